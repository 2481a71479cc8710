"""Fixtures of the reliability suite (tests/reliability): the fork server, a clean environment,
a base store with prompts, server completions and tokens, and the figures the suite reports.

``pytest tests/reliability --stress`` (or ``DFCACHE_RELIABILITY_STRESS=1`` with any path) runs more
crash trials and longer races. With ``DFCACHE_RELIABILITY_SUMMARY=PATH``
the suite writes its figures (trials, phases hit, cases, outcomes) to PATH as JSON;
``python tests/reliability/render_figures.py PATH`` puts them into docs/reliability.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from rel_helpers import MAX_NEW, NUM_PROMPTS, clean_env  # noqa: E402
from zygote import Zygote  # noqa: E402

# Preloaded by the light fork server: everything `dfcache` and the store writers import.
LIGHT = ["dfcache.cli", "dfcache.cli._ls", "dfcache.cli._show", "dfcache.cli._verify", "dfcache.cli._gc",
         "dfcache.cli._transfer", "dfcache.store",
         "dfcache.maintenance", "dfcache.transfer", "runner.commands.run", "runner.core.graph", "runner.core.pipeline",
         "numpy", "ml_dtypes", "zarr", "numcodecs", "typer", "tqdm", "children",
         # what typer and the entry-point scan import lazily on every command
         "pydantic", "importlib.metadata", "typer._adapters", "email.message", "zipfile", "tempfile", "csv"]
HEAVY = LIGHT + ["torch", "transformers", "runner.models.target", "runner.stages.hidden_states.extract",
                 # transformers imports these lazily, at the first from_pretrained: ~4 s per process
                 "transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.auto.modeling_auto",
                 "transformers.tokenization_utils_fast", "safetensors.torch", "runner.stages.completions.sources",
                 "runner.stages.hidden_states", "runner.stages.drafter_eval", "runner.drafters.dflash",
                 "runner.stages.drafter_eval.metrics"]



def pytest_addoption(parser):
    parser.addoption("--stress", action="store_true", default=False,
                     help="reliability suite: many more crash trials and longer races")


def _stress(config) -> bool:
    # `--stress` exists when pytest is pointed at tests/reliability (a conftest's options are read
    # only from the directories given on the command line); DFCACHE_RELIABILITY_STRESS=1 works always.
    return bool(config.getoption("--stress", default=False)) or os.environ.get("DFCACHE_RELIABILITY_STRESS") == "1"


@pytest.fixture(scope="session")
def stress(request) -> bool:
    return _stress(request.config)



UNSET = ("DFCACHE_OFFLINE", "HF_HUB_OFFLINE", "DFCACHE_STORE", "DFCACHE_DEBUG")


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> dict:
    return clean_env(tmp_path_factory.mktemp("rel-home"))


@pytest.fixture(scope="session")
def zygote(env, tmp_path_factory):
    z = Zygote(LIGHT, tmp_path_factory.mktemp("zygote"), env=env)
    yield z
    z.close()


@pytest.fixture(scope="session")
def heavy_zygote(env, tmp_path_factory):
    """A fork server with torch and transformers imported (no op run, so no threads yet)."""
    z = Zygote(HEAVY, tmp_path_factory.mktemp("zygote-heavy"), env=env)
    yield z
    z.close()


@pytest.fixture
def fast_tmp(tmp_path):
    """A fresh directory on a RAM filesystem when there is one (fsync there is ~0.2 ms instead of
    ~10 ms on the CI disk), else tmp_path. Process-kill semantics (flock, rename, O_APPEND) are the
    same on both; the crash tests widen the commit window with a slowed fsync instead."""
    import tempfile

    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1 << 30:
        d = Path(tempfile.mkdtemp(prefix="dfcache-rel-", dir=shm))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


# ------------------------------------------------------------------------------ base store


@pytest.fixture(scope="session")
def base_store(tiny_target, tmp_path_factory, env):
    """A store holding prompts, server completions (from a scripted server) and tokens of the
    tiny target. ``args`` replays them through the CLI: the server URL is not key material, so a
    dead URL plus --offline finds them all cached."""
    from servers import ScriptedServer, run_pipeline

    store = tmp_path_factory.mktemp("base") / "store"
    saved = {k: os.environ.pop(k, None) for k in UNSET}
    try:
        with ScriptedServer(chat="ok") as server:
            _, nodes = run_pipeline(store, "tokens", target=str(tiny_target), completions="server",
                                    server=server.url, num_prompts=NUM_PROMPTS, max_new_tokens=MAX_NEW)
    finally:
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
    args = ["--target", str(tiny_target), "--server", "http://127.0.0.1:9", "--num-prompts", str(NUM_PROMPTS),
            "--max-new-tokens", str(MAX_NEW)]
    from dfcache.samples import index_of
    from dfcache.store import open_store

    idx = index_of(open_store(store))
    segments = {}
    for stage, n in nodes.items():
        (segments[stage],) = idx.segments(n.partition.key)  # a few prompts: one segment a stage
    # "keys": the artifacts (segments) on disk; "sets": the nodes' set keys (what runs report)
    return {"path": store, "keys": segments, "sets": {s: n.key for s, n in nodes.items()}, "args": args}


# ------------------------------------------------------------------------------ figures


class Figures:
    def __init__(self) -> None:
        self.data: dict = {}
        self.outcomes: dict[str, str] = {}
        self.skips: dict[str, str] = {}
        self.started = time.time()
        self.test_seconds = 0.0  # setup + call + teardown of the reliability tests only

    def record(self, name: str, **values) -> None:
        self.data.setdefault(name, {}).update(values)


_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def _ours(nodeid: str) -> bool:
    return "reliability/" in nodeid.replace(os.sep, "/")


def pytest_runtest_logreport(report):
    if not _ours(report.nodeid):
        return
    _FIGURES.test_seconds += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
            _FIGURES.skips[report.nodeid] = f"known gap (xfail): {report.wasxfail}"
        elif outcome == "skipped":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _FIGURES.skips[report.nodeid] = reason.replace("Skipped: ", "")
        _FIGURES.outcomes[report.nodeid] = outcome


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("DFCACHE_RELIABILITY_SUMMARY")
    if not path or not _FIGURES.outcomes:
        return
    counts: dict[str, int] = {}
    for outcome in _FIGURES.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    summary = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m pytest " + " ".join(session.config.invocation_params.args),
        "stress": _stress(session.config),
        "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)",
        "seconds": round(_FIGURES.test_seconds, 1), "session_seconds": round(time.time() - _FIGURES.started, 1),
        "tests": counts, "skipped": _FIGURES.skips,
        "failed": sorted(k for k, v in _FIGURES.outcomes.items() if v == "failed"),
        "figures": _FIGURES.data,
    }
    Path(path).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
