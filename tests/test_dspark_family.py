"""DSpark as a drafter family (SpecForge's layout: a DFlash backbone plus a Markov head): recognised
from its config (one without a Markov head drafts as its backbone and is DFlash's), evaluated by
`run eval` side by side with DFlash (family column ``dspark``), its offline chain equal to SpecForge's
greedy ``spec_generate`` loop (``runner.trust.parity.online_dspark``) block for block in float32
through ``run_parity``, and checked by ``doctor``; what it cannot score is exit 6 before any work."""

from __future__ import annotations

import json
import shutil

import pytest

from runner.drafters.family import DFlash, DSpark, family_of
from runner.models.train_tiny import single_thread

from cli_util import dfcache  # noqa: E402  (tests/ is on sys.path under pytest's rootdir)

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")


def _dspark(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["DSparkDraftModel"]
    cfg["dflash_config"] = {**cfg["dflash_config"], "projector_type": "dspark", **fields}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, cfg


@pytest.fixture(scope="module")
def spark(tiny_target, tmp_path_factory):
    """A tiny trained DFlash backbone and the same backbone with a DSpark rnn Markov head (SpecForge's
    tensor names), its weights random but large enough to change drafts."""
    import torch
    from safetensors.torch import load_file, save_file

    from runner.drafters import dspark
    from runner.models.train_tiny import train_tiny_drafter

    root = tmp_path_factory.mktemp("dspark")
    with single_thread():
        backbone = train_tiny_drafter(tiny_target, root / "dflash", seed=0, steps=120)
    path, cfg = _dspark(backbone, root / "dspark", markov_rank=8, markov_head_type="rnn")
    ref = dspark.MarkovHead(cfg["vocab_size"], 8, cfg["hidden_size"], "rnn")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({"markov_head." + k: v.contiguous() for k, v in ref.state_dict().items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return {"target": tiny_target, "backbone": backbone, "drafter": path, "config": cfg}


def test_what_dspark_cannot_score_is_refused_before_any_work(spark, tmp_path):
    path, _ = _dspark(spark["backbone"], tmp_path / "anchor", markov_rank=8, sample_from_anchor=True)
    store = tmp_path / "store"
    r = dfcache("run", "eval", "--target", spark["target"], "--drafter", path, "--completions", "local",
                "--num-prompts", "1", store=store)
    assert r.code == 6, r.err
    assert "DSpark" in r.err and "sample_from_anchor" in r.err and "Traceback" not in r.err
    assert {f.name for f in store.rglob("*") if f.is_file()} <= {"dfcache-store.json"}


def test_dspark_family_is_recognised_and_without_a_markov_head_is_dflash(spark, tmp_path):
    path, cfg = _dspark(spark["backbone"], tmp_path / "plain", markov_rank=0, confidence_head_alpha=1.0)
    assert family_of(path, cfg) is DFlash
    cfg["dflash_config"]["markov_rank"] = 4
    assert not DFlash.recognises(cfg) and family_of(path, cfg) is DSpark
    assert family_of(spark["drafter"], spark["config"]) is DSpark
    assert DFlash.recognises(json.loads((spark["backbone"] / "config.json").read_text()))


def test_offline_accepted_lengths_equal_online_dspark_on_every_block(spark):
    """The batched offline scoring equals the greedy online loop block for block, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runner.drafters import dspark
    from runner.drafters.dflash import load_target_head
    from runner.models.train_tiny import HELDOUT_PROMPT_IDS, capture_features, load_prompts
    from runner.trust.parity import online_dspark

    tiny_target, path = spark["target"], spark["drafter"]
    with single_thread():
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


def test_parity_float32_equal_on_every_block(spark, tmp_path):
    """`parity` dispatches to DSpark's online loop; the eval's chain equals it on every block, and the
    eval's (teacher-forced) drafts equal the online ones up to the first rejected draft."""
    from dfcache import open_store
    from runner.trust.parity import ParityOptions, run_parity

    with single_thread():
        res = run_parity(open_store(tmp_path / "store"), ParityOptions(
            target=str(spark["target"]), drafter=str(spark["drafter"]), prompts="builtin:reasoning",
            num_prompts=2, max_new_tokens=32, backend="torch", tree_budgets=[4]), log=lambda m: None)
    d = res.to_dict()
    assert d["ok"] and d["completions_equal"] == 2 and d["mismatches"] == []
    assert [(m["method"], m["blocks"] == m["matched"]) for m in d["methods"]] == [("chain", True)]  # no DDTree
    assert d["blocks"] >= 8 and res.tau_online == res.tau_offline and res.tau_online["chain"] > 1.2
    a = d["alignment"]
    assert a["drafts"]["roots"] == a["drafts"]["equal"] == d["blocks"]


def test_run_eval_side_by_side_with_dflash(spark, tmp_path):
    store = tmp_path / "store"
    args = ("run", "eval", "--target", spark["target"], "--drafter", spark["backbone"], "--drafter",
            spark["drafter"], "--completions", "local", "--num-prompts", "2", "--max-new-tokens", "24",
            "--dtype", "float32", "--backend", "torch", "--tree-budget", "4")
    r = dfcache(*args, "--json", store=store)
    assert r.code == 0, r.err
    assert "DSpark" in r.err and "--tree-budget 4" in r.err  # the skipped DDTree budget is said
    out = json.loads(r.out)
    rows = {d["family"]: d for d in out.get("report", out)["drafters"]}
    assert set(rows) == {"dflash", "dspark"}
    assert rows["dflash"]["tau_tree"].keys() == {"4"} and not rows["dspark"]["tau_tree"]
    assert rows["dspark"]["block_size"] == rows["dflash"]["block_size"]
    # the head changes the drafts: the two families' chains differ on the same states
    assert rows["dspark"]["tau_chain"] != rows["dflash"]["tau_chain"]
    md = dfcache(*args, store=store)
    assert md.code == 0, md.err
    assert "| dspark |" in md.out and "| dflash |" in md.out
    assert "0 node(s) did work" in md.out + md.err


def test_doctor_runs_the_dspark_checks(spark, tmp_path):
    from safetensors.torch import load_file, save_file

    r = dfcache("doctor", "--target", spark["target"], "--drafter", spark["drafter"], "--json")
    assert r.code == 0, r.err
    found = {f["check"]: f for f in json.loads(r.out)["checks"]}
    assert found["family"]["found"].startswith("DSpark")
    assert found["dspark head"]["severity"] == "info" and "rnn" in found["dspark head"]["found"]
    assert found["layer ids"]["severity"] != "error"  # the backbone's DFlash checks ran too
    bad = tmp_path / "bad"
    shutil.copytree(spark["drafter"], bad)
    t = load_file(str(bad / "model.safetensors"))
    del t["markov_head.joint_proj.weight"]
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r = dfcache("doctor", "--target", spark["target"], "--drafter", bad, "--json")
    assert r.code == 6
    head = next(f for f in json.loads(r.out)["checks"] if f["check"] == "dspark head")
    assert head["severity"] == "error" and "joint_proj" in head["found"]
