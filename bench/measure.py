"""What the bench_*.py scripts share: a process's own peak memory, a ratio's spread over repeats, and their
summary file and error exit.

Not a benchmark itself (bench/run_all.py runs only bench_*.py). The scripts import it as a sibling module, as
Python puts a script's own folder first on sys.path.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def peak_rss_mib(pid: int | str = "self") -> float:
    """Peak resident memory of a local process since its program started (VmHWM), in MiB.

    Not ``getrusage(...).ru_maxrss``: Linux carries the parent's peak into a child's at exec, so a fresh process
    started by a 1 GB one reports at least 1 GB whatever it does. VmHWM belongs to the address space exec makes.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ratio_spread(numerators: Sequence[float], denominators: Sequence[float]) -> dict:
    """Median and range of the paired ratios numerators[i] / denominators[i], i over the repeats of one run.

    numerators, denominators: (repeats,) timings taken in alternation, so each pair saw the same machine load.
    Returns {"median", "low", "high", "repeats"}, the ratios rounded to 3 decimals.
    """
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"paired timings needed, got {len(numerators)} and {len(denominators)}")
    ratios = [top / bottom for top, bottom in zip(numerators, denominators, strict=True)]
    return {"median": round(statistics.median(ratios), 3), "low": round(min(ratios), 3),
            "high": round(max(ratios), 3), "repeats": len(ratios)}


def spread_text(spread: dict, unit: str = "x") -> str:
    """'1.33x (range 1.30-1.41 over 5 repeats)' for a :func:`ratio_spread` result."""
    return (f"{spread['median']:.2f}{unit} (range {spread['low']:.2f}-{spread['high']:.2f} over "
            f"{spread['repeats']} repeat{'s' if spread['repeats'] != 1 else ''})")


def write_summary(path: str | Path | None, summary: dict) -> None:
    """The benchmark's summary as indented JSON at ``path`` (--json), written whole or not at all; None: no file."""
    from analysis.rundir import atomic_write_text  # noqa: PLC0415 (the scripts put the repository on sys.path first)

    if path:
        atomic_write_text(path, json.dumps(summary, indent=2) + "\n")


def run_script(main: Callable[[], object]) -> None:
    """Run a benchmark's main(): bad options or input (AttnpatError) end in one `error:` line and exit 2."""
    from analysis.errors import AttnpatError  # noqa: PLC0415 (as above)

    try:
        main()
    except AttnpatError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
