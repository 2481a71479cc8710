"""push / pull / status between a local store and a remote: a real S3 server (moto_server) and a
``file://`` directory, through the Python API and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cli_util import dfcache  # noqa: E402
from s3server import S3Server, s3_in_env  # noqa: E402

from dfcache.errors import (IntegrityError, NetworkError, OfflineModeIsEnabled,  # noqa: E402
                            UntrustedManifestError, UsageError)
from dfcache.keys import compute_key  # noqa: E402
from dfcache.store import open_store  # noqa: E402
from dfcache.transfer import compare, list_remote, open_remote, pull_keys, push_keys, select_keys  # noqa: E402

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def s3():
    with s3_in_env() as server:
        yield server


class Remote:
    """One remote under test, with the hooks that damage it behind dfcache's back."""

    def __init__(self, kind: str, url: str, s3: S3Server | None = None, root: Path | None = None) -> None:
        self.kind, self.url, self.s3, self.root = kind, url, s3, root

    @property
    def endpoint(self) -> str | None:
        return self.s3.endpoint if self.s3 else None

    def open(self, **kw):
        return open_remote(self.url, endpoint_url=self.endpoint, **kw)

    def _obj(self, key: str, rel: str) -> str:
        return f"r/artifacts/{key[:2]}/{key}/{rel}"

    def read(self, key: str, rel: str) -> bytes:
        if self.s3:
            return self.s3.client().get_object(Bucket=self.bucket, Key=self._obj(key, rel))["Body"].read()
        return (self.root / "artifacts" / key[:2] / key / rel).read_bytes()

    def write(self, key: str, rel: str, data: bytes) -> None:
        if self.s3:
            self.s3.client().put_object(Bucket=self.bucket, Key=self._obj(key, rel), Body=data)
        else:
            (self.root / "artifacts" / key[:2] / key / rel).write_bytes(data)

    @property
    def bucket(self) -> str:
        return self.url.split("/")[2]


@pytest.fixture(params=["s3", "file"])
def remote(request, tmp_path):
    if request.param == "s3":
        s3 = request.getfixturevalue("s3")
        return Remote("s3", f"s3://{s3.create_bucket()}/r", s3=s3)
    root = tmp_path / "remote"
    return Remote("file", f"file://{root}", root=root)


def bf16(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(ml_dtypes.bfloat16)


def write_chain(store, n: int = 3, seed: int = 0) -> list[str]:
    """n artifacts, each listing the previous one as upstream (like tokens → hidden states)."""
    keys: list[str] = []
    for i in range(n):
        upstream = {"prev": keys[-1]} if keys else {}
        inputs = {"i": i, "seed": seed}
        key = compute_key("chain", 1, inputs, upstream)
        with store.writer(key, stage="chain", stage_version=1, inputs=inputs, upstream=upstream,
                          summary=f"link {i}") as w:
            w.write_array("hidden", bf16(90 + 10 * i, 8, seed * 10 + i), chunk_rows=32,
                          codec="zstd" if i % 2 else "none")
            w.write_array("ids", np.arange(50, dtype=np.int32) + i, chunk_rows=16)
            w.put_json("meta", {"i": i})
        keys.append(key)
    return keys


def no_leftovers(store) -> bool:
    return store.list_manifests() == [] and list((store.backend.root / "staging").iterdir()) == []


# ------------------------------------------------------------------------------ API


def test_push_chain_pull_roundtrip_and_nothing_twice(remote, tmp_path):
    a = open_store(tmp_path / "a")
    keys = write_chain(a)
    r = remote.open()
    res = push_keys(a, r, [keys[-1]], progress=False)
    assert sorted(res.transferred) == sorted(keys) and res.skipped == [] and res.bytes > 0
    assert res.transferred.index(keys[0]) < res.transferred.index(keys[2]) or len(res.transferred) == 3
    cmp = compare(a, r)
    assert cmp.only_local == [] and cmp.only_remote == [] and sorted(m.key for m in cmp.both) == sorted(keys)

    b = open_store(tmp_path / "b")
    res = pull_keys(r, b, [keys[-1]], progress=False)
    assert sorted(res.transferred) == sorted(keys)
    for k in keys:
        assert a.backend.read_manifest(k) == b.backend.read_manifest(k)  # byte-identical manifests
        for name in ("hidden", "ids"):
            x, y = a.open(k).array(name)[:], b.open(k).array(name)[:]
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
        assert b.verify(k) == []
    assert [m.to_dict() for m in a.list_manifests()] == [m.to_dict() for m in b.list_manifests()]
    assert [m.to_dict() for m in list_remote(remote.url, endpoint_url=remote.endpoint)] == \
        [m.to_dict() for m in a.list_manifests()]

    again = push_keys(a, r, keys, progress=False)
    assert again.transferred == [] and sorted(again.skipped) == sorted(keys) and again.bytes == 0
    again = pull_keys(r, b, [keys[-1]], progress=False)
    assert again.transferred == [] and again.bytes == 0


def test_pull_without_upstream_takes_only_the_key(remote, tmp_path):
    a = open_store(tmp_path / "a")
    keys = write_chain(a)
    r = remote.open()
    push_keys(a, r, [keys[-1]], progress=False, jobs=2)
    b = open_store(tmp_path / "b")
    res = pull_keys(r, b, [keys[-1]], with_upstream=False, progress=False)
    assert res.transferred == [keys[-1]] and [m.key for m in b.list_manifests()] == [keys[-1]]


def test_corrupt_remote_object_commits_nothing(remote, tmp_path):
    a = open_store(tmp_path / "a")
    keys = write_chain(a)
    r = remote.open()
    push_keys(a, r, [keys[-1]], progress=False)
    good = remote.read(keys[1], "hidden/c/1/0")
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    remote.write(keys[1], "hidden/c/1/0", bytes(bad))

    b = open_store(tmp_path / "b")
    with pytest.raises(IntegrityError, match="chunk 1 of array hidden") as e:
        pull_keys(r, b, [keys[1]], with_upstream=False, progress=False)
    assert e.value.exit_code == 5
    assert no_leftovers(b)

    with pytest.raises(IntegrityError):
        pull_keys(r, b, [keys[-1]], progress=False, jobs=1)
    assert not b.has(keys[1])
    assert all(b.verify(m.key) == [] for m in b.list_manifests())
    assert list((b.backend.root / "staging").iterdir()) == []


def test_corrupt_local_artifact_is_not_pushed(remote, tmp_path):
    a = open_store(tmp_path / "a")
    keys = write_chain(a, n=1)
    path = a.backend.local_file_path(keys[0], "blobs/meta.json")
    path.write_bytes(path.read_bytes().replace(b"0", b"7"))
    r = remote.open()
    with pytest.raises(IntegrityError, match="document meta"):
        push_keys(a, r, keys, progress=False)
    assert r.list_manifests() == []


def test_hostile_manifests_refused_before_any_local_write(remote, tmp_path):
    a = open_store(tmp_path / "a")
    key = write_chain(a, n=1)[0]
    r = remote.open()
    push_keys(a, r, [key], progress=False)
    original = json.loads(remote.read(key, "manifest.json"))
    b = open_store(tmp_path / "b")
    for attack in ["array ../x", "array /abs", "array blobs", "blob ../../escape", "key ../x", "upstream ../x"]:
        m = json.loads(json.dumps(original))
        what, bad = attack.split(" ")
        if what == "array":
            m["arrays"][bad] = m["arrays"].pop("hidden")
        elif what == "blob":
            m["blobs"][bad] = m["blobs"].pop("meta")
        elif what == "key":
            m["key"] = bad
        else:
            m["upstream"] = {"prev": bad}
        remote.write(key, "manifest.json", json.dumps(m).encode())
        with pytest.raises(UntrustedManifestError) as e:
            pull_keys(r, b, [key], progress=False)
        assert e.value.exit_code == 5, attack
        assert no_leftovers(b), attack
    assert not (tmp_path / "x").exists() and not (tmp_path / "escape.json").exists()


def test_pull_key_that_is_not_a_key_is_usage_error(remote, tmp_path):
    a = open_store(tmp_path / "a")
    push_keys(a, remote.open(), write_chain(a, n=1), progress=False)
    with pytest.raises(UsageError):
        pull_keys(remote.open(), open_store(tmp_path / "b"), ["../" + "0" * 29], progress=False)


def test_symlinks_in_file_remote_are_refused(tmp_path):
    a = open_store(tmp_path / "a")
    keys = write_chain(a, n=2)
    root = tmp_path / "remote"
    r = open_remote(f"file://{root}")
    push_keys(a, r, keys, progress=False)
    art = root / "artifacts" / keys[0][:2] / keys[0]
    # A link to a byte-identical copy: digests would pass, so only the link itself can be refused.
    outside = tmp_path / "outside.bin"
    outside.write_bytes((art / "hidden" / "c" / "0" / "0").read_bytes())
    (art / "hidden" / "c" / "0" / "0").unlink()
    (art / "hidden" / "c" / "0" / "0").symlink_to(outside)
    b = open_store(tmp_path / "b")
    with pytest.raises(IntegrityError, match="symbolic link"):
        pull_keys(open_remote(f"file://{root}"), b, [keys[0]], progress=False)
    assert no_leftovers(b)

    # A whole artifact directory that is a link, reached through the runner's plain open_store.
    art1 = root / "artifacts" / keys[1][:2] / keys[1]
    moved = tmp_path / "elsewhere"
    art1.rename(moved)
    art1.symlink_to(moved, target_is_directory=True)
    with pytest.raises(IntegrityError, match="symbolic link"):
        pull_keys(open_store(f"file://{root}"), b, [keys[1]], with_upstream=False, progress=False)
    assert no_leftovers(b)


def test_offline_refuses_s3_but_allows_file(s3, tmp_path, monkeypatch):
    a = open_store(tmp_path / "a")
    keys = write_chain(a, n=1)
    url = f"s3://{s3.create_bucket()}/r"
    s3_store = open_remote(url, endpoint_url=s3.endpoint)  # opened online, used offline below
    monkeypatch.setenv("DFCACHE_OFFLINE", "1")
    with pytest.raises(OfflineModeIsEnabled, match="offline mode is on"):
        open_remote(url, endpoint_url=s3.endpoint)
    with pytest.raises(OfflineModeIsEnabled):
        push_keys(a, s3_store, keys, progress=False)
    with pytest.raises(OfflineModeIsEnabled):
        pull_keys(s3_store, open_store(tmp_path / "b"), keys, progress=False)
    r = open_remote(f"file://{tmp_path / 'remote'}")
    assert push_keys(a, r, keys, progress=False).transferred == keys
    assert pull_keys(r, open_store(tmp_path / "c"), keys, progress=False).transferred == keys
    monkeypatch.delenv("DFCACHE_OFFLINE")
    with pytest.raises(OfflineModeIsEnabled):
        push_keys(a, s3_store, keys, progress=False, offline=True)  # the --offline flag


def test_remote_by_configured_name(tmp_path, monkeypatch):
    root = tmp_path / "team-remote"
    cfg = tmp_path / "dfcache.toml"
    cfg.write_text(f'[remote.team]\nurl = "file://{root}"\n')
    monkeypatch.setenv("DFCACHE_CONFIG", str(cfg))
    a = open_store(tmp_path / "a")
    keys = write_chain(a, n=2)
    assert sorted(push_keys(a, open_remote("team"), keys[-1:], progress=False).transferred) == sorted(keys)
    assert sorted(m.key for m in list_remote("team")) == sorted(keys)
    with pytest.raises(UsageError, match="neither a URL nor a configured remote"):
        open_remote("nosuchremote")


def test_select_keys(tmp_path):
    a = open_store(tmp_path / "a")
    keys = write_chain(a)
    assert select_keys(a, [keys[0][:10]]) == [keys[0]]
    assert sorted(select_keys(a, all_keys=True)) == sorted(keys)
    assert sorted(select_keys(a, stage="chain")) == sorted(keys) and select_keys(a, stage="other") == []
    with pytest.raises(UsageError, match="--all"):
        select_keys(a, [])


def test_server_stopped_mid_pull_is_network_error_and_leaves_nothing(tmp_path, monkeypatch):
    with S3Server() as server:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        url = f"s3://{server.create_bucket()}/r"
        key = compute_key("big", 1, {})
        with open_store(url, endpoint_url=server.endpoint).writer(key, stage="big", stage_version=1, inputs={}) as w:
            w.write_array("hidden", bf16(60 * 8, 16, 0), chunk_rows=8)
        r = open_remote(url, endpoint_url=server.endpoint)
        b = open_store(tmp_path / "b")
        staging = b.backend.root / "staging"
        outcome: list = []

        def pull():
            try:
                outcome.append(pull_keys(r, b, [key], progress=False, jobs=1))
            except Exception as e:
                outcome.append(e)

        # Kill the server once the pull has staged a file, not before, and before it goes on:
        # the pull waits at its first staged file until the server is dead.
        from dfcache.store import _directory

        staged, killed = threading.Event(), threading.Event()
        real_put = _directory._DirectoryStaging.put

        def put(self, relpath, data):
            n = real_put(self, relpath, data)
            if not staged.is_set():
                staged.set()
                assert killed.wait(120), "the server was never killed"
            return n

        monkeypatch.setattr(_directory._DirectoryStaging, "put", put)
        t = threading.Thread(target=pull)
        t.start()
        assert staged.wait(120), outcome
        assert any(p.is_file() for p in staging.rglob("*"))
        server.kill()
        killed.set()
        t.join(120)
    assert len(outcome) == 1 and isinstance(outcome[0], NetworkError), outcome
    assert outcome[0].exit_code == 4 and url in str(outcome[0])
    assert no_leftovers(b)


# ------------------------------------------------------------------------------ command line


def test_cli_push_status_pull_exit_codes(s3, tmp_path):
    remote = Remote("s3", f"s3://{s3.create_bucket()}/r", s3=s3)
    a = open_store(tmp_path / "a")
    keys = write_chain(a)
    # The endpoint as users set it, not a flag; faulthandler names the thread if a run ever crashes.
    env = {"AWS_ENDPOINT_URL": s3.endpoint, "PYTHONFAULTHANDLER": "1"}
    res = dfcache("push", remote.url, keys[-1][:12], store=tmp_path / "a", env=env)
    assert res.code == 0, res.err
    assert "pushed 3 artifact(s)" in res.out and "0 already there" in res.out

    res = dfcache("status", remote.url, "--json", store=tmp_path / "a", env=env)
    assert res.code == 0, res.err
    st = json.loads(res.out)
    assert st["only_local"] == [] and st["only_remote"] == [] and len(st["both"]) == 3

    res = dfcache("pull", remote.url, "--stage", "chain", "--json", store=tmp_path / "b", env=env)
    assert res.code == 0, res.err
    assert sorted(json.loads(res.out)["transferred"]) == sorted(keys)

    bad = bytearray(remote.read(keys[0], "hidden/c/0/0"))
    bad[-1] ^= 0xFF
    remote.write(keys[0], "hidden/c/0/0", bytes(bad))
    res = dfcache("pull", remote.url, keys[0], store=tmp_path / "c", env=env)
    assert res.code == 5 and "crc32c" in res.err and "Traceback" not in res.err


def test_cli_network_offline_and_usage_exit_codes(s3, tmp_path):
    from servers import ClosedPort

    a = open_store(tmp_path / "a")
    keys = write_chain(a, n=1)
    with ClosedPort() as closed:  # held bound: no other test's server can take the port meanwhile
        res = dfcache("push", "s3://bkt/r", keys[0], "--endpoint-url", closed.url, store=tmp_path / "a")
    assert res.code == 4 and "connection refused" in res.err and "s3://bkt/r" in res.err
    res = dfcache("pull", f"s3://{s3.create_bucket()}/r", "--all", "--offline", store=tmp_path / "b",
                  env={"AWS_ENDPOINT_URL": s3.endpoint})
    assert res.code == 3 and "offline" in res.err and "HF_HUB_OFFLINE" not in res.err  # offline: 3, never 4
    remote = f"file://{tmp_path / 'remote'}"
    res = dfcache("--offline", "push", remote, keys[0], store=tmp_path / "a")
    assert res.code == 0 and "pushed 1 artifact(s)" in res.out
    res = dfcache("push", remote, "--all", store=tmp_path / "a")
    assert res.code == 0 and "pushed 0 artifact(s)" in res.out and "1 already there" in res.out
    res = dfcache("push", remote, store=tmp_path / "a")
    assert res.code == 2 and "--all" in res.err


def test_the_executable_never_finalizes_once_obstore_is_loaded(tmp_path):
    """obstore's tokio threads may release Python objects during interpreter finalization, which
    aborts the process after its output (a refused-connection push exited -6 instead of 4 once in
    a loaded CI run). With obstore loaded, exit_process runs the exit functions, flushes and ends
    without finalizing: an object's __del__ that finalization would run never runs, the exit code
    and the buffered output are kept. Without obstore, the interpreter exits normally."""
    code = textwrap.dedent("""\
        import atexit, sys
        {load}
        from dfcache.__main__ import exit_process

        class Finalized:
            def __del__(self):
                sys.stderr.write("finalized\\n")
        keep = Finalized()
        atexit.register(lambda: sys.stderr.write("exit functions ran\\n"))
        sys.stdout.write("buffered output")  # no newline: still in the buffer
        exit_process(4)
        """)
    for load, finalizes in (("import obstore", False), ("", True)):
        res = subprocess.run([sys.executable, "-c", code.format(load=load)], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert res.returncode == 4, res.stderr
        assert res.stdout == "buffered output"
        assert "exit functions ran" in res.stderr
        assert ("finalized" in res.stderr) is finalizes, (load, res.stderr)


# ------------------------------------------------------------------------------ per sample


def _per_sample_chain(store, prompts_n: int, hs_from: int, hs_to: int, *, max_samples: int = 100):
    """Prompt samples (a root partition) and hidden-state samples made from them."""
    from dfcache.samples import Partition, SampleArray, SampleSink, record_digest

    pp = Partition("prompts", 2, {})
    hp = Partition("hidden_states", 2, {"layer": 1}, upstream={"sample": pp.key})
    digests = [record_digest({"p": i}) for i in range(prompts_n)]
    with SampleSink(store, pp, max_samples=max_samples) as sink:
        for d in digests:
            sink.add(d, doc={"d": d})
    pkeys = pp.sample_keys(digests)
    with SampleSink(store, hp, arrays={"hidden": SampleArray((4,), "bfloat16")}, doc=False,
                    max_samples=max_samples) as sink:
        for k in pkeys[hs_from:hs_to]:
            rng = np.random.default_rng(int(k[:8], 16))
            sink.add(k, {"hidden": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)})
    return pp, hp, pkeys


def test_cli_status_push_pull_per_sample(remote, tmp_path):
    from dfcache.samples import SampleSet

    env = {"AWS_ENDPOINT_URL": remote.endpoint} if remote.endpoint else {}
    a = open_store(tmp_path / "a")
    pp, hp, pkeys = _per_sample_chain(a, 10, 0, 10, max_samples=5)  # 10 states in 2 segments of 5
    # The remote holds 6 of the states (in one segment of its own) and none of the prompts.
    from dfcache.samples import SampleArray, SampleSink

    r = remote.open(create=True)

    with SampleSink(r, hp, arrays={"hidden": SampleArray((4,), "bfloat16")}, doc=False) as sink:
        for k in pkeys[:6]:
            rng = np.random.default_rng(int(k[:8], 16))
            sink.add(k, {"hidden": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)})

    res = dfcache("status", remote.url, "--json", store=tmp_path / "a", env=env)
    assert res.code == 0, res.err
    rows = {x["stage"]: x for x in json.loads(res.out)["samples"]}
    assert (rows["hidden_states"]["only_local"], rows["hidden_states"]["only_remote"], rows["hidden_states"]["both"]) \
        == (4, 0, 6)
    assert (rows["prompts"]["only_local"], rows["prompts"]["both"]) == (10, 0)

    # Push the states: the 4 the remote lacks move (not the 2 local segments whole), with their prompts.
    res = dfcache("push", remote.url, "--stage", "hidden_states", "--json", store=tmp_path / "a", env=env)
    assert res.code == 0, res.err
    s = json.loads(res.out)["samples"]
    assert (s["present"], s["copied"], s["missing"]) == (6, 14, [])  # 4 states + 10 prompts
    r = remote.open()
    hkeys = hp.sample_keys(pkeys)
    assert SampleSet(r, hp.key, hkeys).read_many("hidden", raw=True)[9].tobytes() == \
        SampleSet(a, hp.key, hkeys).read_many("hidden", raw=True)[9].tobytes()
    assert len(SampleSet(r, pp.key, pkeys)) == 10
    from dfcache.sample_transfer import compare_samples

    assert {x["stage"]: x["only_local"] for x in compare_samples(a, remote.open())} == \
        {"prompts": 0, "hidden_states": 0}

    # Pull only the states (no upstream) into a machine that has 3 of them.
    b = open_store(tmp_path / "b")
    _per_sample_chain(b, 10, 0, 3)
    res = dfcache("pull", remote.url, "--stage", "hidden_states", "--no-upstream", store=tmp_path / "b", env=env)
    assert res.code == 0, res.err
    assert "pulled 7 sample(s)" in res.out and "already there" in res.out, res.out
    b = open_store(tmp_path / "b")
    assert [bytes(x) for x in SampleSet(b, hp.key, hkeys).read_many("hidden", raw=True)] == \
        [bytes(x) for x in SampleSet(a, hp.key, hkeys).read_many("hidden", raw=True)]
