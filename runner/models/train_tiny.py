"""Train a tiny DFlash drafter for the tiny target (``runner/models/tiny.py``), on CPU, in seconds.

Used by tests and by ``--example`` runs that need a drafter whose acceptance is well above
chance, so the evaluator's numbers mean something. The recipe is SpecForge's DFlash recipe cut
down (``/work/shared/reference/dflash.md`` §4):

* data: the target's own greedy completions of the built-in prompts (``runner/data/*.jsonl``,
  chat template with ``add_generation_prompt=True``, ``tok(text).input_ids``, no extra BOS);
* features: one target forward per sequence; layer id k = output of decoder layer k *before*
  the final norm (§1.3). Hugging Face's ``hidden_states[k+1]`` is post-norm for the last layer,
  so features are taken with forward hooks on the decoder layers instead;
* blocks: random anchors p in the completion (p and p+1 inside it), block
  ``[x[p], MASK x (B-1)]``, context t < p, loss on slots 1..B-1 against x[p+1..p+B-1] with
  weights ``exp(-(j-1)/gamma)``; the target's embedding and LM head stay frozen.

The drafter is a regular DFlash checkpoint (``save_drafter``): config.json in the reference
layout + model.safetensors with the reference parameter names.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from runner.drafters.dflash import DFlashConfig, DFlashDrafter, init_drafter_weights, load_target_head, save_drafter

__all__ = ["tiny_drafter_config", "train_tiny_drafter", "make_untrained_drafter", "load_prompts",
           "capture_features", "greedy_complete", "greedy_complete_batch", "TrainingSequence",
           "build_training_data", "HELDOUT_PROMPT_IDS", "TrainStats", "single_thread"]

DEFAULT_LAYER_IDS = (1, 3, 5)
# Like the Qwen3.6-27B drafters (sliding layers + a full one); the local window also makes the
# tiny drafter generalise to prompts it was not trained on instead of memorising sequences.
DEFAULT_LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_SLIDING_WINDOW = 16
# Never trained on by default, so tests can measure acceptance on unseen completions.
HELDOUT_PROMPT_IDS = ("code-03", "code-10", "code-17", "reason-02", "reason-09", "reason-16")


def _target_config(target_dir: Path) -> dict:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg.get("text_config") or cfg


def tiny_drafter_config(target_dir: str | Path, *, block_size: int = 8,
                        layer_ids: Sequence[int] = DEFAULT_LAYER_IDS, num_layers: int = 2,
                        layer_types: Sequence[str] | None = DEFAULT_LAYER_TYPES,
                        sliding_window: int | None = DEFAULT_SLIDING_WINDOW,
                        mask_token_id: int = 3, rope_theta: float = 1e6) -> DFlashConfig:
    """A small DFlash config sized for the target at ``target_dir`` (same hidden size and heads)."""
    t = _target_config(Path(target_dir))
    n_target = int(t["num_hidden_layers"])
    bad = [i for i in layer_ids if not 0 <= i < n_target]
    if bad:
        raise ValueError(f"layer ids {bad} do not exist in a {n_target}-layer target")
    heads = int(t["num_attention_heads"])
    types = list(layer_types or ["full_attention"])
    types = (types * num_layers)[:num_layers] if len(types) != num_layers else types
    return DFlashConfig(
        hidden_size=int(t["hidden_size"]), num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or t["hidden_size"] // heads),
        intermediate_size=_mlp_width(t), rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, block_size=block_size, target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        layer_types=types, sliding_window=sliding_window if "sliding_attention" in types else None,
        num_target_layers=n_target, vocab_size=int(t["vocab_size"]),
    )


def _mlp_width(t: dict) -> int:
    """The drafter's dense MLP width. MoE targets (Qwen3.5-MoE, Qwen3-Next) may have no dense
    ``intermediate_size``; their shared expert's (or one expert's) width stands in for it."""
    for name in ("intermediate_size", "shared_expert_intermediate_size", "moe_intermediate_size"):
        if isinstance(t.get(name), int) and t[name] > 0:
            return int(t[name])
    return 4 * int(t["hidden_size"])


@contextlib.contextmanager
def single_thread():
    """Run torch on one intra-op thread, then restore the setting.

    Every op on these tiny models is too small to split; with two threads on a busy 2-core
    machine the OpenMP workers wait for each other and a 20 s training run took over 10 minutes.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _single_threaded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with single_thread():
            return fn(*args, **kwargs)
    return wrapper


# --------------------------------------------------------------------------------------------
# Target side
# --------------------------------------------------------------------------------------------

def load_prompts(tokenizer, names: Sequence[str] = ("coding", "reasoning")) -> list[tuple[str, list[int]]]:
    """(id, prompt token ids) for the built-in prompt sets, encoded as the reference benchmark does."""
    out = []
    for name in names:
        text = resources.files("runner").joinpath("data", f"{name}.jsonl").read_text()
        for line in text.splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            chat = tokenizer.apply_chat_template(rec["messages"], tokenize=False, add_generation_prompt=True)
            out.append((rec["id"], list(tokenizer(chat).input_ids)))
    return out


def _decoder_layers(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None) or getattr(getattr(base, "language_model", None), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def capture_features(model, input_ids: Sequence[int] | torch.Tensor,
                     layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward: (logits [T, V], features [T, n_ids*H]), features pre-final-norm.

    Hooks on the decoder's ``layers[k]`` give the output of decoder layer k for every k, the last
    layer included (HF's last ``hidden_states`` entry has the final norm applied).
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(next(model.parameters()).device)
    layers = _decoder_layers(model)
    bad = [k for k in layer_ids if not 0 <= k < len(layers)]
    if bad:
        raise ValueError(f"layer ids {bad} do not exist in a {len(layers)}-layer target")
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for k in sorted(set(layer_ids)):
        def hook(_mod, _inp, out, k=k):
            captured[k] = out[0] if isinstance(out, tuple) else out
        hooks.append(layers[k].register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(ids).logits[0]
    finally:
        for h in hooks:
            h.remove()
    feats = torch.cat([captured[k][0] for k in layer_ids], dim=-1)
    return logits.float(), feats.float()


def greedy_complete(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """The target's greedy completion (stops after EOS), as plain token ids."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    comp = out[0, ids.shape[1]:].tolist()
    if eos_token_id is not None and eos_token_id in comp:
        comp = comp[:comp.index(eos_token_id) + 1]
    return comp


@dataclass
class TrainingSequence:
    prompt_id: str
    tokens: torch.Tensor        # [T] prompt + completion
    prompt_len: int
    features: torch.Tensor      # [T, n_ids*H]


def _load_target(target_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # use_kernels=False: transformers >= 5.25 would otherwise kernelize with hub kernels (see
    # runner/models/target.py, "Hub kernels").
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, use_kernels=False).eval()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return model, tok


def greedy_complete_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          eos_token_id: int | None, pad_token_id: int = 0) -> list[list[int]]:
    """Greedy completions of several prompts in one left-padded ``generate`` call.

    Padding can in principle move a near-tied argmax, so this is for training data only; the
    evaluator's completions come from unpadded decoding.
    """
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    comps = []
    for row in out[:, width:].tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[:row.index(eos_token_id) + 1]
        comps.append(row)
    return comps


def build_training_data(target_dir: str | Path, layer_ids: Sequence[int], *, max_new_tokens: int = 64,
                        prompt_ids: Sequence[str] | None = None) -> list[TrainingSequence]:
    """Greedy completions + features for the built-in prompts (all but ``HELDOUT_PROMPT_IDS`` by default)."""
    model, tok = _load_target(Path(target_dir))
    prompts = load_prompts(tok)
    if prompt_ids is None:
        prompts = [p for p in prompts if p[0] not in HELDOUT_PROMPT_IDS]
    else:
        known = {pid for pid, _ in prompts}
        unknown = sorted(set(prompt_ids) - known)
        if unknown:
            raise ValueError(f"unknown prompt ids {unknown}")
        prompts = [p for p in prompts if p[0] in set(prompt_ids)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    comps = greedy_complete_batch(model, [ids for _, ids in prompts], max_new_tokens, tok.eos_token_id, pad)
    data = []
    for (pid, ids), comp in zip(prompts, comps):
        seq = list(ids) + comp
        _, feats = capture_features(model, seq, layer_ids)
        data.append(TrainingSequence(pid, torch.tensor(seq), len(ids), feats))
    return data


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def _block_loss(drafter: DFlashDrafter, head, seq: TrainingSequence, anchors: torch.Tensor,
                gamma: float) -> torch.Tensor:
    K, T = drafter.num_drafts, seq.tokens.shape[0]
    ctx_kv = drafter.context_kv(seq.features)
    logits = drafter.block_logits(ctx_kv, anchors, seq.tokens[anchors], head)      # [n, K, V]
    pos = anchors[:, None] + torch.arange(1, K + 1)                                 # labels' positions
    valid = pos < T
    labels = seq.tokens[pos.clamp(max=T - 1)]
    weight = torch.exp(-(torch.arange(1, K + 1, dtype=torch.float32) - 1) / gamma)[None, :] * valid
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce.view_as(weight) * weight).sum() / weight.sum()


@dataclass
class TrainStats:
    seconds: float          # wall clock
    cpu_seconds: float      # this process's CPU time; stable when the machine is busy
    losses: list[float]
    train_prompt_ids: list[str]


@_single_threaded
def train_tiny_drafter(target_dir: str | Path, out_dir: str | Path, *, steps: int = 200, seed: int = 0,
                       block_size: int = 8, layer_ids: Sequence[int] = DEFAULT_LAYER_IDS, num_layers: int = 2,
                       layer_types: Sequence[str] | None = DEFAULT_LAYER_TYPES,
                       sliding_window: int | None = DEFAULT_SLIDING_WINDOW, max_new_tokens: int = 64,
                       prompt_ids: Sequence[str] | None = None, anchors_per_seq: int = 24, seqs_per_step: int = 2,
                       lr: float = 3e-3, loss_decay_gamma: float = 4.0,
                       data: list[TrainingSequence] | None = None, stats: list | None = None,
                       first_draft_slot: int = 1) -> Path:
    """Train a tiny drafter on the target's own greedy completions and save it to ``out_dir``.

    ``first_draft_slot`` 0 trains slot 0 (the root's) to draft too, slot k the token k+1 after the
    root (speculators' ``sample_from_anchor``); the file saved is a DFlash checkpoint either way.

    Trains on every built-in prompt except ``HELDOUT_PROMPT_IDS`` unless ``prompt_ids`` says
    otherwise. ``data`` reuses sequences from :func:`build_training_data`. If ``stats`` is a list,
    a :class:`TrainStats` is appended to it. Returns ``out_dir``.
    """
    t0 = time.perf_counter()
    c0 = time.process_time()
    target_dir = Path(target_dir)
    cfg = tiny_drafter_config(target_dir, block_size=block_size, layer_ids=layer_ids, num_layers=num_layers,
                              layer_types=layer_types, sliding_window=sliding_window)
    head = load_target_head(target_dir)
    if data is None:
        data = build_training_data(target_dir, layer_ids, max_new_tokens=max_new_tokens, prompt_ids=prompt_ids)
    data = [s for s in data if s.tokens.shape[0] - s.prompt_len >= 2]
    if not data:
        raise ValueError("no training sequence has a completion of 2+ tokens")
    drafter = init_drafter_weights(DFlashDrafter(cfg), seed).train()
    drafter.first_draft_slot = first_draft_slot
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        picks = torch.randperm(len(data), generator=gen)[:seqs_per_step].tolist()
        loss = 0.0
        for i in picks:
            seq = data[i]
            lo, hi = seq.prompt_len, seq.tokens.shape[0] - 2            # anchor and anchor+1 in the completion
            n = min(anchors_per_seq, hi - lo + 1)
            anchors = (lo + torch.randperm(hi - lo + 1, generator=gen)[:n]).sort().values
            loss = loss + _block_loss(drafter, head, seq, anchors, loss_decay_gamma) / len(picks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    drafter.eval()
    save_drafter(drafter, out_dir)
    if stats is not None:
        stats.append(TrainStats(time.perf_counter() - t0, time.process_time() - c0, losses,
                                [s.prompt_id for s in data]))
    return Path(out_dir)


def make_untrained_drafter(target_dir: str | Path, out_dir: str | Path, seed: int = 0, **config_kw) -> Path:
    """A randomly initialised drafter with the same config as :func:`train_tiny_drafter` makes."""
    cfg = tiny_drafter_config(target_dir, **config_kw)
    save_drafter(init_drafter_weights(DFlashDrafter(cfg), seed).eval(), out_dir)
    return Path(out_dir)
