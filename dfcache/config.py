"""Environment variables and configuration files, read in one place.

Environment:
    DFCACHE_STORE      default store (path or URL) when ``--store`` is not given; else ``./store``.
    DFCACHE_OFFLINE    ``1``/``true`` turns offline mode on (as ``--offline`` does). Nothing else
                       does: ``HF_HUB_OFFLINE`` only keeps transformers and huggingface_hub off the
                       Hub (dfcache never downloads from it), so an air-gapped cluster that sets it
                       everywhere still reaches its own completion server and S3 store.
    DFCACHE_HOME       where dfcache keeps machine-local state (fingerprint memo); default
                       ``~/.cache/dfcache``.
    DFCACHE_CONFIG     path of a config file to use instead of the usual search.
    DFCACHE_DEBUG      any non-empty value: tracebacks instead of one-line errors (as ``--debug``).
    DFCACHE_WRITE_THREADS
                       chunk files of one array a store writer writes at once (default 1: one
                       after the other on the appending thread; more measured no gain on a GPU host);
                       a local store fsyncs 4 x that many staged files at once (at least 32).
    DFCACHE_PROGRESS_INTERVAL
                       seconds between the progress lines of long stages when stderr is not a
                       terminal (default 10; 0: a line at every step; ``--no-progress``: none).
    AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS_ENDPOINT, AWS_REGION, AWS_DEFAULT_REGION
                       the S3 endpoint and region when neither ``--endpoint-url`` nor the remote's
                       config gives one (credentials, ``AWS_ACCESS_KEY_ID`` and friends, are read
                       by obstore itself; dfcache only asks whether any source of them is set,
                       :func:`aws_credential_source`, never for their values).
    DFCACHE_MAX_RESPONSE_BYTES
                       the most bytes one HTTP answer may have, instead of the bound dfcache derives
                       (docs/config.md).
    HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME, XDG_CACHE_HOME
                       where huggingface_hub keeps models (read the way huggingface_hub reads them).
    HF_DATASETS_CACHE  where the datasets library keeps prepared datasets (``--prompts hf:NAME``
                       and ``suite:NAME`` read them there, never from the Hub); default
                       ``$HF_HOME/datasets``, read the way the datasets library reads it.
    CUDA_VISIBLE_DEVICES
                       which GPUs exist for this process (decides "is a GPU usable" without torch).
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID
                       set by torchrun: which worker of a distributed run this is (docs/distributed.md).
    SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_MIN, SLURM_ARRAY_TASK_COUNT
                       read for ``--shard slurm`` only.

Nothing else in dfcache or the runner reads the environment.

Config files (TOML), first found wins: ``$DFCACHE_CONFIG``, ``./dfcache.toml``,
``~/.config/dfcache/config.toml``. See ``docs/config.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

_TRUE = {"1", "true", "yes", "on"}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _env_number(name: str, parse, ok, fix: str):
    """$name parsed by ``parse`` (None when unset or blank); a value that does not parse or fails
    ``ok`` is a UsageError naming the variable, its value and ``fix``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = parse(raw)
    except (ValueError, OverflowError):  # OverflowError: int(float("inf"))
        value = None
    if value is None or not ok(value):
        raise UsageError(f"{name}={raw!r}: {fix}")
    return value


def offline_from_env() -> bool:
    """True if ``DFCACHE_OFFLINE`` is set to a true value (``HF_HUB_OFFLINE`` is not dfcache's switch)."""
    return _env_true("DFCACHE_OFFLINE")


def debug_from_env() -> bool:
    return bool(os.environ.get("DFCACHE_DEBUG"))


@dataclass(frozen=True)
class AwsSettings:
    endpoint_url: str | None
    region: str | None


def aws_settings() -> AwsSettings:
    """The S3 endpoint and region from the AWS_* variables (None where unset)."""
    env = os.environ
    return AwsSettings(endpoint_url=(env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                                     or env.get("AWS_ENDPOINT") or None),
                       region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None)


def aws_credential_source() -> str | None:
    """Where obstore would take S3 credentials from without asking a cloud instance-metadata
    service, or None when nothing is set (it would then ask http://169.254.169.254). Only
    whether the variables are set is looked at, never their values. The order is obstore's
    (object_store's AmazonS3Builder): keys, web identity, container credentials; plus
    ``AWS_SKIP_SIGNATURE`` (no credentials, unsigned requests) and ``AWS_METADATA_ENDPOINT``
    (the user asks for instance credentials)."""
    env = os.environ
    if _env_true("AWS_SKIP_SIGNATURE"):
        return "unsigned"
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_SECRET_ACCESS_KEY"):
        return "keys"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and env.get("AWS_ROLE_ARN"):
        return "web identity"
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return "container"
    if env.get("AWS_METADATA_ENDPOINT"):
        return "instance metadata"
    return None


MIN_RESPONSE_BYTES = 64 << 10


def max_response_bytes() -> int | None:
    """``DFCACHE_MAX_RESPONSE_BYTES``: the most bytes one HTTP answer may have, over the bound
    dfcache derives for each request (None: unset). Accepts ``512MiB``-style suffixes."""
    raw = os.environ.get("DFCACHE_MAX_RESPONSE_BYTES", "").strip()
    if not raw:
        return None
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
             "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}
    import re

    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)", raw)
    value = int(float(m.group(1)) * units[m.group(2).lower()]) if m and m.group(2).lower() in units else 0
    if value < MIN_RESPONSE_BYTES:
        raise UsageError(f"DFCACHE_MAX_RESPONSE_BYTES={raw!r}: give a number of bytes of at least "
                         f"{MIN_RESPONSE_BYTES} (e.g. 268435456 or 256MiB).")
    return value


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models, by the same environment variables it reads."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def datasets_cache_dir() -> Path:
    """Where the datasets library keeps prepared datasets, by the variables it reads."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "datasets"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "datasets"


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (None if unset)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def default_store_location() -> str:
    return os.environ.get("DFCACHE_STORE") or "store"


def cuda_graphs() -> bool:
    """Whether the hidden-state extraction may replay CUDA graphs ($DFCACHE_CUDA_GRAPHS, default on;
    ``0``, ``false``, ``no`` or ``off`` turn it off). Graphs change no stored bit; off costs speed."""
    return os.environ.get("DFCACHE_CUDA_GRAPHS", "1").strip().lower() not in ("0", "false", "no", "off")


def cuda_lanes() -> int:
    """CUDA streams the hidden-state extraction runs its forwards on side by side ($DFCACHE_CUDA_LANES:
    2, the default, or 1, one forward at a time). Each lane replays its own CUDA graphs, and a shape
    runs side by side only after a check of the pair that it keeps every bit
    (``runner.models.lanes``), so stored rows are the same either way; the memory plan drops to one
    lane where the second does not fit. Two lanes measured faster in every run on an H100
    (2026-12-07: the 27B-shaped extraction 10,051 vs 9,799 tok/s, medians of two each in turns;
    8B-shaped 22,697 and 22,004 vs 21,567; ``bench/results/gpu/gpu_extract_*_lanes_h100_2026-12-07.*``)."""
    value = _env_number("DFCACHE_CUDA_LANES", int, lambda v: v in (1, 2),
                        "give 2 (forwards side by side, the default) or 1 (one forward at a time).")
    return 2 if value is None else value


def segment_bytes() -> int:
    """Bytes of one per-sample segment of a layer before it is committed ($DFCACHE_SEGMENT_BYTES,
    default 256 MiB): what an interrupted extraction can lose at most, per layer."""
    value = _env_number("DFCACHE_SEGMENT_BYTES", lambda raw: int(float(raw)), lambda v: v >= 1,
                        "give a positive number of bytes (e.g. 268435456).")
    return 256 << 20 if value is None else value


def write_threads() -> int | None:
    """Chunk files of one array written at once ($DFCACHE_WRITE_THREADS, a positive integer), or
    None when unset (the store then writes one after the other: ``dfcache.store._pools.write_threads``)."""
    return _env_number("DFCACHE_WRITE_THREADS", int, lambda v: v >= 1,
                       "give a positive number of threads (1: no parallel writes).")


def progress_interval() -> float:
    """Seconds between the progress lines long stages print when stderr is not a terminal
    ($DFCACHE_PROGRESS_INTERVAL, default 10; 0: a line at every step). A terminal gets bars."""
    import math

    value = _env_number("DFCACHE_PROGRESS_INTERVAL", float, lambda v: math.isfinite(v) and v >= 0,
                        "give a number of seconds (0: a line at every step).")
    return 10.0 if value is None else value


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
        import tomllib  # here: most commands run without a config file, and a fully cached run is short

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


def quiet_hub_libraries(*, bars: bool, notices: bool) -> None:
    """Silence transformers/huggingface_hub progress bars and notices through their environment
    (read when they are imported); environment access stays in this module."""
    if not bars:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if not notices:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
