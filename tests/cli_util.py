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
