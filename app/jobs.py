"""Batch jobs for the Runs tab: whitelisted `attnpat <verb>` subprocesses (argument lists, never a shell),
one at a time, with their log as it grows."""
from __future__ import annotations

import atexit
import codecs
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from analysis.data import ALL_TASKS, check_split, check_task, is_data_file
from analysis.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, AttnpatError

# Verbs the Runs tab may start (only those the installed CLI really has are offered); verbs that need
# more than model, task and n (compare, probe-dep, train) are left to the command line.
JOB_VERBS = ("overview", "extract", "classify", "special", "disable", "importance", "prune", "surface",
             "grad-importance", "cluster", "probe-coref", "finetune")
JOB_OPTIONS = ("model", "task", "n", "split", "runs_dir")
MODEL_NAME = re.compile(r"^[\w./~][\w.\-/~]{0,299}$")  # argument lists, no shell: only a leading "-" is refused
# A job's environment names the app's pid: the job watches it and stops when the app is gone (end_with_parent).
JOB_PARENT_ENV = "ATTNPAT_JOB_PARENT_PID"
PARENT_POLL_SECONDS = 0.5
ORPHAN_GRACE_SECONDS = 10.0  # after its SIGTERM, an orphaned job gets this long to clean up before it exits at once


def cli_verbs() -> dict[str, set[str]]:
    """Whitelisted verbs the installed CLI has, each with the job options its callback accepts."""
    # imported here on purpose: app.cli imports this module (through the `app` verb)
    from app.cli import app as cli_app  # noqa: PLC0415

    found = {}
    for command in cli_app.registered_commands:
        name = command.name or (command.callback.__name__ if command.callback else None)
        if name in JOB_VERBS and command.callback is not None:
            accepted = set(inspect.signature(command.callback).parameters)
            found[name] = accepted & set(JOB_OPTIONS)
    return {verb: found[verb] for verb in JOB_VERBS if verb in found}


@dataclass
class Job:
    """One `attnpat <verb>` subprocess and its log (tqdm's carriage-return updates overwrite the last line)."""

    argv: list[str]
    process: subprocess.Popen
    started: float = field(default_factory=time.time)
    lines: list[str] = field(default_factory=lambda: [""])
    finished: float | None = None
    stop_requested: bool = False  # set by BatchJobs.stop: a SIGKILL after its SIGTERM is the Stop's, not a crash

    def log_text(self, tail: int = 60) -> str:
        return "\n".join(self.lines[-tail:]).strip("\n")

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def status(self) -> str:
        command = " ".join(["attnpat", *self.argv])
        code = self.returncode
        if code is None:
            return f"running for {time.time() - self.started:.0f} s: `{command}`"
        if code == 0:
            return f"finished in {(self.finished or time.time()) - self.started:.0f} s: `{command}`"
        if self.stopped:
            number = -code if code < 0 else {TERMINATED_EXIT: signal.SIGTERM, INTERRUPTED_EXIT: signal.SIGINT}[code]
            return f"stopped (signal {number}): `{command}`"
        if code < 0:  # killed by the system: the log ends without a word, so the status says what happened
            why = ", SIGKILL: out of memory?" if -code == signal.SIGKILL else ""
            return f"failed (killed by signal {-code}{why}): `{command}`; see the log"
        return f"failed (exit status {code}): `{command}`; see the log"

    @property
    def stopped(self) -> bool:
        """Stopped: by SIGTERM or Ctrl-C (after cleaning up: app.cli's exit codes; or before its handler was set),
        or killed after the app's Stop. Any other signal (the out-of-memory killer's SIGKILL, a segfault) failed."""
        code = self.returncode
        if code is None:
            return False
        return code in (TERMINATED_EXIT, INTERRUPTED_EXIT) or -code in (signal.SIGTERM, signal.SIGINT) or (
            code < 0 and self.stop_requested)


class BatchJobs:
    """Starts whitelisted `attnpat` verbs as subprocesses (argument lists, never a shell); one at a time."""

    def __init__(self, runs_dir: Path, allowed_models: Callable[[], Iterable[str]] | None = None):
        self.runs_dir = runs_dir
        self.allowed_models = allowed_models  # None: any model name; else the names a job may use
        self.job: Job | None = None
        self._lock = threading.Lock()
        atexit.register(self.stop)  # no orphaned job when the app stops (rerunning the job resumes it)

    def arguments(self, verb: str, model: str, task: str, n, split: str = "validation") -> list[str]:
        verbs = cli_verbs()
        if verb not in verbs:
            raise AttnpatError(f"unknown job {verb!r}; choose one of: {', '.join(verbs) or 'none installed'}")
        model = (model or "").strip()
        if not MODEL_NAME.match(model):
            raise AttnpatError(f"not a model name: {model!r} (use minilm, a model-store name or a hub id)")
        if self.allowed_models is not None and model not in (offered := list(self.allowed_models())):
            raise AttnpatError(f"model {ascii(model[:100])} is not one this app offers ({', '.join(offered)}); start "
                               "it with `attnpat app --allow-any-model` to run jobs on any model")
        task = str(task or "")
        if is_data_file(task):  # a path on the server, which a client could point anywhere (as a model path)
            raise AttnpatError(f"a batch job runs a built-in task ({', '.join(ALL_TASKS)}), not a data file; run "
                               f"`attnpat {verb} --task FILE` in a terminal for {ascii(task[:100])}")
        task, split = check_task(task), check_split(split)
        try:
            count = int(n)
        except (TypeError, ValueError, OverflowError):  # OverflowError: infinity
            raise AttnpatError(f"the number of examples must be a whole number, got {n!r}") from None
        if not 1 <= count <= 1_000_000 or count != float(n):
            raise AttnpatError(f"the number of examples must be a whole number from 1 to 1000000, got {n}")
        values = {"model": model, "task": task, "n": str(count), "split": split, "runs_dir": str(self.runs_dir)}
        argv = [verb]
        for option in JOB_OPTIONS:
            if option in verbs[verb]:
                argv += [f"--{option.replace('_', '-')}", values[option]]
        return argv

    def start(self, verb: str, model: str, task: str, n) -> Job:
        argv = self.arguments(verb, model, task, n)
        with self._lock:
            if self.job is not None and self.job.returncode is None:
                raise AttnpatError(f"a job is already running ({self.job.status()}); wait for it or stop it")
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False",
                   JOB_PARENT_ENV: str(os.getpid())}
            process = subprocess.Popen([sys.executable, "-m", "app.cli", *argv], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            self.job = Job(argv, process)
            threading.Thread(target=self._read, args=(self.job,), daemon=True).start()
            return self.job

    @staticmethod
    def _read(job: Job) -> None:
        stream = job.process.stdout
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two reads
        while chunk := stream.read1(4096):
            for piece in re.split(r"(\r|\n)", decoder.decode(chunk)):
                if piece == "\n":
                    job.lines.append("")
                elif piece == "\r":
                    job.lines[-1] = ""
                else:
                    job.lines[-1] += piece
            del job.lines[:-500]
        job.process.wait()
        job.finished = time.time()

    def stop(self) -> str:
        with self._lock:
            if self.job is None or self.job.returncode is not None:
                return "no job is running"
            self.job.stop_requested = True
            self.job.process.terminate()
            try:
                self.job.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.job.process.kill()
            return "job stopped (resumable verbs continue where they stopped when rerun)"


# ---------------------------------------------------------------- in the job's own process

def end_with_parent(environ=os.environ) -> threading.Thread | None:
    """In a job's process (app.cli.main): when the app that started it dies, even by SIGKILL (which runs no
    atexit, so no Stop), stop as the app's Stop would: SIGTERM to itself, so the verb cleans up and a rerun
    resumes; still alive ORPHAN_GRACE_SECONDS later, exit at once. None when this process is not a job.

    The app's pid is taken out of the environment, so the job's own `attnpat` subprocesses do not watch it.
    Not PR_SET_PDEATHSIG: Linux ties it to the thread that started the job, a Gradio worker thread that ends
    when idle (the job would be killed with it), and setting it needs preexec_fn, unsafe in a threaded app."""
    value = environ.pop(JOB_PARENT_ENV, "")
    if not value.isdigit():
        return None
    watcher = threading.Thread(target=_stop_when_orphaned, args=(int(value),), name="end-with-parent", daemon=True)
    watcher.start()
    return watcher


def parent_gone(parent_pid: int) -> bool:
    """Whether the process that started this one has died: an orphan is re-parented (to init or a subreaper),
    so its parent pid changes; a parent that died before this check is caught too."""
    return os.getppid() != parent_pid


def _stop_when_orphaned(parent_pid: int) -> None:
    while not parent_gone(parent_pid):
        time.sleep(PARENT_POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_SECONDS)
    os._exit(TERMINATED_EXIT)
