"""`dfcache doctor`: each check fires on the broken checkpoint it is about, and stays quiet on a good one.

Real checkpoints: the tiny Qwen3.5 target and an untrained DFlash drafter for it, copied and
edited the way real mistakes look (ids shifted by one, fc sized for another target, a MASK id
past the vocabulary, a Gemma-style target). Completions are a real artifact in a real store.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from cli_util import dfcache
from dfcache import compute_key, open_store
from dfcache.errors import EXIT_BAD_INPUT
from runner.trust.doctor import default_layer_ids, run_doctor
from runner.models.resolve import chat_template_hash


@pytest.fixture(scope="module")
def drafter(tiny_target, tmp_path_factory):
    from runner.models.train_tiny import make_untrained_drafter

    return make_untrained_drafter(tiny_target, tmp_path_factory.mktemp("doctor") / "drafter", seed=1)


def edited(src, dst, **changes):
    """A copy of a checkpoint with config.json fields changed (dflash_config.X via 'dflash_X')."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if k.startswith("dflash_"):
            cfg["dflash_config"][k[len("dflash_"):]] = v
        elif v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def by_check(rep, check):
    return [f for f in rep.findings if f.check == check]


def test_good_pair_is_clean_and_imports_no_torch(tiny_target, drafter):
    code = ("import sys, json; from dfcache.cli import main; "
            f"rc = main(['doctor', '--target', {str(tiny_target)!r}, '--drafter', {str(drafter)!r}, '--json']); "
            "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'tf': 'transformers' in sys.modules}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    report, meta = (json.loads(line) for line in p.stdout.strip().splitlines()[-2:])
    assert meta == {"rc": 0, "torch": False, "tf": False}, p.stderr
    assert report["ok"] and report["errors"] == 0
    sev = {c["check"]: c["severity"] for c in report["checks"]}
    assert sev["fc width"] == sev["mask_token_id"] == sev["hidden size"] == "info"
    # The tiny drafter taps layer 5 of 6: the pre/post-norm trap is worth a warning, not an error.
    assert sev["last layer pre/post-norm"] == "warning"


def test_id_equal_to_depth_is_reported_as_shifted(tiny_target, drafter, tmp_path):
    bad = edited(drafter, tmp_path / "d", dflash_target_layer_ids=[2, 4, 6])
    rep = run_doctor(str(tiny_target), str(bad))
    (f,) = [f for f in by_check(rep, "layer ids") if f.severity == "error"]
    assert "equals the target's depth" in f.found and "[1, 3, 5]" in f.fix
    r = dfcache("doctor", "--target", tiny_target, "--drafter", bad)
    assert r.code == EXIT_BAD_INPUT and "ERROR layer ids" in r.out and "Traceback" not in r.err
    r = dfcache("doctor", "--target", tiny_target, "--drafter", bad, "--json")
    out = json.loads(r.out)
    assert r.code == EXIT_BAD_INPUT and out["exit_code"] == EXIT_BAD_INPUT and not out["ok"] and out["error"]


def test_formula_shifted_ids_warn(tiny_target, drafter, tmp_path):
    formula = default_layer_ids(6, 3)
    assert formula == [1, 2, 3]
    # fc stays 3 x 128 wide, so only the shift is reported.
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "d", dflash_target_layer_ids=[2, 3, 4])))
    assert any("shifted by +1" in f.found for f in by_check(rep, "layer ids") if f.severity == "warning")
    assert rep.ok


def test_fc_width_and_hidden_size_mismatches_are_errors(tiny_target, drafter, tmp_path):
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "a", dflash_target_layer_ids=[1, 3])))
    (f,) = by_check(rep, "fc width")
    assert f.severity == "error" and "expect 3 layers, the config lists 2" in f.found
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "b", hidden_size=64)))
    assert [f.severity for f in by_check(rep, "hidden size")] == ["error"]
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "c", num_target_layers=8)))
    assert [f.severity for f in by_check(rep, "target depth")] == ["error"]


def test_mask_vocab_rope_and_window_errors(tiny_target, drafter, tmp_path):
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "a", dflash_mask_token_id=512)))
    assert [f.severity for f in by_check(rep, "mask_token_id")] == ["error"]
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "b", dflash_mask_token_id=100)))
    # The tokenizer names its own mask token (id 3): another id is worth a warning.
    assert any(f.severity == "warning" and "is id 3" in f.found for f in by_check(rep, "mask_token_id"))
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "c", vocab_size=1024)))
    assert any(f.severity == "error" for f in by_check(rep, "vocab"))
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "d", partial_rotary_factor=0.25)))
    assert any("partial_rotary_factor" in f.found for f in by_check(rep, "rope") if f.severity == "error")
    rep = run_doctor(str(tiny_target), str(edited(drafter, tmp_path / "e", sliding_window=None)))
    assert [f.severity for f in by_check(rep, "sliding window")] == ["error"]


def test_gemma_style_target_warns_about_unscaled_block_embedding(tiny_target, drafter, tmp_path):
    gemma = edited(tiny_target, tmp_path / "gemma", model_type="gemma3_text")
    rep = run_doctor(str(gemma), str(drafter))
    (f,) = by_check(rep, "embedding scale")
    assert f.severity == "warning" and "sqrt(hidden)" in f.found and "11.3137" in f.fix
    fixed = edited(drafter, tmp_path / "d", dflash_input_embedding_scale=128 ** 0.5)
    (f,) = by_check(run_doctor(str(gemma), str(fixed)), "embedding scale")
    assert f.severity == "info"


def _completions(store, template_hash, thinking, texts):
    inputs = {"target": "b" * 32, "endpoint": "openai", "chat_template": template_hash,
              "enable_thinking": thinking, "served_model": None}
    key = compute_key("completions", 1, inputs, {"prompts": "a" * 32})
    with store.writer(key, stage="completions", stage_version=1, inputs=inputs, upstream={"prompts": "a" * 32}) as w:
        w.put_json("index", {"n": len(texts), "endpoint": "openai", "served_model": None, "samples": []})
        for i, t in enumerate(texts):
            w.put_json(f"c{i}", {"index": i, "id": f"s{i}", "text": t, "finish_reason": "stop", "token_ids": None})
    return key


def test_completions_from_checks_template_and_thinking(tiny_target, drafter, tmp_path):
    store = open_store(tmp_path / "store")
    good = _completions(store, chat_template_hash(tiny_target), False, ["x = 1", "y = 2"])
    other = _completions(store, "0" * 32, False, ["<think>let me see</think> x = 1", "y"])
    rep = run_doctor(str(tiny_target), str(drafter), store=store, completions_from=good[:10])
    assert rep.ok and [f.severity for f in by_check(rep, "chat template / thinking")] == ["info"]
    rep = run_doctor(str(tiny_target), str(drafter), store=store, completions_from=other)
    sev = sorted(f.severity for f in by_check(rep, "chat template / thinking"))
    assert sev == ["error", "warning"]
    r = dfcache("doctor", "--target", tiny_target, "--drafter", drafter, "--completions-from", other[:12],
                store=tmp_path / "store")
    assert r.code == EXIT_BAD_INPUT and "another chat template" in r.out
