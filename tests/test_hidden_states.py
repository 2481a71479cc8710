"""Hidden-state extraction on a tiny real Qwen3.5 target (gated DeltaNet + full attention), CPU.

Everything is real: the model is built from a config with random weights, the store is a real
directory, the tokens artifact is written through the store API the tokens stage uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dfcache import fingerprint_path, open_store
from dfcache.errors import BadInputError
from runner.core.graph import Node, RunCache, RunContext, RunHooks, TokensSpec, resolve
from runner.core.pipeline import execute
from runner.core.options import EvalOptions

REPO = Path(__file__).resolve().parents[1]
# Lengths with repeats so that equal-length samples share batches.
LENGTHS = [23, 40, 17, 40, 58, 9, 33, 40, 17, 61, 12, 28]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Two cores shared with other test processes: OpenMP spin-waiting with 2 threads made a
    # forward 40x slower than with 1 in this setup.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_tokens(store, target_dir, lengths=LENGTHS, seed=0) -> Node:
    """A tokens node whose samples have the names and layout of the tokens stage."""
    from dfcache.samples import SampleArray, SampleSink, index_of, record_digest

    rng = np.random.default_rng(seed)
    fp = fingerprint_path(target_dir)
    ups = [record_digest({"seed": seed, "i": i}) for i in range(len(lengths))]
    node = Node.make_samples("tokens", 2, inputs={"target": fp, "tokenizer": fp, "seed": seed}, upstream_samples=ups,
                             ids=[str(i) for i in range(len(lengths))], needs="cpu",
                             spec=TokensSpec(target_dir=str(target_dir)), label="tokens")
    ids = [rng.integers(3, 500, n).astype(np.int32) for n in lengths]
    if index_of(store).missing(node.partition.key, node.sample_keys):
        with SampleSink(store, node.partition, arrays={"ids": SampleArray((), "int32")}) as sink:
            for u, x in zip(ups, ids):
                sink.add(u, {"ids": x}, {"prompt_len": 3, "completion_len": len(x) - 3, "finish_reason": "length",
                                         "tokens_source": "local", "eos_appended": False})
    return node


def samples_of(store, tokens_node):
    from runner.stages.tokens import read_tokens

    t = read_tokens(store, tokens_node)
    return [t.sample(i) for i in range(len(t))], t.offsets


def segments_of(store, node):
    from dfcache.samples import index_of

    return index_of(store).segments(node.partition.key)


def states_of(store, node):
    """Every sample's rows of a layer node, by position (bf16 as uint16 bits)."""
    from dfcache.samples import SampleSet

    return SampleSet(open_store(store.url), node.partition.key, node.sample_keys).read_many("hidden", raw=True)


def run_layers(store, tokens_node, layers, cache: RunCache | None, hooks: RunHooks | None = None, **opts):
    """Plan and execute hidden_states for ``layers``; returns (nodes by layer, ctx). Runs given
    one ``cache`` share the loaded target, as the stages of one run do."""
    from runner.stages import hidden_states as hs

    o = EvalOptions(layers=list(layers), backend="torch", device="cpu", progress=False,
                    **{"dtype": "float32", "batch_tokens": 64, **opts})
    ctx = RunContext(store, o, argv=["run", "hidden-states"], cache=cache, hooks=hooks)
    nodes = hs.build(ctx, tokens_node, hs.requested_layers(ctx, []))
    resolve(ctx, list(nodes.values()))
    execute(ctx, list(nodes.values()))
    return nodes, ctx


def loaded_target(cache: RunCache):
    (target,) = cache.targets.values()
    return target


@pytest.fixture(scope="module")
def fp32_run(tiny_target, tmp_path_factory):
    """Layers {1,3} then {1,3,5} in fp32; records the decoder-layer executions of each run."""
    store = open_store(tmp_path_factory.mktemp("hs") / "store")
    tok = write_tokens(store, tiny_target)
    cache = RunCache()
    first, ctx1 = run_layers(store, tok, [1, 3], cache)
    target = loaded_target(cache)
    after_first = (target.layers_executed, target.tokens_forwarded, list(ctx1.work_done))
    # The second run goes down to the last layer: the final norm and lm_head must still not run.
    head_calls = []
    hooks = [m.register_forward_hook(lambda *a, name=name: head_calls.append(name))
             for name, m in (("norm", target.base.norm), ("lm_head", target.model.lm_head))]
    second, ctx2 = run_layers(store, tok, [1, 3, 5], cache)
    for h in hooks:
        h.remove()
    after_second = (target.layers_executed, target.tokens_forwarded, list(ctx2.work_done))
    return dict(store=store, tokens=tok, first=first, second=second, cache=cache, head_calls=head_calls,
                after_first=after_first, after_second=after_second, target=target)


def test_states_equal_plain_transformers_forward_bit_for_bit(fp32_run, tiny_target):
    import torch
    from transformers import AutoModelForCausalLM

    from runner.stages.hidden_states import read_layer

    store, nodes = fp32_run["store"], fp32_run["second"]
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    samples, offs = samples_of(store, fp32_run["tokens"])
    with torch.no_grad():
        normed = [ref(input_ids=torch.from_numpy(s.astype(np.int64))[None], output_hidden_states=True)
                  .hidden_states[-1][0] for s in samples]
        ref.config.tie_last_hidden_states = False  # hidden_states[L]: the raw last-layer output
        plain = [ref(input_ids=torch.from_numpy(s.astype(np.int64))[None], output_hidden_states=True)
                 .hidden_states for s in samples]
    for k in (1, 3, 5):
        stored = read_layer(store, nodes[k])
        assert stored.dtype == torch.float32 and tuple(stored.shape) == (int(offs[-1]), 128)
        for i, hs in enumerate(plain):
            assert torch.equal(stored[offs[i]:offs[i + 1]], hs[k + 1][0]), (k, i)
    # Layer 5 is the last one: stored before the final norm, which HF applies to hidden_states[-1].
    last = read_layer(store, nodes[5])
    assert not torch.equal(last[: len(samples[0])], normed[0])
    # One sample reads only its rows.
    assert torch.equal(read_layer(store, nodes[3], [2]), plain[2][4][0])


def test_second_request_computes_only_the_new_layer(fp32_run):
    layers1, tokens1, done1 = fp32_run["after_first"]
    layers2, tokens2, done2 = fp32_run["after_second"]
    first, second = fp32_run["first"], fp32_run["second"]
    total = sum(LENGTHS)
    batches = layers1 // 4  # the first run stopped after layer 3: 4 decoder layers per batch
    assert layers1 == 4 * batches and batches >= 1 and tokens1 == total
    assert done1 == [first[1].key, first[3].key]
    # {1,3,5}: 1 and 3 are cached (same keys); one pass runs layers 0..5 and stores only layer 5.
    assert second[1].key == first[1].key and second[3].key == first[3].key
    assert done2 == [second[5].key]
    assert layers2 - layers1 == 6 * batches and tokens2 - tokens1 == total
    assert fp32_run["head_calls"] == []  # no final norm, no lm_head, even for the last layer
    # Asking again does no work at all.
    _, ctx3 = run_layers(fp32_run["store"], fp32_run["tokens"], [1, 5], fp32_run["cache"])
    assert ctx3.work_done == [] and fp32_run["target"].layers_executed == layers2


def test_final_state_is_its_own_artifact_after_the_norm_in_the_same_forward(fp32_run, tiny_target):
    """Issue 32 point 3: layer "final" (the state after the final norm, what the lm_head reads) is keyed
    apart (the layers' keys do not change with it), computed in the same pass as a missing layer (every
    decoder layer once, the norm, never the lm_head), equal to transformers' normed last hidden state
    bit for bit in fp32, and listed as "final (post-norm)"."""
    import torch
    from transformers import AutoModelForCausalLM

    from runner.stages import hidden_states as hs
    from runner.stages.hidden_states import read_layer

    store, tok, target = fp32_run["store"], fp32_run["tokens"], fp32_run["target"]
    ctx = RunContext(store, EvalOptions(layers=[2], backend="torch", device="cpu", dtype="float32", progress=False),
                     argv=["run", "hidden-states"])
    without = hs.build(ctx, tok, hs.requested_layers(ctx, []))
    calls, executed = [], target.layers_executed
    hooks = [m.register_forward_hook(lambda *a, name=name: calls.append(name))
             for name, m in (("norm", target.base.norm), ("lm_head", target.model.lm_head))]
    try:
        nodes, ctx2 = run_layers(store, tok, [2], fp32_run["cache"], final_state=True)
    finally:
        for h in hooks:
            h.remove()
    assert list(nodes) == [2, "final"] and nodes[2].key == without[2].key
    assert nodes["final"].inputs["layer"] == "final" and nodes["final"].label == "hidden_states[final]"
    assert ctx2.work_done == [nodes[2].key, nodes["final"].key]
    batches = (target.layers_executed - executed) // 6
    assert target.layers_executed - executed == 6 * batches and calls == ["norm"] * batches  # one pass, no lm_head
    m = next(iter(segments_of(store, nodes["final"]).values()))
    assert "layer final (post-norm)" in m.summary
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    samples, offs = samples_of(store, tok)
    stored = read_layer(store, nodes["final"])
    with torch.no_grad():
        for i in (0, 4):
            out = ref(input_ids=torch.from_numpy(samples[i].astype(np.int64))[None], output_hidden_states=True)
            assert torch.equal(stored[offs[i]:offs[i + 1]], out.hidden_states[-1][0])  # normed
            assert torch.equal(ref.lm_head(stored[offs[i]:offs[i + 1]]), out.logits[0])


def test_manifest_records_backend_layer_and_what_was_bound(fp32_run):
    segs = segments_of(fp32_run["store"], fp32_run["second"][5])
    assert len(segs) == 1  # every sample of the set in one segment (default segment size)
    m = next(iter(segs.values()))
    assert m.stage == "hidden_states" and m.inputs["layer"] == 5
    assert m.inputs["backend"] == {"kernel": "torch", "device": "cpu", "dtype": "float32",
                                   "attn_implementation": "sdpa"}
    assert m.samples["partition_upstream"] == {"sample": fp32_run["tokens"].partition.key}
    assert sorted(m.samples["keys"]) == sorted(fp32_run["second"][5].sample_keys)
    assert m.arrays["hidden"].dtype == "float32" and m.arrays["hidden"].shape == [sum(LENGTHS), 128]
    bound = m.provenance["bound"]
    assert bound["torch_chunk_gated_delta_rule"].startswith("transformers.models.qwen3_5.")
    assert m.provenance["versions"]["torch"] and m.provenance["versions"]["transformers"]
    assert fp32_run["store"].verify(m.key) == []


def test_no_hub_kernel_can_stand_in_for_the_keyed_functions(fp32_run):
    # transformers >= 5.25 (with `kernels`) kernelizes by default and turns the kernel functions
    # into hub-dispatching modules; the target must be loaded without kernelizing and run plain
    # functions only (with 5.24 both hold trivially).
    target = fp32_run["target"]
    assert not getattr(target.model, "use_kernels", False)
    target.rebind()
    hub = [n for n, v in vars(target.modeling_module).items() if hasattr(type(v), "kernel_layer_name")]
    assert hub == []
    assert sorted(target.bound) == ["causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
                                    "torch_recurrent_gated_delta_rule"]


def test_bf16_keeps_the_model_dtype_and_has_its_own_key(fp32_run, tiny_target, tmp_path):
    import torch

    from runner.stages.hidden_states import read_layer

    store = fp32_run["store"]
    nodes, _ = run_layers(store, fp32_run["tokens"], [5], None, dtype="bfloat16", compression="zstd")
    m = next(iter(segments_of(store, nodes[5]).values()))
    assert nodes[5].partition.key != fp32_run["second"][5].partition.key
    assert m.arrays["hidden"].dtype == "bfloat16" and m.arrays["hidden"].codec == "zstd"
    t = read_layer(store, nodes[5])
    assert t.dtype == torch.bfloat16
    f32 = read_layer(store, fp32_run["second"][5])
    rel = ((t.float() - f32).norm() / f32.norm()).item()
    assert 0 < rel < 0.05


def test_interrupted_extraction_keeps_committed_segments_and_computes_only_the_rest(fp32_run, tiny_target,
                                                                                  tmp_path, monkeypatch):
    """Segments of ~3 samples; stop after 2 committed segments: they stay, and the next run
    computes only the other samples, bit-identically to the uninterrupted extraction."""
    from runner.stages import hidden_states as hs

    monkeypatch.setenv("DFCACHE_SEGMENT_BYTES", str(100 * 128 * 4))  # ~100 tokens of fp32 rows a segment
    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    assert tok.key == fp32_run["tokens"].key
    cache = RunCache()
    done_at = {}

    def stop_after_two(segment, tokens_done):
        if segment == 1:
            done_at["tokens"] = tokens_done
            raise KeyboardInterrupt  # what Ctrl-C does; a kill loses the segment in flight only

    with pytest.raises(KeyboardInterrupt):
        run_layers(store, tok, [1, 3], cache, RunHooks(on_extract_checkpoint=stop_after_two))
    nodes = fp32_run["first"]
    kept = done_at["tokens"]
    assert 0 < kept < sum(LENGTHS)
    from dfcache.samples import index_of

    have = {k: len(index_of(open_store(store.url)).partition(nodes[k].partition.key)) for k in (1, 3)}
    assert have[1] == have[3] and 0 < have[1] < len(LENGTHS)
    target = loaded_target(cache)
    before = target.tokens_forwarded
    again, ctx = run_layers(open_store(store.url), tok, [1, 3], cache)
    assert {k: again[k].samples_dict()["cached"] for k in (1, 3)} == have
    assert target.tokens_forwarded - before == sum(LENGTHS) - kept
    for k in (1, 3):  # same bytes as the uninterrupted extraction
        assert all(np.array_equal(a, b) for a, b in zip(states_of(store, again[k]),
                                                        states_of(fp32_run["store"], nodes[k])))
        assert all(open_store(store.url).verify(s) == [] for s in segments_of(store, again[k]))


def test_interrupted_layers_then_more_layers(fp32_run, tiny_target, tmp_path, monkeypatch):
    """Layers 1,3 interrupted midway, then {1,3,5}: layer 5 computes every sample; 1 and 3 only
    the samples they lack (in the same forward passes as layer 5)."""
    from runner.stages import hidden_states as hs

    monkeypatch.setenv("DFCACHE_SEGMENT_BYTES", str(100 * 128 * 4))
    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    cache = RunCache()

    def stop(segment, tokens_done):
        if segment == 2:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run_layers(store, tok, [1, 3], cache, RunHooks(on_extract_checkpoint=stop))
    target = loaded_target(cache)
    before = target.tokens_forwarded
    nodes, ctx = run_layers(open_store(store.url), tok, [1, 3, 5], cache)
    assert sorted(ctx.work_done) == sorted(n.key for n in nodes.values())
    assert target.tokens_forwarded - before == sum(LENGTHS)  # one pass per sample, all layers it lacks
    for k in (1, 3, 5):
        assert all(np.array_equal(a, b) for a, b in zip(states_of(store, nodes[k]),
                                                        states_of(fp32_run["store"], fp32_run["second"][k])))


def test_subset_superset_and_order_reuse_every_sample(fp32_run, tiny_target, tmp_path):
    """A set of 4 samples, then the 5-sample superset: the plan shows 4 cached and 1 missing in
    every layer, the run computes only that sample, and the states equal extracting all 5 at
    once, bit for bit; any subset or order of them is then fully cached."""
    from runner.core.graph import RunContext, resolve
    from runner.stages import hidden_states as hs

    lengths = LENGTHS[:5]
    five = write_tokens(open_store(tmp_path / "all"), tiny_target, lengths)
    at_once, _ = run_layers(open_store(tmp_path / "all"), five, [1, 3], None)
    store = open_store(tmp_path / "store")
    four = subset(write_tokens(store, tiny_target, lengths), [0, 1, 2, 3])
    cache = RunCache()
    run_layers(store, four, [1, 3], cache)
    target = loaded_target(cache)
    before = target.tokens_forwarded
    ctx = RunContext(open_store(store.url), EvalOptions(layers=[1, 3], backend="torch", device="cpu",
                                                        dtype="float32", progress=False), argv=[])
    planned = resolve(ctx, list(hs.build(ctx, five, [1, 3]).values()))
    assert [(n.samples_dict()["cached"], n.samples_dict()["missing"]) for n in planned] == [(4, 1), (4, 1)]
    nodes, ctx = run_layers(open_store(store.url), five, [1, 3], cache)
    assert target.tokens_forwarded - before == lengths[4]
    assert [n.samples_dict()["produced"] for n in nodes.values()] == [1, 1]
    for k in (1, 3):
        assert all(np.array_equal(a, b) for a, b in zip(states_of(store, nodes[k]),
                                                        states_of(open_store(tmp_path / "all"), at_once[k])))
    for order in ([4, 2], [3, 1, 0, 4, 2]):
        again, ctx = run_layers(open_store(store.url), subset(five, order), [1, 3], cache)
        assert ctx.work_done == [] and all(n.status == "cached" for n in again.values())


def subset(node, positions):
    return Node.make_samples(node.stage, node.version, inputs=node.inputs,
                             upstream_samples=[node.upstream_samples[i] for i in positions],
                             ids=[node.ids[i] for i in positions], needs=node.needs, spec=node.spec,
                             label=node.label)


def test_layer_out_of_range_names_the_depth(fp32_run):
    from runner.stages import hidden_states as hs

    ctx = RunContext(fp32_run["store"], EvalOptions(layers=[6], backend="torch", device="cpu"), argv=[])
    with pytest.raises(BadInputError, match=r"layer id 6 is out of range: the target has 6 decoder layers"):
        hs.build(ctx, fp32_run["tokens"], [1, 6])


def test_requested_layers_union_and_missing(fp32_run):
    from runner.stages import hidden_states as hs

    class D:
        def __init__(self, ids):
            self.target_layer_ids = ids

    ctx = RunContext(fp32_run["store"], EvalOptions(), argv=[])
    assert hs.requested_layers(ctx, [D([1, 3]), D([3, 5])]) == [1, 3, 5]
    ctx.options.layers = [0]
    assert hs.requested_layers(ctx, [D([2])]) == [0, 2]
    ctx.options.layers = None
    with pytest.raises(BadInputError, match="no hidden-state layers requested"):
        hs.requested_layers(ctx, [])


def test_fla_backend_without_cuda_is_bad_input(fp32_run):
    from runner.models.target import resolve_kernel
    from runner.stages import hidden_states as hs

    with pytest.raises(BadInputError, match="--backend fla .* need a CUDA GPU") as e:
        resolve_kernel("fla", "auto", "bfloat16")
    assert e.value.exit_code == 6 and "--backend torch" in str(e.value)
    with pytest.raises(BadInputError, match="--backend fla with --device cpu"):
        resolve_kernel("fla", "cpu", "bfloat16", check=False)
    with pytest.raises(BadInputError, match="--device cuda: no CUDA GPU"):
        resolve_kernel("torch", "cuda", "bfloat16")
    ctx = RunContext(fp32_run["store"], EvalOptions(layers=[1], backend="fla"), argv=[])
    with pytest.raises(BadInputError, match=r"12 sample\(s\) of hidden_states\[1\] are in no store and cannot be "
                                            r"computed here\. \(hidden states for fla/cuda/bfloat16/sdpa\) --backend fla"):
        resolve(ctx, list(hs.build(ctx, fp32_run["tokens"], [1]).values()))
    # auto on a machine without a GPU is the torch fallback on cpu
    b = resolve_kernel("auto", "auto", "bfloat16")
    assert (b.kernel, b.device) == ("torch", "cpu")


def test_fla_states_stored_elsewhere_are_used_on_a_cpu_machine(fp32_run, tiny_target, tmp_path):
    """States extracted with fla on a GPU machine (here: written at the keys the recipe gives)
    are found by a CPU-only plan with --backend fla; nothing needs computing."""
    from dfcache.samples import Partition, SampleArray, SampleSink
    from runner.stages import hidden_states as hs

    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    fla = {"kernel": "fla", "device": "cuda", "dtype": "bfloat16", "attn_implementation": "sdpa"}
    parts = {}
    for k in (1, 3):
        inputs = {"target": tok.inputs["target"], "layer": k, "backend": fla}
        parts[k] = Partition("hidden_states", hs.VERSION, inputs, {"sample": tok.partition.key})
        with SampleSink(store, parts[k], arrays={"hidden": SampleArray((128,), "bfloat16")}, doc=False) as sink:
            for u, n in zip(tok.sample_keys, LENGTHS):  # a state is made from a tokens sample
                sink.add(u, {"hidden": np.zeros((n, 128), np.uint16)})
    ctx = RunContext(store, EvalOptions(layers=[1, 3], backend="fla"), argv=[])
    nodes = hs.build(ctx, tok, [1, 3])
    assert {k: n.partition.key for k, n in nodes.items()} == {k: p.key for k, p in parts.items()}
    resolve(ctx, list(nodes.values()))
    assert all(n.status == "cached" and n.needs == "gpu" for n in nodes.values())


# A permissive stand-in for triton: `import fla.ops.gated_delta_rule` succeeds, so transformers
# binds fla's kernels at import (as with a real triton on a CPU machine), and launching a kernel
# raises the error real triton gives without a GPU driver.
STUB_TRITON = '''
import importlib.abc, importlib.machinery, inspect, sys, types

_CLASSES = {}

def _attr(owner, k):
    if k.startswith("__") and k.endswith("__"):
        raise AttributeError(k)
    name = f"{owner}.{k}"
    if k[:1].isupper() and not k.isupper():
        if name not in _CLASSES:
            _CLASSES[name] = type(k, (_Base,), {})
        return _CLASSES[name]
    return _Any(name)

class _Base:
    def __init__(self, *a, **k): pass
    def __getattr__(self, k): return _attr(type(self).__name__, k)

class _JIT:
    def __init__(self, fn):
        self.fn, self.arg_names = fn, list(inspect.signature(fn).parameters)
        self.__name__ = getattr(fn, "__name__", "kernel")
    def __getitem__(self, grid):
        def launch(*a, **k):
            raise RuntimeError("0 active drivers ([]). There should only be one.")
        return launch
    def __getattr__(self, k): return _attr("jit", k)

class _Any:
    def __init__(self, name): self._name = name
    def __getattr__(self, k): return _attr(self._name, k)
    def __call__(self, *a, **k):
        if self._name.startswith("triton.runtime.driver"):
            raise RuntimeError("0 active drivers ([]). There should only be one.")
        if self._name.endswith(".jit"):
            return _JIT(a[0]) if a and callable(a[0]) else (lambda fn: _JIT(fn))
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]
        return _Any(self._name + "()")
    def __getitem__(self, k): return _Any(self._name + "[]")
    def __iter__(self): return iter(())
    def __bool__(self): return False
    def __int__(self): return 0
    def __index__(self): return 0
    def __float__(self): return 0.0
    def __str__(self): return "0"
    def __eq__(self, o): return False
    def __hash__(self): return id(self)
    def __lt__(self, o): return False
    __le__ = __gt__ = __ge__ = __lt__
    def __or__(self, o): return self
    __ror__ = __and__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __or__
    def __mro_entries__(self, bases): return (_Base,)

class _Mod(types.ModuleType):
    def __getattr__(self, k): return _attr(self.__name__, k)

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = _Mod(spec.name); m.__path__ = []; return m
    def exec_module(self, module): pass

sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Mod
__version__ = "3.4.0"
'''

CHILD = '''
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
# transformers >= 5.25 sends CPU inputs to the torch function itself (a device list per package,
# read when the modeling module is imported); without it the wrapper calls fla whatever the device,
# as 5.24's does, which is the case dfcache's torch binding must withstand.
import transformers.integrations.hub_kernels as hub_kernels
getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {}).pop("fla", None)
import transformers.models.qwen3_5.modeling_qwen3_5 as mq
from dfcache import open_store
from runner.core.graph import Node, RunCache, RunContext, RunHooks, resolve
from runner.core.pipeline import execute
from runner.models.target import implementation_of, resolve_kernel
from runner.core.options import EvalOptions
from runner.stages import hidden_states as hs

store_dir, target_dir = sys.argv[1:3]
from tests.test_hidden_states import write_tokens
# control: with triton importable, transformers bound fla's kernel at import time
control = implementation_of(mq.torch_chunk_gated_delta_rule).__module__
auto = resolve_kernel("auto", "auto", "float32")
store = open_store(store_dir)
tok = write_tokens(store, target_dir)
ctx = RunContext(store, EvalOptions(layers=[1, 3], backend="torch", device="cpu", dtype="float32",
                                    batch_tokens=64, progress=False), argv=[])
nodes = list(hs.build(ctx, tok, [1, 3]).values())
resolve(ctx, nodes)
execute(ctx, nodes)
(target,) = ctx.cache.targets.values()
fla_forward = "ran"
try:  # prove fla's kernel would have run (and failed) had dfcache not rebound the torch path
    import traceback
    from runner.models.target import bind_kernels
    bind_kernels(mq, "fla")
    target.model(input_ids=torch.tensor([[5, 6, 7, 8]]))
except Exception as e:
    frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
    fla_forward = "failed in fla" if any("/fla/ops/" in f for f in frames) else f"failed: {e!r}"
print(json.dumps({"control": control, "auto": [auto.kernel, auto.device],
                  "parts": {n.spec.layer: n.partition.key for n in nodes}, "fla_forward": fla_forward}))
'''


def test_torch_backend_is_enforced_even_when_fla_and_triton_import(fp32_run, tiny_target, tmp_path):
    stub = tmp_path / "stub" / "triton"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(STUB_TRITON)
    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), str(REPO)]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path / "store"),
                        str(tiny_target)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["control"].startswith("fla.ops.gated_delta_rule")
    assert out["auto"] == ["torch", "cpu"]
    assert out["fla_forward"] == "failed in fla"
    from dfcache.samples import index_of

    for layer, part in out["parts"].items():
        (m,) = index_of(open_store(store.url)).segments(part).values()
        assert m.inputs["backend"]["kernel"] == "torch"
        assert m.provenance["bound"]["torch_chunk_gated_delta_rule"].startswith("transformers.")
        assert m.provenance["versions"].get("triton") is None  # a stub, not an installed triton
        # the same bytes as the extraction in a process without triton (same samples: same segment key)
        assert m.arrays["hidden"].digest == fp32_run["store"].manifest(m.key).arrays["hidden"].digest


def test_planning_imports_no_torch(fp32_run, tiny_target):
    code = textwrap.dedent('''
        import sys
        from dfcache import open_store
        from runner.core.graph import Node, RunContext, resolve
        from runner.core.options import EvalOptions
        from runner.stages import hidden_states as hs
        from tests.test_hidden_states import write_tokens
        store = open_store(sys.argv[1])
        tok = write_tokens(store, sys.argv[2])
        ctx = RunContext(store, EvalOptions(layers=[1, 3, 5], dtype="float32", progress=False), argv=[])
        nodes = hs.build(ctx, tok, hs.requested_layers(ctx, []))
        resolve(ctx, list(nodes.values()))
        assert all(n.status == "cached" for n in nodes.values()), [n.status for n in nodes.values()]
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        print("ok")
    ''')
    p = subprocess.run([sys.executable, "-c", code, str(fp32_run["store"].url),
                        str(tiny_target)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
