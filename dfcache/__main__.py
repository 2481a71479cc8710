"""The ``dfcache`` executable (``python -m dfcache``, and the installed ``dfcache`` script).

``dfcache ls`` over a local store is answered here, from the store's listing index, before the
command-line framework (typer, click, pydantic) and the command plugins are imported: those
cost more than the listing itself (docs/benchmarks.md, the ``ls`` row). Only a command line this
module understands completely takes this path: ``ls`` with ``--json``, ``--store``, ``--stage``
or ``--backend`` naming something the store holds, ``--offline``, ``--no-progress``,
``--debug``. Anything else (``--help``, ``--where``, ``--remote``, an unknown stage, a store that
is missing, damaged or of another format, any error) goes to :mod:`dfcache.cli` unchanged, which
says what is wrong exactly as it always did. Both paths print through
:func:`dfcache.maintenance.ls_output`, so their output is the same bytes.

A fully cached ``dfcache run`` is answered the same way, by the fast path the runner declares
for ``run`` (the ``dfcache.fast_paths`` entry points, :mod:`dfcache.plugins`; dfcache imports
nothing of the runner, and the runner knows its own options): it prints through the functions
``dfcache run`` prints with, and leaves anything that needs work, or that it does not understand
completely, to :mod:`dfcache.cli`.
"""

from __future__ import annotations

import os
import sys

_FLAGS = {"--json", "--offline", "--no-progress", "--debug"}
_VALUED = {"--store", "--stage", "--backend"}


def _parse(argv: list[str]) -> dict | None:
    """The options of a plain ``ls`` command line, or None for anything else."""
    from .cmdline import option_value

    opts: dict = {"command": None}
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if a in _FLAGS:
            opts[a] = True
        elif name in _VALUED:
            value, i = option_value(argv, i, eq, value)
            if value is None:
                return None
            if name != "--store" and name in opts:
                return None  # given twice: the parser decides what that means
            opts[name] = value
        elif a == "ls" and opts["command"] is None:
            opts["command"] = a
        else:
            return None
        i += 1
    return opts if opts["command"] == "ls" else None


def _fast_ls(argv: list[str]) -> int | None:
    """Print ``ls``'s output and return 0, or None when dfcache.cli must answer instead."""
    opts = _parse(argv)
    if opts is None:
        return None
    from .config import default_store_location

    loc = opts.get("--store") or default_store_location()
    if "://" in loc:
        return None
    try:
        import json

        root = os.path.abspath(os.path.expanduser(loc))
        import stat

        # Bounded and never blocking (a FIFO in its place hung `ls`); anything odd: the full CLI.
        from .store.layout import MARKER_KIND, MAX_MARKER_BYTES, STORE_MARKER

        fd = os.open(os.path.join(root, STORE_MARKER), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            marker = json.loads(os.read(fd, MAX_MARKER_BYTES))
        finally:
            os.close(fd)
        from .listing import ls_output
        from .store import listing

        # The format version this code reads comes with the snapshot (written by this same
        # code), so the store format module (and its crc32c) is never imported here.
        listed = listing(root)
        if (listed is None or not isinstance(marker, dict) or marker.get("format_version") != listed.format_version
                or marker.get("kind", MARKER_KIND) != MARKER_KIND):
            return None
        entries = listed.artifacts
        stage = opts.get("--stage")
        if stage is not None:
            stage = stage.strip().replace("-", "_")
            if not any(e[2] == stage for e in entries):
                return None  # a stage a plugin defines, or none at all: the full CLI says which
            entries = [e for e in entries if e[2] == stage]
        kernel = opts.get("--backend")
        if kernel is not None:
            backends = [json.loads(e[5])["backend"] for e in listed.artifacts]
            if kernel not in {str(b.get("kernel")) for b in backends if b}:
                return None
            keep = {id(e) for e, b in zip(listed.artifacts, backends) if (b or {}).get("kernel") == kernel}
            entries = [e for e in entries if id(e) in keep]
        entries.sort(key=lambda e: (e[0], e[1]))
        text = ls_output(entries, json_out="--json" in opts, url=str(root), stage=stage,
                         errors=len(listed.errors))
    except Exception:  # noqa: BLE001 - whatever it is, the full CLI reports it properly
        return None
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


def _fast_plugin(argv: list[str]) -> int | None:
    """A command answered by the fast path declared for it (``dfcache.fast_paths``: a fully
    cached ``run``); None when dfcache.cli must answer."""
    from .plugins import FAST_PATHS, load, own_entry_points

    for command, value in own_entry_points().get(FAST_PATHS, {}).items():
        if command in argv:
            rc = load(value)(argv)
            if rc is not None:
                return rc
    return None


def exit_process(rc) -> None:
    """End the command with exit status ``rc`` (an int, None for 0, or a message for 1, as
    ``sys.exit`` takes them), or 130 with the interrupted message if Ctrl-C came at any point
    (:func:`dfcache.interrupts.finish`).

    The interpreter joins the threads and runs the exit functions, and the process ends with
    ``os._exit`` after the last one (installed by :func:`main`): a Ctrl-C during the module
    teardown that would follow was lost or killed the process with -2. Once obstore (the S3
    backend) is loaded, or after a Ctrl-C, not even that: the exit functions run, the output is
    flushed, and the process ends. obstore's tokio threads release Python objects on their own
    schedule, and one that does so during finalization aborts the process (SIGABRT or SIGBUS
    after the command's output, seen under load: ``dfcache/store/_s3.py``), which turned a
    clean exit 4 into -6."""
    if rc is None:
        rc = 0
    elif not isinstance(rc, int):
        print(rc, file=sys.stderr)
        rc = 1
    from .interrupts import finish

    finish(rc)


def main() -> None:
    from . import interrupts

    interrupts.install()  # first: Ctrl-C from here on ends with the message and 130
    argv = sys.argv[1:]
    try:
        rc = _fast_ls(argv)
        if rc is None:
            rc = _fast_plugin(argv)
        if rc is None:
            from dfcache.cli import main as cli_main

            rc = cli_main()
    except SystemExit as e:
        rc = e.code
    except BaseException as e:  # --debug lets errors through: the traceback, then the same exit
        import traceback

        from .config import debug_from_env

        if not isinstance(e, KeyboardInterrupt) or "--debug" in argv or debug_from_env():
            traceback.print_exc()
        rc = 1
        if isinstance(e, KeyboardInterrupt):  # outside the commands' own handling (a fast path, an error handler)
            from .console import INTERRUPTED, emit_json, err

            err(INTERRUPTED)
            if "--json" in argv:
                emit_json({"error": INTERRUPTED, "exit_code": 130, "type": "KeyboardInterrupt"})
            rc = 130
    exit_process(rc)


if __name__ == "__main__":
    main()
