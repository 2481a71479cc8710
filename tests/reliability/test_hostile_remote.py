"""A hostile or broken remote, systematically: every attack is refused (exit 5) before anything
unverified is written locally, over both a real S3 server (moto) and a ``file://`` directory.

Manifest-level attacks (paths in names and keys, absurd shapes and sizes, lying digests) are
refused while planning: no staging area is even opened. Content-level attacks (bytes that do
not match the manifest, oversized files, decompression bombs) are refused file by file before
the file is staged; the staging area is dropped and nothing is published. Symbolic links in a
``file://`` remote are refused, never followed. Helpers come from tests/test_transfer.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import google_crc32c
import numpy as np
import pytest
from rel_helpers import artifacts_listing, copy_store
from test_transfer import Remote, no_leftovers, s3, write_chain  # noqa: F401  (s3 is a fixture)

from dfcache.errors import IntegrityError, UntrustedManifestError
from dfcache.store import open_store
from dfcache.transfer import open_remote, pull_keys, push_keys

# ------------------------------------------------------------------------------ manifest attacks


def _rename_array(new: str) -> Callable[[dict], None]:
    def f(m):
        m["arrays"][new] = m["arrays"].pop("hidden")
    return f


def _rename_blob(new: str) -> Callable[[dict], None]:
    def f(m):
        m["blobs"][new] = m["blobs"].pop("meta")
    return f


def _set(path: str, value) -> Callable[[dict], None]:
    def f(m):
        *head, last = path.split(".")
        d = m
        for p in head:
            d = d[p]
        d[last] = value(d[last]) if callable(value) else value
    return f


def _huge_shape(m):
    a = m["arrays"]["hidden"]
    a["shape"] = [1 << 39, 1 << 20]
    a["nbytes"] = (1 << 39) * (1 << 20) * 2


def _huge_chunks(m):
    a = m["arrays"]["hidden"]
    a["chunk_rows"] = 1 << 30  # one chunk of 2^30 rows x 8 bf16 = 16 GiB, for a 90-row array


def _lying_array_digest(m):
    m["arrays"]["hidden"]["digest"] = "0" * 32


MANIFEST_ATTACKS = [
    ("array name ../x", _rename_array("../x")),
    ("array name /abs", _rename_array("/abs")),
    ("array name ..", _rename_array("..")),
    ("array name a/b", _rename_array("a/b")),
    ("array name blobs (layout collision)", _rename_array("blobs")),
    ("array name manifest.json (layout collision)", _rename_array("manifest.json")),
    ("blob name ../../escape", _rename_blob("../../escape")),
    ("blob name /etc/passwd", _rename_blob("/etc/passwd")),
    ("key field ../x", _set("key", "../x")),
    ("key field of another artifact", _set("key", "f" * 32)),
    ("upstream ../x", _set("upstream", {"prev": "../x"})),
    ("stage ../x", _set("stage", "../x")),
    ("absurd shape (2^59 bytes)", _huge_shape),
    ("negative shape", _set("arrays.hidden.shape", [-90, 8])),
    ("nine dimensions", _set("arrays.hidden.shape", [90] + [1] * 8)),
    ("nbytes lies", _set("arrays.hidden.nbytes", 16)),
    ("chunk_rows 0", _set("arrays.hidden.chunk_rows", 0)),
    ("16 GiB chunks", _huge_chunks),
    ("chunk digest missing", _set("arrays.hidden.chunk_digests", lambda v: v[:-1])),
    ("array digest not over its chunks", _lying_array_digest),
    ("blob of 2^40 bytes", _set("blobs.meta.nbytes", 1 << 40)),
    ("dtype object", _set("arrays.hidden.dtype", "object")),
    ("codec pickle", _set("arrays.hidden.codec", "pickle")),
    ("negative size_bytes", _set("size_bytes", -1)),
    ("format_version 99", _set("format_version", 99)),
    ("manifest is a list", lambda m: "LIST"),
    ("manifest is not JSON", lambda m: "GARBAGE"),
]

# ------------------------------------------------------------------------------ content attacks


def _flip_keep_crc(data: bytes) -> bytes:
    """A changed chunk whose crc32c is recomputed: only the manifest's digest can catch it."""
    body = bytearray(data[:-4])
    body[len(body) // 2] ^= 0x40
    return bytes(body) + google_crc32c.extend(0, bytes(body)).to_bytes(4, "little")


def _zstd_bomb(_data: bytes) -> bytes:
    import numcodecs

    body = numcodecs.Zstd(level=1).encode(np.zeros(64 << 20, np.uint8))  # claims 64 MiB, is a few KB
    body = bytes(body)
    return body + google_crc32c.extend(0, body).to_bytes(4, "little")


CONTENT_ATTACKS = [
    # (id, which link of the chain (0: plain, 1: zstd), file, how its bytes are replaced, words)
    ("chunk bytes differ, crc recomputed", 0, "hidden/c/1/0", _flip_keep_crc, "does not match its digest"),
    ("chunk bit flip", 0, "hidden/c/0/0", lambda d: d[:5] + bytes([d[5] ^ 1]) + d[6:], "crc32c"),
    ("chunk truncated", 0, "hidden/c/2/0", lambda d: d[: len(d) // 3], "chunk 2 of array hidden"),
    ("chunk larger than its manifest allows", 0, "ids/c/0", lambda d: d + b"\0" * 4096, "its manifest allows"),
    ("zstd bomb (claims 64 MiB)", 1, "hidden/c/0/0", _zstd_bomb, "declares 67108864 decompressed bytes"),
    ("zarr.json of 2 MB", 0, "hidden/zarr.json", lambda d: d + b" " * (2 << 20), "its manifest allows"),
    ("zarr.json disagrees with the manifest", 0, "hidden/zarr.json",
     lambda d: json.dumps({**json.loads(d), "shape": [91, 8]}).encode(), "disagrees with the manifest"),
    ("group zarr.json is not zarr", 0, "zarr.json", lambda d: b'{"hello": 1}', "not zarr v3 metadata"),
    ("document differs", 0, "blobs/meta.json", lambda d: d.replace(b"0", b"1"), "document meta"),
    ("chunk missing", 0, "hidden/c/1/0", None, "missing"),
]


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    src = open_store(tmp_path_factory.mktemp("hostile") / "src")
    return src, write_chain(src, n=2)


# Manifest validation is the same code for every backend; over S3 the table runs these (paths
# in names and keys, an absurd size, garbage) and every content attack, which is where reading
# differs; over file:// it runs everything.
S3_MANIFEST_ATTACKS = {"array name ../x", "array name /abs", "blob name ../../escape", "key field ../x",
                       "upstream ../x", "absurd shape (2^59 bytes)", "manifest is not JSON"}


def make_remote(kind: str, request, chain, tmp_path) -> tuple[Remote, list[str]]:
    """The chain pushed to a new remote of that kind."""
    src, keys = chain
    if kind == "s3":
        server = request.getfixturevalue("s3")
        remote = Remote("s3", f"s3://{server.create_bucket()}/r", s3=server)
    else:
        root = tmp_path / "remote"
        remote = Remote("file", f"file://{root}", root=root)
    push_keys(src, remote.open(), keys, progress=False)
    return remote, keys


@pytest.fixture(params=["s3", "file"])
def fresh_remote(request, chain, tmp_path):
    return make_remote(request.param, request, chain, tmp_path)


class Recorder:
    """Wraps a local store's backend: every staging area opened and every file staged."""

    def __init__(self, store) -> None:
        self.opened: list[str] = []
        self.staged: list[str] = []
        backend = store.backend
        real_open = backend.open_staging

        def open_staging(key, resumable=False):
            self.opened.append(key)
            staging = real_open(key, resumable)
            real_put = staging.put

            def put(rel, data):
                self.staged.append(rel)
                return real_put(rel, data)

            staging.put = put
            return staging

        backend.open_staging = open_staging


def _pull(remote: Remote, tmp_path: Path, key: str, **kw):
    local = open_store(tmp_path / "local")
    rec = Recorder(local)
    with pytest.raises(IntegrityError) as e:  # UntrustedManifestError is an IntegrityError
        pull_keys(remote.open(), local, [key], progress=False, **kw)
    assert e.value.exit_code == 5
    assert no_leftovers(local), "a refused pull left something in the local store"
    return e.value, rec


MANIFEST_CASES = [(a, "file") for a in MANIFEST_ATTACKS] + [(a, "s3") for a in MANIFEST_ATTACKS
                                                            if a[0] in S3_MANIFEST_ATTACKS]


@pytest.mark.parametrize("attack,kind", MANIFEST_CASES, ids=[f"{k}-{a[0]}" for a, k in MANIFEST_CASES])
def test_hostile_manifest_is_refused_before_any_local_write(attack, kind, request, chain, tmp_path, figures):
    name, mutate = attack
    remote, keys = make_remote(kind, request, chain, tmp_path)
    key = keys[0]
    m = json.loads(remote.read(key, "manifest.json"))
    out = mutate(m)
    raw = {"LIST": b"[1, 2]", "GARBAGE": b"\x00not json"}.get(out) or json.dumps(m).encode()
    remote.write(key, "manifest.json", raw)
    err, rec = _pull(remote, tmp_path, key, with_upstream=False)
    assert isinstance(err, UntrustedManifestError), f"{name}: {type(err).__name__}: {err}"
    assert rec.opened == [], f"{name}: a staging area was opened before the manifest was refused"
    assert key in str(err)
    # the same refusal through a pull of an artifact that lists it as upstream
    err2, rec2 = _pull(remote, tmp_path / "up", keys[1])
    assert rec2.opened == []
    assert not any(p.name in ("x", "abs", "escape.json", "passwd.json") for p in tmp_path.rglob("*")), name
    figures.record("hostile_remote_cases", **{f"manifest: {name} ({remote.kind})": "refused before any write"})


@pytest.mark.parametrize("attack", CONTENT_ATTACKS, ids=[a[0] for a in CONTENT_ATTACKS])
def test_hostile_bytes_are_refused_before_they_are_staged(attack, fresh_remote, tmp_path, figures):
    name, link, rel, change, words = attack
    remote, keys = fresh_remote
    key = keys[link]
    if change is None:
        if remote.s3:
            remote.s3.client().delete_object(Bucket=remote.bucket, Key=remote._obj(key, rel))
        else:
            (remote.root / "artifacts" / key[:2] / key / rel).unlink()
    else:
        remote.write(key, rel, change(remote.read(key, rel)))
    err, rec = _pull(remote, tmp_path, key, with_upstream=False, jobs=1)
    assert words in str(err), f"{name}: {err}"
    assert rel not in rec.staged, f"{name}: the bad file was staged"
    figures.record("hostile_remote_cases", **{f"content: {name} ({remote.kind})": "refused, nothing published"})


def test_extra_files_in_a_remote_are_never_fetched(fresh_remote, tmp_path):
    remote, keys = fresh_remote
    remote.write(keys[0], "evil.py", b"import os; os.system('echo pwned')")
    if remote.root:
        (remote.root / "artifacts" / keys[0][:2] / keys[0] / "hidden/c/99").mkdir()
    remote.write(keys[0], "hidden/c/99/0", b"junk")
    local = open_store(tmp_path / "local")
    pull_keys(remote.open(), local, [keys[0]], progress=False, with_upstream=False)
    files = local.backend.list_files(keys[0])
    assert "evil.py" not in files and "hidden/c/99/0" not in files
    assert local.verify(keys[0]) == []


# ------------------------------------------------------------------------------ symlinks (file://)


def _link_chunk(art: Path, tmp: Path) -> None:
    target = art / "hidden/c/0/0"
    outside = tmp / "outside.bin"
    outside.write_bytes(target.read_bytes())  # byte-identical: digests would pass, the link must not
    target.unlink()
    target.symlink_to(outside)


def _link_dir(rel: str) -> Callable[[Path, Path], None]:
    def f(art: Path, tmp: Path) -> None:
        src = art / rel
        moved = tmp / f"moved-{rel.replace('/', '_')}"
        src.rename(moved)
        src.symlink_to(moved, target_is_directory=True)
    return f


def _link_manifest(art: Path, tmp: Path) -> None:
    outside = tmp / "manifest-outside.json"
    outside.write_bytes((art / "manifest.json").read_bytes())
    (art / "manifest.json").unlink()
    (art / "manifest.json").symlink_to(outside)


def _link_shard(art: Path, tmp: Path) -> None:
    shard = art.parent
    moved = tmp / "moved-shard"
    shard.rename(moved)
    shard.symlink_to(moved, target_is_directory=True)


def _link_to_etc(art: Path, tmp: Path) -> None:
    (art / "blobs/meta.json").unlink()
    (art / "blobs/meta.json").symlink_to("/etc/hostname")


SYMLINKS = [("chunk file", _link_chunk), ("array directory", _link_dir("hidden")), ("blobs directory", _link_dir("blobs")),
            ("artifact directory", _link_dir(".")), ("manifest.json", _link_manifest), ("shard directory", _link_shard),
            ("document pointing at /etc/hostname", _link_to_etc)]


@pytest.mark.parametrize("case", SYMLINKS, ids=[c[0] for c in SYMLINKS])
def test_symlinks_in_a_file_remote_are_refused(case, chain, tmp_path, figures):
    name, make = case
    src, keys = chain
    root = tmp_path / "remote"
    push_keys(src, open_remote(f"file://{root}"), keys, progress=False)
    art = root / "artifacts" / keys[0][:2] / keys[0]
    if name == "artifact directory":
        moved = tmp_path / "moved-art"
        art.rename(moved)
        art.symlink_to(moved, target_is_directory=True)
    else:
        make(art, tmp_path)
    local = open_store(tmp_path / "local")
    rec = Recorder(local)
    remote = open_remote(f"file://{root}")
    if name in ("manifest.json", "shard directory", "artifact directory"):
        # The manifest itself cannot be read without following the link: the artifact is not there.
        with pytest.raises(Exception) as e:
            pull_keys(remote, local, [keys[0]], progress=False, with_upstream=False)
        assert getattr(e.value, "exit_code", None) in (2, 5), repr(e.value)
    else:
        with pytest.raises(IntegrityError, match="symbolic link"):
            pull_keys(remote, local, [keys[0]], progress=False, with_upstream=False)
    assert no_leftovers(local)
    assert "blobs/meta.json" not in rec.staged or name != "document pointing at /etc/hostname"
    figures.record("hostile_remote_cases", **{f"symlink: {name} (file)": "refused, never followed"})


# ------------------------------------------------------------------------------ through the command line


def test_cli_pull_and_run_refuse_a_hostile_remote(zygote, base_store, tmp_path, figures):
    """`dfcache pull` and `dfcache run --remote` with a remote whose tokens manifest is hostile:
    exit 5, one message naming the remote, and the local store unchanged."""
    keys = base_store["keys"]
    root = tmp_path / "remote"
    r = zygote.cli("--store", base_store["path"], "push", f"file://{root}", "--all")
    assert r.code == 0, r.err
    art = root / "artifacts" / keys["tokens"][:2] / keys["tokens"]
    m = json.loads((art / "manifest.json").read_text())
    m["arrays"]["../../../../pwned"] = m["arrays"].pop("ids")
    (art / "manifest.json").write_text(json.dumps(m))

    local = copy_store(base_store, tmp_path / "local")
    shutil.rmtree(local / "artifacts" / keys["tokens"][:2] / keys["tokens"])
    before = artifacts_listing(local)
    r = zygote.cli("--store", local, "pull", f"file://{root}", keys["tokens"])
    assert r.code == 5 and "Traceback" not in r.err and r.err.count("error:") == 1, r.err
    assert "pwned" in r.err and keys["tokens"] in r.err
    r = zygote.cli("--store", local, "run", "tokens", *base_store["args"], "--offline", "--remote", f"file://{root}")
    assert r.code == 5 and "Traceback" not in r.err and r.err.count("error:") == 1, r.err
    assert artifacts_listing(local) == before
    assert not list(tmp_path.rglob("pwned*"))
    figures.record("hostile_remote_cases", **{"cli: pull and run --remote with a hostile manifest": "exit 5"})
