"""Helpers shared by the reliability tests (import them from here, not from conftest.py: two
conftest modules share the name ``conftest``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STAGES = REPO / "runner" / "stages"

NUM_PROMPTS = 4
MAX_NEW = 8


def has_stage(name: str) -> bool:
    return (STAGES / f"{name}.py").exists() or (STAGES / name / "__init__.py").exists()


def clean_env(home: Path) -> dict:
    """os.environ without anything that changes what dfcache does (offline flags, store, config)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DFCACHE_OFFLINE", "HF_HUB_OFFLINE", "DFCACHE_STORE", "DFCACHE_DEBUG", "DFCACHE_CONFIG",
                        "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")}
    env.update(DFCACHE_HOME=str(home), DFCACHE_CONFIG=str(home / "absent.toml"), HF_HUB_DISABLE_UPDATE_CHECK="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), str(HERE)]))
    return env


def copy_store(base: dict, dst: Path) -> Path:
    shutil.copytree(base["path"], dst)
    return dst


def artifacts_listing(store: Path) -> list[str]:
    """Every path under artifacts/ with its size: what 'the store is unchanged' compares."""
    root = Path(store) / "artifacts"
    if not root.exists():
        return []
    return sorted(f"{p.relative_to(root)} {p.stat().st_size if p.is_file() else 'd'}" for p in root.rglob("*"))
