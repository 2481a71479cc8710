"""Reading committed artifacts: :class:`Artifact` (a manifest and its files) and
:class:`ArrayReader` (rows of one array, reading only the chunks they touch). Every file is
checked with the format's own checks (:mod:`dfcache.store.format`) before it is used; local
uncompressed chunks take the fast paths (one ``pread`` each into the result, reader threads,
memory maps, page-cache loading in ``_pagecache``), checked once per store by their digest and
remembered by each file's signature.
"""

from __future__ import annotations

import json
import os
import stat
from typing import TYPE_CHECKING, Any

from .._lazy import LazyModule
from ..errors import ArtifactNotFoundError, IntegrityError, UsageError
from ..fp8 import FP8_DTYPE
from ..manifest import STORAGE_DTYPE, ArraySpec, Manifest
from . import _pagecache
from . import format as fmt
from ._files import OPEN_FLAGS, NotRegularFile, read_regular
from ._pools import recycled_empty, scratch, thread_pool
from .layout import chunk_prefix

if TYPE_CHECKING:
    from ._store import Store

np = LazyModule("numpy")  # imported by the first array read: opening a store and its manifests needs none

MAPPED_CHUNKS = 512  # mapped chunks kept per store: address space only, the page cache holds the data
VERIFIED_CHUNKS = 1 << 18  # chunk files a store remembers having checked (~40 MB at most)
READ_SPLIT_BYTES = 4 << 20  # a read of at least this much is shared with the reader threads
LOAD_THREADS = 4  # chunk files loaded into the page cache at once by a cold read (they wait on the disk, not a core)


def _load_and_close(fd: int, size: int) -> None:
    try:
        _pagecache.load_large(fd, size)
    finally:
        os.close(fd)


def _read_workers() -> int:
    """Threads beside the caller that read and check chunk files of one large read (the pread
    and the xxh3 of the digest check both release the GIL), so a read uses the machine's idle
    cores: the cores no runnable thread of the system wants now (``/proc/loadavg``'s running
    count, ours included) but one, up to 3. On a busy machine a helper thread waits for a core
    while the caller waits for it, and two threads copying at once share the memory bandwidth
    (issue 36, the 2-core VM: a warm 17 MB read split over two threads took 1.3x the CPU time
    of one thread's, and 6.6 ms against 2.9 ms of wall time at load 8; at most 4% faster at load
    5): a 2-core machine reads on the caller's thread."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores < 2:
        return 0
    try:
        with open("/proc/loadavg", "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])  # "0.50 0.40 0.30 3/512 1234": 3 runnable now
    except (OSError, ValueError, IndexError):
        running = 1  # (no /proc: as if idle)
    return max(0, min(3, cores - max(1, running) - 1))


RACY_NS = 2_000_000_000  # a file changed this recently may change again within one timestamp tick


def _signature(st: os.stat_result) -> tuple:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _settled(st: os.stat_result) -> bool:
    """Whether a check of this file may be remembered by its signature: file times advance by
    the kernel's coarse clock tick, so a file rewritten within the tick of its last change (a
    fresh commit, then a byte flipped in place) keeps its signature. A check made within
    ``RACY_NS`` of the last change is not remembered (as git treats a racy index entry)."""
    import time

    return time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS


def _pread_full(fd: int, buf: np.ndarray, offset: int) -> int:
    """Read ``buf.nbytes`` bytes at ``offset`` (short only at the end of the file)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def repair_hint(key: str) -> str:
    """How to get past a corrupt or incomplete local artifact: the fix of every such error."""
    return (f"Delete it with `dfcache gc --key {key[:12]} --yes` and run again to recompute it, or pull "
            "it again.")


class ArrayReader:
    """Read-only view of a committed array; slicing rows reads only the chunks they touch."""

    def __init__(self, artifact: "Artifact", name: str, spec: ArraySpec) -> None:
        self.artifact = artifact
        self.name = name
        self.spec = spec
        self.shape = tuple(spec.shape)
        self.dtype = spec.dtype
        self.chunk_rows = spec.chunk_rows
        self._ndim = len(self.shape)
        self._storage = np.dtype(STORAGE_DTYPE[spec.dtype])
        self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self._storage.itemsize
        self._file_bytes = self.chunk_rows * self._row_bytes + 4  # an uncompressed chunk file: body, crc32c

    def __len__(self) -> int:
        return self.shape[0]

    def _check_meta(self) -> None:
        """Once per store and array: the array's zarr.json agrees with the manifest."""
        key = self.artifact.key
        checked = self.artifact.store._meta_checked
        if (key, self.name) in checked:
            return
        try:
            fmt.parse_array_meta(self.artifact._read(fmt.array_meta_relpath(self.name)), self.spec, self.name, key)
        except FileNotFoundError:
            raise IntegrityError(f"array {self.name} of artifact {key} is corrupt: zarr.json is missing.",
                                 key=key, fix=repair_hint(key)) from None
        except IntegrityError as e:
            raise e.with_fix(repair_hint(key)) from None
        checked.add((key, self.name))

    def _chunk(self, index: int) -> np.ndarray:
        """Chunk ``index``'s logical rows, read and checked in full (crc32c, decoded size,
        digest): the path of compressed and remote chunks, and of any local chunk whose fast
        read failed, which it then names exactly."""
        self._check_meta()
        key = self.artifact.key
        rel = fmt.chunk_relpath(self.name, index, self._ndim)
        where = f"chunk {index} of array {self.name} in artifact {key}"
        try:
            data = self.artifact._read(rel)
        except FileNotFoundError:
            raise IntegrityError(f"{where} is missing; the artifact is incomplete.", key=key,
                                 fix=repair_hint(key)) from None
        except IntegrityError as e:
            raise e.with_fix(repair_hint(key)) from None
        try:
            return fmt.check_chunk(self.spec, self.name, index, data, key)
        except IntegrityError as e:
            fix = repair_hint(key)
            if e.reason == fmt.MOVED:  # the artifact it came from (or went to) is wrong too
                fix += " `dfcache verify` finds every artifact affected; `dfcache gc --bad --yes` removes them all."
            raise e.with_fix(fix) from None

    def read_raw(self, start: int = 0, stop: int | None = None, *, out: np.ndarray | None = None,
                 mapped: bool = False, copy=None) -> np.ndarray:
        """Rows [start, stop) in the storage dtype (bf16 comes back as its uint16 bits).

        ``out``: an array of at least that many rows (storage dtype, row shape) to read into,
        e.g. a buffer reused across reads or the columns of a wider one (``big[:, 0:1024]``);
        the rows read are returned as a view of it.

        Local uncompressed chunks are read with one ``pread`` each, straight into the result, the
        chunk files not in the page cache first set loading all at once (in large folios where
        the kernel allows, so later warm reads of them copy as fast as of freshly written ones;
        see ``_pagecache``); a read of 4 MiB or more is split into runs of
        chunks read and checked on reader threads beside the caller's (one per further core, up
        to 3). Each chunk file is checked against the manifest's digest of its rows (intact, and
        the chunk of this place: artifact, array, position) the first time this store reads it,
        and the check is remembered by the file's inode, size, mtime and ctime, so a later read
        reads only the rows it needs (a file rewritten or replaced is checked again; one
        corrupted in place without any of those changing is not noticed until the store is
        reopened, and ``verify`` still checks everything). Without ``out``, a result of 1 MiB or more lives in
        a recycled buffer: one whose previous result (and everything made from it) is gone.

        ``mapped=True`` (local, uncompressed chunks): chunk files are memory-mapped and checked
        against their digest the first time this store maps them, not on every read; rows are then
        copied straight from the page cache into ``out``. For many small random reads over the
        same chunks (training). Each use ``stat``s the file: one whose signature changed since
        its check is mapped and checked again (``verify`` still checks everything).

        ``copy(dst, src)`` (with ``mapped``): what copies mapped rows into ``out``, in place of
        numpy's assignment; a caller that has torch passes its copy, faster into the columns of a
        wider ``out`` (``dfcache.training.copy_rows``)."""
        n = self.shape[0]
        stop = n if stop is None else min(stop, n)
        start = max(0, start)
        rows = max(0, stop - start)
        if out is None:
            out = recycled_empty((rows,) + self.shape[1:], self._storage)
        else:
            if out.dtype != self._storage or out.shape[1:] != self.shape[1:] or len(out) < rows:
                raise UsageError(f"out= must be a {self._storage} array of at least {rows} rows of shape "
                                 f"{self.shape[1:]}.")
            out = out[:rows]
        if stop <= start:
            return out
        c0, c1 = start // self.chunk_rows, (stop - 1) // self.chunk_rows
        if mapped:
            for i in range(c0, c1 + 1):
                lo = i * self.chunk_rows
                a, b = max(lo, start), min(lo + self.chunk_rows, stop)
                chunk = self._mapped_chunk(i)
                if chunk is None:
                    chunk = self._chunk(i)
                if copy is None:
                    out[a - start:b - start] = chunk[a - lo:b - lo]
                else:
                    copy(out[a - start:b - start], chunk[a - lo:b - lo])
            return out
        todo = list(range(c0, c1 + 1))
        if self.spec.codec == "none" and self.artifact._local_dir() is not None:
            self._check_meta()
            groups = 1 + _read_workers() if rows * self._row_bytes >= READ_SPLIT_BYTES else 1
            groups = min(groups, len(todo))
            if groups > 1:  # contiguous runs of chunks, the caller's thread reading the first
                cut = [len(todo) * g // groups for g in range(groups + 1)]
                pool = thread_pool("read", groups - 1)
                futures = [pool.submit(self._read_run, todo[cut[g]:cut[g + 1]], start, stop, out)
                           for g in range(1, groups)]
                done = [self._read_run(todo[cut[0]:cut[1]], start, stop, out)]
                done += [f.result() for f in futures]
            else:
                done = [self._read_run(todo, start, stop, out)]
            self._remember(v for verified, _ in done for v in verified)
            todo = [i for _, failed in done for i in failed]
        for i in todo:  # not local, missing or failing its check: _chunk() says what is wrong
            lo = i * self.chunk_rows
            a, b = max(lo, start), min(lo + self.chunk_rows, stop)
            out[a - start:b - start] = self._chunk(i)[a - lo:b - lo]
        return out

    def _read_run(self, chunks: list[int], start: int, stop: int, out: np.ndarray) -> tuple[list, list[int]]:
        """Chunks' rows of [start, stop) into ``out`` (run on any thread; each run opens its own
        files, so a reader thread starts at once). Returns the chunk files checked now (to
        remember) and the chunks to read through _chunk()."""
        verified, failed = [], []
        fds, loads = self._open_local(chunks)
        try:
            for i in chunks:
                lo = i * self.chunk_rows
                a, b = max(lo, start), min(lo + self.chunk_rows, stop)
                fd = fds.get(i)
                if i in loads:
                    loads[i].result()
                sig = self._read_local(fd, i, a, b, out[a - start:b - start]) if fd is not None else False
                if sig is False:
                    failed.append(i)
                elif sig is not True:
                    verified.append(sig)
        finally:
            for load in loads.values():  # a load still running uses its descriptor
                load.result()
            for fd in fds.values():
                os.close(fd)
        return verified, failed

    def _remember(self, verified) -> None:
        store = self.artifact.store
        for ck, sig in verified:
            if len(store._verified) >= VERIFIED_CHUNKS:
                store._verified.pop(next(iter(store._verified)))
            store._verified[ck] = sig

    def prefetch(self, start: int = 0, stop: int | None = None) -> None:
        """Start loading the chunk files of rows [start, stop) that this store has not mapped
        yet and that are not already in the page cache, and return at once (on loader threads
        in large folios where the system allows, see _pagecache; else POSIX_FADV_WILLNEED). A
        reader of several arrays calls it on each before reading any, so the files of one sample
        load in parallel instead of one blocking read after another; a no-op for remote or
        already mapped chunks."""
        if self.spec.codec != "none" or not hasattr(os, "posix_fadvise"):
            return
        n = self.shape[0]
        stop = n if stop is None else min(stop, n)
        if stop <= start:
            return
        mapped = self.artifact.store._mapped
        large = _pagecache.available()
        for i in range(max(0, start) // self.chunk_rows, (stop - 1) // self.chunk_rows + 1):
            if (self.artifact.key, self.name, i) in mapped:
                continue
            path = self.artifact._local_path(fmt.chunk_relpath(self.name, i, self._ndim))
            if path is None:
                return
            try:
                fd = os.open(path, OPEN_FLAGS)  # (O_NONBLOCK: a FIFO planted as a chunk must not hang)
            except OSError:
                continue  # the read reports it
            if large and _pagecache.missing_pages(fd, self._file_bytes):
                thread_pool("load", LOAD_THREADS).submit(_load_and_close, fd, self._file_bytes)
                continue
            try:
                if not large:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def _mapped_chunk(self, index: int) -> np.ndarray | None:
        """An uncompressed local chunk's rows over a read-only mmap, checked against its digest
        (fmt.rows_match) when first mapped by this store, then kept (a bounded number per store)
        while the file's signature (inode, size, mtime, ctime; one ``stat`` per use) stays what it
        was when checked: a file changed on disk is mapped and checked again. None: use _chunk()."""
        if self.spec.codec != "none":
            return None
        store = self.artifact.store
        ck = (self.artifact.key, self.name, index)
        hit = store._mapped.get(ck)
        if hit is not None:
            try:
                if _signature(os.stat(hit[1])) == hit[2]:
                    return hit[0]
            except OSError:
                pass
            store._mapped.pop(ck, None)
        self._check_meta()
        path = self.artifact._local_path(fmt.chunk_relpath(self.name, index, self._ndim))
        if path is None:
            return None
        import mmap

        body = self._file_bytes - 4
        loaded = False
        try:
            fd = os.open(path, OPEN_FLAGS)
        except OSError:
            return None  # _chunk() reports what is wrong
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            if _pagecache.missing_pages(fd, st.st_size):
                loaded = _pagecache.load_large(fd, st.st_size)
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if not loaded and hasattr(mm, "madvise"):  # one large read-ahead for the check, not a fault per few pages
            mm.madvise(mmap.MADV_WILLNEED)
        raw = np.frombuffer(mm, dtype=np.uint8)
        if len(raw) != body + 4 or not fmt.rows_match(raw[:body], self.spec, index):
            del raw
            mm.close()
            return None  # _chunk() re-reads it and says exactly what is wrong
        arr = raw[:body].view(self._storage.newbyteorder("<")).reshape((self.chunk_rows,) + self.shape[1:])
        if _settled(st):  # (an unsettled file is checked again on its next read)
            if len(store._mapped) >= MAPPED_CHUNKS:
                store._mapped.pop(next(iter(store._mapped)))  # the mapping closes with its last view
            store._mapped[ck] = (arr, os.fspath(path), _signature(st))
        return arr

    def map_rows(self, start: int, stop: int) -> np.ndarray | None:
        """Rows [start, stop) with no copy: a private (copy-on-write) memory map of just those
        rows of their chunk file, or None when they are not in one local uncompressed chunk
        whose check this store remembers (then read them with ``read_raw``).

        The chunk is checked against its digest when the store first maps it (as
        ``read_raw(mapped=True)``), and the file this map is made from is the one checked (same
        signature). Writing to the result changes this process's copy of the pages, never the
        file or another result; the pages are read from the page cache on first touch, as
        ``torch.load(mmap=True)`` does."""
        if self.spec.codec != "none" or stop <= start or start < 0 or stop > self.shape[0]:
            return None
        index = start // self.chunk_rows
        if (stop - 1) // self.chunk_rows != index or self._mapped_chunk(index) is None:
            return None
        hit = self.artifact.store._mapped.get((self.artifact.key, self.name, index))
        if hit is None:  # checked now but too fresh to remember (see _settled): read_raw reads it
            return None
        import mmap

        try:
            fd = os.open(hit[1], OPEN_FLAGS)
        except OSError:
            return None
        try:
            if _signature(os.fstat(fd)) != hit[2]:
                return None  # replaced since it was checked: read_raw checks the new file
            row_bytes = self._row_bytes
            a = (start - index * self.chunk_rows) * row_bytes
            b = a + (stop - start) * row_bytes
            lo = a - a % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(fd, b - lo, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=lo)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        rows = np.frombuffer(mm, dtype=self._storage.newbyteorder("<"), count=(b - a) // self._storage.itemsize,
                             offset=a - lo)  # the map closes with the last view of it
        return rows.reshape((stop - start,) + tuple(self.shape[1:]))

    def _open_local(self, chunks: list[int]) -> tuple[dict[int, int], dict]:
        """Descriptors of the local uncompressed chunks ``chunks`` (a missing one left out:
        _chunk() reports it), and for a read of several chunks the files not in the page cache
        set loading at once, so a cold read has every chunk in flight instead of one file's
        readahead at a time: each on a loader thread in large folios where the system allows
        (see _pagecache; returned as futures by chunk), else by POSIX_FADV_WILLNEED."""
        prefix, suffix = chunk_prefix(self.name), "/0" * (self._ndim - 1)
        fds: dict[int, int] = {}
        for i in chunks:
            fd = self.artifact._open_local(f"{prefix}{i}{suffix}")
            if fd is not None:
                fds[i] = fd
        loads: dict = {}
        if len(chunks) < 2:
            return fds, loads
        if _pagecache.available():
            for i, fd in fds.items():
                if _pagecache.missing_pages(fd, self._file_bytes):
                    loads[i] = thread_pool("load", LOAD_THREADS).submit(_pagecache.load_large, fd, self._file_bytes)
            return fds, loads
        for fd in fds.values():
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except (AttributeError, OSError):
                pass
        return fds, loads

    def _read_local(self, fd: int, index: int, a: int, b: int, dest: np.ndarray):
        """Rows [a, b) of uncompressed local chunk ``index`` into ``dest``. The chunk is checked
        against its digest (fmt.rows_match) the first time this store reads the file (known by
        inode, size, mtime, ctime); after that only the rows asked for are read. Returns True (read, known good), the
        (chunk, signature) to remember (read and checked now), or False: use _chunk(), which
        says what is wrong. Safe on any thread: it records nothing itself."""
        store = self.artifact.store
        row_bytes = self._row_bytes
        body = self.chunk_rows * row_bytes
        lo = index * self.chunk_rows
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False  # a FIFO or a directory in a chunk's place: _chunk() says so
        sig = _signature(st)
        ck = (self.artifact.key, self.name, index)
        contiguous = dest.flags.c_contiguous
        if store._verified.get(ck) == sig:
            want = (b - a) * row_bytes
            buf = dest.reshape(-1).view(np.uint8) if contiguous else scratch(want)
            if _pread_full(fd, buf, (a - lo) * row_bytes) != want:
                return False
            if not contiguous:
                dest[...] = buf.view(self._storage.newbyteorder("<")).reshape(dest.shape)
            return True
        whole = contiguous and a == lo and b - lo == self.chunk_rows
        if contiguous and not whole:
            # Part of the chunk: its rows straight into dest and the rest aside, one system call,
            # the digest over the pieces in order (no copy of the chunk put together first).
            head, want = (a - lo) * row_bytes, (b - a) * row_bytes
            aside = scratch(body - want)
            pieces = [aside[:head], dest.reshape(-1).view(np.uint8), aside[head:]]
            trailer = bytearray(5)
            got = os.preadv(fd, [p for p in pieces if len(p)] + [trailer], 0)
            if got != body + 4:
                return self._read_local_whole(fd, index, a, b, dest, st, ck)  # short read (rare)
            if not fmt.rows_match_pieces(pieces, self.spec, index):
                return False
            return (ck, sig) if _settled(st) else True
        return self._read_local_whole(fd, index, a, b, dest, st, ck)

    def _read_local_whole(self, fd: int, index: int, a: int, b: int, dest: np.ndarray, st: os.stat_result,
                          ck: tuple):
        """_read_local's check of a chunk read whole (into dest when it is all of dest, else aside
        and the rows copied out)."""
        row_bytes = self._row_bytes
        body = self.chunk_rows * row_bytes
        lo = index * self.chunk_rows
        whole = dest.flags.c_contiguous and a == lo and b - lo == self.chunk_rows
        buf = dest.reshape(-1).view(np.uint8) if whole else scratch(body)
        # The body and the crc32c after it in one system call (the fifth byte asked for must not
        # come: the file ends there); a short read (rare) is finished one call at a time.
        trailer = bytearray(5)
        got = os.preadv(fd, [buf, trailer], 0)
        if got != body + 4 and (got >= body or _pread_full(fd, buf, 0) != body or len(os.pread(fd, 5, body)) != 4):
            return False  # not a chunk file of this array's size
        # The manifest's digest of this chunk's rows: bytes intact *and* the file the manifest
        # names for this place (a chunk moved from another array keeps a valid crc32c). One pass,
        # in place of the crc32c: xxh3 is the faster (docs/format.md); verify checks the crc too.
        if not fmt.rows_match(buf, self.spec, index):
            return False
        if not whole:
            rows = buf.view(self._storage.newbyteorder("<")).reshape((self.chunk_rows,) + self.shape[1:])
            dest[...] = rows[a - lo:b - lo]
        return (ck, _signature(st)) if _settled(st) else True

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) in the logical dtype (bf16 as ml_dtypes.bfloat16; FP8 states
        dequantized to bf16, ``read_raw`` gives their packed rows, see dfcache/fp8.py)."""
        raw = self.read_raw(start, stop)
        if self.dtype == FP8_DTYPE:
            return self._dequantize(raw).view(fmt.np_logical_dtype("bfloat16"))
        if self.dtype == "bfloat16":
            return raw.view(fmt.np_logical_dtype("bfloat16"))
        return raw

    def _dequantize(self, raw: np.ndarray) -> np.ndarray:
        """Packed FP8 rows -> bf16 bits in a recycled buffer; a large read's rows split across the
        reader threads as its chunks are (numpy releases the GIL in dfcache.fp8's ufuncs), except
        where torch's kernels run them (they use torch's intra-op threads, as many as the caller
        set: a data-loader worker's one)."""
        from .. import fp8

        out = recycled_empty((len(raw), fp8.hidden_width(raw.shape[1])), np.uint16)
        groups = 1 + _read_workers() if out.nbytes >= READ_SPLIT_BYTES and not fp8.uses_torch() else 1
        if groups == 1:
            return fp8.dequantize(raw, out=out)
        cut = [len(raw) * g // groups for g in range(groups + 1)]
        futures = [thread_pool("read", groups - 1).submit(fp8.dequantize, raw[cut[g]:cut[g + 1]], out[cut[g]:cut[g + 1]])
                   for g in range(1, groups)]
        fp8.dequantize(raw[cut[0]:cut[1]], out=out[:cut[1]])
        for f in futures:
            f.result()
        return out

    def __getitem__(self, item) -> np.ndarray:
        if isinstance(item, slice):
            start, stop, step = item.indices(self.shape[0])
            if step != 1:
                return self.read()[item]
            return self.read(start, stop)
        if isinstance(item, (int, np.integer)):
            i = int(item) + (self.shape[0] if item < 0 else 0)
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"row {item} out of range for {self.shape[0]} rows")
            return self.read(i, i + 1)[0]
        if isinstance(item, tuple) and item and isinstance(item[0], slice):
            return self[item[0]][(slice(None),) + item[1:]]
        raise TypeError("arrays are indexed by a row number or a row slice")

    def digest_problems(self) -> list[str]:
        """Re-hash every chunk; return what does not match the manifest (verify's check)."""
        art = self.artifact
        files = {rel: role for rel, role in fmt.expected_files(art.manifest).items()
                 if role.kind == "chunk" and role.name == self.name}
        return art._file_problems(files)


class Artifact:
    """A committed artifact, opened read-only."""

    def __init__(self, store: "Store", manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self.key = manifest.key
        self.stage = manifest.stage

    def _local_path(self, relpath: str):
        """The file's path when the store is a local directory (fast reads), else None."""
        return self.store.backend.local_file_path(self.key, relpath)

    def _local_dir(self) -> str | None:
        """The artifact's directory as a string (path objects cost more than reading a small
        sample's chunks), or None when the store is not local."""
        d = self.__dict__.get("_dir", False)
        if d is False:
            path = self.store.backend.local_file_path(self.key, "")
            d = self._dir = None if path is None else os.fspath(path).rstrip("/") + "/"
        return d

    def _open_local(self, relpath: str) -> int | None:
        """A read-only descriptor of a file of this local artifact (the fast read path), None if
        the store is not local or the file is missing (the caller's slow path says so)."""
        d = self._local_dir()
        if d is None:
            return None
        try:
            # O_NONBLOCK: a FIFO in a chunk's place opens at once (and is refused by the reader's
            # fstat); on regular files it changes nothing.
            return os.open(d + relpath, OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _read(self, relpath: str) -> bytes:
        """A file of this artifact; IntegrityError (no fix) if it is not a regular file, never
        blocking on one (a FIFO); FileNotFoundError if it is missing."""
        backend = self.store.backend
        path = backend.local_file_path(self.key, relpath)
        if path is not None:
            try:
                return read_regular(path)
            except NotRegularFile as e:
                raise IntegrityError(f"{relpath} of artifact {self.key} is refused: {e.problem}.",
                                     key=self.key) from None
        return backend.read_file(self.key, relpath)

    @property
    def array_names(self) -> list[str]:
        return sorted(self.manifest.arrays)

    def array(self, name: str) -> ArrayReader:
        spec = self.manifest.arrays.get(name)
        if spec is None:
            raise ArtifactNotFoundError(f"artifact {self.key} has no array {name!r} "
                                        f"(it has {', '.join(self.array_names) or 'none'}).")
        return ArrayReader(self, name, spec)

    def json(self, name: str) -> Any:
        spec = self.manifest.blobs.get(name)
        if spec is None:
            raise ArtifactNotFoundError(f"artifact {self.key} has no document {name!r}.")
        rel = fmt.blob_relpath(name)
        try:
            data = self._read(rel)
        except FileNotFoundError:
            raise IntegrityError(f"document {name} of artifact {self.key} is missing.", key=self.key,
                                 fix=repair_hint(self.key)) from None
        except IntegrityError as e:
            raise e.with_fix(repair_hint(self.key)) from None
        try:
            fmt.check_file(self.manifest, rel, fmt.FileRole("blob", name), data)
        except IntegrityError as e:
            raise e.with_fix(repair_hint(self.key)) from None
        return json.loads(data)

    def _file_problems(self, files: dict[str, fmt.FileRole]) -> list[str]:
        """Each file checked with the format's one check (the one pulls use); an array whose
        zarr.json is bad is not judged further (its chunks cannot be, against a manifest that
        disagrees with it)."""
        problems = []
        bad_arrays: set[str] = set()
        for rel, role in files.items():
            if role.kind == "chunk" and role.name in bad_arrays:
                continue
            try:
                fmt.check_file(self.manifest, rel, role, self._read(rel))
            except FileNotFoundError:
                problems.append(fmt.missing_problem(self.manifest, rel, role))
            except IntegrityError as e:
                problems.append(e.problem)
            else:
                continue
            if role.kind == "array_meta":
                bad_arrays.add(role.name)
        return problems

    def problems(self) -> list[str]:
        """Everything wrong with this artifact's bytes (empty if it verifies)."""
        return ([f"manifest of {self.key}: {p}" for p in fmt.manifest_problems(self.manifest)]
                + self._file_problems(fmt.expected_files(self.manifest)))
