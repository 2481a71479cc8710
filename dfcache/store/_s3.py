"""``s3://bucket/prefix`` stores: :class:`ObjectStoreBackend`, on zarr's ``zarr.storage.ObjectStore``
over an obstore ``S3Store``.

Endpoint, region and credentials come from the usual AWS variables, read in
:func:`dfcache.config.aws_settings`, overridden by the ``endpoint_url``/``region`` arguments
(``--endpoint-url``, ``[remote.NAME] endpoint_url/region`` in the config). Every request goes
through :meth:`ObjectStoreBackend._run`, which maps transport failures to dfcache errors; offline
mode refuses the backend before it is built (:meth:`Backend.check_offline`).

Why obstore (``zarr.storage.ObjectStore``) and not s3fs (``zarr.storage.FsspecStore``):

- Publishing needs a real create-if-absent write. ``ObjectStore.set_if_not_exists`` is one
  conditional PUT (``If-None-Match: *``) that the server decides atomically; ``FsspecStore``
  inherits zarr's generic ``exists()`` then ``set()``, two requests with a race between them.
- Retries and timeouts are bounded and configurable (``retry_config``, ``client_options``), so a
  dead endpoint fails in seconds with a clear error instead of a retry storm (nix #1990).
- It is about twice as fast as s3fs against the same server (shared/reference/stack-notes.md §6).

Layout under ``s3://bucket/prefix`` (artifacts exactly as in a local store)::

    dfcache-store.json                   {"format_version": 2}, written on the first publish
    artifacts/<key[:2]>/<key>/           one committed artifact: zarr v3 group + manifest.json
    locks/<key>.lease                    held by the one writer allowed under artifacts/../<key>/
    staging/<key>.<writer>/              uploads of a writer that found the lease taken

Publishing without rename. Object stores cannot rename, so ``manifest.json``, written last with
create-if-absent (``If-None-Match: *``), is what makes an artifact exist: readers never see a
partial artifact. Uploading straight under ``artifacts/<key[:2]>/<key>/`` would be safe only if
every writer of a key wrote the same bytes, and it does not: one key covers sampled completions
and GPU kernels with non-deterministic reductions, so two writers' chunk objects of the same names
would interleave and the winning manifest would describe a mix. Hence the lease (``_s3_lease.py``), an object taken
with create-if-absent and rewritten every ``LEASE_REFRESH_S`` by its holder's heartbeat:

- Direct mode (the usual case): the writer takes the key's lease when it opens, deletes whatever
  a crashed writer left under the artifact's prefix, uploads there, and publishes with one
  create-if-absent PUT of the manifest. No copies, no rename.
- Staging mode: the lease was taken, so the writer uploads to its private
  ``staging/<key>.<writer>/``. To publish it waits for the lease: if the holder's manifest appears
  it has lost (drop our copy, return False; both callers succeed, one copy stays). A lease unchanged
  for ``LEASE_STALE_S`` on the waiter's own clock (so no clock skew) belongs to a dead writer and
  is taken over; so, at once, is a lease whose holder was a process of this machine (same boot,
  same PID namespace) that no longer runs, such as a killed torchrun rank. With the lease it
  clears leftovers, copies the staged objects over (server-side copies), writes the manifest with
  create-if-absent and deletes its staging.
- A key already published when the writer opens needs no upload at all.

A holder stops writing if it cannot confirm its lease for longer than the stale period (a network
outage): it then raises instead of writing into a prefix another writer may own. A crash at any
instant leaves no manifest (leftovers are temporaries that gc removes after a grace period, once
their lease is stale) or a complete artifact. Resumable staging is not supported on object stores
(write to a local store and ``dfcache push``).

Network failures become :class:`dfcache.errors.NetworkError` subclasses (exit code 4) naming the
URL and the fix.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime as _dt
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

from ..config import aws_credential_source, aws_settings
from ..errors import (ConnectionRefused, DfcacheError, IntegrityError, NetworkError, ServerHTTPError,
                      ServerTimeout, ServerUnreachable, UsageError)
from ..keys import KEY_PATTERN
from ._backend import Backend, Staging, Temporary
from ._s3_lease import LEASE_STALE_S, LEASE_WAIT_S, _Lease
from .format import check_relpath, check_store_marker, damaged_marker, store_marker_bytes
from .layout import (ARTIFACTS, LEASE_SUFFIX, LOCKS, MANIFEST, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, STAGING,
                     STORE_MARKER, artifact_prefix, lock_relpath, staging_relpath)

IO_CONCURRENCY = 32

# Bounded retries: transient 5xx and dropped connections are retried for a few seconds; a dead
# endpoint then fails fast with a clear message instead of hanging for the 3-minute default.
_RETRY = {"max_retries": 4,
          "backoff": {"init_backoff": _dt.timedelta(milliseconds=100), "max_backoff": _dt.timedelta(seconds=2),
                      "base": 2},
          "retry_timeout": _dt.timedelta(seconds=30)}
_CLIENT = {"connect_timeout": "10s", "timeout": "300s"}

# What gc may remove: a writer's staging prefix, an artifact's prefix without a manifest, a lease.
_TEMP_NAME = re.compile(rf"^({STAGING}/[0-9a-f]{{32}}\.[0-9a-f]{{16}}|{ARTIFACTS}/[0-9a-f]{{2}}/[0-9a-f]{{32}}|"
                        rf"{LOCKS}/[0-9a-f]{{32}}{re.escape(LEASE_SUFFIX)})$")


_used = False  # a client was made in this process (its tokio threads may still hold Python objects)


def _settle_at_exit() -> None:
    # obstore hands request bodies, results and errors to tokio worker threads as Python objects,
    # and releasing one takes the GIL. If that happens after interpreter finalization has begun,
    # Python 3.11 ends the thread with pthread_exit, which aborts the process (SIGABRT or SIGBUS
    # after the command's own output: seen after a successful push, and after a refused connection
    # under load; lancedb#4175 and PyO3/pyo3#4874 describe the same race). The `dfcache`
    # executable never finalizes once obstore is loaded (dfcache.__main__.exit_process); for
    # library use, giving those threads a moment while the interpreter is still whole narrows the
    # window.
    if _used:
        time.sleep(0.1)


atexit.register(_settle_at_exit)


# ----------------------------------------------------------------------------------- errors


def _short(exc: BaseException) -> str:
    """obstore messages carry a multi-line debug dump; keep the first line, bounded."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


_INVALID_PATH = re.compile(r"Encountered object with invalid path|Error parsing Path")


def _map_error(exc: BaseException, backend: "ObjectStoreBackend", what: str) -> DfcacheError:
    """Turn an obstore/transport failure into the dfcache error a user can act on."""
    text = str(exc)
    url = backend.url
    where = f"{what} {url}" + (f" (endpoint {backend.endpoint})" if backend.endpoint else "")
    if _INVALID_PATH.search(text):
        # A listing that met an object whose name is no path (`../../escape/manifest.json`): the
        # bucket's content is wrong, not the network (exit 5, never 4). obstore refuses the whole
        # listing page, so it cannot be skipped; dfcache itself never reads or writes such a name.
        name = re.search(r'Error parsing Path "([^"]*)"', text)
        shown = repr(name.group(1)[:200]) if name else "a name with '..', '.' or empty parts"
        return IntegrityError(f"{where} failed: the bucket {backend.bucket} holds an object whose name is not a "
                              f"valid path (it starts with {shown}); no dfcache store has such names, so the "
                              "remote is damaged or hostile. Nothing was read from that name.",
                              fix=f"Delete the objects whose names start with {shown} from the bucket (with your "
                                  "S3 client), then run the command again.")
    if "ConnectionRefused" in text or "Connection refused" in text:
        return ConnectionRefused(f"{where} failed: connection refused. Start the S3 server or fix the "
                                 "endpoint (--endpoint-url, AWS_ENDPOINT_URL), then run the command again.",
                                 url=url)
    if "dns error" in text or "failed to lookup address" in text or "No route to host" in text:
        return ServerUnreachable(f"{where} failed: the host cannot be reached ({_short(exc)}). Check the "
                                 "endpoint URL and the network, then run the command again.", url=url)
    if "NoSuchBucket" in text:
        return ServerHTTPError(f"{where} failed: bucket {backend.bucket} does not exist. Create it or fix "
                               "the URL.", url=url, status=404)
    if any(s in text for s in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403 Forbidden",
                               "ExpiredToken", "Unauthenticated", "PermissionDenied")):
        return ServerHTTPError(f"{where} failed: access denied ({_short(exc)}). Set AWS_ACCESS_KEY_ID / "
                               "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) for this bucket.",
                               url=url, status=403)
    # Every obstore retry error mentions "retry_timeout", so match only real timeouts.
    if isinstance(exc, TimeoutError) or any(s in text for s in ("timed out", "TimedOut", "deadline has elapsed",
                                                                "kind: Timeout")):
        return ServerTimeout(f"{where} timed out ({_short(exc)}). The server is slow or unreachable; run the "
                             "command again later.", url=url)
    status = re.search(r"status code: (\d{3})", text)
    if status:
        return ServerHTTPError(f"{where} failed: the server answered HTTP {status.group(1)} ({_short(exc)}). Check "
                               "the URL and the server, then run the command again.", url=url,
                               status=int(status.group(1)))
    return NetworkError(f"{where} failed: {_short(exc)}. Check that the server is up and reachable, then run "
                        "the command again.", url=url)


# ------------------------------------------------------------------------------- S3 backend


class _ObjectStaging(Staging):
    """One writer's artifact on an object store; see the module docstring.

    Direct mode (the usual case): this writer took the key's lease when it opened, so it uploads
    straight under ``artifacts/<key[:2]>/<key>/`` and publishing is one create-if-absent PUT of
    the manifest. Staging mode: another writer held the lease, so uploads go to a private
    ``staging/<key>.<writer>/`` and are copied over at publish time, after taking the lease. A
    key already published needs no upload at all: the copy would be dropped anyway.
    """

    def __init__(self, backend: "ObjectStoreBackend", key: str) -> None:
        self.backend = backend
        self.key = key
        self.writer = uuid.uuid4().hex[:16]
        self.final = backend._art(key)
        self._staged: set[str] = set()
        self._lock = threading.Lock()
        self._already_published = False
        self._closed = False
        lease = _Lease(backend, key, self.writer)
        self.lease: _Lease | None = lease if backend._run(self._open(lease), f"opening {key[:12]} on") else None
        if self.lease is not None:
            self.prefix = self.final
            self.lease.start_heartbeat()
        else:
            self.prefix = staging_relpath(f"{key}.{self.writer}/")

    async def _open(self, lease: _Lease) -> bool:
        """Take the lease if free (or held by a dead process of this machine); clear a crashed
        writer's leftovers. True for direct mode."""
        if not await lease.try_create():
            current = await self.backend._get(lease.path, limit=1 << 16)
            if not await lease.take_over_if_gone(current) or not await lease.try_create():
                return False
        try:
            present = [m["path"] for m in await self.backend._list(self.final)]
            if self.final + MANIFEST in present:
                self._already_published = True
                await self.backend.zstore.delete(lease.path)
                return False
            await self.backend._delete_many(present)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.backend.zstore.delete(lease.path)
            raise
        return True

    def put(self, relpath: str, data) -> int:
        check_relpath(relpath)
        parts = data if isinstance(data, (list, tuple)) else [data]
        blob = b"".join(parts) if len(parts) != 1 else bytes(parts[0])
        if self._already_published:
            return len(blob)
        if self.lease is not None:
            self.lease.ensure_held()
        self.backend._run(self.backend._set(self.prefix + relpath, blob), f"uploading {relpath} of {self.key[:12]} to")
        with self._lock:
            self._staged.add(relpath)
        return len(blob)

    def get(self, relpath: str) -> bytes | None:
        check_relpath(relpath)
        with self._lock:
            if relpath not in self._staged:
                return None
        return self.backend._run(self.backend._get(self.prefix + relpath), "reading from")

    def publish(self, manifest_bytes: bytes) -> bool:
        b = self.backend
        manifest_bytes = bytes(manifest_bytes)
        what = f"publishing {self.key[:12]} to"
        if self._already_published:
            if b.read_manifest(self.key) is None:
                raise IntegrityError(f"artifact {self.key} was deleted from {b.url} while this copy was being "
                                     "written; run the command again.", key=self.key)
            self._closed = True
            return False
        if self.lease is not None:
            async def commit():
                await self.lease.check()
                return await b._create(self.final + MANIFEST, manifest_bytes)

            won = b._run(commit(), what)
        else:
            lease = b._run(b._acquire_lease(self.key, self.writer), what)
            if lease is None:
                self._drop_quietly()
                self._closed = True
                return False  # another writer published while we waited
            self.lease = lease
            lease.start_heartbeat()
            won = b._run(self._copy_and_commit(manifest_bytes), what)
            self._drop_quietly()
        # On an exception above the caller aborts, which releases the lease.
        if won:
            b._run(b._ensure_marker(), what)
        self._closed = True
        self.lease.release()
        return won

    async def _copy_and_commit(self, manifest_bytes: bytes) -> bool:
        b = self.backend
        # One listing answers both "published meanwhile?" and "leftovers of a crashed writer?".
        present = [m["path"] for m in await b._list(self.final)]
        if self.final + MANIFEST in present:
            return False
        await b._delete_many(present)
        await self.lease.check()
        with self._lock:
            staged = sorted(self._staged)
        await b._gather(b._copy(self.prefix + rel, self.final + rel) for rel in staged)
        return await b._create(self.final + MANIFEST, manifest_bytes)

    def _drop_quietly(self) -> None:
        with self._lock:
            paths = [self.prefix + rel for rel in self._staged]
            self._staged.clear()
        if not paths:
            return
        try:
            self.backend._run(self.backend._delete_many(paths), "cleaning up in")
        except DfcacheError:
            pass  # the server went away; what is left is a temporary that gc removes later

    def abort(self) -> None:
        # Called while another error propagates: cleanup is best effort and never masks it.
        if self._closed:
            return
        self._closed = True
        lease = self.lease
        if lease is not None and self.prefix == self.final:
            try:
                lease.ensure_held()  # delete under the artifact's prefix only while it is ours
            except DfcacheError:
                pass
            else:
                self._drop_quietly()
        else:
            self._drop_quietly()
        if lease is not None:
            lease.release()

    def __del__(self) -> None:  # pragma: no cover - a writer dropped without publish or abort
        try:
            if self.lease is not None:
                self.lease._stop.set()
        except Exception:
            pass


class ObjectStoreBackend(Backend):
    """An S3 (or S3-compatible) store at ``s3://bucket/prefix`` through ``zarr.storage.ObjectStore``."""

    needs_network = True

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None) -> None:
        from obstore.store import S3Store
        from zarr.storage import ObjectStore

        global _used
        _used = True
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise UsageError(f"{url!r} is not an S3 URL; write s3://bucket/prefix.")
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        if any(p in ("", ".", "..") for p in self.prefix.split("/")) and self.prefix:
            raise UsageError(f"{url!r}: the prefix must not contain empty, '.' or '..' parts.")
        self.url = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        aws = aws_settings()
        self.endpoint = endpoint_url or aws.endpoint_url
        self.region = region or aws.region
        kwargs: dict = {}
        if self.endpoint:
            kwargs["endpoint"] = self.endpoint
        if self.region:
            kwargs["region"] = self.region
        client = dict(_CLIENT, allow_http=bool(self.endpoint and self.endpoint.startswith("http://")))
        # With an endpoint given (a MinIO, a Ceph, a test server) and no credentials set, obstore
        # would ask the cloud instance-metadata address (169.254.169.254) for some before its
        # first request: a probe of an address the user never named, and seconds of waiting where
        # there is no cloud. dfcache refuses instead, at the first request (so a run whose
        # configured remote this is only warns, as for an unreachable remote).
        self._refusal: DfcacheError | None = None
        if self.endpoint and aws_credential_source() is None:
            self._refusal = UsageError(
                f"no S3 credentials are set for {self.url} at the endpoint {self.endpoint}, so dfcache did not "
                "contact it: with an endpoint given it never lets the S3 client ask a cloud instance-metadata "
                "service for credentials.",
                fix="Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN if needed), or "
                    "AWS_SKIP_SIGNATURE=true for a bucket that allows anonymous access (unsigned requests), or "
                    "AWS_METADATA_ENDPOINT=http://169.254.169.254 to use this machine's instance credentials.")
        try:
            self._obs = S3Store(self.bucket, prefix=self.prefix or None, client_options=client,
                                retry_config=_RETRY, **kwargs)
        except Exception as e:
            raise UsageError(f"cannot configure the S3 store {self.url}: {_short(e)}; check the URL, "
                             "--endpoint-url and the AWS_* variables.") from None
        self.zstore = ObjectStore(self._obs)
        self._format_checked = False
        self._marker_written = False

    def __repr__(self) -> str:
        return f"ObjectStoreBackend({self.url!r})"

    # -- plumbing: every call goes through _run, which maps transport errors

    def _run(self, coro, what: str):
        from zarr.core.sync import sync

        if self._refusal is not None:
            coro.close()
            raise self._refusal
        try:
            return sync(coro)
        except DfcacheError:
            raise
        except FileNotFoundError:
            raise
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:
            # Whatever else the object store raises is a failure of the transport: exit 4, always,
            # including classes that are not Exceptions (pyo3's PanicException, CancelledError).
            raise _map_error(e, self, what) from None

    @staticmethod
    def _buf(data: bytes):
        from zarr.core.buffer import default_buffer_prototype

        return default_buffer_prototype().buffer.from_bytes(data)

    @staticmethod
    def _art(key: str, rel: str = "") -> str:
        return artifact_prefix(key) + rel

    async def _set(self, path: str, data: bytes) -> None:
        await self.zstore.set(path, self._buf(data))

    async def _get(self, path: str, limit: int | None = None) -> bytes | None:
        """The object's bytes, None if absent; with ``limit``, never downloads more than limit+1."""
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype

        rng = RangeByteRequest(0, limit + 1) if limit is not None else None
        try:
            buf = await self.zstore.get(path, default_buffer_prototype(), rng)
        except Exception as e:
            # A range request on an empty object. Matched on the server's answer, never on a bare
            # "416": that is also in an endpoint such as 127.0.0.1:41653 whose connect was refused.
            if "InvalidRange" in str(e) or "416 Range Not Satisfiable" in str(e):
                return b""
            raise
        if buf is None:
            return None
        data = buf.to_bytes()
        if limit is not None and len(data) > limit:
            raise IntegrityError(f"{self.url}/{path} is larger than {limit} bytes, more than its manifest "
                                 "allows; the remote copy is damaged or hostile.",
                                 fix="Delete it there and push a good copy.")
        return data

    async def _create(self, path: str, data: bytes) -> bool:
        """Create-if-absent: one conditional PUT (If-None-Match: *), decided by the server.

        The same obstore call ``ObjectStore.set_if_not_exists`` makes, minus its suppression of
        AlreadyExistsError: we need to know who won without a second request.
        """
        import obstore as obs

        try:
            await obs.put_async(self._obs, path, data, mode="create")
            return True
        except obs.exceptions.AlreadyExistsError:
            return False

    async def _exists(self, path: str) -> bool:
        return await self.zstore.exists(path)

    async def _list(self, prefix: str) -> list[dict]:
        import obstore as obs

        return await obs.list(self._obs, prefix=prefix.rstrip("/") or None).collect_async()

    async def _head(self, path: str) -> dict | None:
        import obstore as obs

        try:
            return await obs.head_async(self._obs, path)
        except FileNotFoundError:
            return None

    async def _list_dir(self, prefix: str) -> list[str]:
        return [name async for name in self.zstore.list_dir(prefix)]

    async def _copy(self, src: str, dst: str) -> None:
        import obstore as obs

        await obs.copy_async(self._obs, src, dst, overwrite=True)

    async def _delete_many(self, paths: list[str]) -> None:
        import obstore as obs

        paths = list(paths)
        for i in range(0, len(paths), 1000):  # DeleteObjects takes at most 1000 keys
            await obs.delete_async(self._obs, paths[i:i + 1000])

    @staticmethod
    async def _gather(coros) -> list:
        sem = asyncio.Semaphore(IO_CONCURRENCY)

        async def one(c):
            async with sem:
                return await c

        return await asyncio.gather(*(one(c) for c in coros))

    async def _check_format(self) -> None:
        if self._format_checked:
            return
        try:
            raw = await self._get(STORE_MARKER, limit=MAX_MARKER_BYTES)
        except IntegrityError:
            raise damaged_marker(f"{self.url}/{STORE_MARKER}", f"larger than {MAX_MARKER_BYTES} bytes") from None
        if raw is not None:
            check_store_marker(raw, self.url, endpoint_url=self.endpoint)
        self._format_checked = True

    async def _ensure_marker(self) -> None:
        if not self._marker_written:
            await self._create(STORE_MARKER, store_marker_bytes())
            self._marker_written = True

    async def _acquire_lease(self, key: str, writer: str) -> _Lease | None:
        """Wait for and take ``locks/<key>.lease``; None if the key got published meanwhile."""
        lease = _Lease(self, key, writer)
        seen, seen_since, delay = None, time.monotonic(), 0.02
        give_up = time.monotonic() + LEASE_WAIT_S
        while True:
            if await lease.try_create():
                return lease
            current = await self._get(lease.path, limit=1 << 16)
            if await self._exists(self._art(key, MANIFEST)):
                return None
            if current is None:
                continue  # released between our PUT and GET: try again at once
            if await lease.take_over_if_gone(current):
                continue  # its writer was a process of this machine that is gone (a killed rank)
            if time.monotonic() > give_up:
                try:
                    holder = json.loads(current)
                    who = f"host {holder.get('host')}, pid {holder.get('pid')}"
                except (ValueError, AttributeError):
                    who = "unknown"
                raise NetworkError(f"another writer ({who}) has been writing {key} to {self.url} for over "
                                   f"{LEASE_WAIT_S:.0f} s and still holds its lease; run this again when it is "
                                   "done.", url=self.url)
            if current != seen:
                seen, seen_since = current, time.monotonic()
            elif time.monotonic() - seen_since > LEASE_STALE_S:
                # Unchanged for a whole stale period on our clock: its writer died.
                if await self._get(lease.path, limit=1 << 16) == seen:
                    await self.zstore.delete(lease.path)
                seen = None
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    # -- the Backend interface

    def read_manifest(self, key: str) -> bytes | None:
        if not KEY_PATTERN.match(key):
            return None

        async def go():
            await self._check_format()
            return await self._get(self._art(key, MANIFEST), limit=MAX_MANIFEST_BYTES)

        return self._run(go(), f"reading manifest {key[:12]} from")

    def iter_manifests(self) -> Iterator[tuple[str, bytes]]:
        async def go():
            await self._check_format()
            shards = [s for s in await self._list_dir(ARTIFACTS) if re.fullmatch(r"[0-9a-f]{2}", s)]
            per_shard = await self._gather(self._list_dir(f"{ARTIFACTS}/{s}") for s in shards)
            keys = sorted(k for names in per_shard for k in names if KEY_PATTERN.match(k))
            raws = await self._gather(self._get(self._art(k, MANIFEST), limit=MAX_MANIFEST_BYTES) for k in keys)
            return [(k, raw) for k, raw in zip(keys, raws) if raw is not None]

        yield from self._run(go(), "listing")

    def read_file(self, key: str, relpath: str) -> bytes:
        return self.read_file_limited(key, relpath, None)

    def read_file_limited(self, key: str, relpath: str, limit: int | None) -> bytes:
        """Like ``read_file`` but downloads at most ``limit`` bytes (IntegrityError if larger)."""
        check_relpath(relpath)
        data = self._run(self._get(self._art(key, relpath), limit=limit), f"reading {relpath} of {key[:12]} from")
        if data is None:
            raise FileNotFoundError(f"{self.url}/{self._art(key, relpath)}")
        return data

    def list_files(self, key: str) -> dict[str, int]:
        base = self._art(key)
        metas = self._run(self._list(base), "listing")
        return {m["path"][len(base):]: int(m["size"]) for m in metas}

    def delete(self, key: str) -> bool:
        if not KEY_PATTERN.match(key):
            return False

        async def go():
            base = self._art(key)
            existed = await self._exists(base + MANIFEST)
            if existed:
                # The manifest goes first: from that instant no reader sees the artifact.
                await self.zstore.delete(base + MANIFEST)
            await self._delete_many([m["path"] for m in await self._list(base)])
            return existed

        return self._run(go(), f"deleting {key[:12]} from")

    def open_staging(self, key: str, resumable: bool = False) -> Staging:
        if resumable:
            raise UsageError(f"resumable writes are not supported on object stores ({self.url}); write to a "
                             "local store (--store PATH) and `dfcache push` the result.")
        if not KEY_PATTERN.match(key):
            raise UsageError(f"{key!r} is not a key (32 hex digits).")
        self._run(self._check_format(), "opening")
        return _ObjectStaging(self, key)

    def list_temporaries(self) -> list[Temporary]:
        async def go():
            return await asyncio.gather(self._list(STAGING), self._list(ARTIFACTS), self._list(LOCKS))

        staging, artifacts, locks = self._run(go(), "listing temporaries in")
        now = _dt.datetime.now(_dt.timezone.utc)
        groups: dict[str, list[dict]] = {}
        for m in staging:
            parts = m["path"].split("/")
            groups.setdefault("/".join(parts[:2]), []).append(m)
        by_key: dict[str, list[dict]] = {}
        for m in artifacts:
            parts = m["path"].split("/")
            if len(parts) >= 4:
                by_key.setdefault("/".join(parts[:3]), []).append(m)
        fresh_leases = {m["path"].split("/")[-1][: -len(LEASE_SUFFIX)] for m in locks
                        if (now - m["last_modified"]).total_seconds() < LEASE_STALE_S}
        for name, metas in by_key.items():
            if not any(m["path"].endswith("/" + MANIFEST) and m["path"].count("/") == 3 for m in metas):
                groups[name] = metas
        out = []
        for name, metas in sorted(groups.items()):
            newest = max(m["last_modified"] for m in metas)
            key = name.split("/")[-1].split(".")[0]
            out.append(Temporary(name=name, size_bytes=sum(int(m["size"]) for m in metas),
                                 age_s=(now - newest).total_seconds(),
                                 in_use=name.startswith(ARTIFACTS + "/") and key in fresh_leases, resumable=False))
        for m in locks:
            age = (now - m["last_modified"]).total_seconds()
            out.append(Temporary(name=m["path"], size_bytes=int(m["size"]), age_s=age,
                                 in_use=age < LEASE_STALE_S, resumable=False))
        return out

    def remove_temporary(self, name: str, grace_s: float = 60.0) -> bool:
        if not _TEMP_NAME.match(name):
            return False

        async def go():
            now = _dt.datetime.now(_dt.timezone.utc)
            if name.startswith(LOCKS + "/"):
                head = await self._head(name)
                metas = [head] if head else []
                min_age = max(grace_s, LEASE_STALE_S)
            else:
                metas = await self._list(name)
                min_age = grace_s
            if not metas:
                return False
            newest = max(m["last_modified"] for m in metas)
            # Ages come from the server's clock; the grace period absorbs modest skew.
            if (now - newest).total_seconds() < min_age:
                return False
            if name.startswith(ARTIFACTS + "/"):
                key = name.split("/")[-1]
                if await self._exists(name + "/" + MANIFEST):
                    return False  # became an artifact meanwhile
                lease = await self._head(lock_relpath(key, LEASE_SUFFIX))
                if lease and (now - lease["last_modified"]).total_seconds() < LEASE_STALE_S:
                    return False  # a live publisher is copying into it
            await self._delete_many([m["path"] for m in metas])
            return True

        return self._run(go(), "removing temporaries in")

