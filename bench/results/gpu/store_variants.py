"""Where the store path's time goes on a GPU host's disk (an experiment, not a bench row).

The 1.25 B extraction on an H200 host was store-bound (store path alone ~90k tok/s = 1.47 GB/s
where 8 parallel fsync'd streams of 16 MiB writes took 2.31 GB/s), and writing one layer's chunk
files on more threads changed nothing (1-8 threads: 83k-100k tok/s). Candidates: the number of
fsyncs (one per 1 MiB chunk file), the chunk size, the fsync pool's size, the checkpoints'
waits; and plain files of the same bytes written and fsync'd without the store (the filesystem's
own cost per file). Four layers of hidden 2048 bf16 appended in
16384-row windows, one thread per layer as the extraction's writer does, a checkpoint every 4
windows, then the commit; variants rotate, medians of the repetitions.

    python3 bench/results/gpu/store_variants.py --tokens 131072 --reps 2
"""
import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=131072)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--window", type=int, default=16384)
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--work", default=None)
ap.add_argument("--out", default=None)
args = ap.parse_args()

import dfcache.store._directory as d  # noqa: E402
import dfcache.store.format as fmt  # noqa: E402
from dfcache import compute_key  # noqa: E402
from dfcache.store import open_store  # noqa: E402

work = args.work or tempfile.mkdtemp(prefix="dfcache-store-variants-")
store = open_store(os.path.join(work, "store"))
rng = np.random.default_rng(0)
rows = rng.integers(0, 1 << 16, size=(args.window, args.hidden), dtype=np.uint16)
real_fsync, real_chunk, real_pool = d._fsync_path, fmt.TARGET_CHUNK_BYTES, d.fsync_pool
from dfcache.store._pools import thread_pool  # noqa: E402


def one_run(tag):
    writers, arrays = [], []
    for k in range(args.layers):
        key = compute_key("bench_store_variants", 1, {"layer": k, "tag": tag, "run": time.time()})
        w = store.writer(key, stage="bench_store_variants", stage_version=1, inputs={"layer": k},
                         resumable=not tag.startswith("not resumable"))
        writers.append(w)
        arrays.append(w.create_array("hidden", (args.tokens, args.hidden), "bfloat16"))
    os.sync()
    t = time.perf_counter()

    def layer(i):
        for n, a in enumerate(range(0, args.tokens, args.window)):
            arrays[i].append(rows[: min(args.window, args.tokens - a)])
            if n % 4 == 3 and tag not in ("no checkpoints", "not resumable (no .part renames), no checkpoints"):
                writers[i].checkpoint({"rows": a})

    ths = [threading.Thread(target=layer, args=(i,)) for i in range(args.layers)]
    [x.start() for x in ths]
    [x.join() for x in ths]
    for w in writers:
        w.commit()
    if tag == "no per-file fsync, one sync at the end":
        os.sync()
    dt = time.perf_counter() - t
    for w in writers:
        store.delete(w.key)
    print(f"  ({tag}: chunk_rows {arrays[0].chunk_rows})", flush=True)
    return args.tokens / dt


def raw_run(tag, mib):
    """The filesystem alone: the same bytes as plain files of ``mib`` MiB, one thread per layer,
    each file fsync'd on a pool of 8 (what the store does, without the store)."""
    from concurrent.futures import ThreadPoolExecutor

    root = tempfile.mkdtemp(prefix="raw-", dir=work)
    blob = rows.view(np.uint8).reshape(-1)[: mib << 20]
    per_layer = args.tokens * args.hidden * 2 // len(blob)
    pool = ThreadPoolExecutor(8)
    os.sync()
    t = time.perf_counter()

    def layer(i):
        futs = []
        for n in range(per_layer):
            p = os.path.join(root, f"{i}.{n}")
            with open(p, "wb") as f:
                f.write(blob)
            futs.append(pool.submit(real_fsync, p))
        [f.result() for f in futs]

    ths = [threading.Thread(target=layer, args=(i,)) for i in range(args.layers)]
    [x.start() for x in ths]
    [x.join() for x in ths]
    dt = time.perf_counter() - t
    import shutil
    shutil.rmtree(root)
    pool.shutdown()
    return args.tokens / dt


def variant(name):
    d._fsync_path, fmt.TARGET_CHUNK_BYTES, d.fsync_pool = real_fsync, real_chunk, real_pool
    if name.startswith("raw files"):
        return raw_run(name, int(name.split()[2]))
    if name.startswith("fsync pool "):
        n = int(name.split()[2])
        d.fsync_pool = lambda: thread_pool(f"fsync{n}x", n)
    if name == "chunk 4 MiB, fsync pool 32":
        fmt.TARGET_CHUNK_BYTES = 4 << 20
        d.fsync_pool = lambda: thread_pool("fsync32x", 32)
    if name.startswith("chunk "):
        fmt.TARGET_CHUNK_BYTES = int(name.split()[1]) << 20
    if name == "no per-file fsync, one sync at the end":
        d._fsync_path = lambda p: None
    try:
        return one_run(name)
    finally:
        d._fsync_path, fmt.TARGET_CHUNK_BYTES, d.fsync_pool = real_fsync, real_chunk, real_pool


names = ["chunk 1 MiB (default)", "chunk 4 MiB", "chunk 16 MiB", "no per-file fsync, one sync at the end",
         "fsync pool 32", "fsync pool 64", "chunk 4 MiB, fsync pool 32", "no checkpoints", "not resumable (no .part renames), no checkpoints", "raw files 1 MiB", "raw files 16 MiB"]
runs = {n: [] for n in names}
for rep in range(args.reps):
    for n in names[rep % len(names):] + names[: rep % len(names)]:
        runs[n].append(variant(n))
        print(f"{n:45s} {runs[n][-1]:12,.0f} tok/s  ({runs[n][-1] * args.layers * args.hidden * 2 / 1e9:.2f} GB/s)",
              flush=True)
res = {n: statistics.median(v) for n, v in runs.items()}
print(json.dumps({"tok_per_s_median": res, "runs": runs, "bytes_per_token": args.layers * args.hidden * 2,
                  "cpu_count": os.cpu_count()}, indent=1))
if args.out:
    json.dump({"args": vars(args), "tok_per_s_median": res, "runs": runs}, open(args.out, "w"), indent=1)
