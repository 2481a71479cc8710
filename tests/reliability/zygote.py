"""A fork server for the reliability tests: real child processes without paying Python start-up.

Starting ``python -m dfcache`` costs one to two seconds of CPU on the shared CI machine; the
crash and race tests start hundreds of processes. A zygote imports the modules once and then
``fork``s a fresh child per request. Each child is a real, separate process with its own pid: it
can be SIGKILLed at any instant, it takes its own file locks, it runs the real ``dfcache`` command
line (``dfcache.cli.main``) or a store writer. The zygote never runs anything itself (no torch
op, no zarr call), so it has no threads and forking it is safe.

Protocol: JSON lines on the zygote's stdin/stdout.

    {"op": "spawn", "func": "module:function", "args": [...], "out": PATH, "err": PATH,
     "env": {...}, "unset": [...], "cwd": PATH}          -> {"pid": PID}
    {"op": "poll", "pid": PID}                            -> {"done": bool, "code": int|null}

``code`` is the exit status, or ``-SIGNAL`` for a child killed by a signal (as subprocess does).
The test process sends signals to the child itself, by pid.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


# ------------------------------------------------------------------------------- the server


def _child(req: dict) -> None:
    """In the forked child: redirect output, set the environment, run the function, exit."""
    try:
        os.setpgid(0, 0)  # its own process group: a signal to the test's group does not reach it
        fd_out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        fd_err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fd_out, 1)
        os.dup2(fd_err, 2)
        for fd in (fd_out, fd_err, devnull):
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        for k in req.get("unset", []):
            os.environ.pop(k, None)
        os.environ.update(req.get("env", {}))
        if req.get("cwd"):
            os.chdir(req["cwd"])
        mod, _, name = req["func"].partition(":")
        func = getattr(importlib.import_module(mod), name)
        code = func(*req.get("args", []))
        code = 0 if code is None else int(code)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(preload: list[str]) -> None:
    for mod in preload:
        try:
            importlib.import_module(mod)
        except ImportError as e:  # a module of a stage not in the tree yet: the child imports what it needs
            print(f"zygote: not preloaded: {mod} ({e})", file=sys.stderr, flush=True)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "preloaded": preload}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _child(req)
            reply = {"pid": pid}
        elif req["op"] == "poll":
            try:
                pid, status = os.waitpid(req["pid"], os.WNOHANG)
            except ChildProcessError:
                reply = {"done": True, "code": None}
            else:
                if pid == 0:
                    reply = {"done": False, "code": None}
                else:
                    reply = {"done": True, "code": os.waitstatus_to_exitcode(status)}
        else:
            reply = {"error": f"unknown op {req['op']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ------------------------------------------------------------------------------- the client


class Child:
    """A process forked by a :class:`Zygote`."""

    def __init__(self, zygote: "Zygote", pid: int, out: Path, err: Path) -> None:
        self.zygote, self.pid, self.out_path, self.err_path = zygote, pid, out, err
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None:
            r = self.zygote._ask({"op": "poll", "pid": self.pid})
            if r["done"]:
                self.code = r["code"]
        return self.code

    def wait(self, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        delay = 0.002
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"child {self.pid} still running after {timeout} s:\n{self.err}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)
        return self.code

    def kill(self, sig: int = 9) -> None:
        if self.code is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    @property
    def out(self) -> str:
        try:
            return self.out_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def err(self) -> str:
        try:
            return self.err_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Zygote:
    """Start with ``Zygote(["dfcache.cli", ...], workdir)``; ``spawn`` forks children."""

    def __init__(self, preload: list[str], workdir: Path, env: dict | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self.children: list[Child] = []
        pythonpath = os.pathsep.join([str(HERE), str(REPO / "tests"), str(REPO)])
        # ``env`` is the whole environment (it may leave out variables of ours, such as CI's
        # HF_HUB_OFFLINE=1); each spawn can still add or remove variables.
        full_env = {**(dict(env) if env is not None else dict(os.environ)), "PYTHONPATH": pythonpath}
        self.env = full_env  # what each child starts from (a spawn's env and unset change it)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(self.workdir / "zygote.err", "ab"),
                                     text=True, env=full_env, cwd=str(self.workdir))
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError("zygote failed to start: " + (self.workdir / "zygote.err").read_text())

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("zygote died: " + (self.workdir / "zygote.err").read_text()[-3000:])
        return json.loads(line)

    def spawn(self, func: str, *args, env: dict | None = None, unset: tuple = (), cwd=None,
              name: str = "child") -> Child:
        self._n += 1
        out = self.workdir / f"{self._n:05d}-{name}.out"
        err = self.workdir / f"{self._n:05d}-{name}.err"
        r = self._ask({"op": "spawn", "func": func, "args": [str(a) if isinstance(a, Path) else a for a in args],
                       "out": str(out), "err": str(err), "env": env or {}, "unset": list(unset),
                       "cwd": str(cwd) if cwd else None})
        child = Child(self, r["pid"], out, err)
        self.children.append(child)
        return child

    def run(self, func: str, *args, timeout: float = 120.0, **kw) -> Child:
        child = self.spawn(func, *args, **kw)
        child.wait(timeout)
        return child

    def cli(self, *argv, timeout: float = 120.0, **kw) -> Child:
        """``dfcache ARGV...`` (the real ``dfcache.cli.main``) in a fresh forked process."""
        return self.run("children:cli_main", *[str(a) for a in argv], timeout=timeout, name="cli", **kw)

    def close(self) -> None:
        for child in self.children:  # a test that failed half-way may leave some running
            if child.code is None:
                child.kill()
                try:
                    child.wait(10)
                except Exception:
                    pass
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1:])
