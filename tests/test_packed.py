"""Packed forwards: samples of different lengths in one forward give each sample's own states."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def target(tiny_target):
    from runner.models.target import load_target, resolve_kernel

    return load_target(tiny_target, resolve_kernel("torch", "cpu", "float32"))


def test_packed_rows_equal_one_sample_forwards(target):
    # Equal to float rounding, not bit for bit: on the CPU the GEMMs of a packed row (another M)
    # round differently in the last bit (measured: <= 5e-8 here), which is why packed states are
    # a kernel class of their own. bench/gpu_extract.py measures the bitwise share on a GPU.
    from runner.models.packed import forward_layers_packed

    lengths = [37, 5, 64, 1, 20]
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(4, 500, (n,), generator=g) for n in lengths]
    from runner.models.target import FINAL

    layers = [0, 2, 4, FINAL]                # linear, full and linear attention layers, the post-norm state
    packed = forward_layers_packed(target, torch.cat(samples)[None], lengths, layers)
    assert set(packed) == set(layers)
    start = 0
    for ids, n in zip(samples, lengths):
        one = target.forward_layers(ids[None], layers)
        for k in layers:
            torch.testing.assert_close(packed[k][0, start:start + n], one[k][0], atol=1e-6, rtol=1e-5)
        start += n
    # the model is left as it was: plain forwards after a packed one still run sdpa, unwrapped
    assert target.base.config._attn_implementation == "sdpa"
    assert target.modeling_module.causal_conv1d_fn.__name__ != "run"
    assert target.modeling_module.torch_chunk_gated_delta_rule.__name__ != "run"


def test_packing_without_boundaries_would_leak(target):
    # The check above is not vacuous: one plain forward over the concatenation differs.
    from runner.models.packed import forward_layers_packed

    lengths = [30, 30]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 500, (1, 60), generator=g)
    packed = forward_layers_packed(target, ids, lengths, [4])[4]
    plain = target.forward_layers(ids, [4])[4]
    torch.testing.assert_close(packed[0, :30], plain[0, :30], atol=1e-6, rtol=1e-5)
    assert (packed[0, 30:] - plain[0, 30:]).abs().max() > 1e-2


def test_padded_convolution_equals_per_sample(target):
    from runner.models.packed import forward_layers_packed

    lengths = [9, 2, 17]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 500, (1, sum(lengths)), generator=g)
    a = forward_layers_packed(target, ids, lengths, [0, 1], conv="segments")
    b = forward_layers_packed(target, ids, lengths, [0, 1], conv="padded")
    for k in (0, 1):
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
