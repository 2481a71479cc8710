"""The GPU benches' own tools that run without a GPU: the clock sampler beside a bench
(``bench/gpu_clocks.py``) and the rows rebuilt from an earlier run's JSON (``bench/gpu_extract.py
--rows-from``), with the physical-limit row of issue 36 item 2."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A stand-in for nvidia-smi (no GPU here), written from its documented CSV query output
# (`--query-gpu=... --format=csv,noheader,nounits`, `--loop-ms=N` repeats it): this driver does
# not know `clocks_event_reasons` (older drivers' name is `clocks_throttle_reasons`), as such
# drivers answer an unknown field, with an error and exit status 2.
FAKE_SMI = """#!/bin/sh
case "$*" in *clocks_event_reasons*) echo 'Field "clocks_event_reasons.active" is not a valid field' >&2; exit 2;; esac
case "$*" in
  *--loop-ms=*) while :; do echo "1755, 2619, 651.20, 61, 0x0000000000000004"; sleep 0.05; done;;
  *) echo "1980, 2619, 120.00, 40, 0x0000000000000000";;
esac
"""


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 60  # generous: the stand-in prints every 50 ms
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def test_clock_samples_are_grouped_by_mark_with_the_older_drivers_field(tmp_path, monkeypatch):
    from bench.gpu_clocks import Clocks

    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    clocks = Clocks(period_ms=50)
    try:
        assert clocks.error is None
        clocks.mark("bare")
        _wait_for(lambda: sum(s[1] == "bare" for s in clocks.samples) >= 2, "samples marked 'bare'")
        clocks.mark(None)
        clocks.mark("extract")
        _wait_for(lambda: sum(s[1] == "extract" for s in clocks.samples) >= 2, "samples marked 'extract'")
        clocks.mark(None)
        got = clocks.summary()
    finally:
        proc = clocks._proc
        clocks.close()
    assert set(got) == {"bare", "extract"}  # unmarked samples belong to no pass
    for row in got.values():
        assert row["samples"] >= 2
        assert row["sm_mhz_median"] == 1755.0 and row["power_w_median"] == 651.2
        assert row["temperature_c_max"] == 61.0 and row["reasons"] == ["0x0000000000000004"]
    assert proc.poll() is not None  # the sampler does not outlive close()


def test_no_nvidia_smi_samples_nothing(monkeypatch, tmp_path):
    from bench.gpu_clocks import Clocks

    monkeypatch.setenv("PATH", str(tmp_path))
    clocks = Clocks()
    assert clocks.error == "no nvidia-smi" and clocks.summary() == {}
    clocks.close()


@pytest.mark.parametrize("name, target", [("gpu_extract_8b_256_fused_h100_2026-12-07.json", 0.6),
                                          ("gpu_extract_27b_128_fused_h100_2026-12-07.json", None)])
def test_rows_rebuilt_from_a_runs_json_judge_the_physical_limit_of_the_8b_shape(tmp_path, name, target):
    from bench.gpu_extract import rebuild_rows

    src = tmp_path / name
    doc = json.loads((REPO / "bench" / "results" / "gpu" / name).read_text())
    doc.pop("rows", None)
    doc.pop("rows_rebuilt", None)
    src.write_text(json.dumps(doc))
    out = tmp_path / "out.json"
    assert rebuild_rows(str(src), str(out)) == 0
    new = json.loads(out.read_text())
    assert {k: v for k, v in new.items() if k not in ("rows", "rows_rebuilt")} == doc  # measured fields as they were
    phys = [r for r in new["rows"] if "physical limit" in r["measure"]]
    assert len(phys) == 1
    ext = next(t["tok_per_s"] for t in doc["throughput"] if t["what"] == "dfcache extract (equal)")
    limit = doc["mfu"]["peak_bf16_tflops"] * 1e3 / doc["mfu"]["gflop_per_token"]
    assert phys[0]["ratio"] == round(ext / limit, 3)
    assert phys[0]["target"] == target
    assert phys[0]["status"] == ("INFO" if target is None else ("PASS" if ext / limit >= target else "FAIL"))
