"""DSpark's Markov head against the peers' own code (SpecForge 0.2 ``build_markov_head``'s greedy
``sample_block_tokens``, speculators 0.9 ``MarkovHead.block_bias``; installed --no-deps in CI),
and the batched teacher-forced accepted length equal to the sequential draft block for block."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dfcache.errors import BadInputError
from runner.drafters.dspark import (MarkovHead, accepted_lengths, greedy_chain, head_config, is_dspark_config,
                                    load_markov_head)

V, H, R, N, K = 40, 16, 8, 12, 6


def _ours(head_type, seed=0):
    torch.manual_seed(seed)
    head = MarkovHead(V, R, H, head_type).float().eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p))
    return head


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, K, V, generator=g), torch.randint(0, V, (N,), generator=g),
            torch.randn(N, K, H, generator=g))


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_greedy_chain_equals_specforge(head_type):
    pytest.importorskip("specforge")
    from specforge.modeling.draft.dspark import build_markov_head

    ours = _ours(head_type)
    ref = build_markov_head(SimpleNamespace(vocab_size=V, hidden_size=H),
                            {"markov_rank": R, "markov_head_type": head_type}).float().eval()
    ref.load_state_dict(ours.state_dict())
    base, root, hidden = _inputs()
    with torch.no_grad():
        want_tok, want_logits = ref.sample_block_tokens(base, first_prev_token_ids=root, hidden_states=hidden)
    tok, logits = greedy_chain(ours, base, root, hidden)
    assert torch.equal(tok, want_tok)
    assert torch.equal(logits, want_logits)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_block_bias_equals_speculators(head_type):
    pytest.importorskip("speculators")
    from speculators.models.dspark.model_definitions import MarkovHead as Ref

    ours = _ours(head_type)
    ref = Ref(verifier_vocab_size=V, draft_vocab_size=V, markov_rank=R, hidden_size=H, head_type=head_type).eval()
    ref.load_state_dict(ours.state_dict())
    _, _, hidden = _inputs()
    prev = torch.randint(0, V, (N, K), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref.block_bias(prev_token_ids=prev, hidden_states=hidden)
    assert torch.equal(ours.block_bias(prev, hidden), want)


@pytest.mark.parametrize("head_type", [None, "vanilla", "gated", "rnn"])
def test_batched_accepted_lengths_equal_the_sequential_draft(head_type):
    head = None if head_type is None else _ours(head_type)
    base, root, hidden = _inputs()
    drafted, _ = greedy_chain(head, base, root, hidden)
    # Targets that agree with the draft up to a chosen slot per block (0..K), then differ.
    cut = torch.arange(N) % (K + 1)
    target = drafted.clone()
    for i in range(N):
        if cut[i] < K:
            target[i, cut[i]] = (drafted[i, cut[i]] + 1) % V
    block = torch.cat([root[:, None], target], dim=1)
    got = accepted_lengths(head, base, hidden, block)
    want = torch.tensor([int((drafted[i] == target[i]).long().cumprod(0).sum()) for i in range(N)])
    assert torch.equal(got, want)
    assert torch.equal(got, cut)


def test_configs_of_both_layouts():
    sf = {"architectures": ["DSparkDraftModel"], "vocab_size": V,
          "dflash_config": {"projector_type": "dspark", "markov_rank": R, "markov_head_type": "rnn",
                            "confidence_head_alpha": 0.5}}
    assert is_dspark_config(sf)
    cfg = head_config(sf)
    assert (cfg.layout, cfg.markov_rank, cfg.head_type, cfg.confidence, cfg.sample_from_anchor) == \
        ("specforge", R, "rnn", True, False)
    sp = {"speculators_model_type": "dspark", "markov_head_type": "gated", "sample_from_anchor": False}
    cfg = head_config(sp)
    assert (cfg.layout, cfg.markov_rank, cfg.head_type, cfg.confidence_with_markov) == ("speculators", 256, "gated", True)
    # speculators' default: the anchor slot drafts too (DSparkSpeculatorConfig.sample_from_anchor)
    assert head_config({"speculators_model_type": "dspark"}).sample_from_anchor
    assert not is_dspark_config({"dflash_config": {"block_size": 8}})


@pytest.mark.parametrize("raw, words", [
    ({"speculators_model_type": "dspark", "draft_vocab_size": 80, "transformer_layer_config": {"vocab_size": 64}},
     "draft_vocab_size 80"),
    ({"dflash_config": {"projector_type": "dspark", "markov_rank": 4, "markov_head_type": "lstm"}}, "markov_head_type"),
    ({"dflash_config": {"projector_type": "dspark", "enable_confidence_head": True,
                        "confidence_head_with_markov": True}}, "markov_rank > 0"),
])
def test_configs_dfcache_cannot_score_are_refused(raw, words):
    with pytest.raises(BadInputError, match=words) as e:
        head_config(raw)
    assert str(e.value).rstrip().endswith(".")


def test_load_from_checkpoint_tensors_of_either_prefix():
    ours = _ours("gated")
    cfg = head_config({"dflash_config": {"projector_type": "dspark", "markov_rank": R, "markov_head_type": "gated"}})
    for prefix in ("markov_head.", "logit_head.markov_head."):
        tensors = {prefix + k: v for k, v in ours.state_dict().items()}
        tensors["fc.weight"] = torch.zeros(H, 2 * H)
        head = load_markov_head(tensors, cfg, V, H)
        base, root, hidden = _inputs()
        assert torch.equal(greedy_chain(head, base, root, hidden)[0], greedy_chain(ours, base, root, hidden)[0])
    with pytest.raises(BadInputError, match="missing"):
        load_markov_head({"markov_head.markov_w1.weight": torch.zeros(V, R)}, cfg, V, H)
    with pytest.raises(BadInputError, match="shapes"):
        load_markov_head({"markov_head." + k: v for k, v in ours.state_dict().items()}, cfg, V + 1, H)
    assert load_markov_head({}, head_config({"dflash_config": {"projector_type": "dspark"}}), V, H) is None
