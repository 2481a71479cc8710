"""Worker processes for tests/test_distributed_run.py forked from one interpreter that imported
torch and transformers once, instead of a new interpreter each.

A worker that torchrun starts (``python -u tests/torchrun_fork.py -m dfcache ...`` or
``... SCRIPT ARGS``), or torchrun itself (``python tests/torchrun_fork.py -m torch.distributed.run
...``), is this file's light client: it imports only the standard library, hands its
stdin/stdout/stderr, environment, directory and command line to the fork server over a Unix
socket (``DFCACHE_TEST_FORK_SOCKET``), and waits. The server forks a child that takes those file
descriptors, that environment and directory, and runs ``python -m MODULE`` / ``python SCRIPT`` as
the interpreter would (tests/cli_util.py); the child's exit status comes back to the client,
which ends with it (a signal's death included, so torchrun sees a SIGKILLed rank as SIGKILLed).
Signals the client gets (torchrun's SIGTERM to a failed job's other ranks) are passed on to the
child; a client that dies takes its child with it (the server SIGKILLs a child whose client hung
up). Measured on the 2-core CI VM: a `dfcache run hidden-states` worker cost ~5.5 s of CPU in a
new interpreter (torch and transformers imports ~3.5 s of it), ~1.5 s forked.

The server forks only where the child starts as a new interpreter would: an environment that
differs from the server's only in names torchrun sets or the module lets vary (no start-up
variable, nothing torch or transformers read when imported), and a server with one thread.
Otherwise (or without the socket variable) the client becomes that new interpreter itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

ENV_SOCKET = "DFCACHE_TEST_FORK_SOCKET"
CLIENT = os.path.abspath(__file__)

# What torchrun's agent sets in each worker's environment (torch/distributed/elastic/agent/server/
# local_elastic_agent.py, torch 2.13), read when the worker calls init_process_group, not at import.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                 "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "NCCL_ASYNC_ERROR_HANDLING")
TORCHRUN_PREFIXES = ("TORCHELASTIC_",)


# ------------------------------------------------------------------------------- the client


def _client(argv: list[str]) -> None:
    options = sys.orig_argv[1:len(sys.orig_argv) - len(sys.argv)]  # the interpreter's (torchrun's -u)
    unbuffered = "-u" in options or bool(os.environ.get("PYTHONUNBUFFERED"))
    path = os.environ.get(ENV_SOCKET)
    env = dict(os.environ)  # the socket's variable too: a forked torchrun forks its workers in turn
    if path:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        req = {"argv": argv, "env": env, "cwd": os.getcwd(), "unbuffered": unbuffered}
        socket.send_fds(s, [b"F"], [0, 1, 2])  # one byte carries the descriptors, then the request
        s.sendall(json.dumps(req).encode() + b"\n")
        f = s.makefile("rb")
        reply = json.loads(f.readline())
        if "pid" in reply:
            pid = reply["pid"]

            def forward(signum, frame):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                        signal.SIGUSR2):
                signal.signal(sig, forward)
            line = f.readline()
            code = json.loads(line)["code"] if line else 1
            if code < 0:  # died of a signal: so does the client, as the worker would have
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)
        s.close()
        sys.stderr.write(f"torchrun_fork: a new interpreter ({reply['fallback']})\n")
    # A new interpreter, as torchrun would have started it without this client.
    os.execve(sys.executable, [sys.executable, *options, *argv], env)


# ------------------------------------------------------------------------------- the server


def _differs(base: dict, env: dict, allowed: tuple[str, ...]) -> list[str]:
    """The names whose values differ and may not (``allowed``: names, or prefixes ending in ``*``)."""
    names = {k for k in (*base, *env) if base.get(k) != env.get(k)}
    prefixes = TORCHRUN_PREFIXES + tuple(a[:-1] for a in allowed if a.endswith("*"))
    return sorted(k for k in names if k not in TORCHRUN_VARS and k not in allowed and k != ENV_SOCKET
                  and not k.startswith(prefixes))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(req: dict, fds: list[int]) -> None:
    """In the forked child: the client's streams, environment and directory, then its program."""
    code = 1
    try:
        os.setpgid(0, 0)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        import io

        def stream(fd):  # stdout as the interpreter opens it: unbuffered with -u, else block-buffered
            raw = io.FileIO(fd, "w", closefd=False)
            if req["unbuffered"]:
                return io.TextIOWrapper(raw, encoding=sys.__stdout__.encoding, errors=sys.__stdout__.errors,
                                        write_through=True)
            return io.TextIOWrapper(io.BufferedWriter(raw), encoding=sys.__stdout__.encoding,
                                    errors=sys.__stdout__.errors, line_buffering=os.isatty(fd))

        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = stream(1)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.__stderr__.encoding,
                                      errors="backslashreplace", write_through=True)  # line-buffered or -u
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import runpy

        from cli_util import _run_like_the_interpreter, _start_like_the_interpreter

        argv = req["argv"]
        if argv[0] == "-m":
            _start_like_the_interpreter(os.getcwd())
            sys.argv = [argv[1], *argv[2:]]
            _run_like_the_interpreter(lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
        else:
            _start_like_the_interpreter(os.path.dirname(os.path.abspath(argv[0])))
            sys.argv = list(argv)
            _run_like_the_interpreter(lambda: runpy.run_path(argv[0], run_name="__main__"))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        import traceback

        traceback.print_exc()
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:  # noqa: BLE001 - a closed pipe
                pass
        os._exit(code)


def serve(sock_path: str, allowed: list[str], preload: list[str]) -> None:
    import importlib
    import selectors

    for mod in preload:
        importlib.import_module(mod)
    base = dict(os.environ)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(sock_path)
    lsock.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")  # closed by the test process: stop
    clients: dict[int, socket.socket] = {}  # child pid -> its client's connection
    threads = _threads()
    print(json.dumps({"ready": True, "threads": threads, "datasets": "datasets" in sys.modules}), flush=True)
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.data == "stdin":
                if not sys.stdin.readline():
                    for pid in clients:
                        os.kill(pid, signal.SIGKILL)
                    return
            elif key.data == "accept":
                conn, _ = lsock.accept()
                try:
                    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                    req = json.loads(conn.makefile("rb").readline())
                except (OSError, ValueError) as e:  # a client that died before it asked
                    print(f"torchrun_fork: a request failed: {e!r}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                differs = _differs(base, req["env"], tuple(allowed))
                if differs or _threads() != 1 or len(fds) != 3:
                    why = f"environment differs in {differs}" if differs else f"{_threads()} threads, {len(fds)} fds"
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(json.dumps({"fallback": why}).encode() + b"\n")
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    lsock.close()
                    for c in clients.values():
                        c.close()
                    conn.close()
                    _child(req, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                clients[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            else:  # a client hung up (killed): its child goes too
                pid = key.data
                sel.unregister(key.fileobj)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while clients:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                try:
                    sel.unregister(conn)
                except (KeyError, ValueError):
                    pass
                try:
                    conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:  # the client is gone
                    pass
                conn.close()


class ForkServer:
    """The server as a subprocess started with ``env`` (the module's workers' environment less what
    torchrun adds); ``env_for_workers`` is that environment with the socket that clients use."""

    def __init__(self, env: dict, workdir, preload: list[str], allowed: tuple[str, ...] = ()) -> None:
        import subprocess
        from pathlib import Path

        workdir = Path(workdir)
        self.sock = str(workdir / "fork.sock")
        self.log = workdir / "fork-server.err"
        self.proc = subprocess.Popen([sys.executable, CLIENT, "--serve", self.sock, ",".join(allowed), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "ab"),
                                     env=env, cwd=str(workdir), text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("fork server failed to start: " + self.log.read_text()[-3000:])
        self.hello = json.loads(line)
        self.env_for_workers = {**env, ENV_SOCKET: self.sock}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], [a for a in sys.argv[3].split(",") if a], sys.argv[4:])
    else:
        _client(sys.argv[1:])
