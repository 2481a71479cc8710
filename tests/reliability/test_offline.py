"""Offline means no network, asserted at the socket level.

Each run is a fresh `python -m dfcache` with tests/reliability/netguard on PYTHONPATH: its
sitecustomize.py records every socket created, every connect and every name lookup, and makes
connects and lookups fail. A positive control shows the guard sees a run that does connect.
Where strace works, one run is also traced at the system-call level (which also covers sockets
opened outside Python, e.g. by the Rust S3 client).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rel_helpers import HERE, MAX_NEW, artifacts_listing, copy_store, has_stage

GUARD = HERE / "netguard"


def guarded(env: dict, store: Path, args: list, log: Path, extra_env: dict | None = None, timeout: float = 600,
            prefix: list | None = None):
    e = {**env, **(extra_env or {}), "DFCACHE_NETGUARD_LOG": str(log),
         "PYTHONPATH": os.pathsep.join([str(GUARD), env.get("PYTHONPATH", "")])}
    cmd = (prefix or []) + [sys.executable, "-m", "dfcache", "--store", str(store), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout)


def json_detail(e: dict) -> dict:
    import ast

    return ast.literal_eval(e["detail"])


def network_events(log: Path) -> list[dict]:
    """Everything the guard recorded, apart from its own 'installed' line (which must be there)."""
    entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert any(e["what"] == "guard" for e in entries), "the network guard was not loaded"
    return [e for e in entries if e["what"] != "guard"]


OFFLINE_WAYS = {
    "--offline": (["--offline"], {}),
    "DFCACHE_OFFLINE=1": ([], {"DFCACHE_OFFLINE": "1"}),
    "--offline with a default S3 remote configured": (["--offline"], {"DFCACHE_CONFIG": "{cfg}"}),
}


@pytest.mark.parametrize("way", list(OFFLINE_WAYS))
def test_cached_run_tokens_offline_opens_no_socket(way, base_store, env, tmp_path, figures):
    """Server completions cached: `run tokens` offline replays them and opens no socket."""
    store = copy_store(base_store, tmp_path / "store")
    cfg = tmp_path / "dfcache.toml"
    cfg.write_text('default_remotes = ["team"]\n[remote.team]\nurl = "s3://team-bucket/dfcache"\n'
                   'endpoint_url = "http://127.0.0.1:9"\n')
    flags, extra = OFFLINE_WAYS[way]
    extra = {k: v.format(cfg=cfg) for k, v in extra.items()}
    log = tmp_path / "net.log"
    before = artifacts_listing(store)
    r = guarded(env, store, ["run", "tokens", *base_store["args"], *flags, "--json"], log, extra)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["computed"] == []
    events = network_events(log)
    assert events == [], f"{way}: the run touched the network: {json.dumps(events, indent=1)[:3000]}"
    assert artifacts_listing(store) == before
    figures.record("offline", **{f"run tokens, cached, {way}": "0 sockets"})


def test_guard_sees_a_run_that_does_connect(base_store, env, tmp_path):
    """Positive control: online, with completions missing, the run connects, and the guard sees it
    (and refuses it, so the run fails with exit 4 instead of reaching anything)."""
    store = copy_store(base_store, tmp_path / "store")
    log = tmp_path / "net.log"
    args = [a if a != str(MAX_NEW) else str(MAX_NEW + 1) for a in base_store["args"]]
    r = guarded(env, store, ["run", "tokens", *args], log)
    assert r.returncode == 4, r.stderr
    events = network_events(log)
    assert any(e["what"] in ("connect", "getaddrinfo", "create_connection") for e in events), events


def test_offline_run_tokens_under_strace_makes_no_network_syscall(base_store, env, tmp_path):
    strace = shutil.which("strace")
    if strace is None or subprocess.run([strace, "-f", "-o", os.devnull, "true"], capture_output=True).returncode:
        pytest.skip("strace is not available (or not permitted) here")
    store = copy_store(base_store, tmp_path / "store")
    trace = tmp_path / "trace.txt"
    r = guarded(env, store, ["run", "tokens", *base_store["args"], "--offline"], tmp_path / "net.log",
                prefix=[strace, "-f", "-qq", "-e", "trace=socket,connect,sendto,sendmsg", "-o", str(trace)])
    assert r.returncode == 0, r.stderr
    calls = [line for line in trace.read_text().splitlines() if "AF_INET" in line or "connect(" in line]
    assert calls == [], calls[:20]


@pytest.mark.skipif(not has_stage("drafter_eval"), reason="runner/stages/drafter_eval/ (the eval stage) is not "
                    "there yet")
def test_run_eval_example_offline_opens_no_socket(env, tmp_path_factory, stress, figures):
    """`dfcache run eval --example` offline: building the example, computing everything, and then
    the fully cached replay all open no socket."""
    store = tmp_path_factory.mktemp("example") / "store"
    log = store.parent / "net-first.log"
    first = guarded(env, store, ["run", "eval", "--example", "--offline", "--json"], log, timeout=1800)
    assert first.returncode == 0, first.stderr[-3000:]
    events = network_events(log)
    # Computing imports transformers, whose HTTP stack (urllib3) creates an IPv6 probe socket at
    # import time (bound to ::1, never connected), and writes zarr metadata through zarr, whose
    # asyncio loop makes a local socketpair (AF_UNIX). No connection, no name lookup, no other
    # socket is allowed.
    traffic = [e for e in events if e["what"] != "socket"]
    assert traffic == [], f"the computing run tried the network: {json.dumps(traffic, indent=1)[:3000]}"
    unix = str(int(socket.AF_UNIX))
    inet = [e for e in events if json_detail(e)["family"] != unix]
    assert all("urllib3/util/connection.py" in " ".join(e["stack"][-3:]) for e in inet), \
        json.dumps(inet, indent=1)[:3000]
    log2 = store.parent / "net-cached.log"
    again = guarded(env, store, ["run", "eval", "--example", "--offline", "--json"], log2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["computed"] == []
    events2 = network_events(log2)
    assert events2 == [], f"the cached eval opened a socket: {json.dumps(events2, indent=1)[:3000]}"
    figures.record("offline", **{"run eval --example, complete store": "0 sockets, 0 connects, 0 lookups",
                                 "run eval --example, computing from scratch": f"0 connects, 0 lookups "
                                 f"({len(inet)} import-time urllib3 probe socket(s), {len(events) - len(inet)} "
                                 "AF_UNIX socketpair(s))"})
