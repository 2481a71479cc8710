"""The local directory and ``file://`` backends: the conformance suite plus local-only guarantees."""

import pytest

from dfcache.store import open_store
from dfcache.testing.store_conformance import StoreConformance


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return open_store(tmp_path / "store")


class TestFileRemoteStore(StoreConformance):
    """``file://``: the same directory layout, read without following symbolic links."""

    @pytest.fixture
    def store(self, tmp_path):
        store = open_store(f"file://{tmp_path / 'remote'}")
        assert store.backend.local_file_path("0" * 32, "zarr.json") is None  # never the fast path
        return store
