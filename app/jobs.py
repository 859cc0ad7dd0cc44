"""Batch jobs for the Runs tab: whitelisted `attnpat <verb>` subprocesses (argument lists, never a shell),
one at a time per runs folder, with their log as it grows.

Each job's state (argv, pid, start, exit status once it ends) is kept in <runs>/.jobs/current.json and its log in
<runs>/.jobs/<id>.log, so a restarted app, or a second app on the same runs folder, shows the last job and
refuses to start another beside a running one. The job writes its output straight into its log file, so what it
printed is there whatever is killed (the app or the job, even by SIGKILL), and the app shows the file's tail."""
from __future__ import annotations

import atexit
import inspect
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from analysis.data import ALL_TASKS, check_split, check_task, is_data_file
from analysis.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, AttnpatError, os_error_message, quoted
from analysis.progress import FILE_LOG_INTERVAL_ENV
from analysis.rundir import atomic_write_json, locked, read_json

log = logging.getLogger(__name__)

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
JOBS_FOLDER = ".jobs"  # in the runs folder: current.json (the last job's state) and the last few jobs' logs
STATE_FILE = "current.json"
KEEP_JOB_LOGS = 5
LOG_TAIL_BYTES = 64 * 1024  # enough for 60 lines; a progress bar's redraws are cut at the first full line
# A job's progress bars redraw into its log file this often (seconds): as often as the Runs tab reads it, not
# every FILE_LOG_INTERVAL s as in a terminal's `2> log`, nor at tqdm's 0.1 s, which would swell the file
JOB_PROGRESS_INTERVAL = 0.5
STATE_FIELDS = {"id": str, "argv": list, "pid": int, "started": (int, float), "log": str, "app_pid": int}


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


def add_output(lines: list[str], text: str) -> None:
    """Append decoded output ``text`` to ``lines`` as a terminal shows it: a newline starts a line, a carriage
    return (tqdm's redraw) clears the last one."""
    for piece in re.split(r"(\r|\n)", text):
        if piece == "\n":
            lines.append("")
        elif piece == "\r":
            lines[-1] = ""
        else:
            lines[-1] += piece


def log_file_tail(path: Path, tail: int = 60) -> str:
    """The last ``tail`` lines of a job's log file as the job's log shows them ("" when there is none yet)."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - LOG_TAIL_BYTES))
            data = handle.read()
    except OSError:
        return ""
    lines = [""]
    add_output(lines, data.decode("utf-8", errors="replace"))
    if size > LOG_TAIL_BYTES:
        lines = lines[1:]  # the read began inside a line
    return "\n".join(lines[-tail:]).strip("\n")


def ending(command: str, code: int, stopped: bool, took: str) -> str:
    """How a job that ended reads: ``took`` says when or how long (e.g. "in 12 s")."""
    if code == 0:
        return f"finished (exit 0) {took}: `{command}`"
    if stopped:
        number = -code if code < 0 else {TERMINATED_EXIT: signal.SIGTERM, INTERRUPTED_EXIT: signal.SIGINT}[code]
        return f"stopped (signal {number}) {took}: `{command}`"
    if code < 0:  # killed by the system: the log ends without a word, so the status says what happened
        why = ", SIGKILL: out of memory?" if -code == signal.SIGKILL else ""
        return f"failed (killed by signal {-code}{why}) {took}: `{command}`; see the log"
    return f"failed (exit status {code}) {took}: `{command}`; see the log"


def was_stopped(code: int | None, stop_requested: bool) -> bool:
    """Stopped: by SIGTERM or Ctrl-C (after cleaning up: app.cli's exit codes; or before its handler was set),
    or killed after the app's Stop. Any other signal (the out-of-memory killer's SIGKILL, a segfault) failed."""
    if code is None:
        return False
    return code in (TERMINATED_EXIT, INTERRUPTED_EXIT) or -code in (signal.SIGTERM, signal.SIGINT) or (
        code < 0 and stop_requested)


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22): with the pid it names one
    process, since pids are reused. None when no such process runs (a zombie, dead but not reaped, does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def boot_id() -> str | None:
    """This boot's id (Linux; None elsewhere): start ticks count from boot, so a process is named by pid, start
    ticks and boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def is_running(pid: int, start_ticks: int | None, boot: str | None = None) -> bool:
    """Whether the process that had ``pid`` and started at ``start_ticks`` during boot ``boot`` (None: not
    recorded) still runs (not a later one given the same pid, after a reboot too). Without /proc (not Linux) the
    pid alone is checked."""
    if boot is not None and boot != boot_id():  # recorded before a reboot: every process of then is gone
        return False
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: the pid runs
            pass
        return True
    return start_ticks is not None and process_start_ticks(pid) == start_ticks


def _clock(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


@dataclass
class Job:
    """This app's `attnpat <verb>` subprocess, which writes its output into ``log_path`` (tqdm's carriage-return
    updates overwrite the last line when it is shown)."""

    argv: list[str]
    process: subprocess.Popen
    started: float = field(default_factory=time.time)
    finished: float | None = None
    stop_requested: bool = False  # set by BatchJobs.stop: a SIGKILL after its SIGTERM is the Stop's, not a crash
    id: str = ""
    log_path: Path | None = None

    def log_text(self, tail: int = 60) -> str:
        return log_file_tail(self.log_path, tail) if self.log_path else ""

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def is_running(self) -> bool:
        """True until the process ended and this app took note of how (:meth:`BatchJobs._wait`)."""
        return self.returncode is None or self.finished is None

    def status(self) -> str:
        command = " ".join(["attnpat", *self.argv])
        code = self.returncode
        if code is None:
            return f"running for {time.time() - self.started:.0f} s (pid {self.process.pid}): `{command}`"
        return ending(command, code, self.stopped, f"in {(self.finished or time.time()) - self.started:.0f} s")

    @property
    def stopped(self) -> bool:
        return was_stopped(self.returncode, self.stop_requested)

    def state(self) -> dict:
        """What <runs>/.jobs/current.json holds for this job."""
        state = {"id": self.id, "argv": self.argv, "pid": self.process.pid,
                 "pid_start": process_start_ticks(self.process.pid), "started": self.started,
                 "log": self.log_path.name if self.log_path else "", "app_pid": os.getpid(),
                 "app_start": process_start_ticks(os.getpid()), "boot": boot_id()}
        return {**state, **self.end_state()} if self.returncode is not None else state

    def end_state(self) -> dict:
        """How the job ended, for its state file (once its process ended)."""
        return {"returncode": self.returncode, "finished": self.finished or time.time(),
                "stop_requested": self.stop_requested}


class RecordedJob:
    """The last job as <runs>/.jobs/current.json records it: another app's (a second app on the same runs folder,
    or the one before a restart). Each is_running() reads the state file again."""

    def __init__(self, folder: Path, state: dict):
        self.folder = folder
        self.state = state

    @property
    def argv(self) -> list[str]:
        return [str(part) for part in self.state["argv"]]

    @property
    def returncode(self) -> int | None:
        code = self.state.get("returncode")
        return code if isinstance(code, int) else None

    @property
    def stopped(self) -> bool:
        """A recorded stop, or a job whose app ended before it could record how the job ended."""
        if self.returncode is None:
            return not self.process_alive()
        return was_stopped(self.returncode, bool(self.state.get("stop_requested")))

    def process_alive(self) -> bool:
        return is_running(self.state["pid"], self.state.get("pid_start"), self.state.get("boot"))

    def _app_alive(self) -> bool:
        return is_running(self.state["app_pid"], self.state.get("app_start"), self.state.get("boot"))

    def is_running(self) -> bool:
        """Running, or ended a moment ago while its app, still running, has yet to record the exit status."""
        latest = read_job_state(self.folder)
        if latest is not None and latest["id"] == self.state["id"]:
            self.state = latest
        return self.returncode is None and (self.process_alive() or self._app_alive())

    def log_text(self, tail: int = 60) -> str:
        return log_file_tail(self.folder / Path(self.state["log"]).name, tail) if self.state["log"] else ""

    def status(self) -> str:
        command = " ".join(["attnpat", *self.argv])
        code = self.returncode
        if code is not None:
            return ending(command, code, self.stopped, f"at {_clock(self.state.get('finished') or 0)}")
        if self.process_alive():
            return (f"running (pid {self.state['pid']}, started {_clock(self.state['started'])}, by the app with "
                    f"pid {self.state['app_pid']}): `{command}`")
        if self._app_alive():
            return f"ending (pid {self.state['pid']}): `{command}`"
        return f"stopped: the app that ran it ended before it finished; rerun it to resume: `{command}`"


def read_job_state(folder: Path) -> dict | None:
    """<runs>/.jobs/current.json, or None when there is none. A damaged one (only attnpat writes it) is taken as
    none, with a warning: the next job replaces it."""
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = read_json(path, "the batch job state", "the next job replaces it")
    except AttnpatError as exc:
        log.warning("%s", exc)
        return None
    if not isinstance(state, dict) or not all(isinstance(state.get(key), kind) for key, kind in STATE_FIELDS.items()):
        log.warning("the batch job state %s lacks a field; the next job replaces it", path)
        return None
    return state


def prune_logs(folder: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` job logs in ``folder``."""
    logs = sorted(folder.glob("*.log"), key=lambda path: (path.stat().st_mtime, path.name))
    for old in logs[:max(0, len(logs) - keep)]:
        old.unlink(missing_ok=True)


class BatchJobs:
    """Starts whitelisted `attnpat` verbs as subprocesses (argument lists, never a shell); one at a time per runs
    folder, also across apps: the state of the last job is kept in <runs>/.jobs/."""

    def __init__(self, runs_dir: Path, allowed_models: Callable[[], Iterable[str]] | None = None):
        self.runs_dir = runs_dir
        self.folder = Path(runs_dir) / JOBS_FOLDER
        self.allowed_models = allowed_models  # None: any model name; else the names a job may use
        self.job: Job | None = None
        self._lock = threading.Lock()
        atexit.register(self.stop)  # no orphaned job when the app stops (rerunning the job resumes it)

    def _state_locked(self) -> AbstractContextManager[None]:
        """Held to read-and-write the job state: two apps starting a job at once cannot both start it."""
        return locked(self.folder / ".lock", f"the batch job state in {self.folder}", wait=True)

    def current(self) -> Job | RecordedJob | None:
        """The last job started on this runs folder: this app's own, or another's as recorded (None: no job)."""
        state = read_job_state(self.folder)
        if self.job is not None and (state is None or state["id"] == self.job.id):
            return self.job
        return RecordedJob(self.folder, state) if state is not None else None

    def arguments(self, verb: str, model: str, task: str, n, split: str = "validation") -> list[str]:
        verbs = cli_verbs()
        if not isinstance(verb, str) or verb not in verbs:
            raise AttnpatError(f"unknown job {quoted(verb)}; choose one of: {', '.join(verbs) or 'none installed'}")
        if not isinstance(model, str | None):  # the API may send any JSON value
            raise AttnpatError(f"not a model name: {quoted(model)} (use minilm, a model-store name or a hub id)")
        model = (model or "").strip()
        if not MODEL_NAME.match(model):
            raise AttnpatError(f"not a model name: {quoted(model)} (use minilm, a model-store name or a hub id)")
        if self.allowed_models is not None and model not in (offered := list(self.allowed_models())):
            raise AttnpatError(f"model {ascii(model[:100])} is not one this app offers ({', '.join(offered)}); start "
                               "it with `attnpat app --allow-any-model` to run jobs on any model")
        task = str(task or "")
        if is_data_file(task):  # a path on the server, which a client could point anywhere (as a model path)
            raise AttnpatError(f"a batch job runs a built-in task ({', '.join(ALL_TASKS)}), not a data file; run "
                               f"`attnpat {verb} --task FILE` in a terminal for {ascii(task[:100])}")
        task, split = check_task(task), check_split(split)
        try:
            if isinstance(n, bool):  # JSON true through the API: int(True) would run 1 example
                raise TypeError
            count = int(n)
        except (TypeError, ValueError, OverflowError):  # OverflowError: infinity
            raise AttnpatError(f"the number of examples must be a whole number, got {quoted(n)}") from None
        if not 1 <= count <= 1_000_000 or count != float(n):
            raise AttnpatError(f"the number of examples must be a whole number from 1 to 1000000, got {quoted(n)}")
        values = {"model": model, "task": task, "n": str(count), "split": split, "runs_dir": str(self.runs_dir)}
        argv = [verb]
        for option in JOB_OPTIONS:
            if option in verbs[verb]:
                argv += [f"--{option.replace('_', '-')}", values[option]]
        return argv

    def start(self, verb: str, model: str, task: str, n) -> Job:
        argv = self.arguments(verb, model, task, n)
        with self._lock, self._state_locked():
            if self.job is not None and self.job.returncode is None:
                raise AttnpatError(f"a job is already running ({self.job.status()}); wait for it or stop it")
            last = self.current()
            if isinstance(last, RecordedJob) and last.process_alive():
                raise AttnpatError(f"a job of another attnpat app is already running on {self.runs_dir} "
                                   f"({last.status()}); wait for it or stop it")
            job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
            log_path = self.folder / f"{job_id}.log"
            try:
                prune_logs(self.folder, KEEP_JOB_LOGS - 1)
                log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            except OSError as exc:
                raise AttnpatError(os_error_message(exc, "cannot write the job log")) from exc
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False",
                   JOB_PARENT_ENV: str(os.getpid()), FILE_LOG_INTERVAL_ENV: str(JOB_PROGRESS_INTERVAL)}
            # the log file itself, not a pipe read by this app: a SIGKILLed app lost what was still in the pipe and
            # all the job printed after (its stop line too), and the job failed on its next write to the closed pipe
            try:
                process = subprocess.Popen([sys.executable, "-m", "app.cli", *argv], stdout=log_fd,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            finally:
                os.close(log_fd)  # the job holds its own copy
            job = Job(argv, process, id=job_id, log_path=log_path)
            try:
                atomic_write_json(self.folder / STATE_FILE, job.state())
            except AttnpatError:  # a job nobody else could see: not started
                process.kill()
                process.wait()
                log_path.unlink(missing_ok=True)
                raise
            self.job = job
            threading.Thread(target=self._wait, args=(job,), daemon=True).start()
            return job

    def _wait(self, job: Job) -> None:
        """In a thread: once the job ends, record how."""
        job.process.wait()
        job.finished = time.time()
        self._record_end(job)

    def _record_end(self, job: Job) -> None:
        """Write the ended job's exit status into the state file, unless a later job's state replaced it."""
        try:
            with self._state_locked():
                state = read_job_state(self.folder)
                if state is not None and state["id"] == job.id and "returncode" not in state:
                    atomic_write_json(self.folder / STATE_FILE, {**state, **job.end_state()})
        except AttnpatError as exc:  # the state then reads as stopped when this app ends
            log.warning("cannot record how the job ended: %s", exc)

    def stop(self) -> str:
        with self._lock:
            if self.job is None or self.job.returncode is not None:
                last = self.current()
                if isinstance(last, RecordedJob) and last.process_alive():
                    return (f"the running job is another app's (pid {last.state['app_pid']}): stop it there, or "
                            f"with `kill {last.state['pid']}`")
                return "no job is running"
            self.job.stop_requested = True
            self.job.process.terminate()
            try:
                self.job.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.job.process.kill()
                self.job.process.wait()
            self._record_end(self.job)  # now: at exit the reader thread may not get to it
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
