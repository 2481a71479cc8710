"""Experiment (not part of the suite): what binding a chunk to its place costs a read.

    python -m bench.binding_variants [--mb 256] [--picks 40] [--rounds 3] [--one-thread]

Writes one bf16 array of 4096-wide rows (1 MiB chunks, as the ``read`` benchmark) with the real
store, then reads random samples of 1024-3072 tokens through the real ``ArrayReader.read_raw``,
every chunk checked in the timed read (the store's remembered checks dropped before each read,
as for the chunks a first read meets), with the check the read makes swapped, alternating per
pick (order rotating):

* ``digest``  - what reads do now: ``format.rows_match``, xxh3-128 of the chunk's rows compared
                with the manifest's chunk digest (intact, and the chunk of this place);
* ``crc32c``  - what reads did before: crc32c of the chunk body compared with its file's trailer
                (read beforehand; the comparison is of one integer either way);
* ``both``    - crc32c and then the digest (what keeping the crc32c beside the digest would cost);
* ``none``    - no check at all: the read alone, the lower bound.

Then the same for the training path: ``read_raw(mapped=True)`` of every sample of a segment-sized
range with the store's mapped chunks dropped first (each chunk mapped and checked once).
Prints the medians and the ratio of each check to ``crc32c`` (the cost of the change), per round.
``--one-thread``: no reader threads (the caller's thread checks every chunk), which leaves out
the thread hand-offs whose scheduling dominates the spread of the timings on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ._common import OUT_DIR, clock, med, rmtree
from ._data import make_hidden


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.binding_variants")
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--picks", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one-thread", action="store_true")
    args = ap.parse_args(argv)
    import time

    from dfcache.keys import compute_key
    from dfcache.store import format as fmt
    from dfcache.store import open_store
    from dfcache.store import _reader
    from dfcache.store._reader import RACY_NS

    if args.one_thread:
        _reader._read_workers = lambda: 0

    h = make_hidden(int(args.mb * 1e6), lengths=(1024, 3072), seed=1)
    root = OUT_DIR / f"tmp-binding-{os.getpid()}"
    root.mkdir(parents=True)
    store = open_store(root / "s")
    key = compute_key("binding_variants", 1, {})
    with store.writer(key, stage="binding_variants", stage_version=1, inputs={}) as w:
        w.write_array("hidden_states", h.states, dtype="bfloat16")
    time.sleep(RACY_NS / 1e9 + 0.2)  # settled files: checks are remembered, as in a cache read later
    arr = store.open(key).array("hidden_states")
    spec = arr.spec
    adir = store.backend.local_root / fmt.artifact_prefix(key)
    crcs = {}
    for i in range(spec.num_chunks):
        data = (adir / fmt.chunk_relpath("hidden_states", i, 2)).read_bytes()
        crcs[i] = int.from_bytes(data[-4:], "little")
    crc = fmt._crc32c
    digest_check = fmt.rows_match
    checks = {"digest": digest_check,
              "crc32c": lambda body, s, i: crc(body) == crcs[i],
              "both": lambda body, s, i: crc(body) == crcs[i] and digest_check(body, s, i),
              "none": lambda body, s, i: True}
    off = h.offsets

    def sample(i: int, check, mapped: bool) -> tuple[float, float]:
        """(wall seconds, this thread's CPU seconds) of one sample read with ``check``."""
        fmt.rows_match = check
        store._verified.clear()
        store._mapped.clear()
        try:
            cpu = time.thread_time()
            wall = clock(lambda: arr.read_raw(int(off[i]), int(off[i + 1]), mapped=mapped))
            return wall, time.thread_time() - cpu
        finally:
            fmt.rows_match = digest_check

    ref = arr.read_raw(int(off[0]), int(off[1])).copy()
    for name, check in checks.items():  # every variant reads the same bytes
        fmt.rows_match = check
        store._verified.clear()
        assert np.array_equal(arr.read_raw(int(off[0]), int(off[1])), ref), name
    fmt.rows_match = digest_check
    names = list(checks)
    n = len(h.lengths)
    print(f"{h.nbytes / 1e6:.0f} MB bf16 x {h.states.shape[1]}, chunk_rows {arr.chunk_rows}, {args.picks} random "
          f"samples of 1024-3072 tokens per round, warm page cache, every chunk checked in the timed read"
          + (", no reader threads" if args.one_thread else f", {_reader._read_workers()} reader thread(s)"))
    clocks = ("wall", "cpu") if args.one_thread else ("wall",)  # with reader threads, CPU time is theirs too
    print(f"{'round':<6} {'path':<16} " + " ".join(f"{k:>14}" for k in names))
    for r in range(args.rounds):
        rng = np.random.default_rng(100 + r)
        for mapped in (False, True):
            times = {k: [] for k in names}
            for p in range(args.picks):
                i = int(rng.integers(0, n))
                k0 = p % len(names)
                for k in names[k0:] + names[:k0]:
                    times[k].append(sample(i, checks[k], mapped))
            for c, clk in enumerate(clocks):
                m = {k: med([t[c] for t in v]) for k, v in times.items()}
                cells = [f"{m[k] * 1e3:7.2f} ms {m[k] / m['crc32c']:4.2f}" for k in names]
                path = ("mapped" if mapped else "read_raw") + f" {clk}"
                print(f"{r + 1:<6} {path:<16} " + " ".join(f"{c:>14}" for c in cells))
    print("(each cell: median ms, and its ratio to crc32c: below 1.00 is cheaper than before)")
    rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
