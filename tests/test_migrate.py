"""An older store (format 1, as dfcache before per-sample segments wrote it) gets one message
with the fix, and `dfcache migrate` upgrades it in place keeping every artifact."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_util import dfcache

from dfcache.errors import EXIT_USAGE, UsageError
from dfcache.keys import compute_key
from dfcache.store import format as fmt
from dfcache.store import migrate_store, open_store

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")

OLD_MARKER = b'{"format_version": 1, "kind": "dfcache-store"}\n'  # what format-1 dfcache wrote


def _old_store(root):
    """A store in the format-1 layout: format-1 artifacts are byte for byte what they are today,
    so one is committed and the marker is put back to what the older dfcache wrote."""
    st = open_store(root)
    key = compute_key("tokens", 1, {"x": 1})
    with st.writer(key, stage="tokens", stage_version=1, inputs={"x": 1}) as w:
        w.write_array("token_ids", np.arange(10, dtype=np.int32))
        w.put_json("samples", [{"id": "p0"}])
    (root / fmt.STORE_MARKER).write_bytes(OLD_MARKER)
    return key


def test_old_store_is_refused_with_the_fix_then_migrated_in_place(tmp_path):
    root = tmp_path / "old"
    key = _old_store(root)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))

    r = dfcache("ls", store=root)
    assert r.code == EXIT_USAGE and "Traceback" not in r.err
    assert "has format 1" in r.err and f"dfcache --store {root} migrate" in r.err, r.err
    r = dfcache("--json", "ls", store=root)
    assert r.code == EXIT_USAGE and "migrate" in json.loads(r.out)["error"]
    assert (root / fmt.STORE_MARKER).read_bytes() == OLD_MARKER  # refusing changed nothing

    dry = migrate_store(root, dry_run=True)
    assert (dry.from_format, dry.migrated, dry.artifacts) == (1, False, 1)
    assert (root / fmt.STORE_MARKER).read_bytes() == OLD_MARKER

    r = dfcache("migrate", store=root)
    assert r.code == 0, r.err
    assert "format 1 upgraded to 2" in r.out
    assert json.loads((root / fmt.STORE_MARKER).read_text())["format_version"] == fmt.FORMAT_VERSION == 2
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # only the marker's bytes changed
    st = open_store(root)
    assert [m.key for m in st.list_manifests()] == [key]
    assert st.verify(key) == []
    assert np.array_equal(st.open(key).array("token_ids").read(), np.arange(10))
    r = dfcache("--json", "migrate", store=root)
    assert r.code == 0 and json.loads(r.out)["migrated"] is False


def test_file_url_store_and_a_newer_format(tmp_path):
    root = tmp_path / "old"
    _old_store(root)
    r = dfcache("ls", store=f"file://{root}")
    assert r.code == EXIT_USAGE and f"dfcache --store file://{root} migrate" in r.err, r.err
    res = migrate_store(f"file://{root}")
    assert res.migrated and res.from_format == 1 and res.unreadable == []
    assert dfcache("ls", store=f"file://{root}").code == 0

    (root / fmt.STORE_MARKER).write_text('{"format_version": 99, "kind": "dfcache-store"}\n')
    r = dfcache("ls", store=root)
    assert r.code == EXIT_USAGE and "has format 99" in r.err and "Upgrade dfcache" in r.err, r.err
    with pytest.raises(UsageError, match="has format 99.*Upgrade dfcache"):
        migrate_store(root)


def test_an_unparsable_manifest_is_reported_and_left_alone(tmp_path):
    root = tmp_path / "old"
    key = _old_store(root)
    bad = root / "artifacts" / "bb" / ("b" * 32)
    bad.mkdir(parents=True)
    (bad / fmt.MANIFEST).write_text("{not json")
    res = migrate_store(root)
    assert res.migrated and res.artifacts == 2
    assert [u["key"] for u in res.unreadable] == ["b" * 32]
    assert (bad / fmt.MANIFEST).read_text() == "{not json"
    assert open_store(root).verify(key) == []
