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


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_what_a_directory_without_a_marker_may_hold(tmp_path, scheme):
    """A new store may be made where a repository keeps an empty directory, or where a creation
    was cut short (the store's own directories, empty, or another creator's marker half-written);
    a directory with anything else in it is someone else's and is refused, left as it was."""
    from dfcache.errors import UsageError

    ok = tmp_path / "ok"
    (ok / "artifacts").mkdir(parents=True)
    (ok / "staging").mkdir()
    (ok / ".gitkeep").write_text("")
    (ok / "dfcache-store.json.0123456789abcdef0123456789abcdef.tmp").write_text("{")
    assert open_store(f"{scheme}{ok}").keys() == []
    assert (ok / "dfcache-store.json").is_file()

    for name, make in (("notes", lambda d: (d / "notes.txt").write_text("mine")),
                       ("full-artifacts", lambda d: ((d / "artifacts" / "ab").mkdir(parents=True)))):
        d = tmp_path / name
        d.mkdir()
        make(d)
        before = sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))
        with pytest.raises(UsageError, match="is not a dfcache store"):
            open_store(f"{scheme}{d}")
        assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*")) == before
