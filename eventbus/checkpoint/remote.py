"""Checkpoint folders at fsspec URLs (``s3://``, ``gs://``, ``file://``...), with retries.

fsspec and the filesystem for the URL's scheme (e.g. s3fs) are optional:
``pip install 'eventbus[s3]'``; tenacity, for the retries, comes with eventbus.
A URL whose filesystem is missing, an unknown scheme, or refused credentials is
a one-line :class:`ConfigError`.
Every remote call is retried with exponential backoff, since object stores
fail transiently (throttling, a dropped connection); errors that retrying
cannot fix (no such file, access denied) fail at once.

Object stores have no symlinks: the ``latest`` link is an object named
``<latest>.symlink`` holding the checkpoint's name, as Composer writes it.

A folder that is not there yet is made by the first upload, on every filesystem:
an object store makes its prefix with the first object (a missing bucket stays an
error: it is never created); a filesystem with real folders (``file://``,
``sftp://``...) gets ``makedirs`` before each upload.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import tempfile
from typing import Any, Callable, Optional, TypeVar

from eventbus.errors import ConfigError

__all__ = ["RemoteFolder", "SYMLINK_SUFFIX", "download", "is_url", "parse_storage_options"]

log = logging.getLogger(__name__)

SYMLINK_SUFFIX = ".symlink"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError,
              NotImplementedError, ConfigError)
T = TypeVar("T")


def is_url(path: Any) -> bool:
    """``path`` names a place through fsspec (it has a ``scheme://``), not a local path."""
    return isinstance(path, str) and _SCHEME.match(path) is not None


def parse_storage_options(pairs: Optional[list[str]]) -> dict[str, Any]:
    """``["endpoint_url=http://...", "anon=false"]`` as fsspec keyword arguments (true/false/numbers parsed)."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"storage option must be KEY=VALUE, got {pair!r}")
        options[key.strip()] = _plain(value.strip())
    return options


def _plain(value: str) -> Any:
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it; ConfigError with the fix when it cannot."""
    scheme = _SCHEME.match(url).group(1) if _SCHEME.match(url) else "file"  # type: ignore[union-attr]
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"{url}: remote checkpoint folders need fsspec: pip install 'eventbus[s3]'") from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as err:  # fsspec knows the scheme, its filesystem package is missing
        raise ConfigError(f"{url}: the {scheme}:// filesystem is not installed ({_first_line(err)}); "
                          f"for s3:// pip install 'eventbus[s3]'") from None
    except ValueError as err:
        raise ConfigError(f"{url}: unknown or bad URL ({_first_line(err)})") from None
    except TypeError as err:
        raise ConfigError(f"{url}: bad storage option ({_first_line(err)})") from None
    return fs, path.rstrip("/")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _retrying(attempts: int, wait: float) -> Any:
    import tenacity  # a dependency of eventbus itself (every tracker retries with it too)

    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(max(1, attempts)),
        wait=tenacity.wait_exponential(multiplier=wait, max=max(wait, 30.0)),
        retry=tenacity.retry_if_exception(lambda err: not isinstance(err, _PERMANENT) and _transient(err)),
        before_sleep=_log_retry,
        reraise=True)


def _log_retry(retry: Any) -> None:
    error = retry.outcome.exception() if retry.outcome is not None else None
    log.warning("remote call failed (attempt %d): %s; retrying", retry.attempt_number,
                _first_line(error) if error is not None else "no result")


def _transient(err: BaseException) -> bool:
    """Not a credentials problem: botocore's NoCredentialsError and friends cannot heal by waiting."""
    return "credential" not in type(err).__name__.lower() and "credential" not in str(err).lower()


class RemoteFolder:
    """One folder at an fsspec URL: put files and small text objects, list, remove; every call retried."""

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]] = None, attempts: int = 5,
                 wait: float = 0.5):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = _filesystem(self.url, self.storage_options)
        self._retry = _retrying(attempts, wait)

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args)`` with retries; a credentials problem becomes a ConfigError naming ``what``."""
        try:
            return self._retry(fn, *args, **kwargs)
        except Exception as err:
            if not _transient(err) or isinstance(err, PermissionError):
                raise ConfigError(f"{self.url}: {what} refused: {_first_line(err)} (check the credentials)") \
                    from None
            raise

    def probe(self) -> None:
        """Reach the folder once, without retries, when a worker starts: refused or missing credentials and
        a missing bucket are a ConfigError then, not at the first upload; an unreachable store is only a
        warning (the uploads retry, and training goes on either way); a missing folder or prefix is fine
        (the first upload makes it). ``fs.info``, not ``fs.exists``: s3fs's ``exists`` answers False for
        a missing bucket and, on a bucket alone, for any error, credentials included."""
        try:
            self._look_up()
        except ConfigError:
            raise
        except Exception as err:
            if not _transient(err) or isinstance(err, PermissionError):
                raise ConfigError(f"{self.url}: access refused: {_first_line(err)} (check the credentials)") \
                    from None
            log.warning("%s is not reachable now (%s); uploads will retry", self.url, _first_line(err))

    def _look_up(self) -> None:
        """``info`` of the folder, then (when it is not there) of its bucket on an object store, whose
        'not found' for a prefix cannot tell a missing bucket from a prefix no upload made yet."""
        try:
            self.fs.info(self.root)
            return
        except FileNotFoundError:
            if not hasattr(self.fs, "split_path"):  # real folders (file://, sftp://): made before each upload
                return
        bucket = str(self.fs.split_path(self.root)[0])
        if not bucket:
            return
        try:
            self.fs.info(bucket)
        except FileNotFoundError:
            raise ConfigError(f"{self.url}: bucket {bucket!r} does not exist (it is never created: check the name "
                              f"and the endpoint)") from None

    def child(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def put(self, local: pathlib.Path, name: str) -> None:
        """Upload a file (or a sharded checkpoint's folder) as ``name``, making the folder if need be."""
        self._make_folder()
        self.call(f"upload of {name}", self.fs.put, str(local), self.child(name), recursive=local.is_dir())

    def _make_folder(self) -> None:
        """The folder, made if missing (and again if removed meanwhile). Object stores (their filesystems
        split paths into bucket and key) have no folders to make, and a missing bucket is a typo or a
        missing permission, not something an upload should create."""
        if not hasattr(self.fs, "split_path"):
            self.call(f"creation of {self.url}", self.fs.makedirs, self.root, exist_ok=True)

    def put_text(self, name: str, text: str) -> None:
        self.call(f"upload of {name}", self.fs.pipe_file, self.child(name), text.encode())

    def remove(self, name: str) -> None:
        try:
            self.call(f"removal of {name}", self.fs.rm, self.child(name), recursive=True)
        except FileNotFoundError:
            pass

    def exists(self, name: str = "") -> bool:
        return bool(self.call(f"lookup of {name or self.url}", self.fs.exists, self.child(name) if name else self.root))

    def read_text(self, name: str, limit: int = 4096) -> str:
        """A small object's text (a ``.symlink``): at most ``limit`` bytes are read, whatever is there."""
        data = bytes(self.call(f"read of {name}", self.fs.cat_file, self.child(name), start=0, end=limit))
        return data.decode(errors="replace")

    def get(self, name: str, local: pathlib.Path) -> None:
        self.call(f"download of {name}", self.fs.get, self.child(name), str(local), recursive=True)


def download(url: str, storage_options: Optional[dict[str, Any]] = None) -> pathlib.Path:
    """Fetch the checkpoint at ``url`` into a fresh temporary folder; a ``.symlink`` object is followed
    (its text names the checkpoint beside it). The caller removes ``result.parent``."""
    parent, _, name = url.rstrip("/").rpartition("/")
    folder = RemoteFolder(parent, storage_options)
    if name.endswith(SYMLINK_SUFFIX):
        name = folder.read_text(name).strip().rpartition("/")[2]  # Composer's holds the object's path
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"{url}: does not name a checkpoint")
    if not folder.exists(name):
        raise ConfigError(f"load_path {folder.url_of(name)!r} does not exist")
    local = pathlib.Path(tempfile.mkdtemp(prefix="eventbus-load-")) / name
    folder.get(name, local)
    os.chmod(local.parent, 0o700)
    return local
