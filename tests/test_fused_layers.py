"""The fused Qwen3.5 norms and MLP gate (runner/models/fused_layers.py) give transformers' own
forwards' bits, and the fla binding on CUDA installs them only then. The kernels need a CUDA GPU
and triton: those tests are skipped elsewhere (CI has neither). On the CPU: every class the table
names exists in the installed transformers with the attributes the fused forwards read, and a
module not on CUDA runs its class's own forward."""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("triton")
                               and importlib.util.find_spec("fla")),
                          reason="needs a CUDA GPU, triton and fla (the fused kernels and the fla binding)")

# what each fused forward reads from its module
ATTRS = {"Qwen3_5RMSNorm": ("weight", "eps"), "Qwen3_5RMSNormGated": ("weight", "variance_epsilon"),
         "Qwen3_5MLP": ("gate_proj", "up_proj", "down_proj", "act_fn")}


def _module(cls_name: str):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from runner.models.fused_layers import FUSED

    (mod_name, _), = [k for k in FUSED if k[1] == cls_name]
    cls = getattr(importlib.import_module(mod_name), cls_name)
    cfg = Qwen3_5TextConfig(hidden_size=64, intermediate_size=96, linear_value_head_dim=32)
    if cls_name == "Qwen3_5MLP":
        return cls(cfg, 96)
    return cls(64 if cls_name == "Qwen3_5RMSNorm" else 32)


def test_the_table_names_classes_the_installed_transformers_has():
    from runner.models.fused_layers import FUSED

    assert {name for _, name in FUSED} == set(ATTRS)
    for name, attrs in ATTRS.items():
        m = _module(name)
        assert all(hasattr(m, a) for a in attrs), name


def test_off_the_gpu_each_module_runs_its_own_forward():
    from runner.models.fused_layers import gated_forward, mlp_forward, rmsnorm_forward

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).bfloat16()
    norm, mlp = _module("Qwen3_5RMSNorm").bfloat16(), _module("Qwen3_5MLP").bfloat16()
    assert torch.equal(rmsnorm_forward(norm, x), type(norm).forward(norm, x))
    assert torch.equal(mlp_forward(mlp, x), type(mlp).forward(mlp, x))
    gated = _module("Qwen3_5RMSNormGated").bfloat16()
    h, z = torch.randn(7, 32, generator=g).bfloat16(), torch.randn(7, 32, generator=g).bfloat16()
    assert torch.equal(gated_forward(gated, h, z), type(gated).forward(gated, h, z))


@cuda
def test_each_fused_forward_gives_the_class_bits():
    from runner.models.fused_layers import _CHECKED, self_check

    _CHECKED.clear()
    for name in ATTRS:
        m = _module(name).to("cuda", torch.bfloat16)
        assert self_check(type(m), m, torch.device("cuda")) is None


@cuda
def test_the_fla_binding_installs_them_and_stores_the_same_rows(tiny_target):
    from runner.models.fused_layers import uninstall
    from runner.models.target import FINAL, load_target, resolve_kernel

    target = load_target(tiny_target, resolve_kernel("fla", "cuda", "bfloat16", "sdpa"))
    fused = target.provenance["fused_layers"]
    assert "fused_layers_skipped" not in target.provenance, target.provenance["fused_layers_skipped"]
    assert fused.get("Qwen3_5RMSNorm", 0) > 0 and fused.get("Qwen3_5MLP", 0) > 0, fused
    layers = [0, 2, 4, FINAL]
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(3, 500, (2, 77)).astype(np.int64)).cuda()
    got = target.forward_layers(x, layers)
    uninstall(target.model)
    want = target.forward_layers(x, layers)
    for k in layers:
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k
