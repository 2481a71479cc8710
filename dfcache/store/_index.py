"""The listing index of a local store: what ``dfcache ls`` prints, kept beside the artifacts, so
that listing 100,000 artifacts reads one file instead of parsing 100,000 manifests.

Derived data, never the truth. Each entry is what one ``manifest.json`` gave (its ``ls --json``
row, its ``ls`` line, or why it failed validation), stored with the file's signature (inode,
size, mtime, ctime, all in nanoseconds) and an xxh3-64 of its bytes. A listing walks the
artifact directories as it always did (one ``stat`` of each manifest, no read) and uses an entry
only if the signature is unchanged; anything new, changed or gone is read again or dropped. An
entry recorded within ``RACY_NS`` of its file's last change is "racy" (a same-size rewrite
within the filesystem's timestamp granularity would keep the signature) and is trusted only
after its bytes hash the same again. So an old store with no index, a crashed writer, a manual
copy, deletion or an edited manifest all list exactly what the manifests say.

Files, in ``<store>/index/``:

- ``listing``: a snapshot, replaced atomically (written to a temporary name, then renamed) by a
  listing that found changes. First line a JSON header; then one tab-separated line per artifact
  directory.
- ``listing.log``: lines appended at each local commit (``O_APPEND``, one ``write``), each with
  its own checksum, so the next listing need not parse the new manifests. Merged into the
  snapshot and removed by the next listing; a line lost in between only costs a manifest read.

Both carry a stamp of the code that shapes an entry (this module, manifest validation, the rows
and lines in ``dfcache.maintenance``, key patterns): entries made by other code are ignored.

This module imports neither numpy nor the rest of ``dfcache.store`` (the layout's names only,
:mod:`dfcache.store.layout`): ``dfcache ls`` starts in about the time of the interpreter itself
(see ``dfcache/__main__.py``).
"""

from __future__ import annotations

import json
import os
import stat as _stat
import time

import xxhash

from ._files import NotRegularFile, kind_of, read_regular, replace_derived
from .layout import ARTIFACTS, INDEX, LISTING, LISTING_LOG, MANIFEST, MAX_MANIFEST_BYTES, shard

INDEX_VERSION = 1
RACY_NS = 3 * 10**9  # above the coarsest timestamp granularity in use (2 s on FAT, 1 s on ext3)
_stamp_cache: str | None = None


def stamp() -> str:
    """xxh3-64 of the source files whose code decides what an entry holds."""
    global _stamp_cache
    if _stamp_cache is None:
        # format.py too: a snapshot's format_version is then that of the code reading it.
        from ..keys import source_stamp

        _stamp_cache = source_stamp(INDEX_VERSION, (
            "store/_index.py", "store/format.py", "store/layout.py", "manifest.py", "maintenance.py", "listing.py", "keys.py",
            "__init__.py"))
    return _stamp_cache


def _sig(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _settled(st: os.stat_result, now_ns: int) -> str:
    return "1" if now_ns - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS else "0"


def make_entry(rel: str, st: os.stat_result, data: bytes, now_ns: int) -> str:
    """The index line (without the leading ``rel``) for the manifest bytes ``data`` of
    ``artifacts/<rel>``; the same rules as ``Store.list_manifests``."""
    from ..keys import KEY_PATTERN
    from ..maintenance import ls_entry
    from ..errors import UntrustedManifestError
    from ..manifest import Manifest, key_problem

    name = rel.rsplit("/", 1)[-1]
    head = f"{_sig(st)}\t{_settled(st, now_ns)}\t{xxhash.xxh3_64_hexdigest(data)}"
    try:
        m = Manifest.from_json(data, expect_key=name if KEY_PATTERN.match(name) else None)
        claims = key_problem(m)  # an edited claim (a backend, a layer) is listed as nothing, with the warning
        if claims:
            raise UntrustedManifestError(f"manifest of {m.key} refused: {claims}.", key=m.key)
    except UntrustedManifestError as e:
        return f"{head}\tE\t\t\t\t\t\t{json.dumps(e.message)}"
    created, key, stage, size, line, row = ls_entry(m)
    return f"{head}\tA\t{stage}\t{json.dumps(created)}\t{key}\t{size}\t{line}\t{row}"


class Listing:
    """What a store's manifests say, in directory order: ``artifacts`` holds, per valid
    manifest, its :func:`dfcache.maintenance.ls_entry`;
    ``errors`` holds ``(directory name, message)`` per manifest that failed validation."""

    def __init__(self, format_version: int) -> None:
        self.format_version = format_version  # of the store format the code that listed it reads
        self.artifacts: list[tuple[str, str, str, int, str, str]] = []
        self.errors: list[tuple[str, str]] = []
        self.reread = 0  # manifests parsed because the index did not hold them (or not as they are)


def _read_lines(path: str, st: str, checked: bool) -> tuple[dict[str, str], int | None]:
    """Entries of the snapshot (``checked=False``; with its header's format_version) or of the log."""
    try:
        data = read_regular(path)  # (never blocking: a FIFO at index/listing once hung `ls`)
    except (OSError, NotRegularFile):
        return {}, None
    text = data.decode("utf-8", "surrogateescape")
    lines = text.split("\n")
    out: dict[str, str] = {}
    if not checked:
        try:
            header = json.loads(lines[0])
        except ValueError:
            return {}, None
        if (not isinstance(header, dict) or header.get("stamp") != st
                or not isinstance(header.get("format_version"), int)):
            return {}, None
        for line in lines[1:]:
            rel, sep, rest = line.partition("\t")
            if sep:
                out[rel] = rest
        return out, header["format_version"]
    # log lines: "<xxh3-64 of the rest> <stamp>\t<rel>\t<entry>", the last one possibly torn
    for line in lines[:-1] if not text.endswith("\n") else lines:
        check, sep, rest = line.partition(" ")
        if not sep or xxhash.xxh3_64_hexdigest(rest.encode("utf-8", "surrogateescape")) != check:
            continue
        s, _, rest = rest.partition("\t")
        rel, sep, entry = rest.partition("\t")
        if s == st and sep:
            out[rel] = entry
    return out, None


def _read(path: str) -> bytes | None:
    try:
        return read_regular(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None  # removed since its stat: gone, as Store.list_manifests would find it
    except OSError:  # (IntegrityError: replaced since its stat by something larger than any manifest)
        return b""  # an entry that fails validation, as Store.list_manifests reports it


def _decode_created(field: str) -> str:
    return field[1:-1] if "\\" not in field else json.loads(field)


def listing(root: str | os.PathLike, format_version: int | None = None, *, write: bool = True) -> Listing | None:
    """Every artifact directory of the local store at ``root``, from the index where it still
    holds and from the manifest where it does not; the index is then brought up to date
    (``write``; a read-only store is listed all the same).

    ``format_version``: the store format the caller reads (``format.FORMAT_VERSION``). None (the
    ``dfcache`` executable, which does not import the format module): take it from the snapshot,
    written by this same code (its stamp covers ``format.py``), and return None if there is no
    valid snapshot."""
    root = os.fspath(root)
    idx = os.path.join(root, INDEX)
    st_ = stamp()
    known, fv = _read_lines(os.path.join(idx, LISTING), st_, checked=False)
    if format_version is None:
        if fv is None:
            return None
        format_version = fv
    logged, _ = _read_lines(os.path.join(idx, LISTING_LOG), st_, checked=True)
    had_log = bool(logged) or os.path.exists(os.path.join(idx, LISTING_LOG))
    dirty = had_log or fv != format_version
    known.update(logged)
    out = Listing(format_version)
    now_ns = time.time_ns()
    fresh: list[str] = []  # lines of the new snapshot, if one is needed
    base = os.path.join(root, ARTIFACTS)
    try:
        shards = sorted((e.name, e.path) for e in os.scandir(base) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        shards = []
    artifacts_append, errors_append, fresh_append = out.artifacts.append, out.errors.append, fresh.append
    stat, tail = os.stat, "/" + MANIFEST
    for shard_name, shard_path in shards:
        prefix = shard_name + "/"
        for name in sorted(os.listdir(shard_path)):
            path = shard_path + "/" + name + tail
            try:
                st = stat(path)
            except (FileNotFoundError, NotADirectoryError):
                continue  # a directory without a manifest is not an artifact
            rel = prefix + name
            if not _stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                # A directory or a FIFO in its place (never opened: a FIFO hung `ls`), or larger than
                # any manifest: what Store.list_manifests reports too. Not indexed.
                what = kind_of(st.st_mode) if not _stat.S_ISREG(st.st_mode) else f"{st.st_size} bytes"
                errors_append((name, f"manifest of artifact {name} refused: {path} is {what}."))
                known.pop(rel, None)
                continue
            line = known.pop(rel, None)
            sig = _sig(st)
            data = None
            if line is not None and line.startswith(sig + "\t"):
                parts = line.split("\t")
                if len(parts) != 10:
                    line = None  # a torn snapshot (it is written without fsync)
                elif parts[1] != "1":  # racy: trusted only if its bytes are still the ones indexed
                    data = _read(path)
                    if data is None:
                        continue
                    if xxhash.xxh3_64_hexdigest(data) != parts[2]:
                        line = None
                    elif _settled(st, now_ns) == "1":
                        parts[1] = "1"
                        line = "\t".join(parts)
                        dirty = True
            else:
                line = None
            if line is None:
                if data is None:
                    data = _read(path)
                    if data is None:
                        continue
                line = make_entry(rel, st, data, now_ns)
                parts = line.split("\t")
                out.reread += 1
                dirty = True
            if parts[3] == "A":
                artifacts_append((_decode_created(parts[5]), parts[6], parts[4], int(parts[7]), parts[8], parts[9]))
            else:
                errors_append((name, json.loads(parts[9])))
            if "\t" not in name and "\n" not in name and "\r" not in name:
                fresh_append(rel + "\t" + line)
    if known:
        dirty = True  # entries of directories that are gone
    if dirty and write:
        _write_snapshot(idx, st_, format_version, fresh, drop_log=had_log)
    return out


def _write_snapshot(idx: str, st_: str, format_version: int, lines: list[str], *, drop_log: bool) -> None:
    """Replace the snapshot atomically; no fsync (after a crash a torn snapshot is rebuilt)."""
    header = json.dumps({"dfcache_index": INDEX_VERSION, "stamp": st_, "format_version": format_version})
    data = "\n".join([header, *lines]).encode("utf-8", "surrogateescape")
    if replace_derived(os.path.join(idx, LISTING), data) and drop_log:
        # Lines appended since this listing read the log go with it: the next listing reads
        # those few manifests again.
        try:
            os.unlink(os.path.join(idx, LISTING_LOG))
        except OSError:
            pass


def record_commit(root: str | os.PathLike, key: str, manifest_bytes: bytes) -> None:
    """Append the entry of a just-published artifact to the log (best effort: a commit never
    fails because of its index; a missing line only costs the next listing a manifest read)."""
    try:
        root = os.fspath(root)
        rel = f"{shard(key)}/{key}"
        st = os.stat(os.path.join(root, ARTIFACTS, rel, MANIFEST))
        rest = f"{stamp()}\t{rel}\t{make_entry(rel, st, manifest_bytes, time.time_ns())}"
        data = rest.encode("utf-8", "surrogateescape")
        line = xxhash.xxh3_64_hexdigest(data).encode() + b" " + data + b"\n"
        idx = os.path.join(root, INDEX)
        os.makedirs(idx, exist_ok=True)
        fd = os.open(os.path.join(idx, LISTING_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except Exception:  # noqa: BLE001 - the index is a cache; the commit has already succeeded
        pass
