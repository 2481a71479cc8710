"""`dfcache plan` and `dfcache run`: the eval graph on the command line.

Their options are runner/core/options.py's RUN_OPTIONS, made typer parameters by
runner/commands/run_options.py. Building the plan imports neither torch nor transformers; a run
whose every artifact is cached never does.
"""

from __future__ import annotations

import inspect
import sys
import time

import typer

from dfcache.cli.common import examples, get_store, state
from dfcache.errors import UsageError

from ..core.options import EvalOptions
from .common import _print_plan, print_run, quiet_libraries
from .run_options import CONTEXT, RUN_TARGETS, GroupedCommand, command_argv, options_from, parameters

_EXAMPLES = {
    "run": examples("dfcache run eval --example",
                    "dfcache run eval --target ./qwen3-8b --drafter ./dflash-ckpt --server http://127.0.0.1:30000",
                    "dfcache run hidden-states --target ./qwen3-8b --layer 1 --layer 17 --device cuda"),
    "plan": examples("dfcache plan eval --example",
                     "dfcache plan eval --target ./qwen3-8b --drafter 'runs/x/checkpoint-*' --offline",
                     "dfcache --json plan tokens --target ./qwen3-8b --prompts prompts.jsonl"),
}


def _make_command(mode: str):
    def command(ctx: typer.Context, upto: str = "eval", **kw) -> None:
        if upto not in RUN_TARGETS:
            raise UsageError(f"unknown target {upto!r}; use eval, prompts, completions, tokens or hidden-states.")
        opts = options_from(ctx, kw, run=mode == "run", plan=mode == "plan")
        run_pipeline(mode, RUN_TARGETS[upto], opts, argv=command_argv(ctx, upto), shard=kw.get("shard"),
                     estimate=kw.get("estimate", False))

    # --store, --json, --debug, --offline and --no-progress are the dfcache CLI's global
    # options, which it adds to every command (dfcache.cli.common.GLOBAL_OPTIONS).
    command.__signature__ = inspect.Signature(parameters())
    command.__doc__ = ("Show the graph and each node's status; does no work." if mode == "plan" else
                       "Run the graph up to TARGET, reusing everything cached.")
    return command


# What `dfcache ls --stage` and `ls --backend` accept before the store holds any such artifact.
STAGE_NAMES = ("prompts", "completions", "tokens", "hidden_states", "drafter_eval", "report", "import")
KERNELS = ("fla", "torch")


def register(app: typer.Typer) -> None:
    state.known_stages.update(STAGE_NAMES)
    state.known_kernels.update(KERNELS)
    state.recomputers["hidden_states"] = _recompute_hidden_states  # set-level imports
    state.recomputers["import"] = _recompute_hidden_states
    for mode in ("plan", "run"):
        app.command(mode, cls=GroupedCommand, context_settings=CONTEXT, epilog=_EXAMPLES[mode])(_make_command(mode))


def _recompute_hidden_states(store, keys, n, **kw) -> dict:
    from ..peers.recompute import verify_hook  # imports torch only when asked to recompute

    return verify_hook(store, keys, n, **kw)


def run_pipeline(mode: str, upto: str, opts: EvalOptions, argv: list[str] | None = None, shard: str | None = None,
                 estimate: bool = False):
    """Plan (and for mode "run", execute) the graph through runner.api, and print. Returns (ctx, nodes).

    A run is one worker of a distributed run under torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or with
    ``--shard I/N``: it makes its share, and only the worker that speaks for the job prints the
    summary (docs/distributed.md); other torchrun ranks print nothing and return (None, None)."""
    from .. import api
    from ..core.graph import check_offline

    opts.validate()  # before anything is opened; RunContext checks again for Python callers
    quiet_libraries(bars=opts.progress, notices=opts.progress or not state.no_progress)

    started = time.perf_counter()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if mode == "plan":
        ctx, nodes = api.resolve_graph(upto, opts, get_store(), argv=argv, log=log)
        if estimate:
            from ..core.estimate import describe, estimate as price

            est = price(ctx, nodes)
            _print_plan(nodes, opts, est, describe(est))
        else:
            _print_plan(nodes, opts)
        if ctx.waiting_turns:  # the graph stops at a turn's completions (runner/core/pipeline.py later_turns)
            log(f"note: {ctx.waiting_turns}; a run makes them, then plans the rest with those turns in it.")
        if opts.offline:
            check_offline(ctx, nodes)
        return ctx, nodes
    from ..core.worker import discover
    from ..distributed import run_worker

    worker = discover(shard)
    done = run_worker(upto, opts, get_store(), worker=worker, argv=argv, log=log)
    if done.ctx is None:
        return None, None
    result = api.worker_result(upto, done, time.perf_counter() - started)
    print_run(result, opts, done if worker.distributed else None)
    return done.ctx, done.nodes
