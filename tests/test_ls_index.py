"""The listing index (dfcache/store/_index.py) and `ls`'s fast entry (dfcache/__main__.py): `ls`
prints exactly what the manifests say, whether the index is there, missing, stale, torn or
written by a crashed commit."""

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_util import dfcache
from dfcache.cli import main as cli_main
from dfcache.keys import compute_key
from dfcache.maintenance import ls_entry, ls_output
from dfcache.store import _index, open_store

sys.path.insert(0, str(Path(__file__).resolve().parent / "reliability"))
from zygote import Zygote  # noqa: E402

# What the fast entry imports (dfcache/__main__.py), loaded once by the fork server below.
FAST_ENTRY = ["dfcache", "dfcache.__main__", "dfcache.cmdline", "dfcache.config", "dfcache.store.layout",
              "dfcache.listing", "dfcache.store", "dfcache.interrupts", "json", "stat", "runpy", "cli_util"]


@pytest.fixture(scope="module")
def fast_ls(tmp_path_factory):
    """``python -m dfcache ls ...`` as forked children of one interpreter that imported the fast
    entry's modules: each child runs dfcache/__main__.py as ``__main__``, as the interpreter does.
    ``_check`` lists a store 4 times a call, 7 calls: 28 interpreter start-ups (the file took 10.6 s
    quiet, 8.3 s with forks of ~0.02 s each; on 2 busy cores its tests took ~80 s, mostly start-ups).
    The real executable is still run below (test_changes_behind_the_index, test_fast_entry_...)."""
    z = Zygote(FAST_ENTRY, tmp_path_factory.mktemp("fast-ls"))

    def ls(store_root, *args):
        c = z.run("cli_util:run_dfcache_module", "--store", store_root, "ls", *args, name="ls")
        return c.code, c.out, c.err

    yield ls
    z.close()


def _commit(store, i, stage="tokens", kernel=None, summary=None):
    inputs = {"i": i, "text": f"sample \u00e9 {i}"}
    if kernel:
        inputs["backend"] = {"kernel": kernel, "device": "cpu", "dtype": "bfloat16"}
    key = compute_key(stage, 1, inputs)
    with store.writer(key, stage=stage, stage_version=1, inputs=inputs,
                      summary=summary if summary is not None else f"{stage} {i}") as w:
        w.write_array("ids", np.arange(4 + i, dtype=np.int32))
        w.put_json("meta", {"i": i})
    return key


def _manifest_path(store, key):
    return store.backend.local_root / "artifacts" / key[:2] / key / "manifest.json"


def _expected(store, *, json_out=True, stage=None, kernel=None):
    """`ls` as it was before the index: every manifest read and validated."""
    errors = []
    ms = store.list_manifests(errors=errors)
    ms = [m for m in ms if (stage is None or m.stage == stage)
          and (kernel is None or (m.backend or {}).get("kernel") == kernel)]
    entries = sorted((ls_entry(m) for m in ms), key=lambda e: (e[0], e[1]))
    return ls_output(entries, json_out=json_out, url=store.url, stage=stage, errors=len(errors))


def _in_process(capsys, store, *args):
    capsys.readouterr()
    assert cli_main(["--store", str(store.backend.local_root), "ls", *args]) == 0
    return capsys.readouterr().out


def _check(capsys, store, fast_ls):
    """Subprocess (fast entry) and in-process (full CLI) listings both equal the manifests'."""
    for args, kw in (((), {"json_out": False}), (("--json",), {}),
                     (("--stage", "tokens", "--json"), {"stage": "tokens"}),
                     (("--backend", "fla"), {"json_out": False, "kernel": "fla"})):
        want = _expected(store, **kw)
        code, out, err = fast_ls(store.backend.local_root, *args)
        assert code == 0, err
        assert out == want, args
        assert _in_process(capsys, store, *args) == want, args


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "s")
    for i in range(6):
        _commit(s, i, stage=("tokens", "prompts", "hidden_states")[i % 3], kernel="fla" if i % 3 == 2 else None)
    return s


def test_commit_logs_and_listing_compacts(store, capsys, fast_ls):
    idx = store.backend.local_root / "index"
    log = (idx / "listing.log").read_text().splitlines()
    assert len(log) == 6  # one line per commit
    lst = store.backend.listing()
    assert lst.reread == 0  # every manifest came from the commit log, none was parsed again
    assert not (idx / "listing.log").exists() and (idx / "listing").exists()
    _check(capsys, store, fast_ls)
    again = store.backend.listing()
    assert again.reread == 0 and len(again.artifacts) == 6


def test_missing_or_garbage_index_is_rebuilt(store, capsys, fast_ls):
    store.backend.listing()
    shutil.rmtree(store.backend.local_root / "index")  # an old store: no index at all
    _check(capsys, store, fast_ls)
    snap = store.backend.local_root / "index" / "listing"
    assert snap.exists()
    lines = snap.read_bytes().split(b"\n")
    snap.write_bytes(b"\n".join(lines[:3]) + b"\n" + lines[3][:40])  # torn (written without fsync)
    _check(capsys, store, fast_ls)
    snap.write_bytes(b"\x00" * 100)
    _check(capsys, store, fast_ls)
    assert len(store.backend.listing().artifacts) == 6


def test_changes_behind_the_index(store, capsys, fast_ls):
    root = store.backend.local_root
    store.backend.listing()
    keys = sorted(m.key for m in store.list_manifests())
    # deleted by hand, committed by a process that died before logging, and a manual copy
    shutil.rmtree(root / "artifacts" / keys[0][:2] / keys[0])
    new = _commit(store, 100, stage="tokens")
    (root / "index" / "listing.log").unlink()
    # an in-place edit of the same size, its mtime put back: the ctime still tells
    p = _manifest_path(store, keys[1])
    st = os.stat(p)
    m = json.loads(p.read_text())
    m["summary"] = m["summary"][:-1] + ("X" if m["summary"][-1] != "X" else "Y")
    text = json.dumps(m, sort_keys=True, indent=1)
    assert len(text) == st.st_size
    p.write_text(text)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    # a manifest that no longer validates, and a directory without one
    bad = _manifest_path(store, keys[2])
    bad.write_text(bad.read_text().replace('"format_version": 1', '"format_version": 7'))
    (root / "artifacts" / "ab" / ("ab" + "0" * 30)).mkdir(parents=True)
    _check(capsys, store, fast_ls)
    lst = store.backend.listing()
    listed = {e[1] for e in lst.artifacts}
    assert new in listed and keys[0] not in listed and keys[2] not in listed
    assert [name for name, _ in lst.errors] == [keys[2]]
    assert any(m["summary"] in e[4] for e in lst.artifacts)
    r = dfcache("ls", store=root)
    assert "1 manifest(s) failed validation" in r.out


def test_racy_entries_are_hashed_and_settle(store, monkeypatch):
    root = store.backend.local_root
    store.backend.listing()
    snap = (root / "index" / "listing").read_text().splitlines()[1:]
    assert {line.split("\t")[2] for line in snap} == {"0"}  # just committed: racy
    monkeypatch.setattr(_index, "RACY_NS", -10**12)
    store.backend.listing()  # hashed again, unchanged, now settled
    snap = (root / "index" / "listing").read_text().splitlines()[1:]
    assert {line.split("\t")[2] for line in snap} == {"1"}


def test_log_lines_of_other_code_or_torn_are_ignored(store, capsys, fast_ls):
    root = store.backend.local_root
    log = root / "index" / "listing.log"
    lines = log.read_text().splitlines()
    # another dfcache's stamp; a line whose checksum fails; the last line cut short
    other = lines[0].split(" ", 1)[1].replace(_index.stamp(), "0" * 16, 1)
    import xxhash
    forged = xxhash.xxh3_64_hexdigest(other.encode()) + " " + other
    bent = lines[1][:-5] + "A" + lines[1][-4:]
    log.write_text("\n".join([forged, bent, *lines[2:]])[:-7])
    lst = store.backend.listing()
    assert lst.reread == 3  # the forged, the bent and the torn line's manifests were read
    _check(capsys, store, fast_ls)


def test_fast_entry_falls_back_to_the_full_cli(store, tmp_path):
    root = store.backend.local_root
    r = dfcache("ls", "--stage", "no_such_stage", store=root)
    assert r.code == 2 and "is not a stage" in r.err
    r = dfcache("ls", "--stage", "report", "--json", store=root)  # a stage the runner defines
    assert r.code == 0 and json.loads(r.out) == []
    marker = root / "dfcache-store.json"
    marker.write_text(json.dumps({"format_version": 99, "kind": "dfcache-store"}))
    r = dfcache("ls", "--json", store=root)
    assert r.code == 2 and "format 99" in json.loads(r.out)["error"]
    fresh = tmp_path / "fresh"
    r = dfcache("ls", store=fresh)  # a mistyped --store: said, and nothing is created (issue 34)
    assert r.code == 2 and f"no dfcache store at {fresh}" in r.err and not fresh.exists()
    fresh.mkdir()
    (fresh / "dfcache-store.json").write_bytes((root / "dfcache-store.json").read_bytes().replace(b"99", b"2"))
    r = dfcache("ls", store=fresh)  # a store with nothing in it yet
    assert r.code == 0 and r.out.startswith("no artifacts in")


def test_fast_entry_needs_a_snapshot_of_this_code(store):
    # The executable takes the format version it reads from the snapshot (written by the same
    # code, whose stamp covers format.py): without a snapshot it cannot answer alone.
    root = store.backend.local_root
    assert _index.listing(root) is None  # commits only logged so far
    assert store.backend.listing() is not None
    assert _index.listing(root).format_version == store.backend.listing().format_version


def test_file_remote_and_local_dir_never_use_the_index(store):
    from dfcache.errors import UsageError

    remote = open_store(f"file://{store.backend.local_root}")
    assert remote.backend.listing() is None
    with pytest.raises(UsageError):
        store.local_dir("index")


def test_ls_by_selection_groups_the_segments_of_one_run(tmp_path, capsys):
    """A 10-prompt server run that committed a segment per answer lists as ten one-sample rows in
    `ls`; `ls --by selection` shows one line for it (10 samples in 10 segments), one for another
    prompt set of the same partition (named in the summaries), and other artifacts as they are.
    Through the listing index (in-process, the full CLI) and from manifests (--where)."""
    from dfcache.samples import Partition, SampleSink, record_digest

    store = open_store(tmp_path / "s")
    part = Partition("completions", 2, {"endpoint": "openai", "max_new_tokens": 8})
    with SampleSink(store, part, max_samples=1, summary="q.jsonl×10: completions from openai server") as sink:
        for i in range(10):
            sink.add(record_digest({"p": i}), doc={"text": f"answer {i}"})
    with SampleSink(store, part, summary="builtin:coding×3: completions from openai server") as sink:
        for i in range(3):
            sink.add(record_digest({"c": i}), doc={"text": f"code {i}"})
    other = _commit(store, 0, stage="report", summary="report: a vs b")

    capsys.readouterr()
    assert cli_main(["--store", str(tmp_path / "s"), "ls"]) == 0
    assert len([ln for ln in capsys.readouterr().out.splitlines() if " completions " in ln]) == 11

    assert cli_main(["--store", str(tmp_path / "s"), "ls", "--by", "selection"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["KEY", "STAGE", "SAMPLES", "SEGS"]
    at = lines[0].index("SELECTION")
    rows = {ln[at:]: ln.split() for ln in lines[1:-1]}
    assert rows["q.jsonl×10: completions from openai server"][:4] == [part.key[:12], "completions", "10", "10"]
    assert rows["builtin:coding×3: completions from openai server"][:4] == [part.key[:12], "completions", "3", "1"]
    assert rows["report: a vs b"][:4] == [other[:12], "report", "-", "-"]
    assert lines[-1].startswith("3 selection(s) of 12 artifact(s)")

    for where in ([], ["--where", "dfcache~0"]):  # the index, then the manifests themselves
        assert cli_main(["--store", str(tmp_path / "s"), "--json", "ls", "--by", "selection", *where]) == 0
        got = json.loads(capsys.readouterr().out)
        by_summary = {g["summary"]: g for g in got}
        run = by_summary["q.jsonl×10: completions from openai server"]
        assert run["partition"] == part.key and run["samples"] == 10 and len(run["segments"]) == 10
        assert run["stage"] == "completions" and run["size_bytes"] > 0 and run["first_created"] <= run["created"]
        assert by_summary["report: a vs b"]["key"] == other and by_summary["report: a vs b"]["segments"] == []
    # Each artifact's `ls --json` row says which partition and how many samples a segment holds.
    assert cli_main(["--store", str(tmp_path / "s"), "--json", "ls", "--stage", "completions"]) == 0
    segs = json.loads(capsys.readouterr().out)
    assert sorted(r["samples"]["count"] for r in segs) == [1] * 10 + [3]
    assert {r["samples"]["partition"] for r in segs} == {part.key}
    assert cli_main(["--store", str(tmp_path / "s"), "ls", "--by", "stage"]) == 2
    assert "--by 'stage' is not one of artifact, selection" in capsys.readouterr().err
