"""Put on PYTHONPATH by tests/reliability/test_interrupts.py: stops the process (SIGSTOP) at a named
point, so that the test's SIGINT lands exactly there, however loaded the machine is.

``DFCACHE_TEST_PAUSE``:

- ``import:NAME``: when module NAME is first looked for (a finder in front of the others);
- ``late:NAME``: in an exit function registered when NAME is first imported (so it runs after
  the command has printed its result, while the process ends).

The stop is made inside ``exec()`` of a string, as every ``@dataclass`` made at import time runs
its generated code: a KeyboardInterrupt raised there is the case CPython 3.11 marks "unhandled"
(the process then killed itself with SIGINT after exiting 130). ``DFCACHE_TEST_PAUSE_MARK`` is
the file the child writes ``Z`` into just before it stops.
"""

import atexit
import os
import sys

_SPEC = os.environ.get("DFCACHE_TEST_PAUSE", "")
_MARK = os.environ.get("DFCACHE_TEST_PAUSE_MARK", "")
_STOP = "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\nresumed = True\n"


def _pause() -> None:
    with open(_MARK, "w") as f:
        f.write("Z\n")
    exec(_STOP, {})


class _PauseAt:
    def __init__(self, name: str, late: bool) -> None:
        self.name, self.late, self.done = name, late, False

    def find_spec(self, name, path=None, target=None):
        if name == self.name and not self.done:
            self.done = True
            if self.late:
                atexit.register(_pause)
            else:
                _pause()
        return None


if _SPEC and _MARK:
    kind, _, name = _SPEC.partition(":")
    sys.meta_path.insert(0, _PauseAt(name, late=(kind == "late")))
