"""A DSpark checkpoint (a DFlash backbone plus a Markov head, SpecForge's layout) is not mistaken for
a DFlash one: `run eval` refuses it at planning (exit 6, store unchanged); without a Markov head it
drafts as its backbone and is DFlash's."""

from __future__ import annotations

import json
import shutil

from runner.drafters.family import DFlash, family_of

from cli_util import dfcache  # noqa: E402  (tests/ is on sys.path under pytest's rootdir)


def _dspark(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["DSparkDraftModel"]
    cfg["dflash_config"] = {**cfg["dflash_config"], "projector_type": "dspark", **fields}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, cfg


def test_dspark_with_a_markov_head_is_refused_before_any_work(tiny_target, tmp_path):
    from runner.models.train_tiny import make_untrained_drafter

    dflash = make_untrained_drafter(tiny_target, tmp_path / "dflash")
    path, _ = _dspark(dflash, tmp_path / "dspark", markov_rank=8, markov_head_type="rnn")
    store = tmp_path / "store"
    r = dfcache("run", "eval", "--target", tiny_target, "--drafter", path, "--completions", "local",
                "--num-prompts", "1", store=store)
    assert r.code == 6, r.err
    assert "DSpark" in r.err and "DSparkDraftModel" in r.err and "markov_rank 0" in r.err
    assert "Traceback" not in r.err
    assert {f.name for f in store.rglob("*") if f.is_file()} <= {"dfcache-store.json"}


def test_dspark_without_a_markov_head_is_dflash(tiny_target, tmp_path):
    from runner.models.train_tiny import make_untrained_drafter

    dflash = make_untrained_drafter(tiny_target, tmp_path / "dflash")
    path, cfg = _dspark(dflash, tmp_path / "dspark", markov_rank=0, confidence_head_alpha=1.0)
    assert family_of(path, cfg) is DFlash
    cfg["dflash_config"]["markov_rank"] = 4
    assert not DFlash.recognises(cfg)
    assert DFlash.recognises(json.loads((dflash / "config.json").read_text()))


def test_offline_accepted_lengths_equal_online_dspark_on_every_block(tiny_target, tmp_path):
    """A tiny trained DFlash backbone with a DSpark rnn Markov head (SpecForge's layout and tensor
    names): the batched offline scoring equals the greedy online loop block for block, float32."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runner.drafters import dspark
    from runner.drafters.dflash import load_target_head
    from runner.models.train_tiny import (HELDOUT_PROMPT_IDS, capture_features, load_prompts, single_thread,
                                          train_tiny_drafter)
    from runner.trust.parity import online_dspark

    with single_thread():
        backbone = train_tiny_drafter(tiny_target, tmp_path / "dflash", seed=0, steps=120)
        path, cfg = _dspark(backbone, tmp_path / "dspark", markov_rank=8, markov_head_type="rnn")
        ref = dspark.MarkovHead(cfg["vocab_size"], 8, cfg["hidden_size"], "rnn")
        torch.manual_seed(0)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn_like(p) * 0.5)
        tensors = load_file(str(path / "model.safetensors"))
        tensors.update({"markov_head." + k: v.contiguous() for k, v in ref.state_dict().items()})
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

        drafter = dspark.DSparkDrafter.from_pretrained(path)
        assert drafter.markov is not None and drafter.markov.head_type == "rnn"
        model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(tiny_target))
        head = load_target_head(tiny_target)
        prompts = [p for p in load_prompts(tok) if p[0] in HELDOUT_PROMPT_IDS][:3]
        changed, total, accepted = 0, 0, 0
        for _, prompt in prompts:
            completion, blocks = online_dspark(model, drafter, head, prompt, 48, [tok.eos_token_id])
            ids = list(prompt) + completion
            _, feats = capture_features(model, ids, drafter.target_layer_ids)
            roots = [r for r, _ in blocks]
            got = dspark.score_roots(drafter, head, feats, torch.tensor(ids), roots)
            want = [min(v - 1, len(ids) - 1 - r) for r, v in blocks]
            assert got.tolist() == want
            markov, drafter.markov = drafter.markov, None
            plain = dspark.score_roots(drafter, head, feats, torch.tensor(ids), roots)
            drafter.markov = markov
            changed += int((plain != got).sum())
            total += len(blocks)
            accepted += sum(want)
        print(f'blocks {total}, accepted drafts {accepted}, roots the head changed {changed}')
        assert total >= 10 and accepted >= total // 2  # the backbone is trained: drafts are accepted
        assert changed > 0  # the head changes drafts: the test is not DFlash's
