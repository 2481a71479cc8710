"""Drafter checkpoints in the layouts published ones have (config fields, tensor names, dtypes as
their writers save them; sizes shrunk), each recognised, planned against a target and loaded, and
where the peer's model code runs on the CPU (speculators, installed --no-deps) its logits equal
dfcache's. The layouts and where they were read are tabled in docs/cli.md ("Published layouts").

* speculators EAGLE-3 (RedHatAI/gpt-oss-20b-speculator.eagle3): Llama layer, ``norm_before_fc``
  (``input_norm.weight`` over the three layers' concat), ``norm_before_residual``, reduced vocabulary.
* speculators EAGLE-3 in its default Qwen3 layer (``q_norm``/``k_norm``), ``fc_norm`` and EAGLE 3.1's
  ``norm_output`` (the next step reads norm(h)), attention biases, no ``embed_tokens`` (the target's).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dfcache.errors import BadInputError
from speculators_util import fill_speculators_model, fill_with_target_heads

H, V, DV, T, STEPS = 32, 80, 48, 16, 3


def _speculators_eagle3(out, *, layer: str, draft_vocab: int, drop_embedding=False, seed=0, rope=None, **flags):
    """speculators' own Eagle3DraftModel with random weights, saved by its save_pretrained; ``rope``:
    the verifier's RoPE it copies into transformer_layer_config (speculators train/cli.py)."""
    pytest.importorskip("speculators")
    from transformers import LlamaConfig, Qwen3Config

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    cls = LlamaConfig if layer == "llama" else Qwen3Config
    extra = {"attention_bias": True} if flags.pop("attention_bias", False) else {}
    if rope is not None:
        extra["rope_parameters"] = rope
    tl = cls(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=256, **extra)
    tl._attn_implementation = "eager"  # flex attention needs a compiler; eager takes their float mask
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])),
        **flags)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    fill_speculators_model(model, V, draft_vocab, 0.3)
    model.save_pretrained(str(out))
    embed = model.embed_tokens.weight.detach().clone()
    if drop_embedding:  # converted checkpoints without the drafter's embedding: vLLM shares the target's
        from safetensors.torch import load_file, save_file

        t = load_file(str(out / "model.safetensors"))
        del t["embed_tokens.weight"]
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model.eval(), embed


def _their_logits(model, feats, ids):
    """Their forward (TTT steps teacher-forced on ``ids``): the lm_head's output of every step."""
    got = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: got.append(o[0].detach()))
    try:
        with torch.no_grad():
            model(hidden_states=feats[None], input_ids=ids[None], document_ids=torch.zeros(1, ids.shape[0],
                  dtype=torch.long), ttt_steps=STEPS)
    finally:
        hook.remove()
    return torch.stack(got, 1)  # [n, STEPS, draft vocab]


def _our_logits(d, head, feats, ids):
    """The same teacher-forced steps with the primitives score_roots composes (context_kv, qkv,
    _attend, finish, logits): step s at position j reads token ids[j+s] and step s-1's state."""
    from runner.drafters.eagle3 import _attend, _expand_kv

    c = d.config
    n = feats.shape[0]
    groups, scale = c.num_attention_heads // c.num_key_value_heads, 1.0 / math.sqrt(c.head_dim)
    q0, k0, v0, r0 = d.context_kv(head, feats, ids)
    K0, V0 = _expand_kv(k0, groups), _expand_kv(v0, groups)
    rows = torch.arange(n)
    h = d.finish(_attend(q0, K0, V0, rows + 1, [], [], scale), r0)
    out, ks, vs = [d.logits(h)], [], []
    for s in range(1, STEPS):
        tok = torch.cat([ids[s:], ids.new_zeros(s)])
        q, k, v, res = d.qkv(d.embed(head, tok), h, rows + s)
        ks.append(_expand_kv(k, groups)), vs.append(_expand_kv(v, groups))
        h = d.finish(_attend(q, K0, V0, rows + 1, ks, vs, scale), res)
        out.append(d.logits(h))
    return torch.stack(out, 1)


# The verifiers' RoPE scalings speculators copies (Llama-3.1: llama3; gpt-oss: yarn, truncate false),
# their lengths shrunk so that the scaled frequencies turn within a 16-token test sequence.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


@pytest.mark.parametrize("layer,draft_vocab,drop_embedding,flags", [
    ("llama", DV, False, {"norm_before_fc": True, "norm_before_residual": True, "rope": LLAMA3_ROPE}),
    ("qwen3", V, True, {"fc_norm": True, "norm_output": True, "attention_bias": True, "rope": YARN_ROPE}),
], ids=["llama-llama3_rope-norm_before_fc-draft_vocab", "qwen3-yarn-fc_norm-norm_output-bias-no_embed"])
def test_speculators_eagle3_layouts_equal_their_model(tmp_path, layer, draft_vocab, drop_embedding, flags):
    from runner.drafters.dflash import TargetHead
    from runner.drafters.eagle3 import Eagle3Drafter, score_roots
    from runner.drafters.family import Eagle3, family_of
    from runner.models.train_tiny import single_thread

    path = tmp_path / "d"
    with single_thread():
        model, embed = _speculators_eagle3(path, layer=layer, draft_vocab=draft_vocab, drop_embedding=drop_embedding,
                                           **dict(flags))
        raw = json.loads((path / "config.json").read_text())
        assert family_of(path, raw) is Eagle3
        plan = Eagle3.plan(path, raw, num_target_layers=6, target_hidden=H, target_vocab=V, steps=None)
        assert plan.layers == [0, 1, 2] and plan.block_size == STEPS + 1  # HF indices 1..3: outputs of 0..2
        with pytest.raises(BadInputError, match="the target has 90"):
            Eagle3.plan(path, raw, num_target_layers=6, target_hidden=H, target_vocab=90, steps=None)
        ours = Eagle3Drafter.from_pretrained(path)
        assert (ours.embed_tokens is None) == drop_embedding
        c = ours.config
        assert (c.norm_before_fc, c.fc_norm, c.feed_normed, c.qk_norm, c.attention_bias) == (
            bool(flags.get("norm_before_fc")), bool(flags.get("fc_norm")), bool(flags.get("norm_output")),
            layer == "qwen3", bool(flags.get("attention_bias")))
        assert c.rope_scaling["rope_type"] == flags["rope"]["rope_type"]
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(T, 3 * H, generator=g)
        seq = torch.randint(0, V, (T + 1,), generator=g)
        head = TargetHead(embed, torch.randn(V, H, generator=g))
        want = _their_logits(model, feats, seq[1:])
        got = _our_logits(ours, head, feats, seq[1:])
        tokens, chain = score_roots(ours, head, feats, seq, list(range(1, T + 1)), depth=STEPS)
    n = T - STEPS + 1  # positions whose teacher-forced tokens are all real (no padding)
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chain[:, 0], want[:, 0], rtol=1e-4, atol=1e-4)  # the chain's first step
    d2t = model.d2t if model.d2t is not None else torch.zeros(draft_vocab, dtype=torch.long)
    first = want[:, 0].argmax(-1)
    assert tokens[:, 0].tolist() == (first + d2t[first]).tolist()  # drafts in the target's vocabulary


# ---- SpecForge / SGLang / the EAGLE repo (LlamaForCausalLMEagle3) -------------------------------

def _specforge_eagle3(path, raw_extra: dict, *, th=H, dtype=torch.float16, embed=True, bin_file=False):
    """SpecForge's own LlamaForCausalLMEagle3, random, saved with a config.json of a published
    shape (``raw_extra`` on top of the Llama fields) in ``dtype``: safetensors as SpecForge and
    lmsys/sglang-EAGLE3-* hold it, or pytorch_model.bin without the embedding as the EAGLE repo
    (yuhuili/EAGLE3-*) does. Returns the model holding the saved (rounded) weights in float32."""
    pytest.importorskip("specforge")
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    fields = {k: v for k, v in raw_extra.items() if k not in ("eagle_config", "architectures")}
    cfg = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                      vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=256, hidden_act="silu",
                      num_hidden_layers=1, tie_word_embeddings=False, **fields)
    cfg.draft_vocab_size = DV
    if th != H:
        cfg.target_hidden_size = th
    torch.manual_seed(0)
    m = LlamaForCausalLMEagle3(cfg).float().eval()
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.copy_((torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
                    .to(dtype).float())
        ids = torch.sort(torch.randperm(V)[:DV]).values
        m.d2t.copy_(ids - torch.arange(DV))
        m.t2d.zero_()
        m.t2d[ids] = True
    path.mkdir()
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1,
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": V, "draft_vocab_size": DV,
           "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": str(dtype).split(".")[1],
           **({"target_hidden_size": th} if th != H else {}), **raw_extra}
    (path / "config.json").write_text(json.dumps(raw))
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in m.state_dict().items()}
    if not embed:
        del state["embed_tokens.weight"]
    if bin_file:
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return m


@pytest.mark.parametrize("layout", ["eagle-repo-bin", "specforge-gpt-oss", "specforge-qwen3"])
def test_specforge_layouts_equal_specforge_logits(tmp_path, layout):
    """Three published SpecForge-family shapes: the EAGLE repo's (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B,
    = SpecForge configs/llama3-8B-eagle3.json: no rope_theta, no layer ids, float16
    pytorch_model.bin without embed_tokens); SpecForge's configs/gpt-oss-20B-eagle3.json (eagle_config
    ids, head_dim != hidden/heads, bf16 safetensors with the embedding); configs/qwen3-8b-eagle3.json
    (rope_theta, rope_scaling null, sliding_window set but use_sliding_window false) with a target
    wider than the drafter (target_hidden_size)."""
    from types import SimpleNamespace

    from test_eagle3_reference import _their_logits

    from runner.drafters.dflash import TargetHead
    from runner.drafters.eagle3 import Eagle3Drafter, score_roots
    from runner.models.train_tiny import single_thread
    from runner.stages.drafter_eval import read_drafter

    th, embed, bin_file, dtype = H, True, False, torch.bfloat16
    if layout == "eagle-repo-bin":
        extra, embed, bin_file, dtype = {"bos_token_id": 1, "pad_token_id": 0, "use_cache": True}, False, True, torch.float16
    elif layout == "specforge-gpt-oss":
        extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}, "head_dim": 16, "pad_token_id": 0}
    else:
        extra = {"attention_bias": False, "rope_theta": 1000000, "rope_scaling": None, "sliding_window": 512,
                 "use_sliding_window": False, "max_window_layers": 36, "target_model_type": "qwen3"}
        th = 48
    path = tmp_path / "d"
    with single_thread():
        m = _specforge_eagle3(path, extra, th=th, dtype=dtype, embed=embed, bin_file=bin_file)
        info = SimpleNamespace(num_layers=8, hidden_size=th, vocab_size=V)
        ref = read_drafter(str(path), target_info=lambda: info, eagle_steps=3)
        want_ids = [1, 3, 5] if layout == "specforge-gpt-oss" else [1, 3, 4]  # else SGLang's default for 8 layers
        assert ref.family == "eagle3" and ref.target_layer_ids == want_ids and ref.block_size == 4
        with pytest.raises(BadInputError, match=f"3 x {th} features but the target is 64 wide"):
            read_drafter(str(path), target_info=lambda: SimpleNamespace(num_layers=8, hidden_size=64, vocab_size=V))
        ours = Eagle3Drafter.from_pretrained(path)
        assert (ours.embed_tokens is not None) == embed
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(T, 3 * th, generator=g)
        seq = torch.randint(0, V, (T + 1,), generator=g)
        head = TargetHead(m.embed_tokens.weight.detach(), torch.randn(V, H, generator=g))  # the target's embedding
        theirs = _their_logits(m, feats, seq[1:T + 1])
        _, logits = score_roots(ours, head, feats, seq, list(range(1, T + 1)), depth=STEPS)
    torch.testing.assert_close(logits, theirs, rtol=1e-4, atol=1e-4)


# ---- speculators DFlash (RedHatAI/*-speculator.dflash) ---------------------------------------------

@pytest.mark.parametrize("draft_vocab", [48, 64], ids=["draft_vocab", "full_vocab"])
def test_speculators_dflash_drafts_as_speculators(tmp_path, draft_vocab):
    """speculators' DFlash layout (``speculators_model_type: dflash``, the Qwen3 backbone under
    ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` as HF indices, by default a draft
    vocabulary with ``d2t``/``t2d`` and a reduced ``lm_head``, ``sample_from_anchor`` false, no
    ``embed_tokens`` saved): recognised, planned as a DFlash chain of B-1 drafts (the report says
    ``dflash``), and its drafts equal speculators' own model's."""
    pytest.importorskip("speculators")
    from test_dspark_speculators import B, H as SH, T as ST, V as SV
    from transformers import Qwen3Config

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from runner.drafters import dspark
    from runner.drafters.dflash import TargetHead
    from runner.drafters.family import DSpark, family_of
    from runner.models.train_tiny import single_thread

    tl = Qwen3Config(vocab_size=SV, hidden_size=SH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    tl._attn_implementation = "eager"
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=draft_vocab, block_size=B, aux_hidden_state_layer_ids=[1, 2],
        mask_token_id=SV - 1, speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    with single_thread():
        torch.manual_seed(0)
        model = DFlashDraftModel(cfg)
        embed, lm = fill_with_target_heads(model, SV, SH, draft_vocab, 0.5)
        path = tmp_path / "ckpt"
        model.save_pretrained(str(path))
        raw = json.loads((path / "config.json").read_text())
        assert raw["speculators_model_type"] == "dflash" and raw["sample_from_anchor"] is False
        assert family_of(path, raw) is DSpark
        plan = DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=SV)
        assert plan.label == "dflash" and plan.block_size == B and not plan.final_state
        from types import SimpleNamespace

        from runner.stages.drafter_eval import read_drafter

        ref = read_drafter(str(path), target_info=lambda: SimpleNamespace(num_layers=4, hidden_size=SH, vocab_size=SV))
        assert (ref.family, ref.block_size, ref.target_layer_ids, ref.mask_token_id) == ("dspark", B, [0, 1], SV - 1)
        ours = dspark.DSparkDrafter.from_pretrained(path)
        assert ours.markov is None and ours.first_draft_slot == 1 and ours.target_layer_ids == [0, 1]
        g = torch.Generator().manual_seed(1)
        feats, tokens = torch.randn(ST, 2 * SH, generator=g), torch.randint(0, SV - 1, (ST,), generator=g)
        loss_mask = torch.ones(1, ST)
        loss_mask[:, :4] = 0  # anchors 4 .. T-B-1, as tests/test_dspark_speculators.py reads them
        n = int(loss_mask[0, :-B].sum())
        with torch.no_grad():
            _, logits, _, _, idx = model.eval()._backbone_forward(
                feats[None], tokens[None], loss_mask, torch.zeros(1, ST, SH), torch.zeros(1, ST, dtype=torch.long),
                max_anchors=n)
        want, roots = logits.view(n, B, -1), idx.view(n, B)[:, 0].tolist()
        head = TargetHead(embed_tokens=embed, lm_head=lm)
        drafts = torch.cat([d for _, d in dspark.iter_drafts(ours, head, feats, tokens, roots)])
    theirs = want[:, 1:].argmax(-1)  # slots 1..B-1 draft (sample_from_anchor false)
    if draft_vocab != SV:
        theirs = theirs + model.d2t[theirs]
    assert drafts.tolist() == theirs.tolist()


# ---- bad input: what no family claims, and what a family would read wrong ---------------------

def _domino(path, vocab=64):
    """SpecForge configs/qwen3-8b-domino.json's shape (DominoDraftModel: a dflash_config with
    projector_type 'domino', a GRU head and shifted labels), sizes shrunk."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["DominoDraftModel"], "model_type": "qwen3", "block_size": 4, "emb_dim": 8,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [0, 1], "projector_type": "domino",
                          "pure_draft_prefix_len": 1, "emb_dim": 8, "gru_hidden_dim": 16, "shift_label": True},
        "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "intermediate_size": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "vocab_size": vocab, "num_target_layers": 4}))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(16, 32), "gru.weight_ih_l0": torch.zeros(48, 8)}, str(path / "model.safetensors"))
    return path


def test_unknown_family_is_exit_6_before_any_work(tiny_target, tmp_path):
    from cli_util import dfcache

    store = tmp_path / "store"
    r = dfcache("run", "eval", "--target", tiny_target, "--drafter", _domino(tmp_path / "domino"), "--completions",
                "local", "--prompts", "builtin:reasoning", "--num-prompts", "1", "--max-new-tokens", "8",
                "--backend", "torch", store=store)
    assert r.code == 6 and "Traceback" not in r.err, r.err
    for what in ("Known families", "dflash:", "eagle3:", "dspark:", "DominoDraftModel", "projector_type='domino'"):
        assert what in r.err, (what, r.err)
    assert {f.name for f in store.rglob("*") if f.is_file()} <= {"dfcache-store.json"}  # nothing computed


def test_published_shapes_dfcache_cannot_score_are_refused(tmp_path):
    """Each is exit 6 (BadInputError) naming what it found, never a silent wrong load: P-EAGLE
    (SpecForge configs/qwen3-8b-peagle.json: four layers, PEagleDraftModel), nebius' unnamed EAGLE-3
    head (LlamaForCausalLM, one layer, truncated_vocab_size: recognised, its YaRN RoPE read; a RoPE
    type dfcache does not compute, longrope, is refused), a speculators EAGLE-3 with sliding-window layers, an EAGLE-1-style head
    (use_aux_hidden_state false), and checkpoints holding tensors of modules no family has."""
    from safetensors.torch import load_file, save_file

    from runner.drafters.dflash import DFlashConfig, DFlashDrafter, init_drafter_weights, save_drafter
    from runner.drafters.eagle3 import Eagle3Drafter
    from runner.drafters.family import Eagle3, family_of

    peagle = {"architectures": ["PEagleDraftModel"], "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 16,
              "num_attention_heads": 2, "intermediate_size": 32, "vocab_size": V, "draft_vocab_size": DV}
    with pytest.raises(BadInputError, match="PEagleDraftModel.*Known families"):
        family_of(tmp_path, peagle)
    layer = {"model_type": "llama", "hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": V, "rms_norm_eps": 1e-5}
    nebius = {"architectures": ["LlamaForCausalLM"], **layer, "truncated_vocab_size": DV, "draft_vocab_size": DV,
              "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "original_max_position_embeddings": 4096}}
    assert family_of(tmp_path, nebius) is Eagle3
    from runner.drafters.eagle3_config import Eagle3Config

    read = Eagle3Config.from_dict(nebius)  # its YaRN RoPE is read (tested against speculators' above)
    assert (read.draft_vocab_size, read.rope_scaling["rope_type"], read.target_layer_ids) == (DV, "yarn", None)
    longrope = {**nebius, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}
    with pytest.raises(BadInputError, match="rope_type='longrope' is not supported"):
        Eagle3.plan(tmp_path, longrope, num_target_layers=8, target_hidden=H, target_vocab=V, steps=None)
    with pytest.raises(BadInputError, match="no drafter family"):  # a one-layer LM without a draft vocabulary
        family_of(tmp_path, {"architectures": ["LlamaForCausalLM"], **layer})
    spec = {"speculators_model_type": "eagle3", "draft_vocab_size": V, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
            "transformer_layer_config": {**layer, "layer_types": ["sliding_attention"], "sliding_window": 8}}
    with pytest.raises(BadInputError, match="sliding-window"):
        Eagle3.plan(tmp_path, spec, num_target_layers=8, target_hidden=H, target_vocab=V, steps=None)
    eagle1 = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "eagle_config": {"use_aux_hidden_state": False}}
    with pytest.raises(BadInputError, match="use_aux_hidden_state is false"):
        Eagle3.plan(tmp_path, eagle1, num_target_layers=8, target_hidden=H, target_vocab=V, steps=None)

    # an EAGLE-3 checkpoint with P-EAGLE's mask_hidden, a DFlash one with a foreign module
    e3 = tmp_path / "e3"
    _specforge_eagle3(e3, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, dtype=torch.float32)
    t = load_file(str(e3 / "model.safetensors"))
    t["mask_hidden"] = torch.zeros(1, 3 * H)
    save_file(t, str(e3 / "model.safetensors"))
    with pytest.raises(BadInputError, match=r"\['mask_hidden'\] are not part of a one-layer EAGLE-3"):
        Eagle3Drafter.from_pretrained(e3)
    cfg = DFlashConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       intermediate_size=32, rms_norm_eps=1e-6, rope_theta=1e6, block_size=4, target_layer_ids=[0, 1],
                       mask_token_id=63, layer_types=["full_attention"])
    df = save_drafter(init_drafter_weights(DFlashDrafter(cfg), seed=0), tmp_path / "df")
    DFlashDrafter.from_pretrained(df)  # as saved: loads
    t = load_file(str(df / "model.safetensors"))
    t["gru.weight_ih_l0"] = torch.zeros(48, 8)
    save_file(t, str(df / "model.safetensors"))
    with pytest.raises(BadInputError, match=r"\['gru.weight_ih_l0'\] are no part of a DFlash drafter"):
        DFlashDrafter.from_pretrained(df)


# ---- z-lab's "Meta v1" assistant (MuseGlimmerAssistantModel) --------------------------------------

def test_meta_v1_assistant_layout_is_read_as_zlab_reads_it(tmp_path):
    """z-lab/dflash tests/fixtures/assistant-config.json (a verbatim copy of the published config):
    MuseGlimmerAssistantModel, DFlash's fields at the top level (no dflash_config), sliding layers
    whose in-block attention z-lab runs bidirectionally (is_causal false), rope_parameters, and
    ``encoder.fc`` / ``encoder.output_norm_enc`` for fc / hidden_norm. It drafts as the same drafter
    in SpecForge's layout with ``is_causal: false``."""
    from types import SimpleNamespace

    from safetensors.torch import load_file, save_file

    from runner.drafters.dflash import (DFlashConfig, DFlashDrafter, TargetHead, init_drafter_weights, save_drafter,
                                        score_roots)
    from runner.drafters.family import DFlash, family_of
    from runner.models.train_tiny import single_thread
    from runner.stages.drafter_eval import read_drafter

    Hd, Vv, Bb = 16, 40, 4
    cfg = DFlashConfig(hidden_size=Hd, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       intermediate_size=32, rms_norm_eps=1e-5, rope_theta=500000.0, block_size=Bb,
                       target_layer_ids=[0, 2], mask_token_id=Vv - 1, layer_types=["sliding_attention"] * 2,
                       sliding_window=6, is_causal=False)
    with single_thread():
        ref = save_drafter(init_drafter_weights(DFlashDrafter(cfg), seed=0, std=0.3), tmp_path / "zlab")
        meta = tmp_path / "meta"
        meta.mkdir()
        (meta / "config.json").write_text(json.dumps({
            "architectures": ["MuseGlimmerAssistantModel"], "attention_dropout": 0, "block_size": Bb, "dtype": "bfloat16",
            "head_dim": 8, "hidden_act": "silu", "hidden_size": Hd, "intermediate_size": 32,
            "layer_types": ["sliding_attention"] * 2, "mask_token_id": Vv - 1, "max_position_embeddings": 131072,
            "model_type": "muse_glimmer_assistant", "num_attention_heads": 2, "num_hidden_layers": 2,
            "num_key_value_heads": 1, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "sliding_window": 6,
            "target_layer_ids": [0, 2], "transformers_version": "5.15.0.dev0"}))
        renames = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
        save_file({renames.get(k, k): v for k, v in load_file(str(ref / "model.safetensors")).items()},
                  str(meta / "model.safetensors"), metadata={"format": "pt"})
        raw = json.loads((meta / "config.json").read_text())
        assert family_of(meta, raw) is DFlash
        dref = read_drafter(str(meta), target_info=lambda: SimpleNamespace(num_layers=4, hidden_size=Hd, vocab_size=Vv))
        assert (dref.family, dref.target_layer_ids, dref.block_size, dref.mask_token_id) == ("dflash", [0, 2], Bb, Vv - 1)
        ours, theirs = DFlashDrafter.from_pretrained(meta), DFlashDrafter.from_pretrained(ref)
        assert [layer.is_causal for layer in ours.layers] == [False, False]
        g = torch.Generator().manual_seed(2)
        head = TargetHead(torch.randn(Vv, Hd, generator=g), torch.randn(Vv, Hd, generator=g))
        feats, toks = torch.randn(14, 2 * Hd, generator=g), torch.randint(0, Vv - 1, (14,), generator=g)
        roots = list(range(1, 10))
        a, b = score_roots(ours, head, feats, toks, roots), score_roots(theirs, head, feats, toks, roots)
        for layer in theirs.layers:  # the sliding layers' default (causal) would draft otherwise
            layer.is_causal = True
        c = score_roots(theirs, head, feats, toks, roots)
    assert torch.equal(a, b) and not torch.allclose(a, c)


@pytest.mark.parametrize("name,raw,family,rope", [
    # SpecForge configs/kimi-k3-dspark.json: a DSpark whose backbone declares YaRN (rope_parameters)
    ("kimi-k3-dspark", {"architectures": ["DSparkDraftModel"], "model_type": "qwen3", "block_size": 7, "head_dim": 8,
                        "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                        "num_hidden_layers": 1, "layer_types": ["full_attention"], "num_target_layers": 93,
                        "vocab_size": 64, "rope_parameters": {"factor": 16.0, "original_max_position_embeddings": 4096,
                                                              "rope_theta": 10000.0, "rope_type": "yarn"},
                        "dflash_config": {"attention_mode": "gqa", "markov_head_type": "vanilla", "markov_rank": 8,
                                          "mask_token_id": 63, "projector_type": "dspark",
                                          "target_layer_ids": [7, 23, 51, 67, 83]}}, "dspark", "yarn"),
    # SpecForge configs/qwen2-5-vl-7b-eagle3.json: mrope (plain on text)
    ("qwen2.5-vl-eagle3", {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 16,
                           "head_dim": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32,
                           "num_hidden_layers": 1, "vocab_size": 64, "draft_vocab_size": 32, "rope_theta": 1000000,
                           "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
                           "target_model_type": "qwen2_5_vl"}, "eagle3", None),
])
def test_published_configs_parse(tmp_path, name, raw, family, rope):
    from runner.drafters.dflash import DFlashConfig
    from runner.drafters.dspark_config import backbone_config
    from runner.drafters.eagle3_config import Eagle3Config
    from runner.drafters.family import family_of

    assert family_of(tmp_path, raw).name == family
    cfg = Eagle3Config.from_dict(raw) if family == "eagle3" else DFlashConfig.from_dict(backbone_config(raw))
    assert (cfg.rope_scaling or {}).get("rope_type") == rope


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, YARN_ROPE], ids=["llama3", "yarn"])
def test_scaled_rope_dflash_batched_equals_parity_reference(rope):
    """A DFlash backbone with a scaled RoPE (speculators copies the verifier's; SpecForge's Kimi DSpark
    declares YaRN): the batched eval and parity's literal reference draft give the same logits, and
    they differ from plain RoPE's."""
    from runner.drafters.dflash import DFlashConfig, DFlashDrafter, Rope, TargetHead, init_drafter_weights, score_roots
    from runner.trust.parity import reference_draft

    Hd, Vv, Bb = 16, 40, 4
    raw = {"architectures": ["DFlashDraftModel"], "hidden_size": Hd, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32, "block_size": Bb,
           "rope_parameters": dict(rope), "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": Vv - 1}}
    d = init_drafter_weights(DFlashDrafter(DFlashConfig.from_dict(raw)), seed=0, std=0.3).eval()
    g = torch.Generator().manual_seed(3)
    head = TargetHead(torch.randn(Vv, Hd, generator=g), torch.randn(Vv, Hd, generator=g))
    feats, toks = torch.randn(20, 2 * Hd, generator=g), torch.randint(0, Vv - 1, (20,), generator=g)
    p = 15
    block = torch.tensor([int(toks[p])] + [Vv - 1] * (Bb - 1))
    with torch.no_grad():
        ref = reference_draft(d, head, feats[:p], block, p)
        got = score_roots(d, head, feats, toks, [p])[0]
        d.rope = Rope(8, 10000.0)
        plain = score_roots(d, head, feats, toks, [p])[0]
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-3)
