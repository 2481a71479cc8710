"""Resolving and running the graph for one call, below both the Python API (:mod:`runner.api`)
and the distributed run (:mod:`runner.distributed`): the store opened, the example built, the
remotes opened, the run context made (with this worker on it), the graph resolved and executed.
Nothing here prints; the callers choose where progress goes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .options import RUN_OPTIONS, EvalOptions, default_of, run_argv
from .worker import Worker

TARGETS = ("prompts", "completions", "tokens", "hidden-states", "eval")


def open_store_arg(store, opts: EvalOptions | None = None):
    """``store``: a Store, a path or URL, or None for ``$DFCACHE_STORE``, else ``./store`` (never
    the command line's state: a Python caller has none)."""
    from dfcache import open_store
    from dfcache.store import Store

    if isinstance(store, Store):
        return store
    return open_store(store, offline=True if opts is not None and opts.offline else None)


def open_remotes(opts: EvalOptions, log=None) -> list:
    """The remotes to look in: --remote flags, else the config's default remotes. Offline,
    a remote that needs the network is refused (a file:// remote is fine). ``log``: where the
    note about that goes (default: stderr)."""
    from dfcache.config import load_config

    names = opts.remotes or load_config().default_remotes
    if not names:
        return []
    from dfcache.errors import OfflineModeIsEnabled
    from dfcache.transfer import open_remote

    remotes = []
    for name in names:
        try:
            remotes.append(open_remote(name, endpoint_url=opts.endpoint_url, offline=opts.offline, create=False))
        except OfflineModeIsEnabled:
            # Offline, a network remote is simply not consulted (it must not fail a run that has
            # everything it needs locally); what is missing is then reported as needing the network.
            note = f"note: offline mode is on, so remote {name} (it needs the network) is not consulted."
            if log is not None:
                log(note)
            else:
                print(note, file=sys.stderr, flush=True)
    return remotes


def cli_args(opts: EvalOptions) -> list[str]:
    """The command-line options that give ``opts`` (those that differ from the defaults), for
    "produce it with: dfcache ..." messages of Python calls: the command resolves as the call did."""
    given = {}
    for o in RUN_OPTIONS:
        if not o.field or getattr(opts, o.name) == default_of(o.name):
            continue
        if o.name == "completions" and opts.completions == "server" and opts.server:
            continue  # --server implies it, as typed on the command line
        given[o.name] = getattr(opts, o.name)
    return run_argv("", given)[2:] + (["--offline"] if opts.offline else [])


def _store_args(store) -> list[str]:
    """``--store LOCATION`` unless ``store`` is the one `dfcache` opens by default."""
    import os

    from dfcache.config import default_store_location

    if store is None:
        return []
    url = str(store.url)
    default = default_store_location()
    if "://" not in url and "://" not in default:
        if os.path.realpath(os.path.expanduser(default)) == os.path.realpath(url):
            return []
    elif url == default:
        return []
    return ["--store", url]


def command_argv(upto: str, argv: list[str] | None, opts: EvalOptions | None = None, store=None) -> list[str]:
    if argv is not None:
        return list(argv)
    return [*_store_args(store), "run", upto, *(cli_args(opts) if opts else [])]


def resolve_graph(upto: str, opts: EvalOptions, store=None, *, argv: list[str] | None = None,
                  log: Callable[[str], None] | None = None, out=None, bars=None,
                  worker: Worker | None = None):
    """Build and resolve the graph (no work). Returns ``(ctx, nodes)``: the runner's own objects.

    ``log``: the example build's lines (default: none); ``out``/``bars``: the run's progress
    lines and bars (default: stderr, as the command line prints them); ``worker``: this
    process's place in a distributed run (default: rank 0 of 1), carried by the run context."""
    from dfcache.errors import UsageError

    from .graph import RunContext, resolve
    from .pipeline import build_graph

    if upto not in TARGETS:
        raise UsageError(f"unknown target {upto!r}; use {', '.join(TARGETS)}.")
    if upto in ("prompts", "completions", "tokens"):  # --compression is the hidden states'
        from dfcache.fp8 import check_applies

        check_applies(opts.compression, stage=upto, dtype=opts.dtype)
    if opts.mix is not None:  # before any work (the example's build included): exit 2 or 6 naming the fix
        from ..suites import sets

        sets.parse_mix(opts.mix, sets.names(opts.prompts))
    st = open_store_arg(store, opts)
    argv = command_argv(upto, argv, opts, st)  # before the example fills in its paths: `--example` says them
    if opts.example:
        from ..models.example import apply_example

        apply_example(st, opts, log=log or (lambda m: None))
    note = (lambda m: (out.write(m + "\n"), out.flush())) if out is not None else None
    ctx = RunContext(st, opts, remotes=open_remotes(opts, log=note), argv=argv, out=out, bars=bars,
                     worker=worker)
    nodes = resolve(ctx, build_graph(ctx, upto))
    return ctx, nodes


def run_graph(upto: str, opts: EvalOptions, store, *, argv=None, log=None, out=None, output=None,
              worker: Worker | None = None):
    """Resolve the graph and make what is missing. ``output``: a Python call's output (its ``out``,
    ``bars`` and ``hush()``, which silences transformers before work), else ``out``."""
    from .graph import check_offline, resolve
    from .pipeline import build_graph, execute

    if output is not None:
        out = output.out
    ctx, nodes = resolve_graph(upto, opts, store, argv=argv, log=log, out=out,
                               bars=output.bars if output is not None else None, worker=worker)
    earlier: list = []  # the graphs run before this one (a multi-turn set's earlier turns)
    while True:
        check_offline(ctx, nodes)
        if output is not None and any(n.status.startswith("compute") or n.status == "network" for n in nodes):
            output.hush()  # work to do: the stages load models and tokenizers with transformers
        execute(ctx, nodes)
        if ctx.waiting_turns is None:
            if earlier:
                _count_earlier(ctx, earlier, nodes)
            return ctx, nodes
        earlier += nodes
        # A multi-turn set's next turn is asked after the target's answers this graph just made
        # (runner/core/pipeline.py later_turns): the graph again, with those prompts in it.
        waited = ctx.waiting_turns
        ctx.log(f"prompts: {waited}; they are stored now, so the run goes on with that turn")
        nodes = resolve(ctx, build_graph(ctx, upto))
        if ctx.waiting_turns == waited:
            from dfcache.errors import InternalError

            raise InternalError(f"the run made a turn's completions and still finds them missing ({waited}); "
                                "this is a bug, please report it (rerun with --debug for the traceback).")


def _count_earlier(ctx, earlier: list, nodes: list) -> None:
    """What the earlier graphs of a run made counts as made by it, not as reused: a sample of the
    last graph stored by an earlier one (the first turns' completions) moves from its stored
    positions to the ones the run produced or pulled, and the run's work names the last graph's
    nodes (an earlier graph's node is a part of one of them)."""
    made: dict[str, tuple[set, int, int]] = {}
    for n in earlier:
        if n.partition is not None and (n.produce or n.pull):
            keys, produced, pulled = made.get(n.partition.key, (set(), 0, 0))
            keys.update(n.sample_keys[i] for i in n.produce + n.pull)
            made[n.partition.key] = (keys, produced + n.produced, pulled + n.pulled)
    for n in nodes:
        if n.partition is None or n.partition.key not in made:
            continue
        keys, produced, pulled = made[n.partition.key]
        moved = [i for i in n.local if n.sample_keys[i] in keys]
        n.local = set(n.local) - set(moved)
        n.produce = sorted(set(n.produce) | set(moved))
        n.produced += produced
        n.pulled += pulled
        if produced and n.key not in ctx.work_done:
            ctx.work_done.append(n.key)
    final = {n.key for n in nodes}
    ctx.work_done[:] = [k for k in ctx.work_done if k in final]
