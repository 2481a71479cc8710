"""A fully cached ``dfcache run`` answered before the command-line framework is imported.

Typer, click and pydantic cost more than the whole of a run whose every artifact is stored
(docs/benchmarks.md, ``noop-eval``). ``dfcache/__main__.py`` calls :func:`main` first; it reads
the command line itself, resolves the graph through :func:`runner.api.resolve_graph` (the same
keys, the same store lookups), and when every node is cached prints the result through the
functions ``dfcache run`` itself prints with (:mod:`runner.commands.common`), so the output is the
same bytes but for the seconds it reports.

It answers only what it understands completely and what needs no work: a ``run`` command line
of the options in ``_VALUED``/``_FLAGS`` below (anything else, ``--help``, ``--debug``,
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

_TARGETS = {"eval": "eval", "prompts": "prompts", "completions": "completions", "tokens": "tokens",
            "hidden-states": "hidden-states", "hidden_states": "hidden-states"}
_GLOBAL = ("--json", "--offline", "--no-progress")  # --store too; --debug and --version go to the full CLI

_INT = re.compile(r"[0-9]+\Z")
_FLOAT = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\Z")

# The options of `run` this path takes, in the order runner.commands.run declares them (fix messages
# rebuild the command line in that order): flag -> (EvalOptions field, kind). A flag with two
# spellings (--revision, --target-revision) gives its first one in fix messages, as click does.
_OPTIONS: list[tuple[tuple[str, ...], str, str]] = [
    (("--example",), "example", "flag"),
    (("--target",), "target", "str"),
    (("--revision", "--target-revision"), "target_revision", "str"),
    (("--drafter",), "drafters", "strs"),
    (("--trained-on",), "trained_on", "str"),
    (("--prompts",), "prompts", "str"),
    (("--num-prompts",), "num_prompts", "int"),
    (("--prompt-field",), "prompt_field", "str"),
    (("--messages-field",), "messages_field", "str"),
    (("--id-field",), "id_field", "str"),
    (("--mix",), "mix", "str"),
    (("--max-new-tokens",), "max_new_tokens", "int"),
    (("--max-blocks",), "max_blocks", "int"),
    (("--completions",), "completions", "str"),
    (("--temperature",), "temperature", "float"),
    (("--top-p",), "top_p", "float"),
    (("--seed",), "seed", "int"),
    (("--enable-thinking", "--no-enable-thinking"), "enable_thinking", "bool"),
    (("--accept-retokenized",), "accept_retokenized", "flag"),
    (("--layer",), "layers", "ints"),
    (("--backend",), "backend", "str"),
    (("--device",), "device", "str"),
    (("--eval-device",), "eval_device", "str"),
    (("--dtype",), "dtype", "str"),
    (("--batch-tokens",), "batch_tokens", "int"),
    (("--compression",), "compression", "str"),
    (("--attn-implementation",), "attn_implementation", "str"),
    (("--tree-budget",), "tree_budgets", "ints"),
    (("--end-rule",), "end_rule", "str"),
]
_BY_FLAG = {flag: (i, field, kind) for i, (flags, field, kind) in enumerate(_OPTIONS) for flag in flags}


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
            out["values"][field] = a != "--no-enable-thinking"
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


def _arg(v) -> str:
    # As runner.commands.run._arg spells values in fix messages.
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    return str(v)


def run_argv(p: dict) -> list[str]:
    """The ``run`` arguments fix messages name, as runner.commands.run._run_argv rebuilds them: global
    options given before the command, ``run TARGET``, then the command's own options given on the
    command line in declaration order, then the global options given after it."""
    def globals_at(where: str) -> list[str]:
        args = []
        if where in p["store"]:
            args += ["--store", p["store"][where]]
        for flag in _GLOBAL:
            if where in p["global"].get(flag, ()):
                args.append(flag)
        return args

    args = globals_at("root") + ["run", p["target"]]
    for idx in sorted(p["given"]):
        flags, _, kind = _OPTIONS[idx]
        for v in p["given"][idx]:
            if kind == "flag":
                args.append(flags[0])
            elif kind == "bool":
                args.append(flags[0] if v else flags[1])
            else:
                args += [flags[0], _arg(v)]
    return args + globals_at("command")


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
    from ..distributed import discover

    if discover(None).distributed:
        raise _NotMine
    upto = _TARGETS[p["target"]]
    ctx, nodes = api.resolve_graph(upto, opts, store, argv=run_argv(p))
    if any(n.status not in ("cached", "not needed") for n in nodes):
        raise _NotMine  # there is work to do
    return api._result(upto, ctx, nodes, time.perf_counter() - started), opts
