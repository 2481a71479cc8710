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
from runner.graph import Node, RunCache, RunContext, RunHooks, resolve
from runner.options import EvalOptions
from runner.pipeline import execute

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
    """A tokens artifact with the names and layout of the tokens stage; returns its node."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(3, 500, n) for n in lengths]).astype(np.int32)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    fp = fingerprint_path(target_dir)
    node = Node.make("tokens", 1, inputs={"target": fp, "tokenizer": fp, "seed": seed}, needs="cpu",
                     payload={"target_dir": str(target_dir)}, label="tokens")
    if not store.has(node.key):
        with store.writer(node.key, stage="tokens", stage_version=1, inputs=node.inputs) as w:
            w.write_array("token_ids", ids)
            w.write_array("offsets", offsets)
            w.write_array("prompt_lens", np.full(len(lengths), 3, np.int32))
            w.put_json("samples", [{"id": str(i)} for i in range(len(lengths))])
    return node


def samples_of(store, tokens_key):
    art = store.open(tokens_key)
    ids, offs = art.array("token_ids").read(), art.array("offsets").read()
    return [ids[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)], offs


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
    samples, offs = samples_of(store, fp32_run["tokens"].key)
    with torch.no_grad():
        normed = [ref(input_ids=torch.from_numpy(s.astype(np.int64))[None], output_hidden_states=True)
                  .hidden_states[-1][0] for s in samples]
        ref.config.tie_last_hidden_states = False  # hidden_states[L]: the raw last-layer output
        plain = [ref(input_ids=torch.from_numpy(s.astype(np.int64))[None], output_hidden_states=True)
                 .hidden_states for s in samples]
    for k in (1, 3, 5):
        stored = read_layer(store, nodes[k].key)
        assert stored.dtype == torch.float32 and tuple(stored.shape) == (int(offs[-1]), 128)
        for i, hs in enumerate(plain):
            assert torch.equal(stored[offs[i]:offs[i + 1]], hs[k + 1][0]), (k, i)
    # Layer 5 is the last one: stored before the final norm, which HF applies to hidden_states[-1].
    last = read_layer(store, nodes[5].key)
    assert not torch.equal(last[: len(samples[0])], normed[0])
    # A row range reads only its rows.
    assert torch.equal(read_layer(store, nodes[3].key, offs[2], offs[3]), plain[2][4][0])


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


def test_manifest_records_backend_layer_and_what_was_bound(fp32_run):
    m = fp32_run["store"].manifest(fp32_run["second"][5].key)
    assert m.stage == "hidden_states" and m.inputs["layer"] == 5
    assert m.inputs["backend"] == {"kernel": "torch", "device": "cpu", "dtype": "float32",
                                   "attn_implementation": "sdpa"}
    assert m.upstream == {"tokens": fp32_run["tokens"].key}
    assert m.arrays["hidden"].dtype == "float32" and m.arrays["hidden"].shape == [sum(LENGTHS), 128]
    bound = m.provenance["bound"]
    assert bound["torch_chunk_gated_delta_rule"].startswith("transformers.models.qwen3_5.")
    assert m.provenance["versions"]["torch"] and m.provenance["versions"]["transformers"]
    assert fp32_run["store"].verify(m.key) == []


def test_bf16_keeps_the_model_dtype_and_has_its_own_key(fp32_run, tiny_target, tmp_path):
    import torch

    from runner.stages.hidden_states import read_layer

    store = fp32_run["store"]
    nodes, _ = run_layers(store, fp32_run["tokens"], [5], RunCache(), dtype="bfloat16", compression="zstd")
    m = store.manifest(nodes[5].key)
    assert nodes[5].key != fp32_run["second"][5].key
    assert m.arrays["hidden"].dtype == "bfloat16" and m.arrays["hidden"].codec == "zstd"
    t = read_layer(store, nodes[5].key)
    assert t.dtype == torch.bfloat16
    f32 = read_layer(store, fp32_run["second"][5].key)
    rel = ((t.float() - f32).norm() / f32.norm()).item()
    assert 0 < rel < 0.05


def test_interrupted_extraction_resumes_without_recomputing(fp32_run, tiny_target, tmp_path):
    """Stop after 2 checkpointed windows; the next run computes only the rest, bit-identically."""
    from runner.stages import hidden_states as hs

    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    assert tok.key == fp32_run["tokens"].key
    cache = RunCache()
    done_at = {}

    def stop_after_two(window, tokens_done):
        if window == 1:
            done_at["tokens"] = tokens_done
            raise KeyboardInterrupt  # what Ctrl-C does; a crash leaves the same staging

    with pytest.raises(KeyboardInterrupt):
        run_layers(store, tok, [1, 3], cache, RunHooks(on_extract_checkpoint=stop_after_two))
    nodes = fp32_run["first"]
    assert not store.has(nodes[1].key) and not store.has(nodes[3].key)
    kept = done_at["tokens"]
    assert 0 < kept < sum(LENGTHS)
    target = loaded_target(cache)
    before = target.tokens_forwarded
    _, ctx = run_layers(store, tok, [1, 3], cache)
    assert target.tokens_forwarded - before == sum(LENGTHS) - kept
    assert ctx.last_extract_stats.tokens_resumed == kept
    for k in (1, 3):  # same bytes as the uninterrupted extraction
        assert store.manifest(nodes[k].key).arrays["hidden"].digest == \
            fp32_run["store"].manifest(nodes[k].key).arrays["hidden"].digest


def test_resume_with_layers_at_different_points(fp32_run, tiny_target, tmp_path):
    """Layers 1,3 interrupted midway, then {1,3,5}: layer 5 starts at 0, 1 and 3 keep their rows."""
    from runner.stages import hidden_states as hs

    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    cache = RunCache()

    def stop(window, tokens_done):
        if window == 2:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run_layers(store, tok, [1, 3], cache, RunHooks(on_extract_checkpoint=stop))
    nodes, ctx = run_layers(store, tok, [1, 3, 5], cache)
    assert sorted(ctx.work_done) == sorted(n.key for n in nodes.values())
    for k in (1, 3, 5):
        assert store.manifest(nodes[k].key).arrays["hidden"].digest == \
            fp32_run["store"].manifest(fp32_run["second"][k].key).arrays["hidden"].digest
        assert store.verify(nodes[k].key) == []


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
    with pytest.raises(BadInputError, match=r"layer\(s\) 1 for fla/cuda/bfloat16/sdpa are not in the store "
                                            r"and cannot be computed here\. --backend fla"):
        hs.build(ctx, fp32_run["tokens"], [1])
    # auto on a machine without a GPU is the torch fallback on cpu
    b = resolve_kernel("auto", "auto", "bfloat16")
    assert (b.kernel, b.device) == ("torch", "cpu")


def test_fla_states_stored_elsewhere_are_used_on_a_cpu_machine(fp32_run, tiny_target, tmp_path):
    """States extracted with fla on a GPU machine (here: written at the keys the recipe gives)
    are found by a CPU-only plan with --backend fla; nothing needs computing."""
    from dfcache import compute_key
    from runner.stages import hidden_states as hs

    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    fla = {"kernel": "fla", "device": "cuda", "dtype": "bfloat16", "attn_implementation": "sdpa"}
    keys = {}
    for k in (1, 3):
        inputs = {"target": tok.inputs["target"], "layer": k, "backend": fla}
        keys[k] = compute_key("hidden_states", hs.VERSION, inputs, {"tokens": tok.key})
        with store.writer(keys[k], stage="hidden_states", stage_version=hs.VERSION, inputs=inputs,
                          upstream={"tokens": tok.key}) as w:
            w.write_array("hidden", np.zeros((sum(LENGTHS), 128), np.uint16), dtype="bfloat16")
    ctx = RunContext(store, EvalOptions(layers=[1, 3], backend="fla"), argv=[])
    nodes = hs.build(ctx, tok, [1, 3])
    assert {k: n.key for k, n in nodes.items()} == keys
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
import transformers.models.qwen3_5.modeling_qwen3_5 as mq
from dfcache import open_store
from runner.graph import Node, RunContext, resolve
from runner.pipeline import execute
from runner.models.target import implementation_of, resolve_kernel
from runner.options import EvalOptions
from runner.stages import hidden_states as hs

store_dir, tokens_key, target_dir = sys.argv[1:4]
# control: with triton importable, transformers bound fla's kernel at import time
control = implementation_of(mq.torch_chunk_gated_delta_rule).__module__
auto = resolve_kernel("auto", "auto", "float32")
store = open_store(store_dir)
tok = Node(stage="tokens", key=tokens_key, needs="cpu", inputs=store.manifest(tokens_key).inputs,
           upstream={}, version=1, payload={"target_dir": target_dir})
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
                  "keys": {n.payload["layer"]: n.key for n in nodes}, "fla_forward": fla_forward}))
'''


def test_torch_backend_is_enforced_even_when_fla_and_triton_import(fp32_run, tiny_target, tmp_path):
    stub = tmp_path / "stub" / "triton"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(STUB_TRITON)
    store = open_store(tmp_path / "store")
    tok = write_tokens(store, tiny_target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), str(REPO)]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path / "store"), tok.key,
                        str(tiny_target)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["control"].startswith("fla.ops.gated_delta_rule")
    assert out["auto"] == ["torch", "cpu"]
    assert out["fla_forward"] == "failed in fla"
    for layer, key in out["keys"].items():
        m = store.manifest(key)
        assert m.inputs["backend"]["kernel"] == "torch"
        assert m.provenance["bound"]["torch_chunk_gated_delta_rule"].startswith("transformers.")
        assert m.provenance["versions"].get("triton") is None  # a stub, not an installed triton
        # the same bytes as the extraction in a process without triton
        assert m.arrays["hidden"].digest == fp32_run["store"].manifest(key).arrays["hidden"].digest


def test_planning_imports_no_torch(fp32_run, tiny_target):
    code = textwrap.dedent('''
        import sys
        from dfcache import open_store
        from runner.graph import Node, RunContext, resolve
        from runner.options import EvalOptions
        from runner.stages import hidden_states as hs
        store = open_store(sys.argv[1])
        tok = Node(stage="tokens", key=sys.argv[2], needs="cpu", inputs=store.manifest(sys.argv[2]).inputs,
                   upstream={}, version=1, payload={"target_dir": sys.argv[3]})
        ctx = RunContext(store, EvalOptions(layers=[1, 3, 5], dtype="float32", progress=False), argv=[])
        nodes = hs.build(ctx, tok, hs.requested_layers(ctx, []))
        resolve(ctx, list(nodes.values()))
        assert all(n.status == "cached" for n in nodes.values()), [n.status for n in nodes.values()]
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        print("ok")
    ''')
    p = subprocess.run([sys.executable, "-c", code, str(fp32_run["store"].url), fp32_run["tokens"].key,
                        str(tiny_target)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
