"""DSpark checkpoints as speculators 0.9 writes them (``DSparkDraftModel.save_pretrained``: config
with ``transformer_layer_config``, ``sample_from_anchor`` default true, a draft vocabulary with its
``d2t``/``t2d`` buffers and reduced ``lm_head``), built with speculators' own classes on the CPU
(installed --no-deps): dfcache's batched forward gives their model's teacher-forced logits (their
``_backbone_forward`` plus ``MarkovHead.block_bias`` with their previous-token rule) and drafts."""

from __future__ import annotations

import json

import pytest
import torch

from dfcache.errors import BadInputError
from speculators_util import fill_with_target_heads

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")

pytest.importorskip("speculators")

V, VD, H, B, T = 64, 48, 32, 4, 20


def _build(out, *, anchor: bool | None, draft_vocab: int, head_type="rnn", seed=0):
    """A speculators DSpark model with random weights, saved to ``out``; returns (model, embed, lm_head)."""
    from transformers import Qwen3Config

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tl = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    tl._attn_implementation = "eager"  # flex attention needs a compiler; eager takes their float mask
    extra = {} if anchor is None else {"sample_from_anchor": anchor}  # None: speculators' default
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=draft_vocab, block_size=B, aux_hidden_state_layer_ids=[1, 2],
        mask_token_id=V - 1, markov_rank=8, markov_head_type=head_type, **extra,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(seed)
    model = DSparkDraftModel(cfg)
    embed, lm = fill_with_target_heads(model, V, H, draft_vocab, 0.5)
    model.save_pretrained(str(out))
    return model.eval(), embed, lm


def _theirs(model, feats, tokens):
    """speculators' teacher-forced logits [n, B, V'] over every anchor (sorted), DSparkDraftModel.forward's
    Markov rule; and the anchors."""
    T_ = tokens.shape[0]
    loss_mask = torch.ones(1, T_)
    loss_mask[:, :4] = 0                                   # anchors 4 .. T-B-1
    n = int(loss_mask[0, :-B].sum())
    with torch.no_grad():
        hidden, logits, _, _, idx = model._backbone_forward(
            feats[None], tokens[None], loss_mask, torch.zeros(1, T_, H), torch.zeros(1, T_, dtype=torch.long),
            max_anchors=n)
        block_tokens = tokens[idx].view(n, B)
        if model.config.sample_from_anchor:
            prev = block_tokens
        else:
            prev = torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)
        logits = logits.view(n, B, -1) + model.markov_head.block_bias(
            prev_token_ids=prev, hidden_states=hidden.view(n, B, -1))
    return logits, idx.view(n, B)[:, 0].tolist()


@pytest.mark.parametrize("anchor,draft_vocab,head_type", [(None, V, "rnn"), (False, V, "gated"),
                                                         (None, VD, "rnn"), (False, VD, "vanilla")])
def test_forward_equals_speculators(tmp_path, anchor, draft_vocab, head_type):
    from runner.drafters import dspark
    from runner.drafters.dflash import TargetHead, iter_score_roots

    model, embed, lm = _build(tmp_path / "ckpt", anchor=anchor, draft_vocab=draft_vocab, head_type=head_type)
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["sample_from_anchor"] is (anchor is None)
    g = torch.Generator().manual_seed(1)
    feats, tokens = torch.randn(T, 2 * H, generator=g), torch.randint(0, V - 1, (T,), generator=g)
    want, roots = _theirs(model, feats, tokens)

    ours = dspark.DSparkDrafter.from_pretrained(tmp_path / "ckpt")
    first = 0 if anchor is None else 1
    assert ours.first_draft_slot == first and ours.num_drafts == B - first
    assert ours.target_layer_ids == [0, 1]  # speculators' ids are hidden_states indices: output of layer k-1
    head = TargetHead(embed_tokens=embed, lm_head=lm)
    K = ours.num_drafts
    block = dspark._block_tokens(tokens, roots, K + 1)
    for idx, base in iter_score_roots(ours, head, feats, tokens, roots):
        got = base + ours.markov.block_bias(block[idx, :-1], ours.norm.last)
        torch.testing.assert_close(got, want[idx][:, first:], rtol=1e-4, atol=1e-4)
    drafts = torch.cat([d for _, d in dspark.iter_drafts(ours, head, feats, tokens, roots)])
    d2t = model.d2t if draft_vocab != V else None
    theirs = want[:, first:].argmax(-1)
    assert drafts.tolist() == (theirs if d2t is None else theirs + d2t[theirs]).tolist()


def test_draft_vocabulary_that_does_not_fit_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from runner.drafters.family import DSpark, family_of

    _build(tmp_path / "ckpt", anchor=None, draft_vocab=VD)
    path = tmp_path / "ckpt"
    raw = json.loads((path / "config.json").read_text())
    assert family_of(path, raw) is DSpark
    plan = DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=V)
    assert plan.block_size == B + 1 and plan.key_inputs == {"family": "dspark", "sample_from_anchor": True}
    with pytest.raises(BadInputError, match="the target has 100"):
        DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=100)
    t = load_file(str(path / "model.safetensors"))
    t["d2t"] = t["d2t"] + V  # past the target's vocabulary
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInputError, match="d2t maps draft ids"):
        DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=V)
    del t["d2t"]
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInputError, match="no d2t"):
        DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=V)


# ---- end to end: a speculators-layout DSpark for the tiny target ------------------------------

@pytest.fixture(scope="module")
def spec_dspark(tiny_target, tmp_path_factory):
    """speculators' default DSpark for the tiny target: its backbone trained with the anchor slot
    drafting (slot k drafts the token k+1 after the root), an rnn Markov head (random, large enough
    to change drafts), a draft vocabulary of 3/4 of the target's with d2t/t2d and the reduced
    lm_head; config.json written by speculators' own DSparkSpeculatorConfig."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from runner.drafters import dspark
    from runner.drafters.dflash import load_target_head
    from runner.models.train_tiny import single_thread, train_tiny_drafter

    root = tmp_path_factory.mktemp("spec_dspark")
    with single_thread():
        bb = train_tiny_drafter(tiny_target, root / "backbone", seed=0, steps=120, layer_types=["full_attention"] * 2,
                                sliding_window=None, first_draft_slot=0)
    d = json.loads((bb / "config.json").read_text())
    head = load_target_head(tiny_target)
    vocab = head.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.sort(torch.randperm(vocab, generator=g)[: vocab * 3 // 4]).values
    tl = Qwen3Config(vocab_size=vocab, hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                     num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
                     num_key_value_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
                     rms_norm_eps=d["rms_norm_eps"],
                     rope_parameters={"rope_theta": d["rope_theta"], "rope_type": "default"})
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=len(ids), block_size=d["block_size"],
        aux_hidden_state_layer_ids=[k + 1 for k in d["dflash_config"]["target_layer_ids"]],
        mask_token_id=d["dflash_config"]["mask_token_id"], markov_rank=8, markov_head_type="rnn",
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=d["block_size"])],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3_5ForCausalLM"])))
    path = root / "dspark"
    path.mkdir()
    (path / "config.json").write_text(cfg.to_json_string())
    markov = dspark.MarkovHead(vocab, 8, d["hidden_size"], "rnn", len(ids))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in markov.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = load_file(str(bb / "model.safetensors"))
    tensors.update({"markov_head." + k: v.contiguous() for k, v in markov.state_dict().items()})
    tensors.update({"d2t": ids - torch.arange(len(ids)), "t2d": t2d, "lm_head.weight": head.lm_head[ids].contiguous()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return {"target": tiny_target, "drafter": path, "block_size": d["block_size"]}


def test_speculators_default_dspark_parity_and_run_eval(spec_dspark, tmp_path):
    """A default speculators DSpark (anchor slot drafting, draft vocabulary): `parity`'s greedy online
    loop (B drafts per block, each through d2t) and the eval's batched chain agree on every block in
    float32; `run eval` on the same store reports it with block size B + 1 and the same tau; a d2t
    that does not fit the target is exit 6 before any work."""
    import shutil

    from safetensors.torch import load_file, save_file

    from cli_util import dfcache
    from dfcache import open_store
    from runner.models.train_tiny import single_thread
    from runner.trust.parity import ParityOptions, run_parity

    store = tmp_path / "store"
    with single_thread():
        res = run_parity(open_store(store), ParityOptions(
            target=str(spec_dspark["target"]), drafter=str(spec_dspark["drafter"]), prompts="builtin:reasoning",
            num_prompts=2, max_new_tokens=32, backend="torch"), log=lambda m: None)
    d = res.to_dict()
    assert d["ok"] and d["completions_equal"] == 2 and d["mismatches"] == []
    assert [(m["method"], m["blocks"] == m["matched"]) for m in d["methods"]] == [("chain", True)]
    assert d["blocks"] >= 6 and res.tau_online == res.tau_offline
    assert res.tau_online["chain"] > 1.5  # slot 0's drafts are accepted: the anchor slot is scored
    a = d["alignment"]
    assert a["drafts"]["roots"] == a["drafts"]["equal"] == d["blocks"]

    args = ("run", "eval", "--target", spec_dspark["target"], "--completions", "local", "--prompts",
            "builtin:reasoning", "--num-prompts", "2", "--max-new-tokens", "32", "--dtype", "float32",
            "--backend", "torch")
    r = dfcache(*args, "--drafter", spec_dspark["drafter"], "--json", store=store)
    assert r.code == 0, r.err
    out = json.loads(r.out)
    row = out.get("report", out)["drafters"][0]
    assert row["family"] == "dspark" and row["block_size"] == spec_dspark["block_size"] + 1  # B drafts per block
    assert row["tau_chain"] == pytest.approx(res.tau_offline["chain"])

    bad = tmp_path / "bad"
    shutil.copytree(spec_dspark["drafter"], bad)
    t = load_file(str(bad / "model.safetensors"))
    t["d2t"] = t["d2t"] + 10_000
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    empty = tmp_path / "empty"
    r = dfcache(*args, "--drafter", bad, store=empty)
    assert r.code == 6 and "d2t maps draft ids" in r.err and "Traceback" not in r.err, r.err
    assert {f.name for f in empty.rglob("*") if f.is_file()} <= {"dfcache-store.json"}  # before any work


def test_doctor_reads_a_speculators_dspark(spec_dspark):
    from cli_util import dfcache

    r = dfcache("doctor", "--target", spec_dspark["target"], "--drafter", spec_dspark["drafter"], "--json")
    assert r.code == 0, r.err
    found = {f["check"]: f for f in json.loads(r.out)["checks"]}
    assert found["family"]["found"].startswith("DSpark")
    head = found["dspark head"]
    assert head["severity"] == "info" and "speculators layout" in head["found"]
    assert "sample_from_anchor" in head["found"] and "draft vocabulary" in head["found"]
    assert found["layer ids"]["severity"] != "error"  # the backbone's DFlash checks ran on its fields
