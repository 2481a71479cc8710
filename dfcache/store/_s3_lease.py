"""The write lease of an S3 store: ``locks/<key>.lease``, see :mod:`dfcache.store._s3`."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from typing import Any, Protocol

from ..errors import DfcacheError, NetworkError
from .layout import LEASE_SUFFIX, lock_relpath

LEASE_STALE_S = 120.0
LEASE_REFRESH_S = 20.0
LEASE_MARGIN_S = 40.0  # how late a write may land after it started (request timeouts, retries)
LEASE_WAIT_S = 600.0  # how long a publisher waits for another live writer of the same key

_HERE: dict = {}  # pid -> this process's place (see _place), read once per process


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), None if
    there is no such process here (or no /proc)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _place() -> dict:
    """What tells this process apart from every other process that could hold a lease: the
    machine's boot, the PID namespace (containers on one machine share a boot), the pid and its
    start time (a pid is reused). Empty where /proc cannot tell (another OS)."""
    pid = os.getpid()
    got = _HERE.get(pid)
    if got is None:
        boot = (_read("/proc/sys/kernel/random/boot_id") or "").strip()
        try:
            pidns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pidns = ""
        start = _start_time(pid)
        got = _HERE[pid] = {"boot": boot, "pidns": pidns, "start": start} if boot and pidns and start else {}
    return got


def holder_gone(body: bytes | None) -> bool:
    """Whether a lease was written by a process of this very boot and PID namespace that no longer
    runs (its pid is gone, or is another process's now). Such a lease is dead at once; one of any
    other process, here or elsewhere, is dead only once it has not changed for ``LEASE_STALE_S``."""
    here = _place()
    if not here or not body:
        return False
    try:
        held = json.loads(body)
        if held.get("boot") != here["boot"] or held.get("pidns") != here["pidns"] or not held.get("start"):
            return False
        return _start_time(int(held["pid"])) != held["start"]
    except (ValueError, TypeError, KeyError, AttributeError):
        return False


class LeaseBackend(Protocol):
    """What a lease needs of its store (``_s3.ObjectStoreBackend`` is one): its URL, a way to run
    a request, and single-object reads, writes, creates-if-absent and deletes."""

    url: str
    zstore: Any  # zarr's ObjectStore over the bucket: ``await zstore.delete(path)``

    def _run(self, coro, what: str): ...

    async def _get(self, path: str, limit: int | None = None) -> bytes | None: ...

    async def _set(self, path: str, data: bytes) -> None: ...

    async def _create(self, path: str, data: bytes) -> bool: ...


class _Lease:
    """``locks/<key>.lease``: the right to write under ``artifacts/<key[:2]>/<key>/``.

    A holder rewrites it every ``LEASE_REFRESH_S`` from a heartbeat thread, so waiters see it is
    live. A waiter takes a lease over only after seeing the same body for ``LEASE_STALE_S`` on
    its own clock, which starts after our last write landed; so until ``safe_until`` (last write
    started + stale period - margin for a slow request) nobody else can hold it. Past that, the
    holder checks with a GET before writing again.
    """

    def __init__(self, backend: LeaseBackend, key: str, writer: str) -> None:
        self.backend = backend
        self.key = key
        self.path = lock_relpath(key, LEASE_SUFFIX)
        self.writer = writer
        self.n = 0
        self.body = self._make_body()
        self.safe_until = 0.0
        self.lost = False
        self.released = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._alock: asyncio.Lock | None = None  # heartbeat and writer refresh on one event loop

    def _make_body(self) -> bytes:
        return json.dumps({"writer": self.writer, "host": socket.gethostname(), "pid": os.getpid(),
                           "n": self.n, **_place()}).encode()

    async def take_over_if_gone(self, current: bytes | None) -> bool:
        """Delete the lease if ``current``, what it holds now, is a dead process's of this machine
        (:func:`holder_gone`) and is still what it holds. True if it was deleted."""
        if not holder_gone(current) or await self.backend._get(self.path, limit=1 << 16) != current:
            return False
        await self.backend.zstore.delete(self.path)
        return True

    async def try_create(self) -> bool:
        started = time.monotonic()
        if await self.backend._create(self.path, self.body):
            self.safe_until = started + LEASE_STALE_S - LEASE_MARGIN_S
            return True
        return False

    async def refresh(self) -> None:
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            if self.lost or self.released:
                return
            started = time.monotonic()
            if started >= self.safe_until and await self.backend._get(self.path, limit=1 << 16) != self.body:
                self.lost = True
                return
            self.n += 1
            body = self._make_body()
            await self.backend._set(self.path, body)
            self.body = body
            self.safe_until = started + LEASE_STALE_S - LEASE_MARGIN_S

    def ensure_held(self) -> None:
        """Before writing under the artifact's prefix: raise if another writer may own it now."""
        if self.lost or time.monotonic() >= self.safe_until:
            self.backend._run(self.check(), f"refreshing the write lease of {self.key[:12]} on")

    async def check(self) -> None:
        if not self.lost and time.monotonic() >= self.safe_until:
            await self.refresh()
        if self.lost:
            raise NetworkError(f"lost the write lease of {self.key} on {self.backend.url} (no contact with the "
                               f"server for over {LEASE_STALE_S:.0f} s, and another writer took over). Nothing "
                               "of ours was published; run the command again.", url=self.backend.url)

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name=f"dfcache-lease-{self.key[:8]}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(LEASE_REFRESH_S) and not self.lost:
            try:
                self.backend._run(self.refresh(), "refreshing a write lease on")
            except DfcacheError:
                pass  # try again next period; ensure_held stops writes if it stays unreachable

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours (best effort, idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.lost or self.released:
            return
        self.released = True

        async def go():
            if time.monotonic() < self.safe_until or await self.backend._get(self.path, limit=1 << 16) == self.body:
                await self.backend.zstore.delete(self.path)

        try:
            self.backend._run(go(), "releasing a write lease on")
        except DfcacheError:
            pass  # a lease we cannot delete goes stale and is taken over, or removed by gc

