"""Triton's interpreter (TRITON_INTERPRET=1, on the CPU) made fit to check the fused kernels'
arithmetic: imported first by fused_kernels_interpreter.py and fused_layers_glue_interpreter.py.

Two gaps are patched. Its float32 -> bf16 cast truncates, and its RTNE mode gave -0.25 for
-0.499 (triton 3.9.0), where the GPU's cast rounds to nearest even: the cast is replaced by a
numpy round-to-nearest-even. It has no libdevice, so the kernels' ``libdevice.exp`` becomes
``tl.exp`` (numpy's exp: a SiLU may then differ from torch's CPU one by an ulp)."""
import os
import sys
import types

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, ".")

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

_convert = interp._convert_float


def _rtne(data, src, dst, rounding):
    if src == tl.float32 and dst == tl.bfloat16:
        u = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return _convert(data, src, dst, rounding)


interp._convert_float = _rtne


@triton.jit
def _exp(x):
    return tl.exp(x)


def patch(*modules) -> None:
    """Give each kernel module (causal_conv, fused_layers) the interpreter's ``exp`` as its
    ``libdevice`` (its kernels import libdevice in a closure the interpreter cannot see)."""
    for m in modules:
        m.libdevice = types.SimpleNamespace(exp=_exp)
