"""The one error type users see: a clear, one-line message, no traceback."""
import os
import re
import signal

# The exit status of a command that SIGTERM stopped after its cleanup ran (app.cli.main), as a shell reports it.
TERMINATED_EXIT = 128 + signal.SIGTERM
INTERRUPTED_EXIT = 128 + signal.SIGINT  # Ctrl-C


class Terminated(BaseException):
    """SIGTERM (a job stopped from the web app, `kill`): raised so that cleanup runs as for Ctrl-C."""


class StepStopped(BaseException):
    """A verb run inside another (a demo step, the demo's web app) was stopped by Ctrl-C or SIGTERM and has
    printed its stop line, or failed and printed its error line: the outer command exits with the same code
    (130, 143 or 2) and says nothing more. Not a KeyboardInterrupt, which click would turn into an abort of
    its own."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class AttnpatError(Exception):
    """A user-facing error. The CLI prints ``error: <message>`` and exits 2; the app shows the message."""

    def __init__(self, message: str):
        # One line always: multi-line messages are folded so logs and terminals stay readable.
        super().__init__(" ".join(str(message).split()))


def quoted(value, limit: int = 60) -> str:
    """``value`` as an error line quotes it: its repr (control characters escaped), cut to ``limit`` characters
    with '...' and its length when longer ("'aaaa... (5000 characters)"), so that a pasted page of text is not
    echoed back whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:limit - 3]}...{size}"


def os_error_reason(exc: OSError) -> str:
    """Why an OS error happened, in lower case: 'permission denied', 'file name too long'."""
    return (exc.strerror or type(exc).__name__).lower()


def os_error_message(exc: OSError, doing: str = "") -> str:
    """One line for an OS error: what failed, on which path, and why (e.g. 'cannot write runs/x: permission denied')."""
    reason = os_error_reason(exc)
    # a failed rename names its temporary source and its destination: the destination is the user's path
    target = str(exc.filename2 if exc.filename2 is not None else exc.filename or "")
    return " ".join(part for part in (doing, target) if part) + f": {reason}" if (doing or target) else reason


def write_failure_reason(exc: BaseException) -> str | None:
    """Why a library's write failed, as :func:`os_error_reason` says it, or None when it was no OS error: the
    libraries that save models wrap the OS error (safetensors names it as '(os error 28)'; torch.save raises
    a RuntimeError while handling the OSError of a file object's write)."""
    if isinstance(exc, OSError):
        return os_error_reason(exc)
    if isinstance(exc.__context__, OSError):
        return os_error_reason(exc.__context__)
    code = re.search(r"\(os error (\d+)\)", str(exc))
    return os.strerror(int(code.group(1))).lower() if code else None


def check_choice(value: str, choices, what: str) -> str:
    """``value`` if it is one of ``choices``; otherwise one error line naming them (e.g. what='map kind')."""
    if value not in choices:
        raise AttnpatError(f"unknown {what} {quoted(value)}; use one of: {', '.join(choices)}")
    return value
