"""Acceptance metrics: chain, DDTree (dflash.md §3), the walk and its end rules (§6, §7), aggregation."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from runner.stages.drafter_eval import metrics
from runner.stages.drafter_eval.metrics import (HEAD, WITHIN_OUTPUT, RootScores, aggregate, build_ddtree, candidate_roots,
                            chain_accept, evaluate_response, summarize, topk_log_probs, tree_accept, walk)


def _paths(tree) -> set[tuple[int, ...]]:
    out = set()
    for node in range(1, tree.num_drafted + 1):
        path, n = [], node
        while n:
            path.append(tree.token_ids[n - 1])
            n = tree.parents[n]
        out.add(tuple(reversed(path)))
    return out


def _random_logits(rng: np.random.Generator, depth: int, vocab: int, sharp: float = 3.0) -> torch.Tensor:
    return torch.from_numpy(rng.normal(size=(depth, vocab)) * sharp).float()


# ---- chain ---------------------------------------------------------------------------------

def test_chain_accept_counts_leading_matches_only():
    assert chain_accept([5, 6, 7], [5, 6, 7]) == 3
    assert chain_accept([5, 9, 7], [5, 6, 7]) == 1          # a later match after a miss does not count
    assert chain_accept([9, 6, 7], [5, 6, 7]) == 0
    assert chain_accept([5, 6, 7], [5, 6]) == 2             # target shorter (end of completion)


# ---- DDTree --------------------------------------------------------------------------------

def test_ddtree_is_the_budget_most_probable_prefixes():
    rng = np.random.default_rng(0)
    depth, vocab = 3, 6
    for _ in range(20):
        logits = _random_logits(rng, depth, vocab)
        lp_full = torch.log_softmax(logits, -1).numpy().astype(np.float64)
        scores = {}
        for k in range(1, depth + 1):
            for path in itertools.product(range(vocab), repeat=k):
                scores[path] = sum(lp_full[d, t] for d, t in enumerate(path))
        ranked = sorted(scores, key=lambda p: -scores[p])
        for budget in (1, 2, 5, 11, 40):
            lp, ids = topk_log_probs(logits, budget)
            tree = build_ddtree(lp, ids, budget, vocab_size=vocab)
            assert tree.num_drafted == budget
            assert _paths(tree) == set(ranked[:budget])
            # best-first: node scores never increase in pop order
            assert all(a >= b for a, b in zip(tree.log_weights, tree.log_weights[1:]))


def test_ddtree_ties_break_by_rank_tuple():
    # Root's two children tie (-0.5) and the first child's best child adds 0.0, tying with the
    # second child too. Python tuple order puts ranks (0, 0) before (1,), so the deeper node comes
    # second and the sibling third, as in liranringel/ddtree's heap.
    lp = np.array([[-0.5, -0.5], [0.0, -3.0]], dtype=np.float32)
    ids = np.array([[10, 11], [20, 21]])
    tree = build_ddtree(lp, ids, budget=3)
    assert tree.token_ids == [10, 20, 11]
    assert tree.depths == [1, 2, 1]
    assert tree.parents == [-1, 0, 1, 0]
    assert tree.child_maps[0] == {10: 1, 11: 3} and tree.child_maps[1] == {20: 2}


def test_ddtree_hand_built_distribution_accepts_known_path():
    A, B, C, F = 0, 1, 2, 5                                   # E = 4
    probs = np.array([[0.5, 0.45, 0.02, 0.01, 0.01, 0.01],         # depth 1: A, B
                      [0.024, 0.024, 0.88, 0.024, 0.024, 0.024],   # depth 2: C
                      [0.01, 0.01, 0.01, 0.01, 0.55, 0.41]])       # depth 3: E, F
    logits = torch.log(torch.tensor(probs, dtype=torch.float32))
    lp, ids = topk_log_probs(logits, 8)
    # Prefix scores: A .5, B .45, AC .44, BC .396, ACE .242, BCE .218, ACF .180, BCF .162,
    # then everything else <= .02.
    tree = build_ddtree(lp, ids, budget=4, vocab_size=6)
    assert _paths(tree) == {(A,), (B,), (A, C), (B, C)}
    target = [B, C, F]
    assert chain_accept(logits.argmax(-1).tolist(), target) == 0   # the chain drafts A first
    assert tree_accept(tree, target) == 2                         # the tree holds B -> C
    assert tree_accept(build_ddtree(lp, ids, budget=7, vocab_size=6), target) == 2
    tree8 = build_ddtree(lp, ids, budget=8, vocab_size=6)
    assert (B, C, F) in _paths(tree8)
    assert tree_accept(tree8, target) == 3


def test_ddtree_budget_one_is_the_first_chain_draft():
    rng = np.random.default_rng(1)
    for seed in range(200):
        logits = _random_logits(rng, 7, 16, sharp=2.0)
        lp, ids = topk_log_probs(logits, 1)
        tree = build_ddtree(lp, ids, 1, vocab_size=16)
        draft = logits.argmax(-1).tolist()
        target = draft[:rng.integers(0, 8)] + list(rng.integers(0, 16, size=7))
        target = target[:7]
        assert tree_accept(tree, target) == min(chain_accept(draft, target), 1)


def test_ddtree_acceptance_never_decreases_with_budget():
    rng = np.random.default_rng(2)
    budgets = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64]
    for seed in range(150):
        depth, vocab = 7, int(rng.integers(4, 40))
        logits = _random_logits(rng, depth, vocab, sharp=float(rng.uniform(0.5, 4)))
        lp, ids = topk_log_probs(logits, max(budgets))
        # targets drawn from each depth's top few tokens so long accepted paths happen
        target = [int(ids[d, rng.integers(0, min(3, ids.shape[1]))]) for d in range(depth)]
        prev_acc, prev_paths = -1, set()
        for b in budgets:
            tree = build_ddtree(lp, ids, b, vocab_size=vocab)
            acc, paths = tree_accept(tree, target), _paths(tree)
            assert acc >= prev_acc
            assert prev_paths <= paths       # a bigger budget only adds nodes
            prev_acc, prev_paths = acc, paths


def test_ddtree_needs_enough_candidates():
    lp, ids = topk_log_probs(torch.randn(3, 50), 4)
    with pytest.raises(ValueError, match="top-8"):
        build_ddtree(lp, ids, 8, vocab_size=50)
    assert build_ddtree(lp, ids, 0).num_drafted == 0


# ---- walk ----------------------------------------------------------------------------------

def test_walk_within_output_caps_and_skips_last_token_root():
    P, N = 10, 9                      # completion positions 10..18, last token at 18
    acc = {p: 3 for p in range(P, P + N)}
    roots, values = walk(acc, P, N)
    # 10 -> 14 -> 18 stops: root 18 is the last token, which makes no block
    assert roots == [10, 14] and values == [4, 4]
    acc[14] = 7                       # 8 would run past the end; capped at 18 - 14 = 4
    assert walk(acc, P, N) == ([10, 14], [4, 4])
    acc = {p: 0 for p in range(P, P + N)}
    assert walk(acc, P, N) == (list(range(10, 18)), [1] * 8)
    assert walk({}, P, 1) == ([], [])  # one-token completion: no block at all


def test_walk_head_counts_whole_last_block():
    P, N = 10, 9
    acc = {p: 3 for p in range(P, P + N)}
    acc[14] = 7
    # cut at max_new_tokens: blocks run while the root is < P+N = 19; the last counts whole
    assert walk(acc, P, N, rule=HEAD) == ([10, 14], [4, 8])
    acc[14] = 3
    assert walk(acc, P, N, rule=HEAD) == ([10, 14, 18], [4, 4, 4])
    # ended by EOS at 18: committing position 18 (as the bonus) stops the loop
    assert walk(acc, P, N, rule=HEAD, ended_by_stop=True) == ([10, 14], [4, 4])
    # HEAD runs one block even when the prefill token already was EOS
    assert walk({10: 2}, P, 1, rule=HEAD, ended_by_stop=True) == ([10], [3])


def test_candidate_roots_cover_every_walk():
    assert candidate_roots(5, 4) == [5, 6, 7]
    assert candidate_roots(5, 4, rule=HEAD) == [5, 6, 7, 8]
    assert candidate_roots(5, 4, rule=HEAD, ended_by_stop=True) == [5, 6, 7]
    assert candidate_roots(5, 1, rule=HEAD, ended_by_stop=True) == [5]
    assert candidate_roots(5, 1) == []


# ---- evaluate_response ---------------------------------------------------------------------

def _oracle_logits(seq: list[int], roots: list[int], B: int, V: int, wrong_at: dict[int, int]) -> torch.Tensor:
    """Logits whose argmax at slot j of root p is seq[p+j], except slot wrong_at[p] is wrong."""
    out = torch.zeros(len(roots), B - 1, V)
    for i, p in enumerate(roots):
        for j in range(1, B):
            tok = seq[p + j] if p + j < len(seq) else 0
            if wrong_at.get(p) == j:
                tok = (tok + 1) % V
            out[i, j - 1, tok] = 5.0
    return out


def test_evaluate_response_chain_and_trees_walk_separately():
    B, V, P = 8, 32, 6
    rng = np.random.default_rng(3)
    seq = [int(t) for t in rng.integers(4, V, size=P + 30)]
    roots = candidate_roots(P, 30)
    wrong = {p: 1 + (p % 5) for p in roots}             # chain accepts (p % 5) drafts at root p
    logits = _oracle_logits(seq, roots, B, V, wrong)
    ev = evaluate_response(logits, seq, P, roots=roots, budgets=[1, 4, 64])
    for p in roots:
        assert ev.chain_accepted[p] == min(p % 5, P + 30 - 1 - p)
        assert ev.tree_accepted[1][p] == min(ev.chain_accepted[p], 1)
        assert ev.tree_accepted[64][p] >= ev.tree_accepted[4][p] >= ev.tree_accepted[1][p]
    # each method's walk uses its own values
    p, expect = P, []
    while p < P + 29:
        v = min(ev.chain_accepted[p] + 1, P + 29 - p)
        expect.append((p, v))
        p += v
    assert list(zip(ev.chain.roots, ev.chain.values)) == expect
    assert ev.trees[1].values and max(ev.trees[1].values) <= 2
    assert sum(ev.trees[64].values) == 29 == sum(ev.chain.values)   # blocks tile the completion
    json.dumps(ev.to_dict())


def test_evaluate_response_head_rule_needs_and_uses_continuation():
    B, V, P, N = 8, 32, 4, 12
    rng = np.random.default_rng(4)
    full = [int(t) for t in rng.integers(4, V, size=P + N + B)]
    seq, cont = full[:P + N], full[P + N:]
    roots = candidate_roots(P, N, rule=HEAD)
    logits = _oracle_logits(full, roots, B, V, {})       # perfect drafter
    with pytest.raises(ValueError, match="continuation"):
        evaluate_response(logits, seq, P, roots=roots, rule=HEAD)
    head = evaluate_response(logits, seq, P, roots=roots, rule=HEAD, continuation=cont)
    assert head.chain.values == [8, 8]                  # roots 4, 12: the second block runs past the end
    within = evaluate_response(logits[:-1], seq, P, roots=roots[:-1])
    assert within.chain.values == [8, 3]                 # capped at the 3 tokens left after root 12


def test_evaluate_response_stops_at_first_stop_token():
    B, V, P = 4, 16, 3
    seq = [5, 6, 7, 8, 9, 2, 10, 11]                     # EOS (2) at position 5: completion is 8, 9, 2
    roots = candidate_roots(P, 3)
    logits = _oracle_logits(seq, roots, B, V, {})
    ev = evaluate_response(logits, seq, P, roots=roots, stop_token_ids=[2])
    assert ev.completion_len == 3 and ev.ended_by_stop
    assert ev.chain.values == [2]


def test_root_scores_concat_matches_whole():
    logits = torch.randn(6, 7, 50)
    whole = RootScores.from_logits(range(6), logits, k=16)
    parts = RootScores.concat([RootScores.from_logits(range(3), logits[:3], k=16),
                               RootScores.from_logits(range(3, 6), logits[3:], k=16)])
    assert parts.roots == whole.roots
    assert np.array_equal(parts.argmax, whole.argmax) and np.array_equal(parts.top_ids, whole.top_ids)


# ---- aggregation ---------------------------------------------------------------------------

def test_aggregate_macro_tau_histogram_rates():
    s = aggregate([[1, 3, 8], [2], []], block_size=8)
    assert math.isclose(s.tau, ((1 + 3 + 8) / 3 + 2) / 2)     # mean of per-response means
    assert s.num_responses == 3 and s.num_empty_responses == 1
    assert s.num_blocks == 4 and s.num_tokens == 14 and s.tokens_per_block == 3.5
    assert s.histogram == [0, 1, 1, 1, 0, 0, 0, 0, 1]
    assert s.accept_rate_at == [0.75, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25]
    json.dumps(s.to_dict())
    with pytest.raises(ValueError):
        aggregate([[9]], block_size=8)


def test_summarize_is_json_ready():
    B, V, P = 4, 16, 3
    seq = [5, 6, 7, 8, 9, 10, 11, 12]
    roots = candidate_roots(P, 5)
    ev = evaluate_response(_oracle_logits(seq, roots, B, V, {}), seq, P, roots=roots, budgets=[2])
    out = json.loads(json.dumps(summarize([ev, ev], B)))
    assert out["rule"] == WITHIN_OUTPUT
    assert out["chain"]["tau"] == 4.0            # one block: root 3 takes all 4 tokens left
    assert out["tree"]["2"]["tau"] == 2.0        # budget 2: blocks of 3 then 1 (capped)
    assert metrics.RULES == (WITHIN_OUTPUT, HEAD)


def test_head_rule_on_a_one_token_completion_still_runs_one_block():
    B, V, P = 4, 16, 3
    seq = [5, 6, 7, 2]                                   # the prefill token is already EOS
    roots = candidate_roots(P, 1, rule=HEAD, ended_by_stop=True)
    full = seq + [9, 10, 11]
    logits = _oracle_logits(full, roots, B, V, {})
    with pytest.raises(ValueError, match=">= 3 tokens"):
        evaluate_response(logits, seq, P, roots=roots, rule=HEAD, continuation=[9, 10], stop_token_ids=[2])
    ev = evaluate_response(logits, seq, P, roots=roots, rule=HEAD, continuation=[9, 10, 11], stop_token_ids=[2])
    assert ev.chain.values == [4]
    assert evaluate_response(logits[:0], seq, P, roots=[], stop_token_ids=[2]).chain.values == []
