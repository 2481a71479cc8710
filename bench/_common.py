"""Shared pieces of the benchmark suite: rows, timing, sizes, files.

Every benchmark returns a :class:`Result` (rows + details). A row is one comparison: the
dfcache figure, the competitor's, their ratio, the target and PASS/FAIL (or INFO / SKIPPED).
Timings are taken by :func:`alternate`: contenders run in turn, the order rotating each
repetition, and the median of each is kept, so that a colleague's test run slowing the machine
down for a second hurts every contender alike.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"

PRESETS = {"small": 0.25, "medium": 1.0, "large": 6.0}


# ----------------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One line of the results table.

    ``ratio`` is what the target applies to; ``direction`` says how: ``">="`` (higher is
    better), ``"<="`` or ``"<"`` (lower is better). ``status`` is PASS / FAIL (a target),
    INFO (printed for context, no target) or SKIPPED (``note`` says why).
    """

    bench: str
    measure: str
    dfcache: str = ""
    competitor: str = ""
    ratio: float | None = None
    unit: str = "x"
    target: float | None = None
    direction: str = ">="
    status: str = "INFO"
    note: str = ""
    # Where and when the figure was measured, for rows not measured by this run (GPU rows read
    # from --gpu-json): "NVIDIA H200, 2026-12-04, bench/results/gpu/x.json". Empty: this run.
    source: str = ""

    def judge(self) -> "Row":
        if self.status == "SKIPPED" or self.target is None or self.ratio is None:
            if self.status not in ("SKIPPED", "FAIL"):
                self.status = "INFO"
            return self
        ok = {">=": self.ratio >= self.target, ">": self.ratio > self.target,
              "<=": self.ratio <= self.target, "<": self.ratio < self.target}[self.direction]
        self.status = "PASS" if ok else "FAIL"
        return self

    @property
    def target_text(self) -> str:
        if self.target is None:
            return ""
        sym = {">=": "≥", ">": ">", "<=": "≤", "<": "<"}[self.direction]
        return f"{sym} {fmt_num(self.target)}{self.unit}"

    @property
    def ratio_text(self) -> str:
        return "" if self.ratio is None else f"{fmt_num(self.ratio)}{self.unit}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_text"] = self.target_text
        d["ratio_text"] = self.ratio_text
        return d


def skipped(bench: str, measure: str, why: str) -> Row:
    return Row(bench=bench, measure=measure, status="SKIPPED", note=why)


@dataclass
class Result:
    rows: list[Row] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def fmt_num(x: float) -> str:
    if x is None:
        return ""
    ax = abs(x)
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.2f} s"


# ---------------------------------------------------------------------------------- context


@dataclass
class Ctx:
    factor: float
    size_name: str
    reps: int | None
    work: Path
    gpu_json: str | None = None
    verbose: bool = True
    options: dict = field(default_factory=dict)

    def reps_or(self, default: int) -> int:
        return self.reps if self.reps else default

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def tmpdir(self, name: str) -> Path:
        p = self.work / f"{name}-{uuid.uuid4().hex[:8]}"
        p.mkdir(parents=True)
        return p


def parse_size(text: str) -> tuple[str, float]:
    if text in PRESETS:
        return text, PRESETS[text]
    try:
        f = float(text)
    except ValueError:
        raise SystemExit(f"--size {text!r}: use small, medium, large or a factor such as 0.5") from None
    if f <= 0:
        raise SystemExit("--size factor must be positive")
    return f"x{f:g}", f


# ----------------------------------------------------------------------------------- timing


def alternate(contenders: dict[str, Callable[[], float]], reps: int,
              log: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Run each contender ``reps`` times, interleaved, rotating the order each repetition.

    A contender returns the seconds it measured itself (so it can leave its own set-up and
    clean-up out of the clock). Returns name -> list of seconds.
    """
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(contenders[n]())
        if log:
            log("rep %d/%d: " % (r + 1, reps) + ", ".join(f"{n} {ms(times[n][-1])}" for n in names))
    return times


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def summary(xs: list[float]) -> dict:
    return {"median": med(xs), "min": min(xs), "max": max(xs), "n": len(xs), "all": [round(x, 6) for x in xs]}


def clock(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_now() -> float:
    """CPU seconds (user + system) of this process, all its threads, and of its children that
    have been waited for (a DataLoader's workers once the epoch ends): on a shared machine the
    wall time of a CPU-bound step is mostly waiting for a core, its CPU time is not."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def clock_cpu(fn: Callable[[], Any], cpu: list[float]) -> float:
    """``clock(fn)``, the CPU seconds it took (see :func:`cpu_now`) appended to ``cpu``."""
    c = cpu_now()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    cpu.append(cpu_now() - c)
    return dt


# ------------------------------------------------------------------------------------ files


def fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root`` and every directory (what a durable commit needs)."""
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


def evict(paths) -> None:
    """Drop these files' pages from the page cache (POSIX_FADV_DONTNEED on clean pages)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: str | os.PathLike) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out.extend(os.path.join(dirpath, f) for f in files)
    return out


def tree_bytes(root: str | os.PathLike) -> int:
    return sum(os.lstat(p).st_size for p in files_under(root))


def rmtree(path: str | os.PathLike) -> None:
    shutil.rmtree(path, ignore_errors=True)


def dfcache_cmd(*args: str) -> list[str]:
    """The `dfcache` command line, through this interpreter (the venv's dfcache)."""
    return [sys.executable, "-m", "dfcache", *args]


def run_cmd(cmd: list[str], *, env: dict | None = None, cwd: str | None = None,
            timeout: float | None = None) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    cp = subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
    return time.perf_counter() - t, cp


def last_line(data: bytes) -> str:
    lines = [ln for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else ""


def bench_env(**extra: str) -> dict:
    """The environment of a timed command-line run: this one, as a user's shell would have it.
    PYTHONDONTWRITEBYTECODE is dropped: set in some sandboxes, it makes every dfcache command
    compile dfcache's and runner's modules from source at start-up (52 modules, 72 ms of a
    0.53 s `plan` on the 2-core VM), where a pip install or a first run leaves them compiled
    (DVC, the no-op eval's competitor, comes from pip with its bytecode)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.update(extra)
    return env


def profile_top(fn: Callable[[], Any], n: int = 15) -> list[dict]:
    """Run ``fn`` under cProfile; return the top ``n`` functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    st = pstats.Stats(prof)
    total = st.total_tt or 1e-12
    rows = []
    for (filename, line, func), (cc, nc, tt, ct, _callers) in st.stats.items():
        where = func if filename == "~" else f"{_short(filename)}:{line}({func})"
        rows.append({"function": where, "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4),
                     "share": round(tt / total, 3)})
    rows.sort(key=lambda r: -r["tottime_s"])
    return [{"total_s": round(total, 4)}] + rows[:n]


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/work/main/", "lib/python3."):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker != "lib/python3." else "stdlib/" + tail.split("/", 1)[-1]
    return filename
