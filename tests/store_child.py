"""A child process that writes artifacts into a store (killed at random instants by tests).

usage: python tests/store_child.py STORE FIRST COUNT [ROWS]
Writes artifacts FIRST..FIRST+COUNT-1 (keys from dfcache.testing.store_conformance) and prints
"committed <key>" after each commit.
"""

import sys

from dfcache.store import open_store
from dfcache.testing.store_conformance import write_example

if __name__ == "__main__":
    store = open_store(sys.argv[1])
    first, count = int(sys.argv[2]), int(sys.argv[3])
    rows = int(sys.argv[4]) if len(sys.argv) > 4 else 4000
    for i in range(first, first + count):
        key, _ = write_example(store, i=i, rows=rows, cols=64, chunk_rows=256)
        print(f"committed {key}", flush=True)
