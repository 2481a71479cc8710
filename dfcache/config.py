"""Environment variables and configuration files, read in one place.

Environment:
    DFCACHE_STORE      default store (path or URL) when ``--store`` is not given; else ``./store``.
    DFCACHE_OFFLINE    ``1``/``true`` turns offline mode on (as does ``HF_HUB_OFFLINE``).
    HF_HUB_OFFLINE     honoured as offline too, so one switch covers huggingface_hub and dfcache.
    DFCACHE_HOME       where dfcache keeps machine-local state (fingerprint memo); default
                       ``~/.cache/dfcache``.
    DFCACHE_CONFIG     path of a config file to use instead of the usual search.
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID
                       set by torchrun: which worker of a distributed run this is (docs/distributed.md).
    SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_MIN, SLURM_ARRAY_TASK_COUNT
                       read for ``--shard slurm`` only.
    CUDA_VISIBLE_DEVICES  named in the message when LOCAL_RANK has no GPU.

Config files (TOML), first found wins: ``$DFCACHE_CONFIG``, ``./dfcache.toml``,
``~/.config/dfcache/config.toml``. See ``docs/config.md``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

_TRUE = {"1", "true", "yes", "on"}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def offline_from_env() -> bool:
    """True if ``DFCACHE_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to a true value."""
    return _env_true("DFCACHE_OFFLINE") or _env_true("HF_HUB_OFFLINE")


def default_store_location() -> str:
    return os.environ.get("DFCACHE_STORE") or "store"


def segment_bytes() -> int:
    """Bytes of one per-sample segment of a layer before it is committed ($DFCACHE_SEGMENT_BYTES,
    default 256 MiB): what an interrupted extraction can lose at most, per layer."""
    raw = os.environ.get("DFCACHE_SEGMENT_BYTES", "").strip()
    if raw:
        try:
            value = int(float(raw))
        except ValueError:
            value = 0
        if value < 1:
            from .errors import UsageError

            raise UsageError(f"DFCACHE_SEGMENT_BYTES={raw!r}: give a positive number of bytes (e.g. 268435456).")
        return value
    return 256 << 20


def dfcache_home() -> Path:
    return Path(os.environ.get("DFCACHE_HOME") or Path.home() / ".cache" / "dfcache")


def fingerprint_memo_path() -> Path:
    return dfcache_home() / "fingerprints.json"


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT",
                  "CUDA_VISIBLE_DEVICES")


def launcher_env() -> dict[str, str]:
    """What a launcher (torchrun, a Slurm array) told this process about its place in a job."""
    return {k: os.environ[k] for k in _LAUNCHER_VARS if k in os.environ}


@dataclass
class RemoteConfig:
    name: str
    url: str
    endpoint_url: str | None = None
    region: str | None = None


@dataclass
class Config:
    """What the config file says; empty when there is none."""

    path: Path | None = None
    store: str | None = None
    remotes: dict[str, RemoteConfig] = field(default_factory=dict)
    default_remotes: list[str] = field(default_factory=list)

    def remote_urls(self, names_or_urls: list[str]) -> list[RemoteConfig]:
        """Resolve each name (from ``[remote.NAME]``) or URL to a :class:`RemoteConfig`."""
        out = []
        for item in names_or_urls:
            if item in self.remotes:
                out.append(self.remotes[item])
            elif "://" in item or item.startswith("/") or item.startswith("."):
                out.append(RemoteConfig(name=item, url=item))
            else:
                known = ", ".join(sorted(self.remotes)) or "none configured"
                raise UsageError(f"remote {item!r} is neither a URL nor a configured remote name "
                                 f"({known}); give a URL such as s3://bucket/prefix or add "
                                 f"[remote.{item}] to dfcache.toml.")
        return out


def _config_candidates() -> list[Path]:
    if os.environ.get("DFCACHE_CONFIG"):
        return [Path(os.environ["DFCACHE_CONFIG"])]
    return [Path.cwd() / "dfcache.toml", Path.home() / ".config" / "dfcache" / "config.toml"]


def load_config() -> Config:
    """Read the first config file found; a malformed file is a usage error naming it."""
    for path in _config_candidates():
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"config file {path} cannot be read: {e}; fix or remove it.") from None
        cfg = Config(path=path, store=data.get("store"))
        for name, body in (data.get("remote") or {}).items():
            if not isinstance(body, dict) or "url" not in body:
                raise UsageError(f"config file {path}: [remote.{name}] needs a url = \"...\" line.")
            cfg.remotes[name] = RemoteConfig(name=name, url=str(body["url"]),
                                             endpoint_url=body.get("endpoint_url"),
                                             region=body.get("region"))
        default = data.get("default_remotes", [])
        cfg.default_remotes = [default] if isinstance(default, str) else list(default)
        return cfg
    return Config()
