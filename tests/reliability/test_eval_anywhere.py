"""Extract on a GPU, evaluate anywhere: hidden states whose backend class says fla on CUDA are
evaluated on this CPU machine (`--eval-device auto`), quietly under --no-progress.

The states are the bytes of a real CPU extraction committed again under the partition the fla/cuda
backend class gives (computed from the segments' own inputs with the backend replaced), which is
what a pull from a GPU machine's store leaves here."""

from __future__ import annotations

import json

import pytest
from rel_helpers import NUM_PROMPTS, copy_store, has_stage

from dfcache.errors import EXIT_BAD_INPUT
from dfcache.store import open_store

FLA_CUDA = {"kernel": "fla", "device": "cuda", "dtype": "float32", "attn_implementation": "sdpa"}
pytestmark = pytest.mark.skipif(not has_stage("drafter_eval"), reason="needs runner/stages/drafter_eval/")


def _as_fla_cuda(store, key: str) -> tuple[str, str]:
    """Commit the samples of segment ``key`` again under the fla/cuda backend class's partition
    (same upstream samples, same bytes); returns (new segment key, its partition key)."""
    from dfcache.samples import Partition, SampleArray, Segment, SegmentWriter

    m = store.manifest(key)
    seg = Segment(store, key)
    part = Partition(m.stage, m.stage_version, {**m.inputs, "backend": FLA_CUDA},
                     dict(m.samples["partition_upstream"]))
    spec = m.arrays["hidden"]
    with SegmentWriter(store, part, seg.upstream, doc=False, provenance={"copied_from": key}, summary=m.summary,
                       arrays={"hidden": SampleArray(tuple(spec.shape[1:]), spec.dtype)}) as w:
        for pos in range(len(seg.keys)):
            w.add({"hidden": seg.read_raw(pos, "hidden")})
    return w.key, part.key


def test_fla_cuda_states_evaluate_on_the_cpu(heavy_zygote, base_store, tmp_path):
    from runner.models.train_tiny import make_untrained_drafter

    store = copy_store(base_store, tmp_path / "store")
    drafter = tmp_path / "drafter"
    make_untrained_drafter(base_store["args"][1], drafter, seed=1)
    common = ["--store", store, "run", "eval", *base_store["args"], "--offline", "--drafter", drafter,
              "--dtype", "float32", "--tree-budget", "2", "--no-progress", "--json"]
    # The states on the CPU, as torch made them, and their eval (the reference).
    torch_run = heavy_zygote.cli(*common, "--backend", "torch", "--device", "cpu", timeout=300)
    assert torch_run.code == 0, torch_run.err
    s = open_store(store)
    cpu_states = [m.key for m in s.list_manifests(stage="hidden_states")]
    # `ls` says what the states came from: prompt set, completion source, served model.
    rows = heavy_zygote.cli("--store", store, "ls", "--stage", "hidden-states", "--no-progress")
    assert rows.code == 0, rows.err
    lines = [ln for ln in rows.out.splitlines() if "hidden_states" in ln]
    assert len(lines) == len(cpu_states) >= 1
    for ln in lines:
        assert f"builtin:coding×{NUM_PROMPTS}, openai server scripted-model" in ln, rows.out
    fla = [_as_fla_cuda(s, k) for k in cpu_states]
    fla_parts = {p for _, p in fla}

    r = heavy_zygote.cli(*common, "--backend", "fla", "--device", "cuda", timeout=300)
    assert r.code == 0, r.err
    report = json.loads(r.out)
    after = [m.key for m in open_store(store).list_manifests(stage="hidden_states")]
    assert sorted(after) == sorted(cpu_states + [k for k, _ in fla]), "hidden states were recomputed"
    (d,) = report["drafters"]
    assert d["hidden_states_backend"] == FLA_CUDA
    evals = [m for m in open_store(store).list_manifests(stage="drafter_eval")
             if set(m.samples["partition_upstream"]["hidden_states"]) <= fla_parts]
    assert evals and all(m.inputs["device"] == "cpu" for m in evals)  # the eval keys its own device
    # Same bytes, same device and dtype: the same acceptance as the torch-keyed states.
    (ref,) = json.loads(torch_run.out)["drafters"]
    assert d["tau_chain"] == ref["tau_chain"] and d["tau_tree"] == ref["tau_tree"]
    # --no-progress: none of transformers' bars or kernel-fallback notices on stderr.
    for noise in ("Loading weights", "falling back", "it/s]"):
        assert noise not in r.err and noise not in torch_run.err, f"{noise!r} on stderr:\n{r.err}"
    assert "Torch not compiled with CUDA" not in r.err

    from runner.models.target import cuda_visible

    if not cuda_visible()[0]:
        # auto is the CPU here: --eval-device cpu names the same eval, found in the store.
        again = heavy_zygote.cli(*common, "--backend", "fla", "--device", "cuda", "--eval-device", "cpu", timeout=300)
        assert again.code == 0, again.err
        assert json.loads(again.out)["computed"] == [] and json.loads(again.out)["drafters"][0]["key"] == d["key"]
        r = heavy_zygote.cli(*common, "--backend", "fla", "--device", "cuda", "--eval-device", "cuda",
                             "--tree-budget", "3", timeout=300)
        assert r.code == EXIT_BAD_INPUT, r.err
        assert "--eval-device cuda: no CUDA GPU is usable here" in r.err and "--eval-device cpu" in r.err
        assert "Traceback" not in r.err
