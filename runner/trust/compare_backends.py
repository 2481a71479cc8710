"""`dfcache compare-backends`: each drafter's τ on two (or more) backends' hidden states, side by side
with the per-layer numeric differences of those states.

A drafter trained on one kernel family and served on another can lose acceptance (vLLM PR #43081:
τ 8.23 with FlashInfer vs 8.02 with FlashAttention; fla vs the PyTorch fallback on gated-DeltaNet
targets, DESIGN §1). This command answers "how much does it matter for *this* drafter": the same
tokens (the prompts, completions and tokens of the graph built with ``--completions-backend``, by
default the first ``--backend``; server completions are backend-independent anyway), hidden states of every requested backend
class over those tokens, one eval per (drafter, backend), and ``dfcache diff`` figures per layer
between the first backend and each other one.

``--codec`` (issue 33) is the other axis: one backend, its states stored exact (``none``) and
lossy (``fp8-e4m3``), the same drafters and budgets on each, and the per-layer numeric error of the
lossy states against the exact ones: what FP8 storage costs in τ on the user's own drafters.

Everything is the normal graph: cached artifacts are reused, missing ones are produced where
this machine can (states of a backend it cannot run, e.g. fla on a CPU machine, must already be
in the store or a remote; planning says so before any work). The evals run on the device the
states were made on, or on the CPU when no GPU is usable here (an eval's device is keyed).
"""

from __future__ import annotations

import dataclasses

from dfcache.errors import UsageError

from ..core.graph import RunContext, check_offline, resolve, topo_order
from ..core.options import EvalOptions


def _backend_graph(ctx: RunContext, tokens_node, drafters, layers):
    from ..stages import drafter_eval, hidden_states

    hs = hidden_states.build(ctx, tokens_node, layers)
    evals = [drafter_eval.build(ctx, tokens_node, hs, d) for d in drafters]
    return hs, evals


def run_compare(store, opts: EvalOptions, backends: list[str], *, completions_backend: str | None = None,
                remotes=None, argv=None, codecs: list[str] | None = None) -> dict:
    """Plan every backend's (or codec's) nodes first (so an impossible one fails before work), then run them."""
    from dfcache.fp8 import check_applies

    from ..core.pipeline import build_graph, execute
    from ..stages import drafter_eval, hidden_states

    backends = list(dict.fromkeys(backends))
    codecs = list(dict.fromkeys(codecs or [opts.compression]))
    lossy = [check_applies(c, stage="hidden_states", dtype=opts.dtype)[0] for c in codecs]
    if len(codecs) > 1:
        if len(backends) != 1:
            raise UsageError("compare one axis at a time: several --codec with one --backend, or several --backend "
                             "with at most one --codec.")
        if len(set(lossy)) != len(lossy):
            raise UsageError(f"--codec {' '.join(codecs)}: lossless codecs store the same states; compare states that "
                             "differ, e.g. --codec none --codec fp8-e4m3.")
    elif len(backends) < 2:
        raise UsageError("compare-backends needs at least two backends, e.g. --backend fla --backend torch, or one "
                         "backend and two codecs, e.g. --backend torch --codec none --codec fp8-e4m3.")
    for b in backends:
        if b not in ("fla", "torch"):
            raise UsageError(f"--backend {b!r}: compare fla and torch (auto would pick one of them).")
    # Local completions are keyed by the backend that generated them; all states must cover the
    # same tokens, so one backend's completions serve every backend.
    cb = completions_backend or backends[0]
    if cb not in backends:
        raise UsageError(f"--completions-backend {cb!r} is not one of the compared backends {backends}.")
    base = RunContext(store, dataclasses.replace(opts, backend=cb, device="auto" if cb == "fla" else opts.device),
                      remotes=remotes, argv=argv)
    upto_tokens = build_graph(base, "tokens")
    tokens_node = upto_tokens[-1]
    drafters = drafter_eval.resolve_drafters(base)
    layers = hidden_states.requested_layers(base, drafters)
    plans = []
    for b, codec in [(b, c) for b in backends for c in codecs]:
        # fla states exist on CUDA only: --device (say cpu for the torch side) does not apply to them.
        dev = "auto" if b == "fla" else opts.device
        ctx = RunContext(store, dataclasses.replace(opts, backend=b, device=dev, compression=codec), remotes=remotes,
                         argv=argv, cache=base.cache)
        hs, evals = _backend_graph(ctx, tokens_node, drafters, layers)
        plans.append((b, ctx, hs, evals))
    all_nodes = topo_order([e for _, _, _, evals in plans for e in evals])
    resolve(base, all_nodes)
    check_offline(base, all_nodes)
    for b, ctx, hs, evals in plans:
        nodes = topo_order(evals)
        resolve(ctx, nodes)
        execute(ctx, nodes)
    res = summarize(store, tokens_node.key, plans, drafters, layers)
    res["axis"] = "codec" if len(codecs) > 1 else "backend"
    return res


def summarize(store, tokens_key: str, plans, drafters, layers) -> dict:
    from dfcache.diff import diff_sample_sets

    from ..stages.drafter_eval import read_summary

    labels = []
    rows = {d.name: {"drafter": d.name, "trained_on": d.trained_on, "evals": {}} for d in drafters}
    for b, _ctx, hs, evals in plans:
        label = _label(hs)
        labels.append(label)
        for d, e in zip(drafters, evals):
            s = read_summary(store, e)
            rows[d.name]["evals"][label] = {"key": e.key, "tau_chain": s["chain"]["tau"],
                                            "tau_tree": {k: t["tau"] for k, t in s["tree"].items()},
                                            "blocks": s["chain"]["num_blocks"]}
    ref_label, ref_hs = labels[0], plans[0][2]
    diffs = []
    for (b, _ctx, hs, _e), label in zip(plans[1:], labels[1:]):
        for k in layers:
            a = diff_sample_sets(store, (ref_hs[k].partition.key, ref_hs[k].sample_keys),
                                 (hs[k].partition.key, hs[k].sample_keys), "hidden")
            diffs.append({"layer": k, "a": ref_label, "b": label, "key_a": ref_hs[k].key, "key_b": hs[k].key,
                          "rel_l2": a.rel_l2, "max_abs": a.max_abs, "cos_mean": a.cos_mean, "cos_min": a.cos_min,
                          "equal": a.equal})
    for r in rows.values():
        ref = r["evals"][ref_label]["tau_chain"]
        for label in labels[1:]:
            other = r["evals"][label]["tau_chain"]
            r.setdefault("delta_tau_chain", {})[label] = None if ref is None or other is None else other - ref
    return {"tokens": tokens_key, "backends": labels, "reference": ref_label, "drafters": list(rows.values()),
            "layers": diffs}


def _label(hs: dict) -> str:
    b = next(iter(hs.values())).inputs["backend"]
    return f"{b['kernel']}/{b['device']}/{b['dtype']}/{b['attn_implementation']}" + (f"+{b['states']}" if b.get("states")
                                                                                    else "")


def _f(v, digits=3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _short(res: dict, label: str) -> str:
    """A column's name: the kernel family (backend axis) or how the states are stored (codec axis)."""
    if res.get("axis") == "codec":
        return label.split("+", 1)[1] if "+" in label else label.split("/")[2]
    return label.split("/")[0]


def format_compare(res: dict) -> str:
    labels = res["backends"]
    budgets = sorted({int(b) for d in res["drafters"] for e in d["evals"].values() for b in e["tau_tree"]})
    what = "codecs" if res.get("axis") == "codec" else "backends"
    lines = [f"{what} over the same tokens ({res['tokens'][:12]}); reference {res['reference']}", ""]
    head = ["drafter"] + [f"τ chain {_short(res, lab)}" for lab in labels] + \
           [f"Δ {_short(res, lab)}" for lab in labels[1:]] + \
           [f"τ tree-{b} {_short(res, lab)}" for b in budgets for lab in labels]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for d in res["drafters"]:
        row = [d["drafter"]] + [_f(d["evals"][lab]["tau_chain"]) for lab in labels]
        row += [_f(d["delta_tau_chain"][lab], 3) for lab in labels[1:]]
        row += [_f(d["evals"][lab]["tau_tree"].get(str(b))) for b in budgets for lab in labels]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "hidden states, per layer (dfcache diff):",
              f"{'layer':>5}  {'A':<28} {'B':<28} {'rel_l2':>9} {'max_abs':>9} {'cos_mean':>9} {'cos_min':>9} {'equal':>6}"]
    for x in res["layers"]:
        lines.append(f"{x['layer']:>5}  {x['a']:<28} {x['b']:<28} {_f(x['rel_l2'], 6):>9} {_f(x['max_abs'], 4):>9} "
                     f"{_f(x['cos_mean'], 6):>9} {_f(x['cos_min'], 6):>9} {100 * x['equal']:>5.1f}%")
    for d in res["drafters"]:
        if d.get("trained_on"):
            lines.append(f"{d['drafter']} was trained on {d['trained_on']} states: that column is the one serving "
                         "with the same kernels reproduces.")
    return "\n".join(lines)
