"""`fingerprint`: ``dfcache.keys.fingerprint_path`` of a model directory the first time (every
file hashed, xxh3-128) vs the second time (memoized by path, size, mtime_ns and inode in
``$DFCACHE_HOME/fingerprints.json``), beside the rate of simply reading the same files.

The directory: ``config.json``, ``tokenizer.json`` and safetensors shards of random bytes,
512 MB in all by default (3 GB at ``--size large``). "Cold" means the files' pages were dropped
from the page cache first (``posix_fadvise(DONTNEED)`` on each file, which leaves the rest of
the machine's cache alone); "warm" means they were just read. The read reference reads every
file with 8 MiB ``readinto`` calls (what ``hash_file`` does, without hashing). Each first-time
run gets a fresh ``DFCACHE_HOME``; the second-time run then starts from the memo file on disk
(the in-memory copy is dropped, as in a new process).
"""

from __future__ import annotations

import json
import os

import numpy as np

from ._common import Ctx, Result, Row, alternate, clock, evict, fsync_tree, gbps, med, ms, rmtree, summary

NAME = "fingerprint"
BASE_BYTES = 512 * 10**6
SHARD = 128 * 10**6


def make_model_dir(d, total: int) -> list[str]:
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 4096}))
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {str(i): i for i in range(5000)}}}))
    n = max(1, -(-total // SHARD))
    rng = np.random.default_rng(0)
    for k in range(n):
        size = min(SHARD, total - k * SHARD)
        t = torch.from_numpy(rng.integers(0, 256, size=size, dtype=np.uint8))
        save_file({f"layers.{k}.weight": t}, str(d / f"model-{k + 1:05d}-of-{n:05d}.safetensors"))
    fsync_tree(d)
    return sorted(str(p) for p in d.iterdir())


def read_all(paths: list[str]) -> int:
    buf = bytearray(8 << 20)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                total += n
    return total


def run(ctx: Ctx) -> Result:
    from dfcache import keys

    reps = ctx.reps_or(3)
    total = int(BASE_BYTES * ctx.factor)
    root = ctx.tmpdir("fingerprint")
    model = root / "model"
    ctx.log(f"writing a {total / 1e6:.0f} MB model directory")
    files = make_model_dir(model, total)
    nbytes = sum(os.path.getsize(p) for p in files)
    homes = iter(range(10**6))
    memo_times: list[float] = []
    digests = set()
    old_home = os.environ.get("DFCACHE_HOME")

    def fresh_home():
        os.environ["DFCACHE_HOME"] = str(root / f"home-{next(homes)}")
        keys._memo_loaded = None

    def c_read(cold: bool):
        def go() -> float:
            if cold:
                evict(files)
            else:
                read_all(files)
            return clock(lambda: read_all(files))
        return go

    def c_fp(cold: bool):
        def go() -> float:
            fresh_home()
            if cold:
                evict(files)
            else:
                read_all(files)
            t = clock(lambda: digests.add(keys.fingerprint_path(model)))
            keys._memo_loaded = None  # as a new process: the memo comes from disk
            memo_times.append(clock(lambda: digests.add(keys.fingerprint_path(model))))
            return t
        return go

    try:
        times = alternate({"read_cold": c_read(True), "fp_first_cold": c_fp(True),
                           "read_warm": c_read(False), "fp_first_warm": c_fp(False)}, reps, log=ctx.log)
    finally:
        if old_home is None:
            os.environ.pop("DFCACHE_HOME", None)
        else:
            os.environ["DFCACHE_HOME"] = old_home
        keys._memo_loaded = None
        rmtree(root)
    if len(digests) != 1:
        raise AssertionError(f"fingerprint not stable: {digests}")
    m = {k: med(v) for k, v in times.items()}
    memo = med(memo_times)
    rows = [
        Row(NAME, f"model fingerprint, first time, cold cache ({nbytes / 1e6:.0f} MB) vs reading the files",
            gbps(nbytes, m["fp_first_cold"]), gbps(nbytes, m["read_cold"]) + " read",
            m["read_cold"] / m["fp_first_cold"], target=0.8, direction=">=",
            note="rate ratio; ≈ disk read rate means ≥ 0.8x"),
        Row(NAME, "model fingerprint, first time, warm cache vs reading the files",
            gbps(nbytes, m["fp_first_warm"]), gbps(nbytes, m["read_warm"]) + " read",
            m["read_warm"] / m["fp_first_warm"]),
        Row(NAME, "model fingerprint, second time (memoized)", ms(memo), "", memo * 1e3, unit=" ms",
            target=50, direction="<", note=f"{len(files)} files; memo loaded from disk"),
    ]
    for r in rows:
        r.judge()
    return Result(rows, {"bytes": nbytes, "files": len(files), "reps": reps,
                         "seconds": {k: summary(v) for k, v in times.items()},
                         "memo_seconds": summary(memo_times),
                         "eviction_worked": m["read_cold"] > 1.5 * m["read_warm"]})
