"""`dfcache migrate`: upgrade a store of an older format (``format.MIGRATABLE``) in place.

Format 2 only adds segments of samples to format 1; a format-1 store's artifacts are valid
format-2 artifacts as they are. So the upgrade reads every manifest (each must still parse under
today's checks; one that does not is reported, as `dfcache verify` would, and left alone), then
replaces the store's format marker in one atomic step: a rename over the old file on a
directory, one PUT on S3. Until that step the store is format 1 and a rerun starts over; after
it, it is format 2. Nothing else is rewritten, so an interrupted migrate loses nothing.

Stop other dfcache processes on the store first: an older dfcache refuses the store once it is
format 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from ..errors import IntegrityError, UntrustedManifestError, UsageError
from ._backend import UnreadableManifest
from ._files import NotRegularFile, read_regular
from .format import FORMAT_VERSION, MIGRATABLE, damaged_marker, format_refusal, marker_format, store_marker_bytes
from .layout import ARTIFACTS, MANIFEST, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, STORE_MARKER, marker_tmp_name


@dataclass
class MigrateResult:
    store: str
    from_format: int | None
    to_format: int = FORMAT_VERSION
    migrated: bool = False  # False: already at FORMAT_VERSION (or a dry run)
    dry_run: bool = False
    artifacts: int = 0
    segments: int = 0
    unreadable: list[dict] = field(default_factory=list)  # {"key", "problem"}: left as they are

    def to_dict(self) -> dict:
        return asdict(self)


def _marker_format(raw: bytes, url: str):
    return marker_format(raw, url)


def _local_marker(root: Path, url: str, nofollow: bool) -> bytes:
    """The marker's bytes: bounded, never blocking, through no link in a file:// store."""
    try:
        return read_regular(root / STORE_MARKER, MAX_MARKER_BYTES, nofollow=nofollow)
    except NotRegularFile as e:
        raise damaged_marker(f"{url}/{STORE_MARKER}", e.problem) from None
    except IntegrityError:
        raise damaged_marker(f"{url}/{STORE_MARKER}", f"larger than {MAX_MARKER_BYTES} bytes") from None


def _local_manifests(root: Path) -> Iterator[tuple[str, bytes]]:
    arts = root / ARTIFACTS
    if not arts.is_dir():
        return
    for shard in sorted(arts.iterdir()):
        if not shard.is_dir():
            continue
        for d in sorted(shard.iterdir()):
            try:
                yield d.name, read_regular(d / MANIFEST, MAX_MANIFEST_BYTES)
            except FileNotFoundError:
                continue  # not committed: no manifest, no artifact
            except IntegrityError as e:
                yield d.name, UnreadableManifest(e.problem)


def _write_local_marker(root: Path) -> None:
    marker = root / STORE_MARKER
    tmp = marker.with_name(marker_tmp_name())
    try:
        with open(tmp, "wb") as f:
            f.write(store_marker_bytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, marker)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot rewrite {marker}: {e.strerror}; the store is unchanged (still the old "
                         "format). Make it writable and run `dfcache migrate` again.") from None


def migrate_store(location: str | os.PathLike | None = None, *, endpoint_url: str | None = None,
                  region: str | None = None, offline: bool | None = None, dry_run: bool = False,
                  progress=None) -> MigrateResult:
    """Upgrade the store at ``location`` (a directory, ``file://`` or ``s3://``) to FORMAT_VERSION.

    Already current: nothing is written. A newer or unknown format: :class:`UsageError` (exit 2)
    saying to upgrade dfcache. ``progress(n)`` is called once per manifest checked.
    """
    from ..config import default_store_location
    from ..manifest import validate_manifest
    from ._open import open_backend

    loc = os.fspath(location) if location is not None else default_store_location()
    scheme = loc.split("://", 1)[0].lower() if "://" in loc else ""
    backend = None
    if scheme in ("", "file"):
        root = Path(loc[len("file://"):] if scheme == "file" else loc).expanduser().absolute()
        url = f"file://{root}" if scheme == "file" else str(root)
        if not os.path.lexists(root / STORE_MARKER):
            raise UsageError(f"no dfcache store at {url}; pass an existing store with --store.")
        found = _marker_format(_local_marker(root, url, nofollow=scheme == "file"), url)
        manifests = lambda: _local_manifests(root)  # noqa: E731
    else:
        backend = open_backend(loc, create=False, endpoint_url=endpoint_url, region=region, offline=offline)
        url = backend.url
        raw = backend._run(backend._get(STORE_MARKER, limit=1 << 16), "reading the format marker of")
        if raw is None:
            raise UsageError(f"no dfcache store at {url} (no {STORE_MARKER}); nothing to migrate.")
        found = _marker_format(raw, url)
        backend._format_checked = True  # we are the ones reading it under the old format
        manifests = backend.iter_manifests
    result = MigrateResult(store=url, from_format=found, dry_run=dry_run)
    if found == FORMAT_VERSION:
        return result
    if isinstance(found, bool) or found not in MIGRATABLE:
        raise format_refusal(url, found)
    for key, data in manifests():
        result.artifacts += 1
        if isinstance(data, UnreadableManifest):
            result.unreadable.append({"key": key, "problem": data.problem})
            continue
        try:
            m = validate_manifest(json.loads(data), expect_key=key)
        except (ValueError, UntrustedManifestError) as e:
            result.unreadable.append({"key": key, "problem": str(e)})
        else:
            result.segments += bool(m.samples)
        if progress is not None:
            progress(1)
    if dry_run:
        return result
    if backend is None:
        _write_local_marker(root)
    else:
        backend._run(backend._set(STORE_MARKER, store_marker_bytes()), "rewriting the format marker of")
    result.migrated = True
    return result


__all__ = ["MigrateResult", "migrate_store"]
