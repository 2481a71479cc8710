"""The store format, version 2: names, encodings, digests and checks of an artifact's files.

Public: this is what a store *is* on disk, shared by every backend and by everything that reads
or moves artifacts (``Store`` reads, ``verify``, ``push``/``pull``), so they cannot disagree.
docs/format.md describes the same thing in prose.

Where each file is (the names of the layout, and the bounds of the marker and of a manifest) is
:mod:`dfcache.store.layout`, standard library only so that the executable's fast paths can use it;
every name there is re-exported here. A store (a directory, a ``file://`` remote, an ``s3://``
prefix)::

    dfcache-store.json                     {"format_version": 2, "kind": "dfcache-store"}
    artifacts/<key[:2]>/<key>/             one committed artifact, see artifact_prefix()

Format 2 adds segments of samples (a manifest's ``samples``/``sample_refs``, dfcache/samples/)
to format 1's artifacts, which are unchanged: ``dfcache migrate`` upgrades a format-1 store in
place (see ``MIGRATABLE`` and dfcache/store/_migrate.py). A dfcache that reads format 1 only
refuses a format-2 store rather than misread its segments (its gc would drop referenced ones).

An artifact is one zarr v3 group::

    manifest.json                 written last; its presence is what makes the artifact exist
    zarr.json                     the group (attributes {"dfcache": {"key", "stage"}})
    <array>/zarr.json             array metadata, produced by zarr itself
    <array>/c/<i>/0[/0...]        chunk i: rows [i*chunk_rows, (i+1)*chunk_rows), see chunk_relpath()
    blobs/<name>.json             small JSON documents

Each array is chunked along its first axis only. Chunks are encoded here, without going through
zarr's per-call codec pipeline (which runs at about a third of disk speed, see
shared/reference/storage-probe.md), with exactly the codecs zarr.json declares: ``bytes``
(little endian), optionally ``zstd`` or ``blosc`` (shuffle + zstd or lz4), then ``crc32c``. Any zarr v3
reader opens the result.

Digests: a chunk's digest is xxh3-128 over its logical rows (no padding) in the storage dtype; an
array's digest is xxh3-128 over its chunk digests joined by ``,``; a blob's is xxh3-128 of its
bytes.

Checks raise :class:`dfcache.errors.IntegrityError` whose message names the file and says what is
wrong, with no fix: the caller knows the fix (a local read says "delete and recompute", a pull
"push a good copy") and adds it with ``err.with_fix(...)``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import xxhash

from .._lazy import LazyModule
from ..errors import IntegrityError, UntrustedManifestError, UsageError
from ..manifest import ITEMSIZE, STORAGE_DTYPE, ArraySpec, Manifest, key_problem
from .layout import *  # noqa: F401,F403  (the layout's names are the format's: format.MANIFEST, ...)
from .layout import (BLOBS, CHUNKS, GROUP_META, MANIFEST, MARKER_KIND, STORE_MARKER, array_meta_relpath,
                     blob_relpath, chunk_relpath)

np = LazyModule("numpy")  # imported by the first chunk encoded or decoded: manifests and names need none


@functools.lru_cache(maxsize=1)
def _crc32c_impl() -> tuple:
    """(crc32c function, whether it releases the GIL), imported on first use: the ``crc32c``
    package reads its own distribution metadata when imported (importlib.metadata, tens of ms),
    which a run that checks no chunk never needs."""
    try:  # releases the GIL on large buffers: chunks are checked on reader and encoder threads
        from crc32c import crc32c

        return crc32c, True
    except ImportError:  # the same checksum (zarr's dependency), holding the GIL
        import google_crc32c

        def crc32c(data, value: int = 0) -> int:
            return google_crc32c.extend(value, data)

        return crc32c, False


def _crc32c(data, value: int = 0) -> int:
    return _crc32c_impl()[0](data, value)


def crc_releases_gil() -> bool:
    """Whether the crc32c in use releases the GIL (reads split across threads only if it does)."""
    return _crc32c_impl()[1]


def __getattr__(name: str):
    if name == "CRC_RELEASES_GIL":  # the constant this module had before the import was lazy
        return crc_releases_gil()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

FORMAT_VERSION = 2
# Store formats `dfcache migrate` upgrades in place, and what the store lacks until then.
MIGRATABLE = {1: "written before per-sample segments"}

TARGET_CHUNK_BYTES = 1 << 20  # 128 tokens at 4096 x bf16: little over-read at sample edges
ZSTD_LEVEL = 1
# Codecs written as zarr v3 `blosc`, the whole chunk one block (blosc's default blocks of tens of
# KB cost the compressor its context). On bf16 hidden states (python -m bench.codec_variants):
# shuffle-zstd (byte shuffle, zstd 1) 1.94x smaller where plain zstd gives 1.41x; bitshuffle-lz4
# (bit shuffle, lz4) 1.61x at about 2.5x shuffle-zstd's encode speed. A name fixes every
# parameter, so a manifest's codec says exactly how its chunks were encoded.
BLOSC_CODECS = {"shuffle-zstd": {"cname": "zstd", "clevel": ZSTD_LEVEL, "shuffle": "shuffle"},
                "bitshuffle-lz4": {"cname": "lz4", "clevel": 5, "shuffle": "bitshuffle"}}
_BLOSC_SHUFFLE = {"shuffle": 1, "bitshuffle": 2}  # numcodecs.blosc.SHUFFLE, BITSHUFFLE
BLOSC_HEADER = 16
MAX_META_BYTES = 1 << 20  # a zarr.json is a few hundred bytes
MAX_CHUNK_BYTES = 4 << 30  # dfcache writes ~1 MiB chunks; a manifest asking for more is refused
RESERVED_NAMES = (BLOBS, CHUNKS, GROUP_META, MANIFEST)  # array names that would collide with the layout


def format_refusal(url: str, found: Any, *, endpoint_url: str | None = None) -> UsageError:
    """The one message (exit 2) for a store of another format: the fix for an older one is
    `dfcache migrate`, for a newer one a newer dfcache."""
    import shlex

    if not isinstance(found, bool) and found in MIGRATABLE:
        cmd = f"dfcache --store {shlex.quote(url)} migrate" + (f" --endpoint-url {shlex.quote(endpoint_url)}"
                                                              if endpoint_url else "")
        return UsageError(f"store {url} has format {found} ({MIGRATABLE[found]}); this dfcache reads format "
                          f"{FORMAT_VERSION}. Upgrade it in place (every artifact is kept) with: {cmd}")
    if isinstance(found, int) and not isinstance(found, bool) and found < FORMAT_VERSION:
        return UsageError(f"store {url} has format {found}, older than any this dfcache reads or upgrades (it reads "
                          f"format {FORMAT_VERSION}). Use the dfcache that wrote it, or another store.")
    return UsageError(f"store {url} has format {found!r}; this dfcache reads format {FORMAT_VERSION}. Upgrade "
                      "dfcache or use another store.")



def store_marker_bytes() -> bytes:
    return json.dumps({"format_version": FORMAT_VERSION, "kind": MARKER_KIND}).encode() + b"\n"


def damaged_marker(where: str, why: str) -> IntegrityError:
    """The one message (exit 5) for a store marker that is not one: the store is damaged."""
    return IntegrityError(f"{where} is unreadable ({why}); the store is damaged.",
                          fix=f'Restore the file (content {{"format_version": {FORMAT_VERSION}, "kind": '
                              f'"{MARKER_KIND}"}}, or the format the store was written in) or use another store.')


def marker_format(raw: bytes, url: str, *, where: str | None = None) -> int:
    """The format version a store marker declares. Damaged (not a JSON object, no whole-number
    ``format_version``): IntegrityError, exit 5. Another program's file (a ``kind`` that is not
    dfcache's): UsageError, exit 2. A marker without ``kind`` (older stores) is dfcache's."""
    where = where or f"{url}/{STORE_MARKER}"
    try:
        info = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise damaged_marker(where, "not JSON") from None
    if not isinstance(info, dict) or "format_version" not in info:
        raise damaged_marker(where, "no format_version")
    kind = info.get("kind", MARKER_KIND)
    if kind != MARKER_KIND:
        raise UsageError(f"{url} is not a dfcache store: its {STORE_MARKER} says kind {str(kind)[:80]!r}, not "
                         f"{MARKER_KIND!r}. Check --store (or the remote URL), or pass a new directory for a new store.")
    found = info["format_version"]
    if isinstance(found, bool) or not isinstance(found, int):
        raise damaged_marker(where, f"format_version {str(found)[:40]!r} is not a whole number")
    return found


def check_store_marker(raw: bytes, url: str, *, where: str | None = None, endpoint_url: str | None = None) -> None:
    """Refuse a store whose marker is damaged (5), not dfcache's (2) or of another format (2)."""
    found = marker_format(raw, url, where=where)
    if found != FORMAT_VERSION:
        raise format_refusal(url, found, endpoint_url=endpoint_url)


def check_relpath(relpath: str) -> None:
    """Names inside an artifact are relative: no absolute paths, no empty, '.' or '..' parts."""
    if (not relpath or relpath.startswith("/") or "\\" in relpath or "\x00" in relpath
            or any(p in ("", ".", "..") for p in relpath.split("/"))):
        raise IntegrityError(f"file name {relpath!r} inside an artifact is not allowed (absolute, empty or "
                             "'..' parts); the manifest or the caller is wrong.")


# ------------------------------------------------------------------------------------ dtypes


def logical_dtype_of(arr: np.ndarray) -> str:
    if arr.dtype.name == "bfloat16":
        return "bfloat16"
    name = arr.dtype.name
    if name not in STORAGE_DTYPE:
        raise UsageError(f"dtype {name} cannot be stored; use one of {', '.join(STORAGE_DTYPE)}.")
    return name


def np_logical_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def default_chunk_rows(shape: tuple[int, ...], dtype: str) -> int:
    row_bytes = math.prod(shape[1:]) * ITEMSIZE[STORAGE_DTYPE[dtype]]
    # The power of two nearest TARGET_CHUNK_BYTES (a power of two keeps block reads aligned):
    # rounding down gave FP8 rows (hidden + 4 bytes) half-size chunks, twice the files per token
    # of bf16, and on a GPU host the store's rate is bounded by files written per second.
    rows = max(1, round(2 ** round(math.log2(max(1, TARGET_CHUNK_BYTES / max(1, row_bytes))))))
    return int(min(max(rows, 16), 1 << 20))


def chunk_raw_bytes(spec: ArraySpec) -> int:
    """Bytes of one decoded chunk (chunk_rows full rows); exact, and without numpy (every
    manifest read checks it)."""
    return spec.chunk_rows * math.prod(spec.shape[1:]) * ITEMSIZE[spec.storage_dtype]


# ------------------------------------------------------------------------------------ files


@dataclass(frozen=True)
class FileRole:
    """What one file of an artifact is: ``kind`` is group, array_meta, chunk or blob."""

    kind: str
    name: str | None = None  # the array or blob
    index: int | None = None  # the chunk


def expected_files(m: Manifest) -> dict[str, FileRole]:
    """Relative path → role of every file the manifest implies, and nothing else (group first,
    then each array's metadata and chunks, then blobs)."""
    files: dict[str, FileRole] = {GROUP_META: FileRole("group")}
    for name, spec in sorted(m.arrays.items()):
        files[array_meta_relpath(name)] = FileRole("array_meta", name)
        for i in range(spec.num_chunks):
            files[chunk_relpath(name, i, len(spec.shape))] = FileRole("chunk", name, i)
    for name in sorted(m.blobs):
        files[blob_relpath(name)] = FileRole("blob", name)
    for rel in files:  # names come from validated patterns; this states the invariant
        if rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            raise UntrustedManifestError(f"manifest of {m.key} refused: it implies the file name {rel!r}.",
                                         key=m.key)
    return files


def file_limit(m: Manifest, role: FileRole) -> int:
    """The most bytes the file may have: a reader of an untrusted copy never downloads more."""
    if role.kind in ("group", "array_meta"):
        return MAX_META_BYTES
    if role.kind == "blob":
        return m.blobs[role.name].nbytes
    spec = m.arrays[role.name]
    raw = chunk_raw_bytes(spec)
    if spec.codec != "none":
        raw += raw // 128 + (1 << 16)  # above zstd's and blosc's worst-case expansion of incompressible data
    return raw + 4  # crc32c


# ------------------------------------------------------------------------------------ encoding


@functools.lru_cache(maxsize=256)
def array_zarr_json(shape: tuple, storage_dtype: str, chunk_rows: int, codec: str, dtype: str) -> bytes:
    """zarr.json of an array, produced by zarr itself so the metadata is always what zarr reads."""
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec
    from zarr.storage import MemoryStore

    compressors: list = [ZstdCodec(level=ZSTD_LEVEL)] if codec == "zstd" else []
    if codec in BLOSC_CODECS:
        from zarr.codecs import BloscCodec

        itemsize = np.dtype(storage_dtype).itemsize
        p = BLOSC_CODECS[codec]
        compressors.append(BloscCodec(typesize=itemsize, cname=p["cname"], clevel=p["clevel"], shuffle=p["shuffle"],
                                      blocksize=_blosc_blocksize(shape, storage_dtype, chunk_rows)))
    compressors.append(Crc32cCodec())
    store = MemoryStore()
    zarr.create_array(store=store, name="a", shape=shape, dtype=storage_dtype,
                      chunks=(chunk_rows,) + tuple(shape[1:]) if shape else (1,),
                      compressors=compressors, filters=None, fill_value=0,
                      attributes={"dfcache_dtype": dtype})
    buf = store._store_dict[array_meta_relpath("a")]
    return buf.to_bytes()


def group_zarr_json(key: str, stage: str) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group",
                       "attributes": {"dfcache": {"key": key, "stage": stage}}}, indent=1).encode()


def _blosc_blocksize(shape: tuple, storage_dtype: str, chunk_rows: int) -> int:
    """One block per chunk: blosc's default blocks (tens of KB) cost zstd most of its context."""
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    return max(1, chunk_rows * row * np.dtype(storage_dtype).itemsize)


def encode_chunk(full: np.ndarray, codec: str) -> list:
    """A full (padded) chunk as the buffers of its file: body, then crc32c."""
    full = np.ascontiguousarray(full)
    raw = full.view(np.uint8).reshape(-1)
    if codec == "zstd":
        import numcodecs

        raw = np.frombuffer(numcodecs.Zstd(level=ZSTD_LEVEL).encode(raw), dtype=np.uint8)
    elif codec in BLOSC_CODECS:
        from numcodecs import blosc

        p = BLOSC_CODECS[codec]
        # blosc shuffles by the buffer's itemsize: give it the storage dtype, never bytes
        flat = full.reshape(-1) if full.dtype.itemsize > 1 else raw
        raw = np.frombuffer(blosc.compress(flat, p["cname"].encode(), p["clevel"], _BLOSC_SHUFFLE[p["shuffle"]],
                                           max(1, raw.nbytes)), dtype=np.uint8)
    crc = _crc32c(raw).to_bytes(4, "little")
    return [raw, crc]


def decode_chunk(data: bytes, codec: str, shape: tuple, storage_dtype: str, where: str,
                 key: str | None = None) -> np.ndarray:
    """The chunk's rows (padding included); IntegrityError if its crc32c, codec or size is wrong."""
    if len(data) < 4:
        raise IntegrityError(f"{where} is truncated ({len(data)} bytes).", key=key)
    body = np.frombuffer(data, dtype=np.uint8)[:-4]
    if _crc32c(body) != int.from_bytes(data[-4:], "little"):
        raise IntegrityError(f"{where} fails its crc32c checksum (corrupt or truncated).", key=key)
    if codec == "zstd":
        import numcodecs

        try:  # a chunk of zero-width rows is an empty frame, which numcodecs refuses to decode
            empty = int(np.prod(shape, dtype=np.int64)) == 0 and zstd_content_size(body) == 0
            body = np.frombuffer(b"" if empty else numcodecs.Zstd().decode(body), dtype=np.uint8)
        except Exception:
            raise IntegrityError(f"{where} does not decompress.", key=key) from None
    elif codec in BLOSC_CODECS:
        from numcodecs import blosc

        sizes = blosc_sizes(body)
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(storage_dtype).itemsize
        if sizes is None or sizes[0] != want:  # checked before decompressing: no claim of gigabytes
            raise IntegrityError(f"{where} is not a blosc frame of {want} bytes.", key=key)
        try:  # (blosc refuses to decode an empty frame; a chunk of zero-width rows is one)
            body = np.frombuffer(blosc.decompress(body) if want else b"", dtype=np.uint8)
        except Exception:
            raise IntegrityError(f"{where} does not decompress.", key=key) from None
    dt = np.dtype(storage_dtype).newbyteorder("<")
    expect = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if body.nbytes != expect:
        raise IntegrityError(f"{where} holds {body.nbytes} bytes, expected {expect}.", key=key)
    return np.frombuffer(body, dtype=dt).reshape(shape)


def crc_ok(body, crc: bytes) -> bool:
    return len(crc) == 4 and _crc32c(body) == int.from_bytes(crc, "little")


def blosc_sizes(body) -> tuple[int, int] | None:
    """(decoded bytes, frame bytes) from a blosc header, None unless the frame is exactly ``body``."""
    b = bytes(memoryview(body)[:BLOSC_HEADER])
    if len(b) < BLOSC_HEADER:
        return None
    nbytes, cbytes = int.from_bytes(b[4:8], "little"), int.from_bytes(b[12:16], "little")
    return (nbytes, cbytes) if cbytes == len(body) else None


def content_size(codec: str, body) -> int | None:
    """Decoded size a compressed chunk body declares (None: not a frame of this codec)."""
    if codec == "zstd":
        return zstd_content_size(body)
    sizes = blosc_sizes(body)
    return None if sizes is None else sizes[0]


def zstd_content_size(body) -> int | None:
    """Decompressed size declared in a zstd frame header (RFC 8878 §3.1.1.1), None if absent."""
    b = bytes(memoryview(body)[:18])
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


# ------------------------------------------------------------------------------------ digests


def chunk_digest(rows: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(rows).view(np.uint8).reshape(-1))


def array_digest(chunk_digests: list[str]) -> str:
    return xxhash.xxh3_128_hexdigest(",".join(chunk_digests).encode())


def blob_digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


# ------------------------------------------------------------------------------------ checks


def array_meta_problem(meta: Any, spec: ArraySpec) -> str | None:
    """What is wrong with an array's zarr.json given its manifest entry (None if they agree).

    A manifest edited by hand (a shape, a dtype) passes its own validation and the chunk
    checksums; only this disagreement gives it away."""
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return "zarr.json is not zarr v3 array metadata"
    grid = ((meta.get("chunk_grid") or {}).get("configuration") or {}).get("chunk_shape")
    if (meta.get("shape") != spec.shape or meta.get("data_type") != spec.storage_dtype
            or not isinstance(grid, list) or not grid or grid[0] != spec.chunk_rows):
        return (f"zarr.json says shape {meta.get('shape')} {meta.get('data_type')} in chunks of "
                f"{grid[0] if isinstance(grid, list) and grid else '?'} rows, the manifest {spec.shape} "
                f"{spec.storage_dtype} in chunks of {spec.chunk_rows}")
    attrs = meta.get("attributes")
    if isinstance(attrs, dict) and "dfcache_dtype" in attrs and attrs["dfcache_dtype"] != spec.dtype:
        return f"zarr.json says dtype {attrs['dfcache_dtype']}, the manifest {spec.dtype}"
    return None


def manifest_problems(m: Manifest) -> list[str]:
    """What :func:`dfcache.manifest.validate_manifest` leaves to the format: claims that do not
    give the manifest's key (:func:`dfcache.manifest.key_problem`), array names that collide with
    the group layout, array digests that disagree with their chunk digests, chunks larger than
    anyone should download."""
    claims = key_problem(m)
    out = [claims] if claims else []
    for name, spec in m.arrays.items():
        if name in RESERVED_NAMES:
            out.append(f"array name {name!r} collides with the artifact layout")
        elif array_digest(spec.chunk_digests) != spec.digest:
            out.append(f"array {name}'s digest does not match its chunk digests")
        elif chunk_raw_bytes(spec) > MAX_CHUNK_BYTES:
            out.append(f"array {name} has chunks of {chunk_raw_bytes(spec)} bytes (at most {MAX_CHUNK_BYTES})")
    return out


def check_manifest(m: Manifest) -> None:
    """Raise UntrustedManifestError (no fix) if :func:`manifest_problems` finds anything."""
    problems = manifest_problems(m)
    if problems:
        raise UntrustedManifestError(f"manifest of {m.key} refused: {problems[0]}.", key=m.key)


def missing_problem(m: Manifest, rel: str, role: FileRole) -> str:
    if role.kind == "group":
        return f"zarr.json of the group of artifact {m.key} is missing"
    if role.kind == "array_meta":
        return f"array {role.name}: zarr.json is missing"
    if role.kind == "blob":
        return f"document {role.name} of artifact {m.key} is missing"
    return f"chunk {role.index} of array {role.name} in artifact {m.key} is missing; the artifact is incomplete"


def rows_match(body, spec: ArraySpec, index: int) -> bool:
    """Whether ``body``, the bytes of uncompressed chunk ``index`` (a contiguous uint8 buffer of
    ``chunk_rows`` full rows, the last chunk's padding included), holds exactly the rows the
    manifest names for that chunk: its digest over the logical rows.

    The check every local read of an uncompressed chunk makes (the first time a store reads the
    file): the digest is the manifest's, so it binds the file to its place (this artifact, this
    array, this position) as well as to its bytes, which a chunk's own crc32c cannot (a chunk
    file moved from another array keeps a valid one). It replaces the crc32c on those reads: one
    pass over the bytes either way, and xxh3 is the faster of the two (docs/format.md)."""
    valid = min(spec.chunk_rows, spec.shape[0] - index * spec.chunk_rows) * (
        math.prod(spec.shape[1:]) * ITEMSIZE[spec.storage_dtype])
    return xxhash.xxh3_128_hexdigest(body[:valid]) == spec.chunk_digests[index]


def rows_match_pieces(pieces, spec: ArraySpec, index: int) -> bool:
    """:func:`rows_match` of the chunk body cut into consecutive pieces (contiguous uint8
    buffers, in order, together ``chunk_rows`` full rows): the same digest, computed piece by
    piece, so a reader can read a chunk's wanted rows straight into its result and the others
    aside, and check the whole without copying it together first."""
    valid = min(spec.chunk_rows, spec.shape[0] - index * spec.chunk_rows) * (
        math.prod(spec.shape[1:]) * ITEMSIZE[spec.storage_dtype])
    h = xxhash.xxh3_128()
    for piece in pieces:
        take = min(len(piece), valid)
        if take > 0:
            h.update(piece[:take])
        valid -= take
    return h.hexdigest() == spec.chunk_digests[index]


MOVED = "chunk_moved"  # IntegrityError.reason of an intact chunk in the wrong place


def check_chunk(spec: ArraySpec, name: str, index: int, data: bytes, key: str) -> np.ndarray:
    """Decode chunk ``index`` of array ``name`` and check it against its digest; its logical rows.

    A chunk whose crc32c holds but whose rows are not the manifest's for that place is an intact
    chunk moved or copied from elsewhere: its IntegrityError has ``reason`` :data:`MOVED`."""
    where = f"chunk {index} of array {name} in artifact {key}"
    if spec.codec != "none" and len(data) >= 4:
        declared = content_size(spec.codec, memoryview(data)[:-4])
        if declared is None or declared != chunk_raw_bytes(spec):
            # Checked before decompressing, so a hostile frame cannot claim terabytes.
            raise IntegrityError(f"{where} declares {declared} decompressed bytes, expected "
                                 f"{chunk_raw_bytes(spec)}.", key=key)
    chunk = decode_chunk(data, spec.codec, (spec.chunk_rows,) + tuple(spec.shape[1:]), spec.storage_dtype,
                         where, key)
    rows = np.asarray(chunk[:min(spec.chunk_rows, spec.shape[0] - index * spec.chunk_rows)])
    digest = chunk_digest(rows)
    if digest != spec.chunk_digests[index]:
        # The crc32c held (decode_chunk checked it): whole bytes of some chunk, not this one.
        same = [i for i, d in enumerate(spec.chunk_digests) if d == digest]
        origin = (f"it holds the rows of chunk {same[0]} of the same array" if same else
                  "it is an intact chunk (its crc32c holds) with other rows: a chunk file moved or copied here "
                  "from another array, artifact or position")
        err = IntegrityError(f"{where} does not match its digest: {origin}.", key=key)
        err.reason = MOVED
        raise err
    return rows


def parse_array_meta(data: bytes, spec: ArraySpec, name: str, key: str) -> dict:
    """An array's zarr.json, checked against its manifest entry."""
    try:
        meta = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise IntegrityError(f"array {name}: zarr.json is not valid JSON.", key=key) from None
    problem = array_meta_problem(meta, spec)
    if problem:
        raise IntegrityError(f"array {name}: zarr.json of artifact {key} disagrees with the manifest "
                             f"({problem}).", key=key)
    return meta


def check_file(m: Manifest, rel: str, role: FileRole, data: bytes) -> None:
    """Raise IntegrityError (no fix) unless ``data`` is exactly what the manifest says ``rel`` holds.

    The one check of a file's bytes: ``verify`` and ``push``/``pull`` both use it."""
    key = m.key
    if role.kind == "blob":
        spec = m.blobs[role.name]
        if len(data) != spec.nbytes or blob_digest(data) != spec.digest:
            raise IntegrityError(f"document {role.name} of artifact {key} does not match its digest.", key=key)
    elif role.kind == "group":
        try:
            meta = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            meta = None
        if not isinstance(meta, dict) or meta.get("zarr_format") != 3:
            raise IntegrityError(f"{rel} of artifact {key} is not zarr v3 metadata.", key=key)
        if meta.get("node_type") != "group":
            raise IntegrityError(f"zarr.json of artifact {key} is not a group.", key=key)
    elif role.kind == "array_meta":
        parse_array_meta(data, m.arrays[role.name], role.name, key)
    else:
        check_chunk(m.arrays[role.name], role.name, role.index, data, key)
