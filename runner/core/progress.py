"""Progress of a long stage as plain lines, for a stderr that is not a terminal (a log file, a
Slurm job, ``nohup``), where a bar's carriage returns make one unreadable line or nothing at all.

Eight minutes of server generation showed no sign of life in a log; pip and DVC print a line now
and then instead. :class:`LineProgress` takes the calls the stages make on a tqdm bar (``update``,
``close``) and prints ``completions: 12/80 req (15%), 1.2 req/s, 10 s elapsed, about 57 s left``
every ``every`` seconds, also while no step finishes (a slow server: the line shows the run is
alive), and once more at the end if it printed anything. ``every=0`` prints a line at each step.
"""

from __future__ import annotations

import threading
import time


def _count(n: float, scale: bool) -> str:
    if not scale:
        return f"{int(n)}"
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def _secs(s: float) -> str:
    s = int(round(s))
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60:02d} s"


class LineProgress:
    def __init__(self, total: int | None, desc: str, unit: str, out, every: float, unit_scale: bool = False):
        self.total, self.desc, self.unit, self.out = total, desc, unit, out
        self.every, self.scale = float(every), unit_scale
        self.n = 0
        self.start = self._last = time.monotonic()
        self.printed = 0
        self._printed_n = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.every > 0:
            self._thread = threading.Thread(target=self._beat, name=f"progress: {desc}", daemon=True)
            self._thread.start()

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = now - self.start
        done = _count(self.n, self.scale)
        text = f"{self.desc}: {done}/{_count(self.total, self.scale)} {self.unit}" if self.total else \
            f"{self.desc}: {done} {self.unit}"
        if self.total:
            text += f" ({100 * self.n / self.total:.0f}%)"
        if self.n and elapsed > 0:
            rate = self.n / elapsed
            text += f", {_count(rate, True) if self.scale else f'{rate:.1f}' if rate < 100 else f'{rate:.0f}'} {self.unit}/s"
        text += f", {_secs(elapsed)} elapsed"
        if self.n and self.total and self.n < self.total and elapsed > 0:
            text += f", about {_secs((self.total - self.n) * elapsed / self.n)} left"
        return text

    def _print(self, now: float) -> None:
        with self._lock:
            self._last = now
            self.printed += 1
            self._printed_n = self.n
            try:
                self.out.write(self.line(now) + "\n")
                self.out.flush()
            except (OSError, ValueError):  # a closed stream: progress is not worth failing a run
                pass

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            now = time.monotonic()
            if now - self._last >= self.every:
                self._print(now)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every:
            self._print(now)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self.printed and self._printed_n != self.n:  # how it ended; a short stage prints nothing
            self._print(time.monotonic())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
