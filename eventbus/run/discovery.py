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
import re
import shlex
import sys
from typing import Optional, Union

from eventbus.checkpoint.naming import CHECKPOINTS, FILENAME, latest_name, latest_path, remote_latest_name
from eventbus.checkpoint.readable import checkpoint_file_problem, shown_checkpoint
from eventbus.core.run_folder import resolve_run_folder
from eventbus.errors import ConfigError
from eventbus.run.config import JobConfig

__all__ = ["RUN_LOCK", "check_run_folder", "latest_checkpoint", "resume_from"]

#: Held (flock) by the ``eventbus run`` training in the folder, for as long as it runs; it stays behind.
RUN_LOCK = ".run.lock"


def check_run_folder(config: JobConfig) -> None:
    """A new run never goes into another run's folder (it would append to that run's journal)."""
    if config.resume or config.run_name is None or int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun, rank 0 made the folder the other ranks share
    folder = resolve_run_folder(config.run_name, runs_dir=config.runs_dir)
    if folder.exists() and any(e.name != RUN_LOCK for e in folder.iterdir()) and not _waiting_daemons_only(folder):
        try:
            latest_checkpoint(config)
            how = f"continue it with --run-name {config.run_name} --resume, or choose a new --run-name"
        except ConfigError:  # stopped before its first checkpoint: --resume would find none
            if latest_path(folder).is_symlink():  # it had one: --resume says what is left and how to load it
                raise ConfigError(f"run {config.run_name!r} already exists in {folder}; its {latest_name()} link "
                                  f"is dangling: --run-name {config.run_name} --resume says how to continue it, "
                                  "or choose a new --run-name") from None
            how = (f"it holds no checkpoint to resume from (it stopped before its first); choose a new --run-name, "
                   f"or remove {folder} to use the name again")
        raise ConfigError(f"run {config.run_name!r} already exists in {folder}; {how}")


# What `eventbus daemons` started before its run makes in the run folder: the daemons' state folder
# (supervisor.daemon_command's --state-dir) holding each one's cursor lock (Cursor.claim), nothing else yet.
_DAEMONS_STATE = ".workers"
_CURSOR_LOCK = ".cursor.json.lock"


def _waiting_daemons_only(folder: pathlib.Path) -> bool:
    """Only daemons waiting for this run were here: their cursors' lock files, no cursor (a daemon writes
    its cursor once it applied a run's message: a run was there then), no journal, metrics or checkpoint."""
    for entry in folder.iterdir():
        if entry.name == RUN_LOCK:
            continue
        if entry.name != _DAEMONS_STATE or entry.is_symlink() or not entry.is_dir():
            return False
        if not all(p.name.endswith(_CURSOR_LOCK) and p.is_file() and not p.is_symlink() for p in entry.iterdir()):
            return False
    return True


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
        if latest.is_symlink():  # dangling: this run has checkpoints, never skipped for an older run's
            raise ConfigError(_dangling(folder.name, latest))
    where = f"run {config.run_name!r}" if config.run_name else f"any run under {runs}"
    also = f" or {_remote_folder(config, '<run>')}/{remote_latest_name()}" if config.save_folder else ""
    raise ConfigError(f"--resume: no checkpoint found for {where} "
                      f"(expected <run>/{CHECKPOINTS}/{latest_name()}{also})")


def _dangling(run_name: str, link: pathlib.Path) -> str:
    """Why a dangling ``latest`` link stops a resume, and how to resume from the newest checkpoint left."""
    target = os.readlink(link)
    return (f"--resume: run {run_name!r}: its latest-checkpoint link {link} is dangling: it points to {target}, "
            f"which does not exist (deleted or moved); {_fallback(link, exclude=link.parent / target)}")


_CHECKPOINT_FILE = re.compile("^" + re.escape(FILENAME).replace(r"\{epoch\}", r"(\d+)").replace(r"\{batch\}", r"(\d+)")
                              .replace(r"\{rank\}", "0") + "$")


def _fallback(link: pathlib.Path, exclude: pathlib.Path) -> str:
    """The newest loadable checkpoint left beside ``link`` (not ``exclude``), and how to resume from it."""
    found = sorted(((int(m[1]), int(m[2]), p) for p in link.parent.iterdir()
                    if (m := _CHECKPOINT_FILE.match(p.name)) and p.is_file() and not p.is_symlink()), reverse=True)
    usable = [p for *_, p in found if os.path.abspath(p) != os.path.abspath(exclude) and
              checkpoint_file_problem(p) is None]
    if not usable:
        return (f"no other checkpoint is left in {link.parent}: nothing to resume from; start a new run "
                "(another --run-name)")
    newest = usable[0]
    return (f"the newest checkpoint left is {newest}: to resume from it, point the link at it "
            f"(ln -sfn {shlex.quote(newest.name)} {shlex.quote(str(link))}) and run with --resume again, "
            f"or load it in Python with Trainer(load_path={str(newest)!r})")


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
    if not isinstance(latest, str):  # checked before anything starts; an older checkpoint is offered
        problem = checkpoint_file_problem(latest)
        if problem is not None:
            raise ConfigError(f"--resume: run {config.run_name!r}: its latest checkpoint {shown_checkpoint(latest)} "
                              f"is not a readable checkpoint: {problem}; {_fallback(latest, latest.resolve())}")
    print(f"eventbus run: resuming {config.run_name} from "
          f"{latest if isinstance(latest, str) else latest.resolve()}", file=sys.stderr, flush=True)
    if not isinstance(latest, str):
        return latest, None
    from eventbus.checkpoint.remote import download, parse_storage_options

    local = download(latest, parse_storage_options(config.storage_options))
    return local, local.parent
