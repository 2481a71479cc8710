"""Fidelity: the offline evaluator reproduces real greedy speculative decoding, block for block.

This is the project's correctness test (DESIGN.md §6; dflash.md §7 "Offline equals online in
float32"). A tiny Qwen3.5 target and a drafter trained on its greedy completions run real
DFlash decoding in the package's loop (``runner.trust.parity.online_dflash``, which `dfcache parity`
runs on users' models), written the way z-lab/dflash HEAD's ``dflash_generate`` does it:
draft a block from the context features committed so far, verify it with a target forward,
accept the matching prefix plus the bonus token, append the accepted positions' target features
to the context, repeat. The offline side instead takes one full target forward over prompt +
completion and scores every candidate root with ``score_roots``; ``runner.stages.drafter_eval.metrics`` walks them.

The target here has gated-DeltaNet layers. The loop runs it as a serving engine does (a KV cache,
one verify forward over each drafted block, the linear-attention state rolled back to the
accepted token: ``runner.trust.parity.CachedVerifier``); ``loop="recompute"`` re-runs the whole prefix
each round instead, and in float32 both verify the same tokens and append the same features.
Exactness runs in float32; in bf16 `dfcache parity` judges τ by an interval over prompts (the
tests at the end).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from runner.stages.drafter_eval import metrics
from runner.drafters.dflash import DFlashDrafter, load_target_head, score_roots
from runner.trust.parity import greedy_continuation, online_dflash
from runner.models.train_tiny import (HELDOUT_PROMPT_IDS, TrainStats, capture_features, greedy_complete,
                                      load_prompts, make_untrained_drafter, single_thread)

MAX_NEW_TOKENS = 64
NUM_PROMPTS = 6
TREE_BUDGETS = [1, 4, 16]


@pytest.fixture(scope="module")
def tiny(tiny_target, trained_drafter, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One intra-op thread: these ops are tiny, and two threads on a busy 2-core box stall each other.
    with single_thread():
        root = tmp_path_factory.mktemp("fidelity")
        c0 = time.process_time()
        target_dir = tiny_target  # the session's (the same default build; this module wrote a second one)
        c1 = time.process_time()
        # train_tiny_drafter(target_dir, ..., seed=0) on one thread, trained once for the session (conftest)
        drafter_dir, train_stats = trained_drafter
        stats: list[TrainStats] = [train_stats]
        c2 = time.process_time()
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(target_dir))
        drafter = DFlashDrafter.from_pretrained(drafter_dir)
        head = load_target_head(target_dir)
        prompts = [p for p in load_prompts(tok) if p[0] in HELDOUT_PROMPT_IDS][:NUM_PROMPTS]
        stop_ids = [tok.eos_token_id]
        runs = []
        for pid, prompt in prompts:
            completion, blocks, logits = online_dflash(model, drafter, head, prompt, MAX_NEW_TOKENS, stop_ids)
            runs.append(dict(id=pid, prompt=prompt, completion=completion, blocks=blocks, draft_logits=logits))
        print(f"\nfixture CPU s: target {c1 - c0:.1f}, train {c2 - c1:.1f}, online {time.process_time() - c2:.1f}")
        yield dict(root=root, target_dir=target_dir, drafter_dir=drafter_dir, model=model, tok=tok,
                   drafter=drafter, head=head, runs=runs, stop_ids=stop_ids, stats=stats[0])


def test_training_is_fast_and_held_out(tiny):
    stats = tiny["stats"]
    # CPU time, not wall time: the shared test machine is often busy with other jobs.
    assert stats.cpu_seconds < 60, f"tiny drafter training took {stats.cpu_seconds:.0f}s of CPU"
    assert not set(stats.train_prompt_ids) & set(HELDOUT_PROMPT_IDS)
    assert stats.losses[-1] < stats.losses[0] / 2


def test_capture_features_are_pre_norm_layer_outputs(tiny):
    model = tiny["model"]
    ids = tiny["runs"][0]["prompt"]
    n_layers = model.config.num_hidden_layers
    _, feats = capture_features(model, ids, list(range(n_layers)))
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    H = model.config.hidden_size
    for k in range(n_layers - 1):
        torch.testing.assert_close(feats[:, k * H:(k + 1) * H], hs[k + 1][0])
    last = feats[:, (n_layers - 1) * H:]
    # HF's last entry has the final norm applied; layer id L-1 must be the residual before it.
    assert not torch.allclose(last, hs[n_layers][0])
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(last), hs[n_layers][0])


def test_loops_agree_in_float32(tiny, monkeypatch):
    """The cached loop (recorded linear-attention states, or a copy of the cache and a replay of the
    accepted tokens) and the whole-prefix loop decode the same blocks in float32."""
    from runner.trust.parity import CachedVerifier

    for run in tiny["runs"][:2]:
        args = (tiny["model"], tiny["drafter"], tiny["head"], run["prompt"], MAX_NEW_TOKENS, tiny["stop_ids"])
        completion, blocks, _ = online_dflash(*args, loop="recompute")
        assert (completion, blocks) == (run["completion"], run["blocks"]), run["id"]
    monkeypatch.setattr(CachedVerifier, "use_recording", False)
    run = tiny["runs"][0]
    completion, blocks, _ = online_dflash(tiny["model"], tiny["drafter"], tiny["head"], run["prompt"],
                                          MAX_NEW_TOKENS, tiny["stop_ids"])
    assert (completion, blocks) == (run["completion"], run["blocks"])


def test_verify_row_does_not_see_the_token_drafted_after_it(tiny):
    """bf16, cached loop: the verify row that chooses x[t] has the same logits, bit for bit, whatever
    token is drafted for x[t] (it enters one slot later), so a draft cannot win a target tie."""
    from transformers import AutoModelForCausalLM

    from runner.trust.parity import parting_row_check

    model = AutoModelForCausalLM.from_pretrained(str(tiny["target_dir"]), dtype=torch.bfloat16).eval()
    drafter = DFlashDrafter.from_pretrained(tiny["drafter_dir"], dtype=torch.bfloat16)
    head = load_target_head(tiny["target_dir"], dtype=torch.bfloat16)
    run = tiny["runs"][0]
    record: dict = {}
    with single_thread():
        completion, _, _ = online_dflash(model, drafter, head, run["prompt"], 32, tiny["stop_ids"], record=record)
        blocks = record["blocks"]
        k = next(i for i, b in enumerate(blocks) if b.value >= 3)
        b = blocks[k]
        t = b.root + 2  # chosen by row 1 of that block; the draft for it sits in slot 2
        others = [x for x in ((b.drafts[1] + 1) % head.vocab_size, 0) if x != b.drafts[1]]
        assert parting_row_check(model, drafter, run["prompt"], completion, blocks, t, others) is True
        # the same check through the whole-prefix loop
        record2: dict = {}
        completion2, _, _ = online_dflash(model, drafter, head, run["prompt"], 32, tiny["stop_ids"],
                                          loop="recompute", record=record2)
        b2 = next(x for x in record2["blocks"] if x.value >= 3)
        assert parting_row_check(model, drafter, run["prompt"], completion2, record2["blocks"], b2.root + 2,
                                 [(b2.drafts[1] + 1) % head.vocab_size], loop="recompute") is True


def test_online_loop_is_lossless(tiny):
    # Speculative decoding must reproduce plain greedy decoding; otherwise the comparison below
    # would be against a broken loop.
    for run in tiny["runs"][:2]:
        plain = greedy_complete(tiny["model"], run["prompt"], MAX_NEW_TOKENS, tiny["tok"].eos_token_id)
        assert run["completion"] == plain


def _offline(tiny, run, rule):
    model, drafter, head = tiny["model"], tiny["drafter"], tiny["head"]
    prompt, completion = run["prompt"], run["completion"]
    seq = prompt + completion
    P, N = len(prompt), len(completion)
    _, feats = capture_features(model, seq, drafter.target_layer_ids)       # one full forward
    ended = completion[-1] in tiny["stop_ids"]
    roots = metrics.candidate_roots(P, N, rule=rule, ended_by_stop=ended)
    logits = score_roots(drafter, head, feats, torch.tensor(seq), roots)
    cont = greedy_continuation(model, seq, drafter.block_size - 1) if rule == metrics.HEAD else None
    ev = metrics.evaluate_response(logits, seq, P, roots=roots, rule=rule, continuation=cont,
                                   stop_token_ids=tiny["stop_ids"], budgets=TREE_BUDGETS)
    return ev, seq + (cont or [])


def test_offline_equals_online_block_for_block(tiny):
    B = tiny["drafter"].block_size
    all_values = []
    for run in tiny["runs"]:
        online = run["blocks"]
        all_values += [v for _, v in online]
        # HEAD rule: the whole last block counts, matched against the greedy continuation.
        head_eval, target_seq = _offline(tiny, run, metrics.HEAD)
        assert list(zip(head_eval.chain.roots, head_eval.chain.values)) == online, run["id"]
        # DDTree: trees built from the online draft logits accept what the offline trees accept.
        for p, logits in run["draft_logits"].items():
            target = target_seq[p + 1:p + B]
            for b in TREE_BUDGETS:
                lp, ids = metrics.topk_log_probs(logits, b)
                tree = metrics.build_ddtree(lp, ids, b, vocab_size=logits.shape[-1])
                assert metrics.tree_accept(tree, target) == head_eval.tree_accepted[b][p], (run["id"], p, b)
        # Within-output rule: the same walk, the last block capped at the completion's end and
        # no block rooted on the last token.
        last = len(run["prompt"]) + len(run["completion"]) - 1
        expect = [(p, min(v, last - p)) for p, v in online if p < last]
        within, _ = _offline(tiny, run, metrics.WITHIN_OUTPUT)
        assert list(zip(within.chain.roots, within.chain.values)) == expect, run["id"]
        # DDTree budget 1 keeps only the first draft: values are the chain's, capped at 2.
        assert all(within.tree_accepted[1][p] == min(a, 1) for p, a in within.chain_accepted.items())
    summary = metrics.aggregate([[v for _, v in r["blocks"]] for r in tiny["runs"]], B)
    frac_ge2 = sum(v >= 2 for v in all_values) / len(all_values)
    assert len(all_values) >= 60
    print(f"\nonline: {len(all_values)} blocks, tau {summary.tau:.2f}, {frac_ge2:.0%} accept >= 2 tokens")
    assert frac_ge2 >= 1 / 3, f"only {frac_ge2:.0%} of blocks accepted >= 2 tokens (tau {summary.tau:.2f})"
    # Not a drafter that accepts everything either: the comparison must see a mix of values.
    assert len(set(all_values)) >= 3


def test_batched_scoring_matches_one_at_a_time_on_real_features(tiny):
    from runner.drafters.dflash import score_roots_one_at_a_time

    run, drafter, head = tiny["runs"][0], tiny["drafter"], tiny["head"]
    seq = run["prompt"] + run["completion"]
    _, feats = capture_features(tiny["model"], seq, drafter.target_layer_ids)
    roots = list(range(len(run["prompt"]), len(seq) - 1))
    t0 = time.perf_counter()
    fast = score_roots(drafter, head, feats, torch.tensor(seq), roots, max_batch_roots=16)
    t1 = time.perf_counter()
    slow = score_roots_one_at_a_time(drafter, head, feats, torch.tensor(seq), roots)
    t2 = time.perf_counter()
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))
    print(f"score_roots: {len(roots)} roots batched {t1 - t0:.3f}s, one at a time {t2 - t1:.3f}s "
          f"({(t2 - t1) / max(t1 - t0, 1e-9):.1f}x)")


def test_untrained_drafter_has_same_config_and_low_acceptance(tiny):
    path = make_untrained_drafter(tiny["target_dir"], tiny["root"] / "untrained", seed=1)
    untrained = DFlashDrafter.from_pretrained(path)
    assert untrained.config == tiny["drafter"].config
    run = tiny["runs"][0]
    seq = run["prompt"] + run["completion"]
    _, feats = capture_features(tiny["model"], seq, untrained.target_layer_ids)
    roots = metrics.candidate_roots(len(run["prompt"]), len(run["completion"]))
    ev = metrics.evaluate_response(score_roots(untrained, tiny["head"], feats, torch.tensor(seq), roots),
                                   seq, len(run["prompt"]), roots=roots)
    assert ev.chain.mean < 1.5


# ---------------------------------------------------------------------------------- dfcache parity

def test_compare_blocks_counts_roots_and_values():
    from runner.trust.parity import MethodParity, compare_blocks, within_output

    # HEAD walk of a 10-token completion after a 5-token prompt; the last block is capped.
    online = within_output([(5, 3), (8, 4), (12, 4)], prompt_len=5, completion_len=10)
    assert online == [(5, 3), (8, 4), (12, 2)]
    m = MethodParity("chain")
    compare_blocks(m, "r", online, [(5, 3), (8, 2), (10, 4)], keep=5)
    assert (m.blocks, m.matched, m.mismatch_count) == (3, 1, 2)
    assert m.mismatches == [{"response": "r", "block": 1, "root": 8, "online": 4, "offline": 2},
                            {"response": "r", "block": 2, "root": 12, "online": 2, "offline": None}]


def test_parity_options_are_the_eval_options_checks(tmp_path):
    """Refused before any store or model is touched, with the messages `dfcache run` gives."""
    from dfcache import open_store
    from dfcache.errors import UsageError
    from runner.trust.parity import ParityOptions, run_parity

    store = open_store(tmp_path / "store")
    for bad, says in (({"tree_budgets": [4, 0]}, "--tree-budget 0"), ({"num_prompts": 0}, "--num-prompts 0"),
                      ({"dtype": "fp8"}, "--dtype 'fp8'"), ({"device": "auto"}, "--device 'auto'"),
                      ({"online_loop": "paged"}, "--online-loop 'paged'"),
                      ({"trace": str(tmp_path / "no-such-dir" / "t.jsonl")}, "--trace .*writable directory")):
        with pytest.raises(UsageError, match=says):
            run_parity(store, ParityOptions(target=str(tmp_path / "absent"), drafter=str(tmp_path / "absent"), **bad))
    with pytest.raises(UsageError, match="--target M and --drafter D, or --example"):
        run_parity(store, ParityOptions())
    assert store.keys() == []


def test_parity_no_progress_silences_the_libraries_bars(tmp_path, capsys, monkeypatch):
    """`dfcache parity --no-progress` (the global option) turns transformers' own progress bars
    ("Loading weights") off before any model is loaded, as `run` does; it left them on."""
    import dataclasses

    from transformers.utils import logging as tlog

    from dfcache.cli import main
    from dfcache.cli.common import state

    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    saved = dataclasses.replace(state)
    tlog.enable_progress_bar()
    try:
        rc = main(["--store", str(tmp_path / "store"), "parity", "--target", str(tmp_path / "absent"),
                   "--drafter", str(tmp_path / "absent"), "--no-progress"])
        assert rc == 6  # the target is not there: after the libraries were set up, before any work
        assert not tlog.is_progress_bar_enabled()
    finally:
        tlog.enable_progress_bar()
        for f in dataclasses.fields(state):
            setattr(state, f.name, getattr(saved, f.name))
    capsys.readouterr()


@pytest.fixture(scope="module")
def parity_store(tmp_path_factory):
    from dfcache import open_store

    return tmp_path_factory.mktemp("parity") / "store", open_store


def test_parity_float32_matches_every_block_chain_and_tree(tiny, parity_store):
    from runner.trust.parity import ParityOptions, run_parity

    path, open_store = parity_store
    with single_thread():
        res = run_parity(open_store(path), ParityOptions(
            target=str(tiny["target_dir"]), drafter=str(tiny["drafter_dir"]), prompts="builtin:reasoning",
            num_prompts=2, max_new_tokens=32, tree_budgets=[4], backend="torch", serving_features=True),
            log=lambda m: None)
    d = res.to_dict()
    assert d["ok"] and d["exact_required"] and d["completions_equal"] == 2
    assert [(m["method"], m["blocks"] == m["matched"]) for m in d["methods"]] == [("chain", True), ("tree-4", True)]
    assert d["blocks"] >= 8 and d["mismatches"] == []
    assert res.tau_online == res.tau_offline and res.tau_online["chain"] > 1.5
    # the eval's own drafts (recomputed from the stored states) are the online ones at every root, and the
    # cached loop's features are the stored full-forward ones to float32 rounding
    a = d["alignment"]
    assert a["before"] == {"blocks": d["blocks"], "equal": d["blocks"]} and d["partings"] == []
    assert a["drafts"]["roots"] == a["drafts"]["equal"] == d["blocks"]
    assert a["features"]["rel_l2_max"] < 1e-5
    assert d["interval"]["difference_interval"] == [0.0, 0.0]
    # features from the verify forwards over each accepted block: the same walk in float32
    sf = d["serving_features"]
    assert sf["blocks"] == sf["matched"] == d["blocks"] and sf["interval"]["difference"] == 0.0


def test_parity_cli_json_reuses_the_store(tiny, parity_store, capsys):
    import dataclasses

    from dfcache.cli import main
    from dfcache.cli.common import state

    path, _ = parity_store
    saved = dataclasses.replace(state)
    try:
        # In this process (torch is loaded already); the exit code is main()'s return value.
        with single_thread():
            rc = main(["--store", str(path), "parity", "--target", str(tiny["target_dir"]), "--drafter",
                       str(tiny["drafter_dir"]), "--prompts", "builtin:reasoning", "--num-prompts", "2",
                       "--max-new-tokens", "32", "--tree-budget", "4", "--backend", "torch", "--json"])
    finally:
        for f in dataclasses.fields(state):
            setattr(state, f.name, getattr(saved, f.name))
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    out = json.loads(cap.out)
    assert out["ok"] and out["blocks"] == out["matched"] > 0 and out["agreement"] == 1.0
    assert "0 of 8 stages to produce" in cap.err  # the offline side came from the store


def test_parity_verdict_follows_the_interval():
    """bf16: the paired bootstrap interval of τ online − τ offline over prompts must hold 0."""
    from runner.trust.parity import MethodParity, ParityResult, bootstrap_mean

    def result(*methods):
        return ParityResult(dtype="bfloat16", device="cpu", eval_key="k" * 32, responses=12, completions_equal=9,
                            completion_mismatches=[], methods=list(methods), tau_online={}, tau_offline={})

    equal = MethodParity("chain", pairs=[(f"p{i}", 2.0 + i / 10, 2.0 + i / 10) for i in range(12)])
    iv = equal.interval()
    assert iv["difference_interval"] == [0.0, 0.0] and iv["agrees"] and iv["prompts_differing"] == 0
    # three prompts parted, two one way and one the other: noise, the interval holds 0
    noise = MethodParity("chain", pairs=[(f"p{i}", 3.0 + d, 3.0) for i, d in enumerate([0.8, -1.1, 0.5] + [0.0] * 9)])
    iv = noise.interval()
    assert iv["difference_interval"][0] < 0 < iv["difference_interval"][1] and iv["agrees"]
    assert iv["difference"] == pytest.approx(0.2 / 12) and iv["prompts_differing"] == 3
    assert result(equal, noise).ok
    # every prompt lower offline: a bias, whatever the interval's exact bounds
    biased = MethodParity("tree-4", pairs=[(f"p{i}", 3.0 + 0.3 + (i % 3) / 10, 3.0) for i in range(12)])
    iv = biased.interval()
    assert iv["difference_interval"][0] > 0 and not iv["agrees"]
    assert not result(equal, biased).ok
    # the interval brackets the mean, is the same on every call (fixed seed), and each side has its own
    assert iv["difference_interval"][0] <= iv["difference"] <= iv["difference_interval"][1]
    assert biased.interval() == iv and iv["online_interval"][0] > iv["offline_interval"][1]
    lo, hi = bootstrap_mean([1.0, 2.0, 3.0, 4.0])
    assert 1.0 <= lo < 2.5 < hi <= 4.0


def test_parity_bfloat16_interval_decides_the_exit_code(tiny, tmp_path, capsys):
    """A real bf16 run on the CPU: both τ with their intervals and the paired difference's, and the
    exit code is 6 exactly when that interval leaves out 0."""
    import dataclasses

    from dfcache.cli import main
    from dfcache.cli.common import state

    trace = tmp_path / "trace.jsonl"
    saved = dataclasses.replace(state)
    try:
        with single_thread():
            rc = main(["--store", str(tmp_path / "store"), "parity", "--target", str(tiny["target_dir"]),
                       "--drafter", str(tiny["drafter_dir"]), "--prompts", "builtin:reasoning", "--num-prompts", "3",
                       "--max-new-tokens", "24", "--dtype", "bfloat16", "--backend", "torch", "--tree-budget", "4",
                       "--trace", str(trace), "--serving-features", "--json"])
    finally:
        for f in dataclasses.fields(state):
            setattr(state, f.name, getattr(saved, f.name))
    out = json.loads(capsys.readouterr().out)
    assert not out["exact_required"] and out["online_loop"] == "cache" and out["level"] == 0.95
    for m in out["methods"]:
        iv = m["interval"]
        assert iv["prompts"] == 3 and len(m["responses"]) == 3
        lo, hi = iv["difference_interval"]
        assert lo <= iv["difference"] <= hi and iv["agrees"] == (lo <= 1e-9 and hi >= -1e-9)
        assert iv["online_interval"][0] <= iv["online"] <= iv["online_interval"][1]
    assert out["ok"] == all(m["interval"]["agrees"] for m in out["methods"])  # serving features: not judged
    sf = out["serving_features"]
    assert sf["interval"]["prompts"] == 3 and sf["blocks"] >= sf["matched"] >= 1
    assert rc == (0 if out["ok"] else 6) and (out["ok"] or out["exit_code"] == 6)
    a = out["alignment"]
    assert a["before"]["blocks"] + a["at"]["blocks"] + a["after"]["blocks"] == out["blocks"]
    assert a["drafts"]["roots"] >= 1 and 0 < a["features"]["rel_l2_mean"] < 0.05  # bf16 rounding, not another layer
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == out["blocks"] and {"drafts", "target", "margin", "offline_drafts"} <= set(lines[0])
    assert all(len(b["target"]) == len(b["drafts"]) + 1 for b in lines)


def test_parity_cli_fails_with_exit_6_and_says_why(monkeypatch, tmp_path, capsys):
    """The command's side of the verdict: a bf16 result whose difference interval leaves out 0."""
    import dataclasses

    import runner.trust.parity as parity
    from dfcache.cli import main
    from dfcache.cli.common import state

    biased = parity.MethodParity("chain", blocks=24, matched=20,
                                 pairs=[(f"p{i}", 3.5 + i / 20, 3.0) for i in range(8)])
    res = parity.ParityResult(dtype="bfloat16", device="cpu", eval_key="e" * 32, responses=8, completions_equal=8,
                              completion_mismatches=[], methods=[biased], tau_online={"chain": 3.675},
                              tau_offline={"chain": 3.0})
    monkeypatch.setattr(parity, "run_parity", lambda store, opts: res)
    saved = dataclasses.replace(state)
    try:
        rc_text = main(["--store", str(tmp_path / "s"), "parity", "--target", "t", "--drafter", "d", "--dtype", "bfloat16"])
        text = capsys.readouterr().out
        rc_json = main(["--store", str(tmp_path / "s"), "parity", "--target", "t", "--drafter", "d", "--dtype",
                        "bfloat16", "--json"])
        out = json.loads(capsys.readouterr().out)
    finally:
        for f in dataclasses.fields(state):
            setattr(state, f.name, getattr(saved, f.name))
    assert rc_text == rc_json == 6
    assert "FAIL" in text and "+0.675 [" in text and "--num-prompts" in text
    assert out["exit_code"] == 6 and "interval" in out["error"] and not out["interval"]["agrees"]


def test_parity_example_uses_the_example_models(tiny, tmp_path, capsys):
    """`parity --example` takes the example's target and trained drafter from beside the store."""
    import dataclasses
    import shutil

    from dfcache.cli import main
    from dfcache.cli.common import state
    from runner.models.example import DONE

    from dfcache import open_store

    store = tmp_path / "store"
    where = open_store(store).local_dir("example")
    for name, src in (("target", tiny["target_dir"]), ("drafter-trained", tiny["drafter_dir"]),
                      ("drafter-untrained", tiny["drafter_dir"])):  # the untrained one is not used here
        shutil.copytree(src, where / name)
        (where / name / DONE).write_text("ok\n")
    saved = dataclasses.replace(state)
    try:
        with single_thread():
            rc = main(["--store", str(store), "parity", "--example", "--prompts", "builtin:reasoning",
                       "--num-prompts", "1", "--max-new-tokens", "16", "--backend", "torch", "--json"])
    finally:
        for f in dataclasses.fields(state):
            setattr(state, f.name, getattr(saved, f.name))
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert out["ok"] and out["exact_required"] and out["blocks"] == out["matched"] >= 1
