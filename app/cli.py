"""The `attnpat` command line: thin verbs over analysis/, annotation/ and classifier/.

Each group of verbs lives in its own module ``app/cli_<group>.py`` exposing ``register(app)``; this
file wires them together and turns AttnpatError into a one-line message with exit status 2.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys

import typer

from analysis.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, AttnpatError, StepStopped, Terminated, os_error_message
from app.jobs import end_with_parent
from app.options import with_ray_default

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="What do BERT attention heads do? Extract, classify and analyse attention maps.")

# Verb groups, in help order. Every listed module must exist (a test checks they all register).
COMMAND_MODULES = ("core", "models", "annotate", "classify", "kinds", "finetune", "sweeps", "clark", "webapp", "demo")


def _register_all() -> None:
    for group in COMMAND_MODULES:
        module_name = f"app.cli_{group}"
        if importlib.util.find_spec(module_name) is None:
            continue  # a group still being written; tests/test_cli_core.py fails until every group exists
        importlib.import_module(module_name).register(app)


_register_all()


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, print AttnpatError as one line on stderr and exit 2."""
    if argv is None:  # the console script: SIGTERM ends it as Ctrl-C would (locks released, temporary files removed)
        signal.signal(signal.SIGTERM, _raise_terminated)
        end_with_parent()  # a web app's job: stopped when the app is gone, not left running on its own
        for stream in (sys.stdout, sys.stderr):  # a path the terminal's encoding lacks prints escaped, not a crash
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="backslashreplace")
    try:
        # typer turns Ctrl-C into Exit(130) and, outside standalone mode, returns that code instead of raising
        returned = app(args=with_ray_default(sys.argv[1:] if argv is None else list(argv)), standalone_mode=False)
        if returned == INTERRUPTED_EXIT:
            raise KeyboardInterrupt
    except AttnpatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _exit(2, argv)
    except OSError as exc:  # a read-only or full run directory, a vanished file: one line, not a traceback
        print(f"error: {os_error_message(exc, 'cannot access' if exc.filename else '')}", file=sys.stderr)
        return _exit(2, argv)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return _exit(INTERRUPTED_EXIT, argv)
    except typer.TyperException as exc:  # a usage error (unknown option, bad value): one line too
        message = _usage_message(exc)
        if message:  # none when a group was called without a verb: its help was shown
            print(f"error: {message}", file=sys.stderr)
        return _exit(getattr(exc, "exit_code", 2), argv)
    except StepStopped as exc:  # the stopped step has printed its stop line
        return _exit(exc.code, argv)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return _exit(INTERRUPTED_EXIT, argv)
    except Terminated:
        print("terminated; rerun the same command to resume", file=sys.stderr)
        return _exit(TERMINATED_EXIT, argv)
    if argv is None:  # the work is done and recorded: a Stop while the interpreter shuts down would misreport it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return _exit(returned if isinstance(returned, int) else 0, argv)


def _usage_message(exc: typer.TyperException) -> str:
    """The usage error's message, pointing to the verb's --help (typer bundles its own click: its
    exceptions are typer.TyperException, not click's)."""
    message = (exc.format_message() if hasattr(exc, "format_message") else str(exc)).strip()
    context = getattr(exc, "ctx", None)
    return f"{message} (see `{context.command_path} --help`)" if message and context is not None else message


def _exit(code: int, argv) -> int:
    if argv is None:  # called as the console script
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
