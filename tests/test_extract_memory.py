"""The extraction sizes its forwards from the GPU memory free after the model loads
(runner/models/memory.py), says what it chose, and refuses with exit 6 and the
figures a set whose longest sample cannot run at all.

The free-memory figure is passed in (``extract(..., gpu_free_bytes=N)``), the way the CUDA path
passes ``torch.cuda.mem_get_info``'s: the tiny real Qwen3.5 target runs on the CPU, nothing of
torch is replaced.
"""

from __future__ import annotations

import numpy as np
import pytest

from dfcache import compute_key, open_store
from dfcache.errors import BadInputError

LENGTHS = [16, 16, 9, 16, 24, 16, 24, 24, 16, 16, 16, 16]
LAYERS = [1, 3]


def _extract(store, target, tag, free=None):
    from runner.stages.hidden_states.extract import LayerSink, extract

    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(3, 500, n) for n in LENGTHS]).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int64)
    writers, sinks = [], []
    for k in LAYERS:
        w = store.writer(compute_key("memory_test", 1, {"layer": k, "tag": tag}), stage="memory_test",
                         stage_version=1, inputs={"layer": k, "tag": tag}, resumable=True)
        writers.append(w)
        sinks.append(LayerSink(layer=k, writer=w, array=w.create_array("hidden", (int(offsets[-1]), 128), "float32")))
    logged = []
    try:
        stats = extract(target, ids, offsets, sinks, batch_tokens=64, gpu_free_bytes=free, log=logged.append)
    except BaseException:
        for w in writers:
            w.abort()
        raise
    for w in writers:
        w.commit()
    stored = {k: store.open(w.key).array("hidden").read() for k, w in zip(LAYERS, writers)}
    return stats, stored, logged


def test_little_free_memory_shrinks_batches_and_keeps_the_rows(cpu_target, tmp_path):
    from runner.models import memory

    store = open_store(tmp_path / "store")
    per_token = memory.per_token_bytes(cpu_target.model.config, len(LAYERS), 4)
    _, full_rows, _ = _extract(store, cpu_target, "roomy")
    # room for 48 tokens a forward (two 24-token samples), not the 64 asked for
    free = memory.RESERVE_BYTES + 48 * per_token
    stats, rows, logged = _extract(store, cpu_target, "tight", free)
    chosen = stats.extra["memory_plan"]
    assert chosen["batch_tokens"] == 48 and chosen["requested_batch_tokens"] == 64
    assert chosen["cuda_graphs"] is False  # never on the CPU
    assert all(n * length <= 48 for n, length in
               (map(int, shape.split("x")) for shape in stats.extra["batch_shapes"]))
    assert any("batches of at most 48 tokens (asked 64, shrunk to fit)" in line for line in logged)
    for k in LAYERS:
        assert np.array_equal(rows[k], full_rows[k])


def test_a_sample_that_cannot_fit_is_refused_before_any_forward(cpu_target, tmp_path):
    from runner.models import memory

    store = open_store(tmp_path / "store")
    per_token = memory.per_token_bytes(cpu_target.model.config, len(LAYERS), 4)
    before = cpu_target.layers_executed
    with pytest.raises(BadInputError) as e:
        _extract(store, cpu_target, "too-small", memory.RESERVE_BYTES + 23 * per_token)  # the longest is 24
    assert e.value.exit_code == 6
    msg = str(e.value)
    assert "longest sample (24 tokens)" in msg and "GiB is free once the model is loaded" in msg
    assert msg.rstrip().endswith("(--max-new-tokens, a shorter prompt set).")
    assert cpu_target.layers_executed == before
    assert store.keys() == []


def test_27b_shaped_plan_on_an_80gb_card():
    """The Qwen3.5/3.6-27B text config (no weights): after 54 GB of weights about 25 GB are left,
    which holds 16k-token batches with CUDA graphs; 2.5 GiB holds smaller ones, without graphs."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from runner.models import memory

    cfg = Qwen3_5TextConfig(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                            num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                            linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16)
    per_token = memory.per_token_bytes(cfg, 5, 2)
    assert 200 << 10 < per_token < 1 << 20  # hundreds of KiB a token
    roomy = memory.plan(25 << 30, per_token, 2048, 16384)
    assert roomy.batch_tokens == 16384 and roomy.cuda_graphs
    assert roomy.lanes == 1 and roomy.lane_tokens == 0  # one lane unless asked
    tight = memory.plan(5 << 29, per_token, 2048, 16384)
    assert tight.cuda_graphs is False and 2048 <= tight.batch_tokens < 16384
    # A second lane (runner/models/lanes.py) gets what the first leaves, and never shrinks its batches.
    two = memory.plan(25 << 30, per_token, 2048, 16384, lanes=2)
    assert two.lanes == 2 and two.batch_tokens == 16384
    usable = (25 << 30) - memory.RESERVE_BYTES
    assert 2048 <= two.lane_tokens and 2 * 16384 * per_token + 2 * two.lane_tokens * per_token <= usable
    assert "2 lanes for forwards of at most" in two.describe()
    # room for the first lane's graphs but not for another sample's eager set and pool: one lane
    snug = memory.plan(memory.RESERVE_BYTES + (2 * 16384 + 2 * 2048 - 1) * per_token, per_token, 2048, 16384, lanes=2)
    assert snug.cuda_graphs and snug.batch_tokens == 16384 and snug.lanes == 1 and snug.lane_tokens == 0
    fits = memory.plan(memory.RESERVE_BYTES + (2 * 16384 + 2 * 2048) * per_token, per_token, 2048, 16384, lanes=2)
    assert fits.lanes == 2 and fits.lane_tokens == 2048
    assert memory.plan(5 << 29, per_token, 2048, 16384, lanes=2).lanes == 1  # no graphs, no lanes
    with pytest.raises(BadInputError):
        memory.plan(1 << 30, per_token, 2048, 16384)


def test_a_model_built_in_memory_is_bound_with_load_targets_checks(tiny_target):
    """models.target.bind_target (how the 27B-shaped GPU bench hands the stage a model built on the
    GPU): the same forward as load_target's, and the same refusals (here a dtype other than planned)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runner.models.target import bind_target, load_target, read_model_info, resolve_kernel

    spec = resolve_kernel("torch", "cpu", "float32", "sdpa")
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32, use_kernels=False)
    bound = bind_target(model, read_model_info(tiny_target), spec)
    loaded = load_target(tiny_target, spec)
    ids = torch.arange(3, 19)[None]
    a, b = bound.forward_layers(ids, [1, 3]), loaded.forward_layers(ids, [1, 3])
    assert all(torch.equal(a[k], b[k]) for k in (1, 3))
    with pytest.raises(BadInputError, match="loaded as torch.float32, not bfloat16"):
        bind_target(model, read_model_info(tiny_target), resolve_kernel("torch", "cpu", "bfloat16", "sdpa"))


def test_cuda_lanes_setting(monkeypatch):
    """$DFCACHE_CUDA_LANES: 2 (the default) or 1, anything else is a usage error naming the fix (more
    lanes are not offered: the pair check covers two)."""
    from dfcache.config import cuda_lanes
    from dfcache.errors import UsageError

    monkeypatch.delenv("DFCACHE_CUDA_LANES", raising=False)
    assert cuda_lanes() == 2
    monkeypatch.setenv("DFCACHE_CUDA_LANES", " 1 ")
    assert cuda_lanes() == 1
    for bad in ("0", "two", "-3", "3"):
        monkeypatch.setenv("DFCACHE_CUDA_LANES", bad)
        with pytest.raises(UsageError) as e:
            cuda_lanes()
        assert f"DFCACHE_CUDA_LANES={bad!r}" in str(e.value) and str(e.value).endswith("or 1 (one forward at a time).")
