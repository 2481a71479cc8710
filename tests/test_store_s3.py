"""The S3 backend against a real S3 server (moto_server): the conformance suite, plus what is
specific to object stores (no partial artifact visible, temporaries, error mapping)."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from s3server import s3_in_env  # noqa: E402

from dfcache.errors import ConnectionRefused, NetworkError, OfflineModeIsEnabled, UsageError  # noqa: E402
from dfcache.store import open_store  # noqa: E402
from dfcache.testing.store_conformance import StoreConformance, write_example  # noqa: E402
from dfcache.keys import compute_key  # noqa: E402

KEY = compute_key("conformance", 1, {})  # the key of what these tests write (stage conformance, no inputs)


@pytest.fixture(scope="module")
def s3():
    with s3_in_env() as server:
        yield server


def _object_key(store, key: str, relpath: str) -> str:
    prefix = store.backend.prefix
    return f"{prefix}/artifacts/{key[:2]}/{key}/{relpath}" if prefix else f"artifacts/{key[:2]}/{key}/{relpath}"


class TestS3Store(StoreConformance):
    @pytest.fixture
    def store(self, s3):
        return open_store(f"s3://{s3.create_bucket()}/dfcache", endpoint_url=s3.endpoint)

    def corrupt(self, store, key, relpath):
        c = self._client(store)
        obj = _object_key(store, key, relpath)
        data = bytearray(c.get_object(Bucket=store.backend.bucket, Key=obj)["Body"].read())
        data[len(data) // 2] ^= 0xFF
        c.put_object(Bucket=store.backend.bucket, Key=obj, Body=bytes(data))

    def remove(self, store, key, relpath):
        self._client(store).delete_object(Bucket=store.backend.bucket, Key=_object_key(store, key, relpath))

    def overwrite(self, store, key, relpath, data: bytes):
        self._client(store).put_object(Bucket=store.backend.bucket, Key=_object_key(store, key, relpath), Body=data)

    @staticmethod
    def _client(store):
        import boto3

        return boto3.client("s3", endpoint_url=store.backend.endpoint, region_name="us-east-1")


def _objects(s3, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", []))


def test_layout_mirrors_local_store_and_no_staging_left(s3):
    bucket = s3.create_bucket()
    store = open_store(f"s3://{bucket}/p", endpoint_url=s3.endpoint)
    key, _ = write_example(store, rows=100, chunk_rows=50)
    objs = _objects(s3, bucket)
    base = f"p/artifacts/{key[:2]}/{key}/"
    assert set(objs) == {"p/dfcache-store.json"} | {base + r for r in (
        "manifest.json", "zarr.json", "hidden/zarr.json", "hidden/c/0/0", "hidden/c/1/0", "ids/zarr.json",
        "ids/c/0", "blobs/meta.json")}
    assert store.backend.list_temporaries() == []
    # Plain zarr, knowing nothing of dfcache, reads the artifact where it lies.
    import zarr

    ids = zarr.open_array(store=store.backend.zstore, path=f"artifacts/{key[:2]}/{key}/ids", mode="r")
    assert np.array_equal(ids[:], np.arange(100, dtype=np.int32))


def _crash(writer) -> None:
    """The writer disappears without commit or abort, as when its process dies."""
    import gc

    writer._staging.__del__()  # what interpreter exit does to its heartbeat: it stops
    del writer
    gc.collect()


def test_crashed_writers_leave_only_temporaries_that_gc_removes(s3):
    bucket = s3.create_bucket()
    store = open_store(f"s3://{bucket}/p", endpoint_url=s3.endpoint)
    key = KEY  # inputs={} give it
    first = store.writer(key, stage="conformance", stage_version=1, inputs={})
    first.write_array("x", np.zeros((40, 2), np.float32), chunk_rows=10)
    # A second writer of the key while the first holds its lease uploads to private staging.
    second = store.writer(key, stage="conformance", stage_version=1, inputs={})
    second.write_array("x", np.ones((40, 2), np.float32), chunk_rows=10)
    _crash(first)
    _crash(second)
    assert not store.has(key) and store.list_manifests() == []
    temps = {t.name.split(".")[0]: t for t in store.backend.list_temporaries()}
    assert set(temps) == {f"artifacts/{key[:2]}/{key}", f"staging/{key}", f"locks/{key}"}
    assert all(t.size_bytes > 0 for t in temps.values())
    # The first writer's lease is fresh: its files could still be a live writer's.
    assert temps[f"artifacts/{key[:2]}/{key}"].in_use
    assert not store.backend.remove_temporary(f"artifacts/{key[:2]}/{key}", grace_s=0)
    assert not store.backend.remove_temporary(temps[f"locks/{key}"].name, grace_s=0)
    staging = temps[f"staging/{key}"].name
    assert not store.backend.remove_temporary(staging, grace_s=3600)  # too young
    assert store.backend.remove_temporary(staging, grace_s=0)
    # Once the lease is gone (stale after LEASE_STALE_S, then collected), the rest goes too.
    s3.client().delete_object(Bucket=bucket, Key=f"p/locks/{key}.lease")
    assert store.backend.remove_temporary(f"artifacts/{key[:2]}/{key}", grace_s=0)
    assert _objects(s3, bucket) == []
    write_example(store, rows=20)  # and the store works as before


def test_partial_artifact_without_manifest_is_invisible_and_collectable(s3):
    bucket = s3.create_bucket()
    store = open_store(f"s3://{bucket}/p", endpoint_url=s3.endpoint)
    key, _ = write_example(store, rows=20)
    # What a publisher that crashed mid-copy leaves: the files, no manifest.
    s3.client().delete_object(Bucket=bucket, Key=f"p/artifacts/{key[:2]}/{key}/manifest.json")
    assert not store.has(key) and store.list_manifests() == []
    names = [t.name for t in store.backend.list_temporaries()]
    assert names == [f"artifacts/{key[:2]}/{key}"]
    assert store.backend.remove_temporary(names[0], grace_s=0)
    # The next writer of the key publishes normally.
    write_example(store, rows=20)
    assert store.verify(key) == []


@pytest.mark.parametrize("first_commits", [True, False])
def test_same_key_different_bytes_never_mix(s3, first_commits):
    """One key need not mean one content (sampled text, non-deterministic GPU kernels): whichever
    writer wins, the artifact is entirely that writer's."""
    import threading

    store = open_store(f"s3://{s3.create_bucket()}/p", endpoint_url=s3.endpoint)
    key = KEY  # inputs={} give it
    data = {w: np.full((64, 4), w, np.float32) for w in (1, 2)}
    first = store.writer(key, stage="conformance", stage_version=1, inputs={})  # holds the lease
    second = store.writer(key, stage="conformance", stage_version=1, inputs={})  # uploads aside
    first.write_array("x", data[1], chunk_rows=8)
    second.write_array("x", data[2], chunk_rows=8)
    done = threading.Event()
    t = threading.Thread(target=lambda: (second.commit(), done.set()))
    t.start()  # waits for the first writer's lease
    time.sleep(0.3)
    assert not done.is_set() and not store.has(key)
    if first_commits:
        first.commit()
    else:
        first.abort()
    t.join(30)
    assert done.is_set()
    winner = 1 if first_commits else 2
    assert first.won is first_commits and second.won is not first_commits
    assert store.verify(key) == []
    assert store.open(key).array("x")[:].tobytes() == data[winner].tobytes()
    assert store.backend.list_temporaries() == []


def test_resumable_writer_refused_on_s3(s3):
    store = open_store(f"s3://{s3.create_bucket()}/p", endpoint_url=s3.endpoint)
    with pytest.raises(UsageError, match="resumable"):
        store.writer("cd" * 16, stage="conformance", stage_version=1, inputs={}, resumable=True)


def test_unreachable_endpoint_is_network_error_with_fix(s3):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: refused, and no other process can take it
        port = s.getsockname()[1]
        store = open_store("s3://nobody/p", endpoint_url=f"http://127.0.0.1:{port}")
        with pytest.raises(ConnectionRefused) as e:
            store.has("ef" * 16)
    assert e.value.exit_code == 4 and "s3://nobody/p" in str(e.value) and "endpoint" in str(e.value)


class _Panic(BaseException):
    """Stands for pyo3's PanicException (a BaseException, not an Exception) from a tokio worker."""


@pytest.mark.parametrize("exc", [RuntimeError("something obstore never said before"), _Panic("tokio worker panicked"),
                                 asyncio.CancelledError()], ids=["RuntimeError", "BaseException", "CancelledError"])
def test_any_unexpected_object_store_error_is_exit_4(exc):
    """Whatever class the object store raises, the caller gets a NetworkError (exit 4) naming the
    store, never exit 1."""
    store = open_store("s3://nobody/p", endpoint_url="http://127.0.0.1:9")

    async def failing():
        raise exc

    with pytest.raises(NetworkError) as e:
        store.backend._run(failing(), "listing")
    assert e.value.exit_code == 4 and "listing s3://nobody/p" in str(e.value)


def test_missing_bucket_names_the_bucket(s3):
    store = open_store("s3://no-such-bucket-here/p", endpoint_url=s3.endpoint)
    with pytest.raises(NetworkError, match="no-such-bucket-here does not exist"):
        store.list_manifests()


def test_offline_refuses_s3_before_any_request(s3, monkeypatch):
    monkeypatch.setenv("DFCACHE_OFFLINE", "1")
    with pytest.raises(OfflineModeIsEnabled, match="offline"):
        open_store(f"s3://{s3.create_bucket()}/p", endpoint_url=s3.endpoint)


def test_format_1_prefix_is_refused_with_the_fix_then_migrated(s3):
    from dfcache.store import migrate_store

    bucket = s3.create_bucket()
    url = f"s3://{bucket}/old"
    key, _ = write_example(open_store(url, endpoint_url=s3.endpoint), rows=10, chunk_rows=10)
    old = b'{"format_version": 1, "kind": "dfcache-store"}\n'  # what format-1 dfcache wrote
    s3.client().put_object(Bucket=bucket, Key="old/dfcache-store.json", Body=old)
    with pytest.raises(UsageError, match=f"has format 1.*dfcache --store {url} migrate --endpoint-url"):
        open_store(url, endpoint_url=s3.endpoint).list_manifests()
    res = migrate_store(url, endpoint_url=s3.endpoint)
    assert res.migrated and (res.from_format, res.artifacts, res.unreadable) == (1, 1, [])
    store = open_store(url, endpoint_url=s3.endpoint)
    assert [m.key for m in store.list_manifests()] == [key] and store.verify(key) == []
    assert not migrate_store(url, endpoint_url=s3.endpoint).migrated


_LEASE_HOLDER = """
import sys, time
import numpy as np
from dfcache.store import open_store
store = open_store(sys.argv[1], endpoint_url=sys.argv[2])
w = store.writer(sys.argv[3], stage="conformance", stage_version=1, inputs={})
assert w._staging.lease is not None  # direct mode: it holds the key's lease
w.write_array("x", np.zeros((40, 2), np.float32), chunk_rows=10)
print("HELD", flush=True)
time.sleep(600)
"""


def _lease_holder(s3, url: str, key: str):
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", _LEASE_HOLDER, url, s3.endpoint, key], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, **s3.env})
    assert p.stdout.readline().strip() == "HELD"
    return p


def test_a_lease_of_a_killed_process_of_this_machine_is_taken_over_at_once(s3):
    """A rank killed mid-write leaves its lease; a rerun on the same machine sees that process is
    gone and takes the lease at once instead of waiting LEASE_STALE_S (120 s) for it to go stale."""
    from dfcache.store._s3_lease import LEASE_STALE_S

    url = f"s3://{s3.create_bucket()}/p"
    key = KEY  # inputs={} give it
    holder = _lease_holder(s3, url, key)
    holder.kill()
    holder.wait()
    store = open_store(url, endpoint_url=s3.endpoint)
    t = time.monotonic()
    w = store.writer(key, stage="conformance", stage_version=1, inputs={})
    assert w._staging.lease is not None  # direct mode, the dead holder's leftovers cleared
    w.write_array("x", np.ones((40, 2), np.float32), chunk_rows=10)
    w.commit()
    assert w.won and time.monotonic() - t < LEASE_STALE_S / 4
    assert store.verify(key) == [] and store.open(key).array("x")[:].tobytes() == np.ones((40, 2), np.float32).tobytes()
    assert store.backend.list_temporaries() == []


def test_a_live_holders_lease_is_waited_for_then_taken_when_it_dies(s3):
    import threading

    url = f"s3://{s3.create_bucket()}/p"
    key = KEY  # inputs={} give it
    holder = _lease_holder(s3, url, key)
    try:
        store = open_store(url, endpoint_url=s3.endpoint)
        w = store.writer(key, stage="conformance", stage_version=1, inputs={})
        assert w._staging.lease is None  # the holder runs: this writer uploads aside
        w.write_array("x", np.ones((40, 2), np.float32), chunk_rows=10)
        done = threading.Event()
        th = threading.Thread(target=lambda: (w.commit(), done.set()))
        th.start()
        assert not done.wait(1.5)  # waits while the holder lives
    finally:
        holder.kill()
        holder.wait()
    th.join(30)
    assert done.is_set() and w.won  # taken over once the holder is gone, not after LEASE_STALE_S
    assert store.open(key).array("x")[:].tobytes() == np.ones((40, 2), np.float32).tobytes()


def test_a_lease_from_another_machine_or_container_is_not_taken_over_early(s3):
    """Only a holder of this boot and PID namespace can be looked up; any other lease is dead only
    once stale, whatever its pid."""
    import json

    from dfcache.store._s3_lease import _place, holder_gone

    here = _place()
    assert here, "this test needs /proc (Linux)"
    gone_pid = 2 ** 22 + 12345  # above pid_max's default: no such process
    for other in ({"boot": "0" * 36}, {"pidns": "pid:[1]"}):
        body = json.dumps({"writer": "w", "host": "h", "pid": gone_pid, "n": 0, **here, **other}).encode()
        assert not holder_gone(body)
    assert holder_gone(json.dumps({"writer": "w", "pid": gone_pid, "n": 0, **here}).encode())
    assert not holder_gone(json.dumps({"writer": "w", "pid": os.getpid(), "n": 0, **here}).encode())  # alive
    # the pid runs, but not the process that wrote the lease (it started at another time): reused
    assert holder_gone(json.dumps({"writer": "w", "pid": os.getpid(), "n": 0, **{**here, "start": "1"}}).encode())
    assert not holder_gone(b'{"writer": "w", "host": "h", "pid": 1, "n": 0}')  # an older dfcache's lease
    url = f"s3://{s3.create_bucket()}/p"
    key = "d3" * 16
    body = json.dumps({"writer": "w", "host": "h", "pid": gone_pid, "n": 0, **here, "boot": "0" * 36}).encode()
    s3.client().put_object(Bucket=url.split("/")[2], Key=f"p/locks/{key}.lease", Body=body)
    w = open_store(url, endpoint_url=s3.endpoint).writer(key, stage="conformance", stage_version=1, inputs={})
    assert w._staging.lease is None  # not taken: it may be a live writer elsewhere
    w.abort()
