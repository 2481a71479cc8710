"""Offline DFlash acceptance metrics: chain and DDTree block values, the greedy walk, aggregation.

Pure functions over token ids and per-root draft scores; no store access. Definitions follow
z-lab/dflash (the offline acceptance loop) and liranringel/ddtree, as docs/metrics.md states them:

* Chain: a block rooted at p drafts ``d[1..B-1]`` (argmax of the draft logits
  of slots 1..B-1). ``accepted(p)`` = number of leading j with ``d[j] == x[p+j]``, where x is the
  target's greedy sequence. Block value = accepted + 1 (the bonus token), range 1..B.
* DDTree with budget N: best-first heap over per-depth top-min(N, V)
  log-probs (softmax over the full vocabulary, float32) keeps the N most probable prefixes,
  ties broken by Python tuple order exactly as ``liranringel/ddtree: ddtree.py``
  ``build_ddtree_tree``. ``accepted(p)`` = length of the longest prefix of x[p+1:] that is a
  root path; value = accepted + 1, so value <= min(N, B-1) + 1.
* The walk: first root = P (prompt length; x[P] is the prefill argmax and is not
  a block); next root = p + value. Values depend on the method, so chain and every budget are
  walked separately over the same per-root scores.
* End of the completion, two rules:
  - ``"within_output"`` (default, later z-lab ``produced`` rule): value capped at the completion
    tokens left after the root, ``min(accepted + 1, P+N-1-p)``; stop when p >= P+N-1, so a root
    on the last token makes no block.
  - ``"head"`` (z-lab/dflash HEAD 44947fb): every block counts whole, drafts accepted past the end
    included, matched against ``continuation`` = the target's greedy tokens past the end (EOS
    ignored, at least B-1 of them). At least one block is run; stop after a block once the
    committed tokens (bonus included) contain the stop token that ends the completion, or the
    root reaches P+N when the completion was cut at max_new_tokens.
  A stop token inside the completion ends it there (greedy decoding stops at the first one).
* Aggregation: tau = mean over responses of each response's mean block value (a macro
  average); responses with no block (a one-token completion under ``within_output``) are left
  out of tau and counted separately. Also the histogram of values 0..B (index 0 is always 0,
  kept for the reference layout), per-position acceptance ``accept_rate_at[j-1]`` = fraction of
  blocks whose first j drafts were accepted (value >= j+1), j = 1..B-1, and tokens per block
  (total value / blocks).
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "WITHIN_OUTPUT", "HEAD", "RULES", "RootScores", "DDTree", "ResponseWalk", "ResponseEval", "Summary",
    "chain_accept", "topk_log_probs", "build_ddtree", "tree_accept", "candidate_roots", "walk",
    "effective_completion_len", "evaluate_response", "aggregate", "summarize",
]

WITHIN_OUTPUT = "within_output"
HEAD = "head"
RULES = (WITHIN_OUTPUT, HEAD)


# --------------------------------------------------------------------------------------------
# Per-block acceptance
# --------------------------------------------------------------------------------------------

def chain_accept(draft_tokens: Sequence[int], target_tokens: Sequence[int]) -> int:
    """Leading drafts equal to the target's tokens (x[p+1], x[p+2], ...); excludes the bonus."""
    n = 0
    for d, t in zip(draft_tokens, target_tokens):
        if int(d) != int(t):
            break
        n += 1
    return n


def topk_log_probs(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-min(k, V) log-probs and token ids per row, computed the way DDTree does.

    ``logits`` [..., D, V]; returns float32 log-probs and int64 ids, each [..., D, min(k, V)].
    Log-probs are ``top_logit - logsumexp(logits)`` in float32 so tree scores (and their ties)
    round exactly like ``build_ddtree_tree``.
    """
    import torch  # here: aggregating stored block values (the report) must not import torch

    lf = logits.float()
    k = min(int(k), lf.shape[-1])
    top, ids = torch.topk(lf, k=k, dim=-1)
    lp = top - torch.logsumexp(lf, dim=-1, keepdim=True)
    return lp.cpu().numpy().astype(np.float32, copy=False), ids.cpu().numpy().astype(np.int64, copy=False)


@dataclass
class DDTree:
    """A draft tree; node 0 is the root (the block's first token), nodes 1.. are drafts."""

    token_ids: list[int] = field(default_factory=list)   # per drafted node (index i -> node i+1)
    depths: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=lambda: [-1])  # per node, root included
    child_maps: list[dict[int, int]] = field(default_factory=lambda: [{}])
    log_weights: list[float] = field(default_factory=list)

    @property
    def num_drafted(self) -> int:
        return len(self.token_ids)


def build_ddtree(top_log_probs: np.ndarray, top_token_ids: np.ndarray, budget: int,
                 vocab_size: int | None = None) -> DDTree:
    """Best-first DDTree over per-depth top-k candidates (``liranringel/ddtree: build_ddtree_tree``).

    ``top_log_probs``/``top_token_ids`` [D, K] come from :func:`topk_log_probs` with
    K >= min(budget, V); depth d uses its first min(budget, V) candidates. ``budget`` counts
    drafted nodes (root excluded). Node score = sum of per-depth log-probs along the path; the
    heap pops prefixes in non-increasing score, ties broken by the rank tuple and then the rest
    of the tuple, as in the reference.
    """
    lp = np.asarray(top_log_probs, dtype=np.float32)
    ids = np.asarray(top_token_ids)
    tree = DDTree()
    if budget <= 0 or lp.shape[0] == 0:
        return tree
    avail = lp.shape[1]
    # Without vocab_size the table is taken to hold every candidate there is (K = V when K < budget).
    topk = min(budget, avail if vocab_size is None else vocab_size)
    if avail < topk:
        raise ValueError(f"DDTree budget {budget} needs top-{topk} candidates per depth, only {avail} given")
    depth_limit = lp.shape[0]
    # Scores are accumulated in Python floats from float32 table entries, in the reference's
    # order of operations, so equal-score ties resolve identically.
    first = float(lp[0, 0])
    heap = [(-first, (0,), 0, 1, 0, first)]
    while heap and len(tree.token_ids) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        token = int(ids[depth - 1, rank])
        node = len(tree.token_ids) + 1
        tree.token_ids.append(token)
        tree.depths.append(depth)
        tree.parents.append(parent)
        tree.log_weights.append(score)
        tree.child_maps.append({})
        tree.child_maps[parent][token] = node
        if rank + 1 < topk:
            sib = score - float(lp[depth - 1, rank]) + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sib))
        if depth < depth_limit:
            child = score + float(lp[depth, 0])
            heapq.heappush(heap, (-child, ranks + (0,), node, depth + 1, 0, child))
    return tree


def tree_accept(tree: DDTree, target_tokens: Sequence[int]) -> int:
    """Length of the longest prefix of ``target_tokens`` (x[p+1:]) that is a root path."""
    node, n = 0, 0
    for t in target_tokens:
        nxt = tree.child_maps[node].get(int(t))
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


# --------------------------------------------------------------------------------------------
# Per-root scores
# --------------------------------------------------------------------------------------------

@dataclass
class RootScores:
    """What the metrics need from the draft logits of each candidate root, without the [V] axis.

    ``argmax`` [R, D] drives the chain (``argmax`` of the logits, as the reference samples at
    temperature 0); ``top_lp``/``top_ids`` [R, D, K] drive DDTree budgets up to K.
    """

    roots: list[int]
    argmax: np.ndarray
    top_lp: np.ndarray
    top_ids: np.ndarray
    vocab_size: int

    @classmethod
    def from_logits(cls, roots: Sequence[int], logits: torch.Tensor, k: int = 0) -> "RootScores":
        if logits.shape[0] != len(roots):
            raise ValueError(f"{len(roots)} roots but logits for {logits.shape[0]}")
        lf = logits.float()
        argmax = lf.argmax(-1).cpu().numpy().astype(np.int64)
        if k > 0:
            lp, ids = topk_log_probs(lf, k)
        else:
            lp = np.zeros(lf.shape[:2] + (0,), np.float32)
            ids = np.zeros(lf.shape[:2] + (0,), np.int64)
        return cls([int(r) for r in roots], argmax, lp, ids, int(lf.shape[-1]))

    @classmethod
    def concat(cls, parts: Sequence["RootScores"]) -> "RootScores":
        if not parts:
            raise ValueError("no parts")
        return cls([r for p in parts for r in p.roots], np.concatenate([p.argmax for p in parts]),
                   np.concatenate([p.top_lp for p in parts]), np.concatenate([p.top_ids for p in parts]),
                   parts[0].vocab_size)


# --------------------------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------------------------

def effective_completion_len(tokens: Sequence[int], prompt_len: int,
                             stop_token_ids: Sequence[int] | None) -> tuple[int, bool]:
    """(N, ended_by_stop): the completion is cut after its first stop token, if any."""
    n = len(tokens) - prompt_len
    if n < 1:
        raise ValueError(f"no completion: {len(tokens)} tokens with prompt length {prompt_len}")
    if stop_token_ids:
        stops = {int(s) for s in stop_token_ids}
        for i in range(prompt_len, len(tokens)):
            if int(tokens[i]) in stops:
                return i - prompt_len + 1, True
    return n, False


def _limit(prompt_len: int, n: int, rule: str, ended_by_stop: bool) -> int:
    if rule == WITHIN_OUTPUT:
        return prompt_len + n - 1
    if rule == HEAD:
        return prompt_len + n - 1 if ended_by_stop else prompt_len + n
    raise ValueError(f"unknown end rule {rule!r}; use one of {RULES}")


def candidate_roots(prompt_len: int, completion_len: int, *, rule: str = WITHIN_OUTPUT,
                    ended_by_stop: bool = False) -> list[int]:
    """Every root the walk can visit; score these, then walk each method over them."""
    limit = _limit(prompt_len, completion_len, rule, ended_by_stop)
    if rule == HEAD:
        return list(range(prompt_len, max(limit, prompt_len + 1)))
    return list(range(prompt_len, limit))


def walk(accepted: Mapping[int, int], prompt_len: int, completion_len: int, *, rule: str = WITHIN_OUTPUT,
         ended_by_stop: bool = False) -> tuple[list[int], list[int]]:
    """Greedy walk over per-root accepted-draft counts; returns (roots, block values).

    ``accepted[p]`` = drafts accepted for the block rooted at p (without the bonus).
    """
    limit = _limit(prompt_len, completion_len, rule, ended_by_stop)
    last = prompt_len + completion_len - 1
    roots, values = [], []
    p = prompt_len
    if rule == WITHIN_OUTPUT:
        while p < limit:
            v = min(accepted[p] + 1, last - p)
            roots.append(p)
            values.append(v)
            p += v
    else:
        # HEAD checks the stop condition only after a block, so the first block always runs.
        while True:
            v = accepted[p] + 1
            roots.append(p)
            values.append(v)
            p += v
            if p >= limit:
                break
    return roots, values


@dataclass
class ResponseWalk:
    roots: list[int]
    values: list[int]

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


@dataclass
class ResponseEval:
    """Chain and per-budget tree walks of one response, plus the per-root values they used."""

    rule: str
    prompt_len: int
    completion_len: int
    ended_by_stop: bool
    chain: ResponseWalk
    trees: dict[int, ResponseWalk]
    chain_accepted: dict[int, int]
    tree_accepted: dict[int, dict[int, int]]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["trees"] = {str(b): w for b, w in d["trees"].items()}
        d["tree_accepted"] = {str(b): {str(p): a for p, a in m.items()} for b, m in d["tree_accepted"].items()}
        d["chain_accepted"] = {str(p): a for p, a in d["chain_accepted"].items()}
        return d


def evaluate_response(scores: RootScores | torch.Tensor, tokens: Sequence[int], prompt_len: int, *,
                      roots: Sequence[int] | None = None, budgets: Sequence[int] = (),
                      rule: str = WITHIN_OUTPUT, continuation: Sequence[int] | None = None,
                      stop_token_ids: Sequence[int] | None = None) -> ResponseEval:
    """Chain and DDTree values for every candidate root, then one walk per method.

    ``scores``: :class:`RootScores`, or raw draft logits [R, B-1, V] for ``roots``. ``tokens`` =
    prompt + greedy completion. ``rule="head"`` needs ``continuation``: the target's greedy tokens
    after the completion (EOS ignored), at least B-1 of them.
    """
    if not isinstance(scores, RootScores):  # raw logits (a torch tensor)
        if roots is None:
            raise ValueError("pass roots= with raw logits")
        scores = RootScores.from_logits(roots, scores, k=max(budgets, default=0))
    tokens = [int(t) for t in tokens]
    n, ended = effective_completion_len(tokens, prompt_len, stop_token_ids)
    seq = tokens[:prompt_len + n]
    depth = scores.argmax.shape[1]
    if rule not in RULES:
        raise ValueError(f"unknown end rule {rule!r}; use one of {RULES}")
    needed = candidate_roots(prompt_len, n, rule=rule, ended_by_stop=ended)
    if rule == HEAD:
        # the last candidate root's drafts reach depth tokens past it
        need = max(needed) + depth - (prompt_len + n - 1)
        have = 0 if continuation is None else len(continuation)
        if have < need:
            raise ValueError(f"rule 'head' needs the target's greedy continuation past the completion "
                             f"(>= {need} tokens, got {have}); use rule 'within_output' without one")
        seq = seq + [int(t) for t in continuation]
    end = len(seq)  # within_output: matching never looks past the completion
    row = {p: i for i, p in enumerate(scores.roots)}
    missing = [p for p in needed if p not in row]
    if missing:
        raise ValueError(f"scores lack roots {missing[:5]} (need every root in {needed[0]}..{needed[-1]})")
    for b in budgets:
        if b > 0 and scores.top_lp.shape[2] < min(b, scores.vocab_size):
            raise ValueError(f"budget {b} needs top-{min(b, scores.vocab_size)} scores, "
                             f"have {scores.top_lp.shape[2]}")

    chain_acc, tree_acc = {}, {b: {} for b in budgets}
    for p in needed:
        i = row[p]
        target = seq[p + 1:min(p + 1 + depth, end)]
        chain_acc[p] = chain_accept(scores.argmax[i], target)
        for b in budgets:
            tree = build_ddtree(scores.top_lp[i], scores.top_ids[i], b, scores.vocab_size)
            tree_acc[b][p] = tree_accept(tree, target)
    chain = ResponseWalk(*walk(chain_acc, prompt_len, n, rule=rule, ended_by_stop=ended))
    trees = {b: ResponseWalk(*walk(tree_acc[b], prompt_len, n, rule=rule, ended_by_stop=ended)) for b in budgets}
    return ResponseEval(rule, prompt_len, n, ended, chain, trees, chain_acc, tree_acc)


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------

@dataclass
class Summary:
    """Dataset-level acceptance; plain fields, ``asdict`` serialises it to JSON."""

    block_size: int
    tau: float | None
    num_responses: int
    num_empty_responses: int
    num_blocks: int
    num_tokens: int
    tokens_per_block: float | None
    histogram: list[int]
    histogram_frac: list[float]
    accept_rate_at: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def aggregate(responses: Sequence[Sequence[int]], block_size: int) -> Summary:
    """tau (macro mean), histogram 0..B, per-position acceptance, tokens per block."""
    per_response = [sum(v) / len(v) for v in responses if len(v)]
    values = [int(x) for v in responses for x in v]
    hist = [0] * (block_size + 1)
    for x in values:
        if not 1 <= x <= block_size:
            raise ValueError(f"block value {x} outside 1..{block_size}")
        hist[x] += 1
    nb = len(values)
    rates = [sum(1 for x in values if x >= j + 1) / nb if nb else 0.0 for j in range(1, block_size)]
    return Summary(
        block_size=block_size,
        tau=sum(per_response) / len(per_response) if per_response else None,
        num_responses=len(responses), num_empty_responses=len(responses) - len(per_response),
        num_blocks=nb, num_tokens=sum(values),
        tokens_per_block=sum(values) / nb if nb else None,
        histogram=hist, histogram_frac=[h / nb if nb else 0.0 for h in hist], accept_rate_at=rates,
    )


def summarize(evals: Sequence[ResponseEval], block_size: int) -> dict:
    """JSON-ready ``{"rule", "chain": Summary, "tree": {budget: Summary}}`` over responses."""
    rules = {e.rule for e in evals}
    if len(rules) > 1:
        raise ValueError(f"responses evaluated with different end rules {sorted(rules)}")
    budgets = sorted({b for e in evals for b in e.trees})
    return {
        "rule": rules.pop() if rules else None,
        "chain": aggregate([e.chain.values for e in evals], block_size).to_dict(),
        "tree": {str(b): aggregate([e.trees[b].values for e in evals if b in e.trees], block_size).to_dict()
                 for b in budgets},
    }
