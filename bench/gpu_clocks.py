"""The card's SM clock, power and temperature sampled beside a GPU bench (``nvidia-smi`` every
250 ms), grouped by what the bench marked as running, so that a ratio between two phases says
whether the card itself ran slower in one of them.

Why: on an H100 (2026-12-07) the replayed forwards inside the extraction took 86 ms a sample
against 80 ms bare (8B-shaped) and 192 against 175 ms (27B-shaped), the first replay close to
bare: either the card's clocks fell under sustained load or the work beside the forwards slowed
them. The samples tell the two apart.

    clocks = Clocks()              # no nvidia-smi (a CPU host): samples nothing, summary() is {}
    clocks.mark("bare forward")    # samples from now on are tagged with it
    ...
    clocks.mark(None)
    clocks.summary()               # {mark: {"samples", "sm_mhz_median", "sm_mhz_min", ...}}
    clocks.close()
"""

from __future__ import annotations

import atexit
import shutil
import statistics
import subprocess
import threading
import time

# clocks_event_reasons is the newer drivers' name of clocks_throttle_reasons
_QUERIES = (("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active"),
            ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active"),
            ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"))


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


class Clocks:
    def __init__(self, period_ms: int = 250, index: int = 0) -> None:
        self.samples: list[tuple] = []  # (time, mark, sm MHz, mem MHz, power W, temperature C, reasons)
        self.error: str | None = None
        self._mark: str | None = None
        self._proc = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.error = "no nvidia-smi"
            return
        for fields in _QUERIES:
            cmd = [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", f"--id={index}"]
            try:
                ok = subprocess.run(cmd, capture_output=True, text=True, timeout=20).returncode == 0
            except (OSError, subprocess.SubprocessError) as e:
                self.error = f"nvidia-smi: {e}"
                return
            if ok:
                break
        else:
            self.error = "nvidia-smi answered none of the queries"
            return
        self._proc = subprocess.Popen(cmd + [f"--loop-ms={period_ms}"], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True, name="gpu-clocks").start()
        atexit.register(self.close)  # nvidia-smi would outlive this process

    def _read(self) -> None:
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 4:
                continue
            reasons = parts[4] if len(parts) > 4 else None
            self.samples.append((time.perf_counter(), self._mark, *(_num(p) for p in parts[:4]), reasons))

    def mark(self, name: str | None) -> None:
        self._mark = name

    def summary(self) -> dict:
        out: dict[str, dict] = {}
        by: dict[str, list] = {}
        for s in list(self.samples):
            if s[1] is not None:
                by.setdefault(s[1], []).append(s)
        for name, rows in by.items():
            sm = [r[2] for r in rows if r[2] is not None]
            power = [r[4] for r in rows if r[4] is not None]
            temp = [r[5] for r in rows if r[5] is not None]
            out[name] = {"samples": len(rows),
                         "sm_mhz_median": statistics.median(sm) if sm else None,
                         "sm_mhz_min": min(sm) if sm else None,
                         "power_w_median": statistics.median(power) if power else None,
                         "temperature_c_max": max(temp) if temp else None,
                         "reasons": sorted({r[6] for r in rows if r[6]})}
        return out

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
