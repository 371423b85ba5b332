"""prunelab command line: a thin face over :mod:`prunelab.api`.

Exit codes: 0 success; 2 a user error, printed as one line ``error: ...`` (``--verbose``
adds the traceback); 130 Ctrl-C, printed as one line saying what was kept; 1 a bug
(traceback). Layer indices are 0-based everywhere.
"""

from __future__ import annotations

import sys

import typer

from prunelab import interrupts, log
from prunelab.cli import (  # noqa: F401  (register)
    conditional_cmds,
    elastic_cmds,
    factor_cmds,
    front_cmds,
    heal_cmds,
    inspect_cmds,
    plugins,
    prune_cmds,
    report_cmds,
    vision_cmds,
    workflow_cmds,
)
from prunelab.cli.apps import app
from prunelab.cli.common import state
from prunelab.errors import PrunelabError


def run(argv: list[str] | None = None) -> None:
    """Console entry point (see the module docstring for the exit codes); a Ctrl-C that
    lands outside the command (before it is parsed, while it exits) is exit 130 too, and a
    second Ctrl-C while it exits is ignored."""
    import signal

    try:
        code = cli_main(argv)
    except KeyboardInterrupt:
        code = _interrupted()
    except Exception:  # the consequence of a Ctrl-C a library swallowed (prunelab.interrupts)
        if not interrupts.seen():
            raise
        code = _interrupted()
    if code == 130:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


def _quiet_transformers() -> None:
    """Errors only from transformers, no hub progress bars: set through the environment when
    transformers is not loaded yet (so that ``--help`` never imports it), else directly."""
    import os

    if "transformers" not in sys.modules:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        return
    transformers = sys.modules["transformers"]
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def cli_main(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    _quiet_transformers()
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in ("--verbose", "-v") for a in args[: _first_command(args)])
    state.update(verbose=verbose, on_interrupt=None, help="--help" in args)
    plugins.set_cli(None)
    usage, abort = _click_exceptions()
    try:
        rv = app(args=args, prog_name="prunelab", standalone_mode=False)
    except PrunelabError as exc:
        if interrupts.seen():
            return _interrupted()
        return _fail(str(exc), exc.exit_code, exc)
    except KeyboardInterrupt:
        return _interrupted()
    except (typer.Exit, SystemExit) as exc:
        code = getattr(exc, "exit_code", getattr(exc, "code", 0))
        return code if isinstance(code, int) else 0
    except usage as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help, exit 0
            exc.show()
            return 0
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        return _fail(_retired(exc) or exc.format_message() + hint, 2, exc)
    except abort:
        return _interrupted()
    if rv == 130:  # typer turns a Ctrl-C inside a command into a return value
        return _interrupted()
    return rv if isinstance(rv, int) else 0


def _retired(exc) -> str | None:
    """``--remove was replaced by --budget remove-blocks:N`` for a flag of an earlier
    version (:data:`prunelab.budget.RETIRED`) that the command no longer has; ``None``
    for any other usage error."""
    from prunelab.budget import retired_hint

    name = getattr(exc, "option_name", None)
    if type(exc).__name__ != "NoSuchOption" or not name:
        return None
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path.removeprefix("prunelab").strip() if ctx is not None else ""
    new = retired_hint(path, name)
    return f"{name} was replaced by {new}" if new else None


def _first_command(args: list[str]) -> int:
    """Position of the first non-option word (the global options stand before it)."""
    return next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))


def _fail(message: str, code: int, exc: BaseException) -> int:
    if state["verbose"]:
        import traceback

        traceback.print_exception(exc)
    text = " ".join(message.split()) or type(exc).__name__
    log.console.print(f"error: {text}", markup=False, soft_wrap=True)
    return code


def _interrupted() -> int:
    saved = state.get("on_interrupt") or "nothing was written"
    log.console.print(f"interrupted: {saved}", markup=False, soft_wrap=True)
    return 130


def _click_exceptions() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Usage-error and abort classes of click and of typer's vendored copy (typer >= 0.2x
    raises its own ``typer._click`` classes, which are not click's)."""
    import click

    usage, abort = [click.exceptions.ClickException], [click.exceptions.Abort]
    try:
        from typer._click import exceptions as vendored
    except ImportError:
        vendored = None
    if vendored is not None:
        usage.append(vendored.ClickException)
        if hasattr(vendored, "Abort"):
            abort.append(vendored.Abort)
    return tuple(usage), tuple(abort)


if __name__ == "__main__":
    run()
