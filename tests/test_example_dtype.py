"""`run eval --example` runs float32 on the CPU, but a run that asks for the GPU path keeps the
dtype that path runs for users (issue 36 point 3): the options the example fills in."""

from __future__ import annotations

from runner.models.example import fill_example_defaults
from runner.core.options import EvalOptions


def test_the_cpu_example_is_float32_on_torch():
    opts = EvalOptions(example=True)
    assert fill_example_defaults(opts) is None
    assert (opts.dtype, opts.backend, opts.device) == ("float32", "torch", "cpu")


def test_fla_or_cuda_keeps_bfloat16_and_says_so():
    for given in ({"backend": "fla", "device": "cuda"}, {"backend": "fla"}, {"device": "cuda"}):
        opts = EvalOptions(example=True, **given)
        note = fill_example_defaults(opts)
        assert opts.dtype == "bfloat16", given
        assert note and "bfloat16" in note and note.endswith("pass --dtype float32)")
        assert opts.num_prompts == 8 and opts.tree_budgets == [4, 8]  # the other defaults still apply


def test_an_explicit_float32_on_the_gpu_stays_float32():
    opts = EvalOptions(example=True, backend="fla", device="cuda", dtype="float32")
    assert fill_example_defaults(opts) is None
    assert opts.dtype == "float32"
