"""`dfcache compare-backends`: τ on two backends' states over the same tokens, with per-layer diffs.

fla states cannot be computed on this CPU machine (fla's kernels need CUDA), so the fla side is
committed into the store the way a GPU machine's push would leave it: under the key the
hidden-state stage gives fla/cuda states of the same tokens samples (the key recipe of
runner/stages/hidden_states/), with the torch states' values plus a small perturbation standing
in for the kernel difference. Everything else (torch states, both evals, the diffs) is computed
by the command itself.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dfcache import open_store
from dfcache.errors import BadInputError
from runner.trust.compare_backends import run_compare
from runner.core.graph import RunContext, resolve
from runner.core.pipeline import execute
from runner.models.target import resolve_kernel
from runner.core.options import EvalOptions
from runner.core.pipeline import build_graph
from runner.stages import hidden_states
from runner.models.train_tiny import single_thread

NOISE = 1e-2


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory):
    from runner.models.train_tiny import make_untrained_drafter

    root = tmp_path_factory.mktemp("cmp")
    drafter = make_untrained_drafter(tiny_target, root / "drafter", seed=1)
    opts = EvalOptions(target=str(tiny_target), drafters=[str(drafter)], num_prompts=2, max_new_tokens=8,
                       device="cpu", dtype="float32", tree_budgets=[2], progress=False)
    return root, drafter, opts


def commit_fake_fla_states(store, opts):
    """Run the torch graph, then commit perturbed copies of its states under the fla/cuda
    partitions (same samples, one segment a layer); returns the nodes and, per layer, (torch set
    key, fla set key, fla partition key)."""
    from dfcache.samples import Partition, SampleArray, SampleSet, SegmentWriter
    from runner.core.sampling import set_key

    ctx = RunContext(store, dataclasses.replace(opts, backend="torch"), argv=[])
    nodes = resolve(ctx, build_graph(ctx, "eval"))
    with single_thread():
        execute(ctx, nodes)
    fla = resolve_kernel("fla", "auto", opts.dtype, "sdpa", has_linear_attention=True, check=False)
    rng = np.random.default_rng(0)
    out = {}
    for n in nodes:
        if n.stage != "hidden_states":
            continue
        part = Partition(hidden_states.NAME, hidden_states.VERSION, {**n.inputs, "backend": fla.to_key()},
                         dict(n.partition.upstream))
        ups = sorted(set(n.upstream_samples))
        src = SampleSet(store, n.partition.key, [n.partition.sample_key(u) for u in ups])
        rows = src.read_many("hidden", raw=True)
        spec = src.segment(0)[0].artifact.manifest.arrays["hidden"]
        with SegmentWriter(store, part, ups, doc=False, provenance={"note": "torch states + noise, standing in for fla"},
                           arrays={"hidden": SampleArray(tuple(spec.shape[1:]), spec.dtype)}) as w:
            for x in rows:
                y = (x + NOISE * np.abs(x).mean() * rng.standard_normal(x.shape)).astype(x.dtype)
                w.add({"hidden": y})
        out[n.inputs["layer"]] = (n.key, set_key(part.key, part.sample_keys(n.upstream_samples)), part.key)
    return nodes, out


def test_fla_states_missing_on_a_cpu_machine_fail_before_any_work(setup, tmp_path):
    _, _, opts = setup
    store = open_store(tmp_path / "s")
    with pytest.raises(BadInputError, match="cannot be computed here"):
        run_compare(store, opts, ["fla", "torch"])
    assert store.list_manifests() == []


def test_tau_side_by_side_with_per_layer_diffs(setup, tmp_path, capsys):
    root, drafter, opts = setup
    store = open_store(tmp_path / "s")
    torch_nodes, keys = commit_fake_fla_states(store, opts)
    with single_thread():
        res = run_compare(store, opts, ["fla", "torch"], completions_backend="torch")
    assert res["backends"] == ["fla/cuda/float32/sdpa", "torch/cpu/float32/sdpa"]
    tokens = next(n for n in torch_nodes if n.stage == "tokens")
    assert res["tokens"] == tokens.key                       # both sides over the same tokens
    (d,) = res["drafters"]
    torch_eval = next(n for n in torch_nodes if n.stage == "drafter_eval")
    assert d["evals"]["torch/cpu/float32/sdpa"]["key"] == torch_eval.key   # the plain eval, reused
    fla_parts = [keys[k][2] for k in (1, 3, 5)]
    fla_evals = [m for m in store.list_manifests(stage="drafter_eval")
                 if m.samples["partition_upstream"]["hidden_states"] == fla_parts]
    assert fla_evals and all(m.inputs["device"] == "cpu" for m in fla_evals)  # evaluated here, from GPU-made states
    assert all(1.0 <= e["tau_chain"] <= 8.0 for e in d["evals"].values())
    assert d["delta_tau_chain"]["torch/cpu/float32/sdpa"] == pytest.approx(
        d["evals"]["torch/cpu/float32/sdpa"]["tau_chain"] - d["evals"]["fla/cuda/float32/sdpa"]["tau_chain"])
    assert [x["layer"] for x in res["layers"]] == [1, 3, 5]
    for x in res["layers"]:
        assert 0.2 * NOISE < x["rel_l2"] < 5 * NOISE and x["cos_min"] < 1.0 and x["equal"] < 0.5
        assert (x["key_a"], x["key_b"]) == keys[x["layer"]][1::-1]

    # The command line, everything cached now.
    from dfcache.cli import main
    from dfcache.cli.common import state

    saved = dataclasses.replace(state)
    try:
        rc = main(["--store", str(tmp_path / "s"), "compare-backends", "--target", opts.target, "--drafter",
                   str(drafter), "--backend", "fla", "--backend", "torch", "--num-prompts", "2",
                   "--max-new-tokens", "8", "--device", "cpu", "--completions-backend", "torch", "--dtype", "float32", "--tree-budget", "2", "--json"])
    finally:
        for f in dataclasses.fields(state):
            setattr(state, f.name, getattr(saved, f.name))
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(res))


def test_codec_axis_gives_tau_on_fp8_states_beside_bf16_with_per_layer_error(setup, tmp_path):
    """Issue 33: one backend, states stored exact and FP8, the same drafter and budgets on each."""
    from dfcache.errors import UsageError
    from runner.trust.compare_backends import format_compare

    root, drafter, opts = setup
    opts = dataclasses.replace(opts, dtype="bfloat16")
    store = open_store(tmp_path / "s")
    with single_thread():
        res = run_compare(store, opts, ["torch"], codecs=["none", "fp8-e4m3"])
    assert res["axis"] == "codec"
    assert res["backends"] == ["torch/cpu/bfloat16/sdpa", "torch/cpu/bfloat16/sdpa+fp8-e4m3"]
    (d,) = res["drafters"]
    exact, lossy = (d["evals"][b] for b in res["backends"])
    assert exact["key"] != lossy["key"] and all(1.0 <= e["tau_chain"] <= 8.0 for e in (exact, lossy))
    assert set(exact["tau_tree"]) == set(lossy["tau_tree"]) == {"2"}
    assert [x["layer"] for x in res["layers"]] == [1, 3, 5]
    for x in res["layers"]:
        assert 0 < x["rel_l2"] < 0.05 and 0.99 < x["cos_min"] < 1.0 and x["equal"] < 1.0
    text = format_compare(res)
    assert "codecs over the same tokens" in text and "τ chain fp8-e4m3" in text and "Δ fp8-e4m3" in text
    for backends, codecs in ((["torch", "fla"], ["none", "fp8-e4m3"]), (["torch"], ["none", "zstd"])):
        with pytest.raises(UsageError):
            run_compare(store, opts, backends, codecs=codecs)
