"""Uploads of written checkpoints to a remote folder, on one thread, in save order.

The checkpoint worker writes each checkpoint locally first (atomic, durable),
acknowledges it (the trainer may reuse its buffer), then queues the upload here:
a slow or failing object store delays only this thread, never the worker's
event stream and never training. One thread, first in first out, so a
retention removal queued after an upload runs after it; a checkpoint's remote
copy is not removed while a remote ``latest`` names it (its removal waits until
a newer upload moves ``latest`` on), its local file goes as soon as its upload
is done, and a local file whose upload kept failing is kept, never removed by
retention.

What waits for upload is bounded, for a failing store and for a slow one: at
most ``backlog`` checkpoints that retention let go and whose upload failed, and
at most ``backlog`` that retention let go queued behind a slow upload (the
local folder holds what retention keeps, those, and the one uploading);
beyond that the oldest is dropped (never
uploaded, its local file removed), with an error line and
``checkpoint/upload_backlog_dropped``, so neither the queue nor the local
folder grows with the run.
The oldest goes, not the newest: the newest local checkpoint is what a resume
loads, so writing on (rather than pausing saves until the store heals) keeps a
crash from losing the progress made during the outage. Each upload that works
again retries the waiting ones, oldest first. ``checkpoint/upload_backlog`` says
how many local checkpoints await upload after each result.

A store that is down can take a minute to fail one upload (every attempt and
its backoff). After such a failure, the uploads and remote removals queued in
the next as many seconds are not tried: they wait as failed ones do, so the
queue, retention and the end of the run are never held behind one slow failure
after another (the thread spends at most about half its time on a store that
keeps failing). Remote removals not done meanwhile are retried once the store
works again. At the end, the newest checkpoint still waiting gets one attempt
if the pause kept it from any.
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import shutil
import threading
import time
from typing import Any, Callable, Optional

from eventbus.checkpoint.remote import SYMLINK_SUFFIX, RemoteFolder
from eventbus.errors import ConfigError

__all__ = ["Uploader"]

log = logging.getLogger(__name__)

_STOP = None
# After a failed remote call that took T seconds, the next T seconds' calls wait (at most this long).
MAX_PAUSE_SECONDS = 300.0


class Uploader:
    """Upload and remove checkpoints at remote URLs; ``report(metrics, step)`` hears each result."""

    def __init__(self, storage_options: Optional[dict[str, Any]] = None, attempts: int = 5, wait: float = 0.5,
                 report: Optional[Callable[[dict[str, Any], int], None]] = None, backlog: int = 4):
        if backlog < 0:
            raise ConfigError(f"--upload-backlog must be 0 or more checkpoints, got {backlog}")
        self.storage_options = dict(storage_options or {})
        self.attempts, self.wait = attempts, wait
        self.report = report
        self.backlog = backlog
        self.failed: dict[str, dict[str, Any]] = {}  # local path -> its upload, which gave up; oldest first
        self.released: set[str] = set()  # of those, the ones retention let go: kept only for their upload
        self._folders: dict[str, RemoteFolder] = {}
        self._pending: list[dict[str, Any]] = []  # queued uploads, for the worker's state_dict
        self._paused_until, self._failed_for = 0.0, 0.0  # the store failed slowly: calls before then wait
        self._owed: list[tuple[str, str]] = []  # remote removals not done while the store failed: (url, name)
        self._ending = False  # close() asked to stop: the newest waiting upload had its last chance
        self._newest = ""  # the local path of the newest upload: never dropped
        self._latest = _LatestNames()
        self._lock = threading.Lock()  # _pending, _tasks, and moves between them and ``failed``
        self._wake = threading.Condition(self._lock)
        self._tasks: collections.deque[Optional[dict[str, Any]]] = collections.deque()  # queued, not started
        self._thread: Optional[threading.Thread] = None

    def folder(self, url: str) -> RemoteFolder:
        """The RemoteFolder for ``url`` (made once: checks the URL, imports its filesystem)."""
        if url not in self._folders:
            self._folders[url] = RemoteFolder(url, self.storage_options, self.attempts, self.wait)
        return self._folders[url]

    def upload(self, url: str, local: str, batch: int, latest: Optional[str]) -> None:
        """Queue ``local`` for ``url``, then point ``latest`` (a ``.symlink`` object) at it."""
        self.folder(url)
        task = {"op": "upload", "url": url, "local": local, "batch": batch, "latest": latest, "released": False}
        with self._lock:
            self._pending.append(task)
            self._newest = local
        self._submit(task)

    def remove(self, url: str, local: str) -> None:
        """Retention let ``local`` go: queue the removal of its remote copy (after every upload queued before);
        its local file goes once its upload is done, at once if it is. Beyond ``backlog`` released uploads
        still queued (a slow store), the oldest is dropped."""
        self._start()
        with self._wake:
            self._tasks.append({"op": "remove", "url": url, "local": local})
            self._wake.notify()
            uploads = [task for task in self._pending if task["local"] == local]
            for task in uploads:
                task["released"] = True
            uploaded = not uploads and local not in self.failed
            dropped = self._drop_queued()
        if uploaded:
            _remove_local(pathlib.Path(local))
        for task in dropped:
            _remove_local(pathlib.Path(task["local"]))
            log.error("checkpoint %s dropped without upload: the remote folder is slow and the newest %d released "
                      "checkpoints wait for it instead (--upload-backlog)", task["local"], self.backlog)
            self._report({"checkpoint/upload_backlog_dropped": task["local"]}, int(task["batch"]))

    def _drop_queued(self) -> list[dict[str, Any]]:
        """The oldest released uploads queued (not started) beyond ``backlog``, taken out of the queue (with their
        removal, unless an earlier attempt may have put them there). Called with the lock held."""
        queued = sorted((task for task in self._tasks if task is not None and task["op"] == "upload"
                         and task["released"] and task["local"] != self._newest), key=lambda task: task["batch"])
        dropped = queued[:max(0, len(queued) - self.backlog)]
        if dropped:
            # A first attempt's removal goes with it (nothing was put there); a retried one may have been put.
            unsent = {task["local"] for task in dropped if "tried" not in task}
            self._tasks = collections.deque(
                task for task in self._tasks if task is None or all(task is not other for other in dropped)
                and (task["op"] != "remove" or task["local"] not in unsent or task.get("owed")))
            self._pending = [task for task in self._pending if all(task is not other for other in dropped)]
        return dropped

    def pending(self) -> list[dict[str, Any]]:
        """The uploads queued or running, each with ``released`` when retention let it go."""
        with self._lock:
            return [dict(task) for task in self._pending]

    def waiting(self) -> list[dict[str, Any]]:
        """Every upload not done yet, for the worker's state_dict (a restarted worker queues them again):
        those queued or running, then those that failed and wait for a retry, each with ``released``
        when retention let it go (to be removed once uploaded)."""
        with self._lock:  # an upload moves from pending to failed (and back) under it: listed once, never missed
            pending = [dict(task) for task in self._pending]
            failed, released = dict(self.failed), frozenset(self.released)
        return pending + [{"url": task["url"], "local": path, "batch": task["batch"], "latest": task["latest"],
                                  "released": path in released} for path, task in failed.items()]

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued upload has ended (done or given up, its result reported); False when
        ``timeout`` seconds passed first (they go on in the background)."""
        deadline = time.monotonic() + timeout
        while self.pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def owed(self) -> list[list[str]]:
        """The remote removals not done while the store failed, as ``[url, name]``: for the worker's state."""
        return [list(removal) for removal in list(self._owed)]

    def owe(self, removals: list[list[str]]) -> None:
        """Remote removals a stopped worker owed: done once an upload works (a restarted worker's state)."""
        self._owed.extend((str(entry[0]), str(entry[1])) for entry in removals
                          if isinstance(entry, (list, tuple)) and len(entry) == 2)

    def close(self, timeout: Optional[float] = None, last_chance: bool = True) -> None:
        """Finish what is queued (uploads retry within their own limits), then stop the thread; with
        ``last_chance``, the newest upload the pause kept from any attempt gets one (the run's end)."""
        if self._thread is None:
            return
        self._ending = self._ending or not last_chance
        self._put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("uploads still running after %.0fs; %d not finished (the local files stay)",
                      timeout or 0.0, len(self.pending()))
        self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-uploads", daemon=True)
            self._thread.start()

    def _submit(self, task: dict[str, Any]) -> None:
        self._start()
        self._put(task)

    def _put(self, task: Optional[dict[str, Any]]) -> None:
        with self._wake:
            self._tasks.append(task)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._tasks:
                    self._wake.wait()
                task = self._tasks.popleft()
                empty = not self._tasks
            if task is _STOP:
                if empty and not self._last_chance():
                    return
                self._put(_STOP)  # uploads retried after close() asked to stop: finish them first
                continue
            try:
                (self._upload if task["op"] == "upload" else self._remove)(task)
            except Exception:  # a bug, not a remote failure: log it and go on with the next
                log.exception("checkpoint %s of %s failed", task["op"], task["local"])

    def _upload(self, task: dict[str, Any]) -> None:
        local, folder = pathlib.Path(task["local"]), self.folder(task["url"])
        started = time.perf_counter()
        paused = self._paused() if not task.get("last_chance") else None
        uploaded = False
        try:
            if not local.exists():
                raise FileNotFoundError(f"{local} is gone")
            if paused:
                raise StoreFailing(paused)
            folder.put(local, local.name)
            if task["latest"]:
                folder.put_text(task["latest"] + SYMLINK_SUFFIX, local.name)
                for removal in self._latest.moved(task["url"], task["latest"], local.name):
                    self._put(removal)  # held while the old latest named its checkpoint
        except Exception as err:
            if not paused:
                self._pause_after(started)
            with self._lock:  # out of pending and into failed in one step, as waiting() reads them
                self.failed[str(local)] = dict(task, tried=not paused)
                self._pending = [t for t in self._pending if t is not task]
            log.error("checkpoint %s not uploaded to %s: %s: %s; the local file is kept (%d await upload)", local,
                      folder.url, type(err).__name__, err, len(self.failed))
            self._report({"checkpoint/upload_error": f"{local.name}: {type(err).__name__}: {err}"[:1000],
                          "checkpoint/upload_backlog": len(self.failed)}, task["batch"])
        else:
            self._paused_until = 0.0
            log.info("uploaded checkpoint %s to %s", local, folder.url_of(local.name))
            self.failed.pop(str(local), None)
            self._report({"checkpoint/uploaded/path": folder.url_of(local.name),
                          "checkpoint/uploaded/batch": int(task["batch"]),
                          "checkpoint/uploaded/seconds": time.perf_counter() - started,
                          "checkpoint/upload_backlog": len(self.failed)}, task["batch"])
            uploaded = True
            self._retry_backlog()
        finally:
            with self._lock:
                self._pending = [t for t in self._pending if t is not task]
                uploaded = uploaded and task.get("released", False)  # read with the lock: remove() sets it
            if uploaded:  # retention let it go while it uploaded: its remote copy goes in turn
                _remove_local(local)

    def _paused(self) -> Optional[str]:
        """Why a remote call is not tried now, or None: the store failed slowly a moment ago."""
        left = self._paused_until - time.perf_counter()
        if left <= 0:
            return None
        return f"its last call failed after {self._failed_for:.0f}s; nothing is tried there for {left:.0f}s more"

    def _pause_after(self, started: float) -> None:
        """A remote call that began at ``started`` failed: wait as long as it took before the next."""
        now = time.perf_counter()
        self._failed_for = now - started
        self._paused_until = now + min(self._failed_for, MAX_PAUSE_SECONDS)

    def _last_chance(self) -> bool:
        """At the end: queue the newest waiting upload once more if the pause kept it from any attempt."""
        if self._ending or not self.failed:
            return False
        self._ending = True
        path, task = next(reversed(self.failed.items()))
        if task.get("tried", True) or not pathlib.Path(path).exists():
            return False
        released = path in self.released
        self.released.discard(path)
        self._requeue(path, dict(task, last_chance=True, released=released))
        return True

    def _requeue(self, path: str, task: dict[str, Any]) -> None:
        """A failed upload queued again (out of ``failed`` and into the queue in one step, as remove() sees
        them), followed by its removal when retention had let it go."""
        with self._wake:
            del self.failed[path]
            self._pending.append(task)
            self._tasks.append(task)
            if task["released"]:
                self._tasks.append({"op": "remove", "url": task["url"], "local": path})
            self._wake.notify()

    def _retry_backlog(self) -> None:
        """The store works again: queue the remote removals it missed, then the uploads that gave up,
        oldest first, each followed by its removal when retention had let it go."""
        for url, name in self._owed:
            self._put({"op": "remove", "url": url, "local": name, "owed": True})
        self._owed.clear()
        for path, task in list(self.failed.items()):
            released = path in self.released
            self.released.discard(path)
            if not pathlib.Path(path).exists():
                del self.failed[path]
                continue
            # ``latest`` names the newer one just uploaded
            self._requeue(path, dict(task, latest=None, last_chance=False, released=released))

    def _bound_backlog(self, step: int) -> None:
        """At most ``backlog`` released checkpoints wait for their upload: drop the oldest beyond that."""
        waiting = [path for path in self.failed if path in self.released]
        for path in waiting[:max(0, len(waiting) - self.backlog)]:
            del self.failed[path]
            self.released.discard(path)
            _remove_local(pathlib.Path(path))
            log.error("checkpoint %s dropped without upload: the remote folder keeps failing and the newest %d "
                      "released checkpoints wait for it instead (--upload-backlog)", path, self.backlog)
            self._report({"checkpoint/upload_backlog_dropped": path,
                          "checkpoint/upload_backlog": len(self.failed)}, step)

    def _remove(self, task: dict[str, Any]) -> None:
        local = pathlib.Path(task["local"])
        with self._wake:
            waiting = [upload for upload in self._pending if upload["local"] == task["local"]]
            for upload in waiting:  # a failed upload queued again since retention let it go: remove after it
                upload["released"] = True
            if waiting:
                self._tasks.append(task)
                return
        if not task.get("owed") and self._latest.held(task):  # removed once a newer upload moves latest on
            return
        if str(local) in self.failed:
            log.warning("retention: keeping %s, which was never uploaded", local)
            self.released.add(str(local))
            self._bound_backlog(int(self.failed[str(local)]["batch"]))
            return
        started, paused = time.perf_counter(), self._paused()
        try:
            if paused:
                raise StoreFailing(paused)
            self.folder(task["url"]).remove(local.name)
        except Exception as err:
            if not paused:
                self._pause_after(started)
            again = not task.get("owed")  # an owed removal that fails again is given up
            if again:
                self._owed.append((task["url"], local.name))
            log.error("retention: could not remove %s from %s: %s: %s%s", local.name, task["url"],
                      type(err).__name__, err, "; retried once the remote folder works again" if again else "")
        else:
            log.info("retention: removed checkpoint %s from %s", local.name, task["url"])
        if not task.get("owed"):
            _remove_local(local)

    def _report(self, metrics: dict[str, Any], step: int) -> None:
        if self.report is not None:
            try:
                self.report(metrics, step)
            except Exception as err:  # the run may be over: the log line above says it all
                log.debug("upload result not reported: %s", err)


class _LatestNames:
    """What each remote ``latest`` object names, and the removals held back meanwhile: a resume from the remote
    folder must never find ``latest`` naming a checkpoint that retention removed. Upload thread only."""

    def __init__(self) -> None:
        self._named: dict[tuple[str, str], str] = {}  # (url, a ``latest`` object) -> the checkpoint it names
        self._held: list[dict[str, Any]] = []

    def held(self, removal: dict[str, Any]) -> bool:
        """Hold ``removal`` (True) while a ``latest`` at its URL names its checkpoint."""
        if self._names(removal):
            self._held.append(removal)
            return True
        return False

    def moved(self, url: str, latest: str, name: str) -> list[dict[str, Any]]:
        """``latest`` at ``url`` now names ``name``: the removals no longer held, to run now."""
        self._named[(url, latest)] = name
        free = [removal for removal in self._held if not self._names(removal)]
        self._held = [removal for removal in self._held if self._names(removal)]
        return free

    def _names(self, removal: dict[str, Any]) -> bool:
        return any(url == removal["url"] and name == pathlib.Path(removal["local"]).name
                   for (url, _), name in self._named.items())


class StoreFailing(Exception):
    """A remote call left for later: the store failed slowly a moment ago (its name is in the log line)."""


def _remove_local(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
