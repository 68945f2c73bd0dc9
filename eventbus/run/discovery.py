"""Finding the run ``eventbus run`` trains: a free folder for a new run, or the run to resume and its
latest checkpoint.

The latest checkpoint is the run folder's ``latest`` link, else (with a remote save
folder) the ``.symlink`` object there, as Composer's autoresume looks; the names are
:mod:`eventbus.checkpoint.naming`'s. A remote checkpoint is downloaded into a
temporary folder that the caller removes once it is loaded.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Optional, Union

from eventbus.checkpoint.naming import CHECKPOINTS, latest_name, latest_path, remote_latest_name
from eventbus.core.run_folder import resolve_run_folder
from eventbus.errors import ConfigError
from eventbus.run.config import JobConfig

__all__ = ["check_run_folder", "latest_checkpoint", "resume_from"]


def check_run_folder(config: JobConfig) -> None:
    """A new run never goes into another run's folder (it would append to that run's journal)."""
    if config.resume or config.run_name is None or int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun, rank 0 made the folder the other ranks share
    folder = resolve_run_folder(config.run_name, runs_dir=config.runs_dir)
    if folder.exists() and any(folder.iterdir()):
        try:
            latest_checkpoint(config)
            how = f"continue it with --run-name {config.run_name} --resume, or choose a new --run-name"
        except ConfigError:  # stopped before its first checkpoint: --resume would find none
            how = (f"it holds no checkpoint to resume from (it stopped before its first); choose a new --run-name, "
                   f"or remove {folder} to use the name again")
        raise ConfigError(f"run {config.run_name!r} already exists in {folder}; {how}")


def latest_checkpoint(config: JobConfig) -> tuple[str, Union[str, pathlib.Path]]:
    """The run to resume (``config.run_name``, else the newest run folder holding a checkpoint) and its
    latest checkpoint: a local path, or the URL of the remote ``.symlink`` object."""
    runs = pathlib.Path(config.runs_dir)
    candidates = ([runs / config.run_name] if config.run_name else
                  sorted((p for p in runs.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True))
    for folder in candidates:
        latest = latest_path(folder)
        if latest.exists():
            return folder.name, latest
        remote = _remote_latest(config, folder.name)
        if remote is not None:
            return folder.name, remote
    where = f"run {config.run_name!r}" if config.run_name else f"any run under {runs}"
    also = f" or {_remote_folder(config, '<run>')}/{remote_latest_name()}" if config.save_folder else ""
    raise ConfigError(f"--resume: no checkpoint found for {where} "
                      f"(expected <run>/{CHECKPOINTS}/{latest_name()}{also})")


def _remote_folder(config: JobConfig, run_name: str) -> str:
    assert config.save_folder is not None
    return config.save_folder.replace("{run_name}", run_name).replace("{rank}", "0").rstrip("/")


def _remote_latest(config: JobConfig, run_name: str) -> Optional[str]:
    """The URL of run ``run_name``'s latest checkpoint in the remote save folder, if there is one."""
    if config.save_folder is None:
        return None
    from eventbus.checkpoint.remote import RemoteFolder, parse_storage_options

    folder = RemoteFolder(_remote_folder(config, run_name), parse_storage_options(config.storage_options))
    link = remote_latest_name()
    try:
        found = folder.exists(link)
    except ConfigError:
        raise
    except Exception as err:  # retried already: the store is unreachable
        raise ConfigError(f"--resume: cannot reach {folder.url}: {type(err).__name__}: {err}") from None
    return folder.url_of(link) if found else None


def resume_from(config: JobConfig) -> tuple[pathlib.Path, Optional[pathlib.Path]]:
    """The latest checkpoint of the run to resume (``config.run_name`` is set to that run), as a local
    file, and the temporary folder it was downloaded into when it is in the remote save folder (the
    caller removes it once it is loaded)."""
    config.run_name, latest = latest_checkpoint(config)
    print(f"eventbus run: resuming {config.run_name} from "
          f"{latest if isinstance(latest, str) else latest.resolve()}", file=sys.stderr, flush=True)
    if not isinstance(latest, str):
        return latest, None
    from eventbus.checkpoint.remote import download, parse_storage_options

    local = download(latest, parse_storage_options(config.storage_options))
    return local, local.parent
