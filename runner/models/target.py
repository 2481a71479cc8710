"""The target model for hidden-state extraction: backend resolution, loading, truncated forwards.

Two halves with different import rules:

* Planning (:func:`resolve_kernel`, :func:`read_model_info`, :func:`cuda_visible`) reads files
  and package metadata only. It never imports torch or transformers, because a fully cached run
  must not pay for (or depend on) them.
* Producing (:func:`load_target`, :class:`TargetModel`) loads the model with transformers'
  ``AutoModelForCausalLM`` (Qwen3.5/3.6 ``qwen3_5``/``qwen3_5_text``, Qwen3-Next, plain
  Qwen3/Llama-style models) from a local directory, in bf16 or fp32.

Backend class (key material, see DESIGN §3): kernel family (``fla`` | ``torch``), device type
(``cuda`` | ``cpu``), dtype, attention implementation. Exact versions are provenance.

How kernels get bound (shared/reference/stack-notes.md §1): transformers decides, once, when it
imports a modeling module, whether ``torch_chunk_gated_delta_rule`` and friends call fla's Triton
kernels or the pure-PyTorch reference; it checks not whether triton works, nor (up to 5.24) the
device (5.25 sends CPU inputs to the reference itself). So
dfcache enforces the requested family itself: ``torch`` rebinds the module's functions to their
``__wrapped__`` PyTorch originals (works even after fla was bound, and with a broken or stub
triton), ``fla`` restores the wrappers and requires that they really call ``fla.*``. The binding
is re-applied before every forward pass, because the module globals are process-wide and another
target in the same process may have rebound them. What is really bound (read from the wrapper's
closure) is verified and recorded. Hub kernels (transformers >= 5.25 with ``kernels``) never run
and nothing is fetched: see "Hub kernels" below.

Layer semantics: layer id ``k`` is the output of decoder layer ``k`` (Hugging Face
``hidden_states[k+1]``), before the final norm, including the last layer. The forward pass stops
right after the deepest requested layer (an exception from a forward hook), so neither the layers
after it, nor the final norm, nor the lm_head are computed. Layer id ``FINAL`` ("final") is the
state after the final norm (what the lm_head reads); asking for it runs every layer and the norm,
in the same forward as the other layers, and still not the lm_head.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from dfcache.errors import BadInputError, ModelNotFoundError, UsageError

from ..core.worker import Worker, device_for

# The values of --backend, --device, --dtype and --attn-implementation (declared with the options).
from ..core.options import ATTN_IMPLEMENTATIONS as ATTN_CHOICES  # noqa: E402
from ..core.options import DEVICES as DEVICE_CHOICES  # noqa: E402
from ..core.options import DTYPES as DTYPE_CHOICES  # noqa: E402
from ..core.options import KERNELS as KERNEL_CHOICES  # noqa: E402

# Model types whose layers include gated-DeltaNet linear attention when the config has no
# ``layer_types`` list (hub checkpoints of Qwen3-Next give only ``full_attention_interval``).
LINEAR_ATTENTION_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                                          "qwen3_next"})


# ----------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class KernelSpec:
    """How the target runs: what changes the numerics of hidden states by design; every field is
    key material. (Keys and manifests call it ``backend``, the name it had first: renaming the
    field would change every key. In dfcache, "backend" means a storage backend.)"""

    kernel: str  # fla | torch
    device: str  # cuda | cpu
    dtype: str  # bfloat16 | float32
    attn_implementation: str  # sdpa | eager | ...
    note: str = field(default="", compare=False)  # why auto/fla resolved as it did (never keyed)

    def to_key(self) -> dict:
        d = asdict(self)
        d.pop("note")
        return d

    @classmethod
    def from_key(cls, backend: dict) -> "KernelSpec":
        """The class of a hidden-state key's ``backend``, whose ``states`` (a lossy codec such as
        fp8-e4m3, keyed there: dfcache/fp8.py) is how the rows were stored, not how the target ran."""
        return cls(**{k: v for k, v in backend.items() if k != "states"})

    @property
    def label(self) -> str:
        return f"{self.kernel}/{self.device}/{self.dtype}/{self.attn_implementation}"


@dataclass(frozen=True)
class ModelInfo:
    """What planning needs from a target's config.json (read as JSON, no transformers)."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int | None
    has_linear_attention: bool
    max_positions: int | None = None  # max_position_embeddings: the context window, when config.json says


def read_model_info(target_dir: str | os.PathLike) -> ModelInfo:
    """Depth, width and attention kinds of the target, from its config.json."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{path} does not exist; pass a model directory that holds config.json "
                                 "and the weights with --target.")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise BadInputError(f"{path} is not valid JSON ({e}); repair or re-download the model.") from None
    if not isinstance(cfg, dict):
        from ..core.values import json_kind

        raise BadInputError(f"{path} is a JSON {json_kind(cfg)}, not an object; a model's config.json is one "
                            "object of its settings: repair or re-download the model.")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    model_type = str(cfg.get("model_type") or text.get("model_type") or "")
    layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    if not isinstance(layers, int) or layers < 1 or not isinstance(hidden, int) or hidden < 1:
        raise BadInputError(f"{path} has no usable num_hidden_layers/hidden_size; pass a decoder-only "
                            "causal LM directory (Qwen3.5/3.6, Qwen3-Next, Qwen3, Llama-style).")
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        linear = "linear_attention" in types
    else:
        linear = model_type in LINEAR_ATTENTION_MODEL_TYPES or \
            str(text.get("model_type", "")) in LINEAR_ATTENTION_MODEL_TYPES
    vocab = text.get("vocab_size", cfg.get("vocab_size"))
    positions = text.get("max_position_embeddings", cfg.get("max_position_embeddings"))
    return ModelInfo(model_type=model_type, num_layers=layers, hidden_size=hidden,
                     vocab_size=vocab if isinstance(vocab, int) else None, has_linear_attention=linear,
                     max_positions=positions if isinstance(positions, int) and positions > 0 else None)


def _torch_build() -> dict:
    """torch's build flags (``cuda``, ``hip``, ``__version__``) from torch/version.py, unimported."""
    mod = sys.modules.get("torch")
    if mod is not None and getattr(mod, "version", None) is not None:
        v = mod.version
        return {"__version__": getattr(v, "__version__", None), "cuda": getattr(v, "cuda", None),
                "hip": getattr(v, "hip", None)}
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return {}
    out: dict = {}
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return out
    for name in ("__version__", "cuda", "hip"):
        m = re.search(rf"^{re.escape(name)}\s*(?::[^=\n]*)?=\s*(.+)$", text, re.M)
        if m:
            try:
                out[name] = ast.literal_eval(m.group(1).strip())
            except (ValueError, SyntaxError):
                pass
    return out


def cuda_visible() -> tuple[bool, str]:
    """Whether a CUDA GPU is usable here, decided without importing torch; and why not."""
    from dfcache.config import cuda_visible_devices

    cvd = cuda_visible_devices()
    if cvd is not None and cvd.strip() in ("", "-1", "none", "NoDevFiles"):
        return False, f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU"
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        # Already imported (a produce step, a script): ask torch itself; this costs no import.
        if torch.cuda.is_available():
            return True, ""
        return False, f"torch {torch.__version__} sees no CUDA GPU"
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/nvidia0")):
        return False, "no NVIDIA driver is visible (/dev/nvidiactl and /proc/driver/nvidia are absent)"
    build = _torch_build()
    if not build:
        return False, "torch is not installed"
    if not build.get("cuda") and not build.get("hip"):
        return False, f"the installed torch {build.get('__version__', '?')} is a CPU-only build"
    return True, ""


def _spec_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[name] is None
        return False


def fla_available() -> tuple[bool, str]:
    """Whether fla's Triton kernels can be imported (package presence only; no import)."""
    missing = [pip for mod, pip in (("fla", "flash-linear-attention"), ("triton", "triton"))
               if not _spec_exists(mod)]
    if missing:
        return False, f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed"
    return True, ""


def resolve_kernel(kernel: str = "auto", device: str = "auto", dtype: str = "bfloat16",
                    attn_implementation: str = "sdpa", *, has_linear_attention: bool = True,
                    check: bool = True) -> KernelSpec:
    """The backend class a run will use, decided at planning time without importing torch.

    ``auto`` device is ``cuda`` when a GPU is visible (always ``cuda`` with ``--backend fla``, the
    only device fla runs on); ``auto`` kernel is ``fla`` on ``cuda`` when fla and triton are
    installed, else ``torch``. A model without linear-attention layers never calls an fla kernel,
    so its kernel family is ``torch`` whatever was asked.

    ``check=True`` raises :class:`BadInputError` (exit 6) when this machine cannot run the class
    (see :func:`kernel_problem`). Planning passes ``check=False``: keys of an explicit class
    must be computable anywhere, so that states extracted with fla on a GPU machine are found
    on a CPU machine; it is computing them here that needs the hardware.
    """
    for what, val, choices in (("--backend", kernel, KERNEL_CHOICES), ("--device", device, DEVICE_CHOICES),
                               ("--dtype", dtype, DTYPE_CHOICES),
                               ("attention implementation", attn_implementation, ATTN_CHOICES)):
        if val not in choices:
            raise UsageError(f"{what} {val!r} is not one of {', '.join(choices)}.")
    if kernel == "fla" and device == "cpu":
        raise BadInputError("--backend fla with --device cpu: flash-linear-attention's Triton kernels run "
                            "only on CUDA GPUs. Use --backend torch for the pure-PyTorch path on the CPU, or "
                            "--device cuda on a machine with a GPU.")
    visible, _ = cuda_visible()
    dev = device if device != "auto" else ("cuda" if visible or kernel == "fla" else "cpu")
    note = ""
    if kernel == "auto":
        fla_ok, fla_why = fla_available()
        k = "fla" if dev == "cuda" and fla_ok else "torch"
        if dev == "cuda" and not fla_ok:
            note = f"--backend auto chose torch on cuda: {fla_why}"
    else:
        k = kernel
    if k == "fla" and not has_linear_attention:
        k = "torch"
        note = "the model has no linear-attention layers, so no fla kernel runs: its states are torch states"
    backend = KernelSpec(kernel=k, device=dev, dtype=dtype, attn_implementation=attn_implementation, note=note)
    if check:
        problem = kernel_problem(backend)
        if problem:
            raise BadInputError(problem)
    return backend


def kernel_problem(backend: KernelSpec) -> str | None:
    """Why this machine cannot compute with ``backend`` (a message ending with the fix), or None."""
    if backend.device == "cuda":
        visible, why_not = cuda_visible()
        if not visible:
            if backend.kernel == "fla":
                return ("--backend fla runs flash-linear-attention's Triton kernels, which need a CUDA GPU, "
                        f"and none is usable here ({why_not}). Use --backend torch for the pure-PyTorch path "
                        "(its states differ numerically and are cached under their own key), or run on a "
                        "machine with a CUDA GPU and share the store (dfcache push/pull).")
            return (f"--device cuda: no CUDA GPU is usable here ({why_not}). Run on a machine with a GPU "
                    "and a CUDA build of torch, or pass --device cpu.")
    if backend.kernel == "fla":
        ok, why = fla_available()
        if not ok:
            return (f"--backend fla: {why}. Install them (pip install flash-linear-attention triton) or "
                    "use --backend torch.")
    return None


def library_versions() -> dict:
    """Exact versions of what shapes the numbers (provenance, never keyed), from package metadata."""
    import importlib.metadata  # here: planning a cached graph reads no metadata (email, zipfile, csv...)

    out = {}
    for dist in ("torch", "transformers", "flash-linear-attention", "fla-core", "triton", "causal-conv1d",
                 "accelerate"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# ------------------------------------------------------------------------------ kernel binding

# Hub kernels (transformers >= 5.25 with the ``kernels`` package, which it now requires): the
# decorators turn each kernel function of a modeling module into a ``kernels`` function module
# (an ``nn.Module`` instance, not a function) that dispatches, through the layer being run, to a
# per-layer copy; ``from_pretrained`` then calls ``kernelize`` by default (``use_kernels``
# defaults to True), which swaps those copies, and decorated classes such as RMSNormGated or the
# whole gated-DeltaNet layer, for kernels downloaded from the Hugging Face Hub
# (kernels-community/fla, mamba-ssm, liger, rotary ... on CUDA). dfcache never downloads at run
# time, and the kernel family is key material: a hub kernel in place of fla's Triton kernels or of
# the PyTorch reference would put other numbers under the same key. So hub kernels are shut out
# twice: load_target passes ``use_kernels=False`` (no kernelize, nothing fetched) and checks that
# it held, and every function of the modeling module is pinned to a plain function: the
# fallback functions to transformers' own wrapper (fla or torch, what we key on) or its
# ``torch_function``, the hub-only ones (5.25's ``causal_conv1d_forward``) to their body, so the
# layers' calls by global name never reach the kernels dispatch even if something kernelizes the
# model later. With 5.24 (no ``kernels``) the decorators leave plain functions and nothing changes.

# (modeling module name, function name) -> transformers' fallback wrapper (unwrapped from a hub
# function module), bound for fla.
_ORIGINAL_WRAPPERS: dict[tuple[str, str], Callable] = {}
# the same key -> the pure-PyTorch function the wrapper falls back to, bound for torch
_TORCH_FUNCTIONS: dict[tuple[str, str], Callable] = {}
# (modeling module name, function name) -> the body of a hub-only function module (bound always)
_HUB_ONLY_FUNCTIONS: dict[tuple[str, str], Callable] = {}
_SCANNED: set[str] = set()


def _hub_function_body(obj: Any) -> Callable | None:
    """The function behind a ``kernels`` function module (what ``use_kernel_forward_from_hub``
    makes of a function when the ``kernels`` package is installed), or None for anything else.
    Its class's ``forward`` closes over the decorated function as ``func``."""
    if inspect.isfunction(obj) or not hasattr(type(obj), "kernel_layer_name"):
        return None
    try:
        func = inspect.getclosurevars(type(obj).forward).nonlocals.get("func")
    except (TypeError, ValueError, AttributeError):
        return None
    return func if inspect.isfunction(func) else None


def _fallback_closure(fn: Any) -> dict | None:
    """The closure of transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper, if ``fn``
    is (or wraps) one: it holds ``implementation`` (what runs) and ``torch_function``."""
    seen = 0
    while fn is not None and seen < 4:
        fn = _hub_function_body(fn) or fn
        try:
            nl = inspect.getclosurevars(fn).nonlocals
        except (TypeError, ValueError):
            nl = {}
        if "implementation" in nl and "torch_function" in nl:
            return nl
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return None


def _scan(module) -> None:
    """Record the module's kernel functions once, before any rebinding, so that the originals are
    transformers' own."""
    name = module.__name__
    if name in _SCANNED:
        return
    for attr, obj in list(vars(module).items()):
        body = _hub_function_body(obj)
        fn = body or obj
        closure = _fallback_closure(fn) if inspect.isfunction(fn) else None
        if closure is not None:
            _ORIGINAL_WRAPPERS[(name, attr)] = fn
            _TORCH_FUNCTIONS[(name, attr)] = closure["torch_function"]
        elif body is not None:
            _HUB_ONLY_FUNCTIONS[(name, attr)] = body
    _SCANNED.add(name)


def kernel_wrappers(module) -> dict[str, Callable]:
    """The functions of a modeling module that transformers bound to an optional kernel package
    (fla's gated delta rule, causal_conv1d), as transformers' fallback wrappers."""
    _scan(module)
    return {attr: w for (mod, attr), w in _ORIGINAL_WRAPPERS.items() if mod == module.__name__}


def implementation_of(fn: Any) -> Any:
    """What a (possibly wrapped) function really calls."""
    nl = _fallback_closure(fn)
    return nl["implementation"] if nl is not None else fn


def apply_binding(module, kernel: str) -> None:
    """Point the module's kernel functions at ``kernel`` (fla|torch): transformers' fallback
    wrappers for fla, their ``torch_function`` (the pure-PyTorch original) for torch; hub-only
    functions at their bodies whatever the kernel."""
    for attr, wrapper in kernel_wrappers(module).items():
        setattr(module, attr, _TORCH_FUNCTIONS[(module.__name__, attr)] if kernel == "torch" else wrapper)
    for (mod, attr), body in _HUB_ONLY_FUNCTIONS.items():
        if mod == module.__name__:
            setattr(module, attr, body)


def bind_kernels(module, kernel: str) -> dict[str, str]:
    """Bind the module's kernel functions to ``kernel``; return name -> what each now calls."""
    apply_binding(module, kernel)
    return bound_kernels(module)


def bound_kernels(module) -> dict[str, str]:
    """name -> module of the implementation each kernel function of ``module`` calls right now."""
    out = {}
    for attr in kernel_wrappers(module):
        impl = implementation_of(getattr(module, attr))
        out[attr] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
    return out


def _is_delta_rule(name: str) -> bool:
    return "delta_rule" in name


# ------------------------------------------------------------------------------------- loading


class _StopForward(Exception):
    """Raised by the hook on the deepest wanted layer: nothing after it is computed."""


class LayerCapture:
    """Forward hooks on decoder layers ``want`` (sorted unique ids into ``layers``) that keep each
    one's output in ``outputs`` and stop the forward right after the deepest.

    ``with LayerCapture(layers, want) as outputs:`` runs the forward; leaving the block removes
    the hooks and swallows the stop, so the caller reads ``outputs`` after it and checks
    ``missing()`` (a model whose forward skips a decoder layer never fills its entry).
    """

    def __init__(self, layers, want: list[int], stop: bool = True) -> None:
        self.layers = layers
        self.want = want
        self.stop = stop  # False: the forward runs on after the deepest (the final state is wanted too)
        self.outputs: dict[int, Any] = {}
        self._handles: list = []

    def _hook(self, i: int, deepest: bool):
        def hook(module, args, output):
            self.outputs[i] = output[0] if isinstance(output, (tuple, list)) else output
            if deepest:
                raise _StopForward

        return hook

    def __enter__(self) -> dict[int, Any]:
        last = self.want[-1] if self.want and self.stop else None
        self._handles = [self.layers[i].register_forward_hook(self._hook(i, i == last)) for i in self.want]
        return self.outputs

    def __exit__(self, exc_type, exc, tb) -> bool:
        for h in self._handles:
            h.remove()
        self._handles = []
        return exc_type is not None and issubclass(exc_type, _StopForward)

    def missing(self) -> list[int]:
        return [i for i in self.want if i not in self.outputs]


class TargetModel:
    """A loaded target, bound to one backend class, that returns selected layer outputs.

    ``layers_executed`` counts decoder-layer forward calls (one per layer per batch) and
    ``tokens_forwarded`` the token positions run through the model; tests read both.
    """

    def __init__(self, model, base, layers, info: ModelInfo, backend: KernelSpec, modeling_module,
                 bound: dict[str, str], provenance: dict, overrides: dict[str, Callable] | None = None) -> None:
        self.model = model
        self.base = base
        self.layers = layers
        self.info = info
        self.num_layers = len(layers)
        self.hidden_size = info.hidden_size
        self.backend = backend
        self.modeling_module = modeling_module
        self.bound = bound
        self.provenance = provenance
        self.layers_executed = 0
        self.tokens_forwarded = 0
        self.overrides = overrides or {}  # exact faster functions bound over the binding's (bind_target)
        import torch

        self.torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[backend.dtype]
        self.device = next(model.parameters()).device  # cuda:N, so streams and copies name it exactly
        for layer in layers:
            layer.register_forward_pre_hook(self._count_layer)

    def _count_layer(self, module, args) -> None:
        self.layers_executed += 1

    def check_layers(self, layers) -> list[int]:
        return check_layer_ids(layers, self.num_layers)

    def rebind(self) -> None:
        """Re-apply this target's kernel binding (module globals are shared by the process)."""
        if self.modeling_module is not None:
            apply_binding(self.modeling_module, self.backend.kernel)
            for name, fn in self.overrides.items():
                setattr(self.modeling_module, name, fn)

    def forward_layers(self, input_ids, layers) -> dict:
        """Outputs of decoder layers ``layers`` for ``input_ids`` [B, T] (no padding: every row is
        a whole sample), each [B, T, H] on the model's device in its dtype. Layers after the
        deepest requested one, the final norm and the lm_head are not computed. ``FINAL`` among
        ``layers``: every layer and the final norm run, and its entry is the base model's
        ``last_hidden_state`` (after the final norm, what the lm_head reads); the lm_head never runs."""
        import torch

        final = FINAL in layers
        want = sorted(set(int(k) for k in layers if k != FINAL))
        if not want and not final:
            return {}
        capture = LayerCapture(self.layers, want, stop=not final)
        with capture as out:
            self.rebind()
            # no_grad, not inference_mode: what transformers itself uses around fla's autograd
            # Functions, and the outputs stay ordinary tensors for the copies that follow.
            with torch.no_grad():
                res = self.base(input_ids=input_ids, use_cache=False)
            if final:
                out[FINAL] = res.last_hidden_state if hasattr(res, "last_hidden_state") else res[0]
        missing = capture.missing()
        if missing:
            raise RuntimeError(f"layers {missing} of {type(self.model).__name__} did not run; the model's "
                               "forward skips decoder layers, which dfcache does not support.")
        self.tokens_forwarded += int(input_ids.numel())
        return out


# The layer id of the target's state after its final norm: what its lm_head reads (SGLang's
# ``last_hidden_states``, HF's ``last_hidden_state`` of the base model), which EAGLE-3's teacher
# (SpecForge's ``hidden_state``) and DSpark's training (``target_last_hidden_states``) read. A string,
# so its hidden-state key (``layer: "final"``) can never equal a decoder layer's, and integer ids keep
# their keys. It sorts after every decoder layer (computing it runs them all).
FINAL = "final"


def layer_order(k) -> tuple[int, int]:
    """Sort key of layer ids: decoder layers by index, then FINAL."""
    return (1, 0) if k == FINAL else (0, int(k))


def sort_layers(layers) -> list:
    return sorted(set(layers), key=layer_order)


def layer_name(k) -> str:
    """How listings name a layer id."""
    return "final (post-norm)" if k == FINAL else str(k)


def layer_of_key(value):
    """The layer id of a hidden-state key's ``layer`` input (an int, or FINAL)."""
    return FINAL if value == FINAL else int(value)


def deepest_run(layers, num_layers: int) -> int:
    """The deepest decoder layer a forward computing ``layers`` runs."""
    return max(num_layers - 1 if k == FINAL else int(k) for k in layers)


def check_layer_ids(layers, num_layers: int) -> list:
    """Sorted unique layer ids, each a valid decoder-layer index of a ``num_layers``-deep model
    (or FINAL, last)."""
    out = set()
    for k in layers:
        if k == FINAL:
            out.add(k)
            continue
        if isinstance(k, bool) or not isinstance(k, int):
            raise BadInputError(f"layer id {k!r} is not an integer; layer ids are decoder-layer indices "
                                f"0..{num_layers - 1}.")
        if not 0 <= k < num_layers:
            raise BadInputError(f"layer id {k} is out of range: the target has {num_layers} decoder layers "
                                f"(ids 0..{num_layers - 1}). Check the drafter's "
                                "dflash_config.target_layer_ids or --layer, and that --target is the model "
                                "the drafter was trained against.")
        out.add(k)
    return sort_layers(out)


def _decoder_stack(model, num_layers: int):
    """(module whose forward runs the decoder layers, its ModuleList of layers)."""
    from torch import nn

    for path in ("model", "model.language_model", "language_model", "transformer", ""):
        owner = model
        try:
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part)
        except AttributeError:
            continue
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
            return owner, layers
    raise BadInputError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}; "
                        "dfcache extracts hidden states from decoder-only models with a `layers` list "
                        "(Qwen3.5/3.6, Qwen3-Next, Qwen3, Llama-style).")


def _check_fla_importable() -> None:
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:
        raise BadInputError(f"--backend fla: fla's gated delta rule kernels do not import ({type(e).__name__}: "
                            f"{e}). Install working flash-linear-attention and triton for this CUDA setup, "
                            "or use --backend torch.") from None


def load_target(target_dir: str | os.PathLike, backend: KernelSpec, *,
                info: ModelInfo | None = None, worker: Worker | None = None) -> TargetModel:
    """Load the target from a local directory and bind it to ``backend``; verify what is bound.

    Raises BadInputError when the machine cannot give what planning decided (no CUDA in torch,
    fla not importable, a kernel bound to another family than asked). ``worker``: on CUDA, the
    shards load straight onto its GPU (``RunContext.worker``; default rank 0 of 1).
    """
    import torch

    info = info or read_model_info(target_dir)
    if backend.device == "cuda" and not torch.cuda.is_available():
        raise BadInputError(f"this run was planned for cuda but torch {torch.__version__} sees no CUDA GPU; "
                            "check the driver and CUDA_VISIBLE_DEVICES, or pass --device cpu.")
    if backend.kernel == "fla":
        _check_fla_importable()
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[backend.dtype]
    # use_kernels=False: transformers >= 5.25 kernelizes by default, fetching hub kernels at run
    # time in place of the ones we key on (see "Hub kernels" above); older versions default to it.
    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=backend.attn_implementation,
                                  local_files_only=True, use_kernels=False)
    if backend.device == "cuda":
        # cuda:LOCAL_RANK under torchrun (one GPU a rank); the shards load straight onto it, not
        # through host RAM.
        kwargs["device_map"] = device_for(worker or Worker(), "cuda")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if "attention implementation" in str(e) or "attn_implementation" in str(e):
            others = [a for a in ("eager", "sdpa", "flash_attention_2") if a != backend.attn_implementation]
            raise BadInputError(f"the target in {target_dir} cannot run attention implementation "
                                f"{backend.attn_implementation!r} ({str(e).split('.')[0]}); pass "
                                f"--attn-implementation {others[0]} (or {others[1]}). It is part of the "
                                "hidden-state key, so states of each implementation are cached apart.") from None
        raise BadInputError(f"cannot load the target from {target_dir} ({type(e).__name__}: {e}); pass a "
                            "local transformers model directory with --target.") from None
    if backend.device != "cuda":
        model.to("cpu")
    return bind_target(model, info, backend)


def bind_target(model, info: ModelInfo, backend: KernelSpec) -> TargetModel:
    """A model already in memory (``load_target``'s, or one built from a config on the GPU, as
    the 27B-shaped GPU bench does: 54 GB of random weights are not worth a disk round trip) bound
    to ``backend``, with every check ``load_target`` makes: device, dtype, no hub kernels, the
    attention implementation and the kernel family really bound."""
    import torch

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[backend.dtype]
    model.eval()
    model.requires_grad_(False)
    got_device = next(model.parameters()).device
    if got_device.type != backend.device:
        raise BadInputError(f"the target loaded onto {got_device}, not {backend.device}; check "
                            "CUDA_VISIBLE_DEVICES and the --device option.")
    got_dtype = next(model.parameters()).dtype
    if got_dtype != dtype:
        raise BadInputError(f"the target loaded as {got_dtype}, not {backend.dtype}; dfcache does not "
                            "support quantized targets for extraction.")
    if getattr(model, "use_kernels", False):
        raise BadInputError(f"transformers kernelized {type(model).__name__} with hub kernels although dfcache "
                            "passed use_kernels=False; hub kernels would replace the kernels the hidden-state "
                            "key names. Unset any kernel_config/USE_HUB_KERNELS override and retry.")
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != backend.attn_implementation:
        raise BadInputError(f"the target runs attention implementation {attn!r}, not the planned "
                            f"{backend.attn_implementation!r}; pick one the model supports.")
    base, layers = _decoder_stack(model, info.num_layers)
    modeling = sys.modules.get(type(base).__module__)
    bound: dict[str, str] = {}
    if modeling is not None:
        apply_binding(modeling, backend.kernel)  # pins hub-only functions in every modeling module
    if modeling is not None and kernel_wrappers(modeling):
        bound = bind_kernels(modeling, backend.kernel)
        delta = {n: m for n, m in bound.items() if _is_delta_rule(n)}
        if backend.kernel == "fla" and not delta:
            raise BadInputError(f"--backend fla: {modeling.__name__} binds no gated-delta-rule kernel "
                                f"(it binds {', '.join(sorted(bound))}); use --backend torch.")
        wrong = {n: m for n, m in delta.items() if family_of_module(m) != backend.kernel}
        if wrong:
            detail = ", ".join(f"{n} -> {m}" for n, m in sorted(wrong.items()))
            raise BadInputError(
                f"--backend {backend.kernel} was asked but the model calls {detail}. transformers binds "
                f"kernels once, when it imports {modeling.__name__}; in this process that happened while "
                "fla was not importable. Run extraction in a fresh process with flash-linear-attention and "
                "triton installed, or use --backend torch.")
    elif backend.kernel == "fla":
        raise BadInputError(f"--backend fla: {type(model).__name__} has no fla-accelerated functions; use "
                            "--backend torch.")
    overrides, override_note = {}, None
    fla_cuda = modeling is not None and backend.kernel == "fla" and backend.device == "cuda"
    if fla_cuda:
        overrides, override_note = exact_overrides(modeling, got_device)
        for name, fn in overrides.items():
            setattr(modeling, name, fn)
        bound = bound_kernels(modeling)
    prov = {"versions": library_versions(), "bound": bound, "model_class": type(model).__name__,
            "modeling_module": getattr(modeling, "__name__", None), "attn_implementation": attn,
            "torch_cuda": getattr(torch.version, "cuda", None), "device": str(got_device)}
    if backend.device == "cuda":
        prov["gpu"] = torch.cuda.get_device_name(got_device)
    if override_note:
        prov["exact_overrides_skipped"] = override_note
    if fla_cuda and backend.dtype == "bfloat16":
        from .fused_layers import install

        prov["fused_layers"], skipped = install(model, got_device)
        if skipped:
            prov["fused_layers_skipped"] = skipped
    return TargetModel(model, base, layers, info, backend, modeling, bound, prov, overrides)


def exact_overrides(modeling, device) -> tuple[dict[str, Callable], str | None]:
    """Faster functions with the same bits, for the fla kernel class on CUDA: the gated-DeltaNet
    causal conv + SiLU in one Triton pass (``causal_conv``), where transformers would run its
    PyTorch fallback and the fused kernel gives the fallback's bits on this device (checked once;
    a difference keeps the fallback and is said in the provenance). Names -> functions, and why
    none where one was possible but refused."""
    key = (modeling.__name__, "causal_conv1d_fn")
    wrapper = getattr(modeling, "causal_conv1d_fn", None)
    reference = _TORCH_FUNCTIONS.get(key)
    if wrapper is None or reference is None or implementation_of(wrapper) is not reference:
        return {}, None  # not this layer family, or an installed causal_conv1d kernel runs: left as is
    from .causal_conv import exact_conv_fn, self_check

    variant, why = self_check(reference, device)
    if variant is None:
        return {}, why
    return {"causal_conv1d_fn": exact_conv_fn(reference, variant)}, None


def family_of_module(qualname: str) -> str:
    """Kernel family of a recorded ``module.function`` name."""
    if qualname == "fla" or qualname.startswith("fla."):
        return "fla"
    if qualname.startswith("transformers.") or qualname.startswith("torch"):
        return "torch"
    return qualname.split(".")[0]
