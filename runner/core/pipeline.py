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
    ctx.waiting_turns = None
    first = prompts.build(ctx)
    if upto == "prompts":
        return topo_order([first])  # the first turns: later ones need the target's answers
    whole, waiting = later_turns(ctx, first)
    if whole is None:  # a turn's completions are missing: this graph makes them (execution.py runs it again)
        return topo_order([waiting])
    roots = [completions.build(ctx, whole)]
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


def later_turns(ctx: RunContext, first: Node) -> tuple[Node | None, Node | None]:
    """The prompt set with every later turn of its multi-turn records (suite:mt-bench), as the
    peers ask them: turn k+1's messages are turn k's, the target's answer to it, then the next user
    turn. A later turn's prompt is a prompt record like any other, keyed by its content (the answer
    included), with the id ``ID/turnK``; it is made from the stored completion of the turn before.

    Returns ``(prompts node, None)``, or ``(None, completions node)`` when some turn's completions
    are not stored yet: the graph then ends at that node (making them is the run's work, or
    offline the usual missing-node error) and ``ctx.waiting_turns`` says why; the run builds the
    graph again after it (runner/core/execution.py). Nothing here contacts anything."""
    from dfcache.keys import messages_digest
    from dfcache.samples import SampleSet, index_of

    turns = first.spec.turns
    if not turns:
        return first, None
    node, at = first, {b: b for b in turns}  # record position -> the position of its latest turn's prompt
    answers: dict[int, list[str]] = {b: [] for b in turns}
    k = 1
    while True:
        asking = [b for b in turns if len(turns[b]) > k]
        if not asking:
            return node, None
        comp = completions.build(ctx, node)
        keys = [comp.sample_keys[at[b]] for b in asking]
        missing = index_of(ctx.store).missing(comp.partition.key, keys)
        if missing:
            ctx.waiting_turns = (f"the prompts of turn {k + 1} of {len(asking)} multi-turn prompt(s) are made from "
                                 f"the target's answers to turn {k} ({len(set(missing))} not stored yet)")
            return None, comp
        docs = SampleSet(ctx.store, comp.partition.key, keys).docs()
        ids, upstream, records = list(node.ids), list(node.upstream_samples), []
        for b, doc in zip(asking, docs):
            answers[b].append(doc["text"])
            messages = []
            for user, answer in zip(turns[b], answers[b]):
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": turns[b][k]})
            at[b] = len(ids)
            ids.append(f"{first.ids[b]}/turn{k + 1}")
            upstream.append(messages_digest(messages))
            records.append({"id": ids[-1], "messages": messages})
        source = first.summary.partition(" prompts from ")[2]  # `ls` names the set by it (core/summaries.py)
        node = prompts.node(ids, upstream, prompts.JoinedRecords(node.spec.records, records), turns,
                            f"{len(ids)} prompts from {source} (turns 1-{k + 1})")
        k += 1


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
