"""bench/state_digest.py (digests of stored hidden states, to compare library versions bit for bit
on a GPU: bench/results/gpu/state_digest_*_2026-12-04-t525.json, transformers 5.24 vs 5.25) runs on the CPU: the same digests
twice, no network, no hub kernels, plain kernel functions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent


def _run(*outs: Path) -> list[dict]:
    """Run the script once per output file, all at once: independent processes, own work dirs
    (two in a row took 2x the wall time of one on an idle 2-core machine)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, str(REPO / "bench" / "state_digest.py"), "--cpu-smoke", "--out", str(out),
                               "--work", str(out.parent / (out.stem + "-work"))],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for out in outs]
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stdout + stderr
    return [json.loads(out.read_text()) for out in outs]


def test_state_digest_on_the_cpu(tmp_path):
    a, b = _run(tmp_path / "a.json", tmp_path / "b.json")
    assert a["states_xxh3"] == b["states_xxh3"] and a["model"]["weights_xxh3"] == b["model"]["weights_xxh3"]
    assert sorted(a["layers"]) == ["1", "3"] and all(len(v["per_sample"]) == 3 for v in a["layers"].values())
    assert a["network_attempts"] == [] and a["use_kernels"] is False and a["modeling_functions_all_plain"]
    assert all(v.startswith("transformers.") for v in a["bound"].values())  # torch on the CPU
