"""Stage `hidden_states`: the target's per-layer hidden states over every token, one artifact per layer.

Key recipe (``KEY`` below; ``build()`` makes its nodes through it)::

    key = compute_key('hidden_states', 1, inputs, upstream)
    inputs:
        target        fingerprint of the target directory (the tokens node's "target")
        layer         k: output of decoder layer k = HF hidden_states[k+1], before the final norm
                      (the last layer too)
        backend       the KernelSpec: {kernel: fla|torch, device: cuda|cpu, dtype: bfloat16|float32,
                      attn_implementation: sdpa|...}
        versions      {package: installed version} for each --key-versions package (only some runs
                      have it)
    upstream:
        tokens        the tokens key

Layer-granular on purpose: a drafter needing layers [1, 16, 31] reuses every layer already stored
for the same tokens, model and backend class. All layer nodes of one (tokens, target, backend)
share a ``group``, so the runner calls :func:`produce` once with every missing layer and one
forward pass per batch computes them all, stopping after the deepest.

Output (one artifact per layer): array ``hidden`` [total_tokens, hidden_size], the model's dtype
exactly (bf16 stored as its uint16 bits, or fp32), rows in the tokens artifact's order (sample i is
rows ``offsets[i]:offsets[i+1]``), chunked along tokens; ``--compression none|zstd``.
Exact library versions, the GPU, the kernel functions really bound and the batching are
provenance, not key material. Extraction is resumable: an interrupted run keeps every checkpointed
window (see extract.py beside this module) and the next run continues from there.
"""

from __future__ import annotations

import numpy as np

from dfcache.errors import BadInputError, UsageError
from dfcache.keys import fingerprint_path

from ...graph import KeyRecipe, Node, RunContext
from ...summaries import origin
from ...models.target import KernelSpec, kernel_problem, check_layer_ids, read_model_info, resolve_kernel
from ...provenance_keys import key_version_inputs

KEY = KeyRecipe("hidden_states", 1, inputs={
    "target": 'fingerprint of the target directory (the tokens node\'s "target")',
    "layer": "k: output of decoder layer k = HF hidden_states[k+1], before the final norm (the last "
             "layer too)",
    "backend": "the KernelSpec: {kernel: fla|torch, device: cuda|cpu, dtype: bfloat16|float32, "
               "attn_implementation: sdpa|...}",
    "versions": "{package: installed version} for each --key-versions package",
}, upstream={"tokens": "the tokens key"}, optional=frozenset({"versions"}))
NAME = KEY.stage
VERSION = KEY.version


def requested_layers(ctx: RunContext, drafters) -> list[int]:
    """The union of the drafters' ``target_layer_ids`` and ``--layer`` ids, sorted."""
    layers: set[int] = set()
    for d in drafters:
        ids = getattr(d, "target_layer_ids", None)
        if ids is None:
            raise BadInputError(f"drafter {getattr(d, 'name', d)!r} has no target_layer_ids; its "
                                "config.json needs dflash_config.target_layer_ids.")
        layers.update(ids)
    if ctx.options.layers:
        layers.update(ctx.options.layers)
    if not layers:
        raise BadInputError("no hidden-state layers requested: pass --layer (repeatable, e.g. --layer 1 "
                            "--layer 3) or a drafter (--drafter DIR) whose dflash_config.target_layer_ids "
                            "name them.")
    for k in layers:
        if isinstance(k, bool) or not isinstance(k, int):
            raise BadInputError(f"layer id {k!r} is not an integer; pass decoder-layer indices.")
    return sorted(layers)


def build(ctx: RunContext, tokens_node: Node, layers) -> dict[int, Node]:
    """One node per layer; resolves the backend class without importing torch."""
    opts = ctx.options
    payload = tokens_node.payload if isinstance(tokens_node.payload, dict) else {}
    target_dir = payload.get("target_dir") or opts.target
    if not target_dir:
        raise UsageError("no target model: pass --target with the model whose hidden states to extract.")
    info = read_model_info(target_dir)
    layers = check_layer_ids(list(layers), info.num_layers)
    target_fp = tokens_node.inputs.get("target") or fingerprint_path(target_dir)
    backend = resolve_kernel(opts.backend, opts.device, opts.dtype,
                             getattr(opts, "attn_implementation", "sdpa"),
                             has_linear_attention=info.has_linear_attention, check=False)
    needs = "gpu" if backend.device == "cuda" else "cpu"
    group = f"{NAME}/{tokens_node.key}/{target_fp}/{backend.label}"
    nodes = {}
    for k in layers:
        nodes[k] = KEY.node(
            inputs={"target": target_fp, "layer": k, "backend": backend.to_key(), **key_version_inputs(opts)},
            upstream={"tokens": tokens_node.key}, needs=needs, deps=[tokens_node],
            label=f"hidden_states[{k}]", group=group,
            fix=(f"{ctx.command_with()} (on a machine with a CUDA GPU)" if needs == "gpu" else None),
            summary=f"layer {k}/{info.num_layers}",
            payload={"target_dir": str(target_dir), "layer": k, "backend": backend.to_key(),
                     "note": backend.note, "tokens": tokens_node.key})
    if any(not _stored_somewhere(ctx, n.key) for n in nodes.values()):
        from ...models.resolve import require_weights

        require_weights(target_dir, "extracting hidden states runs the model: pass the directory that holds "
                                    "its weights with --target.")
    problem = kernel_problem(backend)
    if problem:
        # Cached states of any backend class are usable anywhere; computing missing ones is what
        # needs the hardware. Say so now, before any other stage does work.
        missing = [k for k, n in nodes.items() if not _stored_somewhere(ctx, n.key)]
        if missing:
            raise BadInputError(f"hidden states of layer(s) {', '.join(map(str, missing))} for {backend.label} "
                                f"are not in the store and cannot be computed here. {problem}")
    return nodes


def _stored_somewhere(ctx: RunContext, key: str) -> bool:
    if ctx.store.has(key):
        return True
    for remote in ctx.remotes:
        try:
            if remote.has(key):
                return True
        except Exception:  # an unreachable remote is reported by the resolver, not here
            continue
    return False


def get_target(ctx: RunContext, target_dir: str, backend: KernelSpec):
    """The loaded target for ``backend``, loaded once per run (kept in ``ctx.cache``)."""
    from ...models.target import load_target

    key = (str(target_dir), backend.label)
    t = ctx.cache.targets.get(key)
    if t is None:
        t = load_target(target_dir, backend)
        ctx.cache.targets[key] = t
    return t


def _read_tokens(ctx: RunContext, key: str, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    art = ctx.store.open(key)
    ids = art.array("token_ids").read()
    offsets = art.array("offsets").read().astype(np.int64)
    if (len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(ids)
            or (len(offsets) > 1 and np.any(np.diff(offsets) < 0))):
        raise BadInputError(f"tokens artifact {key} has inconsistent offsets; delete it "
                            f"(dfcache gc --key {key[:12]} --yes) and run again.")
    if len(ids) and vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise BadInputError(f"tokens artifact {key} holds token id {int(ids.max())}, outside the target's "
                            f"vocabulary of {vocab_size}; the tokens come from another tokenizer. Pass the "
                            "matching --target.")
    return ids, offsets


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    groups: dict[str, list[Node]] = {}
    for n in nodes:
        groups.setdefault(n.group or n.key, []).append(n)
    for group in groups.values():
        _produce_group(ctx, group)


def _produce_group(ctx: RunContext, nodes: list[Node]) -> None:
    from .extract import LayerSink, extract

    nodes = sorted((n for n in nodes if not ctx.store.has(n.key)), key=lambda n: n.payload["layer"])
    if not nodes:
        return
    p = nodes[0].payload
    backend = KernelSpec(**p["backend"])
    if p.get("note"):
        ctx.log(f"hidden states: {p['note']}")
    target = get_target(ctx, p["target_dir"], backend)
    target.check_layers([n.payload["layer"] for n in nodes])  # planning read config.json; verify on the model
    token_ids, offsets = _read_tokens(ctx, p["tokens"], target.info.vocab_size)
    total = int(offsets[-1])
    dtype = backend.dtype
    provenance = {**target.provenance, "batching": "equal-length samples per batch, no padding",
                  "batch_tokens": ctx.options.batch_tokens}
    writers, sinks = [], []
    try:
        # Sorted by layer: every process takes the per-key locks in one order, so two runs that
        # share some layers wait for each other instead of deadlocking.
        for n in nodes:
            w = ctx.store.writer(n.key, stage=NAME, stage_version=VERSION, inputs=n.inputs,
                                 upstream=n.upstream, provenance=provenance,
                                 summary=f"{n.summary}: {origin(ctx.store, p['tokens'])}",
                                 resumable=True)
            if ctx.store.has(n.key):  # another process committed it while we waited for its lock
                w.discard()
                continue
            writers.append(w)
            aw = w.create_array("hidden", (total, target.hidden_size), dtype, codec=ctx.options.compression)
            sinks.append(LayerSink(layer=n.payload["layer"], writer=w, array=aw))
        if not sinks:
            return
        desc = f"hidden states L{','.join(str(s.layer) for s in sinks)}"
        stats = extract(target, token_ids, offsets, sinks, batch_tokens=ctx.options.batch_tokens,
                        progress_factory=lambda n: ctx.progress(n, desc, unit="tok", unit_scale=True),
                        on_checkpoint=ctx.hooks.on_extract_checkpoint, log=ctx.log)
        for w in writers:
            w.commit()
    except BaseException:
        for w in writers:
            if w.manifest is None:
                w.abort()  # resumable: the checkpointed windows stay for the next run
        raise
    ctx.last_extract_stats = stats
    ctx.log(f"hidden states: layers {[s.layer for s in sinks]} over {total} tokens "
            f"({backend.label}): {stats.tokens} tokens in {stats.wall_s:.1f} s "
            f"({stats.tokens_per_s:,.0f} tok/s){f', {stats.tokens_resumed} resumed' if stats.tokens_resumed else ''}")


def read_layer(store, key: str, start: int = 0, stop: int | None = None):
    """Rows [start, stop) of a hidden-state artifact as a torch tensor in its stored dtype."""
    import torch

    arr = store.open(key).array("hidden")
    raw = arr.read_raw(start, stop)
    if arr.dtype == "bfloat16":
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)
