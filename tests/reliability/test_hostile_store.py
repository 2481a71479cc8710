"""Odd stores and hostile peers (issue 34, the dfcache side), through the command line.

Each case damages a copy of a store (or a remote, or plays a server) the way a new user, a
crash, a shared filesystem or a hostile peer would, runs one `dfcache` command in its own process,
and checks the contract of docs/cli.md: the exit code, one `error:` line naming the thing and the
fix, no traceback, no hang, and a store that is unchanged or repaired by the command the message
names. Kinds covered, each by several cases (further cases of the same kind must take the same
path):

- an open that could block: FIFOs where a store file or a staging area should be;
- a file that is not what its name says: directories, FIFOs and files where a manifest, a chunk,
  the store's own directories or its marker should be; markers that are damaged, huge, of another
  program or of a string format version;
- anything that could read or write outside a `file://` remote: links at its own directories,
  its shard directories and its marker;
- unbounded answers and answers without end from a completions server: endless chunked bodies,
  `Content-Length: 8 GiB`, bodies and headers dripped a byte every 0.5 s, on the readiness
  probe, the model list and the chat endpoint;
- S3: offline (exit 3, never 4), an endpoint with no credentials (no probe of the cloud metadata
  address, no connection at all), an object whose name is no path (exit 5, never the network);
- what `gc` must clean (graves, strays, links: never followed) and what it must report (a
  read-only store: exit 2).

No test depends on timing: a case that would hang without its fix fails at the child's timeout
(two minutes), and a bounded read is shown by the bytes the server managed to send (a count).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from rel_helpers import MAX_NEW, NUM_PROMPTS, artifacts_listing, copy_store
from servers import HostileServer, RecordingListener
from test_bad_input import check_one_message

from dfcache.errors import EXIT_BAD_INPUT, EXIT_INTEGRITY, EXIT_NETWORK, EXIT_OFFLINE_MISSING, EXIT_OK, EXIT_USAGE

assert EXIT_BAD_INPUT == 6  # (the table below uses the other codes; 6 is the runner's)

HOUR_AGO = time.time() - 3600


def art(store: Path, key: str) -> Path:
    return store / "artifacts" / key[:2] / key


def first_chunk(store: Path, key: str) -> Path:
    a = art(store, key)
    return next(p for p in sorted(a.rglob("*")) if "/c/" in "/" + str(p.relative_to(a)) and p.is_file())


def fifo_at(path: Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)


def dir_at(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "junk").write_bytes(b"not a file of dfcache")


def old(path: Path) -> None:
    os.utime(path, (HOUR_AGO, HOUR_AGO), follow_symlinks=False)


@dataclass
class StoreCase:
    id: str
    code: int
    words: list[str]
    argv: Callable[[dict], list]  # ctx -> the command line (``--store`` is added unless given)
    damage: Callable[[dict], None] | None = None
    repair: list = field(default_factory=list)  # command lines (exit 0 each); then `verify` must exit 0
    check: Callable[[dict], None] | None = None  # what must hold afterwards (before any repair)
    absent: list[str] = field(default_factory=list)
    unchanged: bool = True  # artifacts/ as it was after the damage


def _tokens_run(ctx: dict) -> list:
    return ["run", "tokens", *ctx["args"], "--offline"]


def _marker(text: str) -> Callable[[dict], None]:
    def damage(ctx: dict) -> None:
        (ctx["store"] / "dfcache-store.json").write_text(text)
    return damage


def _staging_leftovers(ctx: dict) -> None:
    st = ctx["store"] / "staging"
    k = ctx["keys"]["tokens"]
    grave = st / f"{k}.0123456789ab.deleted"  # a gc or a delete killed before its rmtree finished
    (grave / "doc" / "c").mkdir(parents=True)
    (grave / "doc" / "c" / "0").write_bytes(b"x" * 100)
    (st / f"{k}.ba9876543210.deleted").write_bytes(b"a grave that is a file")
    (st / "stray.tmp").write_bytes(b"a stray temporary file")
    outside = ctx["tmp"] / "outside"
    outside.mkdir()
    (outside / "precious").write_text("must survive gc")
    (st / "link.tmp").symlink_to(outside, target_is_directory=True)  # removed, never followed
    for p in (grave, grave / "doc", st / f"{k}.ba9876543210.deleted", st / "stray.tmp", st / "link.tmp"):
        old(p)
    (st / "fresh.tmp").write_bytes(b"a stray younger than the grace period: kept")


def _check_staging_cleaned(ctx: dict) -> None:
    left = sorted(p.name for p in (ctx["store"] / "staging").iterdir())
    assert left == ["fresh.tmp"], left
    assert (ctx["tmp"] / "outside" / "precious").read_text() == "must survive gc"


def _fifo_in_staging(ctx: dict) -> None:
    fifo_at(ctx["store"] / "staging" / f"{ctx['keys']['tokens']}.0123456789ab.tmp")


def _no_fifo_left(ctx: dict) -> None:
    assert list((ctx["store"] / "staging").iterdir()) == []


def _fifo_chunk_and_no_tokens(ctx: dict) -> None:
    fifo_at(first_chunk(ctx["store"], ctx["keys"]["completions"]))
    shutil.rmtree(art(ctx["store"], ctx["keys"]["tokens"]))


def _artifacts_is_a_file(ctx: dict) -> None:
    shutil.rmtree(ctx["store"] / "artifacts")
    (ctx["store"] / "artifacts").write_text("not a directory")


TYPO = "{tmp}/typo/store"
NO_STORE = ["no dfcache store at {tmp}/typo/store", "the directory does not exist",
            "a store is created by the first command that writes to it"]


def _nothing_created(ctx: dict) -> None:
    assert not (ctx["tmp"] / "typo").exists(), "a mistyped --store was created"


def _sparse_marker(ctx: dict) -> None:
    with open(ctx["store"] / "dfcache-store.json", "r+b") as f:
        f.truncate(3 << 30)  # 3 GB of holes: reading it whole is what must not happen


CASES = [
    # ---- opens that could block (a FIFO)
    StoreCase("staging: a FIFO (gc --dry-run)", EXIT_OK, ["would remove: temporary staging/", "0123456789ab.tmp"],
              lambda c: ["gc", "--dry-run", "--grace", "0"], _fifo_in_staging),
    StoreCase("staging: a FIFO (gc --yes)", EXIT_OK, ["removed: temporary staging/", "0123456789ab.tmp"],
              lambda c: ["gc", "--yes", "--grace", "0"], _fifo_in_staging, check=_no_fifo_left),
    StoreCase("chunk: a FIFO (verify)", EXIT_INTEGRITY, ["is a FIFO (named pipe), not a regular file", "gc --bad --yes",
                                                         "{key_completions}"],
              lambda c: ["verify"], lambda c: fifo_at(first_chunk(c["store"], c["keys"]["completions"])),
              repair=[["gc", "--bad", "--yes"]]),
    StoreCase("chunk: a FIFO (a run that reads it)", EXIT_INTEGRITY,
              ["is a FIFO (named pipe), not a regular file", "dfcache gc --key {key_completions} --yes"],
              _tokens_run, _fifo_chunk_and_no_tokens, repair=[["gc", "--bad", "--yes"]]),
    StoreCase("manifest.json: a FIFO (ls)", EXIT_OK, ["warning: 1 manifest(s) failed validation"],
              lambda c: ["ls"], lambda c: fifo_at(art(c["store"], c["keys"]["tokens"]) / "manifest.json"),
              repair=[["gc", "--bad", "--yes"]]),
    StoreCase("store marker: a FIFO (ls)", EXIT_INTEGRITY,
              ["dfcache-store.json is unreadable", "FIFO (named pipe)", "the store is damaged"],
              lambda c: ["ls"], lambda c: fifo_at(c["store"] / "dfcache-store.json")),
    StoreCase("index/listing: a FIFO (ls)", EXIT_OK, ["3 artifact(s)"],
              lambda c: ["ls"], lambda c: fifo_at(c["store"] / "index" / "listing")),
    # ---- a file that is not what its name says
    StoreCase("manifest.json: a directory (ls)", EXIT_OK, ["warning: 1 manifest(s) failed validation"],
              lambda c: ["ls"], lambda c: dir_at(art(c["store"], c["keys"]["tokens"]) / "manifest.json")),
    StoreCase("manifest.json: a directory (verify)", EXIT_INTEGRITY,
              ["is a directory, not a regular file", "{key_tokens}", "gc --bad --yes"],
              lambda c: ["verify"], lambda c: dir_at(art(c["store"], c["keys"]["tokens"]) / "manifest.json"),
              repair=[["gc", "--bad", "--yes"]]),
    StoreCase("manifest.json: a directory (gc --yes, then gc --bad --yes repairs)", EXIT_OK, ["item(s)"],
              lambda c: ["gc", "--yes"], lambda c: dir_at(art(c["store"], c["keys"]["tokens"]) / "manifest.json"),
              repair=[["gc", "--bad", "--yes"]]),
    # (a segment whose manifest cannot be read holds no samples: a run makes them again beside it,
    # as for any invalid manifest; `verify` reports the damaged one and `gc --bad` removes it)
    StoreCase("manifest.json: a directory (a run recomputes its samples)", EXIT_OK, ["4 computed of 4 samples"],
              _tokens_run, lambda c: dir_at(art(c["store"], c["keys"]["tokens"]) / "manifest.json"),
              repair=[["gc", "--bad", "--yes"]], unchanged=False),
    StoreCase("chunk: a directory (verify)", EXIT_INTEGRITY, ["is a directory, not a regular file", "{key_tokens}"],
              lambda c: ["verify"], lambda c: dir_at(first_chunk(c["store"], c["keys"]["tokens"])),
              repair=[["gc", "--bad", "--yes"]]),
    StoreCase("artifacts/: a regular file (ls)", EXIT_INTEGRITY,
              ["the store {store} is damaged: {store}/artifacts is a regular file, not a directory", "Move it out"],
              lambda c: ["ls"], _artifacts_is_a_file),
    StoreCase("artifacts/: a regular file (verify)", EXIT_INTEGRITY, ["{store}/artifacts is a regular file"],
              lambda c: ["verify"], _artifacts_is_a_file),
    StoreCase("artifacts/: a regular file (run)", EXIT_INTEGRITY, ["{store}/artifacts is a regular file"],
              _tokens_run, _artifacts_is_a_file),
    StoreCase("staging/: a FIFO (gc --yes)", EXIT_INTEGRITY, ["{store}/staging is a FIFO (named pipe), not a directory"],
              lambda c: ["gc", "--yes"], lambda c: (shutil.rmtree(c["store"] / "staging"),
                                                    os.mkfifo(c["store"] / "staging"))),
    # ---- the store marker
    StoreCase("store marker: 3 GB (ls)", EXIT_INTEGRITY, ["dfcache-store.json is unreadable", "65536 bytes", "damaged"],
              lambda c: ["ls"], _sparse_marker),
    StoreCase("store marker: kind of another program (ls)", EXIT_USAGE,
              ["is not a dfcache store", "kind 'zarr-store'"], lambda c: ["ls"],
              _marker('{"format_version": 2, "kind": "zarr-store"}')),
    StoreCase("store marker: format_version \"2\", a string (ls)", EXIT_INTEGRITY,
              ["format_version '2' is not a whole number", "damaged"], lambda c: ["ls"],
              _marker('{"format_version": "2", "kind": "dfcache-store"}'), absent=["Upgrade dfcache"]),
    StoreCase("store marker: format_version 0 (run)", EXIT_USAGE, ["has format 0, older than any"], _tokens_run,
              _marker('{"format_version": 0, "kind": "dfcache-store"}'), absent=["Upgrade dfcache"]),
    # ---- a mistyped --store: said, and nothing created
    StoreCase("mistyped --store (ls)", EXIT_USAGE, NO_STORE, lambda c: ["--store", TYPO, "ls"], check=_nothing_created),
    StoreCase("mistyped --store (verify)", EXIT_USAGE, NO_STORE, lambda c: ["verify", "--store", TYPO],
              check=_nothing_created),
    StoreCase("mistyped --store (gc)", EXIT_USAGE, NO_STORE, lambda c: ["--store", TYPO, "gc", "--dry-run"],
              check=_nothing_created),
    StoreCase("mistyped --store (show)", EXIT_USAGE, NO_STORE, lambda c: ["--store", TYPO, "show", "abc"],
              check=_nothing_created),
    # ---- what gc cleans: graves, strays, links (never followed); a fresh stray waits for its grace period
    StoreCase("staging: graves, strays and a link (gc --yes)", EXIT_OK, ["removed: temporary staging/stray.tmp",
                                                                         "removed: temporary staging/link.tmp"],
              lambda c: ["gc", "--yes"], _staging_leftovers, check=_check_staging_cleaned),
]


def _fmt(text: str, ctx: dict) -> str:
    return text.format(tmp=ctx["tmp"], store=ctx["store"], **{f"key_{s}": k[:12] for s, k in ctx["keys"].items()})


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_odd_store(case: StoreCase, zygote, base_store, tmp_path, figures):
    store = copy_store(base_store, tmp_path / "store")
    ctx = {"store": store, "tmp": tmp_path, "keys": dict(base_store["keys"]), "args": base_store["args"]}
    if case.damage:
        case.damage(ctx)
    before = artifacts_listing(store)
    argv = [_fmt(str(a), ctx) for a in case.argv(ctx)]
    if argv[0] != "--store":
        argv = ["--store", str(store), *argv]
    r = zygote.cli(*argv, timeout=120)
    assert r.code == case.code, f"{case.id}: exit {r.code}, want {case.code}\n{r.out[-2000:]}\n{r.err[-3000:]}"
    check_one_message(r, case.code)
    said = r.out + r.err
    for w in case.words:
        assert _fmt(w, ctx) in said, f"{case.id}: {_fmt(w, ctx)!r} not in:\n{said}"
    for w in case.absent:
        assert _fmt(w, ctx) not in said, f"{case.id}: {w!r} should not be said:\n{said}"
    if case.unchanged:
        assert artifacts_listing(store) == before, f"{case.id}: the store changed"
    if case.check:
        case.check(ctx)
    for fix in case.repair:
        done = zygote.cli("--store", store, *fix, timeout=120)
        assert done.code == 0, f"{case.id}: {fix} exit {done.code}\n{done.err[-2000:]}"
    if case.repair:
        ok = zygote.cli("--store", store, "verify", timeout=120)
        assert ok.code == 0 and " 0 bad" in ok.out, f"{case.id}: not repaired:\n{ok.out}\n{ok.err[-2000:]}"
    figures.record("hostile_store_cases", **{case.id: {"exit": r.code}})


def test_a_fifo_in_place_of_a_sample_index_or_resumable_progress_is_no_index(tmp_path):
    """The per-partition sample index (used from 4096 samples, so not by the table's small store)
    and a resumable writer's staged progress are store files too: a FIFO there reads as absent
    (the index is rebuilt from the manifests, the writer starts over), never as a hang."""
    from dfcache.samples._index import _read_sample_index
    from dfcache.store import open_store

    fifo_at(tmp_path / "index-file")
    assert _read_sample_index(tmp_path / "index-file", "p" * 32) == ({}, None)
    store = open_store(tmp_path / "store")
    staging = store.backend.open_staging("ab" * 16, resumable=True)
    try:
        fifo_at(staging.path / "progress.json")
        assert staging.get("progress.json") is None and staging.size("progress.json") is None
    finally:
        staging.discard()


# ------------------------------------------------------------------------------ a read-only store


def _read_only(src: Path, mnt: Path) -> str | None:
    """``src`` seen read-only at ``mnt``: a read-only bind mount (root), else write bits off
    (a user whose permissions the kernel enforces). None: neither is possible here."""
    mnt.mkdir()
    if os.geteuid() == 0:
        ok = subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True).returncode == 0
        if ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(mnt)], capture_output=True).returncode == 0:
            return "read-only bind mount"
        if ok:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        return None
    mnt.rmdir()
    src.rename(mnt)
    for p in [mnt, *mnt.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)
    return "write permission off"


def test_gc_on_a_read_only_store_is_exit_2_and_changes_nothing(zygote, base_store, tmp_path, figures):
    src = copy_store(base_store, tmp_path / "store")
    left = src / "staging" / f"{base_store['keys']['tokens']}.0123456789ab.tmp"
    left.mkdir()
    (left / "part").write_bytes(b"a crashed writer's staging area")
    old(left)
    mnt = tmp_path / "ro"
    how = _read_only(src, mnt)
    if how is None:
        pytest.skip("no way to make a read-only store here (a bind mount needs root and mount rights)")
    try:
        before = artifacts_listing(mnt)
        for argv in (["gc", "--yes", "--force", "--stage", "completions"], ["gc", "--yes"]):
            r = zygote.cli("--store", mnt, *argv, timeout=120)
            assert r.code == EXIT_USAGE, f"{argv}: exit {r.code}\n{r.err[-3000:]}"
            err = check_one_message(r, EXIT_USAGE)
            assert f"from the store {mnt}" in err and "Make the store writable" in err, err
            assert artifacts_listing(mnt) == before and left.name in os.listdir(mnt / "staging")
        ls = zygote.cli("--store", mnt, "ls", timeout=120)  # reading it still works
        assert ls.code == 0 and "3 artifact(s)" in ls.out, ls.err
    finally:
        if how == "read-only bind mount":
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        else:
            for p in [mnt, *mnt.rglob("*")]:
                if not p.is_symlink():
                    p.chmod(p.stat().st_mode | 0o200)
    figures.record("hostile_store_cases", **{f"gc on a read-only store ({how})": {"exit": EXIT_USAGE}})


# ------------------------------------------------------------------------------ file:// remotes


def _remote_with(base_store, tmp_path, zygote, keys: list[str] | None = None) -> Path:
    root = tmp_path / "remote"
    r = zygote.cli("--store", base_store["path"], "push", f"file://{root}", *(keys or ["--all"]), timeout=120)
    assert r.code == 0, r.err
    return root


def _link_own_dir(name: str) -> Callable[[Path, Path, dict], None]:
    def damage(root: Path, outside: Path, keys: dict) -> None:
        shutil.rmtree(root / name, ignore_errors=True)
        (root / name).symlink_to(outside, target_is_directory=True)
    return damage


def _link_shard(root: Path, outside: Path, keys: dict) -> None:
    shard = root / "artifacts" / keys["tokens"][:2]
    assert not shard.exists()  # (only prompts and completions were pushed)
    shard.symlink_to(outside, target_is_directory=True)


PUSH_THROUGH_LINKS = [("staging", _link_own_dir("staging")), ("artifacts", _link_own_dir("artifacts")),
                      ("locks", _link_own_dir("locks")), ("index", _link_own_dir("index")),
                      ("a shard directory", _link_shard)]


@pytest.mark.parametrize("where,damage", PUSH_THROUGH_LINKS, ids=[w for w, _ in PUSH_THROUGH_LINKS])
def test_push_never_writes_through_a_link_in_a_file_remote(where, damage, zygote, base_store, tmp_path, figures):
    keys = base_store["keys"]
    root = _remote_with(base_store, tmp_path, zygote, [keys["prompts"], keys["completions"]])
    outside = tmp_path / "outside"
    outside.mkdir()
    damage(root, outside, keys)
    r = zygote.cli("--store", base_store["path"], "push", f"file://{root}", "--all", timeout=120)
    assert r.code == EXIT_INTEGRITY, f"{where}: exit {r.code}\n{r.err[-3000:]}"
    err = check_one_message(r, EXIT_INTEGRITY)
    assert "symbolic link" in err and f"file://{root}" in err, err
    assert list(outside.iterdir()) == [], f"{where}: written outside the remote: {list(outside.rglob('*'))}"
    figures.record("hostile_store_cases", **{f"file:// remote: push through a link at {where}": {"exit": r.code}})


def _marker_link(root: Path, tmp: Path) -> None:
    outside = tmp / "marker-outside.json"
    outside.write_bytes((root / "dfcache-store.json").read_bytes())
    (root / "dfcache-store.json").unlink()
    (root / "dfcache-store.json").symlink_to(outside)


def _marker_sparse(root: Path, tmp: Path) -> None:
    with open(root / "dfcache-store.json", "r+b") as f:
        f.truncate(3 << 30)


def _marker_kind(root: Path, tmp: Path) -> None:
    (root / "dfcache-store.json").write_text('{"format_version": 2, "kind": "something-else"}')


REMOTE_MARKERS = [("a link pointing outside", _marker_link, EXIT_INTEGRITY, "is a symbolic link"),
                  ("3 GB", _marker_sparse, EXIT_INTEGRITY, "more than a marker may have"),
                  ("a FIFO", lambda root, tmp: fifo_at(root / "dfcache-store.json"), EXIT_INTEGRITY, "FIFO"),
                  ("of another program", _marker_kind, EXIT_USAGE, "kind 'something-else'")]


@pytest.mark.parametrize("what,damage,code,words", REMOTE_MARKERS, ids=[m[0] for m in REMOTE_MARKERS])
def test_a_file_remote_marker_is_read_bounded_without_links(what, damage, code, words, zygote, base_store, tmp_path,
                                                            figures):
    root = _remote_with(base_store, tmp_path, zygote, [base_store["keys"]["prompts"]])
    damage(root, tmp_path)
    local = tmp_path / "local"
    for argv in (["ls", "--remote", f"file://{root}"], ["pull", f"file://{root}", "--all"]):
        r = zygote.cli("--store", local, *argv, timeout=120)
        assert r.code == code, f"{what} {argv[0]}: exit {r.code}\n{r.err[-3000:]}"
        err = check_one_message(r, code)
        assert words in err and f"file://{root}" in err, err
    assert not local.exists(), "the refused pull created the local store"
    figures.record("hostile_store_cases", **{f"file:// remote: marker that is {what}": {"exit": code}})


# ------------------------------------------------------------------------------ S3


def test_offline_ls_of_an_s3_remote_is_exit_3(zygote, base_store, tmp_path):
    for argv in (["--offline", "ls", "--remote", "s3://bkt/r"], ["pull", "s3://bkt/r", "--all", "--offline"]):
        r = zygote.cli("--store", tmp_path / "local", *argv, timeout=120)
        assert r.code == EXIT_OFFLINE_MISSING, f"{argv}: exit {r.code}\n{r.err}"
        err = check_one_message(r, EXIT_OFFLINE_MISSING)
        assert "offline mode is on" in err and "s3://bkt/r" in err and "HF_HUB_OFFLINE" not in err, err


NO_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SKIP_SIGNATURE",
                  "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                  "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_METADATA_ENDPOINT")


def test_an_s3_endpoint_without_credentials_is_refused_before_any_connection(zygote, base_store, tmp_path, figures):
    """With an endpoint given and no credentials, obstore would ask the cloud metadata address
    for some first. dfcache refuses before the S3 client sends anything: not even the endpoint
    sees a connection. With AWS_SKIP_SIGNATURE=true (the user's choice) it goes, unsigned."""
    with RecordingListener() as endpoint:
        for argv in (["ls", "--remote", "s3://bkt/r"], ["pull", "s3://bkt/r", "--all"]):
            r = zygote.cli("--store", tmp_path / "local", *argv, "--endpoint-url", endpoint.url, unset=NO_CREDENTIALS,
                           timeout=120)
            assert r.code == EXIT_USAGE, f"{argv}: exit {r.code}\n{r.err[-3000:]}"
            err = check_one_message(r, EXIT_USAGE)
            assert "no S3 credentials are set" in err and "AWS_ACCESS_KEY_ID" in err and "AWS_SKIP_SIGNATURE" in err
        assert endpoint.settle() == 0
    with RecordingListener() as endpoint:
        r = zygote.cli("--store", tmp_path / "local", "ls", "--remote", "s3://bkt/r", "--endpoint-url", endpoint.url,
                       unset=NO_CREDENTIALS, env={"AWS_SKIP_SIGNATURE": "true"}, timeout=120)
        assert r.code == EXIT_NETWORK, r.err  # (the listener hangs up)
        assert endpoint.settle() >= 1
    figures.record("hostile_store_cases", **{"s3: endpoint without credentials": {"exit": EXIT_USAGE,
                                                                                  "connections": 0}})


def test_an_object_named_dot_dot_in_a_bucket_is_integrity_not_network(zygote, tmp_path, figures, monkeypatch):
    from s3server import S3Server
    from test_transfer import write_chain

    from dfcache.store import open_store
    from dfcache.transfer import open_remote, push_keys

    with S3Server() as s3:
        bucket = s3.create_bucket()
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        src = open_store(tmp_path / "src")
        keys = write_chain(src, n=1)
        push_keys(src, open_remote(f"s3://{bucket}/r", endpoint_url=s3.endpoint), keys, progress=False)
        k = keys[0]
        s3.client().put_object(Bucket=bucket, Key=f"r/artifacts/{k[:2]}/../../escape/manifest.json", Body=b"{}")
        for argv in (["pull", f"s3://{bucket}/r", "--all"], ["ls", "--remote", f"s3://{bucket}/r"]):
            r = zygote.cli("--store", tmp_path / "local", *argv, "--endpoint-url", s3.endpoint, env=s3.env,
                           timeout=120)
            assert r.code == EXIT_INTEGRITY, f"{argv}: exit {r.code}\n{r.err[-3000:]}"
            err = check_one_message(r, EXIT_INTEGRITY)
            assert "not a valid path" in err and f"r/artifacts/{k[:2]}/../" in err, err
            assert "server is up" not in err and "network" not in err, err
        # a pull of the artifact by its key reads no listing: it works
        r = zygote.cli("--store", tmp_path / "local", "pull", f"s3://{bucket}/r", k, "--endpoint-url", s3.endpoint,
                       env=s3.env, timeout=120)
        assert r.code == 0, r.err
    assert not (tmp_path / "escape").exists()
    figures.record("hostile_store_cases", **{"s3: object named ../../escape/manifest.json": {"exit": EXIT_INTEGRITY}})


# ------------------------------------------------------------------------------ the completions server

# (path, mode, extra run options, words): every case ends in exit 4 with one message, nothing cached
SERVER_CASES = [
    ("/v1/chat/completions", "endless", [], ["went on past", "DFCACHE_MAX_RESPONSE_BYTES"]),
    ("/v1/chat/completions", "huge", [], ["announces 8 GiB (8589934592 bytes)", "was not read further"]),
    ("/v1/chat/completions", "drip", ["--request-timeout", "3"],
     ["got only part of its answer within 3 s", "--request-timeout"]),
    ("/v1/chat/completions", "drip-head", ["--request-timeout", "3"], ["got no answer within 3 s"]),
    ("/health", "endless", [], ["/health", "went on past"]),
    ("/health", "huge", [], ["/health", "announces 8 GiB"]),
    ("/health", "drip", ["--wait-server", "2"], ["not ready after waiting 2 s", "/health"]),
    ("/v1/models", "endless", [], ["/v1/models", "went on past"]),
    ("/v1/models", "huge", [], ["/v1/models", "announces 8 GiB"]),
]


@pytest.mark.parametrize("path,mode,extra,words", SERVER_CASES, ids=[f"{p} {m}" for p, m, _, _ in SERVER_CASES])
def test_a_hostile_completions_server_is_bounded(path, mode, extra, words, zygote, base_store, tiny_target, tmp_path,
                                                 figures):
    store = copy_store(base_store, tmp_path / "store")
    before = artifacts_listing(store)
    with HostileServer({path: mode}) as server:
        r = zygote.cli("--store", store, "run", "tokens", "--target", tiny_target, "--server", server.url,
                       "--num-prompts", NUM_PROMPTS, "--max-new-tokens", MAX_NEW + 1, "--concurrency", "1", *extra,
                       timeout=120)
        sent = server.sent.get(path, 0)
    assert r.code == EXIT_NETWORK, f"{path} {mode}: exit {r.code}\n{r.err[-3000:]}"
    err = check_one_message(r, EXIT_NETWORK)
    for w in words:
        assert w in err, f"{path} {mode}: {w!r} not in:\n{err}"
    assert "MemoryError" not in err and "internal error" not in err
    # What the client took before it stopped: the bound (16 MiB for these answers, 4 MiB and a bit for a
    # generation of 9 tokens) plus the sockets' buffers. Without a bound it was gigabytes.
    assert sent < 64 << 20, f"{path} {mode}: the server sent {sent} bytes before the client stopped"
    assert artifacts_listing(store) == before
    figures.record("hostile_store_cases", **{f"server: {path} {mode}": {"exit": r.code, "bytes_sent": sent}})


def test_max_response_bytes_can_be_raised_and_is_checked(zygote, base_store, tiny_target, tmp_path):
    store = copy_store(base_store, tmp_path / "store")
    with HostileServer({"/v1/chat/completions": "ok"}) as server:
        args = ["--store", store, "run", "tokens", "--target", tiny_target, "--server", server.url, "--num-prompts",
                NUM_PROMPTS, "--max-new-tokens", MAX_NEW + 1]
        bad = zygote.cli(*args, env={"DFCACHE_MAX_RESPONSE_BYTES": "lots"}, timeout=120)
        assert bad.code == EXIT_USAGE and "DFCACHE_MAX_RESPONSE_BYTES='lots'" in bad.err, bad.err
        ok = zygote.cli(*args, "--json", env={"DFCACHE_MAX_RESPONSE_BYTES": "1MiB"}, timeout=120)
    assert ok.code == 0, ok.err
    assert json.loads(ok.out)["computed"], ok.out
