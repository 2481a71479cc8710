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


def dfcache(*args, store=None, env=None, timeout=600, cwd=None) -> Result:
    cmd = [sys.executable, "-m", "dfcache"]
    if store is not None:
        cmd += ["--store", str(store)]
    full_env = {**os.environ, **(env or {})}
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
