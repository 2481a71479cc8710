"""Cache keys and input fingerprints.

A key is the xxh3-128 hex digest of a canonical encoding of
``{"stage", "stage_version", "inputs", "upstream"}``. The encoding is canonical JSON: dict keys
sorted, no whitespace, floats written by ``repr`` (shortest round-trip form, one spelling per
value), ints never confused with floats (``1`` and ``1.0`` differ), NaN/inf refused. Strings that
look like absolute paths, and dict keys that name machine-local things (mtimes, hosts), are
refused: they give false misses on another machine (datasets #2496, Bazel #2998).

Directories (models, checkpoints) enter keys through :func:`fingerprint_path`, which hashes
their config, tokenizer files and weight contents. Hashing is memoized by (path, size,
mtime_ns, inode) of every file; that memo decides only whether to re-hash and never enters a key.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Iterable
from json.encoder import encode_basestring as _json_str  # json's own escaping of a str, ensure_ascii=False
from pathlib import Path
from typing import Any

import xxhash

from .errors import BadInputError, KeyMaterialError

KEY_HEX_LEN = 32
KEY_PATTERN = re.compile(r"^[0-9a-f]{32}$")
_FORBIDDEN_KEY_NAMES = {"mtime", "mtime_ns", "ctime", "atime", "inode", "host", "hostname", "path",
                        "abspath", "cwd", "pid"}
_ABS_PATH = re.compile(r"^(/|[A-Za-z]:[\\/]|~[/\\])")


def canonical_encode(value: Any) -> bytes:
    """Encode ``value`` as canonical JSON bytes; raise :class:`KeyMaterialError` on forbidden material."""
    return _encode(value, "").encode("utf-8")


# Exactly what json.dumps(s, ensure_ascii=False) and json.dumps(k) give for a str, without the
# encoder json.dumps builds per call with non-default options (most of a key's cost, measured).
_str_json = json.JSONEncoder(ensure_ascii=False).encode
_name_json = json.JSONEncoder().encode


def _encode(v: Any, where: str) -> str:
    t = type(v)  # the common exact types first; anything else (subclasses too) as below
    if t is str:
        if _ABS_PATH.match(v):
            raise KeyMaterialError(
                f"key material {where or 'value'} is an absolute path ({v!r}); paths differ between "
                "machines. Pass a fingerprint of the file or directory instead (dfcache.fingerprint_path).")
        return _str_json(v)
    if t is int:
        return str(v)
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            raise KeyMaterialError(f"key material {where or 'value'} is {v!r}; use a finite number.")
        # repr gives the shortest string that round-trips; a trailing 'f' marks the type so that
        # 1 and 1.0 never collide.
        return repr(v) + "f"
    if isinstance(v, str):  # a str subclass: as the str it is
        return _encode(str.__str__(v), where)
    if isinstance(v, os.PathLike):
        raise KeyMaterialError(
            f"key material {where or 'value'} is a path object ({v!s}); pass a fingerprint instead.")
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_encode(x, f"{where}[{i}]") for i, x in enumerate(v)) + "]"
    if isinstance(v, dict):
        items = []
        for k in v:
            if not isinstance(k, str):
                raise KeyMaterialError(f"key material {where or 'dict'} has a non-string key {k!r}.")
            if k.lower() in _FORBIDDEN_KEY_NAMES:
                raise KeyMaterialError(
                    f"key material field {where + '.' if where else ''}{k} is machine-local and would "
                    "make keys differ between machines; leave it out of the inputs (record it in "
                    "provenance instead).")
        for k in sorted(v):
            items.append(_name_json(k) + ":" + _encode(v[k], f"{where}.{k}" if where else k))
        return "{" + ",".join(items) + "}"
    raise KeyMaterialError(
        f"key material {where or 'value'} has type {type(v).__name__}; use str, int, float, bool, "
        "None, list or dict.")


def compute_key(stage: str, stage_version: int, inputs: dict, upstream: dict[str, str] | None = None) -> str:
    """Return the 32-hex-digit key of a stage run.

    Args:
        stage: the stage name, e.g. ``"hidden_states"``.
        stage_version: the stage's explicit version, bumped when its output semantics change.
        inputs: resolved inputs (fingerprints, parameters); never paths or mtimes.
        upstream: role name → key of each upstream artifact.
    """
    if not isinstance(stage_version, int) or isinstance(stage_version, bool):
        raise KeyMaterialError(f"stage_version of {stage!r} must be an int, got {stage_version!r}.")
    for role, key in (upstream or {}).items():
        if not (isinstance(key, str) and KEY_PATTERN.match(key)) and not (
                isinstance(key, list) and all(isinstance(k, str) and KEY_PATTERN.match(k) for k in key)):
            raise KeyMaterialError(f"upstream {role!r} of {stage!r} is not a key: {key!r}.")
    material = {"stage": stage, "stage_version": stage_version, "inputs": inputs,
                "upstream": upstream or {}}
    return xxhash.xxh3_128_hexdigest(canonical_encode(material))


# ------------------------------------------------------------------------- keys of samples
#
# The keys of samples, sets and segments (dfcache/samples/) are canonical encodings of two hex
# keys: exactly canonical_encode's bytes, spelled out here (a hex key needs no escaping and is no
# path), because a plan derives one per sample and stage and the general encoder costs most of
# that (tests/test_keys.py checks each against canonical_encode). Only here: callers never
# spell these encodings themselves.


def sample_key(partition: str, upstream: str) -> str:
    """The key of the sample of ``partition`` made from the upstream sample ``upstream``:
    ``xxh3_128(canonical({"partition": partition, "sample": upstream}))``."""
    return xxhash.xxh3_128_hexdigest(('{"partition":"%s","sample":"%s"}' % (partition, upstream)).encode())


def sample_keys(partition: str, upstream: Iterable[str]) -> list[str]:
    """:func:`sample_key` of each of ``upstream``, in order (the loop a plan runs per stage)."""
    head, h = '{"partition":"%s","sample":"' % partition, xxhash.xxh3_128_hexdigest
    return [h((head + u + '"}').encode()) for u in upstream]


def segment_key(partition: str, keys) -> str:
    """The key of a segment holding samples ``keys`` of ``partition`` (dfcache/samples/):
    ``xxh3_128(canonical({"partition": partition, "segment": xxh3_128(",".join(sorted(keys)))}))``."""
    inner = xxhash.xxh3_128_hexdigest(",".join(sorted(keys)).encode())
    return xxhash.xxh3_128_hexdigest(('{"partition":"%s","segment":"%s"}' % (partition, inner)).encode())


def set_key(partition: str, keys: list[str]) -> str:
    """The key of an ordered set of samples of one partition (order matters: a report's rows):
    ``xxh3_128(canonical({"partition": partition, "set": xxh3_128(",".join(keys))}))``."""
    inner = xxhash.xxh3_128_hexdigest(",".join(keys).encode())
    return xxhash.xxh3_128_hexdigest(('{"partition":"%s","set":"%s"}' % (partition, inner)).encode())


# The record encoding: plain sorted compact JSON (json.dumps(record, sort_keys=True,
# separators=(",", ":"), ensure_ascii=False, allow_nan=False)), not key material: a prompt may
# well contain text that looks like an absolute path. One encoder for the process (json.dumps
# builds one per call with these options: 1.7x the time on 100,000 prompts).
_record_json = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def record_digest(record: Any) -> str:
    """Content digest of a JSON record (the upstream key of a root sample, e.g. a prompt)."""
    return xxhash.xxh3_128_hexdigest(_record_json(record).encode())


def messages_digest(messages: list) -> str:
    """``record_digest({"messages": messages})`` of a chat request's messages: spelled out for
    messages that are exactly ``{"role": str, "content": str}`` (the same bytes, 2x faster than
    the encoder on 100,000 prompts), through :func:`record_digest` for anything else."""
    try:  # (a message with another key, or without one of these, or a value not a str: the encoder)
        parts = ['{"content":%s,"role":%s}' % (_json_str(m["content"]), _json_str(m["role"]))
                 for m in messages if len(m) == 2]
    except (TypeError, KeyError):
        parts = None
    if parts is None or len(parts) != len(messages):
        return record_digest({"messages": messages})
    return xxhash.xxh3_128_hexdigest(('{"messages":[' + ",".join(parts) + "]}").encode())


def digest_bytes(data) -> str:
    """xxh3-128 hex digest of a bytes-like object (numpy arrays must be C-contiguous)."""
    return xxhash.xxh3_128_hexdigest(data)


# ----------------------------------------------------------------------------- fingerprints

# Files that shape a model's or checkpoint's behaviour. Anything else in the directory (READMEs,
# images, training logs) is ignored so that editing a model card does not invalidate caches.
_MODEL_FILE_PATTERNS = (
    re.compile(r".*\.safetensors$"), re.compile(r".*\.bin$"), re.compile(r".*\.pt$"),
    re.compile(r".*\.gguf$"), re.compile(r"^config\.json$"), re.compile(r"^generation_config\.json$"),
    re.compile(r"^tokenizer.*"), re.compile(r"^special_tokens_map\.json$"),
    re.compile(r"^chat_template.*"), re.compile(r".*\.model$"), re.compile(r"^vocab\..*"),
    re.compile(r"^merges\.txt$"), re.compile(r"^added_tokens\.json$"),
    re.compile(r".*\.index\.json$"), re.compile(r"^preprocessor_config\.json$"),
)
_PIECE = 8 << 20
_memo_lock = threading.Lock()
_memo_loaded: dict[str, dict] | None = None


def _memo_path() -> Path:
    from .config import fingerprint_memo_path

    return fingerprint_memo_path()


def _load_memo() -> dict[str, dict]:
    global _memo_loaded
    if _memo_loaded is None:
        try:
            _memo_loaded = json.loads(_memo_path().read_text())
        except (OSError, ValueError):
            _memo_loaded = {}
    return _memo_loaded


def _save_memo(memo: dict) -> None:
    path = _memo_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, path)
    except OSError:
        pass  # the memo is only a speed-up


def hash_file(path: Path, stat: os.stat_result | None = None) -> str:
    """xxh3-128 of a file's contents, memoized by (path, size, mtime_ns, inode)."""
    path = Path(path).resolve()
    st = stat or path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    with _memo_lock:
        memo = _load_memo()
        hit = memo.get(str(path))
        if hit and hit.get("stamp") == stamp:
            return hit["digest"]
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_PIECE)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    digest = h.hexdigest()
    with _memo_lock:
        memo = _load_memo()
        memo[str(path)] = {"stamp": stamp, "digest": digest}
        _save_memo(memo)
    return digest


def fingerprint_path(path: str | os.PathLike, *, all_files: bool = False) -> str:
    """Fingerprint a model/checkpoint directory (or a single file) by content.

    The fingerprint covers the relative names and contents of the config, tokenizer and weight
    files. Names are relative, so the same model in two places has one fingerprint.

    Raises:
        ModelNotFoundError: the path does not exist.
    """
    from .errors import ModelNotFoundError

    p = Path(path)
    if not p.exists():
        raise ModelNotFoundError(f"{p} does not exist; pass an existing model or checkpoint directory.")
    if p.is_file():
        return xxhash.xxh3_128_hexdigest(canonical_encode({"file": hash_file(p)}))
    entries = {}
    for root, dirs, files in os.walk(p):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), p)
            if not all_files and not any(pat.match(name) for pat in _MODEL_FILE_PATTERNS):
                continue
            entries[rel.replace(os.sep, "/")] = hash_file(Path(root) / name)
    if not entries:
        raise BadInputError(f"{p} holds no model files (config, tokenizer or weights); "
                            "pass the directory that holds config.json and the weights.")
    return xxhash.xxh3_128_hexdigest(canonical_encode(entries))


def fingerprint_text(text: str) -> str:
    """xxh3-128 of a string (for chat templates and other small inputs)."""
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def source_stamp(version: int, sources: tuple[str, ...]) -> str:
    """xxh3-64 of ``version`` and the source files ``sources`` (paths inside the dfcache package):
    a derived file stamped with it is rebuilt by any other code."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    h = xxhash.xxh3_64(str(version).encode())
    for rel in sources:
        try:
            with open(os.path.join(pkg, rel), "rb") as f:
                h.update(f.read())
        except OSError:
            h.update(b"?")
    return h.hexdigest()
