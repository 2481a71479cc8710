"""Stage `hidden_states`: the target's per-layer hidden states over every token, one partition per layer.

Key recipe (per sample; ``KEY`` below, ``build()`` makes its nodes through it)::

    partition = compute_key('hidden_states', 2, inputs, upstream)
    sample    = sample_key(partition, tokens sample key)
    inputs:
        target        fingerprint of the target directory (the tokens node's "target")
        layer         k: output of decoder layer k = HF hidden_states[k+1], before the final norm
                      (the last layer too); or "final": the state after the final norm (what the
                      lm_head reads)
        backend       the KernelSpec: {kernel: fla|torch, device: cuda|cpu, dtype: bfloat16|float32,
                      attn_implementation: sdpa|...}, plus states: fp8-e4m3 for lossy FP8 states
                      (only then)
        versions      {package: installed version} for each --key-versions package (only some runs
                      have it)
    upstream:
        sample        the tokens partition

Sample- and layer-granular on purpose: a drafter needing layers [1, 16, 31] reuses every layer
of every sample already stored for the same tokens, model and backend class, whatever set it was
extracted in. All layer nodes of one (tokens, target, backend) share a ``group``, so the runner
calls :func:`produce` once with every layer that misses samples, and one forward pass per batch
computes, for the missing samples only, every layer that misses them, stopping after the deepest.

The final state (layer id ``"final"``, ``runner.models.target.FINAL``): the target's last hidden
state after its final norm, what its lm_head reads (SGLang's ``last_hidden_states``). It is an
artifact of its own, keyed ``layer: "final"`` (no decoder layer's key can equal it; theirs are
unchanged), computed in the same forward as the layers of its group (which then runs every layer
and the norm, not the lm_head), reused by any family that reads it: EAGLE-3's teacher in
SpecForge's layout, DSpark's training data. It is requested by ``--final-state``, and by `run
hidden-states` / `export` for a drafter whose family trains on it (runner/drafters/family.py).

Output, per sample: array ``hidden`` [tokens, hidden_size], the model's dtype exactly (bf16 stored
as its uint16 bits, or fp32), chunked along tokens; ``--compression none|zstd|shuffle-zstd|bitshuffle-lz4``
(lossless), or ``fp8-e4m3[+lossless]``: FP8 codes and a per-token scale (dfcache/fp8.py), quantized
where the rows are computed (on the GPU for a CUDA target). Samples are
committed in segments of about ``DFCACHE_SEGMENT_BYTES`` (default 256 MiB) per layer, so an
interrupted extraction keeps every finished segment and the next run computes only the samples
still missing. Exact library versions, the GPU, the kernel functions really bound and the
batching are provenance, not key material.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dfcache.errors import BadInputError, UsageError
from dfcache.fp8 import check_applies, stored_array
from dfcache.keys import fingerprint_path

from ...core.graph import HiddenStatesSpec, KeyRecipe, Node, RunContext
from ...core.summaries import samples_origin
from ...models.target import (FINAL, KernelSpec, check_layer_ids, deepest_run, kernel_problem, layer_name,
                              layer_order, read_model_info, resolve_kernel)
from ...core.provenance_keys import key_version_inputs

if TYPE_CHECKING:  # numpy is imported where arrays are made: planning a cached graph needs none
    import numpy as np

KEY = KeyRecipe("hidden_states", 2, inputs={
    "target": 'fingerprint of the target directory (the tokens node\'s "target")',
    "layer": "k: output of decoder layer k = HF hidden_states[k+1], before the final norm (the last "
             "layer too); or \"final\": the state after the final norm (what the lm_head reads)",
    "backend": "the KernelSpec: {kernel: fla|torch, device: cuda|cpu, dtype: bfloat16|float32, "
               "attn_implementation: sdpa|...}, plus states: fp8-e4m3 for lossy FP8 states (only then)",
    "versions": "{package: installed version} for each --key-versions package",
}, upstream={"sample": "the tokens partition"}, optional=frozenset({"versions"}), sample="tokens sample key")
NAME = KEY.stage
VERSION = KEY.version


def requested_layers(ctx: RunContext, drafters, *, training: bool = False) -> list:
    """The union of the drafters' ``target_layer_ids`` and ``--layer`` ids, sorted, then ``"final"``
    (the state after the final norm) with ``--final-state`` or, when ``training`` (`run
    hidden-states`: what the drafters train on), a drafter whose family trains on it."""
    from ...drafters.family import trains_on_final_state
    from ...models.target import FINAL, sort_layers

    layers: set = set()
    if getattr(ctx.options, "final_state", False) or (training and any(
            trains_on_final_state(getattr(d, "family", None)) for d in drafters)):
        layers.add(FINAL)
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
                            "--layer 3), --final-state, or a drafter (--drafter DIR) whose "
                            "dflash_config.target_layer_ids name them.")
    for k in layers:
        if k != FINAL and (isinstance(k, bool) or not isinstance(k, int)):
            raise BadInputError(f"layer id {k!r} is not an integer; pass decoder-layer indices.")
    return sort_layers(layers)


def build(ctx: RunContext, tokens_node: Node, layers) -> dict:
    """One node per layer; resolves the backend class without importing torch."""
    opts = ctx.options
    target_dir = getattr(tokens_node.spec, "target_dir", None) or opts.target
    if not target_dir:
        raise UsageError("no target model: pass --target with the model whose hidden states to extract.")
    info = read_model_info(target_dir)
    layers = check_layer_ids(list(layers), info.num_layers)
    target_fp = tokens_node.inputs.get("target") or fingerprint_path(target_dir)
    backend = resolve_kernel(opts.backend, opts.device, opts.dtype,
                             getattr(opts, "attn_implementation", "sdpa"),
                             has_linear_attention=info.has_linear_attention, check=False)
    needs = "gpu" if backend.device == "cuda" else "cpu"
    lossy, _ = check_applies(opts.compression, stage=NAME, dtype=backend.dtype)
    key_backend = {**backend.to_key(), **({"states": lossy} if lossy else {})}  # lossy states: keyed apart
    group = f"{NAME}/{tokens_node.partition.key}/{target_fp}/{backend.label}" + (f"/{lossy}" if lossy else "")
    problem = kernel_problem(backend)
    nodes = {}
    for k in layers:
        nodes[k] = KEY.samples(
            inputs={"target": target_fp, "layer": k, "backend": key_backend, **key_version_inputs(opts)},
            upstream_samples=tokens_node.sample_keys, upstream_bytes=tokens_node.sample_key_bytes,
            partition_upstream={"sample": tokens_node.partition.key},
            ids=tokens_node.ids, needs=needs, deps=[tokens_node],
            label=f"hidden_states[{k}]", group=group,  # hidden_states[final]: after the final norm
            # Cached states of any backend class are usable anywhere; computing missing ones is what
            # needs the hardware: resolve() says so before any stage does work.
            problem=f"(hidden states for {backend.label}) {problem}" if problem else None,
            fix=(f"{ctx.command_with()} (on a machine with a CUDA GPU)" if needs == "gpu" else None),
            summary=(f"layer {k}/{info.num_layers}" if k != FINAL else
                     f"layer {layer_name(k)}"),
            spec=HiddenStatesSpec(target_dir=str(target_dir), layer=k, backend=backend, tokens=tokens_node,
                                  states=lossy or None),
            precheck=lambda: _require_weights(target_dir))
    return nodes


def _require_weights(target_dir) -> None:
    from ...models.resolve import require_weights

    require_weights(target_dir, "extracting hidden states runs the model: pass the directory that holds "
                                "its weights with --target.")


def get_target(ctx: RunContext, target_dir: str, backend: KernelSpec):
    """The loaded target for ``backend``, loaded once per run (kept in ``ctx.cache``)."""
    from ...models.target import load_target

    key = (str(target_dir), backend.label)
    t = ctx.cache.targets.get(key)
    if t is None:
        t = load_target(target_dir, backend, worker=ctx.worker)
        ctx.cache.targets[key] = t
    return t


def segment_bytes() -> int:
    from dfcache.config import segment_bytes as configured

    return configured()


class _SegmentRows:
    """Takes one layer's rows in token order (any split, never across a segment's end: extract's
    boundaries) and hands each finished sample to the writer of the segment it belongs to: what
    the extraction pipeline's layer sinks write into."""

    rows_written = 0  # nothing to resume: a segment is committed whole or not at all

    def __init__(self, writer_for, cuts: list[tuple[int, int]], lengths, state: dict, empty: np.ndarray) -> None:
        self.empty = empty  # a sample of no tokens, in the storage dtype
        self.writer_for = writer_for  # segment index -> its (open) writer for this layer
        self.cuts = cuts
        self.lengths = lengths
        self.state = state  # {"segment": the segment being filled}
        self._i = 0  # next sample (global index in the extraction's order)
        self._parts: list[np.ndarray] = []
        self._have = 0

    def _add_empty_samples(self, w, stop: int) -> None:
        while self._i < stop and self.lengths[self._i] == 0:
            w.add({"hidden": self.empty})
            self._i += 1

    def append(self, rows: np.ndarray) -> None:
        seg = self.state["segment"]
        w = self.writer_for(seg)
        stop = self.cuts[seg][1]
        while len(rows):
            self._add_empty_samples(w, stop)
            need = int(self.lengths[self._i]) - self._have
            take, rows = rows[:need], rows[need:]
            self._parts.append(take)
            self._have += len(take)
            if self._have == self.lengths[self._i]:
                if len(self._parts) == 1:
                    one = self._parts[0]
                else:
                    import numpy as np

                    one = np.concatenate(self._parts)
                w.add({"hidden": one})
                self._parts, self._have = [], 0
                self._i += 1

    def finish_segment(self, w) -> None:
        """Before the segment's commit: its trailing (or only) empty samples."""
        self._add_empty_samples(w, self.cuts[self.state["segment"]][1])

    def checkpoint(self, state=None) -> None:
        """The pipeline checkpoints after every window; a segment commits only whole."""


def _commit_or_abort(writer) -> None:
    """Commit a segment writer; if its commit fails, remove what it staged (the writer's own
    ``CommitOnExit``)."""
    with writer:
        pass


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    groups: dict[str, list[Node]] = {}
    for n in nodes:
        groups.setdefault(n.group or n.key, []).append(n)
    for group in groups.values():
        _produce_group(ctx, group)


def _produce_group(ctx: RunContext, nodes: list[Node]) -> None:
    from dfcache.samples import SampleArray, SegmentWriter, index_of

    from ..tokens import read_tokens
    from .extract import LayerSink, extract

    nodes = sorted(nodes, key=lambda n: layer_order(n.spec.layer))
    # Which layers each missing tokens sample lacks (another process may have committed some since
    # planning); samples lacking the same layers share forward passes.
    lacking: dict[str, list[Node]] = {}
    for n in nodes:
        have = index_of(ctx.store).partition(n.partition.key)
        for i in n.positions_distinct(n.produce):
            if n.sample_keys[i] not in have:
                lacking.setdefault(n.upstream_samples[i], []).append(n)
    if not lacking:
        return
    p = nodes[0].spec
    tokens_node = p.tokens
    backend = p.backend
    if backend.note:
        ctx.log(f"hidden states: {backend.note}")
    target = get_target(ctx, p.target_dir, backend)
    target.check_layers([n.spec.layer for n in nodes])  # planning read config.json; verify on the model
    position_of = {u: i for i, u in enumerate(tokens_node.sample_keys)}
    by_layers: dict[tuple, list[str]] = {}
    for u, ns in lacking.items():
        by_layers.setdefault(tuple(n.spec.layer for n in ns), []).append(u)
    row_shape, stored_dtype, lossless = stored_array(target.hidden_size, backend.dtype, ctx.options.compression)
    lossy = stored_dtype != backend.dtype  # FP8: extract quantizes where the rows are computed
    row_bytes = row_shape[0] * (4 if stored_dtype == "float32" else 1 if lossy else 2)
    budget = max(1, segment_bytes() // row_bytes)  # tokens a segment of one layer
    provenance = {**target.provenance, "batching": "equal-length samples per batch, no padding",
                  "batch_tokens": ctx.options.batch_tokens}
    node_of = {n.spec.layer: n for n in nodes}
    origin = samples_origin(ctx.store, getattr(tokens_node.spec, "completions", None))
    total_tokens, segments = 0, 0
    import time
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    t0 = time.perf_counter()
    stats = None
    for layers, ups in by_layers.items():
        ups = sorted(ups)  # a segment's samples are in upstream-key order
        toks = read_tokens(ctx.store, tokens_node, [position_of[u] for u in ups])
        if toks.token_ids.size and (int(toks.token_ids.min()) < 0
                                    or int(toks.token_ids.max()) >= (target.info.vocab_size or 1 << 62)):
            raise BadInputError(f"the tokens hold id {int(toks.token_ids.max())}, outside the target's vocabulary "
                                f"of {target.info.vocab_size}; they come from another tokenizer. Pass the matching "
                                "--target.")
        lengths = np.diff(toks.offsets).astype(np.int64)
        # Segments of about `budget` tokens (at least one sample each): [(first, stop), ...]
        cuts, start = [], 0
        while start < len(ups):
            stop, tokens = start, 0
            while stop < len(ups) and (stop == start or tokens + lengths[stop] <= budget):
                tokens += int(lengths[stop])
                stop += 1
            cuts.append((start, stop))
            start = stop
        open_writers: dict[int, object] = {}  # layer -> the segment writer being filled

        def writer_for(k: int, seg: int):
            w = open_writers.get(k)
            if w is None:
                first, stop = cuts[seg]
                w = SegmentWriter(ctx.store, node_of[k].partition, ups[first:stop], doc=False,
                                  arrays={"hidden": SampleArray(row_shape, stored_dtype, lossless)},
                                  summary=f"{node_of[k].summary}: {origin}", provenance=provenance,
                                  rows={"hidden": int(toks.offsets[stop] - toks.offsets[first])})
                open_writers[k] = w
            return w

        state = {"segment": 0}
        committing: list = []  # (segment, its layers' commit futures): one segment at a time

        def settle() -> None:
            # Runs in the pipeline's writer thread at the next boundary (or after the pipeline):
            # the segment whose commits were started there is committed, then counted and hooked.
            nonlocal total_tokens, segments
            if not committing:
                return
            seg, futures = committing.pop()
            errors = [e for e in (f.exception() for f in futures) if e is not None]
            if errors:
                raise errors[0]
            first, stop = cuts[seg]
            total_tokens += int(toks.offsets[stop] - toks.offsets[first])
            segments += 1
            hook = ctx.hooks.on_extract_checkpoint
            if hook is not None:
                hook(segments - 1, total_tokens)

        def commit_segment(seg: int, _token=None) -> None:
            # Runs in the pipeline's writer thread, between two segments' rows (extract's
            # boundaries). The layers' commits (each waits for its chunk files' fsyncs, then
            # publishes) run on their own threads, side by side, while the writer goes on with
            # the next segment's rows: one after the other in the writer thread they stalled it at
            # every boundary (1.25 B on an H100: the extraction waited 2.3 s of its 2.9 s on the
            # writer, 0.82x of the bare forward, 2026-12-07).
            settle()
            started = []
            for k in layers:
                sinks_by_layer[k].finish_segment(writer_for(k, seg))
                started.append(commits.submit(_commit_or_abort, open_writers.pop(k)))
            committing.append((seg, started))
            state["segment"] = seg + 1

        empty = np.zeros((0,) + row_shape, np.uint8 if lossy else np.float32 if stored_dtype == "float32" else np.uint16)
        sinks_by_layer = {k: _SegmentRows(lambda seg, k=k: writer_for(k, seg), cuts, lengths, state, empty)
                          for k in layers}
        sinks = [LayerSink(layer=k, writer=sinks_by_layer[k], array=sinks_by_layer[k]) for k in layers]
        desc = f"hidden states L{','.join(map(str, layers))}"
        commits = ThreadPoolExecutor(max_workers=len(layers), thread_name_prefix="dfcache-segment-commit")
        try:
            # One pipeline over every segment, so compute never waits for a segment's commit.
            stats = extract(target, toks.token_ids, toks.offsets, sinks, batch_tokens=ctx.options.batch_tokens,
                            progress_factory=lambda n: ctx.progress(n, desc, unit="tok", unit_scale=True),
                            log=ctx.log, boundaries=[int(toks.offsets[stop]) for _, stop in cuts],
                            on_boundary=commit_segment, quantize=lossy)
            for seg in range(state["segment"], len(cuts)):  # segments of empty samples only, when nothing ran
                commit_segment(seg)
            settle()
        except BaseException:
            for _seg, futures in committing:  # a segment whose rows are all written still commits
                for f in futures:
                    f.exception()
            for w in open_writers.values():
                w.abort()
            raise
        finally:
            commits.shutdown(wait=True)
    wall = time.perf_counter() - t0
    ctx.last_extract_stats = stats
    if total_tokens:
        from ...core.extract_rates import record_rate  # for `dfcache plan --estimate` of later runs

        depths = [deepest_run([n.spec.layer], target.num_layers) for n in nodes]  # "final" runs them all
        record_rate(ctx.store, target.info, backend.dtype, target.provenance.get("gpu") or backend.device,
                    sorted(set(depths)), total_tokens, wall)
    ctx.log(f"hidden states: {len(lacking)} sample(s), layers {[n.spec.layer for n in nodes]} "
            f"({backend.label}{', ' + ctx.options.compression if lossy else ''}): {total_tokens} tokens in "
            f"{segments} segment(s), {wall:.1f} s ({total_tokens / wall if wall > 0 else 0:,.0f} tok/s)")
    if lossy:
        t1 = time.perf_counter()
        _log_lossy_error(ctx, nodes)
        ctx.last_lossy_check_s = time.perf_counter() - t1


# Samples the lossy-vs-exact line compares per layer, at most: reading every sample back took
# about 13 s a layer after a 3.3 s FP8 extraction of 128 x 2048 tokens at hidden 2048 (H200
# host, 2026-12-06), longer than the extraction; 16 samples give the same figures to a few
# parts in a thousand (rel_l2 and cos are means over millions of values).
LOSSY_CHECK_SAMPLES = 16


def _evenly_spaced(n: int, k: int) -> list[int]:
    """``min(n, k)`` positions of ``range(n)``, evenly spaced, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _log_lossy_error(ctx: RunContext, nodes: list[Node]) -> None:
    """Lossy states just extracted whose exact (bf16) states of the same samples are cached too: the
    per-layer error, as `dfcache diff` reports it, and the command that gives its cost in τ."""
    from dfcache.diff import diff_sample_sets
    from dfcache.samples import Partition, index_of

    idx = index_of(ctx.store)
    shown = False
    for n in nodes:
        exact_backend = {k: v for k, v in n.inputs["backend"].items() if k != "states"}
        exact = Partition(n.partition.stage, n.partition.version, {**n.inputs, "backend": exact_backend},
                          n.partition.upstream)
        keys = exact.sample_keys(n.upstream_samples)
        have = idx.partition(exact.key)
        if not keys or any(k not in have for k in keys):
            continue
        picks = _evenly_spaced(len(keys), LOSSY_CHECK_SAMPLES)
        d = diff_sample_sets(ctx.store, (exact.key, [keys[i] for i in picks]),
                             (n.partition.key, [n.sample_keys[i] for i in picks]), "hidden")
        which = (f"the same {len(keys)} sample(s)" if len(picks) == len(keys) else
                 f"{len(picks)} of the same {len(keys)} samples (evenly spaced; `dfcache diff` compares them all)")
        ctx.log(f"hidden states: layer {n.spec.layer} {n.inputs['backend']['states']} vs the cached "
                f"{exact_backend.get('dtype')} states of {which}: rel_l2 {d.rel_l2:.6f}, "
                f"max_abs {d.max_abs:.4g}, cos_mean {d.cos_mean:.6f}, cos_min {d.cos_min:.6f}")
        shown = True
    if shown:
        ctx.log("hidden states: their cost in τ on your drafters: dfcache compare-backends --backend "
                f"{exact_backend.get('kernel')} --codec none --codec {ctx.options.compression} with this run's "
                "--target, --drafter and prompt options")


def read_layer(store, node: Node, positions=None):
    """A layer node's states of the samples at ``positions`` (default: the whole set), in set
    order and concatenated along tokens, as a torch tensor in the stored dtype."""
    import numpy as np
    import torch

    from dfcache.samples import SampleSet

    positions = list(range(len(node.sample_keys))) if positions is None else list(positions)
    # read, not read_raw: FP8 states come dequantized to bf16 (dfcache/fp8.py)
    raw = SampleSet(store, node.partition.key, [node.sample_keys[i] for i in positions]).read_many("hidden")
    raw = np.concatenate(raw) if raw else np.zeros((0, 0), np.float32)
    if raw.dtype.name == "bfloat16":
        raw = raw.view(np.uint16)
    if raw.dtype == np.uint16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)
