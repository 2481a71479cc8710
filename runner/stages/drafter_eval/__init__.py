"""Stage `drafter_eval`: offline chain and tree acceptance of one drafter (DFlash or EAGLE-3), per response.

Key recipe (per sample; ``KEY`` below, ``build()`` makes its nodes through it)::

    partition = compute_key('drafter_eval', 4, inputs, upstream)
    sample    = sample_key(partition, tokens sample key)
    inputs:
        drafter             fingerprint of the checkpoint directory (config + weights)
        target_head         fingerprint of the target (its embeddings and lm_head are used)
        block_size          from the drafter's config
        target_layer_ids    from the drafter's config
        mask_token_id       from the drafter's config (only some runs have it)
        tree_budgets        sorted unique --tree-budget values
        max_blocks          --max-blocks, or null
        end_rule            within (continuation is refused)
        dtype               compute dtype of the drafter
        device              cpu | cuda, where the eval runs (--eval-device; not the states' device)
        family              the drafter family when not DFlash (eagle3, dspark), from its
                            config.json (only some runs have it)
        draft_depth         EAGLE-3: drafts per root of the chain (--eagle-steps, else the
                            checkpoint's, else 5) (only some runs have it)
        eagle_trees         EAGLE-3: sorted unique --eagle-tree [topk, steps, draft tokens] (only
                            some runs have it)
        sample_from_anchor  DSpark: true where the anchor slot drafts too (B drafts per block;
                            speculators' default) (only some runs have it)
    upstream:
        sample              the tokens partition
        hidden_states       hidden-state partitions in the drafter's target_layer_ids order

Families (runner/drafters/family.py): a DFlash drafter's inputs are those above without the
EAGLE-3 ones, exactly as before families existed; an EAGLE-3 drafter has no mask_token_id and
no DDTree budgets (it drafts its own tree: ``eagle_trees``), and ``block_size`` is its chain
depth + 1. A DSpark drafter has DFlash's inputs (its backbone's) plus ``family`` (and
``sample_from_anchor`` where its anchor slot drafts too: then ``block_size`` is B + 1, drafts + 1,
as the report counts it), and no DDTree
budgets (``tree_budgets`` [], with a note: its Markov head drafts a chain; DDTree over its
per-slot marginals is not the peers' decoding).

The hidden-state partitions are upstream, so the backend class that produced the states (fla or
torch, device, dtype) is part of this key through them; a response's eval reads the states of
its own tokens sample in each of them. The eval's own numerics (its device and dtype) are keyed
here, apart from them: states extracted with fla on a GPU are evaluated on any machine
(``--eval-device auto`` is CUDA where one is usable, else the CPU).

What it computes (docs/metrics.md, ``metrics.py`` beside this module): for each response,
the draft logits of every candidate block root are scored in batched drafter passes
(``score_roots``: context features of positions < p only), then the greedy walk runs once for the
chain and once per tree budget. ``--max-blocks N`` scores only the roots the first N blocks can
reach (p < P + (N-1)·B + 1) and keeps the first N blocks of each walk, so the limit bounds work
without changing the blocks it keeps.

Output, per sample: the document ``{"prompt_len", "completion_len", "ended_by_stop", "rule",
"chain": [block values], "tree": {budget: [block values]}}``. The report aggregates them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dfcache.errors import BadInputError, ModelNotFoundError
from dfcache.keys import fingerprint_path

from ...core.graph import DrafterEvalSpec, KeyRecipe, Node, RunContext
from ...core.values import int_list, json_kind
from ...core.worker import device_for
from ...drafters.family import eagle_trees, tree_label

# version 3: CPU scoring runs in passes of 64 roots (dflash.CPU_BATCH_ROOTS), not 256; the attention
# groups follow the passes, so CPU logits moved at float rounding (2e-6 on the bench drafter) and an
# argmax at a near-tie could move with them.
# version 4: passes of 128 roots on the CPU (faster at one thread and at two), the same reason.
KEY = KeyRecipe("drafter_eval", 4, inputs={
    "drafter": "fingerprint of the checkpoint directory (config + weights)",
    "target_head": "fingerprint of the target (its embeddings and lm_head are used)",
    "block_size": "from the drafter's config",
    "target_layer_ids": "from the drafter's config",
    "mask_token_id": "from the drafter's config",
    "tree_budgets": "sorted unique --tree-budget values",
    "max_blocks": "--max-blocks, or null",
    "end_rule": "within (continuation is refused)",
    "dtype": "compute dtype of the drafter",
    "device": "cpu | cuda, where the eval runs (--eval-device; not the states' device)",
    "family": "the drafter family when not DFlash (eagle3, dspark), from its config.json",
    "draft_depth": "EAGLE-3: drafts per root of the chain (--eagle-steps, else the checkpoint's, else 5)",
    "eagle_trees": "EAGLE-3: sorted unique --eagle-tree [topk, steps, draft tokens]",
    "sample_from_anchor": "DSpark: true where the anchor slot drafts too (B drafts per block; speculators' default)",
}, upstream={"sample": "the tokens partition",
             "hidden_states": "hidden-state partitions in the drafter's target_layer_ids order"},
   optional=frozenset({"mask_token_id", "family", "draft_depth", "eagle_trees", "sample_from_anchor"}),
   sample="tokens sample key")
NAME = KEY.stage
VERSION = KEY.version


@dataclass
class DrafterRef:
    """A drafter checkpoint as planning sees it: config fields read as JSON (no torch)."""

    path: Path
    name: str
    fingerprint: str
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int | None  # None: a family without a MASK token (EAGLE-3)
    trained_on: str | None
    hidden_size: int | None = None
    step: int | None = None  # training step (runner/drafters/checkpoints.py), when the checkpoint says
    # What the checkpoint's config declares (dflash_config.trained_on_backend): covered by its
    # fingerprint, so a stored report may hold it. ``trained_on`` above is the run's view
    # (--trained-on, else this), a verdict input decided when results are shown, never stored.
    trained_on_declared: str | None = None
    family: str = "dflash"  # runner/drafters/family.py; DFlash adds no key input
    plan: object | None = None  # the family's Plan (runner.drafters.family) where it is not DFlash


def read_drafter(path_str: str, trained_on: str | None = None, target_info=None,
                 eagle_steps: int | None = None) -> DrafterRef:
    """Read a drafter checkpoint's config (its family from runner/drafters/family.py); every problem
    is a BadInputError naming the field. ``target_info``: a callable giving the target's
    ``ModelInfo``, for families whose plan depends on the target (EAGLE-3's default layers,
    widths and vocabulary checked before any work)."""
    path = Path(path_str).expanduser()
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise ModelNotFoundError(f"drafter {path_str} is not a directory; pass a DFlash checkpoint "
                                 "directory (config.json + *.safetensors) with --drafter.")
    if not cfg_path.is_file():
        raise BadInputError(f"drafter {path_str} has no config.json; pass a DFlash checkpoint directory.")
    bin_only = not any(path.glob("*.safetensors"))
    if bin_only and not (path / "pytorch_model.bin").is_file():
        raise BadInputError(f"drafter {path_str} has no *.safetensors weights; pass a complete checkpoint.")
    from ...models.resolve import check_weight_files

    check_weight_files(path, f"drafter {path_str}", "re-download or re-save the checkpoint (a copy or "
                       "download that stopped half-way leaves such a file).")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, RecursionError) as e:
        raise BadInputError(f"{cfg_path}: not valid JSON ({e}); fix or re-download the file.") from None
    if not isinstance(cfg, dict):
        raise BadInputError(f"{cfg_path}: a JSON {json_kind(cfg)}, not an object; a drafter's config.json is one "
                            "object of its settings (with dflash_config): fix or re-download the checkpoint.")
    from ...drafters.family import DSpark, Eagle3, family_of

    family = family_of(path, cfg)
    if bin_only and family is not Eagle3:  # pytorch_model.bin: the EAGLE repo's EAGLE-3 checkpoints only
        raise BadInputError(f"drafter {path_str} has no *.safetensors weights (a pytorch_model.bin is read for "
                            "EAGLE-3 checkpoints only); pass a complete checkpoint.")
    if family is Eagle3:
        info = target_info() if target_info is not None else None
        plan = Eagle3.plan(path, cfg, num_target_layers=info.num_layers if info else None,
                           target_hidden=info.hidden_size if info else None,
                           target_vocab=info.vocab_size if info else None, steps=eagle_steps)
        return DrafterRef(path=path, name=path.name, fingerprint=fingerprint_path(path), block_size=plan.block_size,
                          target_layer_ids=plan.layers, mask_token_id=None, trained_on=trained_on,
                          hidden_size=None, family="eagle3", plan=plan)
    raw = cfg
    if family is DSpark:  # speculators' layout read as SpecForge's (its backbone is DFlash's)
        from ...drafters.dspark_config import backbone_config

        cfg = backbone_config(cfg, source=str(cfg_path))
    dcfg = cfg.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise BadInputError(f"{cfg_path}: dflash_config must be an object.")
    ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))  # top level: DFlashConfig's precedence
    if int_list(ids) is None:
        raise BadInputError(f"{cfg_path}: dflash_config.target_layer_ids is missing or not a list of "
                            "integers; the drafter's tap layers must come from its checkpoint (guessing "
                            "them is wrong for most published drafters). Add the ids it was trained with.")
    block_size = dcfg.get("block_size", cfg.get("block_size"))
    if not isinstance(block_size, int) or block_size < 2:
        raise BadInputError(f"{cfg_path}: block_size is missing or < 2; set the drafter's block size.")
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if not isinstance(mask, int):
        raise BadInputError(f"{cfg_path}: dflash_config.mask_token_id is missing; set the MASK token id "
                            "the drafter was trained with.")
    declared = dcfg.get("trained_on_backend") or cfg.get("trained_on_backend")
    ref = DrafterRef(path=path, name=path.name, fingerprint=fingerprint_path(path), block_size=block_size,
                     target_layer_ids=list(ids), mask_token_id=mask,
                     trained_on=trained_on or (declared if declared in ("fla", "torch") else None),
                     trained_on_declared=declared if declared in ("fla", "torch") else None,
                     hidden_size=cfg.get("hidden_size") if isinstance(cfg.get("hidden_size"), int) else None)
    if family is DSpark:  # the DFlash backbone's fields above, plus its head (checked here)
        info = target_info() if target_info is not None else None
        ref.plan = DSpark.plan(path, raw, layers=ref.target_layer_ids, block_size=block_size,
                               target_vocab=info.vocab_size if info else None)
        ref.family = "dspark"
        ref.block_size = ref.plan.block_size  # drafts + 1: B + 1 where the anchor slot drafts too
    return ref


def resolve_drafters(ctx: RunContext) -> list[DrafterRef]:
    opts = ctx.options
    if not opts.drafters:
        raise BadInputError("run eval needs at least one drafter: pass --drafter DIR (repeatable), or "
                            "--example for the embedded one.")
    from ...drafters.checkpoints import expand_drafter_arg, incomplete_reason

    refs = []
    for value in opts.drafters:  # a directory, a glob, or a training-output directory
        found, several = expand_drafter_arg(value)
        complete = []
        for c in found:
            # A glob or training directory may hold a checkpoint the trainer is still writing.
            problem = incomplete_reason(c.path) if several else None
            if problem:
                ctx.log(f"note: skipping {c.path}: {problem} (still being written?)")
            else:
                complete.append(c)
        if not complete:
            raise BadInputError(f"--drafter {value}: none of its {len(found)} checkpoint(s) is complete yet; "
                                "wait for the trainer to finish writing one (or use dfcache watch).")
        for c in complete:
            ref = read_drafter_in(ctx, str(c.path))
            ref.step = c.step
            refs.append(ref)
    names = [r.name for r in refs]
    for i, r in enumerate(refs):  # side-by-side columns need distinct names
        if names.count(r.name) > 1:
            r.name = f"{r.name}#{i + 1}"
    return refs


def read_drafter_in(ctx: RunContext, path_str: str) -> DrafterRef:
    """:func:`read_drafter` for this run: its --trained-on, --eagle-steps and target (a family's
    plan may depend on the target: EAGLE-3's default layers, widths and vocabulary)."""
    return read_drafter(path_str, ctx.options.trained_on, target_info=lambda: _target_info(ctx),
                        eagle_steps=getattr(ctx.options, "eagle_steps", None))


def _target_info(ctx: RunContext):
    from ...models.resolve import resolved_target
    from ...models.target import read_model_info

    return read_model_info(resolved_target(ctx).dir)


def build(ctx: RunContext, tokens_node: Node, hs_nodes: dict[int, Node], drafter: DrafterRef) -> Node:
    opts = ctx.options
    from ...models.target import read_model_info

    # Checked here, before any work: a drafter for another target must not cost an extraction.
    info = read_model_info(tokens_node.spec.target_dir)
    width = info.hidden_size
    if drafter.hidden_size is not None and drafter.hidden_size != width:
        raise BadInputError(f"drafter {drafter.path} has hidden_size {drafter.hidden_size} but the target "
                            f"is {width} wide; pass the drafter trained for this target (or that target).")
    # The MASK id indexes the target's embedding table: one outside it failed only in this
    # stage's produce(), after completions, tokens and hidden states had been computed.
    if drafter.mask_token_id is not None and (drafter.mask_token_id < 0 or (info.vocab_size is not None and drafter.mask_token_id >= info.vocab_size)):
        ids = f"ids 0..{info.vocab_size - 1}, vocab_size in its config.json" if info.vocab_size else "ids from 0"
        raise BadInputError(f"drafter {drafter.path}: mask_token_id {drafter.mask_token_id} is outside the "
                            f"target's vocabulary ({ids}); set dflash_config.mask_token_id to the MASK id the drafter was trained "
                            "with (dfcache doctor checks it), or pass the target it was trained for.")
    layers = [hs_nodes[k] for k in drafter.target_layer_ids]
    backend = layers[0].inputs["backend"]
    budgets = sorted({int(b) for b in opts.tree_budgets})
    device = eval_device(getattr(opts, "eval_device", "auto"))
    inputs = {"drafter": drafter.fingerprint, "target_head": tokens_node.inputs["target"],
              "block_size": drafter.block_size, "target_layer_ids": drafter.target_layer_ids,
              "mask_token_id": drafter.mask_token_id, "tree_budgets": budgets,
              "max_blocks": opts.max_blocks, "end_rule": opts.end_rule, "dtype": opts.dtype,
              "device": device}
    if drafter.family == "dspark":
        # DFlash's inputs (the backbone's) plus the family; DDTree budgets are DFlash's alone
        if budgets:
            ctx.log(f"note: {drafter.name} is a DSpark drafter: its chain is evaluated, --tree-budget "
                    f"{','.join(map(str, budgets))} is DFlash's DDTree and is skipped for it")
        inputs.update(drafter.plan.key_inputs, tree_budgets=[])
        budgets = []
    elif drafter.family != "dflash":
        # a family's own inputs; DDTree budgets are DFlash's (EAGLE-3 drafts its own tree)
        del inputs["mask_token_id"]
        inputs.update(drafter.plan.key_inputs, tree_budgets=[], eagle_trees=eagle_trees(opts))
        budgets = []
    problem = None
    if device == "cuda":
        from ...models.target import cuda_visible

        visible, why = cuda_visible()
        if not visible:
            # Only responses this run must evaluate need the GPU: resolve() refuses before any work.
            problem = (f"--eval-device cuda: no CUDA GPU is usable here ({why}); pass --eval-device cpu or auto "
                       "(stored hidden states of any backend evaluate on the CPU).")
    return KEY.samples(inputs=inputs, upstream_samples=tokens_node.sample_keys,
                       upstream_bytes=tokens_node.sample_key_bytes,
                       partition_upstream={"sample": tokens_node.partition.key,
                                           "hidden_states": [n.partition.key for n in layers]},
                       ids=tokens_node.ids, needs="gpu" if device == "cuda" else "cpu",
                       deps=[tokens_node, *layers], label=f"drafter_eval {drafter.name}", problem=problem,
                       spec=DrafterEvalSpec(drafter=drafter, target_dir=tokens_node.spec.target_dir,
                                            backend=backend, tokens=tokens_node, layers=layers),
                       summary=f"{drafter.name}: budgets {budgets or '-'}, layers {drafter.target_layer_ids}")


COMMIT_EVERY = 1024


def eval_device(choice: str | None) -> str:
    """``--eval-device``: ``auto`` (or None) is ``cuda`` where a GPU is usable, else ``cpu``, whatever
    device made the states (decided without importing torch)."""
    if choice not in (None, "auto"):
        return choice
    from ...models.target import cuda_visible

    return "cuda" if cuda_visible()[0] else "cpu"


def _max_root(prompt_len: int, max_blocks: int | None, block_size: int) -> int | None:
    return None if max_blocks is None else prompt_len + (max_blocks - 1) * block_size + 1


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    import torch

    from dfcache.samples import SampleSet, SampleSink

    from .metrics import RootScores, candidate_roots, effective_completion_len, evaluate_response
    from ...drafters.dflash import DFlashDrafter, load_target_head
    from ...models.resolve import eos_token_ids
    from ..tokens import read_tokens

    opts = ctx.options
    dtype = torch.float32 if opts.dtype == "float32" else torch.bfloat16
    for node in nodes:
        todo = node.positions_distinct(node.produce)
        if not todo:
            continue
        ref: DrafterRef = node.spec.drafter
        device = device_for(ctx.worker, node.inputs["device"])  # cuda:LOCAL_RANK under torchrun
        head = load_target_head(node.spec.target_dir, device=device, dtype=dtype)
        if ref.family == "eagle3":
            from ...drafters.eagle3 import Eagle3Drafter

            drafter = Eagle3Drafter.from_pretrained(ref.path, device=device, dtype=dtype)
            drafter.layer_ids = list(ref.target_layer_ids)
        elif ref.family == "dspark":
            from ...drafters.dspark import DSparkDrafter

            drafter = DSparkDrafter.from_pretrained(ref.path, device=device, dtype=dtype)
        else:
            drafter = DFlashDrafter.from_pretrained(ref.path, device=device, dtype=dtype)
        toks = read_tokens(ctx.store, node.spec.tokens, todo)
        stops = eos_token_ids(node.spec.target_dir)
        budgets = node.inputs["tree_budgets"]
        states = [SampleSet(ctx.store, ln.partition.key, [ln.sample_keys[i] for i in todo])
                  for ln in node.spec.layers]
        bar = ctx.progress(len(todo), desc=f"eval {ref.name}", unit="resp")
        from ...core.summaries import samples_origin

        origin = samples_origin(ctx.store, getattr(node.spec.tokens.spec, "completions", None))
        with SampleSink(ctx.store, node.partition, summary=f"{node.summary}; {origin}", max_samples=COMMIT_EVERY,
                        provenance={"torch": torch.__version__, "device": device}) as sink:
            for j, i in enumerate(todo):
                seq = toks.sample(j)
                plen = int(toks.prompt_lens[j])
                n, ended = effective_completion_len(seq, plen, stops)
                roots = candidate_roots(plen, n, ended_by_stop=ended)
                limit = _max_root(plen, opts.max_blocks, ref.block_size)
                if limit is not None:
                    roots = [p for p in roots if p < limit]
                trees = {}
                if roots and ref.family == "eagle3":
                    feats = read_context(states, j, max(roots), head.hidden_size).to(device=device, dtype=dtype)
                    scores, trees = score_eagle3(drafter, head, feats, seq, roots, ref.block_size - 1,
                                                 node.inputs["eagle_trees"], plen, n)
                elif roots and ref.family == "dspark":
                    feats = read_context(states, j, max(roots), head.hidden_size).to(device=device, dtype=dtype)
                    scores = score_dspark(drafter, head, feats, seq, roots)
                elif roots:
                    feats = read_context(states, j, max(roots), head.hidden_size).to(device=device, dtype=dtype)
                    scores = score_response(drafter, head, feats, seq, roots, k=max(budgets, default=0))
                else:
                    scores = RootScores.from_logits([], torch.zeros(0, ref.block_size - 1, head.vocab_size),
                                                    k=max(budgets, default=0))
                ev = evaluate_response(scores, seq, plen, budgets=budgets, stop_token_ids=stops)
                if opts.max_blocks is not None:
                    for w in [ev.chain, *ev.trees.values()]:
                        w.roots, w.values = w.roots[: opts.max_blocks], w.values[: opts.max_blocks]
                doc = {"prompt_len": plen, "completion_len": n, "ended_by_stop": ended, "rule": ev.rule,
                       "chain": ev.chain.values, "tree": {str(b): w.values for b, w in ev.trees.items()}}
                if ref.family == "eagle3":
                    doc["eagle_tree"] = {label: eagle_walk(acc, plen, n, ended, opts.max_blocks)
                                         for label, acc in trees.items()}
                sink.add(node.upstream_samples[i], doc=doc)
                bar.update(1)
        bar.close()


def read_context(states, j: int, stop: int, width: int):
    """Context features [stop, n_ids*H] of sample j: its rows [0, stop) of each layer's
    ``SampleSet`` in ``states`` (the drafter's target_layer_ids order), concatenated, in the stored
    dtype; every layer must be ``width`` (the target's hidden size) wide."""
    import torch

    layers = [_as_tensor(ss, j, stop) for ss in states]
    got = {t.shape[-1] for t in layers}
    if got != {width}:
        raise BadInputError(f"hidden states are {sorted(got)} wide but the target's embedding is "
                            f"{width}; the drafter, target and states must belong together.")
    return torch.cat(layers, dim=-1)


def score_response(drafter, head, feats, seq, roots: list[int], k: int):
    """``RootScores`` of one response's candidate ``roots`` (argmax and top-k per draft slot), in
    the passes the eval runs them (``iter_score_roots``), so a caller sees the eval's drafts."""
    import torch

    from .metrics import RootScores
    from ...drafters.dflash import iter_score_roots

    ids = torch.as_tensor(seq.astype("int64") if hasattr(seq, "astype") else list(seq), dtype=torch.long)
    # Reduce each chunk of roots to argmax/top-k at once: [R, B-1, V] logits of a long response
    # would not fit in memory with a 150k vocabulary.
    parts = [RootScores.from_logits([roots[q] for q in idx], logits, k=k)
             for idx, logits in iter_score_roots(drafter, head, feats, ids, roots)]
    return RootScores.concat(parts)


def score_dspark(drafter, head, feats, seq, roots: list[int]):
    """DSpark: ``RootScores`` of the chain, the Markov head teacher-forced over each root's block
    (``runner.drafters.dspark.iter_drafts``: drafts equal to the sequential ones up to and
    including the first rejected one, all the chain walk reads), in the backbone's batched passes."""
    import numpy as np
    import torch

    from .metrics import RootScores
    from ...drafters.dspark import iter_drafts

    ids = torch.as_tensor(seq.astype("int64") if hasattr(seq, "astype") else list(seq), dtype=torch.long)
    parts = []
    for idx, drafts in iter_drafts(drafter, head, feats, ids, roots):
        empty = np.zeros(tuple(drafts.shape) + (0,))
        parts.append(RootScores([roots[q] for q in idx], drafts.cpu().numpy().astype(np.int64),
                                empty.astype(np.float32), empty.astype(np.int64), head.vocab_size))
    return RootScores.concat(parts)


def score_eagle3(drafter, head, feats, seq, roots: list[int], depth: int, trees: list, prompt_len: int, n: int):
    """EAGLE-3: ``RootScores`` of the chain (drafts of every root in batched passes, already in
    the target's vocabulary) and, per ``--eagle-tree``, each root's accepted length."""
    import numpy as np
    import torch

    from .metrics import RootScores
    from ...drafters.eagle3 import dynamic_trees, score_roots, tree_accept

    ids = torch.as_tensor(seq.astype("int64") if hasattr(seq, "astype") else list(seq), dtype=torch.long)
    toks, _ = score_roots(drafter, head, feats, ids, roots, depth)
    empty = np.zeros((len(roots), depth, 0))
    scores = RootScores([int(r) for r in roots], toks.numpy().astype(np.int64), empty.astype(np.float32),
                        empty.astype(np.int64), head.vocab_size)
    seq_l = [int(t) for t in ids.tolist()]
    end = prompt_len + n
    out = {}
    for topk, steps, tokens in trees:  # every root's tree in batched passes (dynamic_trees)
        built = dynamic_trees(drafter, head, feats, ids, roots, topk, steps, tokens)
        out[tree_label((topk, steps, tokens))] = {p: tree_accept(t, seq_l[p + 1:min(p + 1 + steps, end)])
                                                  for p, t in zip(roots, built)}
    return scores, out


def eagle_walk(acc: dict, prompt_len: int, n: int, ended: bool, max_blocks):
    from .metrics import walk

    _, values = walk(acc, prompt_len, n, ended_by_stop=ended)
    return values[:max_blocks] if max_blocks is not None else values


def _as_tensor(samples, j: int, stop: int):
    """Rows [0, stop) of sample j's states, as a torch tensor in the stored dtype."""
    import numpy as np
    import torch
    from dfcache import fp8
    from dfcache.fp8 import FP8_DTYPE

    seg, pos = samples.segment(j)
    a, _ = seg.rows(pos, "hidden")
    reader = seg.reader("hidden")
    raw = reader.read_raw(a, a + stop)
    if reader.dtype == FP8_DTYPE:  # lossy FP8 states: the bf16 a reader of them gets
        raw = fp8.dequantize(raw)
    if raw.dtype == np.uint16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)


def read_responses(store, node: Node) -> list[dict]:
    """Every response's eval document of a drafter_eval node's prompt set, in prompt order, each
    with the prompt's ``id`` (ids belong to the set, not to the shared sample)."""
    from dfcache.samples import SampleSet

    docs = SampleSet(store, node.partition.key, node.sample_keys).docs()
    return [{"id": node.ids[i], **d} for i, d in enumerate(docs)]


def read_summary(store, node: Node, docs: list[dict] | None = None) -> dict:
    """What the report shows for one drafter: metrics over its responses (``docs``, read when not
    given) plus who/what. ``trained_on`` and ``backend_mismatch`` are this run's view (--trained-on,
    else the declared backend): for results computed and shown at once (watch, compare-backends);
    the report stores ``trained_on_declared`` only."""
    from .metrics import aggregate

    docs = read_responses(store, node) if docs is None else docs
    ref: DrafterRef = node.spec.drafter
    budgets = node.inputs["tree_budgets"]
    rules = {d["rule"] for d in docs}
    summary = {"rule": rules.pop() if len(rules) == 1 else node.inputs["end_rule"],
               "chain": aggregate([d["chain"] for d in docs], ref.block_size).to_dict(),
               "tree": {str(b): aggregate([d["tree"][str(b)] for d in docs if str(b) in d["tree"]],
                                          ref.block_size).to_dict() for b in budgets}}
    if ref.family == "eagle3":
        summary["eagle_tree"] = {tree_label(t): aggregate([d.get("eagle_tree", {}).get(tree_label(t), []) for d in docs],
                                                          int(t[1]) + 1).to_dict()
                                 for t in node.inputs.get("eagle_trees", [])}
    hs_backend = node.spec.backend
    summary.update({"drafter": ref.name, "drafter_path_name": ref.path.name,
                    "hidden_states_backend": hs_backend, "trained_on": ref.trained_on,
                    "trained_on_declared": ref.trained_on_declared,
                    "backend_mismatch": bool(ref.trained_on and ref.trained_on != hs_backend["kernel"]),
                    "block_size": ref.block_size, "tree_budgets": budgets,
                    "family": getattr(ref.plan, "label", "") or ref.family,
                    "max_blocks": node.inputs["max_blocks"]})
    return summary
