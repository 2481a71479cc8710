"""What the reliability tests run in child processes (forked by zygote.py, or plain subprocesses).

Writers print *phase markers* on stdout, one ``os.write`` per line so a SIGKILL never leaves half
a line, and the test reads the last marker to know where the kill landed:

    S i        artifact i: writer open (staging directory created), data being computed, documents
    C i        artifact i: chunk writes
    P i        artifact i: commit (array metadata, fsync of every file, manifest, rename)
    D i KEY    artifact i committed
    H i KEY    artifact i was already in the store (a rerun)
    R ROWS RESUMED    a resumable writer started with ROWS rows kept (RESUMED: 0/1)
    K ROWS / k ROWS   a resumable writer's checkpoint at ROWS rows started / finished
    Z N OP     stopped (SIGSTOP) just before store operation N, OP; the test SIGKILLs it there
    O N OP     (counting only) store operation N was OP

Where a kill lands is decided by the child, not by timing: a *pause* (``{"op": N}``, or
``{"after": MARKER, "op": N}`` to count from a marker, ``{"after_op": OP, "op": N}`` from an
operation) stops the process with SIGSTOP just before
its N-th store operation (a staged file, a rename or replace, a directory fsync), and a pause
counted from a marker stops at the end of that phase at the latest (just before the next
marker). The test waits for the ``Z`` marker and sends SIGKILL (or SIGINT then SIGCONT): the
kill lands at exactly that point, however loaded the machine is.

The data of every artifact is a pure function of its spec, so any process can regenerate what
an artifact must hold and compare bytes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

_MARK_FD = [1]
_PAUSE: dict = {"op": None, "after": None, "after_op": None, "only": "", "counting": False, "count": 0, "list": False, "frozen": False}
_PAUSE_LOCK = threading.RLock()


def mark(line: str) -> None:
    p = _PAUSE
    if p["counting"] and p["after"] is not None and not p["frozen"]:
        _freeze("end of phase")  # the phase ended before its N-th operation: stop at its end
    if p["after"] is not None and line == p["after"] and not p["frozen"]:
        with _PAUSE_LOCK:
            p["counting"], p["count"] = True, 0
    os.write(_MARK_FD[0], (line + "\n").encode())


def _freeze(what: str) -> None:
    with _PAUSE_LOCK:
        if _PAUSE["frozen"]:
            return
        _PAUSE["frozen"] = True
        os.write(_MARK_FD[0], f"Z {_PAUSE['count']} {what}\n".encode())
    os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, every thread, until killed


def _done(what: str) -> None:
    """After an operation returned: an ``after_op`` pause counts from here on (not from the call,
    so that another thread's next operation cannot overtake it)."""
    p = _PAUSE
    if p["after_op"] is not None and not p["counting"] and what.startswith(p["after_op"]):
        with _PAUSE_LOCK:
            p["counting"], p["count"] = True, 0


def _point(what: str) -> None:
    p = _PAUSE
    if not p["counting"] or p["frozen"] or not what.startswith(p["only"]):
        return
    with _PAUSE_LOCK:
        p["count"] += 1
        n = p["count"]
        if p["list"]:
            os.write(_MARK_FD[0], f"O {n} {what}\n".encode())
        hit = p["op"] is not None and n >= p["op"]
    if hit:
        _freeze(what)


def install_pause(pause: dict | None, fd: int = 1) -> None:
    """Count the store's operations in this process and stop at the one ``pause`` names
    (``{"op": N}``; ``{"after": MARKER, "op": N}`` counts from a marker, ``{"after_op": OP, "op": N}``
    from the first operation whose name starts with OP, and ``"only": PREFIX`` counts only the
    operations named so (deterministic where several threads write); ``{"list": true}`` prints them all)."""
    _MARK_FD[0] = fd
    if not pause:
        return
    # A SIGINT sent while the process is stopped is delivered, on SIGCONT, to any thread that does
    # not block it; in a writer thread it only sets Python's flag while the main thread sleeps in a
    # join, and the run went on to finish. Threads started from here on block it, so Ctrl-C reaches
    # the main thread, as it does when the terminal sends it to a busy process.
    real_inner = threading.Thread._bootstrap_inner

    def inner(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        return real_inner(self)

    threading.Thread._bootstrap_inner = inner
    from dfcache.store import _directory

    _PAUSE.update(op=pause.get("op"), after=pause.get("after"), after_op=pause.get("after_op"), only=pause.get("only", ""),
                  list=bool(pause.get("list")), counting=pause.get("after") is None and pause.get("after_op") is None)
    real_put, real_fsync_dir = _directory._DirectoryStaging.put, _directory._fsync_dir
    real_rename, real_replace = os.rename, os.replace

    def op(what, real, *a, **kw):
        _point(what)
        result = real(*a, **kw)
        _done(what)
        return result

    def put(self, relpath, data):
        return op(f"put {relpath}", real_put, self, relpath, data)

    def fsync_dir(path):
        return op("fsync_dir", real_fsync_dir, path)

    def in_store(dst) -> bool:  # not the libraries' own renames (caches, memo files)
        d = os.fspath(dst)
        return f"{os.sep}staging{os.sep}" in d or f"{os.sep}artifacts{os.sep}" in d

    def rename(src, dst, *a, **kw):
        if in_store(dst):
            return op(f"rename {os.path.basename(os.fspath(dst))}", real_rename, src, dst, *a, **kw)
        return real_rename(src, dst, *a, **kw)

    def replace(src, dst, *a, **kw):
        if in_store(dst):
            return op(f"replace {os.path.basename(os.fspath(dst))}", real_replace, src, dst, *a, **kw)
        return real_replace(src, dst, *a, **kw)

    _directory._DirectoryStaging.put = put
    _directory._fsync_dir = fsync_dir
    os.rename, os.replace = rename, replace


def slow_fsync(delay: float) -> None:
    """Make every fsync take ``delay`` seconds longer: widens the commit window so that random
    kills land inside it (the order of operations is unchanged)."""
    if delay <= 0:
        return
    real = os.fsync

    def fsync(fd):
        time.sleep(delay)
        return real(fd)

    os.fsync = fsync


def slow_put(delay: float) -> None:
    """Make every file a local store writer stages take ``delay`` seconds longer (so that the
    chunk-write phase of a small artifact is long enough for a random kill to land in it)."""
    if delay <= 0:
        return
    from dfcache.store import _directory

    real = _directory._DirectoryStaging.put

    def put(self, relpath, data):
        time.sleep(delay)
        return real(self, relpath, data)

    _directory._DirectoryStaging.put = put


# ------------------------------------------------------------------------------ artifact specs


def key_of(spec: dict) -> str:
    from dfcache.keys import compute_key

    return compute_key("reliability", 1, {k: spec[k] for k in sorted(spec) if k != "slow"})


def data_of(spec: dict) -> np.ndarray:
    """The ``x`` array of an artifact spec: float32 or bfloat16 rows, seeded by the spec."""
    rng = np.random.default_rng([spec["i"], spec["rows"], spec["cols"]])
    x = rng.standard_normal((spec["rows"], spec["cols"]), dtype=np.float32)
    if spec.get("dtype") == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x


def ids_of(spec: dict) -> np.ndarray:
    return (np.arange(spec["rows"], dtype=np.int64) * 7 + spec["i"]).astype(np.int32)


def check_artifact(store, spec: dict, verify: bool = True) -> list[str]:
    """Problems with the committed artifact of ``spec``: verify, then bytes against the spec."""
    key = key_of(spec)
    if verify:
        problems = store.verify(key)
        if problems:
            return problems
    art = store.open(key)
    x = art.array("x").read_raw()
    want = data_of(spec)
    want = want.view(np.uint16) if spec.get("dtype") == "bfloat16" else want
    if x.tobytes() != want.tobytes():
        return [f"{key}: array x differs from what its spec gives"]
    if "ids" in art.array_names and art.array("ids").read().tobytes() != ids_of(spec).tobytes():
        return [f"{key}: array ids differs from what its spec gives"]
    if art.json("meta") != {"spec": {k: v for k, v in spec.items() if k != "slow"}}:
        return [f"{key}: document meta differs"]
    return []


# ------------------------------------------------------------------------------ children


def cli_main(*argv: str) -> int:
    from dfcache.cli import main

    return main(list(argv))


def writer_job(store_path: str, job_json: str) -> int:
    """Write the artifacts of a job (a list of specs), printing phase markers."""
    from dfcache.store import open_store

    job = json.loads(job_json)
    install_pause(job.get("pause"))
    slow_fsync(job.get("slow_fsync", 0.0))
    slow_put(job.get("slow_put", 0.0))
    if job.get("start_at"):
        time.sleep(max(0.0, job["start_at"] - time.time()))  # start together with the others
    store = open_store(store_path)
    for spec in job["artifacts"]:
        key = key_of(spec)
        i = spec["i"]
        if store.has(key):
            mark(f"H {i} {key}")
            continue
        mark(f"S {i}")
        with store.writer(key, stage="reliability", stage_version=1, inputs={k: v for k, v in spec.items() if k != "slow"},
                          summary=f"reliability {i}") as w:
            w.put_json("meta", {"spec": {k: v for k, v in spec.items() if k != "slow"}})
            data = data_of(spec)  # "computing" while the staging area exists
            time.sleep(job.get("compute", 0.0))
            aw = w.create_array("x", data.shape, spec.get("dtype", "float32"), chunk_rows=spec["chunk_rows"],
                                codec=spec.get("codec", "none"))
            mark(f"C {i}")
            for piece in np.array_split(data, max(1, spec["rows"] // 100)):
                aw.append(piece)
            w.write_array("ids", ids_of(spec), chunk_rows=spec["chunk_rows"])
            mark(f"P {i}")
        mark(f"D {i} {key}")
    return 0


def new_store_job(stores_json: str, start_at: str) -> int:
    """Open (create) each store of a list at the same instant as the other children do, one after
    the other, printing ``O <path>`` for each opened."""
    from dfcache.store import open_store

    for path, at in zip(json.loads(stores_json), json.loads(start_at)):
        time.sleep(max(0.0, at - time.time()))
        open_store(path)
        mark(f"O {path}")
    return 0


def boundaries_of(spec: dict) -> list[int]:
    """Where a resumable writer checkpoints: a fixed, spec-given schedule of row counts."""
    out, pos = [], 0
    for step in spec["steps"]:
        pos = min(spec["rows"], pos + step)
        out.append(pos)
    if not out or out[-1] != spec["rows"]:
        out.append(spec["rows"])
    return out


def resumable_job(store_path: str, spec_json: str, pause_json: str = "") -> int:
    """One artifact written in steps with a checkpoint after each; resumes what it finds."""
    from dfcache.store import open_store

    spec = json.loads(spec_json)
    install_pause(json.loads(pause_json) if pause_json else None)
    slow_fsync(spec.get("slow", 0.0))
    store = open_store(store_path)
    key = key_of(spec)
    if store.has(key):
        mark(f"H {spec['i']} {key}")
        return 0
    data = data_of(spec)
    w = store.writer(key, stage="reliability", stage_version=1, inputs={k: v for k, v in spec.items() if k != "slow"},
                     summary="resumable", resumable=True)
    if store.has(key):  # another process committed it while we waited for the key lock
        w.discard()
        mark(f"H {spec['i']} {key}")
        return 0
    with w:
        w.put_json("meta", {"spec": {k: v for k, v in spec.items() if k != "slow"}})
        aw = w.create_array("x", data.shape, spec.get("dtype", "float32"), chunk_rows=spec["chunk_rows"],
                            codec=spec.get("codec", "none"))
        pos = aw.rows_written
        mark(f"R {pos} {int(w.resumed)}")
        for b in boundaries_of(spec):
            if b <= pos:
                continue
            aw.append(data[pos:b])
            pos = b
            mark(f"K {b}")
            w.checkpoint({"rows": b})
            mark(f"k {b}")
        w.write_array("ids", ids_of(spec), chunk_rows=spec["chunk_rows"])
        mark(f"P {spec['i']}")
    mark(f"D {spec['i']} {key}")
    return 0


def reader_job(store_path: str, seconds: str, specs_json: str) -> int:
    """Read and verify every committed artifact in a loop; any artifact that is listed but not
    complete and correct is an error (exit 1)."""
    from dfcache.store import open_store

    specs = {key_of(s): s for s in json.loads(specs_json)}
    store = open_store(store_path)
    deadline = time.monotonic() + float(seconds)
    reads = 0
    seen: set[str] = set()
    while time.monotonic() < deadline:
        errors: list = []
        manifests = store.list_manifests(errors=errors)
        if errors:
            print(f"invalid manifest listed: {errors}", file=sys.stderr)
            return 1
        for m in manifests:
            spec = specs.get(m.key)
            if spec is None:
                print(f"unknown artifact {m.key}", file=sys.stderr)
                return 1
            problems = check_artifact(store, spec)
            if problems:
                print(f"reader saw a bad artifact {m.key}: {problems}", file=sys.stderr)
                return 1
            reads += 1
            seen.add(m.key)
        time.sleep(0.005)
    mark(f"READS {reads} {len(seen)}")
    return 0


def gc_loop(store_path: str, seconds: str, *extra: str) -> int:
    """``dfcache gc --yes EXTRA`` again and again, each in a fresh forked process."""
    deadline = time.monotonic() + float(seconds)
    runs = 0
    while time.monotonic() < deadline:
        pid = os.fork()
        if pid == 0:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            try:
                os._exit(cli_main("--store", store_path, "gc", "--yes", *extra))
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"gc exited {code}", file=sys.stderr)
            return 1
        runs += 1
    mark(f"GC {runs}")
    return 0


def slow_cli(delay: str, *argv: str) -> int:
    """``dfcache ARGV`` with every file deletion slowed and marked ``U n`` (n deletions so far):
    lets a test SIGKILL a `dfcache gc` half-way through removing a directory."""
    real = os.unlink
    count = [0]

    def unlink(*a, **kw):
        time.sleep(float(delay))
        result = real(*a, **kw)
        count[0] += 1
        mark(f"U {count[0]}")
        return result

    os.unlink = unlink
    return cli_main(*argv)


def paused_cli(pause_json: str, *argv: str) -> int:
    """``dfcache ARGV`` stopped just before the store operation ``pause_json`` names (markers on
    stderr, so that stdout stays the command's own)."""
    install_pause(json.loads(pause_json), fd=2)
    return cli_main(*argv)


def cli_with_fsize_limit(limit: str, *argv: str) -> int:
    """``dfcache ARGV`` with RLIMIT_FSIZE set: a write past ``limit`` bytes fails with EFBIG (Python
    ignores SIGXFSZ), like a full disk where mounting a small tmpfs is not allowed."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    return cli_main(*argv)
