"""Chunk codecs: `shuffle-zstd` and `bitshuffle-lz4` (zarr v3 blosc) round-trip bitwise, keep
the digests of the uncompressed bytes, are read by zarr itself, refuse damaged or lying frames,
and stores written with `none` or `zstd` read as before."""

import json

import ml_dtypes
import numpy as np
import pytest
import zarr

from dfcache.errors import IntegrityError
from dfcache.keys import compute_key
from dfcache.store import format as fmt
from dfcache.store import open_store


def _arrays():
    rng = np.random.default_rng(3)
    # like hidden states: a few large channels, the rest small, bf16
    scale = np.where(rng.random(96) < 0.05, 30.0, 0.5)
    return {"h": (rng.standard_normal((1000, 96)) * scale).astype(ml_dtypes.bfloat16),
            "ids": rng.integers(0, 50_000, 1000).astype(np.int32),
            "mask": rng.random(1000) < 0.5,
            "cube": rng.standard_normal((37, 3, 5)).astype(np.float32),
            "empty": np.zeros((4, 0), np.float16)}


def _write(store, codec, chunk_rows=None):
    key = compute_key("codec_test", 1, {"codec": codec, "chunk_rows": chunk_rows})
    with store.writer(key, stage="codec_test", stage_version=1, inputs={"codec": codec, "chunk_rows": chunk_rows}) as w:
        for name, a in _arrays().items():
            w.write_array(name, a, codec=codec, chunk_rows=chunk_rows if name != "empty" else None)
    return key


@pytest.mark.parametrize("codec,chunk_rows", [("shuffle-zstd", None), ("shuffle-zstd", 128), ("bitshuffle-lz4", 128)])
def test_blosc_codecs_round_trip_bitwise_same_digests_and_zarr_reads_it(tmp_path, codec, chunk_rows):
    store = open_store(tmp_path / "s")
    plain, packed = _write(store, "none", chunk_rows), _write(store, codec, chunk_rows)
    mp, mc = store.manifest(plain), store.manifest(packed)
    art = store.open(packed)
    group = zarr.open_group(str(store.backend.local_root / fmt.artifact_prefix(packed)), mode="r")
    for name, a in _arrays().items():
        want = a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a
        assert mc.arrays[name].codec == codec
        assert mc.arrays[name].digest == mp.arrays[name].digest  # digests cover the logical bytes
        got = art.array(name).read_raw()
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        assert np.asarray(group[name][:]).tobytes() == want.tobytes()
        meta = json.loads((store.backend.local_root / fmt.artifact_prefix(packed) / name / "zarr.json").read_text())
        assert [c["name"] for c in meta["codecs"]] == ["bytes", "blosc", "crc32c"]
    assert art.array("h").read_raw(100, 333).tobytes() == _arrays()["h"].view(np.uint16)[100:333].tobytes()
    assert store.verify(packed) == []
    chunks = lambda m: sum(n for rel, n in store.backend.list_files(m.key).items() if rel.startswith("h/c/"))  # noqa: E731
    assert chunks(mc) < chunks(mp)


def test_old_codecs_still_read(tmp_path):
    store = open_store(tmp_path / "s")
    for codec in ("none", "zstd"):
        key = _write(store, codec)
        got = store.open(key).array("h").read_raw()
        assert got.tobytes() == _arrays()["h"].view(np.uint16).tobytes()
        assert store.manifest(key).arrays["h"].codec == codec and store.verify(key) == []


def test_damaged_or_lying_blosc_chunks_are_refused(tmp_path):
    store = open_store(tmp_path / "s")
    key = _write(store, "shuffle-zstd")
    m = store.manifest(key)
    rel = fmt.chunk_relpath("h", 0, 2)
    role = fmt.expected_files(m)[rel]
    good = store.backend.read_file(key, rel)
    fmt.check_file(m, rel, role, good)

    def with_crc(body: bytes) -> bytes:
        import google_crc32c
        return body + google_crc32c.extend(0, body).to_bytes(4, "little")

    body = bytearray(good[:-4])
    lying = bytearray(body)
    lying[4:8] = (64 << 20).to_bytes(4, "little")  # claims 64 MiB decoded
    with pytest.raises(IntegrityError, match="declares 67108864"):
        fmt.check_file(m, rel, role, with_crc(bytes(lying)))
    with pytest.raises(IntegrityError, match="crc32c"):
        fmt.check_file(m, rel, role, bytes(body) + b"\0\0\0\0")
    flipped = bytearray(body)
    flipped[len(flipped) // 2] ^= 0xFF
    with pytest.raises(IntegrityError, match="does not (decompress|match its digest)"):
        fmt.check_file(m, rel, role, with_crc(bytes(flipped)))
    # the same through a read, with the repair hint
    path = store.backend.local_root / fmt.artifact_prefix(key) / rel
    path.write_bytes(with_crc(bytes(lying)))
    with pytest.raises(IntegrityError, match="gc --key"):
        open_store(tmp_path / "s").open(key).array("h").read_raw()
    assert fmt.file_limit(m, role) >= len(good)


def test_unknown_codec_is_a_usage_error(tmp_path):
    from dfcache.errors import UsageError

    store = open_store(tmp_path / "s")
    with pytest.raises(UsageError, match="shuffle-zstd"):
        with store.writer(compute_key("x", 1, {}), stage="x", stage_version=1, inputs={}) as w:
            w.write_array("a", np.zeros(3, np.float32), codec="lz4")
