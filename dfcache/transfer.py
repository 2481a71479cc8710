"""Push and pull artifacts between stores, verifying everything that crosses.

The API the CLI (``dfcache push/pull/status``, ``dfcache ls --remote``) and the runner call::

    remote = open_remote("s3://bucket/dfcache")          # or a [remote.NAME] from dfcache.toml
    push_keys(local, remote, [key])                      # key and its upstream chain
    pull_keys(remote, local, [key], with_upstream=False) # what the runner does for one node
    compare(local, remote)                               # only local / only remote / both

What crosses is decided by the manifest alone. A source manifest is validated with
:func:`dfcache.manifest.validate_manifest` before anything is written at the destination, and
the files fetched are exactly those it implies (:func:`dfcache.store.format.expected_files`): the
group's ``zarr.json``, each array's ``<array>/zarr.json`` and its ``num_chunks`` chunk files, and
``blobs/<name>.json``. Names come
from validated patterns, never from a remote listing, so nothing like ``../x`` or ``/etc/x`` can
be asked for; sizes are bounded before download. Every chunk's crc32c and xxh3 digest and every
blob's digest are checked against the manifest (:func:`dfcache.store.format.check_file`, the
check ``verify`` uses too) while the files go into the destination's private staging; only when all of them pass is the artifact published (manifest last). Any failure aborts
the staging, so the destination never holds a partial or unverified artifact. Pushing verifies
local content the same way, so corrupt data is never shared.

Offline: a remote that needs the network (``s3://``) is refused before any socket is opened
(:meth:`dfcache.store.Backend.check_offline`); ``file://`` remotes work offline.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field, fields

from .config import load_config
from .errors import ArtifactNotFoundError, IntegrityError, UntrustedManifestError, UsageError
from .keys import KEY_PATTERN
from .maintenance import human_bytes
from .manifest import Manifest
from .store import Store, open_store
from .store import format as fmt

__all__ = ["BaseTransferResult", "Comparison", "TransferResult", "compare", "damage_fix", "list_remote", "open_remote", "pull_keys",
           "push_keys", "read_bounded", "select_keys", "source_manifest"]

# ------------------------------------------------------------------------------ results


class BaseTransferResult:
    """What a push or pull result is, of artifacts (:class:`TransferResult`) or of samples
    (:class:`dfcache.sample_transfer.SampleTransferResult`): its direction and two stores, its
    JSON form, and how its one-line summary starts."""

    direction: str  # "push" | "pull"
    source: str
    destination: str
    seconds: float

    def _verb_where(self) -> tuple[str, str]:
        """("pushed", "to DESTINATION") or ("pulled", "from SOURCE")."""
        if self.direction == "push":
            return "pushed", f"to {self.destination}"
        return "pulled", f"from {self.source}"

    def to_dict(self) -> dict:
        """Every field in declaration order (the ``--json`` object), seconds to the millisecond."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["seconds"] = round(self.seconds, 3)
        return out


@dataclass
class TransferResult(BaseTransferResult):
    """What one push or pull of artifacts did."""

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
        verb, where = self._verb_where()
        rate = f", {human_bytes(self.bytes / self.seconds)}/s" if self.seconds > 0 and self.bytes else ""
        return (f"{verb} {len(self.transferred)} artifact(s), {human_bytes(self.bytes)} in {self.files} file(s) "
                f"{where} in {self.seconds:.1f} s{rate}; {len(self.skipped)} already there (skipped)")


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


def open_remote(url_or_name: str, *, endpoint_url: str | None = None, region: str | None = None,
                offline: bool | None = None, create: bool = True) -> Store:
    """Open a remote store by URL (``s3://bucket/prefix``, ``file:///path``, a plain directory) or by
    the name of a ``[remote.NAME]`` in dfcache.toml. Explicit ``endpoint_url``/``region`` win over the
    config, which wins over the AWS_* variables. ``create=False`` refuses a missing ``file://`` store.

    The same opener as :func:`dfcache.open_store`; a plain directory is opened as ``file://``, so a
    remote is always read without following symlinks.
    """
    cfg = load_config().remote_urls([url_or_name])[0]
    url = cfg.url
    if "://" not in url:
        from pathlib import Path

        url = "file://" + str(Path(url).expanduser().absolute())
    return open_store(url, endpoint_url=endpoint_url or cfg.endpoint_url, region=region or cfg.region,
                      create=create, offline=offline)


def list_remote(url_or_name: str, *, stage: str | None = None, endpoint_url: str | None = None,
                region: str | None = None, offline: bool | None = None, errors: list | None = None) -> list[Manifest]:
    """Manifests of every artifact in a remote (validated; invalid ones go to ``errors`` as
    (key, message)). For ``dfcache ls --remote URL``."""
    store = open_remote(url_or_name, endpoint_url=endpoint_url, region=region, offline=offline, create=False)
    return store.list_manifests(stage=stage, errors=errors)


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
    remote.backend.check_offline(offline)
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


def damage_fix(direction: str, key: str, where: str) -> str:
    """The fix a damaged copy's error ends with, for a push or a pull (the damage is the source's)."""
    if direction == "pull":
        return (f"The copy in {where} is damaged: push a good copy there again (or delete it there), "
                "then pull.")
    return (f"Your local copy is damaged: check it with `dfcache verify {key[:12]}`, delete it "
            f"(`dfcache gc --key {key[:12]} --yes`) and recompute it, then push.")


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
            manifest = source_manifest(raw, key, direction, src.url)
            items[key] = _Item(key, raw, manifest)
        stack.append((key, True))
        if with_upstream and manifest is not None:
            for up in reversed(manifest.upstream_keys):
                if up not in state:
                    stack.append((up, False))
    return todo, skipped, missing


# ------------------------------------------------------------------------------ transfer


class _Cancelled(Exception):
    """Another artifact failed or the user interrupted: stop without starting new work."""


def source_manifest(raw: bytes, key: str, direction: str, where: str) -> Manifest:
    """A source's manifest, validated and checked against the format before anything is written
    (UntrustedManifestError with the fix for this direction otherwise)."""
    try:
        manifest = Manifest.from_json(raw, expect_key=key)
        fmt.check_manifest(manifest)
    except UntrustedManifestError as e:
        raise e.with_fix(damage_fix(direction, key, where)) from None
    return manifest


def read_bounded(store: Store, m: Manifest, rel: str, role: fmt.FileRole, direction: str) -> bytes:
    """A file of a source copy, never more than its manifest allows (:func:`format.file_limit`);
    IntegrityError with the fix for this direction if it is missing or larger. Not yet checked:
    pass it to :func:`format.check_file` (or :func:`format.check_chunk`)."""
    try:
        return store.backend.read_file_limited(m.key, rel, fmt.file_limit(m, role))
    except FileNotFoundError:
        raise IntegrityError(f"{rel} of artifact {m.key} is missing in {store.url}; that copy is incomplete.",
                             key=m.key, fix=damage_fix(direction, m.key, store.url)) from None
    except IntegrityError as e:
        raise e.with_fix(damage_fix(direction, m.key, store.url)) from None


def _read_verified(store: Store, m: Manifest, rel: str, role: fmt.FileRole, direction: str) -> bytes:
    data = read_bounded(store, m, rel, role, direction)
    try:
        fmt.check_file(m, rel, role, data)
    except IntegrityError as e:
        raise e.with_fix(damage_fix(direction, m.key, store.url)) from None
    return data


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

    def copy_file(item: _Item, staging, rel: str, role: fmt.FileRole) -> int:
        if cancel.is_set():
            raise _Cancelled()
        data = _read_verified(src, item.manifest, rel, role, direction)
        staging.put(rel, data)
        with bar_lock:
            bar.update(len(data))
        return len(data)

    def transfer_one(item: _Item) -> tuple[str, int, int, bool]:
        if cancel.is_set():
            raise _Cancelled()
        files = fmt.expected_files(item.manifest)
        staging = dst.backend.open_staging(item.key)
        try:
            futures = [file_pool.submit(copy_file, item, staging, rel, role) for rel, role in files.items()]
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
                                     f"{item.manifest.size_bytes}.", key=item.key,
                                     fix=damage_fix(direction, item.key, src.url))
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
    dst_store.backend.check_offline(offline)
    src_store.backend.check_offline(offline)
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
    remote_store.backend.check_offline(offline)
    local_store.backend.check_offline(offline)
    return _transfer("pull", Store(remote_store.backend.for_untrusted_reads()), local_store, list(keys), with_upstream=with_upstream,
                     progress=progress, jobs=jobs)
