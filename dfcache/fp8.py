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

numpy, and torch only where it is already imported (:func:`quantize_torch`, which extraction calls
on the GPU; :func:`dequantize_codes` uses torch's kernels in a process that imported torch).
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
    # Divide by a tensor, not the Python number: CUDA divides by a scalar as a multiplication by its
    # reciprocal (1/448 is inexact), which gave 1,139 of 2,048 rows a scale one ulp off the host's on
    # an H200 (2026-12-06, bench/results/gpu/fp8_cuda_diag.py); tensor by tensor division is IEEE there.
    amax = f.abs().amax(dim=1, keepdim=True) if f.shape[1] else torch.zeros((f.shape[0], 1), device=f.device)
    scale = (amax / torch.full_like(amax, E4M3_MAX)).clamp(min=MIN_SCALE)
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
    """Codes ``[n, G * H]`` (uint8 or float8_e4m3fn; rows may be strided, e.g. packed rows'
    code columns) and scales ``[n, G]`` (one per row and group of H, e.g. per layer) -> bf16
    bits ``[n, G * H]`` (uint16), written into ``out`` when given (any row slice of a result).

    In a process that has imported torch (a trainer, a data loader), torch's vectorized kernels
    (:func:`_dequantize_torch`: 3.1x less CPU than numpy's at one thread, bench/fp8_variants.py);
    otherwise numpy (:func:`_dequantize_numpy`): a command that needs no torch does not import it
    for this. The same bits either way (tests/test_fp8.py)."""
    if uses_torch():
        return _dequantize_torch(codes, scales, out)
    return _dequantize_numpy(codes, scales, out)


def uses_torch() -> bool:
    """Whether :func:`dequantize_codes` runs torch's kernels here (torch is imported already);
    they parallelize over torch's intra-op threads, so a reader does not split rows for them."""
    import sys

    return "torch" in sys.modules


def _dequantize_torch(codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`dequantize_codes` in four vectorized passes over blocks of rows (torch's float8 ->
    bf16 cast is scalar code, 40 ms per 10 M values here, and a per-row 256-entry table of the
    products, gathered by ``np.take`` or ``index_select``, 2 to 8 ns per value):

    1. int8 code -> int16 (sign-extended, numpy), ``<< 4``, ``& 0x87F0`` (ATen): the code's sign over bf16's
       sign, its exponent and mantissa over bf16's low exponent bits and top mantissa bits, i.e.
       the code's value times 2^-120 as a bf16 (a bf16 subnormal for e4m3's subnormals, exact);
    2. one bf16 multiply by ``bf16(scale) x 2^120`` (exact as a bf16 for scales under 256, else
       ``x 2^120`` then ``x bf16(scale)``, the first exact): torch computes a bf16 product in
       float32 (exact: 4 x 8 significant bits) and rounds it to nearest even once, which is
       hs-connectors' ``fp8.to(bf16) * scale.to(bf16)``.

    About 0.57 ns per value at one thread against numpy's 1.8 (bench/fp8_variants.py, the busy
    2-core VM; 0.46 without the NaN-code check). The same
    fall-backs to the casts as :func:`_dequantize_numpy`: non-finite scales, NaN codes, a thread
    that flushes subnormals (torch's bf16 multiply would read the subnormal codes as 0)."""
    import torch

    codes, n, g, width, h, out, s = _dequantize_setup(codes, scales, out)
    if not n or not width:
        return out
    if not (np.isfinite(s).all() and _subnormals_kept()):
        return _dequantize_numpy(codes, scales, out)  # it takes the casts for the rows that need them
    one = float(np.abs(s).max(initial=0)) < 2.0 ** 8
    f = torch.from_numpy(s * np.float32(2.0 ** 120) if one else s).to(torch.bfloat16)[:, :, None]  # exact
    c8 = codes.view(np.int8)
    ot = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    rows = max(1, _TORCH_BLOCK_VALUES // width)
    t = torch.empty((min(rows, n), width), dtype=torch.int16)
    tn_all = t.numpy()
    for i in range(0, n, rows):
        j = min(n, i + rows)
        tt, tn = t[:j - i], tn_all[:j - i]
        np.copyto(tn, c8[i:j], casting="unsafe")  # sign-extended (numpy's: ~10% less CPU than torch's copy_)
        tt.bitwise_left_shift_(4)
        # NaN codes (0x7F, 0xFF: here 0x07F0 and 0xFFF0, the largest of the block as int16 and as
        # uint16) take the casts: two numpy maxima over the block just written, about 0.6 ms per
        # 10 M values (torch's int16 max is 3x slower, its == and any() 60x)
        if tn.max() == 0x07F0 or tn.view(np.uint16).max() == 0xFFF0:
            _dequantize_casts(codes[i:j], scales[i:j], out[i:j])
            continue
        tt.bitwise_and_(-0x7810)  # 0x87F0: the sign bit, the 7 bits of exponent and mantissa
        b = tt.view(torch.bfloat16)
        if not one:
            b = b * (2.0 ** 120)
        torch.mul(b.view(j - i, g, h), f[i:j], out=ot[i:j].view(j - i, g, h))
    return out


def _dequantize_setup(codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None):
    """What both dequantizers start from: the codes as uint8, rows, layers, width, values per
    layer, the output (made when None) and bf16(scale) as float32, as their reader rounds it."""
    import ml_dtypes

    n, g = scales.shape
    codes = codes.view(np.uint8)
    width = codes.shape[1]
    if out is None:
        out = np.empty((n, width), np.uint16)
    s = scales.astype(ml_dtypes.bfloat16).astype(np.float32)
    return codes, n, g, width, (width // g if g else 0), out, s


_TORCH_BLOCK_VALUES = 1 << 20  # values per block: 5.8 ms a sample against 7.8 in 256 K blocks and 9.2 in one


def _dequantize_numpy(codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`dequantize_codes` in numpy (the reader splits a large read's rows across its
    threads, numpy releases the GIL).

    Integer and float32 ufuncs over blocks of rows that stay in cache, no float8 or bfloat16
    ufunc (ml_dtypes' casts, and torch's CPU float8 cast, are scalar loops): about 1.4 ns per
    value on one core of the busy 2-core VM, a warm one-sample read 4x less CPU than with the
    casts (bench/fp8.py's read variants, docs/benchmarks.md):

    1. ``(int32(int8 code) << 20) & 0x87F00000``: the code's sign, exponent and mantissa laid
       over float32's, i.e. the code's value times 2^-120 (a float32 subnormal for e4m3's
       subnormals, exact);
    2. ``x 2^120`` (exact: the code's value), ``x float32(bf16(scale))`` (exact: 4 x 8
       significant bits), as hs-connectors' ``fp8.to(bf16) * scale.to(bf16)`` computes it; one
       multiply by ``scale x 2^120`` where that is a float32 (scales under 256: the same product);
    3. float32 -> bf16 round to nearest even in integers (``(u + 0x7FFF + (u >> 16 & 1)) >> 16``).

    Same bits as the casts (:func:`_dequantize_casts`), which still take rows whose scale is not
    finite or that hold NaN codes (0x7F, 0xFF: integers would make them finite), and any block
    on a thread that flushes float32 subnormals (e.g. after ``torch.set_flush_denormal(True)``)."""
    codes, n, g, width, h, out, s = _dequantize_setup(codes, scales, out)
    rows = max(1, _BLOCK_VALUES // max(1, width))
    t = np.empty((min(rows, n), width), np.int32)
    w = np.empty_like(t, dtype=np.uint32)
    mag = np.empty((min(rows, n), width), np.uint8)
    for i in range(0, n, rows):
        j = min(n, i + rows)
        c, sj, o = codes[i:j], s[i:j], out[i:j]
        np.bitwise_and(c, 0x7F, out=mag[:j - i])
        if not (np.isfinite(sj).all() and mag[:j - i].max(initial=0) != 0x7F and _subnormals_kept()):
            _dequantize_casts(c, scales[i:j], o)
            continue
        tt, ww = t[:j - i], w[:j - i]
        u, f = tt.view(np.uint32), tt.view(np.float32)
        np.copyto(tt, c.view(np.int8), casting="unsafe")  # sign-extended
        np.left_shift(tt, 20, out=tt)
        np.bitwise_and(tt, np.int32(-0x78100000), out=tt)  # 0x87F00000: sign, then 7 bits at float32's exponent
        if np.abs(sj).max(initial=0) < 2.0 ** 8:  # one multiply: scale x 2^120 is a float32
            np.multiply(f.reshape(j - i, g, h), (sj * np.float32(2.0 ** 120))[:, :, None], out=f.reshape(j - i, g, h))
        else:
            np.multiply(f, np.float32(2.0 ** 120), out=f)
            np.multiply(f.reshape(j - i, g, h), sj[:, :, None], out=f.reshape(j - i, g, h))
        np.right_shift(u, 16, out=ww)
        np.bitwise_and(ww, 1, out=ww)
        np.add(u, ww, out=u)
        np.add(u, np.uint32(0x7FFF), out=u)
        np.right_shift(u, 16, out=o, casting="unsafe")
    return out


_BLOCK_VALUES = 1 << 17  # values per block: its int32 scratch (512 KiB) stays in L2


def _subnormals_kept() -> bool:
    """Whether float32 arithmetic on this thread keeps subnormals (no FTZ/DAZ): step 1 needs it."""
    return bool(np.multiply(np.full(1, 2.0 ** -130, np.float32), np.float32(2.0 ** 120))[0] == np.float32(2.0 ** -10))


def _dequantize_casts(codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`dequantize_codes` through ml_dtypes' casts (float8 -> float32, x bf16(scale), ->
    bf16, round to nearest even): the reference, and the path for non-finite scales and NaN codes."""
    import ml_dtypes

    n, g = scales.shape
    f = np.ascontiguousarray(codes).view(_e4m3()).astype(np.float32).reshape(n, g, -1)
    f *= scales.astype(ml_dtypes.bfloat16).astype(np.float32)[:, :, None]  # bf16(scale); exact product
    bits = f.reshape(n, -1).astype(ml_dtypes.bfloat16).view(np.uint16)
    if out is None:
        return bits
    out[...] = bits
    return out
