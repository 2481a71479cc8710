"""The store conformance suite: what every backend must do, as pytest tests.

A backend's test module subclasses :class:`StoreConformance` and provides a ``store`` fixture
returning a fresh, empty :class:`dfcache.store.Store`::

    class TestLocal(StoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            return open_store(tmp_path / "s")

Every backend runs it: the local directory and ``file://`` (tests/test_store_local.py), ``s3://``
against a real S3 server (tests/test_store_s3.py). The checks cover what the ``Backend`` interface
declares, capabilities included (bounded reads, offline refusal, local directories).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from dfcache.errors import (AmbiguousKeyError, ArtifactNotFoundError, IntegrityError, OfflineModeIsEnabled,
                            UsageError)
from dfcache.keys import compute_key
from dfcache.store import format as fmt


def _key(i) -> str:
    return compute_key("conformance", 1, {"i": i})


def _bf16(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    import ml_dtypes

    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(ml_dtypes.bfloat16)


def write_example(store, i=0, rows=300, cols=16, chunk_rows=64, codec="none"):
    key = _key(i)
    n = i if isinstance(i, int) else sum(map(ord, str(i)))
    data = _bf16(rows, cols, seed=n)
    with store.writer(key, stage="conformance", stage_version=1, inputs={"i": i},
                      provenance={"backend": "test"}, summary=f"example {i}") as w:
        w.write_array("hidden", data, chunk_rows=chunk_rows, codec=codec)
        w.write_array("ids", np.arange(rows, dtype=np.int32) * (i + 1 if isinstance(i, int) else 1))
        w.put_json("meta", {"i": i, "text": "héllo"})
    return key, data


class StoreConformance:
    """Subclass and provide a ``store`` fixture (a fresh empty store)."""

    def test_empty(self, store):
        assert store.list_manifests() == []
        assert not store.has(_key(0))
        with pytest.raises(ArtifactNotFoundError):
            store.manifest(_key(0))

    @pytest.mark.parametrize("codec", ["none", "zstd", "shuffle-zstd"])
    def test_roundtrip_bitexact(self, store, codec):
        key, data = write_example(store, codec=codec)
        assert store.has(key)
        art = store.open(key)
        got = art.array("hidden")[:]
        assert got.dtype.name == "bfloat16"
        assert got.view(np.uint16).tobytes() == data.view(np.uint16).tobytes()
        assert np.array_equal(art.array("ids")[:], np.arange(300, dtype=np.int32))
        assert art.json("meta") == {"i": 0, "text": "héllo"}
        assert store.verify(key) == []

    def test_dtypes_roundtrip(self, store):
        key = _key("dtypes")
        arrays = {
            "f32": np.random.default_rng(1).standard_normal((50, 3)).astype(np.float32),
            "f16": np.random.default_rng(2).standard_normal((7,)).astype(np.float16),
            "i64": np.arange(-5, 95, dtype=np.int64),
            "u8": np.arange(256, dtype=np.uint8),
            "b": np.array([True, False, True]),
        }
        with store.writer(key, stage="conformance", stage_version=1, inputs={"i": "dtypes"}) as w:
            for name, a in arrays.items():
                w.write_array(name, a, chunk_rows=16)
        art = store.open(key)
        for name, a in arrays.items():
            got = art.array(name)[:]
            assert got.dtype == a.dtype and got.tobytes() == a.tobytes(), name

    def test_slices_read_only_their_chunks(self, store):
        key, data = write_example(store, rows=1000, chunk_rows=100)
        art = store.open(key)
        arr = art.array("hidden")
        assert arr[250:260].view(np.uint16).tobytes() == data[250:260].view(np.uint16).tobytes()
        assert arr[999].view(np.uint16).tobytes() == data[999].view(np.uint16).tobytes()
        reads = []
        orig, orig_open = art._read, art._open_local
        art._read = lambda rel: (reads.append(rel), orig(rel))[1]
        art._open_local = lambda rel: (reads.append(rel), orig_open(rel))[1]  # a local store's fast path
        arr[250:260]
        assert reads == ["hidden/c/2/0"]
        reads.clear()
        arr[250:260]  # once its crc32c passed, a local chunk is read again by the rows asked for only
        assert reads == ["hidden/c/2/0"]

    def test_manifest_fields(self, store):
        key, _ = write_example(store)
        m = store.manifest(key)
        assert m.key == key and m.stage == "conformance" and m.stage_version == 1
        assert m.inputs == {"i": 0} and m.provenance["backend"] == "test"
        spec = m.arrays["hidden"]
        assert spec.shape == [300, 16] and spec.dtype == "bfloat16" and spec.chunk_rows == 64
        assert spec.nbytes == 300 * 16 * 2 and len(spec.digest) == 32
        assert m.size_bytes > spec.nbytes and m.created and m.dfcache_version and m.format_version == 1

    def test_list_and_resolve(self, store):
        keys = [write_example(store, i=i, rows=10)[0] for i in range(3)]
        assert sorted(m.key for m in store.list_manifests()) == sorted(keys)
        assert store.list_manifests(stage="other") == []
        assert store.resolve(keys[0][:10]) == keys[0]
        with pytest.raises(ArtifactNotFoundError):
            store.resolve("ffffffffffff" if not any(k.startswith("ffff") for k in keys) else "0000000000")
        # 40 keys make a shared one-digit prefix certain (16 possible first digits).
        many = [write_example(store, i=100 + i, rows=2)[0] for i in range(40)]
        first = max("0123456789abcdef", key=lambda c: sum(k.startswith(c) for k in many + keys))
        with pytest.raises(AmbiguousKeyError):
            store.resolve(first)

    def test_abort_leaves_nothing(self, store):
        key = _key("aborted")
        with pytest.raises(RuntimeError):
            with store.writer(key, stage="conformance", stage_version=1, inputs={"i": "aborted"}) as w:
                w.write_array("x", np.zeros((100, 4), np.float32), chunk_rows=10)
                raise RuntimeError("boom")
        assert not store.has(key)
        assert store.list_manifests() == []

    def test_incomplete_array_refused(self, store):
        key = _key("short")
        with pytest.raises(UsageError):
            with store.writer(key, stage="conformance", stage_version=1, inputs={"i": "short"}) as w:
                aw = w.create_array("x", (100, 4), "float32", chunk_rows=10)
                aw.append(np.zeros((50, 4), np.float32))
        assert not store.has(key)

    def test_streaming_append_matches_one_shot(self, store):
        key = _key("stream")
        data = np.random.default_rng(3).standard_normal((257, 5)).astype(np.float32)
        with store.writer(key, stage="conformance", stage_version=1, inputs={"i": "stream"}) as w:
            aw = w.create_array("x", data.shape, "float32", chunk_rows=32)
            for start in range(0, 257, 45):
                aw.append(data[start:start + 45])
        assert store.open(key).array("x")[:].tobytes() == data.tobytes()

    def test_same_key_twice_keeps_one_copy(self, store):
        key, data = write_example(store)
        key2, _ = write_example(store)
        assert key == key2
        assert [m.key for m in store.list_manifests()] == [key]
        assert store.verify(key) == []

    def test_concurrent_writers_same_key(self, store):
        errors = []

        def run():
            try:
                write_example(store, i=7, rows=500)
            except Exception as e:  # pragma: no cover - the assertion shows it
                errors.append(e)

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert [m.key for m in store.list_manifests()] == [_key(7)]
        assert store.verify(_key(7)) == []

    def test_delete(self, store):
        key, _ = write_example(store)
        assert store.delete(key)
        assert not store.has(key)
        assert not store.delete(key)

    def test_corrupt_chunk_detected(self, store):
        key, _ = write_example(store, rows=200, chunk_rows=50)
        self.corrupt(store, key, "hidden/c/1/0")
        problems = store.verify(key)
        assert problems and "chunk 1" in " ".join(problems)
        with pytest.raises(IntegrityError):
            store.open(key).array("hidden")[60:70]

    def test_missing_chunk_detected(self, store):
        key, _ = write_example(store, rows=200, chunk_rows=50)
        self.remove(store, key, "hidden/c/2/0")
        problems = store.verify(key)
        assert problems and "missing" in " ".join(problems)

    def test_edited_manifest_refused(self, store):
        key, _ = write_example(store)
        raw = json.loads(store.backend.read_manifest(key))
        raw["arrays"]["hidden"]["shape"] = [301, 16]
        self.overwrite(store, key, "manifest.json", json.dumps(raw).encode())
        assert store.verify(key)

    def test_files_are_the_format_s(self, store):
        key, _ = write_example(store, rows=200, chunk_rows=50, codec="zstd")
        m = store.manifest(key)
        files = store.backend.list_files(key)
        assert set(files) == set(fmt.expected_files(m)) | {fmt.MANIFEST}
        assert sum(n for rel, n in files.items() if rel != fmt.MANIFEST) == m.size_bytes

    def test_bounded_read(self, store):
        key, _ = write_example(store, rows=200, chunk_rows=50)
        m = store.manifest(key)
        rel = fmt.chunk_relpath("hidden", 1, 2)
        limit = fmt.file_limit(m, fmt.expected_files(m)[rel])
        data = store.backend.read_file_limited(key, rel, limit)
        assert data == store.backend.read_file(key, rel) and len(data) <= limit
        with pytest.raises(IntegrityError, match="allows"):
            store.backend.read_file_limited(key, rel, len(data) - 1)
        with pytest.raises(FileNotFoundError):
            store.backend.read_file_limited(key, "hidden/c/99/0", limit)

    def test_offline_refusal_matches_needs_network(self, store):
        store.backend.check_offline(False)
        if store.backend.needs_network:
            with pytest.raises(OfflineModeIsEnabled):
                store.backend.check_offline(True)
        else:
            store.backend.check_offline(True)

    def test_local_dir_only_for_local_roots(self, store):
        d = store.local_dir("reports")
        assert (d is None) == (store.backend.local_root is None)
        if d is not None:
            assert d.parent == store.backend.local_root
        with pytest.raises(UsageError):
            store.local_dir("artifacts")

    def test_untrusted_view_reads_the_same(self, store):
        key, data = write_example(store, rows=100, chunk_rows=32)
        from dfcache.store import Store

        view = Store(store.backend.for_untrusted_reads())
        assert view.backend.needs_network == store.backend.needs_network
        assert view.open(key).array("hidden")[:].view(np.uint16).tobytes() == data.view(np.uint16).tobytes()

    # Backends whose files are not below a local root override these three.
    def _path(self, store, key, relpath):
        root = store.backend.local_root
        assert root is not None, "override corrupt/remove/overwrite for a backend without a local root"
        return root / fmt.artifact_prefix(key) / relpath

    def corrupt(self, store, key, relpath):
        path = self._path(store, key, relpath)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    def remove(self, store, key, relpath):
        self._path(store, key, relpath).unlink()

    def overwrite(self, store, key, relpath, data: bytes):
        self._path(store, key, relpath).write_bytes(data)
