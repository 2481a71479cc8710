"""Run the real `dfcache` command line in a subprocess (exit codes, stdout, stderr)."""

import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Result:
    code: int
    out: str
    err: str


# Set (for one test) by the ``forked_cli`` fixture (tests/conftest.py): a fork server whose children
# run ``python -m dfcache`` as the interpreter would, without its start-up (see FORK_PRELOAD).
_FORK = None

# What `dfcache` imports for its light commands (ls, show, verify, gc, push/pull, --help), loaded once
# by the fork server: a fresh `python -m dfcache --help` took 0.8 to 1.8 s of CPU, a fork ~0.05 s.
FORK_PRELOAD = ["dfcache.cli", "dfcache.cli._ls", "dfcache.cli._show", "dfcache.cli._verify", "dfcache.cli._gc",
                "dfcache.cli._transfer", "dfcache.store", "dfcache.maintenance", "dfcache.transfer",
                "runner.commands.run", "runner.core.graph", "runner.core.pipeline", "numpy", "ml_dtypes", "zarr",
                "numcodecs", "typer", "tqdm", "pydantic", "importlib.metadata", "typer._adapters", "email.message",
                "zipfile", "tempfile", "csv", "runpy", "cli_util"]


# Variables the interpreter reads at start-up, before any code of ours: a forked child of an
# interpreter started without them would not have them applied (PYTHONFAULTHANDLER is applied by
# run_dfcache_module; PYTHONPATH is the zygote's own, see fork_is_faithful).
_STARTUP_PREFIXES = ("PYTHON", "LC_", "LANG")


def fork_is_faithful(full_env: dict) -> bool:
    """Whether a forked child with ``full_env`` starts as a fresh interpreter with it would: the
    start-up variables (PYTHONPATH included: it decides sys.path) equal the session's, which the
    fork server was started from."""
    base = _FORK.session_env
    names = {k for k in (*full_env, *base) if k.startswith(_STARTUP_PREFIXES) and k != "PYTHONFAULTHANDLER"}
    return all(full_env.get(k) == base.get(k) for k in names)


def dfcache(*args, store=None, env=None, timeout=600, cwd=None) -> Result:
    cmd = [sys.executable, "-m", "dfcache"]
    if store is not None:
        cmd += ["--store", str(store)]
    full_env = {**os.environ, **(env or {})}
    if _FORK is not None and fork_is_faithful(full_env):  # the same command line, environment and directory
        argv = cmd[3:] + [str(a) for a in args]
        child = _FORK.run("cli_util:run_dfcache_module", *argv, timeout=timeout, env=full_env,
                          unset=tuple(k for k in _FORK.env if k not in full_env), cwd=cwd or os.getcwd(), name="cli")
        return Result(child.code, child.out, child.err)
    p = subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                       env=full_env, cwd=cwd)
    return Result(p.returncode, p.stdout, p.stderr)


def run_side_by_side(code: str, *argsets, timeout: int = 120) -> None:
    """Run ``python -c code REPO *args`` once per argument set, all at once (the repo importable),
    and check that each exits 0 having printed ``done``."""
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo}
    procs = [subprocess.Popen([sys.executable, "-c", code, repo, *map(str, args)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in argsets]
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0 and "done" in out, err


def run_dfcache_module(*argv) -> None:
    """``python -m dfcache ARGV...`` in this process, as the interpreter runs it (``dfcache/__main__.py``
    executed as ``__main__``): the function a fork server (tests/reliability/zygote.py) runs in each
    forked child, so that a test gets the real executable's path without an interpreter start-up.

    What a fresh interpreter would do differently is done here too: ``sys.path[0]`` is the working
    directory (``python -m``), ``PYTHONFAULTHANDLER`` turns faulthandler on, and at the end the
    non-daemon threads are joined and the exit functions run (the zygote's child ends with
    ``os._exit``, which does neither; dfcache's last exit function, dfcache.interrupts._end_late,
    ends the process with the command's status as it does in the real executable). Other start-up
    variables (PYTHON*, LC_*, LANG) make :func:`dfcache` start a real interpreter instead
    (:func:`fork_is_faithful`)."""
    import atexit
    import runpy
    import threading

    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    sys.path.insert(0, os.getcwd())
    sys.argv = ["dfcache", *map(str, argv)]
    try:
        runpy.run_module("dfcache", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # what Py_FinalizeEx does first: wait for the non-daemon threads
    atexit._run_exitfuncs()
    raise SystemExit(code)
