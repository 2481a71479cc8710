"""The store API: :class:`Store` (committed artifacts addressed by key, over one backend) and
:func:`open_store`. Writing is :mod:`._writer`, reading :mod:`._reader`; what the files are is
:mod:`dfcache.store.format`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import AmbiguousKeyError, ArtifactNotFoundError, IntegrityError, UntrustedManifestError, UsageError
from ..keys import KEY_PATTERN
from ..manifest import Manifest, key_problem
from . import format as fmt
from ._backend import Backend, UnreadableManifest
from ._reader import Artifact, repair_hint

if TYPE_CHECKING:
    from ._writer import ArtifactWriter


class Store:
    """A dfcache store: committed artifacts addressed by key, over one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.url = backend.url
        self._meta_checked: set[tuple[str, str]] = set()  # (key, array) whose zarr.json agrees
        # read_raw(mapped=True) chunks: (key, array, chunk) -> (rows, path, signature when checked)
        self._mapped: dict[tuple[str, str, int], tuple] = {}
        # (key, array, chunk) -> the file's (inode, size, mtime, ctime) when its check passed
        self._verified: dict[tuple[str, str, int], tuple] = {}

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def has(self, key: str) -> bool:
        try:
            return self.backend.read_manifest(key) is not None
        except UntrustedManifestError:
            return True  # there, but damaged: manifest() says so, with the fix

    def manifest(self, key: str) -> Manifest:
        try:
            raw = self.backend.read_manifest(key)
        except UntrustedManifestError as e:
            raise e.with_fix(repair_hint(key)) from None
        if raw is None:
            raise ArtifactNotFoundError(f"no artifact {key} in {self.url}; run `dfcache ls` to see what "
                                        "is there.")
        try:
            return Manifest.from_json(raw, expect_key=key)
        except UntrustedManifestError as e:
            raise e.with_fix(repair_hint(key)) from None

    def open(self, key: str) -> Artifact:
        return Artifact(self, self.manifest(key))

    def writer(self, key: str, *, stage: str, stage_version: int, inputs: dict,
               upstream: dict | None = None, provenance: dict | None = None, summary: str = "",
               resumable: bool = False, samples: dict | None = None,
               sample_refs: list | None = None) -> "ArtifactWriter":
        from ._writer import ArtifactWriter  # here: reading a store (a cached run) needs no writer

        return ArtifactWriter(self, key, stage=stage, stage_version=stage_version, inputs=inputs,
                              upstream=upstream, provenance=provenance, summary=summary,
                              resumable=resumable, samples=samples, sample_refs=sample_refs)

    def list_manifests(self, stage: str | None = None, *, errors: list | None = None) -> list[Manifest]:
        """Every committed artifact's manifest (never array data). Invalid manifests, and those
        whose claims (stage, inputs, upstream) do not give their key, are skipped and reported in
        ``errors`` as (key, message): whatever selects artifacts by what they claim (``ls``,
        ``--where``, ``gc`` scopes, ``push``/``pull --stage``) never trusts an edited one."""
        out = []
        for key, raw in self.backend.iter_manifests():
            if isinstance(raw, UnreadableManifest):
                if errors is not None:
                    errors.append((key, f"{raw.problem} {repair_hint(key)}"))
                continue
            if stage is not None and f'"stage": "{stage}"' not in raw.decode("utf-8", "replace"):
                continue
            try:
                m = Manifest.from_json(raw, expect_key=key if KEY_PATTERN.match(key) else None)
                claims = key_problem(m)
                if claims:
                    raise UntrustedManifestError(f"manifest of {m.key} refused: {claims}.", key=m.key,
                                                 fix=repair_hint(m.key))
            except UntrustedManifestError as e:
                if errors is not None:
                    errors.append((key, e.message))
                continue
            if stage is None or m.stage == stage:
                out.append(m)
        return out

    def keys(self) -> list[str]:
        return [k for k, _ in self.backend.iter_manifests()]

    def resolve(self, prefix: str) -> str:
        """The full key for a unique prefix (as git does for commits)."""
        prefix = prefix.strip().lower()
        if not prefix or any(c not in "0123456789abcdef" for c in prefix):
            raise ArtifactNotFoundError(f"{prefix!r} is not a key or key prefix (hex digits).")
        if len(prefix) == 32:
            if self.has(prefix):
                return prefix
            raise ArtifactNotFoundError(f"no artifact {prefix} in {self.url}; run `dfcache ls`.")
        matches = [k for k in self.keys() if k.startswith(prefix)]
        if not matches:
            raise ArtifactNotFoundError(f"no artifact key starts with {prefix} in {self.url}; run "
                                        "`dfcache ls` to see the keys.")
        if len(matches) > 1:
            raise AmbiguousKeyError(f"key prefix {prefix} matches {len(matches)} artifacts "
                                    f"({', '.join(m[:12] for m in matches[:5])}); give more digits.")
        return matches[0]

    def delete(self, key: str) -> bool:
        return self.backend.delete(key)

    def verify(self, key: str) -> list[str]:
        """Problems with one artifact: invalid manifest, missing or corrupt files."""
        try:
            art = self.open(key)
        except IntegrityError as e:
            return [e.message]
        problems = art.problems()
        if not problems and art.manifest.samples:
            from ..samples import segment_problems

            problems = segment_problems(self, key)
        return problems

    def local_dir(self, name: str) -> Path | None:
        """A directory on this machine beside the store's artifacts, for files made from them
        (report files, generated example models); None when the store is not a local directory.

        ``name`` is one plain name (``reports``, ``example``); the directory may not exist yet."""
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or name in fmt.RESERVED_DIRS:
            raise UsageError(f"{name!r} is not a name for a directory beside the store's artifacts.")
        root = self.backend.local_root
        return None if root is None else Path(root) / name


def open_store(location: str | os.PathLike | None = None, *, create: bool = True,
               endpoint_url: str | None = None, region: str | None = None,
               offline: bool | None = None) -> Store:
    """Open a store by path or URL: a directory, ``file:///path``, ``s3://bucket/prefix``.

    ``None`` means ``$DFCACHE_STORE`` or ``./store``. A local store is created if missing (unless
    ``create=False``). A ``file://`` store is read without following symbolic links; an
    ``s3://`` store is refused while offline. See :mod:`dfcache.store._open`.
    """
    from ._open import open_backend

    return Store(open_backend(location, create=create, endpoint_url=endpoint_url, region=region,
                              offline=offline))
