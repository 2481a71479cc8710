"""The eval pipeline: the table of stages, the graph they make, and running it.

``prompts → completions → tokens → hidden_states[layer] → drafter_eval → report``

``STAGES`` is the one place that names the stages; ``runner.graph`` (what a node and a run are)
imports none of them, so stages import the graph and nothing imports back. ``build_graph(ctx,
upto)`` wires the stages; it resolves inputs and computes every key without doing any work (and
without importing torch). ``execute(ctx, nodes)`` produces what is missing, in dependency order.
"""

from __future__ import annotations

from types import ModuleType

from dfcache.errors import InternalError, UsageError

from .graph import Node, RunContext, topo_order
from .stages import completions, drafter_eval, hidden_states, prompts, report, tokens

STAGES: dict[str, ModuleType] = {m.NAME: m for m in (prompts, completions, tokens, hidden_states, drafter_eval,
                                                     report)}
TARGETS = ("prompts", "completions", "tokens", "hidden-states", "eval")


def build_graph(ctx: RunContext, upto: str = "eval") -> list[Node]:
    if upto not in TARGETS:
        raise UsageError(f"unknown target {upto!r}; choose one of {', '.join(TARGETS)}.")
    roots: list[Node] = [prompts.build(ctx)]
    if upto == "prompts":
        return topo_order(roots)
    roots = [completions.build(ctx, roots[0])]
    if upto == "completions":
        return topo_order(roots)
    tok = tokens.build(ctx, roots[0])
    if upto == "tokens":
        return topo_order([tok])
    # `run hidden-states --drafter D` extracts the layers D reads (its target_layer_ids).
    drafters = drafter_eval.resolve_drafters(ctx) if upto == "eval" or ctx.options.drafters else []
    layers = hidden_states.requested_layers(ctx, drafters)
    hs = hidden_states.build(ctx, tok, layers)
    if upto == "hidden-states":
        return topo_order(list(hs.values()))
    evals = [drafter_eval.build(ctx, tok, hs, d) for d in drafters]
    return topo_order([report.build(ctx, evals)])


def execute(ctx: RunContext, nodes: list[Node]) -> None:
    """Produce every node that is not cached, in dependency order."""
    pending = [n for n in nodes if n.status != "cached"]
    # Stages that talk to something outside (a server) check it once, before any work starts.
    for stage in dict.fromkeys(n.stage for n in pending if n.status != "remote"):
        check = getattr(STAGES[stage], "preflight", None)
        if check is not None:
            check(ctx, [n for n in pending if n.stage == stage])
    done: set[str] = set()
    for n in pending:
        if n.key in done or ctx.store.has(n.key):
            done.add(n.key)
            continue
        if n.status == "remote":
            from dfcache.transfer import pull_keys

            pull_keys(n.remote, ctx.store, [n.key], with_upstream=False, progress=ctx.options.progress)
            done.add(n.key)
            continue
        group = [m for m in pending if m.stage == n.stage and m.group is not None and m.group == n.group
                 and m.key not in done and m.status != "remote" and not ctx.store.has(m.key)]
        batch = group or [n]
        STAGES[n.stage].produce(ctx, batch)
        for m in batch:
            if not ctx.store.has(m.key):
                raise InternalError(f"stage {m.stage} returned without committing {m.key}; this is a bug in "
                                    "the stage, please report it (rerun with --debug for the traceback).")
            done.add(m.key)
            ctx.work_done.append(m.key)
