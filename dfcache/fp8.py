"""FP8 hidden states: the one owner of the lossy ``fp8-e4m3`` codec (issue 33).

What is stored. A bf16 array of rows ``[n, H]`` (hidden states: tokens x hidden size) stored
``fp8-e4m3`` is the array of logical dtype :data:`FP8_DTYPE` and shape ``[n, H + 4]``, storage
dtype uint8: each row is the row's ``H`` float8_e4m3fn codes, then its float32 scale (4 bytes,
little endian). One scale per token (row), as vllm-project/speculators' FP8 backend (#1028) and
hs-connectors' ``fp8_utils`` do::

    scale = max(amax(|row|) / 448, 1e-12)          float32
    code  = float8_e4m3fn(row_f32 / scale)         round to nearest even
    value = bfloat16(float32(code) * bfloat16(scale))

The dequantization is hs-connectors' (``fp8.to(bf16) * scale.to(bf16)``: the product of two bf16
values is exact in float32, so it rounds once), so a reader of ours and theirs give the same bits.
Packing the scale into the row keeps one array per sample and layer: chunking, digests, crc32c,
verify, push and pull see plain uint8 rows, and a lossless codec (``zstd``, ``shuffle-zstd``,
``bitshuffle-lz4``) composes on top: ``--compression fp8-e4m3+zstd``.

Keys. A lossy codec changes the bytes a drafter sees, so it is key material: the hidden-states
key's ``backend`` gets ``"states": "fp8-e4m3"`` (absent for exact states, whose keys are
unchanged); the lossless stage is not keyed (DESIGN.md section 3).

Older readers. A dfcache that predates this codec does not know the dtype :data:`FP8_DTYPE` and
refuses the manifest (never returns the codes as numbers); this one refuses any dtype or codec it
does not know with exit 2 naming it (:class:`dfcache.errors.UnknownCodecError`).

numpy only (torch is imported by :func:`quantize_torch` alone, which extraction calls on the GPU).
"""

from __future__ import annotations

from ._lazy import LazyModule
from .errors import UsageError
from .manifest import CODECS as LOSSLESS
from .manifest import FP8_DTYPE, SCALE_BYTES

np = LazyModule("numpy")

FP8_E4M3 = "fp8-e4m3"
LOSSY = (FP8_E4M3,)
E4M3_MAX = 448.0
MIN_SCALE = 1e-12  # hs-connectors' clamp: an all-zero row gets this scale and zero codes
APPLIES_TO = "bfloat16 hidden states (the hidden_states stage with --dtype bfloat16)"


def compression_choices() -> tuple[str, ...]:
    """Every ``--compression`` value: the lossless codecs, then FP8 alone and FP8 + each."""
    return LOSSLESS + (FP8_E4M3,) + tuple(f"{FP8_E4M3}+{c}" for c in LOSSLESS[1:])


def split_compression(name: str) -> tuple[str | None, str]:
    """``"fp8-e4m3+zstd"`` -> ``("fp8-e4m3", "zstd")``; ``"zstd"`` -> ``(None, "zstd")``."""
    lossy, _, lossless = name.partition("+") if name.startswith("fp8-") else (None, "", name)
    lossless = lossless or "none"
    if (lossy is not None and lossy not in LOSSY) or lossless not in LOSSLESS or name not in compression_choices():
        raise UsageError(f"--compression {name!r} is not a codec; choose one of {', '.join(compression_choices())}.")
    return lossy, lossless


def check_applies(name: str, *, stage: str, dtype: str) -> tuple[str | None, str]:
    """:func:`split_compression`, refusing a lossy codec where it does not apply (exit 2)."""
    lossy, lossless = split_compression(name)
    if lossy is not None and (stage != "hidden_states" or dtype != "bfloat16"):
        what, fix = ((f"{dtype} hidden states", "Pass --dtype bfloat16") if stage == "hidden_states" else
                     (f"the {stage} stage", "Run the hidden-states (or eval) stage with it"))
        raise UsageError(f"--compression {name} does not apply to {what}: {lossy} applies to {APPLIES_TO} only. "
                         f"{fix}, or pass a lossless codec ({', '.join(LOSSLESS)}).")
    return lossy, lossless


def stored_array(hidden: int, dtype: str, compression: str) -> tuple[tuple[int, ...], str, str]:
    """(row shape, logical dtype, lossless codec) of hidden-state rows of ``hidden`` values of
    ``dtype`` stored with ``compression`` (:func:`check_applies` first)."""
    lossy, lossless = check_applies(compression, stage="hidden_states", dtype=dtype)
    if lossy is None:
        return (int(hidden),), dtype, lossless
    return (stored_width(hidden),), FP8_DTYPE, lossless


def stored_width(hidden: int) -> int:
    """Bytes of one stored row of ``hidden`` values."""
    return int(hidden) + SCALE_BYTES


def hidden_width(stored: int) -> int:
    """Values per row of packed rows ``stored`` bytes wide."""
    return int(stored) - SCALE_BYTES


def _e4m3():
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn)


def quantize(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 rows (their uint16 bits, or ml_dtypes.bfloat16) ``[n, H]`` -> packed rows ``[n, H + 4]`` uint8."""
    bits = np.ascontiguousarray(bits).view(np.uint16)
    n, h = bits.shape
    f = (bits.astype(np.uint32) << 16).view(np.float32)
    amax = np.abs(f).max(axis=1) if h else np.zeros(n, np.float32)
    scale = np.maximum(amax / np.float32(E4M3_MAX), np.float32(MIN_SCALE)).astype(np.float32)
    packed = np.empty((n, h + SCALE_BYTES), np.uint8) if out is None else out
    packed[:, :h] = (f / scale[:, None]).astype(_e4m3()).view(np.uint8)
    packed[:, h:] = scale.astype("<f4").view(np.uint8).reshape(n, SCALE_BYTES)
    return packed


def quantize_torch(rows):
    """The same as :func:`quantize`, bit for bit, on a torch bf16 tensor ``[n, H]`` where it is
    (extraction runs it on the GPU, so only the packed rows cross to the host): a uint8 tensor."""
    import torch

    f = rows.float()
    scale = (f.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=MIN_SCALE) if f.shape[1] else \
        torch.full((f.shape[0], 1), MIN_SCALE, device=f.device)
    codes = (f / scale).to(torch.float8_e4m3fn)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8).reshape(f.shape[0], SCALE_BYTES)], dim=1)


def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed rows -> (codes ``[n, H]`` as ml_dtypes.float8_e4m3fn, scales ``[n]`` float32); views where possible."""
    packed = np.ascontiguousarray(packed).view(np.uint8)
    h = hidden_width(packed.shape[1])
    scales = np.ascontiguousarray(packed[:, h:]).view("<f4").reshape(-1).astype(np.float32, copy=False)
    return packed[:, :h].view(_e4m3()), scales


def dequantize(packed: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Packed rows ``[n, H + 4]`` -> bf16 bits ``[n, H]`` (uint16), as hs-connectors' reader gives them."""
    codes, scales = unpack(packed)
    return dequantize_codes(codes, scales.reshape(-1, 1), out=out)


def dequantize_codes(codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Codes ``[n, G * H]`` (uint8 or float8_e4m3fn) and scales ``[n, G]`` (one per row and group
    of H, e.g. per layer) -> bf16 bits ``[n, G * H]`` (uint16).

    ml_dtypes' casts (float8 -> float32 -> bfloat16, round to nearest even): about 3x faster than a
    table gather here, whose uint8 indices numpy widens to intp first (measured on 4096 x 4096)."""
    import ml_dtypes

    n, g = scales.shape
    f = np.ascontiguousarray(codes).view(_e4m3()).astype(np.float32).reshape(n, g, -1)
    f *= scales.astype(ml_dtypes.bfloat16).astype(np.float32)[:, :, None]  # bf16(scale); exact product
    bits = f.reshape(n, -1).astype(ml_dtypes.bfloat16).view(np.uint16)
    if out is None:
        return bits
    out[...] = bits
    return out
