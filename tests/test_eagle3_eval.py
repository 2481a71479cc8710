"""EAGLE-3 end to end on a tiny real target: a drafter trained in seconds (SpecForge's layout),
`dfcache run eval` recognising its family, and `dfcache parity`: the offline chain equals real
greedy EAGLE-3 decoding (``runner.drafters.eagle3.online_eagle3``, the target run on its KV cache
as a serving engine does) block for block in float32."""

from __future__ import annotations

import json

import pytest

from runner.models.train_tiny import single_thread

from cli_util import dfcache  # noqa: E402  (tests/ is on sys.path under pytest's rootdir)

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")


@pytest.fixture(scope="module")
def eagle(tiny_target, tmp_path_factory):
    from runner.drafters.train_eagle3 import train_tiny_eagle3

    root = tmp_path_factory.mktemp("eagle3")
    stats: list = []
    with single_thread():
        path = train_tiny_eagle3(tiny_target, root / "eagle3", steps=120, stats=stats)
    return {"target": tiny_target, "drafter": path, "root": root, "stats": stats[0]}


def test_tiny_eagle3_trains_and_uses_a_reduced_draft_vocabulary(eagle):
    from safetensors.numpy import load_file

    losses = eagle["stats"]["losses"]
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    t = load_file(str(eagle["drafter"] / "model.safetensors"))
    assert t["d2t"].shape == (256,) and t["t2d"].sum() == 256 and "midlayer.self_attn.q_proj.weight" in t
    cfg = json.loads((eagle["drafter"] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 256


def test_parity_float32_equal_on_every_block(eagle, tmp_path):
    from dfcache import open_store
    from runner.trust.parity import ParityOptions, run_parity

    with single_thread():
        res = run_parity(open_store(tmp_path / "store"), ParityOptions(
            target=str(eagle["target"]), drafter=str(eagle["drafter"]), prompts="builtin:reasoning",
            num_prompts=2, max_new_tokens=32, backend="torch", eagle_trees=["1,4,5", "3,4,10"]), log=lambda m: None)
    d = res.to_dict()
    assert d["ok"] and d["completions_equal"] == 2 and d["mismatches"] == []
    assert [(m["method"], m["blocks"] == m["matched"]) for m in d["methods"]] == [
        ("chain", True), ("eagle-1x4x5", True), ("eagle-3x4x10", True)]
    # a tree of top-1 is the chain of its depth; a wider tree accepts at least as much here
    assert res.tau_online["eagle-3x4x10"] >= res.tau_online["eagle-1x4x5"] > 1.2
    assert d["blocks"] >= 8 and res.tau_online == res.tau_offline
    assert res.tau_online["chain"] > 1.2  # the trained drafter is accepted
    a = d["alignment"]
    assert a["drafts"]["roots"] == a["drafts"]["equal"] == d["blocks"]


def test_run_eval_side_by_side_with_a_family_column(eagle, tmp_path):
    from runner.models.train_tiny import make_untrained_drafter

    dflash = make_untrained_drafter(eagle["target"], tmp_path / "dflash")  # layers 1, 3, 5 like the EAGLE-3 one
    store = tmp_path / "store"
    args = ("run", "eval", "--target", eagle["target"], "--drafter", dflash, "--drafter", eagle["drafter"],
            "--completions", "local", "--num-prompts", "1", "--max-new-tokens", "12", "--dtype", "float32",
            "--backend", "torch", "--eagle-steps", "3", "--eagle-tree", "2,3,6", "--tree-budget", "4")
    r = dfcache(*args, "--json", store=store)
    assert r.code == 0, r.err
    out = json.loads(r.out)
    rep = out.get("report", out)
    rows = {d["family"]: d for d in rep["drafters"]}
    assert set(rows) == {"dflash", "eagle3"}
    assert set(rows["eagle3"]["tau_eagle_tree"]) == {"eagle-2x3x6"} and rows["eagle3"]["block_size"] == 4
    assert rows["dflash"]["tau_tree"].keys() == {"4"} and "tau_eagle_tree" not in rows["dflash"]
    # one set of hidden states serves both families; the table has the family column
    md = dfcache(*args, store=store)
    assert md.code == 0, md.err
    head = next(line for line in md.out.splitlines() if line.startswith("| drafter"))
    assert "| family |" in head and "τ eagle-2x3x6" in head and "τ tree-4" in head
    assert "| eagle3 |" in md.out and "| dflash |" in md.out
    assert "0 node(s) did work" in md.out + md.err


def test_unknown_family_and_foreign_vocab_are_exit_6_before_any_work(eagle, tmp_path):
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(eagle["drafter"], odd)
    (odd / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"], "model_type": "medusa"}))
    store = tmp_path / "store"
    r = dfcache("run", "eval", "--target", eagle["target"], "--drafter", odd, "--completions", "local",
                "--num-prompts", "1", store=store)
    assert r.code == 6, r.err
    assert "MedusaModel" in r.err and "dflash" in r.err and "eagle3" in r.err
    # refused at planning: no artifact (the store holds at most its own marker file)
    assert {f.name for f in store.rglob("*") if f.is_file()} <= {"dfcache-store.json"}

    foreign = tmp_path / "foreign"
    shutil.copytree(eagle["drafter"], foreign)
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (foreign / "config.json").write_text(json.dumps(cfg))
    r = dfcache("run", "eval", "--target", eagle["target"], "--drafter", foreign, "--completions", "local",
                "--num-prompts", "1", store=store)
    assert r.code == 6, r.err
    assert "vocab" in r.err and "Traceback" not in r.err


def test_doctor_runs_the_eagle3_checks(eagle, tmp_path):
    import shutil

    r = dfcache("doctor", "--target", eagle["target"], "--drafter", eagle["drafter"], "--json")
    assert r.code == 0, r.err
    found = {f["check"]: f for f in json.loads(r.out)["checks"]}
    assert found["family"]["found"].startswith("EAGLE-3")
    assert found["d2t map"]["severity"] == "info" and found["fc width"]["severity"] == "info"
    bad = tmp_path / "bad"
    shutil.copytree(eagle["drafter"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}
    cfg["vocab_size"] = 1000
    (bad / "config.json").write_text(json.dumps(cfg))
    r = dfcache("doctor", "--target", eagle["target"], "--drafter", bad, "--json")
    errors = {f["check"] for f in json.loads(r.out)["checks"] if f["severity"] == "error"}
    assert {"layer ids", "vocabulary"} <= errors
