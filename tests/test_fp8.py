"""FP8 hidden states (issue 33): the codec is hs-connectors' own numerics bit for bit, it round-trips
through a real store with and without a lossless stage, extraction keys it apart from bf16 (and not
apart by its lossless stage), reads dequantize, ls/show name it, and bad input is refused (exit 2)
with the list of what it applies to and the store unchanged."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import zarr

from cli_util import dfcache
from dfcache import fp8
from dfcache.keys import compute_key
from dfcache.store import open_store
from test_hidden_states import one_torch_thread, run_layers, segments_of, write_tokens  # noqa: F401 (autouse)

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")


def _states(n=300, h=96, seed=0) -> np.ndarray:
    """bf16 bits like hidden states: a few large channels, rows of different magnitude, a zero row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)) * np.where(rng.random(h) < 0.05, 30.0, 0.5) * rng.uniform(0.01, 10, (n, 1))
    x[3] = 0
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def test_quantize_and_dequantize_are_hs_connectors_bit_for_bit():
    """speculators' FP8 backend writes with hs-connectors' fp8_utils: the same codes, scales and bf16."""
    import torch
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    bits = _states()
    t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    packed = fp8.quantize(bits)
    assert packed.shape == (300, 100) and packed.dtype == np.uint8
    assert np.array_equal(fp8.quantize_torch(t).numpy(), packed)  # what extraction runs on the device
    codes, scales = fp8.unpack(packed)
    q, s = quantize_tensor_to_fp8(t)
    assert np.array_equal(codes.view(np.uint8), q.view(torch.uint8).numpy())
    assert np.array_equal(scales, s.reshape(-1).numpy())
    theirs = dequantize_fp8_tensor(q, s).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(fp8.dequantize(packed), theirs)
    # lossy, within e4m3's half-ulp (2^-4 relative) of each row's largest value
    x = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    y = fp8.dequantize(packed).view(ml_dtypes.bfloat16).astype(np.float32)
    assert not np.array_equal(x, y)
    assert (np.abs(y - x) <= np.abs(x).max(axis=1, keepdims=True) / 16 + 1e-30).all()
    assert not y[3].any()  # a zero row stays zero


@pytest.mark.parametrize("kernels", ["torch", "numpy"])
def test_the_fast_dequantization_gives_hs_connectors_bits_for_every_code_scale_and_edge(kernels, monkeypatch):
    """dequantize runs integer bit moves and a bf16 multiply in torch where torch is imported,
    integer and float32 ufuncs in numpy elsewhere (not ml_dtypes' casts): the same bits as their
    reader for every non-NaN code at scales from the clamp to bf16's largest (and all under 256:
    torch's one multiply), for NaN codes and non-finite scales (the casts take those rows),
    per-layer groups, a row slice written into a wider result, and on a thread that flushes
    subnormals (the casts again)."""
    import threading

    monkeypatch.setattr(fp8, "uses_torch", lambda: kernels == "torch")

    import torch
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    def theirs(codes, scales):  # codes [n, G*H] uint8, scales [n, G] float32
        n, g = scales.shape
        q = torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn).reshape(n, g, -1)
        out = dequantize_fp8_tensor(q, torch.from_numpy(scales).reshape(n, g, 1))
        return out.reshape(n, -1).view(torch.int16).numpy().view(np.uint16)

    def same(ours, ref):  # bit for bit, NaN for NaN (NaN payloads: ml_dtypes' casts and torch differ)
        nan = np.isnan(ref.view(ml_dtypes.bfloat16).astype(np.float32))
        return np.array_equal(ours[~nan], ref[~nan]) and np.isnan(ours[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()

    codes = np.tile(np.arange(256, dtype=np.uint8), (200, 1))
    scales = (np.float32(2.0) ** np.linspace(-40, 119, 200).astype(np.float32) * np.float32(1.37)).reshape(-1, 1)
    scales[-1] = 1e-12
    assert same(fp8.dequantize_codes(codes, scales), theirs(codes, scales))  # NaN codes: every row casts
    plain = codes[:, [c for c in range(256) if c & 0x7F != 0x7F]]  # no NaN code: every row the fast way
    assert fp8._subnormals_kept()
    assert np.array_equal(fp8.dequantize_codes(plain, scales), theirs(plain, scales))
    small = scales[scales[:, 0] < 256]
    assert np.array_equal(fp8.dequantize_codes(plain[:len(small)], small), theirs(plain[:len(small)], small))
    one_nan = np.tile(plain[:1], (5000, 1))  # 0xFF in the last of several blocks: that block alone takes the casts
    one_nan[4900, 7] = 0xFF
    ones = np.full((5000, 1), 0.75, np.float32)
    assert same(fp8.dequantize_codes(one_nan, ones), theirs(one_nan, ones))
    odd = scales.copy()
    odd[[5, 6, 7]] = [[np.inf], [np.nan], [-0.0]]
    with np.errstate(invalid="ignore"):
        got = fp8.dequantize_codes(plain, odd)
    with np.errstate(invalid="ignore"):
        assert same(got, theirs(plain, odd))
    rng = np.random.default_rng(3)
    grouped = rng.integers(0, 127, (64, 3 * 40)).astype(np.uint8)
    gs = rng.uniform(1e-4, 50, (64, 3)).astype(np.float32)
    assert np.array_equal(fp8.dequantize_codes(grouped.view(ml_dtypes.float8_e4m3fn), gs), theirs(grouped, gs))
    packed = fp8.quantize(_states(n=3000, h=96))  # more rows than one block
    out = np.zeros((3100, 96), np.uint16)
    fp8.dequantize(packed[100:2900], out=out[200:3000])
    assert np.array_equal(out[200:3000], fp8._dequantize_casts(*_codes_scales(packed[100:2900])))
    assert not out[:200].any() and not out[3000:].any()
    flushed = {}

    def flushing():  # FTZ/DAZ is per thread: the integer layout's subnormals would read as 0
        torch.set_flush_denormal(True)
        try:
            flushed["kept"] = fp8._subnormals_kept()
            flushed["bits"] = fp8.dequantize_codes(plain, scales)
        finally:
            torch.set_flush_denormal(False)
    th = threading.Thread(target=flushing)
    th.start()
    th.join()
    if torch.set_flush_denormal(False):  # the CPU supports flushing: that thread did
        assert flushed["kept"] is False
    assert np.array_equal(flushed["bits"], theirs(plain, scales))


@pytest.mark.parametrize("kernels", ["torch", "numpy"])
def test_a_large_fp8_read_split_across_reader_threads_gives_the_same_bits(tmp_path, monkeypatch, kernels):
    """A read of 4 MiB or more dequantizes its rows on the reader's threads (where cores are idle:
    one helper forced here), each into its slice of one result; torch's kernels take it whole
    (on torch's threads)."""
    from dfcache.store import _reader

    monkeypatch.setattr(_reader, "_read_workers", lambda: 1)
    monkeypatch.setattr(fp8, "uses_torch", lambda: kernels == "torch")
    packed = fp8.quantize(_states(n=4500, h=512))
    key = compute_key("fp8_test", 1, {"big": 1})
    store = open_store(tmp_path / "s")
    with store.writer(key, stage="fp8_test", stage_version=1, inputs={}) as w:
        w.write_array("hidden", packed, dtype=fp8.FP8_DTYPE, chunk_rows=512)
    a = open_store(tmp_path / "s").open(key).array("hidden")
    got = a.read(7, 4500)
    assert got.nbytes >= _reader.READ_SPLIT_BYTES
    assert np.array_equal(got.view(np.uint16), fp8._dequantize_casts(*_codes_scales(packed[7:])))


def _codes_scales(packed):
    codes, scales = fp8.unpack(packed)
    return codes, scales.reshape(-1, 1)


def test_fp8_rows_round_trip_through_a_store_with_each_lossless_stage(tmp_path):
    store = open_store(tmp_path / "s")
    packed = fp8.quantize(_states())
    sizes = {}
    for codec in ("none", "zstd", "shuffle-zstd", "bitshuffle-lz4"):
        key = compute_key("fp8_test", 1, {"codec": codec})
        with store.writer(key, stage="fp8_test", stage_version=1, inputs={"codec": codec}) as w:
            w.write_array("hidden", packed, dtype=fp8.FP8_DTYPE, codec=codec, chunk_rows=64)
        a = open_store(tmp_path / "s").open(key).array("hidden")
        assert np.array_equal(a.read_raw(), packed)  # packed rows, bit for bit
        deq = a.read(10, 20)  # a read is dequantized bf16
        assert deq.dtype == ml_dtypes.bfloat16 and np.array_equal(deq.view(np.uint16), fp8.dequantize(packed[10:20]))
        # any zarr v3 reader opens it: uint8 rows of codes and a scale
        z = zarr.open_array(store=str(tmp_path / "s" / "artifacts" / key[:2] / key / "hidden"), mode="r")
        assert np.array_equal(z[:], packed)
        sizes[codec] = sum(f.stat().st_size for f in (tmp_path / "s" / "artifacts" / key[:2] / key / "hidden").rglob("*")
                           if f.is_file() and f.name != "zarr.json")
    assert sizes["zstd"] < sizes["none"]
    assert dfcache("verify", store=tmp_path / "s").code == 0


def test_a_dtype_or_codec_this_dfcache_does_not_read_is_exit_2_naming_it(tmp_path):
    """What a reader older than a codec meets: never the bytes taken for numbers."""
    store = open_store(tmp_path / "s")
    key = compute_key("fp8_test", 1, {})
    with store.writer(key, stage="fp8_test", stage_version=1, inputs={}) as w:
        w.write_array("hidden", fp8.quantize(_states()), dtype=fp8.FP8_DTYPE)
    path = tmp_path / "s" / "artifacts" / key[:2] / key / "manifest.json"
    m = json.loads(path.read_text())
    m["dfcache_version"] = "99.0.0"  # what a later release writes; the same names from this release are junk (5)
    for field, value in (("dtype", "float8_e5m2_blockscaled"), ("codec", "fp8-e5m2")):
        edited = json.loads(json.dumps(m))
        edited["arrays"]["hidden"][field] = value
        path.write_text(json.dumps(edited))
        r = dfcache("show", key, store=tmp_path / "s")
        assert r.code == 2, r.err
        assert value in r.err and "newer dfcache" in r.err and "Traceback" not in r.err
    from dfcache import __version__
    edited["dfcache_version"] = __version__  # the same name claimed by this release: no release wrote it
    path.write_text(json.dumps(edited))
    assert dfcache("show", key, store=tmp_path / "s").code == 5
    m["arrays"]["hidden"]["dtype"] = "../x"  # junk, not a name: an untrusted manifest (5)
    path.write_text(json.dumps(m))
    assert dfcache("show", key, store=tmp_path / "s").code == 5


@pytest.mark.parametrize("args,names", [
    (["run", "tokens", "--compression", "fp8-e4m3"], "the tokens stage"),
    (["run", "hidden-states", "--dtype", "float32", "--compression", "fp8-e4m3+zstd"], "float32 hidden states"),
    (["plan", "eval", "--compression", "fp8-e5m2"], "is not one of"),
])
def test_fp8_where_it_does_not_apply_is_exit_2_with_what_it_applies_to(tmp_path, tiny_target, args, names):
    r = dfcache(*args, "--target", tiny_target, "--layer", "1", store=tmp_path / "s")
    assert r.code == 2, r.err
    assert names in r.err and "fp8-e4m3" in r.err and "Traceback" not in r.err
    assert ("bfloat16 hidden states" in r.err) or "fp8-e4m3+zstd" in r.err
    assert not (tmp_path / "s" / "artifacts").exists() or not any((tmp_path / "s" / "artifacts").iterdir())


def test_extraction_keys_fp8_apart_quantizes_the_bf16_rows_and_reads_dequantize(tiny_target, tmp_path, capfd,
                                                                                monkeypatch):
    import torch

    import runner.stages.hidden_states as hs
    from runner.stages.hidden_states import read_layer

    monkeypatch.setattr(hs, "LOSSY_CHECK_SAMPLES", 5)  # the check reads a bounded, evenly spaced subset

    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    bf16, _ = run_layers(store, tok, [1, 3], None, dtype="bfloat16")
    capfd.readouterr()
    f8, _ = run_layers(store, tok, [1, 3], None, dtype="bfloat16", compression="fp8-e4m3")
    # the first FP8 extraction of samples whose bf16 states are cached prints its per-layer error
    err = capfd.readouterr().err
    for k in (1, 3):
        assert (f"layer {k} fp8-e4m3 vs the cached bfloat16 states of 5 of the same 12 samples (evenly spaced; "
                "`dfcache diff` compares them all): rel_l2 0.0") in err
    assert "--codec none --codec fp8-e4m3" in err
    f8z, ctx = run_layers(store, tok, [1, 3], None, dtype="bfloat16", compression="fp8-e4m3+zstd")
    for k in (1, 3):
        assert f8[k].key != bf16[k].key  # a bf16 request never gets FP8 states, nor the other way
        assert f8z[k].key == f8[k].key  # the lossless stage is not keyed: reused
        assert f8[k].inputs["backend"] == {**bf16[k].inputs["backend"], "states": "fp8-e4m3"}
        assert "states" not in bf16[k].inputs["backend"]
        (m,) = segments_of(store, f8[k]).values()
        assert m.arrays["hidden"].dtype == fp8.FP8_DTYPE and m.arrays["hidden"].shape[1] == 128 + 4
        exact = read_layer(store, bf16[k])
        lossy = read_layer(store, f8[k])
        assert lossy.dtype == torch.bfloat16 and lossy.shape == exact.shape
        # the stored FP8 rows are the quantized bf16 rows, bit for bit
        want = fp8.dequantize(fp8.quantize(exact.view(torch.int16).numpy().view(np.uint16)))
        assert np.array_equal(lossy.view(torch.int16).numpy().view(np.uint16), want)
        rel = ((lossy.float() - exact.float()).norm() / exact.float().norm()).item()
        assert 0 < rel < 0.05
    assert not ctx.work_done  # fp8-e4m3+zstd found every sample of fp8-e4m3
    ls = dfcache("ls", "--stage", "hidden_states", store=store.url)
    assert ls.code == 0 and "torch/cpu/fp8-e4m3" in ls.out and "torch/cpu/bfloat16" in ls.out
    f8_seg, bf16_seg = next(iter(segments_of(store, f8[1]))), next(iter(segments_of(store, bf16[1])))
    show = dfcache("show", f8_seg, store=store.url)
    assert show.code == 0 and "fp8-e4m3" in show.out and "float8_e4m3fn_scaled" in show.out
    diff = dfcache("--json", "diff", bf16_seg, f8_seg, store=store.url)  # FP8 diffs against bf16 as bf16
    assert diff.code == 0, diff.err
    (a,) = json.loads(diff.out)["arrays"]
    assert 0 < a["rel_l2"] < 0.05 and a["cos_min"] > 0.99
    # training reads: bf16 dequantized by default (the eval's bf16, bit for bit), codes and scales on request
    from dfcache.training import HiddenStateDataset
    from runner.core.samples import StoredSamples

    def dataset(nodes, **kw):
        src = StoredSamples(store.url, tok.partition.key, tok.sample_keys, [nodes[k].partition.key for k in (1, 3)],
                            [nodes[k].sample_keys for k in (1, 3)], list(tok.ids), layers=[1, 3])
        return HiddenStateDataset(src, **kw)

    deq, raw, exact = dataset(f8)[4], dataset(f8, fp8="raw")[4], dataset(bf16)[4]
    n = exact["hidden_states"].shape[1]
    assert deq["hidden_states"].dtype == torch.bfloat16 and "hidden_states_scales" not in deq
    want = torch.cat([read_layer(store, f8[k], [4]) for k in (1, 3)], dim=-1)[None]
    assert torch.equal(deq["hidden_states"].view(torch.int16), want.view(torch.int16))
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw["hidden_states"].shape == (1, n, 256)
    assert raw["hidden_states_scales"].shape == (1, n, 2) and raw["hidden_states_scales"].dtype == torch.float32
    again = (raw["hidden_states"].to(torch.bfloat16).view(1, n, 2, 128)
             * raw["hidden_states_scales"].to(torch.bfloat16)[..., None]).reshape(1, n, 256)  # hs-connectors' rule
    assert torch.equal(again.view(torch.int16), deq["hidden_states"].view(torch.int16))
    assert not torch.equal(deq["hidden_states"].view(torch.int16), exact["hidden_states"].view(torch.int16))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (quantization on the device)")
def test_quantize_on_cuda_gives_the_hosts_bits():
    """Extraction quantizes on the GPU (issue 33): its packed rows must be the host's bits, or FP8 states
    made on a GPU and on a CPU would differ under one key."""
    import torch

    for seed in range(3):
        bits = _states(n=2048, h=4096, seed=seed)
        t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        on_device = fp8.quantize_torch(t.cuda()).cpu().numpy()
        on_host = fp8.quantize(bits)
        rows, cols = np.nonzero(on_device != on_host)
        where = [(int(r), int(c), int(on_host[r, c]), int(on_device[r, c])) for r, c in zip(rows[:5], cols[:5])]
        assert not len(rows), f"{len(rows)} bytes differ (row, column, host, device): {where}"



def test_the_lossy_check_picks_evenly_spaced_samples_first_and_last_included():
    from runner.stages.hidden_states import _evenly_spaced

    assert _evenly_spaced(5, 16) == [0, 1, 2, 3, 4]
    picks = _evenly_spaced(128, 16)
    assert len(picks) == 16 and picks[0] == 0 and picks[-1] == 127 and picks == sorted(set(picks))
    assert max(b - a for a, b in zip(picks, picks[1:])) <= 9
