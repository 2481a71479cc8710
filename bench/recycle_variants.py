"""Experiment (not part of the suite): which recycled buffer should a read's result go to?

    python -m bench.recycle_variants [--reps 21]

The training bench's data (``bench/training.py``: 4 layers x 1024 bf16, samples of 128-1024
tokens, the per-layer layout), one DataLoader epoch at 0 workers with each item cloned, CPU time
of the process, alternating, order rotating, one untimed epoch before each timed one:

* ``last taken``   - ``dfcache.store._pools._Recycler`` as it is: the free base taken most
                     recently (its lines are likely still in the last-level cache);
* ``smallest fit`` - the free base with the fewest bytes that holds the result (before 2026-12-08);
* ``specforge``    - SpecForge's loader over the same samples exported, for scale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ._common import alternate, cpu_now, med, rmtree


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.recycle_variants")
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args(argv)
    import torch

    from dfcache.store import _pools
    from dfcache.store._reader import RACY_NS
    from dfcache.training import HiddenStateDataset
    from runner.core.samples import StoredSamples
    from runner.peers.export import export, specforge_relpath

    from ._data import make_hidden
    from .training import BASE_BYTES, HIDDEN, LAYERS, _epoch, _selection, _SpecForge, _write_store

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="dfcache-recycle-"))
    try:
        h = make_hidden(BASE_BYTES, width=LAYERS * HIDDEN, lengths=(128, 1024), seed=5)
        store, tok, layer_sets = _write_store(root / "store", h.states, h.lengths, HIDDEN)
        export(_selection(store, tok, layer_sets, HIDDEN), "specforge", root / "specforge")
        ours = HiddenStateDataset(StoredSamples(str(root / "store"), tok[0], tok[1], [p for p, _ in layer_sets],
                                                [k for _, k in layer_sets], [str(i) for i in range(len(tok[1]))]))
        theirs = _SpecForge([str(root / "specforge" / specforge_relpath(i)) for i in range(len(h.lengths))], True)
        time.sleep(RACY_NS / 1e9 + 0.2)  # chunks settled, as a trainer finds them
        last_taken = _pools._Recycler.take

        def smallest_fit(self, nbytes: int):
            """The previous policy: the smallest free base that fits; none: a new one, as now."""
            if nbytes > self.MAX_BYTES:
                return None
            with self._lock:  # a reference each: the list's, the loop's, getrefcount's argument
                fits = [b for b in self._bases if b.nbytes >= nbytes and sys.getrefcount(b) == 3]
                if fits:
                    return min(fits, key=lambda b: b.nbytes)[:nbytes]
            return last_taken(self, nbytes)

        def epoch(ds, take=None):
            def go():
                if take is not None:
                    _pools._Recycler.take = take
                    _pools._recycler._bases.clear()
                _epoch(ds, 0, seed=0)  # untimed: this policy's bases made, pages warm
                c = cpu_now()
                _epoch(ds, 0, seed=1)
                return cpu_now() - c
            return go

        try:
            times = alternate({"last taken": epoch(ours, last_taken), "smallest fit": epoch(ours, smallest_fit),
                               "specforge": epoch(theirs)}, args.reps)
        finally:
            _pools._Recycler.take = last_taken
        print(f"{len(h.lengths)} samples, {h.states.nbytes / 1e6:.0f} MB, CPU ms an epoch, median of {args.reps}:")
        for name, ts in times.items():
            print(f"  {name:13s} {med(ts) * 1e3:6.1f} ms  ({med(times['specforge']) / med(ts):.2f}x of specforge)")
    finally:
        rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
