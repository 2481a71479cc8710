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


def dfcache(*args, store=None, env=None, timeout=600, cwd=None) -> Result:
    cmd = [sys.executable, "-m", "dfcache"]
    if store is not None:
        cmd += ["--store", str(store)]
    full_env = {**os.environ, **(env or {})}
    if _FORK is not None:  # the same command line, environment and directory, in a forked child
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
    forked child, so that a test gets the real executable's path without an interpreter start-up."""
    import runpy

    sys.argv = ["dfcache", *map(str, argv)]
    runpy.run_module("dfcache", run_name="__main__", alter_sys=True)
