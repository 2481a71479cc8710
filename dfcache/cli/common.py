"""What every command of the `dfcache` command line shares: the global options, the store they
name, and output helpers.

Public: command modules outside this package (the runner's ``run``/``plan``) use it too, so that
``--store``, ``--json``, ``--debug`` and ``--offline`` mean the same everywhere and JSON output
has one shape.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from ..maintenance import human_bytes  # noqa: F401  (re-exported for the commands)


@dataclass
class GlobalState:
    store_location: str | None = None
    json: bool = False
    debug: bool = False
    offline: bool = False


state = GlobalState()


def get_store(create: bool = True):
    """Open the store named by --store, $DFCACHE_STORE or ./store."""
    from ..store import open_store

    return open_store(state.store_location, create=create)


def emit_json(obj) -> None:
    # Compact: indent= switches json to its pure-Python encoder, 3x slower on `ls` of 10k artifacts.
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()


def err(message: str) -> None:
    sys.stderr.write(message.rstrip() + "\n")
    sys.stderr.flush()
