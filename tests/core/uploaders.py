"""Callbacks that upload files, for the artifacts tests (importable by a worker subprocess)."""

from __future__ import annotations

import json
import pathlib

from eventbus import Callback


class Uploader(Callback):
    """At FIT_END uploads one small file under each name in ``names`` and records, per name, the
    error it got (None when the upload call returned)."""

    def __init__(self, source: str, names: list[str], report: str):
        self.source, self.names, self.report = source, names, report

    def fit_end(self, state, logger):
        errors = {}
        for name in self.names:
            try:
                logger.upload_file(name, self.source, overwrite=True)
                errors[name] = None
            except Exception as err:  # recorded for the test: an upload must not raise to the callback
                errors[name] = f"{type(err).__name__}: {err}"
        pathlib.Path(self.report).write_text(json.dumps(errors))
