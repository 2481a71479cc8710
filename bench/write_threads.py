"""Experiment (not part of the suite): the extraction's store path alone, by chunk-write threads.

    python -m bench.write_threads [--layers 4] [--hidden 2048] [--mb 64] [--threads 1,2,4,8] [--reps 3]

Drives the hidden-state extraction's own writer (``runner.stages.hidden_states.extract._WindowWriter``:
one task per layer on its pool, each appending the piece's rows to that layer's resumable
``ArrayWriter``, a checkpoint of every layer after each window) with window buffers that are ready
at once (no model, no GPU, no torch), and times the whole store path, commits (every fsync)
included, for each ``$DFCACHE_WRITE_THREADS`` (the uncompressed chunk files of one append written
at once, ``dfcache.store._pools.write_threads``) with the CPU time it took (every thread of the
process). The counts run in turn, the order rotating each
repetition, medians kept (``bench._common.alternate``) and the best run (on a shared machine whose
disk others use, the one least disturbed); every count writes the same bytes (the
digests of the committed arrays are compared). Prints one line per count and a JSON summary.
bench/gpu_extract.py's ``store path alone`` phase measures the same counts behind the real
GPU copies on a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time

from ._common import OUT_DIR, alternate, med, rmtree


def store_path(store, layers: int, hidden: int, tokens: int, piece: int, window_pieces: int, data) -> tuple[float, list]:
    """Seconds to write ``tokens`` rows of every layer through the extraction's writer, and the
    committed arrays' digests."""
    from dfcache import compute_key
    from runner.stages.hidden_states.extract import NUM_BUFFERS, ExtractStats, LayerSink, Window, _Job, _WindowWriter

    sinks = []
    for k in range(layers):
        key = compute_key("bench_write_threads", 1, {"layer": k, "run": time.time_ns()})
        w = store.writer(key, stage="bench_write_threads", stage_version=1, inputs={"layer": k}, resumable=True)
        sinks.append(LayerSink(layer=k, writer=w, array=w.create_array("hidden", (tokens, hidden), "bfloat16")))
    free: queue.Queue = queue.Queue()
    for _ in range(NUM_BUFFERS):
        free.put(None)
    t = time.perf_counter()
    writer = _WindowWriter(sinks, None, None, ExtractStats())
    writer.start()
    win = piece * window_pieces
    for i, start in enumerate(range(0, tokens, win)):
        stop = min(tokens, start + win)
        free.get()  # a window buffer is free (compute would fill it here)
        w = Window(index=i, first=start, stop=stop, token_start=start, token_stop=stop, batches=[])
        bufs = {k: data[k][: stop - start] for k in range(layers)}
        for a in range(0, stop - start, piece):
            b = min(stop - start, a + piece)
            writer.jobs.put(_Job(w, bufs, None, a, b, release=(lambda: free.put(None)) if b == stop - start else None))
    writer.jobs.put(None)
    writer.join()
    if writer.error is not None:
        raise writer.error
    digests = [s.writer.commit().arrays["hidden"].digest for s in sinks]
    dt = time.perf_counter() - t
    for s in sinks:
        store.delete(s.writer.key)
    return dt, digests


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.write_threads")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--mb", type=float, default=64, help="MB of bf16 rows per layer")
    ap.add_argument("--piece-tokens", type=int, default=4096, help="rows a layer appends at once (a batch)")
    ap.add_argument("--window-pieces", type=int, default=2, help="pieces between two checkpoints")
    ap.add_argument("--threads", default="1,2,4,8", help="values of DFCACHE_WRITE_THREADS")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the store goes (default bench/out/)")
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args(argv)

    import numpy as np

    from dfcache.store import open_store

    tokens = int(args.mb * 1e6) // (2 * args.hidden)
    win = args.piece_tokens * args.window_pieces
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 1 << 16, size=(min(win, tokens), args.hidden), dtype=np.uint16) for _ in range(args.layers)]
    root = __import__("pathlib").Path(args.dir or OUT_DIR) / f"tmp-write-threads-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    store = open_store(root / "store")
    digests: dict[str, list] = {}
    cpu: dict[str, list] = {}
    old = os.environ.get("DFCACHE_WRITE_THREADS")

    def contender(n: str):
        def go() -> float:
            os.environ["DFCACHE_WRITE_THREADS"] = n
            c0 = time.process_time()
            dt, d = store_path(store, args.layers, args.hidden, tokens, args.piece_tokens, args.window_pieces, data)
            cpu.setdefault(n, []).append(time.process_time() - c0)  # every thread of the process
            digests.setdefault(n, d)
            assert d == digests[n], "the same rows gave other bytes"
            return dt
        return go

    try:
        counts = [s.strip() for s in args.threads.split(",") if s.strip()]
        times = alternate({n: contender(n) for n in counts}, args.reps,
                          log=lambda m: print(m, flush=True))
    finally:
        if old is None:
            os.environ.pop("DFCACHE_WRITE_THREADS", None)
        else:
            os.environ["DFCACHE_WRITE_THREADS"] = old
        rmtree(root)
    same = len({tuple(d) for d in digests.values()}) == 1
    total = tokens * args.layers * args.hidden * 2
    out = {"layers": args.layers, "hidden": args.hidden, "tokens": tokens, "bytes": total, "cpu_count": os.cpu_count(),
           "piece_tokens": args.piece_tokens, "window_pieces": args.window_pieces, "same_bytes": same,
           "threads": {n: {"median_s": round(med(v), 4), "tok_per_s": round(tokens / med(v)),
                           "gbps": round(total / med(v) / 1e9, 3), "runs_s": [round(x, 4) for x in v],
                           "best_tok_per_s": round(tokens / min(v)), "cpu_s": round(med(cpu[n]), 4)}
                       for n, v in times.items()}}
    base = out["threads"][counts[0]]["tok_per_s"]
    for n, r in out["threads"].items():
        print(f"DFCACHE_WRITE_THREADS={n}: {r['tok_per_s']:,} tok/s ({r['gbps']} GB/s, {r['tok_per_s'] / base:.2f}x "
              f"of {counts[0]}); best run {r['best_tok_per_s']:,} tok/s "
              f"({r['best_tok_per_s'] / out['threads'][counts[0]]['best_tok_per_s']:.2f}x); CPU {r['cpu_s']:.3f} s (median); "
              f"runs {r['runs_s']} s")
    print(f"same bytes for every count: {same}")
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
