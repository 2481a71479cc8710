"""DSpark (SpecForge 0.2 ``DSparkDraftModel``, speculators 0.9 ``dspark``): a DFlash backbone plus
a low-rank Markov logit bias over the previous block token, and a confidence head.

Read from the peers' model code (not copied): the backbone is DFlash's unchanged (same config,
same ``fc``/``hidden_norm``/layers/``norm``); after ``base = lm_head(norm(h))`` slot ``k`` of a
block gets ``base[k] + markov_w2(f(prev_k, h_k))`` where ``prev_k`` is the token before slot
``k`` (the root for slot 1, then the token drafted at ``k - 1``) and ``h_k`` the backbone's normed
hidden state at the slot:

* ``vanilla``: ``f = markov_w1[prev]``;
* ``gated``: ``f = sigmoid(gate_proj([h; w1[prev]])) * w1[prev]``;
* ``rnn``: a state ``s`` (zeros at slot 1) updated per slot from ``joint_proj([s; w1[prev]; h])``
  split into gate / candidate / output; ``f = tanh(output)``.

The confidence head (``confidence_head.proj``) predicts acceptance and does not change the draft:
greedy τ ignores it.

Greedy acceptance needs no sequential loop: a slot counts only while every earlier draft equalled
the target's token, so along the accepted prefix ``prev_k`` *is* the target's token. The accepted
length of a block is therefore the first mismatch of ``argmax(base + block_bias(prev = the
target's tokens))`` (:func:`accepted_lengths`), batched over all roots at once; :func:`greedy_chain`
is the sequential draft (the reference online loop's), equal to it block for block (tested).

Layouts: SpecForge keeps the DSpark fields in ``dflash_config`` (``projector_type: "dspark"``,
``markov_rank`` default 0 = no head, ``markov_head_type``, ``enable_confidence_head``,
``confidence_head_with_markov``) and drafts slots 1..B-1 as DFlash does. speculators puts them at
the top level (``speculators_model_type: "dspark"``, ``markov_rank`` default 256), the backbone's
fields under ``transformer_layer_config`` (``dspark_config.backbone_config`` reads them as
SpecForge's), and by default ``sample_from_anchor: true`` (speculators 0.9
``DFlashDraftModel._backbone_forward``: targets at ``anchored_block_indices`` unshifted, and
``DSparkDraftModel.forward``: ``prev_token_ids = block_tokens``): the anchor slot's output drafts
the token after the root, slot ``k`` the token ``k + 1`` after it, its previous token block token
``k``. The block's input is unchanged (``[x[p], MASK x (B-1)]``, context < p): only which slots
give drafts moves (``first_draft_slot`` 0, ``num_drafts`` B), so everything below runs with
K = B and ``prev`` starting at the root, as for K = B-1.

A draft vocabulary (speculators' ``draft_vocab_size`` < the target's): ``lm_head`` and
``markov_w2`` have draft-vocabulary rows, ``markov_w1`` the target's (it reads the previous token's
target id); the buffers ``d2t`` (offsets: draft id ``d`` is target id ``d + d2t[d]``, as EAGLE-3's)
and ``t2d`` (a mask) are in the safetensors, and the reduced ``lm_head.weight`` too (speculators
keeps it; dfcache falls back to the target's rows ``d + d2t[d]``). Drafts are mapped to target ids
(:func:`_to_target`) before they are compared or fed back to the head.

:class:`DSparkDrafter` is the DFlash backbone (``DFlashDrafter``, its loader and batched
``block_logits``) with the head; its final norm records its output so the head reads the normed
hidden states of the slots ``block_logits`` and the parity reference draft computed.
:func:`score_roots` gives the accepted lengths of all roots of a response, batched;
:func:`iter_drafts` the teacher-forced drafts the eval's chain walk reads (equal to the sequential
draft up to and including its first rejected token, so the chain's accepted lengths are equal);
``runner.trust.parity.online_dspark`` is the reference online loop. The family is
``runner.drafters.family.DSpark``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from collections.abc import Sequence
from pathlib import Path

from dfcache.errors import BadInputError

from .dflash import DFlashDrafter, TargetHead, iter_score_roots

from .dspark_config import HEAD_TYPES, DSparkHeadConfig, head_config, is_dspark_config  # noqa: F401


class MarkovHead(nn.Module):
    """The Markov logit bias; parameter names as both peers save them (``markov_w1``/``_w2``,
    ``gate_proj``, ``joint_proj``) under ``markov_head.``."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str = "vanilla",
                 draft_vocab_size: int | None = None):
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise ValueError(f"head_type {head_type!r}")
        self.head_type, self.rank = head_type, int(rank)
        # w1 is indexed by the previous token's target id, w2 gives draft-vocabulary logits
        # (speculators' MarkovHead: verifier_vocab_size / draft_vocab_size)
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size or vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def _rnn_step(self, state, emb, hidden):
        gate, cand, out = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return gate * state + (1.0 - gate) * torch.tanh(cand), self.markov_w2(torch.tanh(out))

    def step_bias(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """Bias [n, V] for one slot and the next state (rnn; None otherwise)."""
        emb = self.markov_w1(prev.long())
        if self.head_type == "vanilla":
            return self.markov_w2(emb), None
        hidden = hidden.to(emb.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1)))
            return self.markov_w2(gate * emb), None
        if state is None:
            state = emb.new_zeros(emb.shape[:-1] + (self.rank,))
        state, bias = self._rnn_step(state, emb, hidden)
        return bias, state

    def block_bias(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced bias [n, K, V] for slots whose previous tokens are ``prev`` [n, K]
        (``hidden`` [n, K, H]); all slots at once where the head has no state."""
        emb = self.markov_w1(prev.long())
        if self.head_type == "vanilla":
            return self.markov_w2(emb)
        hidden = hidden.to(emb.dtype)
        if self.head_type == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1))) * emb)
        state, out = emb.new_zeros(emb.shape[0], self.rank), []
        for k in range(emb.shape[1]):
            state, bias = self._rnn_step(state, emb[:, k], hidden[:, k])
            out.append(bias)
        return torch.stack(out, dim=1)


def load_markov_head(tensors: dict[str, torch.Tensor], cfg: DSparkHeadConfig, vocab_size: int,
                     hidden_size: int, draft_vocab_size: int | None = None) -> MarkovHead | None:
    """The head from a checkpoint's tensors (``markov_head.*``, SpecForge's early
    ``logit_head.markov_head.*`` and a ``model.`` prefix accepted); None where markov_rank is 0."""
    if cfg.markov_rank == 0:
        return None
    head = MarkovHead(vocab_size, cfg.markov_rank, hidden_size, cfg.head_type, draft_vocab_size)
    state = {}
    for name, t in tensors.items():
        for prefix in ("model.logit_head.markov_head.", "logit_head.markov_head.", "model.markov_head.", "markov_head."):
            if name.startswith(prefix):
                state[name[len(prefix):]] = t
                break
    missing = sorted(set(head.state_dict()) - set(state))
    if missing:
        raise BadInputError(f"DSpark drafter: markov_head tensors {missing} missing for a {cfg.head_type} head of "
                            f"rank {cfg.markov_rank}; re-save the checkpoint.")
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    bad = [k for k in shapes if tuple(state[k].shape) != shapes[k]]
    if bad:
        raise BadInputError(f"DSpark drafter: markov_head tensors {bad} have shapes "
                            f"{[tuple(state[k].shape) for k in bad]}, expected {[shapes[k] for k in bad]} "
                            f"(vocabulary {vocab_size}, hidden {hidden_size}); pass the drafter for this target.")
    head.load_state_dict({k: state[k] for k in shapes})
    return head


def _to_target(ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocabulary ids to target ids (``d + d2t[d]``, speculators' and SpecForge's offsets)."""
    return ids if d2t is None else ids + d2t.to(ids.device)[ids]


@torch.no_grad()
def greedy_chain(head: MarkovHead | None, base: torch.Tensor, root: torch.Tensor, hidden: torch.Tensor,
                 d2t: torch.Tensor | None = None):
    """The sequential draft (the online loop's): tokens [n, K] (target ids) and corrected logits
    [n, K, V] (draft vocabulary) from the backbone's logits ``base`` [n, K, V] and normed hidden
    ``hidden`` [n, K, H] of the K drafting slots, ``root`` [n] the token before the first draft;
    batched over the n blocks. ``d2t``: the draft vocabulary's map (None: the target's)."""
    if head is None:
        return _to_target(base.argmax(-1), d2t), base
    prev, state, toks, logits = root.long(), None, [], []
    for k in range(base.shape[1]):
        bias, state = head.step_bias(prev, hidden[:, k], state)
        step = base[:, k] + bias
        prev = _to_target(step.argmax(-1), d2t)
        toks.append(prev)
        logits.append(step)
    return torch.stack(toks, 1), torch.stack(logits, 1)


@torch.no_grad()
def teacher_forced_drafts(head: MarkovHead | None, base: torch.Tensor, hidden: torch.Tensor,
                          block_tokens: torch.Tensor, d2t: torch.Tensor | None = None) -> torch.Tensor:
    """Drafts [n, K] (target ids), slot ``k``'s previous token the target's (``block_tokens``
    [n, K + 1]: the root then the target's next K tokens): equal to :func:`greedy_chain`'s up to and
    including the first draft that differs from the target's token, which is all a greedy chain
    walk reads."""
    logits = base if head is None else base + head.block_bias(block_tokens[:, :-1], hidden)
    return _to_target(logits.argmax(-1), d2t)


@torch.no_grad()
def accepted_lengths(head: MarkovHead | None, base: torch.Tensor, hidden: torch.Tensor,
                     block_tokens: torch.Tensor, d2t: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy accepted drafts per block [n] (0..K), all slots at once: ``block_tokens`` [n, K + 1]
    are the root then the target's next K tokens (the previous tokens of the accepted prefix)."""
    drafts = teacher_forced_drafts(head, base, hidden, block_tokens, d2t)
    match = (drafts == block_tokens[:, 1:]).to(torch.int64)
    return match.cumprod(dim=1).sum(dim=1)


class _RecordingNorm(nn.Module):
    """The backbone's final norm, keeping its last output (the hidden states the head reads)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.inner, self.last = norm, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self.inner(x)
        return self.last


class DSparkDrafter(DFlashDrafter):
    """A DSpark checkpoint in either layout: the DFlash backbone plus ``markov`` (None where
    markov_rank is 0); ``first_draft_slot`` 0 where the anchor slot drafts (``sample_from_anchor``);
    ``d2t`` (None: the target's vocabulary) and ``lm_weight`` (the checkpoint's reduced lm_head,
    speculators keeps it; None: the target's lm_head rows ``d + d2t[d]``)."""

    d2t: torch.Tensor | None = None
    lm_weight: torch.Tensor | None = None
    _IGNORED_PREFIXES = DFlashDrafter._IGNORED_PREFIXES + ("markov_head.",)  # the head: read below

    @classmethod
    def checkpoint_config(cls, raw: dict, source: str):
        from .dflash import DFlashConfig
        from .dspark_config import backbone_config

        return DFlashConfig.from_dict(backbone_config(raw, source=source), source=source)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "DSparkDrafter":
        import json

        from safetensors import safe_open

        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        hcfg = head_config(raw, source=str(path / "config.json"))
        model = super().from_pretrained(path, device=device, dtype=dtype)
        model.first_draft_slot = 0 if hcfg.sample_from_anchor else 1
        tensors = {}
        wanted = ("d2t", "model.d2t", "lm_head.weight", "model.lm_head.weight")
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    if "markov_head." in name or name in wanted:
                        tensors[name] = st.get_tensor(name)
        vocab = int(hcfg.vocab_size or model.config.vocab_size or 0)
        if not vocab:
            raise BadInputError(f"DSpark drafter {path}: config.json has no vocab_size; add the target's "
                                "vocabulary size.")
        draft = int(hcfg.draft_vocab_size or vocab)
        head = load_markov_head(tensors, hcfg, vocab, model.config.hidden_size, draft)
        model.markov = None if head is None else head.to(device=device, dtype=dtype).eval()
        if draft != vocab:
            d2t = tensors.get("d2t", tensors.get("model.d2t"))
            if d2t is None or tuple(d2t.shape) != (draft,):
                raise BadInputError(f"DSpark drafter {path}: draft_vocab_size {draft} (vocab_size {vocab}) needs a "
                                    f"d2t tensor of {draft} entries, found "
                                    f"{'none' if d2t is None else tuple(d2t.shape)}; re-save it with its vocab maps.")
            d2t = d2t.to(torch.long)
            ids = torch.arange(draft) + d2t
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise BadInputError(f"DSpark drafter {path}: d2t maps draft ids to target ids {int(ids.min())}.."
                                    f"{int(ids.max())}, outside 0..{vocab - 1}; pass the drafter for this target.")
            model.d2t = d2t.to(device)
            lm = tensors.get("lm_head.weight", tensors.get("model.lm_head.weight"))
            if lm is not None:
                if tuple(lm.shape) != (draft, model.config.hidden_size):
                    raise BadInputError(f"DSpark drafter {path}: lm_head.weight is {tuple(lm.shape)}, not "
                                        f"(draft_vocab_size {draft}, hidden {model.config.hidden_size}); re-save it.")
                model.lm_weight = lm.to(device=device, dtype=dtype)
        model.norm = _RecordingNorm(model.norm)
        return model

    def draft_lm_weight(self, head: TargetHead) -> torch.Tensor:
        """The rows logits are taken over: the target's lm_head, or the draft vocabulary's (the
        checkpoint's reduced lm_head, which speculators keeps and loads; else the target's rows
        ``d + d2t[d]``, what speculators derives from t2d when the file has none)."""
        if self.d2t is None:
            return head.lm_head
        if self.lm_weight is None:
            self.lm_weight = head.lm_head[torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t]
        return self.lm_weight

    def compute_logits(self, hidden: torch.Tensor, head: TargetHead, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.d2t is None:
            return super().compute_logits(hidden, head, out=out)
        return self._scaled(F.linear(self.norm(hidden), self.draft_lm_weight(head).to(hidden.dtype)).float(), out)


def _block_tokens(token_ids: torch.Tensor, roots: Sequence[int], B: int) -> torch.Tensor:
    """[n, B]: the root's token then the target's next B-1 (-1 past the end: never a match); B is
    the drafts per block + 1."""
    T = token_ids.shape[0]
    idx = torch.tensor(roots, dtype=torch.long)[:, None] + torch.arange(B)
    return torch.where(idx < T, token_ids[idx.clamp(max=T - 1)], torch.full_like(idx, -1))


@torch.no_grad()
def iter_drafts(drafter: DSparkDrafter, head: TargetHead, context_features: torch.Tensor,
                token_ids: torch.Tensor, roots: Sequence[int], **chunking):
    """(indices into ``roots``, drafts [n, K]) per batched pass of the backbone (K = num_drafts:
    B-1, or B where the anchor slot drafts; target ids, through d2t where the vocabulary is reduced)
    (``runner.drafters.dflash.iter_score_roots``), the head teacher-forced
    (:func:`teacher_forced_drafts`); slots past the end of ``token_ids`` see token 0 as their
    previous token and are never matched (the walk stops at the end)."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).cpu()
    roots = [int(r) for r in roots]
    K = drafter.num_drafts
    for idx, base in iter_score_roots(drafter, head, context_features, token_ids, roots, **chunking):
        # block_logits ran its roots in ascending order (iter_score_roots hands them so): the
        # recorded hidden rows are in the order of idx.
        hidden = drafter.norm.last
        block = _block_tokens(token_ids, [roots[i] for i in idx], K + 1).to(base.device)
        yield idx, teacher_forced_drafts(drafter.markov, base.float(), hidden.float(), block.clamp(min=0),
                                         drafter.d2t)


@torch.no_grad()
def score_roots(drafter: DSparkDrafter, head: TargetHead, context_features: torch.Tensor,
                token_ids: torch.Tensor, roots: Sequence[int], **chunking) -> torch.Tensor:
    """Greedy accepted drafts [len(roots)] for the blocks rooted at each p in ``roots`` (the target's
    tokens ``token_ids`` [T]; features as ``runner.drafters.dflash.score_roots`` takes them), all
    roots through the backbone in batches and the head teacher-forced (:func:`iter_drafts`)."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).cpu()
    roots = [int(r) for r in roots]
    out = torch.zeros(len(roots), dtype=torch.long)
    K = drafter.num_drafts
    for idx, drafts in iter_drafts(drafter, head, context_features, token_ids, roots, **chunking):
        block = _block_tokens(token_ids, [roots[i] for i in idx], K + 1).to(drafts.device)
        match = (drafts == block[:, 1:]).to(torch.int64)  # -1 past the end: never a match
        out[torch.tensor(idx)] = match.cumprod(dim=1).sum(dim=1).cpu()
    return out
