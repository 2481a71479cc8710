"""Push and pull artifacts between stores, verifying everything that crosses.

The API the CLI (``dfcache push/pull/status``, ``dfcache ls --remote``) and the runner call::

    remote = open_remote("s3://bucket/dfcache")          # or a [remote.NAME] from dfcache.toml
    push_keys(local, remote, [key])                      # key and its upstream chain
    pull_keys(remote, local, [key], with_upstream=False) # what the runner does for one node
    compare(local, remote)                               # only local / only remote / both

What crosses is decided by the manifest alone. A source manifest is validated with
:func:`dfcache.manifest.validate_manifest` before anything is written at the destination, and
the files fetched are exactly those it implies: the group's ``zarr.json``, each array's
``<array>/zarr.json`` and its ``num_chunks`` chunk files, and ``blobs/<name>.json``. Names come
from validated patterns, never from a remote listing, so nothing like ``../x`` or ``/etc/x`` can
be asked for; sizes are bounded before download. Every chunk's crc32c and xxh3 digest and every
blob's digest are checked against the manifest while the files go into the destination's private
staging; only when all of them pass is the artifact published (manifest last). Any failure aborts
the staging, so the destination never holds a partial or unverified artifact. Pushing verifies
local content the same way, so corrupt data is never shared.

Offline: a remote that needs the network (``s3://``) is refused before any socket is opened;
``file://`` remotes work offline.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field

import xxhash

from .config import load_config, offline_from_env
from .errors import (ArtifactNotFoundError, IntegrityError, OfflineModeIsEnabled,
                     UntrustedManifestError, UsageError)
from .keys import KEY_PATTERN
from .maintenance import human_bytes
from .manifest import STORAGE_DTYPE, Manifest
from .store import Store

__all__ = ["Comparison", "TransferResult", "compare", "list_remote", "open_remote", "pull_keys", "push_keys",
           "select_keys"]

MAX_META_BYTES = 1 << 20  # a zarr.json is a few hundred bytes
MAX_CHUNK_BYTES = 4 << 30  # dfcache writes ~4 MiB chunks; a manifest asking for more is refused


# ------------------------------------------------------------------------------ results


@dataclass
class TransferResult:
    """What one push or pull did."""

    direction: str  # "push" | "pull"
    source: str
    destination: str
    transferred: list[str] = field(default_factory=list)  # keys newly published at the destination
    skipped: list[str] = field(default_factory=list)  # keys the destination already had
    missing_upstream: list[str] = field(default_factory=list)  # upstream keys neither side has
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        verb = "pushed" if self.direction == "push" else "pulled"
        where = f"to {self.destination}" if self.direction == "push" else f"from {self.source}"
        rate = f", {human_bytes(self.bytes / self.seconds)}/s" if self.seconds > 0 and self.bytes else ""
        return (f"{verb} {len(self.transferred)} artifact(s), {human_bytes(self.bytes)} in {self.files} file(s) "
                f"{where} in {self.seconds:.1f} s{rate}; {len(self.skipped)} already there (skipped)")

    def to_dict(self) -> dict:
        return {"direction": self.direction, "source": self.source, "destination": self.destination,
                "transferred": self.transferred, "skipped": self.skipped,
                "missing_upstream": self.missing_upstream, "files": self.files, "bytes": self.bytes,
                "seconds": round(self.seconds, 3)}


@dataclass
class Comparison:
    """Artifacts of two stores, by where they are."""

    local: str
    remote: str
    only_local: list[Manifest]
    only_remote: list[Manifest]
    both: list[Manifest]

    def to_dict(self) -> dict:
        def rows(ms):
            return [{"key": m.key, "stage": m.stage, "size_bytes": m.size_bytes, "created": m.created,
                     "summary": m.summary} for m in ms]

        return {"local": self.local, "remote": self.remote, "only_local": rows(self.only_local),
                "only_remote": rows(self.only_remote), "both": rows(self.both)}


# ------------------------------------------------------------------------------ opening


def _needs_network(store: Store) -> bool:
    return bool(getattr(store.backend, "needs_network", False))


def _check_offline(store: Store, offline: bool | None) -> None:
    offline = offline_from_env() if offline is None else offline
    if offline and _needs_network(store):
        raise OfflineModeIsEnabled(f"cannot reach {store.url}: offline mode is on (--offline or DFCACHE_OFFLINE); "
                                   "use a file:// remote or turn offline mode off.", url=store.url)


def open_remote(url_or_name: str, *, endpoint_url: str | None = None, region: str | None = None,
                offline: bool | None = None, create: bool = True) -> Store:
    """Open a remote store by URL (``s3://bucket/prefix``, ``file:///path``, a plain directory) or by
    the name of a ``[remote.NAME]`` in dfcache.toml. Explicit ``endpoint_url``/``region`` win over the
    config, which wins over the AWS_* variables. ``create=False`` refuses a missing ``file://`` store.
    """
    from .store._remote import open_remote_backend

    cfg = load_config().remote_urls([url_or_name])[0]
    url = cfg.url
    if "://" not in url:
        from pathlib import Path

        url = "file://" + str(Path(url).expanduser().absolute())
    backend = open_remote_backend(url, endpoint_url=endpoint_url or cfg.endpoint_url, region=region or cfg.region,
                                  create=create, offline=offline)
    return Store(backend)


def list_remote(url_or_name: str, *, stage: str | None = None, endpoint_url: str | None = None,
                region: str | None = None, offline: bool | None = None, errors: list | None = None) -> list[Manifest]:
    """Manifests of every artifact in a remote (validated; invalid ones go to ``errors`` as
    (key, message)). For ``dfcache ls --remote URL``."""
    store = open_remote(url_or_name, endpoint_url=endpoint_url, region=region, offline=offline, create=False)
    return store.list_manifests(stage=stage, errors=errors)


def _safe_source(store: Store) -> Store:
    """A local directory used as a pull source is read through the no-symlink backend."""
    from .store._local import LocalBackend
    from .store._remote import FileRemoteBackend

    backend = store.backend
    if isinstance(backend, LocalBackend) and not isinstance(backend, FileRemoteBackend):
        return Store(FileRemoteBackend(backend.root, create=False))
    return store


# ------------------------------------------------------------------------------ selection


def select_keys(store: Store, keys=(), *, all_keys: bool = False, stage: str | None = None) -> list[str]:
    """Full keys in ``store``: the given keys or unique prefixes, or every key (``all_keys``),
    or every key of ``stage``; ``stage`` with keys keeps those of that stage."""
    keys = list(keys or [])
    if not keys and not all_keys and not stage:
        raise UsageError("say what to transfer: give keys (or unique prefixes), --all, or --stage S.")
    if keys:
        chosen = [store.resolve(k) for k in keys]
        if stage:
            chosen = [k for k in chosen if store.manifest(k).stage == stage]
    else:
        chosen = [m.key for m in store.list_manifests(stage=stage)]
    return list(dict.fromkeys(chosen))


def compare(local: Store, remote: Store, *, offline: bool | None = None) -> Comparison:
    """Which artifacts are only local, only in the remote, or in both (by key)."""
    _check_offline(remote, offline)
    mine = {m.key: m for m in local.list_manifests()}
    theirs = {m.key: m for m in remote.list_manifests()}

    def order(ms):
        return sorted(ms, key=lambda m: (m.created, m.key))

    return Comparison(local=local.url, remote=remote.url,
                      only_local=order(m for k, m in mine.items() if k not in theirs),
                      only_remote=order(m for k, m in theirs.items() if k not in mine),
                      both=order(m for k, m in mine.items() if k in theirs))


# ------------------------------------------------------------------------------ planning


@dataclass
class _Item:
    key: str
    raw: bytes  # the manifest bytes, published unchanged
    manifest: Manifest


def _fix(direction: str, key: str, where: str) -> str:
    if direction == "pull":
        return (f"The copy in {where} is damaged: push a good copy there again (or delete it there), "
                "then pull.")
    return (f"Your local copy is damaged: check it with `dfcache verify {key[:12]}`, delete it "
            f"(`dfcache gc --key {key[:12]} --yes`) and recompute it, then push.")


def _check_manifest(m: Manifest, direction: str, where: str) -> None:
    """What validate_manifest leaves to us: names that collide with the group layout, the
    array digest agreeing with its chunk digests, chunk sizes we are willing to download."""
    from .store._store import _array_digest

    for name, spec in m.arrays.items():
        if name in ("blobs", "c", "zarr.json", "manifest.json"):
            raise UntrustedManifestError(f"manifest of {m.key} refused: array name {name!r} collides with the "
                                         f"artifact layout. {_fix(direction, m.key, where)}", key=m.key)
        if _array_digest(spec.chunk_digests) != spec.digest:
            raise UntrustedManifestError(f"manifest of {m.key} refused: array {name}'s digest does not match "
                                         f"its chunk digests. {_fix(direction, m.key, where)}", key=m.key)
        if _chunk_raw_bytes(spec) > MAX_CHUNK_BYTES:
            raise UntrustedManifestError(f"manifest of {m.key} refused: array {name} has chunks of "
                                         f"{_chunk_raw_bytes(spec)} bytes (at most {MAX_CHUNK_BYTES}). "
                                         f"{_fix(direction, m.key, where)}", key=m.key)


def _chunk_raw_bytes(spec) -> int:
    import numpy as np

    row = int(np.prod(spec.shape[1:], dtype=np.int64)) if len(spec.shape) > 1 else 1
    return spec.chunk_rows * row * np.dtype(STORAGE_DTYPE[spec.dtype]).itemsize


def _plan(direction: str, src: Store, dst: Store, keys: list[str], with_upstream: bool):
    """Upstream-first list of artifacts the destination lacks, what it already has, and upstream
    keys neither side has. Every source manifest is validated here, before any write."""
    for k in keys:
        if not isinstance(k, str) or not KEY_PATTERN.match(k):
            raise UsageError(f"{k!r} is not a key (32 hex digits); resolve prefixes with select_keys first.")
    todo: list[_Item] = []
    skipped: list[str] = []
    missing: list[str] = []
    state: dict[str, str] = {}
    requested = set(keys)
    # Iterative post-order walk: a remote's upstream graph can be deep; recursion is not safe.
    stack: list[tuple[str, bool]] = [(k, False) for k in reversed(keys)]
    items: dict[str, _Item | None] = {}
    while stack:
        key, expanded = stack.pop()
        if expanded:
            item = items[key]
            if item is None:
                skipped.append(key)
            else:
                todo.append(item)
            continue
        if key in state:
            continue
        state[key] = "seen"
        if dst.has(key):
            items[key] = None
            manifest = None
            if with_upstream:
                for store in ((src, dst) if direction == "push" else (dst, src)):  # the local side first
                    raw = store.backend.read_manifest(key)
                    if raw is not None:
                        manifest = Manifest.from_json(raw, expect_key=key)
                        break
        else:
            raw = src.backend.read_manifest(key)
            if raw is None:
                if key in requested:
                    remote = src.url if direction == "pull" else dst.url
                    raise ArtifactNotFoundError(f"no artifact {key} in {src.url}; run `dfcache status {remote}` "
                                                "to see what each side has.")
                missing.append(key)
                continue
            manifest = Manifest.from_json(raw, expect_key=key)
            _check_manifest(manifest, direction, src.url)
            items[key] = _Item(key, raw, manifest)
        stack.append((key, True))
        if with_upstream and manifest is not None:
            for up in reversed(manifest.upstream_keys):
                if up not in state:
                    stack.append((up, False))
    return todo, skipped, missing


# ------------------------------------------------------------------------------ verification


def _expected_files(m: Manifest) -> dict[str, tuple]:
    """Relative path → (kind, detail) of every file the manifest implies, and nothing else."""
    from .store._store import chunk_relpath

    files: dict[str, tuple] = {"zarr.json": ("group", None)}
    for name, spec in sorted(m.arrays.items()):
        files[f"{name}/zarr.json"] = ("array_meta", name)
        for i in range(spec.num_chunks):
            files[chunk_relpath(name, i, len(spec.shape))] = ("chunk", (name, i))
    for name in sorted(m.blobs):
        files[f"blobs/{name}.json"] = ("blob", name)
    for rel in files:  # names come from validated patterns; this states the invariant
        if rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            raise UntrustedManifestError(f"manifest of {m.key} refused: it implies the file name {rel!r}.",
                                         key=m.key)
    return files


def _limit(m: Manifest, kind: str, detail) -> int:
    if kind in ("group", "array_meta"):
        return MAX_META_BYTES
    if kind == "blob":
        return m.blobs[detail].nbytes
    spec = m.arrays[detail[0]]
    raw = _chunk_raw_bytes(spec)
    if spec.codec == "zstd":
        raw += raw // 128 + (1 << 16)  # above zstd's worst-case expansion of incompressible data
    return raw + 4  # crc32c


def _zstd_content_size(body: memoryview) -> int | None:
    """Decompressed size declared in a zstd frame header (RFC 8878 §3.1.1.1), None if absent."""
    b = bytes(body[:18])
    if len(b) < 6 or b[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = b[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(b) < pos + size:
        return None
    value = int.from_bytes(b[pos:pos + size], "little")
    return value + 256 if size == 2 else value


def _verify(m: Manifest, rel: str, kind: str, detail, data: bytes, direction: str, where: str) -> None:
    """Raise IntegrityError unless ``data`` is exactly what the manifest says ``rel`` holds."""
    import json

    key = m.key
    fix = _fix(direction, key, where)
    if kind == "blob":
        spec = m.blobs[detail]
        if len(data) != spec.nbytes or xxhash.xxh3_128_hexdigest(data) != spec.digest:
            raise IntegrityError(f"document {detail} of artifact {key} does not match its digest. {fix}", key=key)
        return
    if kind in ("group", "array_meta"):
        try:
            meta = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            meta = None
        if not isinstance(meta, dict) or meta.get("zarr_format") != 3:
            raise IntegrityError(f"{rel} of artifact {key} is not zarr v3 metadata. {fix}", key=key)
        if kind == "group":
            if meta.get("node_type") != "group":
                raise IntegrityError(f"zarr.json of artifact {key} is not a group. {fix}", key=key)
            return
        from .store._store import array_meta_problem

        problem = array_meta_problem(meta, m.arrays[detail])
        if problem:
            raise IntegrityError(f"{rel} of artifact {key} disagrees with the manifest (array {detail}: "
                                 f"{problem}). {fix}", key=key)
        return
    import numpy as np

    from .store._store import _chunk_digest, _decode_chunk

    name, index = detail
    spec = m.arrays[name]
    where_chunk = f"chunk {index} of array {name} in artifact {key}"
    if spec.codec == "zstd" and len(data) >= 4:
        declared = _zstd_content_size(memoryview(data)[:-4])
        if declared is None or declared != _chunk_raw_bytes(spec):
            # Checked before decompressing, so a hostile frame cannot claim terabytes.
            raise IntegrityError(f"{where_chunk} declares {declared} decompressed bytes, expected "
                                 f"{_chunk_raw_bytes(spec)}. {fix}", key=key)
    try:
        chunk = _decode_chunk(data, spec.codec, (spec.chunk_rows,) + tuple(spec.shape[1:]), spec.storage_dtype,
                              where_chunk, key)
    except IntegrityError as e:
        raise IntegrityError(f"{e.message} {fix}", key=key) from None
    rows = min(spec.chunk_rows, spec.shape[0] - index * spec.chunk_rows)
    if _chunk_digest(np.asarray(chunk[:rows])) != spec.chunk_digests[index]:
        raise IntegrityError(f"{where_chunk} does not match its digest. {fix}", key=key)


# ------------------------------------------------------------------------------ transfer


class _Cancelled(Exception):
    """Another artifact failed or the user interrupted: stop without starting new work."""


def _read_source(store: Store, key: str, rel: str, limit: int, direction: str) -> bytes:
    backend = store.backend
    try:
        reader = getattr(backend, "read_file_limited", None)
        if reader is not None:
            return reader(key, rel, limit)
        path = backend.local_file_path(key, rel)
        if path is not None:
            import os

            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size > limit:
                    raise IntegrityError(f"{rel} of artifact {key} in {store.url} is larger than its manifest "
                                         f"allows ({limit} bytes). {_fix(direction, key, store.url)}", key=key)
                return f.read()
        data = backend.read_file(key, rel)
        if len(data) > limit:
            raise IntegrityError(f"{rel} of artifact {key} in {store.url} is larger than its manifest allows "
                                 f"({limit} bytes). {_fix(direction, key, store.url)}", key=key)
        return data
    except FileNotFoundError:
        raise IntegrityError(f"{rel} of artifact {key} is missing in {store.url}; that copy is incomplete. "
                             f"{_fix(direction, key, store.url)}", key=key) from None


def _transfer(direction: str, src: Store, dst: Store, keys: list[str], *, with_upstream: bool, progress: bool,
              jobs: int) -> TransferResult:
    t0 = time.monotonic()
    jobs = max(1, int(jobs))
    todo, skipped, missing = _plan(direction, src, dst, list(keys), with_upstream)
    result = TransferResult(direction=direction, source=src.url, destination=dst.url, skipped=skipped,
                            missing_upstream=missing)
    if not todo:
        result.seconds = time.monotonic() - t0
        return result
    from tqdm import tqdm

    bar = tqdm(total=sum(it.manifest.size_bytes for it in todo), unit="B", unit_scale=True, unit_divisor=1024,
               desc=direction, file=sys.stderr, disable=None if progress else True, leave=False)
    bar_lock = threading.Lock()
    cancel = threading.Event()
    file_pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="dfcache-file")
    art_pool = ThreadPoolExecutor(max_workers=max(1, min(4, jobs, len(todo))), thread_name_prefix="dfcache-art")

    def copy_file(item: _Item, staging, rel: str, kind: str, detail) -> int:
        if cancel.is_set():
            raise _Cancelled()
        data = _read_source(src, item.key, rel, _limit(item.manifest, kind, detail), direction)
        _verify(item.manifest, rel, kind, detail, data, direction, src.url)
        staging.put(rel, data)
        with bar_lock:
            bar.update(len(data))
        return len(data)

    def transfer_one(item: _Item) -> tuple[str, int, int, bool]:
        if cancel.is_set():
            raise _Cancelled()
        files = _expected_files(item.manifest)
        staging = dst.backend.open_staging(item.key)
        try:
            futures = [file_pool.submit(copy_file, item, staging, rel, kind, detail)
                       for rel, (kind, detail) in files.items()]
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                for f in futures:
                    if f in done and f.exception() is not None:
                        raise f.exception()
                nbytes = sum(f.result() for f in futures)
            except BaseException:
                for f in futures:
                    f.cancel()
                wait(futures)  # nothing may still write into the staging we are about to drop
                raise
            if nbytes != item.manifest.size_bytes:
                raise IntegrityError(f"artifact {item.key} holds {nbytes} bytes of files but its manifest says "
                                     f"{item.manifest.size_bytes}. {_fix(direction, item.key, src.url)}",
                                     key=item.key)
            if cancel.is_set():
                raise _Cancelled()
            won = staging.publish(item.raw)
        except BaseException:
            staging.abort()
            raise
        return item.key, nbytes, len(files), won

    errors: list[BaseException] = []
    try:
        futures = {art_pool.submit(transfer_one, it): it.key for it in todo}
        for f in as_completed(futures):
            exc = f.exception()
            if exc is None:
                key, nbytes, nfiles, won = f.result()
                (result.transferred if won else result.skipped).append(key)
                result.files += nfiles if won else 0
                result.bytes += nbytes if won else 0
            elif not isinstance(exc, _Cancelled):
                cancel.set()
                errors.append(exc)
    except BaseException:
        cancel.set()
        raise
    finally:
        art_pool.shutdown(wait=True, cancel_futures=True)
        file_pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    if errors:
        raise errors[0]
    result.seconds = time.monotonic() - t0
    return result


def push_keys(src_store: Store, dst_store: Store, keys, *, with_upstream: bool = True, progress: bool = True,
              jobs: int = 8, offline: bool | None = None) -> TransferResult:
    """Copy artifacts (and, with ``with_upstream``, their upstream chains) that ``dst_store`` lacks.

    Local content is verified (digests, checksums) before it is shared; a corrupt artifact stops
    the push with IntegrityError and is not published. Raises OfflineModeIsEnabled for a network
    remote while offline, NetworkError if the remote fails, ArtifactNotFoundError for a key the
    source does not have.
    """
    _check_offline(dst_store, offline)
    _check_offline(src_store, offline)
    return _transfer("push", src_store, dst_store, list(keys), with_upstream=with_upstream, progress=progress,
                     jobs=jobs)


def pull_keys(remote_store: Store, local_store: Store, keys, *, with_upstream: bool = True, progress: bool = True,
              jobs: int = 8, offline: bool | None = None) -> TransferResult:
    """Fetch artifacts (and, with ``with_upstream``, their upstream chains) the local store lacks.

    Each manifest is validated before anything is written locally; files go into the local
    store's staging and are verified against the manifest; only a fully verified artifact is
    published. On IntegrityError (exit 5) or NetworkError (exit 4) the failing artifact leaves
    nothing behind. Symbolic links in a ``file://`` remote are refused, never followed.
    """
    _check_offline(remote_store, offline)
    _check_offline(local_store, offline)
    return _transfer("pull", _safe_source(remote_store), local_store, list(keys), with_upstream=with_upstream,
                     progress=progress, jobs=jobs)
