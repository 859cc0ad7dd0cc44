"""Run every benchmark in bench/ one after another (each prints its own figures and targets).

    .venv/bin/python bench/run_all.py            # what `make bench` runs
    .venv/bin/python bench/run_all.py sweeps     # only bench_sweeps.py

Benchmarks are never timed tests: machines are noisy, so each reports ratios measured in one run.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent
    scripts = sorted(here.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in argv]
    failed = []
    for script in scripts:
        print(f"\n=== {script.name}", flush=True)
        if subprocess.call([sys.executable, str(script)], cwd=here.parent) != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
