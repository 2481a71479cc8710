"""A fully cached ``dfcache run`` answered before the command-line framework is imported.

Typer, click and pydantic cost more than the whole of a run whose every artifact is stored
(docs/benchmarks.md, ``noop-eval``). ``dfcache/__main__.py`` calls :func:`main` first; it reads
the command line itself, resolves the graph through :func:`runner.core.execution.resolve_graph` (the same
keys, the same store lookups), and when every node is cached prints the result through the
functions ``dfcache run`` itself prints with (:mod:`runner.commands.common`), so the output is the
same bytes but for the seconds it reports.

It answers only what it understands completely and what needs no work: a ``run`` command line
of the options RUN_OPTIONS marks ``fast`` (anything else, ``--help``, ``--debug``,
``--shard``, ``--server``, ``--remote`` or a configured default remote, a torchrun or Slurm
worker, a store URL, a store or example models not there yet), and a graph with nothing to
produce or pull. For everything else, and on any error, it returns None before printing
anything and :mod:`dfcache.cli` runs the command as it always did (it says what is wrong, or
does the work). What this path would have logged is dropped then, so nothing is said twice.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import time

from ..core.options import RUN_OPTIONS
from ..core.options import run_argv as core_run_argv

_TARGETS = {"eval": "eval", "prompts": "prompts", "completions": "completions", "tokens": "tokens",
            "hidden-states": "hidden-states", "hidden_states": "hidden-states"}
_GLOBAL = ("--json", "--offline", "--no-progress")  # --store too; --debug and --version go to the full CLI

_INT = re.compile(r"[0-9]+\Z")
_FLOAT = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\Z")

# The options of `run` this path takes (RUN_OPTIONS' with ``fast``), in declaration order:
# (flags, EvalOptions field, kind). A flag with two spellings (--revision, --target-revision)
# gives its first one in fix messages, as click does.
def _kind(o) -> str:
    if o.type is bool:
        return "bool" if o.off else "flag"
    # (--prompts: one set here; several go to the full command line, as a value given twice does)
    return {str: "str", int: "int", float: "float"}[o.type] + ("s" if o.is_list else "")


_OPTIONS: list[tuple[tuple[str, ...], str, str]] = [
    ((*o.flags, *((o.off,) if o.off else ())), o.name, _kind(o)) for o in RUN_OPTIONS if o.fast]
_BY_FLAG = {flag: (i, field, kind) for i, (flags, field, kind) in enumerate(_OPTIONS) for flag in flags}
_OFF = {o.off for o in RUN_OPTIONS if o.fast and o.off}


class _NotMine(Exception):
    """Raised inside this module: the full CLI answers this command line."""


def parse(argv: list[str]) -> dict | None:
    """``{"target", "store", "global", "given", "values"}`` for a ``run`` line this path takes, else None.

    ``store``: {where: the last --store given there}; ``global``: flag -> where it was given
    ("root" before ``run``, "command" after it);
    ``given``: run option index -> the values given, in order; ``values``: EvalOptions fields."""
    from dfcache.cmdline import option_value

    out = {"target": None, "store": {}, "global": {}, "given": {}, "values": {}}
    i, command = 0, False
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name == "--store":
            value, i = option_value(argv, i, eq, value)
            if value is None:
                return None
            out["store"]["command" if command else "root"] = value  # the later one wins, as in dfcache.cli
        elif a in _GLOBAL:
            out["global"].setdefault(a, set()).add("command" if command else "root")
        elif not command:
            if a != "run":
                return None
            command = True
        elif a in _BY_FLAG and _BY_FLAG[a][2] in ("flag", "bool"):
            idx, field, kind = _BY_FLAG[a]
            out["values"][field] = a not in _OFF
            out["given"][idx] = [out["values"][field]]
        elif name in _BY_FLAG:
            idx, field, kind = _BY_FLAG[name]
            if kind in ("flag", "bool"):
                return None  # --example=yes and the like: the parser says what it makes of them
            value, i = option_value(argv, i, eq, value)
            if value is None:
                return None
            if kind in ("int", "ints") and not _INT.match(value):
                return None
            if kind == "float" and not _FLOAT.match(value):
                return None
            v = int(value) if kind in ("int", "ints") else float(value) if kind == "float" else value
            if kind in ("strs", "ints"):
                out["given"].setdefault(idx, []).append(v)
                out["values"].setdefault(field, []).append(v)
            else:
                if idx in out["given"]:
                    return None  # given twice: the parser decides what that means
                out["given"][idx] = [v]
                out["values"][field] = v
        elif not a.startswith("-") and out["target"] is None and a in _TARGETS:
            out["target"] = a
        else:
            return None
        i += 1
    if not command:
        return None
    out["target"] = out["target"] or "eval"
    return out


def run_argv(p: dict) -> list[str]:
    """The ``run`` arguments fix messages name, as the full command line rebuilds them
    (runner.core.options.run_argv): global options given before the command, ``run TARGET``,
    the command's own options given on the command line, then the global options given after it."""
    def globals_at(where: str) -> list[str]:
        args = []
        if where in p["store"]:
            args += ["--store", p["store"][where]]
        for flag in _GLOBAL:
            if where in p["global"].get(flag, ()):
                args.append(flag)
        return args

    given = {}
    for idx in p["given"]:
        _, name, kind = _OPTIONS[idx]
        values = p["given"][idx]
        given[name] = values if kind in ("strs", "ints") else values[-1]
    return core_run_argv(p["target"], given, before=globals_at("root"), after=globals_at("command"))


def main(argv: list[str]) -> int | None:
    """Print a fully cached run's result and return 0; None when dfcache.cli must answer."""
    p = parse(argv)
    if p is None:
        return None
    from dfcache import config

    if config.debug_from_env() or config.launcher_env():
        return None  # tracebacks, and the workers of a distributed run, are the full CLI's
    loc = p["store"].get("command", p["store"].get("root")) or config.default_store_location()
    if "://" in loc:
        return None
    said = io.StringIO()  # what the graph logs while it resolves: printed only if this path answers
    real_stderr = sys.stderr
    try:
        with contextlib.redirect_stderr(said):
            result, opts = _resolve(p, loc, real_stderr)
    except KeyboardInterrupt:
        from dfcache.console import INTERRUPTED, emit_json, err

        err(INTERRUPTED)  # as dfcache.cli says it (nothing was committed here)
        if "--json" in p["global"]:
            emit_json({"error": INTERRUPTED, "exit_code": 130, "type": "KeyboardInterrupt"})
        return 130
    except Exception:  # noqa: BLE001 - not ours (_NotMine), or an error the full CLI reports properly
        return None
    from .common import print_run

    real_stderr.write(said.getvalue())
    real_stderr.flush()
    print_run(result, opts)
    return 0


def _resolve(p: dict, loc: str, stderr):
    import os

    from dfcache import config
    from dfcache.store.layout import STORE_MARKER

    from ..core.options import EvalOptions

    root = os.path.abspath(os.path.expanduser(loc))
    if not os.path.isfile(os.path.join(root, STORE_MARKER)):
        raise _NotMine  # a store that is not there yet is made by the full CLI
    if config.load_config().default_remotes:
        raise _NotMine
    json_out = "--json" in p["global"]
    no_progress = "--no-progress" in p["global"]
    opts = EvalOptions(**p["values"])
    opts.offline = "--offline" in p["global"] or config.offline_from_env()
    opts.json = json_out
    opts.progress = not (no_progress or json_out) and stderr.isatty()
    opts.validate()
    from .common import quiet_libraries

    quiet_libraries(bars=opts.progress, notices=opts.progress or not no_progress)
    started = time.perf_counter()
    from dfcache.store import open_store

    store = open_store(root, create=False)
    if opts.example:
        from ..models.example import example_built

        if not example_built(store):
            raise _NotMine  # building the example models is work
    from .. import api
    from ..core.execution import resolve_graph
    from ..core.worker import discover

    if discover(None).distributed:
        raise _NotMine
    upto = _TARGETS[p["target"]]
    ctx, nodes = resolve_graph(upto, opts, store, argv=run_argv(p))
    if any(n.status not in ("cached", "not needed") for n in nodes):
        raise _NotMine  # there is work to do
    return api._result(upto, ctx, nodes, time.perf_counter() - started), opts
