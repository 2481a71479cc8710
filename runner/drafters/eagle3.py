"""EAGLE-3 drafter: checkpoint loading (SpecForge and speculators layouts) and offline drafting.

What an EAGLE-3 drafter computes, as SGLang and vLLM run it (and SpecForge's
``LlamaForCausalLMEagle3`` / speculators' ``Eagle3DraftModel`` train it):

* Features: the outputs of three target decoder layers (low, mid, high; Hugging Face
  ``hidden_states[k+1]`` for layer id k, before the final norm), concatenated in the order of
  ``eagle_aux_hidden_state_layer_ids`` and projected once, ``g = fc(C)`` ([3*Ht] -> [H], no bias).
  Without ids in the config SGLang's default applies: layers ``[1, N//2 - 1, N - 4]`` of an
  N-layer target (it captures the *inputs* of layers 2, N//2, N-3, the same tensors).
* One decoder layer (``midlayer`` in SpecForge, ``layers.0`` in speculators) whose attention
  input is ``cat(input_layernorm(embed(token)), hidden_norm(h))`` [2H]; its residual is ``h``
  (``hidden_norm(h)`` when ``norm_before_residual``). Logits: ``lm_head(norm(h'))`` over the
  draft vocabulary; a draft id d is the target token ``d + d2t[d]``.
* Position j of the first step holds (g[j], token x[j+1]) and predicts x[j+2]. A block rooted at
  p (the bonus token x[p] committed, features of positions < p known) is drafted from position
  p-1: step 1 attends to the step-1 keys of positions 0..p-1; step s > 1 feeds the previous
  step's pre-norm output and its own draft token at position p-2+s and attends to those same
  keys plus the keys of its own earlier steps (the chain's, or the tree node's ancestors').

Because the step-1 keys of a position depend only on that position's inputs, every root of a
response shares them: :func:`score_roots` computes them once (one causal pass) and drafts all
roots' later steps in batched passes; :func:`draft_one_root` is the literal per-root loop an
online decoder runs, and tests check the two agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dfcache.errors import BadInputError

from .dflash import (RMSNorm, Rope, TargetHead, _read_config, _read_tensors, _safetensors_files,
                     attention_projections, gated_mlp)
from .dflash import init_drafter_weights as init_eagle3_weights  # one deterministic init for every family
from .eagle3_config import Eagle3Config, default_layer_ids, is_eagle3_config

__all__ = ["Eagle3Config", "Eagle3Drafter", "default_layer_ids", "score_roots", "draft_one_root",
           "dynamic_tree", "save_eagle3", "init_eagle3_weights", "is_eagle3_config"]

BIN_WEIGHTS = "pytorch_model.bin"  # the EAGLE repo's own checkpoints (yuhuili/EAGLE3-*) hold only this file


def _weights(path: Path):
    """(tensor names, read(names) -> {name: tensor}) of a checkpoint: its safetensors files, else
    the EAGLE repo's ``pytorch_model.bin`` (a plain state dict; read with ``weights_only``, which
    unpickles tensors and nothing else)."""
    if not any(path.glob("*.safetensors")) and (path / BIN_WEIGHTS).is_file():
        try:
            state = torch.load(path / BIN_WEIGHTS, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign pickle: torch raises several kinds
            raise BadInputError(f"drafter checkpoint {path}: {BIN_WEIGHTS} is not a readable state dict ({e}); "
                                "re-download it or re-save the checkpoint as safetensors.") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise BadInputError(f"drafter checkpoint {path}: {BIN_WEIGHTS} is not a state dict of tensors; "
                                "re-save the checkpoint as safetensors.")
        return dict.fromkeys(state), lambda names: {n: state[n] for n in names}
    files = _safetensors_files(path, f"drafter checkpoint {path}")
    return files, lambda names: _read_tensors(files, names, "cpu", None)


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name under SpecForge's layout: no ``model.`` prefix (vLLM's), the
    decoder layer as ``midlayer.`` (speculators and vLLM write ``layers.0.``)."""
    name = name[len("model."):] if name.startswith("model.") else name
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


# Tensors a published EAGLE-3 checkpoint may hold that change no draft: t2d (derivable from d2t),
# speculators' verifier copies (verifier_norm / verifier_lm_head: training targets only) and
# older checkpoints' RoPE tables.
_IGNORED = ("t2d", "d2t", "embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def _ignorable(name: str) -> bool:
    return name in _IGNORED or name.endswith("rotary_emb.inv_freq")


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 draft model's tensors under SpecForge's names (speculators' ``layers.0.`` map here)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H, hd = cfg.hidden_size, cfg.head_dim
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        ab, mb = cfg.attention_bias, cfg.mlp_bias
        self.midlayer = nn.Module()
        m = self.midlayer
        m.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        m.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        m.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        # q/k/v read the embedding and the fused features side by side (2 x hidden); Qwen3's
        # attention adds per-head q/k RMSNorms before RoPE (cfg.qk_norm)
        m.self_attn = attention_projections(2 * H, H, cfg.num_attention_heads, cfg.num_key_value_heads, hd, ab,
                                            cfg.qk_norm, cfg.rms_norm_eps)
        m.mlp = gated_mlp(H, cfg.intermediate_size, mb)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: torch.Tensor | None = None  # the drafter's own embedding, when saved
        self.rope = Rope(hd, cfg.rope_theta, cfg.rope_scaling)
        self.layer_ids: list[int] | None = cfg.target_layer_ids

    # ---- what the eval and the online loops read ------------------------------------------

    @property
    def target_layer_ids(self) -> list[int]:
        if self.layer_ids is None:
            raise BadInputError("EAGLE-3 drafter without eagle_aux_hidden_state_layer_ids: resolve them against "
                                "the target (resolve_layer_ids) before drafting.")
        return self.layer_ids

    def resolve_layer_ids(self, num_target_layers: int | None) -> list[int]:
        if self.layer_ids is None:
            if not num_target_layers:
                raise BadInputError("EAGLE-3 drafter without eagle_aux_hidden_state_layer_ids and a target whose "
                                    "config.json has no num_hidden_layers; add the ids to the drafter config.")
            self.layer_ids = default_layer_ids(num_target_layers)
        return self.layer_ids

    mask_token_id = 0  # a placeholder for the loops' unwritten slots (EAGLE has no MASK token)
    block_size: int | None = None  # chain depth + 1, set by whoever chose the depth (eval, parity)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def embed(self, head: TargetHead, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else head.embed_tokens
        return F.embedding(ids, table).to(self.dtype)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "Eagle3Drafter":
        path = Path(path)
        cfg = Eagle3Config.from_dict(_read_config(path), source=str(path / "config.json"))
        files, read = _weights(path)
        source_of: dict[str, str] = {}
        for n in files:
            c = canonical_name(n)
            if c in source_of:
                raise BadInputError(f"drafter checkpoint {path}: both '{source_of[c]}' and '{n}' are present; "
                                    "keep one naming (SpecForge's midlayer.* or speculators' layers.0.*).")
            source_of[c] = n
        # What the tensors say where configs differ among writers: a Qwen3 layer's q/k norms
        # (speculators labels some Qwen3-shaped layers llama) and attention/MLP biases.
        if "midlayer.self_attn.q_norm.weight" in source_of:
            cfg.qk_norm = True
        if "midlayer.self_attn.q_proj.bias" in source_of:
            cfg.attention_bias = True
        if "midlayer.mlp.gate_proj.bias" in source_of:
            cfg.mlp_bias = True
        with torch.device("meta"):
            model = cls(cfg)
        expected = {k: tuple(v.shape) for k, v in model.named_parameters()}
        missing = sorted(set(expected) - set(source_of))
        if missing:
            raise BadInputError(f"drafter checkpoint {path}: missing EAGLE-3 tensors {missing[:5]}"
                                f"{' ...' if len(missing) > 5 else ''}; re-save it with SpecForge or speculators.")
        # Any other tensor changes the drafter's forward in a way this loader does not know (a
        # second decoder layer, P-EAGLE's mask_hidden, ...): refused, never silently dropped.
        unknown = sorted(n for c, n in source_of.items() if c not in expected and not _ignorable(c))
        if unknown:
            raise BadInputError(f"drafter checkpoint {path}: tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                                "are not part of a one-layer EAGLE-3 drafter (SpecForge's or speculators' names); "
                                "pass an EAGLE-3 checkpoint, or one re-saved without them.")
        wanted = [source_of[k] for k in expected] + [source_of[k] for k in ("d2t", "embed_tokens.weight")
                                                      if k in source_of]
        tensors = read(wanted)
        state = {}
        for k, shape in expected.items():
            t = tensors[source_of[k]]
            if tuple(t.shape) != shape:
                raise BadInputError(f"drafter checkpoint {path}: tensor '{source_of[k]}' is {tuple(t.shape)}, "
                                    f"config.json implies {shape}. Fix config.json (hidden_size, head_dim, heads, "
                                    "intermediate_size, draft_vocab_size, target_hidden_size) to match the weights.")
            state[k] = t.to(dtype)
        model = model.to_empty(device="cpu")
        model.load_state_dict(state, strict=False)
        if "d2t" in source_of:
            d2t = tensors[source_of["d2t"]].to(torch.long)
            if tuple(d2t.shape) != (cfg.draft_vocab_size,):
                raise BadInputError(f"drafter checkpoint {path}: d2t has shape {tuple(d2t.shape)}, not "
                                    f"({cfg.draft_vocab_size},) = draft_vocab_size; re-save the checkpoint.")
            model.d2t = d2t
        elif cfg.draft_vocab_size != cfg.vocab_size:
            raise BadInputError(f"drafter checkpoint {path}: draft_vocab_size {cfg.draft_vocab_size} != vocab_size "
                                f"{cfg.vocab_size} but no d2t map; re-save the checkpoint with its vocab maps.")
        else:
            model.d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        mapped = torch.arange(cfg.draft_vocab_size) + model.d2t
        if int(mapped.min()) < 0 or int(mapped.max()) >= cfg.vocab_size:
            raise BadInputError(f"drafter checkpoint {path}: d2t maps draft ids to target ids "
                                f"{int(mapped.min())}..{int(mapped.max())}, outside vocab_size {cfg.vocab_size}; "
                                "the vocab maps belong to another target. Pass the drafter trained for this target.")
        if "embed_tokens.weight" in source_of:
            emb = tensors[source_of["embed_tokens.weight"]]
            if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise BadInputError(f"drafter checkpoint {path}: embed_tokens.weight is {tuple(emb.shape)}, "
                                    f"not ({cfg.vocab_size}, {cfg.hidden_size}); re-save the checkpoint.")
            model.embed_tokens = emb.to(dtype)
        model = model.to(device)
        if model.embed_tokens is not None:
            model.embed_tokens = model.embed_tokens.to(device)
        model.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return model.eval()

    # ---- one decoder step -------------------------------------------------------------------

    def qkv(self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor):
        """Rotated q [N, nh, hd], k, v [N, nkv, hd] and the residual of rows (emb, h) at ``positions``."""
        m, c = self.midlayer, self.config
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(h)], dim=-1)
        residual = m.hidden_norm(h) if c.norm_before_residual else h
        n = x.shape[0]
        q = m.self_attn.q_proj(x).view(n, c.num_attention_heads, c.head_dim)
        k = m.self_attn.k_proj(x).view(n, c.num_key_value_heads, c.head_dim)
        v = m.self_attn.v_proj(x).view(n, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q, k = m.self_attn.q_norm(q), m.self_attn.k_norm(k)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return Rope.apply(q, cos, sin), Rope.apply(k, cos, sin), v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then the MLP block: the layer's pre-norm output."""
        m = self.midlayer
        h = residual + m.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        x = m.post_attention_layernorm(h)
        out = h + m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))
        # speculators' norm_output (EAGLE 3.1): the state carried to the next step, and the one its
        # lm_head reads, is norm(h) (Eagle3DraftModel.forward); logits() then applies no second norm.
        return self.norm(out) if self.config.feed_normed else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer's outputs (pre-norm, or already normed: feed_normed)."""
        c = self.config
        return self.lm_head(self.norm(h) if c.norm_output and not c.feed_normed else h).float()

    def context_kv(self, head: TargetHead, features: torch.Tensor, next_tokens: torch.Tensor, start: int = 0):
        """First-step (q, k, v, residual) of positions start..start+n-1: features [n, 3*Ht] of those
        positions, tokens x[start+1..start+n] (``start`` > 0: a serving engine's draft-extend of
        newly accepted positions)."""
        x = features.to(self.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([n(c) for n, c in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        g = self.fc(x)
        pos = torch.arange(start, start + g.shape[0], device=g.device)
        return self.qkv(self.embed(head, next_tokens), g, pos)


def _expand_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _attend(q, k_ctx, v_ctx, ctx_len: torch.Tensor, extra_k: list, extra_v: list, scale: float):
    """Attention of rows q [R, nh, hd] over context keys [T, nh, hd] (row r sees the first
    ctx_len[r]) plus per-row extra keys (each [R, nh, hd]), in one float32 softmax."""
    s_ctx = torch.einsum("rhd,thd->rht", q.float(), k_ctx.float()) * scale
    t = torch.arange(k_ctx.shape[0], device=q.device)
    s_ctx = s_ctx.masked_fill((t[None, :] >= ctx_len[:, None])[:, None, :], float("-inf"))
    s_ext = [(q.float() * k.float()).sum(-1, keepdim=True) * scale for k in extra_k]
    p = torch.softmax(torch.cat([s_ctx, *s_ext], dim=-1), dim=-1)
    out = torch.einsum("rht,thd->rhd", p[..., :k_ctx.shape[0]], v_ctx.float())
    for i, v in enumerate(extra_v):
        out = out + p[..., k_ctx.shape[0] + i, None] * v.float()
    return out.to(q.dtype)


def _check(drafter: "Eagle3Drafter", head: TargetHead, features: torch.Tensor, token_ids: torch.Tensor,
           roots: Sequence[int]) -> list[int]:
    roots = [int(p) for p in roots]
    if features.shape[-1] != 3 * drafter.config.target_hidden_size:
        raise BadInputError(f"context features are {features.shape[-1]} wide, the EAGLE-3 drafter needs "
                            f"3 x {drafter.config.target_hidden_size}; the drafter, target and states must belong together.")
    for p in roots:
        if p < 1 or p > features.shape[0] or p >= token_ids.shape[0]:
            raise ValueError(f"root {p} needs features of positions < {p} ({features.shape[0]} stored) "
                             f"and its token ({token_ids.shape[0]} tokens)")
    return roots


CHUNK_ROOTS = 128  # roots per batched pass: [R, heads, T] float32 scores stay small on the CPU


@torch.no_grad()
def score_roots(drafter: Eagle3Drafter, head: TargetHead, features: torch.Tensor, token_ids: torch.Tensor,
                roots: Sequence[int], depth: int, chunk: int = CHUNK_ROOTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain drafts of every root, batched: (tokens [R, depth] in the target's vocabulary,
    draft logits [R, depth, draft_vocab]). ``features`` [>= max(roots), 3*Ht], ``token_ids`` the
    sequence. The first step of all positions is one causal pass; later steps run per chunk."""
    roots = _check(drafter, head, features, token_ids, roots)
    c = drafter.config
    if not roots:
        return torch.zeros(0, depth, dtype=torch.long), torch.zeros(0, depth, c.draft_vocab_size)
    n = max(roots)
    dev = drafter.device
    ids = token_ids.to(dev)
    q0, k0, v0, r0 = drafter.context_kv(head, features[:n].to(dev), ids[1:n + 1])
    groups = c.num_attention_heads // c.num_key_value_heads
    k0, v0 = _expand_kv(k0, groups), _expand_kv(v0, groups)
    scale = 1.0 / math.sqrt(c.head_dim)
    toks, logits = [], []
    for a in range(0, len(roots), chunk):
        rows = torch.tensor(roots[a:a + chunk], device=dev) - 1  # the position each root drafts from
        ctx_len = rows + 1
        h = drafter.finish(_attend(q0[rows], k0, v0, ctx_len, [], [], scale), r0[rows])
        ks, vs, t_out, l_out = [], [], [], []
        for s in range(depth):
            lg = drafter.logits(h)
            d = drafter.to_target(lg.argmax(-1))
            t_out.append(d), l_out.append(lg)
            if s + 1 == depth:
                break
            q, k, v, res = drafter.qkv(drafter.embed(head, d), h, rows + s + 1)
            ks.append(_expand_kv(k, groups)), vs.append(_expand_kv(v, groups))
            h = drafter.finish(_attend(q, k0, v0, ctx_len, ks, vs, scale), res)
        toks.append(torch.stack(t_out, 1)), logits.append(torch.stack(l_out, 1))
    return torch.cat(toks).cpu(), torch.cat(logits).cpu()


@torch.no_grad()
def draft_one_root(drafter: Eagle3Drafter, head: TargetHead, features: torch.Tensor, token_ids: Sequence[int],
                   root: int, depth: int) -> tuple[list[int], torch.Tensor]:
    """The online decoder's chain at one root, literally: project the features of positions < root,
    a causal pass over them, then ``depth`` autoregressive steps each attending over the
    concatenation of the context keys and its own earlier steps' keys (SDPA, no batching)."""
    c = drafter.config
    dev = drafter.device
    ids = torch.as_tensor(list(token_ids[1:root + 1]), device=dev)
    q, k, v, res = drafter.context_kv(head, features[:root].to(dev), ids)
    groups = c.num_attention_heads // c.num_key_value_heads
    K, V = _expand_kv(k, groups), _expand_kv(v, groups)
    att = F.scaled_dot_product_attention(q[-1:].transpose(0, 1), K.transpose(0, 1), V.transpose(0, 1))
    h = drafter.finish(att.transpose(0, 1), res[-1:])
    out, lgs = [], []
    for s in range(depth):
        lg = drafter.logits(h)
        d = drafter.to_target(lg.argmax(-1))
        out.append(int(d)), lgs.append(lg[0])
        if s + 1 == depth:
            break
        q, k, v, res = drafter.qkv(drafter.embed(head, d), h, torch.tensor([root + s], device=dev))
        K, V = torch.cat([K, _expand_kv(k, groups)]), torch.cat([V, _expand_kv(v, groups)])
        att = F.scaled_dot_product_attention(q.transpose(0, 1), K.transpose(0, 1), V.transpose(0, 1))
        h = drafter.finish(att.transpose(0, 1), res)
    return out, torch.stack(lgs)


# --------------------------------------------------------------------------------------------
# EAGLE's dynamic tree (SGLang --speculative-eagle-topk / -num-steps / -num-draft-tokens)
# --------------------------------------------------------------------------------------------

@dataclass
class Tree:
    """A drafted tree: node i has ``tokens[i]`` (target vocabulary) and ``parents[i]`` (-1: the root)."""

    tokens: list[int]
    parents: list[int]


def tree_accept(tree: Tree, target: Sequence[int]) -> int:
    """Greedy verification: the depth of the deepest node whose path equals the target's tokens."""
    node, acc = -1, 0
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(p, {}).setdefault(t, i)
    while acc < len(target):
        nxt = children.get(node, {}).get(int(target[acc]))
        if nxt is None:
            break
        node, acc = nxt, acc + 1
    return acc


@torch.no_grad()
def dynamic_tree(drafter: Eagle3Drafter, head: TargetHead, features: torch.Tensor, token_ids: Sequence[int],
                 root: int, topk: int, num_steps: int, num_draft_tokens: int) -> Tree:
    """EAGLE-2/3's dynamic tree at one root: step 1 keeps the root's top-k; each later step expands
    the k frontier nodes by their top-k (cumulative probability = product along the path) and
    keeps the best k of the k*k as the next frontier; the tree is the ``num_draft_tokens - 1``
    best nodes of all steps (ties: the earlier candidate). Each node attends over the context keys
    and its ancestors' keys."""
    c = drafter.config
    dev = drafter.device
    ids = torch.as_tensor(list(token_ids[1:root + 1]), device=dev)
    q, k, v, res = drafter.context_kv(head, features[:root].to(dev), ids)
    groups = c.num_attention_heads // c.num_key_value_heads
    K0, V0 = _expand_kv(k, groups), _expand_kv(v, groups)
    scale = 1.0 / math.sqrt(c.head_dim)
    ctx = torch.tensor([root], device=dev)
    h = drafter.finish(_attend(q[-1:], K0, V0, ctx, [], [], scale), res[-1:])
    lp = torch.log_softmax(drafter.logits(h)[0], -1)
    top = torch.topk(lp, min(topk, lp.shape[-1]))
    # every candidate: (score, token, parent candidate index); the frontier carries state
    cand_score = top.values.tolist()
    cand_tok = drafter.to_target(top.indices).tolist()
    cand_parent = [-1] * len(cand_score)
    frontier = [(i, h[0], [], []) for i in range(len(cand_score))]  # (cand idx, parent h, anc k, anc v)
    for step in range(1, num_steps):
        new = []
        rows = []
        for ci, hp, ak, av in frontier:
            tok = torch.tensor([cand_tok[ci]], device=dev)
            qn, kn, vn, rn = drafter.qkv(drafter.embed(head, tok), hp[None], torch.tensor([root - 1 + step], device=dev))
            ks, vs = ak + [_expand_kv(kn, groups)], av + [_expand_kv(vn, groups)]
            hn = drafter.finish(_attend(qn, K0, V0, ctx, ks, vs, scale), rn)
            lpn = torch.log_softmax(drafter.logits(hn)[0], -1)
            tn = torch.topk(lpn, min(topk, lpn.shape[-1]))
            for s, t in zip(tn.values.tolist(), drafter.to_target(tn.indices).tolist()):
                rows.append((cand_score[ci] + s, t, ci, hn[0], ks, vs))
        base = len(cand_score)
        for j, (s, t, p, *_rest) in enumerate(rows):
            cand_score.append(s), cand_tok.append(t), cand_parent.append(p)
        order = sorted(range(len(rows)), key=lambda j: -rows[j][0])[:topk]
        frontier = [(base + j, rows[j][3], rows[j][4], rows[j][5]) for j in order]
    keep = sorted(sorted(range(len(cand_score)), key=lambda j: -cand_score[j])[:max(num_draft_tokens - 1, 0)])
    where = {j: i for i, j in enumerate(keep)}
    return Tree([cand_tok[j] for j in keep], [where.get(cand_parent[j], -1) if cand_parent[j] >= 0 else -1
                                              for j in keep])


@torch.no_grad()
def dynamic_trees(drafter: Eagle3Drafter, head: TargetHead, features: torch.Tensor, token_ids: torch.Tensor,
                  roots: Sequence[int], topk: int, num_steps: int, num_draft_tokens: int,
                  chunk: int = CHUNK_ROOTS) -> list[Tree]:
    """:func:`dynamic_tree` of every root, batched: the first-step keys of all positions once, then
    per chunk of roots one pass per step over all frontier nodes (roots x topk), each attending to
    its root's context keys and its own ancestors' keys. Same trees as the per-root function."""
    roots = _check(drafter, head, features, token_ids, roots)
    if not roots:
        return []
    c = drafter.config
    dev = drafter.device
    ids = token_ids.to(dev)
    q0, k0, v0, r0 = drafter.context_kv(head, features[:max(roots)].to(dev), ids[1:max(roots) + 1])
    groups = c.num_attention_heads // c.num_key_value_heads
    K0, V0 = _expand_kv(k0, groups), _expand_kv(v0, groups)
    scale = 1.0 / math.sqrt(c.head_dim)
    k = min(topk, c.draft_vocab_size)
    out: list[Tree] = []
    for a in range(0, len(roots), chunk):
        rows = torch.tensor(roots[a:a + chunk], device=dev) - 1
        R = rows.shape[0]
        h = drafter.finish(_attend(q0[rows], K0, V0, rows + 1, [], [], scale), r0[rows])
        top = torch.topk(torch.log_softmax(drafter.logits(h), -1), k)            # [R, k]
        scores = [top.values]                                                     # per step: [R, n]
        tokens = [drafter.to_target(top.indices)]
        parents = [torch.full((R, k), -1, dtype=torch.long, device=dev)]         # candidate index, -1: root
        f_tok, f_idx = tokens[0], torch.arange(k, device=dev).expand(R, k)        # frontier: token, candidate idx
        f_score, f_h = top.values, h[:, None, :].expand(R, k, h.shape[-1])      # its score, its parent's h
        f_k = f_v = None                                                          # ancestors' keys [R, k, d, nh, hd]
        base = k
        ctx = (rows + 1).repeat_interleave(k)
        for step in range(1, num_steps):
            n = R * k
            pos = (rows + step).repeat_interleave(k)  # node of depth step: position root - 1 + step
            qn, kn, vn, rn = drafter.qkv(drafter.embed(head, f_tok.reshape(n)), f_h.reshape(n, -1), pos)
            kn, vn = _expand_kv(kn, groups), _expand_kv(vn, groups)
            anc_k = [] if f_k is None else [f_k[:, :, d].reshape(n, *kn.shape[1:]) for d in range(f_k.shape[2])]
            anc_v = [] if f_v is None else [f_v[:, :, d].reshape(n, *vn.shape[1:]) for d in range(f_v.shape[2])]
            hn = drafter.finish(_attend(qn, K0, V0, ctx, anc_k + [kn], anc_v + [vn], scale), rn)
            tn = torch.topk(torch.log_softmax(drafter.logits(hn), -1), k)          # [n, k]
            cand = (f_score.reshape(n, 1) + tn.values).reshape(R, k * k)
            scores.append(cand)
            tokens.append(drafter.to_target(tn.indices).reshape(R, k * k))
            parents.append(f_idx.repeat_interleave(k, dim=1))
            # the next frontier: the best k of the k*k (ties: the earlier candidate, as sorted() is stable)
            order = torch.sort(-cand, dim=1, stable=True).indices[:, :k]         # [R, k]
            par = order // k                                                      # which frontier node
            new_k = torch.cat([f_k, kn.view(R, k, 1, *kn.shape[1:])], 2) if f_k is not None else kn.view(R, k, 1, *kn.shape[1:])
            new_v = torch.cat([f_v, vn.view(R, k, 1, *vn.shape[1:])], 2) if f_v is not None else vn.view(R, k, 1, *vn.shape[1:])
            gather = par[:, :, None, None, None].expand(R, k, *new_k.shape[2:])
            f_k, f_v = torch.gather(new_k, 1, gather), torch.gather(new_v, 1, gather)
            f_h = torch.gather(hn.view(R, k, -1), 1, par[:, :, None].expand(R, k, hn.shape[-1]))
            f_tok = torch.gather(tokens[-1], 1, order)
            f_score = torch.gather(cand, 1, order)
            f_idx = base + order
            base += k * k
        all_s, all_t, all_p = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
        keep_n = max(num_draft_tokens - 1, 0)
        keep = torch.sort(-all_s, dim=1, stable=True).indices[:, :keep_n].sort(dim=1).values
        for r in range(R):
            kept = keep[r].tolist()
            where = {j: i for i, j in enumerate(kept)}
            t = all_t[r, kept].tolist()
            p = all_p[r, kept].tolist()
            out.append(Tree(t, [where.get(x, -1) if x >= 0 else -1 for x in p]))
    return out


# --------------------------------------------------------------------------------------------
# Saving and tiny checkpoints
# --------------------------------------------------------------------------------------------

def save_eagle3(model: Eagle3Drafter, out_dir: str | Path) -> Path:
    """``config.json`` + ``model.safetensors`` as SpecForge saves them (``midlayer.*``, ``d2t``, ``t2d``)."""
    import json

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    cfg.target_layer_ids = model.layer_ids
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    mapped = torch.arange(cfg.draft_vocab_size) + model.d2t.cpu()
    t2d[mapped[(mapped >= 0) & (mapped < cfg.vocab_size)]] = True
    state["t2d"] = t2d
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


