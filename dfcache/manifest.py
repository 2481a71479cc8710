"""The manifest: what an artifact is, written last, and validated before use.

A manifest is a JSON file (``manifest.json``) beside the artifact's zarr group. Its presence is
what makes an artifact exist. Manifests from anywhere (a remote especially) are validated with
:func:`validate_manifest` before anything in them is used as a path or a size.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import KeyMaterialError, UnknownCodecError, UntrustedManifestError
from .keys import KEY_PATTERN, compute_key, segment_key

FORMAT_VERSION = 1

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
STAGE_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
DIGEST_PATTERN = re.compile(r"^[0-9a-f]{32}$")

# FP8 hidden states (dfcache/fp8.py): per row, H float8_e4m3fn codes then the row's float32 scale
FP8_DTYPE = "float8_e4m3fn_scaled"
SCALE_BYTES = 4

# Logical dtypes and how they are stored (zarr v3 has no bfloat16: its bits go in uint16).
STORAGE_DTYPE = {
    "bfloat16": "uint16", "float16": "float16", "float32": "float32", "float64": "float64",
    "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool",
    FP8_DTYPE: "uint8",
}
ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "float16": 2, "int16": 2, "uint16": 2, "float32": 4, "int32": 4,
            "uint32": 4, "float64": 8, "int64": 8, "uint64": 8}  # of the storage dtypes, without numpy
CODECS = ("none", "zstd", "shuffle-zstd", "bitshuffle-lz4")  # per array; see dfcache/store/format.py
MAX_ARRAY_BYTES = 1 << 44  # 16 TiB: anything larger in a manifest is hostile or broken
MAX_NDIM = 8


@dataclass
class ArraySpec:
    """One array of an artifact."""

    shape: list[int]
    dtype: str  # logical dtype, e.g. "bfloat16"
    chunk_rows: int
    digest: str  # xxh3-128 over the per-chunk digests, see docs/format.md
    nbytes: int  # logical bytes (shape x itemsize)
    codec: str = "none"
    chunk_digests: list[str] = field(default_factory=list)

    @property
    def storage_dtype(self) -> str:
        return STORAGE_DTYPE[self.dtype]

    @property
    def num_chunks(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return -(-rows // self.chunk_rows) if rows else 0


@dataclass
class BlobSpec:
    """A small JSON document stored with the artifact (prompt records, texts, reports)."""

    digest: str
    nbytes: int


@dataclass
class Manifest:
    key: str
    stage: str
    stage_version: int
    inputs: dict[str, Any]
    upstream: dict[str, Any]
    provenance: dict[str, Any]
    arrays: dict[str, ArraySpec]
    blobs: dict[str, BlobSpec]
    created: str
    size_bytes: int
    dfcache_version: str
    format_version: int = FORMAT_VERSION
    summary: str = ""
    # A segment (many samples of one partition, see dfcache/samples/): {"partition": key,
    # "partition_upstream": {role: partition key}, "keys": [sample keys, in segment order]}.
    samples: dict[str, Any] | None = None
    # Samples this artifact was made from: [{"partition": key, "keys": [sample keys]}] (gc keeps them).
    sample_refs: list[dict[str, Any]] | None = None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("samples", "sample_refs"):  # absent, not null, in artifacts that have none
            if d[name] is None:
                del d[name]
        return d

    @property
    def upstream_keys(self) -> list[str]:
        out: list[str] = []
        for v in self.upstream.values():
            out.extend(v if isinstance(v, list) else [v])
        return out

    @property
    def backend(self) -> dict | None:
        b = self.inputs.get("backend")
        return b if isinstance(b, dict) else None

    @classmethod
    def from_json(cls, text: str | bytes, *, expect_key: str | None = None) -> "Manifest":
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise UntrustedManifestError(f"manifest{' of ' + expect_key if expect_key else ''} is not "
                                         f"valid JSON ({e}).", key=expect_key,
                                         fix="Delete the artifact and recompute or pull it again.") from None
        return validate_manifest(data, expect_key=expect_key)


def _bad(msg: str, key: str | None) -> UntrustedManifestError:
    where = f"manifest of {key}" if key else "manifest"
    return UntrustedManifestError(f"{where} refused: {msg}.", key=key,
                                  fix="Delete it and recompute, or pull it again from a trusted remote.")


def _newer_than_this(version: Any) -> bool:
    """Whether a manifest's ``dfcache_version`` claims a later release than this one (numeric
    parts compared; anything else is not newer)."""
    from . import __version__

    def parts(v: Any) -> tuple[int, ...] | None:
        m = re.match(r"^(\d{1,6})\.(\d{1,6})(?:\.(\d{1,6}))?", v) if isinstance(v, str) else None
        return tuple(int(x or 0) for x in m.groups()) if m else None

    theirs, ours = parts(version), parts(__version__)
    return theirs is not None and ours is not None and theirs > ours


def _refuse_unknown(name: str, dtype: Any, codec: Any, key: str | None, written_by: Any) -> None:
    """A dtype or codec this dfcache does not read: a newer dfcache's (exit 2, named: the manifest
    says a later release wrote it), or junk (5). A manifest that claims this release or an older
    one and names a codec no release wrote ("pickle", "object") is a hostile or damaged one
    (tests/reliability/test_hostile_remote.py), not one to upgrade for."""
    what, value = ("dtype", dtype) if dtype not in STORAGE_DTYPE else ("codec", codec)
    if isinstance(value, str) and NAME_PATTERN.match(value) and _newer_than_this(written_by):
        raise UnknownCodecError(f"artifact {key} stores array {name} with {what} {value!r}, which this dfcache does "
                                "not read (a newer dfcache wrote it).", key=key,
                                fix=f"Upgrade dfcache to read it, or use states stored with a codec it reads "
                                    f"({', '.join(CODECS)}).")
    raise _bad(f"array {name} has {what} {str(value)[:40]!r}", key)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_manifest(data: Any, *, expect_key: str | None = None) -> Manifest:
    """Check every field a reader relies on and build a :class:`Manifest`.

    Keys and names must match strict patterns (no path separators, no ``..``), shapes and sizes
    must be sane, digests present. Raises :class:`UntrustedManifestError` otherwise.
    """
    k = expect_key
    if not isinstance(data, dict):
        raise _bad("not a JSON object", k)
    key = data.get("key")
    if not isinstance(key, str) or not KEY_PATTERN.match(key):
        raise _bad(f"key {key!r} is not 32 hex digits", k)
    if expect_key is not None and key != expect_key:
        raise _bad(f"it says key {key} but is stored under {expect_key}", k)
    k = key
    fmt = data.get("format_version")
    if fmt != FORMAT_VERSION:
        raise _bad(f"format_version {fmt!r} is not {FORMAT_VERSION} (written by another dfcache "
                   "version)", k)
    stage = data.get("stage")
    if not isinstance(stage, str) or not STAGE_PATTERN.match(stage):
        raise _bad(f"stage {stage!r} is not a valid stage name", k)
    if not _int(data.get("stage_version")):
        raise _bad("stage_version is not an integer", k)
    for name in ("inputs", "upstream", "provenance", "arrays", "blobs"):
        if not isinstance(data.get(name), dict):
            raise _bad(f"{name} is not an object", k)
    for role, v in data["upstream"].items():
        vals = v if isinstance(v, list) else [v]
        if not all(isinstance(x, str) and KEY_PATTERN.match(x) for x in vals):
            raise _bad(f"upstream {role!r} is not a key", k)
    arrays: dict[str, ArraySpec] = {}
    for name, spec in data["arrays"].items():
        if not NAME_PATTERN.match(name) or ".." in name:
            raise _bad(f"array name {name!r} is not allowed", k)
        if not isinstance(spec, dict):
            raise _bad(f"array {name} is not an object", k)
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_NDIM
                or not all(_int(s) and 0 <= s < 1 << 40 for s in shape)):
            raise _bad(f"array {name} has shape {shape!r}", k)
        if dtype not in STORAGE_DTYPE or spec.get("codec", "none") not in CODECS:
            _refuse_unknown(name, dtype, spec.get("codec", "none"), k, data.get("dfcache_version"))
        if dtype == FP8_DTYPE and (len(shape) != 2 or shape[1] < SCALE_BYTES):
            raise _bad(f"array {name} of {dtype} has shape {shape} (rows of codes and a 4-byte scale)", k)
        cr = spec.get("chunk_rows")
        if not _int(cr) or not 1 <= cr <= 1 << 30:
            raise _bad(f"array {name} has chunk_rows {cr!r}", k)
        nbytes = math.prod(shape) * ITEMSIZE[STORAGE_DTYPE[dtype]]  # exact; numpy is not needed to list a store
        if nbytes > MAX_ARRAY_BYTES or spec.get("nbytes") != nbytes:
            raise _bad(f"array {name} claims {spec.get('nbytes')!r} bytes for shape {shape}", k)
        digest = spec.get("digest")
        if not isinstance(digest, str) or not DIGEST_PATTERN.match(digest):
            raise _bad(f"array {name} has no valid digest", k)
        cds = spec.get("chunk_digests", [])
        a = ArraySpec(shape=list(shape), dtype=dtype, chunk_rows=cr, digest=digest, nbytes=nbytes,
                      codec=spec.get("codec", "none"), chunk_digests=list(cds))
        if (not isinstance(cds, list) or len(cds) != a.num_chunks
                or not all(isinstance(d, str) and DIGEST_PATTERN.match(d) for d in cds)):
            raise _bad(f"array {name} has {len(cds) if isinstance(cds, list) else 'no'} chunk digests "
                       f"for {a.num_chunks} chunks", k)
        arrays[name] = a
    blobs: dict[str, BlobSpec] = {}
    for name, spec in data["blobs"].items():
        if not NAME_PATTERN.match(name) or ".." in name:
            raise _bad(f"blob name {name!r} is not allowed", k)
        if (not isinstance(spec, dict) or not isinstance(spec.get("digest"), str)
                or not DIGEST_PATTERN.match(spec["digest"]) or not _int(spec.get("nbytes"))
                or not 0 <= spec["nbytes"] <= 1 << 34):
            raise _bad(f"blob {name} has no valid digest or size", k)
        blobs[name] = BlobSpec(digest=spec["digest"], nbytes=spec["nbytes"])
    if not _int(data.get("size_bytes")) or data["size_bytes"] < 0:
        raise _bad("size_bytes is not a non-negative integer", k)
    for name in ("created", "dfcache_version"):
        if not isinstance(data.get(name), str):
            raise _bad(f"{name} is not a string", k)
    samples = data.get("samples")
    if samples is not None:
        if (not isinstance(samples, dict) or not _is_key(samples.get("partition"))
                or not isinstance(samples.get("partition_upstream", {}), dict)
                or not _key_list(samples.get("keys")) or not samples["keys"]):
            raise _bad("samples is not {partition, partition_upstream, keys} with 32-hex-digit keys", k)
        for role, v in samples.get("partition_upstream", {}).items():
            if not all(_is_key(x) for x in (v if isinstance(v, list) else [v])):
                raise _bad(f"samples.partition_upstream {role!r} is not a key", k)
    refs = data.get("sample_refs")
    if refs is not None:
        if not isinstance(refs, list) or not all(
                isinstance(r, dict) and _is_key(r.get("partition")) and _key_list(r.get("keys")) for r in refs):
            raise _bad("sample_refs is not a list of {partition, keys} with 32-hex-digit keys", k)
    return Manifest(key=key, stage=stage, stage_version=data["stage_version"], inputs=data["inputs"],
                    upstream=data["upstream"], provenance=data["provenance"], arrays=arrays,
                    blobs=blobs, created=data["created"], size_bytes=data["size_bytes"],
                    dfcache_version=data["dfcache_version"], format_version=fmt,
                    summary=str(data.get("summary", ""))[:500], samples=samples, sample_refs=refs)


def key_problem(m: Manifest) -> str | None:
    """What is wrong with a manifest's claims given its key (None if they give it).

    A key is derived from what its manifest claims: ``compute_key(stage, stage_version, inputs,
    upstream)``; for a segment of samples (``samples``), the partition key is that of its stage,
    version, inputs and ``partition_upstream``, and the segment key
    ``keys.segment_key(partition, sample keys)``. A manifest edited to claim other inputs (a
    backend, a layer) still validates; this is what gives it away. ``ls``, the listings that
    ``--where``, ``gc`` scopes and ``push``/``pull`` selections use (``Store.list_manifests``),
    and the format's manifest check (``verify``, ``pull``, ``push``) refuse such a manifest.
    Nothing but hashing: no numpy, no file read."""
    s = m.samples
    try:
        if s:
            partition = compute_key(m.stage, m.stage_version, m.inputs, dict(s.get("partition_upstream") or {}))
            if partition != s["partition"]:
                return (f"its stage, version, inputs and partition_upstream give partition {partition}, not the "
                        f"{s['partition']} it claims: the manifest was edited")
            derived = segment_key(partition, s["keys"])
            what = "its partition and sample keys give"
        else:
            derived = compute_key(m.stage, m.stage_version, m.inputs, m.upstream)
            what = "its stage, version, inputs and upstream give"
    except KeyMaterialError as e:
        return f"its claims cannot be key material ({e.problem}): the manifest was edited"
    if derived != m.key:
        return f"{what} key {derived}, not its own: the manifest was edited, or written under a key not its own"
    return None


def _is_key(v: Any) -> bool:
    return isinstance(v, str) and KEY_PATTERN.match(v) is not None


_DROP_HEX = str.maketrans("", "", "0123456789abcdef")


def _key_list(v: Any) -> bool:
    """A list of keys, checked in C-speed passes (a segment lists thousands): joined by commas,
    n keys are 33n-1 characters with a comma at every 33rd place and nothing but hex digits
    elsewhere, so no element holds a comma or is anything but one key."""
    if not isinstance(v, list):
        return False
    if not v:
        return True
    try:
        joined = ",".join(v)
    except TypeError:  # an element that is not a string
        return False
    commas = "," * (len(v) - 1)
    return len(joined) == 33 * len(v) - 1 and joined[32::33] == commas and joined.translate(_DROP_HEX) == commas
