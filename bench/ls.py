"""`ls`: wall time of ``dfcache ls --json`` (a subprocess, as a user runs it) over stores of
10,000 and 30,000 small artifacts (100,000 at ``--size large``), and how the per-artifact cost
grows with the store.

The artifacts are real: written by ``store.writer`` (five stages, realistic inputs and
upstream keys, one small array and one JSON document each), by 4 worker processes, with
``os.fsync`` turned into a no-op in the workers only (durability is not what ``ls`` is measured
on; the commit cost with fsync is measured apart and printed). The stores are kept in
``bench/out/cache/ls/`` keyed by a hash of the store's sources, so a second run with unchanged
store code reuses them; the build time of a fresh build is recorded. The 30k store is the 10k
store copied plus 20k more. ``ls`` runs with the page cache warm. Per-artifact cost is
``(t(N) - t(empty store)) / N``; growth = per-artifact cost at the larger N / at 10k.
The stores carry the listing index their writers logged at commit (``dfcache/store/_index.py``);
the same 10k store with its index removed first (an old store) is printed beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ._common import (OUT_DIR, REPO, Ctx, Result, Row, alternate, bench_env, clock, dfcache_cmd, med, ms,
                      profile_top, rmtree, run_cmd, summary)

NAME = "ls"
WORKERS = 4
STAGES = ("prompts", "completions", "tokens", "hidden_states", "eval")
SOURCES = ("dfcache/__init__.py", "dfcache/keys.py", "dfcache/manifest.py", "dfcache/store/_store.py",
           "dfcache/store/_writer.py", "dfcache/store/format.py", "dfcache/store/layout.py", "dfcache/store/_open.py",
           "dfcache/store/_directory.py", "dfcache/store/_local.py", "dfcache/store/_backend.py")


def counts(factor: float) -> tuple[int, int]:
    n1 = max(100, round(10_000 * min(1.0, factor)))
    n2 = 100_000 if factor >= 3 else max(3 * n1, round(30_000 * factor))
    return n1, n2


def _artifact(i: int) -> tuple[str, dict, dict]:
    from dfcache.keys import compute_key

    stage = STAGES[i % len(STAGES)]
    inputs = {"target": f"{(i * 2654435761) % 2**64:016x}{i:016x}", "prompts": "builtin:coding",
              "num_prompts": 10 + i % 50, "max_new_tokens": 256, "temperature": 0.0, "seed": i,
              "backend": {"kernel": "torch", "dtype": "bfloat16"}}
    upstream = {} if stage == "prompts" else {"input": compute_key("x", 1, {"i": i - 1})}
    return stage, inputs, upstream


def build(store_path: str, start: int, count: int) -> None:
    """Worker: write artifacts start..start+count-1 with the real writer (fsync off)."""
    import numpy as np

    os.fsync = lambda fd: None  # fixture speed only; the bytes are what the writer writes
    from dfcache.keys import compute_key
    from dfcache.store import open_store

    store = open_store(store_path)
    ids = np.arange(64, dtype=np.int32)
    for i in range(start, start + count):
        stage, inputs, upstream = _artifact(i)
        key = compute_key(stage, 1, inputs, upstream)
        with store.writer(key, stage=stage, stage_version=1, inputs=inputs, upstream=upstream,
                          summary=f"{stage} #{i}") as w:
            w.write_array("token_ids", ids + i)
            w.put_json("meta", {"i": i, "stage": stage})


def _build_range(store: Path, start: int, count: int) -> None:
    per = -(-count // WORKERS)
    procs = []
    for k in range(WORKERS):
        a = start + k * per
        n = min(per, start + count - a)
        if n <= 0:
            continue
        procs.append(subprocess.Popen([sys.executable, "-c", f"from bench.ls import build; build({str(store)!r}, {a}, {n})"],
                                      cwd=str(REPO), env=bench_env(PYTHONPATH=str(REPO))))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("building the ls fixture failed (see stderr)")


def _fingerprint() -> str:
    import xxhash

    import inspect

    h = xxhash.xxh3_64()
    for s in SOURCES:
        h.update((REPO / s).read_bytes())
    for fn in (_artifact, build):  # the fixture's own recipe
        h.update(inspect.getsource(fn).encode())
    return h.hexdigest()


def fixtures(ctx: Ctx, sizes: list[int]) -> tuple[dict[int, Path], dict]:
    base = OUT_DIR / "cache" / "ls" / _fingerprint()
    base.mkdir(parents=True, exist_ok=True)
    for old in base.parent.iterdir():  # stores of older store code are stale
        if old != base:
            rmtree(old)
    paths, info = {}, {}
    prev = None
    for n in sorted(sizes):
        p = base / f"store-{n}"
        if (p / ".complete").exists():
            info[n] = {"reused": True}
        else:
            rmtree(p)
            t0 = time.perf_counter()
            start = 0
            if prev is not None:
                ctx.log(f"copying the {prev[0]}-artifact store")
                subprocess.run(["cp", "-a", "--reflink=auto", str(prev[1]), str(p)], check=True)
                (p / ".complete").unlink(missing_ok=True)
                start = prev[0]
            ctx.log(f"building {n - start} artifacts into {p.name} ({WORKERS} workers)")
            if start == 0:
                from dfcache.store import open_store
                open_store(p)
            _build_range(p, start, n - start)
            (p / ".complete").write_text("ok\n")
            dt = time.perf_counter() - t0
            info[n] = {"reused": False, "build_s": round(dt, 1), "written": n - start,
                       "ms_per_artifact_4_workers": round(dt / max(1, n - start) * 1e3, 2)}
        paths[n] = p
        prev = (n, p)
    return paths, info


def commit_cost(ctx: Ctx, n: int = 100) -> float:
    """Seconds per small-artifact commit with the real writer, fsync on, one process."""
    import numpy as np

    from dfcache.keys import compute_key
    from dfcache.store import open_store

    root = ctx.tmpdir("commit")
    store = open_store(root / "s")
    ids = np.arange(64, dtype=np.int32)

    def go():
        for i in range(n):
            stage, inputs, upstream = _artifact(10**7 + i)
            key = compute_key(stage, 1, inputs, upstream)
            with store.writer(key, stage=stage, stage_version=1, inputs=inputs, upstream=upstream) as w:
                w.write_array("token_ids", ids)
                w.put_json("meta", {"i": i})
    t = clock(go)
    rmtree(root)
    return t / n


def _profile_ls(store: Path) -> list[dict]:
    """cProfile of the executable's own path (``dfcache/__main__.py``: the listing index)."""
    import contextlib
    import io

    from dfcache.__main__ import _fast_ls

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        return profile_top(lambda: _fast_ls(["--store", str(store), "ls", "--json"]), n=15)


def run(ctx: Ctx) -> Result:
    n1, n2 = counts(ctx.factor)
    reps = ctx.reps_or(3)
    paths, build_info = fixtures(ctx, [n1, n2])
    empty_root = ctx.tmpdir("ls-empty")
    from dfcache.store import open_store
    open_store(empty_root / "s")
    paths[0] = empty_root / "s"
    env = bench_env()

    def lister(n: int, without_index: bool = False):
        def go() -> float:
            if without_index:  # a store written before the index, or whose index was lost
                rmtree(paths[n] / "index")
            t, cp = run_cmd(dfcache_cmd("--store", str(paths[n]), "ls", "--json"), env=env, timeout=900)
            if cp.returncode != 0:
                raise RuntimeError(f"dfcache ls failed: {cp.stderr.decode()[-300:]}")
            got = len(json.loads(cp.stdout))
            if got != n:
                raise RuntimeError(f"dfcache ls listed {got} artifacts, expected {n}")
            return t
        return go

    ctx.log("warming the page cache (one ls each)")
    for n in (0, n1, n2):
        lister(n)()
    def python_startup() -> float:
        t, _ = run_cmd([sys.executable, "-c", "pass"], env=env)
        return t

    times = alternate({"python -c pass": python_startup, "empty": lister(0), f"{n1}": lister(n1),
                       f"{n2}": lister(n2), f"{n1} no index": lister(n1, True)}, reps, log=ctx.log)
    lister(n1)()  # leave the fixture with its index
    m = {k: med(v) for k, v in times.items()}
    ctx.log(f"profiling ls in-process over {n1} artifacts")
    prof = _profile_ls(paths[n1])
    ctx.log("measuring one small-artifact commit with fsync")
    commit_s = commit_cost(ctx)
    rmtree(empty_root)
    per1 = (m[f"{n1}"] - m["empty"]) / n1
    per2 = (m[f"{n2}"] - m["empty"]) / n2
    rows = [
        Row(NAME, f"dfcache ls --json, {n1:,} artifacts (wall, subprocess)", ms(m[f"{n1}"]),
            f"empty store: {ms(m['empty'])}", m[f"{n1}"], unit=" s", target=0.5, direction="<",
            note=f"absolute seconds; {per1 * 1e6:.0f} µs per artifact above the empty-store start-up; "
            f"`python -c pass` takes {ms(m['python -c pass'])} on this machine now"),
        Row(NAME, "dfcache ls --json start-up: empty store vs `python -c pass` (wall, subprocess)",
            ms(m["empty"]), ms(m["python -c pass"]), m["empty"] / m["python -c pass"],
            note="time ratio (lower is better): what dfcache adds to the interpreter before listing"),
        Row(NAME, f"dfcache ls --json, {n1:,} artifacts, no index (an old store; this ls rebuilds it)",
            ms(m[f"{n1} no index"]), ms(m[f"{n1}"]) + " with it", m[f"{n1} no index"] / m[f"{n1}"],
            note="time ratio: every manifest read and validated once, as every ls did before the index"),
        Row(NAME, f"dfcache ls --json, {n2:,} artifacts (wall, subprocess)", ms(m[f"{n2}"]),
            f"empty store: {ms(m['empty'])}", m[f"{n2}"], unit=" s",
            note=f"{per2 * 1e6:.0f} µs per artifact"),
        Row(NAME, f"ls per-artifact cost growth, {n1:,} -> {n2:,}", f"{per2 * 1e6:.0f} µs/artifact",
            f"{per1 * 1e6:.0f} µs/artifact", per2 / per1, target=1.25, direction="<=",
            note="1.0 = linear; the 0.25 margin absorbs noise on a shared machine"),
        Row(NAME, "commit of one small artifact (real writer, fsync on)", ms(commit_s), "", None,
            note="fixture build cost; the " + ", ".join(
                f"{n:,} store {'reused' if b['reused'] else 'built in %.0f s' % b['build_s']}"
                for n, b in build_info.items())),
    ]
    for r in rows:
        r.judge()
    return Result(rows, {"counts": [n1, n2], "reps": reps, "seconds": {k: summary(v) for k, v in times.items()},
                         "per_artifact_us": {n1: per1 * 1e6, n2: per2 * 1e6}, "build": build_info,
                         "commit_ms": commit_s * 1e3, "profile_ls": prof, "profile_n": n1})
