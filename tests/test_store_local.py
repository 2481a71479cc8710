"""The local directory backend: the conformance suite plus local-only guarantees."""

import pytest

from dfcache.store import open_store
from dfcache.testing.store_conformance import StoreConformance


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return open_store(tmp_path / "store")
