"""The main job behind ``eventbus run``: train the bundled character model end to end."""

from __future__ import annotations

import argparse
import pathlib
import time
from typing import Any, Optional

import torch

from eventbus.callback import Callback
from eventbus.demo import CharLM, CharLMConfig, make_dataloaders
from eventbus.logger import ConsoleLogger, Logger
from eventbus.state import State
from eventbus.trainer import Trainer

__all__ = ["add_run_arguments", "run_job"]


class EpochPrinter(Callback):
    """The printing callback from Composer's documentation."""

    def epoch_start(self, state: State, logger: Logger) -> None:
        print(f"Epoch: {int(state.timestamp.epoch)}", flush=True)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-duration", default="2ep", help="how long to train: '2ep', '500ba', ... (default: 2ep)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per batch (default: 32)")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence (default: 64)")
    parser.add_argument("--d-model", type=int, default=64, help="model width (default: 64)")
    parser.add_argument("--layers", type=int, default=2, help="Transformer layers (default: 2)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--device", default=None, help="cpu, gpu or cuda:N (default: gpu when available)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "amp_bf16"])
    parser.add_argument("--eval-interval", default="1ep", help="when to evaluate (default: 1ep)")
    parser.add_argument("--log-interval", default="50ba", help="console progress interval (default: 50ba)")
    parser.add_argument("--run-name", default=None, help="name of the run folder under --runs-dir")
    parser.add_argument("--runs-dir", default="runs", type=pathlib.Path, help="where run folders go (default: runs)")
    parser.add_argument("--seed", type=int, default=17)


def run_job(args: argparse.Namespace) -> int:
    """Build the trainer from parsed arguments, train, and say where the results are."""
    config = CharLMConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers)
    torch.manual_seed(args.seed)
    train_loader, eval_loader, vocab_size = make_dataloaders(config, args.batch_size)
    model = CharLM(vocab_size, config)
    trainer = Trainer(
        model,
        train_loader,
        max_duration=args.max_duration,
        eval_dataloader=eval_loader,
        eval_interval=args.eval_interval,
        optimizers=torch.optim.AdamW(model.parameters(), lr=args.lr),
        callbacks=[EpochPrinter()],
        loggers=[ConsoleLogger(args.log_interval)],
        run_name=args.run_name,
        seed=args.seed,
        device=args.device,
        precision=args.precision,
    )
    run_folder = args.runs_dir / trainer.state.run_name
    run_folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        trainer.fit()
    finally:
        trainer.close()
    checkpoint = run_folder / "final.pt"
    torch.save(trainer.state_dict(), checkpoint)
    ts = trainer.state.timestamp
    values: dict[str, Any] = trainer.state.eval_metric_values.get("eval", {})
    summary = ", ".join(f"{name} {float(value):.4f}" for name, value in values.items())
    print(
        f"\nTrained {ts.batch.value} batches ({ts.sample.value} samples, {ts.token.value} tokens) "
        f"in {time.perf_counter() - started:.1f}s. Eval: {summary or 'none'}.\n"
        f"Final state: {checkpoint}  (resume with Trainer(load_path=...))",
        flush=True,
    )
    return 0


