"""`dfcache plan --estimate` (runner/core/estimate.py): the tokens still to extract, the bytes per codec
and the hours, from the rate of the last extraction of the same target shape in this store, or
the GPU bench's figure for that shape.

Through the real command line, in this process, on the tiny Qwen3.5 target (CPU, float32, local
greedy completions): an empty store gives an upper bound and no rate; after an extraction the
rate is recorded and a new layer's plan is exact and priced with it.
"""

from __future__ import annotations

import json

import pytest

from dfcache.errors import EXIT_USAGE


def _cli(capsys, store, *args):
    from dfcache.cli import main

    code = main(["--store", str(store), *[str(a) for a in args]])
    out = capsys.readouterr()
    return code, out.out, out.err


def _args(target, *layers):
    out = ["--target", target, "--backend", "torch", "--device", "cpu", "--dtype", "float32", "--num-prompts", 2,
           "--max-new-tokens", 4]
    for k in layers:
        out += ["--layer", k]
    return out


def test_estimate_before_and_after_an_extraction(tiny_target, tmp_path, capsys):
    store = tmp_path / "store"
    code, out, err = _cli(capsys, store, "--json", "plan", "hidden-states", *_args(tiny_target, 1, 3), "--estimate")
    assert code == 0, err
    est = json.loads(out)["estimate"]
    assert len(est) == 1 and est[0]["samples_to_extract"] == 2 and est[0]["layers"] == [1, 3]
    assert est[0]["tokens_exact"] is False and est[0]["tokens_to_extract"] > 2 * 4  # prompts + 4 new tokens each
    assert est[0]["rate"] is None and est[0]["hours"] is None  # no figure for the tiny shape yet
    none = est[0]["bytes"]["none"]
    assert none == est[0]["tokens_to_extract"] * 2 * 128 * 4  # two layers, hidden 128, float32 (an upper bound)
    assert est[0]["bytes"]["shuffle-zstd"] < est[0]["bytes"]["bitshuffle-lz4"] < none

    code, out, err = _cli(capsys, store, "run", "hidden-states", *_args(tiny_target, 1, 3))
    assert code == 0, err

    # layer 2 is new: both samples lack it; their tokens are stored now, so the count is exact
    code, out, err = _cli(capsys, store, "--json", "plan", "hidden-states", *_args(tiny_target, 1, 2, 3), "--estimate")
    assert code == 0, err
    plan = json.loads(out)
    e = plan["estimate"][0]
    tokens = [n for n in plan["nodes"] if n["stage"] == "tokens"][0]
    assert e["samples_to_extract"] == 2 and e["tokens_exact"] is True
    rates = json.loads((store / "extract-rates" / "rates.json").read_text())
    (shape, by_device), = rates.items()
    assert shape == "hybrid/h128/l6/float32" and list(by_device) == ["cpu"]
    measured = by_device["cpu"]
    assert measured["deepest"] == 3 and measured["layers"] == [1, 3]
    assert measured["tokens"] == e["tokens_to_extract"]  # the run extracted these same two samples
    assert e["rate"]["device"] == "cpu" and "this store's last extraction" in e["rate"]["source"]
    # deepest layer now 2, measured at 3: the forward runs 3 layers instead of 4
    assert e["rate"]["tok_per_s"] == pytest.approx(measured["tok_per_s"] * 4 / 3)
    assert e["hours"] == pytest.approx(e["tokens_to_extract"] / e["rate"]["tok_per_s"] / 3600)
    assert e["bytes"]["none"] == e["tokens_to_extract"] * 128 * 4  # only layer 2 is stored
    assert tokens["status"] == "cached"

    code, out, err = _cli(capsys, store, "plan", "hidden-states", *_args(tiny_target, 1, 2, 3), "--estimate")
    assert code == 0, err
    assert f"{e['tokens_to_extract']:,} tokens to extract" in out and "h at" in out and "on cpu" in out

    code, out, err = _cli(capsys, store, "run", "hidden-states", *_args(tiny_target, 1, 3), "--estimate")
    assert code == EXIT_USAGE and "--estimate applies to `dfcache plan` only" in err


def test_the_bench_figure_prices_a_27b_shaped_job(tmp_path):
    """No extraction recorded: 10,000 prompts of 2,048 tokens on the Qwen3.6-27B shape at the H100
    bench's rate, scaled to the deepest layer."""
    from dfcache import open_store
    from runner.core.estimate import pick_rate
    from runner.models.target import ModelInfo

    store = open_store(tmp_path / "store")
    info = ModelInfo(model_type="qwen3_5", num_layers=64, hidden_size=5120, vocab_size=248320,
                     has_linear_attention=True)
    at61 = pick_rate(store, info, "bfloat16", 61, None)
    assert at61["device"] == "NVIDIA H100 80GB HBM3" and "GPU bench" in at61["source"]
    assert 10_000 * 2048 / at61["tok_per_s"] / 3600 == pytest.approx(0.704, abs=0.01)
    assert pick_rate(store, info, "bfloat16", 30, None)["tok_per_s"] == pytest.approx(at61["tok_per_s"] * 62 / 31)
    assert pick_rate(store, info, "float32", 61, None) is None  # no figure for another dtype
