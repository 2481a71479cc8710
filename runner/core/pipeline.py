"""The eval pipeline: the table of stages, the graph they make, and running it.

``prompts → completions → tokens → hidden_states[layer] → drafter_eval → report``

``STAGES`` is the one place that names the stages; ``runner.core.graph`` (what a node and a run are)
imports none of them, so stages import the graph and nothing imports back. ``build_graph(ctx,
upto)`` wires the stages; it resolves inputs and computes every key without doing any work (and
without importing torch). ``execute(ctx, nodes)`` produces what is missing, in dependency order.
"""

from __future__ import annotations

from types import ModuleType

from dfcache.errors import InternalError, UsageError

from .graph import Node, RunContext, topo_order
from ..stages import completions, drafter_eval, hidden_states, prompts, report, tokens

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
    # `run hidden-states` makes training data: the final state too for a family that trains on it.
    layers = hidden_states.requested_layers(ctx, drafters, training=upto == "hidden-states")
    hs = hidden_states.build(ctx, tok, layers)
    if upto == "hidden-states":
        return topo_order(list(hs.values()))
    evals = [drafter_eval.build(ctx, tok, hs, d) for d in drafters]
    return topo_order([report.build(ctx, evals)])


def execute(ctx: RunContext, nodes: list[Node]) -> None:
    """Produce what resolve() said, in dependency order: pull what remotes hold, then compute
    (or fetch) the rest; per-sample nodes only their missing samples."""
    pending = [n for n in nodes if n.status not in ("cached", "not needed")]
    # Stages that talk to something outside (a server) check it once, before any work starts.
    for stage in dict.fromkeys(n.stage for n in pending if n.status != "remote"):
        check = getattr(STAGES[stage], "preflight", None)
        if check is not None:
            check(ctx, [n for n in pending if n.stage == stage and n.status != "remote"])
    done: set[str] = set()
    for n in pending:
        if n.partition is not None:
            _execute_samples(ctx, n, pending, done)
            continue
        if n.key in done or ctx.store.has(n.key):
            done.add(n.key)
            continue
        if n.status == "remote":
            from dfcache.transfer import pull_keys

            pull_keys(n.remote, ctx.store, [n.key], with_upstream=False, progress=ctx.options.progress)
            done.add(n.key)
            continue
        STAGES[n.stage].produce(ctx, [n])
        if not ctx.store.has(n.key):
            raise _not_committed(n.stage, n.key)
        done.add(n.key)
        ctx.work_done.append(n.key)


def _not_committed(stage: str, what: str) -> InternalError:
    return InternalError(f"stage {stage} returned without committing {what}; this is a bug in the stage, please "
                         "report it (rerun with --debug for the traceback).")


def _execute_samples(ctx: RunContext, n: Node, pending: list[Node], done: set[str]) -> None:
    from dfcache.samples import index_of

    if n.pull:
        from dfcache.sample_transfer import pull_samples

        by_remote: dict = {}
        for i in n.positions_distinct(n.pull):
            k = n.sample_keys[i]
            by_remote.setdefault(id(n.remote_of[k]), (n.remote_of[k], []))[1].append(k)
        for remote, keys in by_remote.values():
            r = pull_samples(remote, ctx.store, {n.partition.key: keys}, progress=ctx.options.progress)
            n.pulled += r.copied
    if n.produce and n.key not in done:
        batch = [m for m in pending if m.stage == n.stage and m.partition is not None and m.produce
                 and m.key not in done and (m is n or (n.group is not None and m.group == n.group))]
        # A stage may refuse that others compute from some of its samples in this run (tokens:
        # unverified retokenized ids without --accept-retokenized), decided per run, never stored.
        uses: dict[str, tuple[Node, set[int]]] = {}  # once per upstream node (a batch may hold many layers)
        for m in batch:
            for d in m.deps:
                if hasattr(STAGES[d.stage], "check_use"):
                    uses.setdefault(d.key, (d, set()))[1].update(m.produce)
        for d, positions in uses.values():
            STAGES[d.stage].check_use(ctx, d, sorted(positions))
        STAGES[n.stage].produce(ctx, batch)
        for m in batch:
            done.add(m.key)
            lacking = index_of(ctx.store).missing(m.partition.key, [m.sample_keys[i] for i in m.produce])
            if lacking:
                raise _not_committed(m.stage, f"{len(lacking)} sample(s) of {m.label}")
            m.produced = len(m.positions_distinct(m.produce))
            ctx.work_done.append(m.key)
    done.add(n.key)
