"""One deterministic regression test per bug the reliability suite found (see docs/reliability.md,
"Bugs found"). The randomized tests found them; these pin each one down in a few milliseconds.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import sys

import numpy as np
import pytest

from dfcache.errors import IntegrityError, StoreWriteError
from dfcache.keys import compute_key
from dfcache.maintenance import gc_plan
from dfcache.store import open_store
from dfcache.store import _directory


def _data(rows=300, cols=4):
    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)


def _crash(writer) -> None:
    """What SIGKILL leaves: the staging area as it is, locks released, nothing cleaned."""
    writer._staging._release()


# ------------------------------------------------------------------------------ 1. stale tail


def test_stale_tail_of_the_same_length_is_not_resumed(tmp_path):
    """Bug: a crash between replacing tails/x.bin and progress.json left a newer tail beside older
    progress. When both tails had the same length the resumed writer appended to the wrong rows
    and committed an artifact that verified (its digests were computed from the wrong rows)."""
    store = open_store(tmp_path / "s")
    key = compute_key("regress", 1, {"case": "tail"})
    data = _data()
    w = store.writer(key, stage="regress", stage_version=1, inputs={"case": "tail"}, resumable=True)
    aw = w.create_array("x", data.shape, "float32", chunk_rows=64)
    aw.append(data[:74])  # one chunk + a tail of 10 rows
    w.checkpoint()
    aw.append(data[74:202])  # two more chunks + again a tail of 10 rows (rows 192..201)
    # The crash: the new tail file is in place, progress.json still describes the old one.
    w._put("tails/x.bin", memoryview(np.ascontiguousarray(aw._tail).view(np.uint8).reshape(-1)))
    _crash(w)
    w2 = store.writer(key, stage="regress", stage_version=1, inputs={"case": "tail"}, resumable=True)
    aw2 = w2.create_array("x", data.shape, "float32", chunk_rows=64)
    assert aw2.rows_written == 64, "a tail that is not the checkpointed one must be dropped"
    aw2.append(data[aw2.rows_written:])
    w2.commit()
    assert store.open(key).array("x")[:].tobytes() == data.tobytes()
    assert store.verify(key) == []


# ------------------------------------------------------------------------------ 2. partial removal


def _progress_with_chunks(store, key, inputs):
    data = _data(640)
    w = store.writer(key, stage="regress", stage_version=1, inputs=inputs, resumable=True)
    aw = w.create_array("x", data.shape, "float32", chunk_rows=64)
    aw.append(data[:400])
    w.checkpoint()
    path = w._staging.path
    _crash(w)
    return data, path


def test_resume_refuses_progress_whose_files_are_gone(tmp_path):
    """Bug: progress.json that outlived some of its chunk files (an `rm -r` or a gc killed
    half-way) was trusted; the resumed writer committed an artifact with missing chunks."""
    store = open_store(tmp_path / "s")
    key = compute_key("regress", 1, {"case": "partial"})
    data, path = _progress_with_chunks(store, key, {"case": "partial"})
    (path / "x" / "c" / "2" / "0").unlink()
    w = store.writer(key, stage="regress", stage_version=1, inputs={"case": "partial"}, resumable=True)
    assert not w.resumed
    aw = w.create_array("x", data.shape, "float32", chunk_rows=64)
    assert aw.rows_written == 0
    aw.append(data)
    w.commit()
    assert store.verify(key) == []
    assert store.open(key).array("x")[:].tobytes() == data.tobytes()


def test_gc_takes_a_staging_area_out_of_sight_before_deleting_it(tmp_path, monkeypatch):
    """Bug (same failure, gc side): gc deleted a resumable staging area file by file in place, so
    a gc killed half-way left progress without its chunks under the name the next writer uses."""
    store = open_store(tmp_path / "s")
    key = compute_key("regress", 1, {"case": "gc"})
    _progress_with_chunks(store, key, {"case": "gc"})

    def killed_midway(path, *a, **kw):  # deletes one file, then the process "dies"
        next(p for p in path.rglob("0") if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(_directory.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        gc_plan(store, tmp=True, grace_s=0).execute(store, grace_s=0)
    monkeypatch.undo()
    assert not (tmp_path / "s" / "staging" / f"{key}.resume").exists(), "the half-deleted area kept its name"
    assert [p.name.endswith(".deleted") for p in (tmp_path / "s" / "staging").iterdir()] == [True]
    gc_plan(store, tmp=True, grace_s=0).execute(store, grace_s=0)  # the next gc finishes the job
    assert list((tmp_path / "s" / "staging").iterdir()) == []


# ------------------------------------------------------------------------------ 3. gc between mkdir and flock


@pytest.mark.parametrize("resumable", [False, True])
def test_writer_survives_gc_between_mkdir_and_lock(tmp_path, monkeypatch, resumable):
    """Bug: `gc --grace 0` could delete a brand-new staging directory between the writer's mkdir
    and its flock (nobody held it yet); the writer then failed, or wrote into a directory that
    no lock protected. The writer now checks, once locked, that the path is still its directory."""
    store = open_store(tmp_path / "s")
    key = compute_key("regress", 1, {"case": "race", "r": resumable})
    real_flock = fcntl.flock
    fired = []

    def flock(fd, op):
        if not fired and op == fcntl.LOCK_EX and stat.S_ISDIR(os.fstat(fd).st_mode):  # its new staging dir
            fired.append(True)
            plan = gc_plan(store, tmp=True, grace_s=0)
            assert plan.items, "gc should see the unlocked new staging directory"
            plan.execute(store, grace_s=0)
        return real_flock(fd, op)

    real_put = _directory._DirectoryStaging.put

    def put(self, relpath, data):  # and gc again once the writer is writing: its area must be held
        n = real_put(self, relpath, data)
        if relpath.startswith("x/c/") and len(fired) == 1:
            fired.append(True)
            gc_plan(store, tmp=True, grace_s=0).execute(store, grace_s=0)
        return n

    monkeypatch.setattr(_directory.fcntl, "flock", flock)
    monkeypatch.setattr(_directory._DirectoryStaging, "put", put)
    with store.writer(key, stage="regress", stage_version=1, inputs={"case": "race", "r": resumable},
                      resumable=resumable) as w:
        w.write_array("x", _data(), chunk_rows=64)
    monkeypatch.undo()
    assert len(fired) == 2 and store.verify(key) == []
    assert store.open(key).array("x")[:].tobytes() == _data().tobytes()


# ------------------------------------------------------------------------------ 4. edited manifests


@pytest.mark.parametrize("edit", ["shape", "dtype"])
def test_reads_refuse_a_manifest_that_disagrees_with_zarr_json(tmp_path, edit):
    """Bug: a manifest edited to one row fewer (nbytes adjusted) or to int32 instead of float32
    still validated, and reads (which check crc32c, not digests) returned the data reshaped or
    reinterpreted as good. Reads now check each array's zarr.json against the manifest."""
    store = open_store(tmp_path / "s")
    key = compute_key("regress", 1, {"case": edit})
    with store.writer(key, stage="regress", stage_version=1, inputs={"case": edit}) as w:
        w.write_array("x", _data(), chunk_rows=128)
    mpath = tmp_path / "s" / "artifacts" / key[:2] / key / "manifest.json"
    m = json.loads(mpath.read_text())
    if edit == "shape":
        m["arrays"]["x"]["shape"] = [299, 4]
        m["arrays"]["x"]["nbytes"] = 299 * 4 * 4
    else:
        m["arrays"]["x"]["dtype"] = "int32"
    mpath.write_text(json.dumps(m))
    fresh = open_store(tmp_path / "s")
    with pytest.raises(IntegrityError, match=f"dfcache gc --key {key[:12]} --yes") as e:
        fresh.open(key).array("x")[:]
    assert "zarr.json says" in str(e.value) and e.value.exit_code == 5
    assert any("zarr.json says" in p for p in fresh.verify(key))


def test_corrupt_chunk_message_names_the_key_and_the_gc_command(tmp_path):
    """Bug (message): a checksum failure said "delete the artifact and recompute" without the key
    prefix or the command; every corrupt-artifact message now ends with the same fix."""
    store = open_store(tmp_path / "s")
    key = compute_key("regress", 1, {"case": "msg"})
    with store.writer(key, stage="regress", stage_version=1, inputs={"case": "msg"}) as w:
        w.write_array("x", _data(), chunk_rows=128)
        w.put_json("doc", {"a": 1})
    art = tmp_path / "s" / "artifacts" / key[:2] / key
    chunk = art / "x" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-1] + b"\x00")
    (art / "blobs" / "doc.json").write_text('{"a": 2}')
    (art / "manifest.json").write_text(json.dumps({**json.loads((art / "manifest.json").read_text()), "size_bytes": "x"}))
    for read in (lambda s: s.open(key).array("x")[:], lambda s: s.open(key).json("doc"), lambda s: s.manifest(key)):
        with pytest.raises(IntegrityError) as e:
            read(open_store(tmp_path / "s"))
        assert key in str(e.value) and f"`dfcache gc --key {key[:12]} --yes`" in str(e.value), str(e.value)
        (art / "manifest.json").write_text((art / "manifest.json").read_text())


# ------------------------------------------------------------------------------ 5. full store


def test_a_full_store_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    """Bug: ENOSPC (or EDQUOT, EROFS, EFBIG...) while writing surfaced as "internal error:
    OSError" (exit 1). It is now StoreWriteError (exit 2), naming the store and the fix."""
    store = open_store(tmp_path / "s")
    key = compute_key("regress", 1, {"case": "full"})
    real = _directory._DirectoryStaging._put

    def full(self, relpath, data):
        if "/c/" in relpath:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, relpath, data)

    monkeypatch.setattr(_directory._DirectoryStaging, "_put", full)
    with pytest.raises(StoreWriteError) as e:
        with store.writer(key, stage="regress", stage_version=1, inputs={"case": "full"}) as w:
            w.write_array("x", _data())
    assert e.value.exit_code == 2 and "No space left on device" in str(e.value)
    assert str(tmp_path / "s") in str(e.value) and "another --store" in str(e.value)
    assert not store.has(key) and list((tmp_path / "s" / "staging").iterdir()) == []


# ------------------------------------------------------------------------------ 6. Ctrl-C


def test_ctrl_c_exits_130_with_a_message(tmp_path, monkeypatch, capsys):
    """Bug: typer turns KeyboardInterrupt into Exit(130) and, outside standalone mode, returns it;
    main() ignored the value, so a Ctrl-C'ed `dfcache run` exited 0 and printed nothing."""
    from dfcache.cli import main
    from dfcache.store._store import Store

    open_store(tmp_path / "s")

    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "list_manifests", interrupted)
    from dfcache.store._local import LocalBackend

    monkeypatch.setattr(LocalBackend, "listing", interrupted)  # ls reads the listing index
    assert main(["--store", str(tmp_path / "s"), "ls"]) == 130
    assert "interrupted: committed artifacts are kept" in capsys.readouterr().err


# ------------------------------------------------------------------------------ 7. sockets at import


def test_importing_the_http_client_opens_no_socket():
    """Bug: dfcache.http imported requests at module level; urllib3's import opens an IPv6 probe
    socket, so every run (cached, offline) opened a socket while building its plan."""
    import subprocess

    code = "import sys, dfcache.http, runner.stages.completions; print('requests' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr


# ------------------------------------------------------------------------------ (helpers sanity)


def test_regression_helpers_leave_no_staging_behind(tmp_path):
    store = open_store(tmp_path / "s")
    key = compute_key("regress", 1, {"case": "clean"})
    w = store.writer(key, stage="regress", stage_version=1, inputs={"case": "clean"})
    w.write_array("x", _data())
    w.abort()
    assert list((tmp_path / "s" / "staging").iterdir()) == []
    shutil.rmtree(tmp_path / "s")
