"""The one progress-bar factory: every long job shows a tqdm bar unless the user asked for quiet."""
from __future__ import annotations

import os
import stat
import sys

from tqdm.auto import tqdm

FILE_LOG_INTERVAL = 10.0  # seconds between a bar's updates when stderr is a file


def progress_bar(total: int | None, progress: bool | str, desc: str, unit: str = "ex", **options):
    """A tqdm bar, or None when ``progress`` is falsy. A string ``progress`` replaces the default ``desc``.

    When stderr is a regular file (``2> log``, a batch scheduler's log) the bar updates every FILE_LOG_INTERVAL
    seconds: each update is appended there, not redrawn, and tqdm's 0.1 s default fills the log with thousands.
    A terminal or a pipe (the web app's job log reads one) keeps the default."""
    if not progress:
        return None
    if stderr_is_file():
        options.setdefault("mininterval", FILE_LOG_INTERVAL)
    return tqdm(total=total, desc=progress if isinstance(progress, str) else desc, unit=unit, dynamic_ncols=True,
                **options)


def stderr_is_file() -> bool:
    try:
        return stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured, closed)
        return False
