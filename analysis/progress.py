"""The one progress-bar factory: every long job shows a tqdm bar unless the user asked for quiet."""
from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(total: int | None, progress: bool | str, desc: str, unit: str = "ex", **options):
    """A tqdm bar, or None when ``progress`` is falsy. A string ``progress`` replaces the default ``desc``."""
    if not progress:
        return None
    return tqdm(total=total, desc=progress if isinstance(progress, str) else desc, unit=unit, dynamic_ncols=True,
                **options)
