"""The `dfcache` command line: a thin layer over the Python API.

Commands live in modules that each define ``register(app)``: this package's own, and every
plugin of the ``dfcache.commands`` entry point group (:mod:`dfcache.plugins`), the runner's
``plan``/``run`` among them: dfcache imports nothing of the runner and knows nothing about
DFlash. A command module that fails to import is never dropped silently: one of this package's
is an error, a plugin's is a warning on stderr (its traceback under ``--debug``), and asking for
a command it would have provided is an error naming why it is not there. Errors print one line
(no traceback unless ``--debug``) and exit with the code the design assigns (see
``dfcache.errors``).
"""

from __future__ import annotations

import sys
from typing import Optional

import typer
from typer.core import TyperArgument

from .. import __version__, interrupts
from ..console import INTERRUPTED
from ..errors import EXIT_INTERNAL, EXIT_USAGE, DfcacheError
from .common import (GLOBAL_OPTIONS, REGISTERED_FIELDS, GlobalState, apply_global, emit_json, err, examples, state,
                     with_global_options)

app = typer.Typer(name="dfcache", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},  # every command's, plugins' too
                  help="Content-addressed artifact cache and offline-first eval runner for "
                       "speculative-decoding drafters.",
                  epilog=examples("dfcache run eval --example", "dfcache ls --stage hidden-states",
                                  "dfcache --store s3://bucket/cache --json verify", "dfcache COMMAND -h"))


def _version(value: bool) -> None:
    if value:
        print(f"dfcache {__version__}")
        raise typer.Exit()


@app.callback()
def _global(store: Optional[str] = GLOBAL_OPTIONS["store"][1](),
            json_out: bool = GLOBAL_OPTIONS["json"][1](),
            debug: bool = GLOBAL_OPTIONS["debug"][1](),
            offline: bool = GLOBAL_OPTIONS["offline"][1](),
            no_progress: bool = GLOBAL_OPTIONS["no_progress"][1](),
            version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                         help="Print the version and exit.")) -> None:
    for name, value in (("store", store), ("json", json_out), ("debug", debug), ("offline", offline),
                        ("no_progress", no_progress)):
        apply_global(name, value)


_registered = False


def _register_all() -> None:
    """Add every command to the app, once per process: main() may run several times in one process,
    and registering again appended all 38 commands again (typer then rebuilt every copy on each
    call: the 30th in-process main() took 0.9 s of CPU instead of 0.03 s) and wrapped each callback
    in the global options once more."""
    global _registered
    if _registered:
        return
    from . import _diff, _gc, _ls, _migrate, _show, _transfer, _verify

    for module in (_ls, _show, _verify, _gc, _diff, _transfer, _migrate):  # (the order `dfcache -h` lists)
        module.register(app)
    from ..plugins import COMMANDS, entry_points, load

    for _name, value in entry_points(COMMANDS):
        try:
            load(value)(app)
        except Exception as e:  # a broken plugin must not take `ls`/`verify` down with it
            if state.debug:
                raise
            _plugin_errors.append(f"command plugin {value} failed to load: {type(e).__name__}: {e}")
    # Global options work after any command name too (docs/cli.md), plugins' commands included.
    for info in app.registered_commands:
        info.callback = with_global_options(info.callback)
    _registered = True


class _MetavarArgument(TyperArgument):
    """An argument shown by its metavar alone, as click and `hf` show them (``KEY``,
    ``[KEY]...``, ``URL``): typer 0.29 writes it ``{key}`` in the usage line and adds its Python
    type in the list of arguments (``key <str>``, ``keys... <list[str]>``)."""

    def get_usage_pieces(self, ctx) -> list[str]:
        return [self.metavar]

    def display_type_rich(self, ctx):
        return None


def _arguments_by_metavar(group) -> None:
    for cmd in group.commands.values():
        for param in cmd.params:
            if type(param) is TyperArgument and param.metavar:
                param.__class__ = _MetavarArgument  # the same object, shown differently


def _known_commands() -> set[str]:
    return {c.name or c.callback.__name__ for c in app.registered_commands}


_plugin_errors: list[str] = []
_INTERRUPTED = INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # main() may run several times in one process: this command line's state starts fresh, what the
    # commands registered (once, _register_all) stays.
    state.__dict__.update({k: v for k, v in GlobalState().__dict__.items() if k not in REGISTERED_FIELDS})
    # Known before parsing, so that a usage error is JSON too and a crash in parsing shows its
    # traceback; the parser then takes these flags wherever they stand.
    for flag in ("--json", "--debug"):
        if flag in argv:
            setattr(state, flag[2:], True)
    from ..config import debug_from_env

    if debug_from_env():
        state.debug = True
    try:
        _register_all()
        if _plugin_errors:
            known = _known_commands()
            unknown = any(not a.startswith("-") for a in argv) and not any(a in known for a in argv)
            for line in _plugin_errors:
                err(f"{'error' if unknown else 'warning'}: {line}")
            if unknown:
                return _json_error(" ".join(_plugin_errors), EXIT_INTERNAL, "PluginError")
        command = typer.main.get_command(app)
        _arguments_by_metavar(command)
        rv = command(args=argv, prog_name="dfcache", standalone_mode=False)
        if isinstance(rv, int) and not isinstance(rv, bool):
            # typer turns Ctrl-C (KeyboardInterrupt) into Exit(130) and, outside standalone mode,
            # returns the code instead of raising: without this a Ctrl-C'ed run exited 0, silently.
            if rv == 130:
                err(_INTERRUPTED)
                return _json_error(_INTERRUPTED, 130, "KeyboardInterrupt")
            return rv
        return 0
    except DfcacheError as e:
        if state.debug:
            raise
        if interrupts.received():  # a failure that Ctrl-C caused (a request cut short) is the interrupt
            err(_INTERRUPTED)
            return _json_error(_INTERRUPTED, 130, "KeyboardInterrupt")
        err(f"error: {e}")
        extra = {"missing": e.missing} if getattr(e, "missing", None) else {}
        return _json_error(str(e), e.exit_code, type(e).__name__, **extra)
    except KeyboardInterrupt:
        if state.debug:
            raise
        err(_INTERRUPTED)
        return _json_error(_INTERRUPTED, 130, "KeyboardInterrupt")
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    except Exception as e:  # click usage errors and the unexpected
        if _is_click_error(e, "Abort"):
            err("aborted.")
            return _json_error("aborted.", 130, "Abort")
        if _is_click_error(e, "ClickException"):
            if state.debug:
                raise
            e.show()
            code = getattr(e, "exit_code", EXIT_USAGE) or EXIT_USAGE
            return _json_error(e.format_message(), code, "UsageError")
        if state.debug:
            raise
        if interrupts.received():  # e.g. a TypeError the warnings machinery made of a KeyboardInterrupt
            err(_INTERRUPTED)
            return _json_error(_INTERRUPTED, 130, "KeyboardInterrupt")
        message = (f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback and "
                   "report it)")
        err(message)
        return _json_error(message, EXIT_INTERNAL, "InternalError")


def _json_error(message: str, code: int, kind: str, **extra) -> int:
    """Under --json, the error as one JSON object on stdout too (stderr keeps the human line)."""
    if state.json:
        emit_json({"error": message, "exit_code": code, "type": kind, **extra})
    return code


def _is_click_error(e: Exception, name: str) -> bool:
    # typer vendors its own copy of click, so match either copy's class by name.
    return any(cls.__name__ == name and cls.__module__.split(".")[-1] == "exceptions"
               for cls in type(e).__mro__)
