"""The CPU rows of ``python -m bench`` measure what they say (issue 36): CPU time counts every
thread and the joined child processes, the eval-batching target is judged with both sides at
one torch thread, and the ``size`` row fails, saying why, when it cannot use the tiny model's
states (never a silent N(0,1) fallback)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from bench._common import Ctx, cpu_now

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def _burn(seconds: float) -> None:
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def test_cpu_time_counts_threads_and_joined_children():
    c = cpu_now()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.3)], check=True)  # waited for: counted
    th = threading.Thread(target=_burn, args=(0.2,))
    th.start()
    th.join()
    assert cpu_now() - c >= 0.5  # 0.3 s of the child's + 0.2 s of the thread's, whatever the load


def _ctx(tmp_path, factor: float) -> Ctx:
    return Ctx(factor=factor, size_name="tiny", reps=1, work=tmp_path, verbose=False)


def test_size_row_fails_naming_why_when_the_tiny_states_cannot_be_made(tmp_path, monkeypatch):
    import bench.size as size

    def broken(ctx, tokens):
        raise ImportError("this transformers has no Qwen3.5")

    monkeypatch.setattr(size, "tiny_states", broken)
    res = size.run(_ctx(tmp_path, 0.01))
    judged = [r for r in res.rows if r.target is not None]
    assert len(judged) == 2 and all(r.status == "FAIL" for r in judged)
    assert all("no Qwen3.5" in r.note and "N(0,1)" not in r.measure for r in res.rows)
    assert res.details["source"] is None  # nothing was measured on other data


def test_eval_batching_target_row_pins_one_thread_on_both_sides(tmp_path):
    torch = pytest.importorskip("torch")
    import bench.eval_batching as eb

    before = torch.get_num_threads()
    res = eb.run(_ctx(tmp_path, 0.01))
    judged = [r for r in res.rows if r.target is not None]
    assert len(judged) == 1 and "1 torch thread)" in judged[0].measure
    assert "CPU time" in judged[0].measure  # judged by CPU time; the wall time is in the details
    run = res.details["runs"][next(k for k in res.details["runs"] if k.endswith("x1"))]
    assert run["cpu_seconds"]["batched"]["n"] == run["seconds"]["batched"]["n"] > 0
    assert res.details["judged_threads"] == 1
    assert torch.get_num_threads() == before
    # beside it, one block at a time over cached context K/V (as a serving loop decodes), same results
    cached = [r for r in res.rows if "context K/V cached" in r.measure]
    assert len(cached) == 1 and cached[0].status == "INFO" and cached[0].ratio > 0
    assert next(v for k, v in res.details["runs"].items() if k.endswith("_cached_context"))["max_abs_diff"] < 1e-4


def test_the_page_says_when_a_run_was_made_on_a_busy_machine():
    from bench.__main__ import _run_source

    meta = {"date": "2026-12-06T17:38:40+00:00", "machine": {"cpu_model": "AMD EPYC", "usable_cpus": 2}}
    busy = {"meta": {**meta, "load_avg_start": [8.3, 8.6, 6.8], "load_avg_end": [6.3, 8.0, 7.5]}}
    quiet = {"meta": {**meta, "load_avg_start": [0.5, 0.4, 0.3], "load_avg_end": [1.5, 1, 1]}}
    assert _run_source(busy) == "2026-12-06, AMD EPYC (2 cores, busy (load 7.3))"
    assert _run_source(quiet) == "2026-12-06, AMD EPYC (2 cores)"
