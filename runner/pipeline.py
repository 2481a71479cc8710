"""The eval graph: prompts → completions → tokens → hidden_states[layer] → drafter_eval → report.

``build_graph(ctx, upto)`` wires the stages; it resolves inputs and computes every key without
doing any work (and without importing torch).
"""

from __future__ import annotations

from .graph import Node, RunContext, topo_order

TARGETS = ("prompts", "completions", "tokens", "hidden-states", "eval")


def build_graph(ctx: RunContext, upto: str = "eval") -> list[Node]:
    from .stages import prompts

    if upto not in TARGETS:
        from dfcache.errors import UsageError

        raise UsageError(f"unknown target {upto!r}; choose one of {', '.join(TARGETS)}.")
    roots: list[Node] = [prompts.build(ctx)]
    if upto == "prompts":
        return topo_order(roots)
    from .stages import completions

    roots = [completions.build(ctx, roots[0])]
    if upto == "completions":
        return topo_order(roots)
    from .stages import tokens

    tok = tokens.build(ctx, roots[0])
    if upto == "tokens":
        return topo_order([tok])
    from .stages import hidden_states

    drafters = []
    if upto == "eval" or ctx.options.drafters:
        # `run hidden-states --drafter D` extracts the layers D reads (its target_layer_ids).
        from .stages import drafter_eval

        drafters = drafter_eval.resolve_drafters(ctx)
    layers = hidden_states.requested_layers(ctx, drafters)
    hs = hidden_states.build(ctx, tok, layers)
    if upto == "hidden-states":
        return topo_order(list(hs.values()))
    from .stages import drafter_eval, report

    evals = [drafter_eval.build(ctx, tok, hs, d) for d in drafters]
    return topo_order([report.build(ctx, evals)])
