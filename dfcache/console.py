"""Output helpers every command shares: one JSON document on stdout, one line on stderr.

Standard library only: the ``dfcache`` executable's fast paths (``dfcache/__main__.py``) print
with them before the command-line framework is imported; :mod:`dfcache.cli.common` re-exports
them for the commands.
"""

from __future__ import annotations

import json
import sys

INTERRUPTED = "interrupted: committed artifacts are kept; run the same command again to resume."


def emit_json(obj) -> None:
    # Compact: indent= switches json to its pure-Python encoder, 3x slower on `ls` of 10k artifacts.
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()


def err(message: str) -> None:
    sys.stderr.write(message.rstrip() + "\n")
    sys.stderr.flush()
