"""The one progress-bar factory: every long job shows a tqdm bar unless the user asked for quiet."""
from __future__ import annotations

import os
import stat
import sys

from tqdm.auto import tqdm

FILE_LOG_INTERVAL = 10.0  # seconds between a bar's updates when stderr is a file
# Another interval for a log file that is followed live (the web app's jobs write theirs, which the Runs tab reads)
FILE_LOG_INTERVAL_ENV = "ATTNPAT_FILE_LOG_INTERVAL"


def progress_bar(total: int | None, progress: bool | str, desc: str, unit: str = "ex", **options):
    """A tqdm bar, or None when ``progress`` is falsy. A string ``progress`` replaces the default ``desc``.

    When stderr is a regular file (``2> log``, a batch scheduler's log) the bar updates every FILE_LOG_INTERVAL
    seconds: each update is appended there, not redrawn, and tqdm's 0.1 s default fills the log with thousands.
    A terminal or a pipe keeps the default. FILE_LOG_INTERVAL_ENV, where set to a positive number, replaces
    FILE_LOG_INTERVAL."""
    if not progress:
        return None
    if stderr_is_file():
        options.setdefault("mininterval", file_log_interval())
    return tqdm(total=total, desc=progress if isinstance(progress, str) else desc, unit=unit, dynamic_ncols=True,
                **options)


def stderr_is_file() -> bool:
    try:
        return stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured, closed)
        return False


def file_log_interval() -> float:
    """Seconds between a bar's updates on a log file: FILE_LOG_INTERVAL_ENV's value, else FILE_LOG_INTERVAL."""
    try:
        seconds = float(os.environ.get(FILE_LOG_INTERVAL_ENV, ""))
    except ValueError:
        return FILE_LOG_INTERVAL
    return seconds if 0 < seconds < float("inf") else FILE_LOG_INTERVAL
