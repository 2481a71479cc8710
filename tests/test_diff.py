"""`dfcache diff`: numeric comparison of two artifacts' arrays, on real extractions and real stores."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cli_util import dfcache
from dfcache import compute_key, open_store
from dfcache.diff import diff_artifacts
from dfcache.errors import BadInputError
from test_hidden_states import one_torch_thread, run_layers, segments_of, write_tokens  # noqa: F401 (autouse)

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")


def segment(store, node) -> str:
    """The key of the one segment holding a layer node's samples."""
    (key,) = segments_of(store, node)
    return key


@pytest.fixture(scope="module")
def extracted(tiny_target, tmp_path_factory):
    """Layer 3 of the same tokens in fp32 and in bf16, through the real stage."""
    store = open_store(tmp_path_factory.mktemp("diff") / "store")
    tok = write_tokens(store, tiny_target)
    f32, _ = run_layers(store, tok, [3], None, dtype="float32")
    b16, _ = run_layers(store, tok, [3], None, dtype="bfloat16")
    return dict(store=store, tokens=tok, f32=segment(store, f32[3]), b16=segment(store, b16[3]))


def synthetic(store, name, arrays: dict, upstream=None):
    key = compute_key("synthetic", 1, {"name": name}, upstream or {})
    with store.writer(key, stage="synthetic", stage_version=1, inputs={"name": name},
                      upstream=upstream or {}) as w:
        for n, a in arrays.items():
            w.write_array(n, a, chunk_rows=16)
    return key


def test_artifact_against_itself_is_exact(extracted):
    r = diff_artifacts(extracted["store"], extracted["f32"], extracted["f32"])
    (a,) = r.arrays
    assert (a.name, a.rel_l2, a.max_abs, a.equal, a.equal_kind) == ("hidden", 0.0, 0.0, 1.0, "bits")
    assert a.cos_mean == pytest.approx(1.0, abs=1e-12) and a.cos_min == pytest.approx(1.0, abs=1e-12)
    assert r.inputs_differ == {}


def test_fp32_against_bf16_extraction_differs(extracted):
    r = diff_artifacts(extracted["store"], extracted["f32"], extracted["b16"])
    (a,) = r.arrays
    assert (a.dtype_a, a.dtype_b, a.equal_kind) == ("float32", "bfloat16", "values")
    assert 1e-4 < a.rel_l2 < 0.05 and a.max_abs > 0 and a.equal < 0.5
    assert 0.99 < a.cos_min <= a.cos_mean < 1.0
    assert r.inputs_differ == {"backend.dtype": ["float32", "bfloat16"]}


def test_chunked_metrics_match_a_direct_computation(tmp_path, monkeypatch):
    import dfcache.diff as d

    monkeypatch.setattr(d, "CHUNK_BYTES", 8 * 40 * 8)  # 40 rows of 8 float64: many steps
    rng = np.random.default_rng(1)
    a = rng.standard_normal((300, 8)).astype(np.float32)
    b = a.copy()
    b[::3] += rng.standard_normal((100, 8)).astype(np.float32) * 1e-3
    b[7] = 0.0
    store = open_store(tmp_path / "s")
    ka, kb = synthetic(store, "a", {"x": a}), synthetic(store, "b", {"x": b})
    (r,) = diff_artifacts(store, ka, kb).arrays
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        cos = (a64 * b64).sum(1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))
    cos[7] = 0.0  # a zero row against a non-zero one
    assert r.rel_l2 == pytest.approx(np.linalg.norm(a64 - b64) / np.linalg.norm(a64), rel=1e-12)
    assert r.max_abs == pytest.approx(np.abs(a64 - b64).max(), rel=1e-12)
    assert r.cos_mean == pytest.approx(cos.mean(), rel=1e-12) and r.cos_min == pytest.approx(cos.min())
    assert r.equal == pytest.approx((a == b).mean()) and r.rows == 300


def test_different_rows_are_bad_input(extracted, tiny_target, tmp_path):
    store = extracted["store"]
    other = write_tokens(store, tiny_target, lengths=[23, 40, 17], seed=1)
    k_other = segment(store, run_layers(store, other, [3], None, dtype="float32")[0][3])
    with pytest.raises(BadInputError, match="hold different samples") as e:
        diff_artifacts(store, extracted["f32"], k_other)
    assert e.value.exit_code == 6
    s2 = open_store(tmp_path / "s")
    ka = synthetic(s2, "a", {"x": np.zeros((10, 4), np.float32)})
    kb = synthetic(s2, "b", {"x": np.zeros((12, 4), np.float32)})
    with pytest.raises(BadInputError, match=r"shape \[10, 4\] .* but \[12, 4\]"):
        diff_artifacts(s2, ka, kb)
    kc = synthetic(s2, "c", {"y": np.zeros((10, 4), np.float32)})
    with pytest.raises(BadInputError, match="no array name in common"):
        diff_artifacts(s2, ka, kc)
    with pytest.raises(BadInputError, match="has no array 'x'"):
        diff_artifacts(s2, ka, kc, arrays=["x"])


def test_cli_table_json_prefixes_and_exit_codes(extracted, tiny_target):
    store = extracted["store"]
    a, b = extracted["f32"], extracted["b16"]
    r = dfcache("diff", a[:10], b[:10], store=store.url)
    assert r.code == 0, r.err
    assert "rel L2" in r.out and "hidden" in r.out and "backend.dtype: float32 | bfloat16" in r.out
    r = dfcache("diff", a, a, "--json", "--array", "hidden", store=store.url)
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["key_a"] == a and out["arrays"][0]["rel_l2"] == 0.0 and out["arrays"][0]["equal"] == 1.0
    r = dfcache("--json", "diff", a, b, store=store.url)  # the global --json flag
    assert r.code == 0 and not math.isclose(json.loads(r.out)["arrays"][0]["rel_l2"], 0.0)
    other = write_tokens(store, tiny_target, lengths=[23, 40, 17], seed=1)
    k_other = segment(store, run_layers(store, other, [3], None, dtype="float32")[0][3])
    r = dfcache("diff", a, k_other, store=store.url)
    assert r.code == 6 and "hold different samples" in r.err and "Traceback" not in r.err
    r = dfcache("diff", a, "ffffffffffff", store=store.url)
    assert r.code == 2 and "no artifact key starts with" in r.err
