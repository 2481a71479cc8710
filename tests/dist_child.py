"""`dfcache` as one worker of a distributed test run that dies at a known point.

    torchrun ... tests/dist_child.py --store S run hidden-states ...

When ``RANK`` equals ``DIST_CHILD_KILL_RANK``, the worker SIGKILLs itself right after committing
its first hidden-states segment: a rank lost mid-run with committed work behind it and
uncommitted work ahead, at the same point every time (no sleeps, no timing).
"""

from __future__ import annotations

import os
import signal
import sys

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("DIST_CHILD_KILL_RANK"):
    from dfcache.samples import SegmentWriter

    _commit = SegmentWriter.commit

    def _commit_then_die(self, *args, **kwargs):
        out = _commit(self, *args, **kwargs)
        if self.partition.stage == "hidden_states":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    SegmentWriter.commit = _commit_then_die

if __name__ == "__main__":
    from dfcache.cli import main

    sys.exit(main())
