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
    assert res.details["judged_threads"] == 1
    assert torch.get_num_threads() == before
