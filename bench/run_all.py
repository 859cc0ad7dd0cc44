"""Run every benchmark in bench/ (the bench_*.py scripts) one after another; each prints its own figures and
targets. bench/recipe_sweep.py, a training-recipe sweep of an hour or more, runs only on its own.

    .venv/bin/python bench/run_all.py                      # what `make bench` runs
    .venv/bin/python bench/run_all.py sweeps               # only bench_sweeps.py
    .venv/bin/python bench/run_all.py --out bench-results  # also bench-results/<name>.json, one per benchmark

Benchmarks are never timed tests: machines are noisy, so each reports ratios measured in one run.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent
    scripts = sorted(here.glob("bench_*.py"))
    names = [script.stem.removeprefix("bench_") for script in scripts]
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip() + f"\n\nbenchmarks: {', '.join(names)}")
        return 0
    out = None
    if "--out" in argv:
        at = argv.index("--out")
        if at + 1 >= len(argv) or argv[at + 1].startswith("-"):
            return usage_error("--out takes a folder (each benchmark writes <folder>/<name>.json)")
        out = Path(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
        if out.exists() and not out.is_dir():
            return usage_error(f"--out {out} is a file, not a folder")
    unknown = [name for name in argv if name not in names]
    if unknown:  # a typo would otherwise run nothing and exit 0
        return usage_error(f"unknown benchmark {', '.join(unknown)} (benchmarks: {', '.join(names)})")
    if argv:
        scripts = [script for script, name in zip(scripts, names, strict=True) if name in argv]
    if out:
        out.mkdir(parents=True, exist_ok=True)
    failed = []
    for script in scripts:
        print(f"\n=== {script.name}", flush=True)
        # each script writes its --json atomically: a benchmark stopped part-way leaves no half file
        results = ["--json", str((out / f"{script.stem.removeprefix('bench_')}.json").absolute())] if out else []
        if subprocess.call([sys.executable, str(script), *results], cwd=here.parent) != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
