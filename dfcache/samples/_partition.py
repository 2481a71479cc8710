"""A partition: everything a per-sample stage keys except the set of samples; its key is an
ordinary :func:`dfcache.compute_key` of (stage, version, inputs, upstream partition keys), and each
of its samples' keys :func:`dfcache.keys.sample_key` of it and the upstream sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..errors import IntegrityError, UsageError
from ..keys import compute_key, sample_key, sample_keys
from ..manifest import Manifest


def partition_key(stage: str, version: int, inputs: dict, upstream: dict | None = None) -> str:
    return compute_key(stage, version, inputs, upstream or {})


@dataclass(eq=False)
class Partition:
    """One per-sample stage's inputs without the samples; ``key`` is derived from the rest."""

    stage: str
    version: int
    inputs: dict
    upstream: dict = field(default_factory=dict)  # role -> partition key (or list of them)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = partition_key(self.stage, self.version, self.inputs, self.upstream)

    def sample_key(self, upstream: str) -> str:
        return sample_key(self.key, upstream)

    def sample_keys(self, upstream: Iterable[str]) -> list[str]:
        return sample_keys(self.key, upstream)

    @classmethod
    def of_segment(cls, m: Manifest) -> "Partition":
        """The partition a segment manifest claims, checked: its key must derive from the
        manifest's stage, version, inputs and upstream partitions (else it is not trusted)."""
        s = m.samples or {}
        try:
            p = cls(m.stage, m.stage_version, m.inputs, dict(s.get("partition_upstream") or {}))
        except UsageError:
            p = None
        if p is None or p.key != s.get("partition"):
            raise IntegrityError(f"segment {m.key} claims partition {s.get('partition')} but its inputs give "
                                 f"{p.key if p else 'no key'}; the manifest was altered. Delete it "
                                 f"(`dfcache gc --key {m.key[:12]} --force --yes`) or pull it again.", key=m.key)
        return p
