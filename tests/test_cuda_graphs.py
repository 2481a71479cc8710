"""CUDA graph replay of the truncated forward (runner/models/graphs.py) gives the eager forward's
bits, and the extraction uses it. Needs a CUDA GPU: skipped elsewhere (CI has none); the H200
figures are in docs/benchmarks.md."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (graph capture)")

LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target(tiny_target):
    from runner.models.target import load_target, resolve_kernel

    return load_target(tiny_target, resolve_kernel("torch", "cuda", "float32", "sdpa"))


def test_replays_give_the_eager_bits(target):
    from runner.models.graphs import ForwardGraphs, same_bits

    g = ForwardGraphs(target)
    rng = np.random.default_rng(0)
    for i in range(5):
        x = torch.from_numpy(rng.integers(3, 500, (1, 32)).astype(np.int64)).cuda()
        got = g(x, LAYERS)
        want = target.forward_layers(x, LAYERS)
        assert all(same_bits(got[k], want[k]) for k in LAYERS), i
    st = g.stats()
    assert st["captured"] == ["1x32 L1,3"] or st["refused"], st
    if st["captured"]:
        assert st["replays"] == 3  # the first two forwards run eagerly, the second one captures


def test_replays_with_the_final_state_give_the_eager_bits(target):
    """The final state (layer "final", after the final norm) rides in the same captured forward."""
    from runner.models.graphs import ForwardGraphs, same_bits
    from runner.models.target import FINAL

    g = ForwardGraphs(target)
    rng = np.random.default_rng(1)
    for i in range(4):
        x = torch.from_numpy(rng.integers(3, 500, (2, 24)).astype(np.int64)).cuda()
        got = g(x, [1, FINAL])
        want = target.forward_layers(x, [1, FINAL])
        assert set(got) == {1, FINAL} and all(same_bits(got[k], want[k]) for k in got), i
        with torch.no_grad():
            ref = target.model(input_ids=x, use_cache=False)
        assert torch.equal(target.model.lm_head(got[FINAL]), ref.logits), i
    st = g.stats()
    assert st["captured"] == ["2x24 L1,final"] or st["refused"], st


def _extract_and_check(target, tmp_path, n: int, batch_tokens: int, seed: int):
    """Extract n samples of 24 tokens into a fresh store, check every stored row against a
    one-sample eager forward bit for bit, and return the extraction's statistics."""
    from dfcache import compute_key, open_store
    from runner.stages.hidden_states.extract import LayerSink, extract

    store = open_store(tmp_path / "store")
    lengths = [24] * n
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 500, sum(lengths)).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    writers, sinks = [], []
    for k in LAYERS:
        w = store.writer(compute_key("graphs_test", 1, {"layer": k}), stage="graphs_test", stage_version=1,
                         inputs={"layer": k}, resumable=True)
        writers.append(w)
        sinks.append(LayerSink(layer=k, writer=w, array=w.create_array("hidden", (int(offsets[-1]), 128), "float32")))
    stats = extract(target, ids, offsets, sinks, batch_tokens=batch_tokens)
    for w in writers:
        w.commit()
    for k, w in zip(LAYERS, writers):
        stored = store.open(w.key).array("hidden").read()
        for i in range(len(lengths)):
            x = torch.from_numpy(ids[offsets[i]:offsets[i + 1]].astype(np.int64))[None].cuda()
            one = target.forward_layers(x, LAYERS)[k][0].cpu().numpy()
            assert np.array_equal(stored[offsets[i]:offsets[i + 1]].view(np.uint32), one.view(np.uint32)), (k, i)
    return stats


def test_extraction_with_graphs_stores_eager_bits(target, tmp_path):
    stats = _extract_and_check(target, tmp_path, 6, 24, seed=1)
    assert stats.extra["cuda_graphs"]["replays"] >= 1 or stats.extra["cuda_graphs"]["refused"]


@pytest.mark.parametrize("lanes", ["2", "1"])
def test_extraction_on_lanes_stores_eager_bits(tiny_target, tmp_path, monkeypatch, lanes):
    """Forwards side by side on two CUDA streams (runner/models/lanes.py) store the bits of
    one-sample eager forwards; a shape runs side by side only after its pair check passed."""
    from runner.models.target import load_target, resolve_kernel
    from runner.stages.hidden_states.extract import _verdicts

    # A target of its own: graphs, lanes and their verdicts are kept per loaded target, and the
    # tests above (two lanes by default) would leave this shape captured and its pair checked.
    target = load_target(tiny_target, resolve_kernel("torch", "cuda", "float32", "sdpa"))
    monkeypatch.setenv("DFCACHE_CUDA_LANES", lanes)
    # as at hidden 4096: a pair of 24-token samples is taken to change bits, so one sample a forward
    _verdicts(target)[(2, 24)] = False
    stats = _extract_and_check(target, tmp_path, 16, 96, seed=7)
    assert stats.extra["batch_shapes"] == {"1x24": 16}
    if lanes == "2":
        st = stats.extra["lanes"]
        assert st["lanes"] == 2 and stats.extra["memory_plan"]["lanes"] == 2
        # both lanes capture the shape at its second forward there; the next pair is checked
        assert all("1x24 L1,3" in c for c in st["captured"]), st
        assert st["checked"] == {"1x24 L1,3": True}, st
        assert st["side_by_side"] >= 8, st
    else:
        assert "lanes" not in stats.extra and stats.extra["memory_plan"]["lanes"] == 1
