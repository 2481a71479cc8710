"""Opt-in version keying: ``--key-versions fla,transformers`` makes those exact versions part of
every hidden-state key.

By default exact library versions are provenance, recorded and shown but not keyed (DESIGN §3),
so a patch release of transformers does not invalidate terabytes of states. Teams that want a
re-extraction on every upgrade of a package opt in per run; the default keys do not change (the
``versions`` input is absent unless asked for). Versions are read from package metadata, never
by importing the package; a package that is not installed keys as ``null``.
"""

from __future__ import annotations

from dfcache.errors import UsageError

# Short names users type -> distribution names (as recorded in provenance "versions").
ALIASES = {"fla": "flash-linear-attention", "flash-linear-attention": "flash-linear-attention",
           "fla-core": "fla-core", "torch": "torch", "transformers": "transformers", "triton": "triton",
           "causal-conv1d": "causal-conv1d", "causal_conv1d": "causal-conv1d", "accelerate": "accelerate",
           "cuda": "cuda"}


def parse_key_versions(value: str | None) -> list[str]:
    """``"fla, transformers"`` -> sorted unique distribution names; unknown names are a usage error."""
    if not value:
        return []
    out = set()
    for part in value.split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name not in ALIASES:
            raise UsageError(f"--key-versions: unknown package {part.strip()!r}; choose from "
                             f"{', '.join(sorted(set(ALIASES) - {'flash-linear-attention', 'causal_conv1d'}))}.")
        out.add(ALIASES[name])
    return sorted(out)


def installed_version(dist: str) -> str | None:
    if dist == "cuda":
        from ..models.target import _torch_build

        return _torch_build().get("cuda")
    import importlib.metadata  # here: the default keys read no package metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def key_version_inputs(opts) -> dict:
    """Extra hidden-state key inputs for ``opts.key_versions``: ``{}`` (the default) or ``{"versions": {...}}``."""
    names = list(getattr(opts, "key_versions", None) or [])
    if not names:
        return {}
    return {"versions": {d: installed_version(d) for d in names}}
