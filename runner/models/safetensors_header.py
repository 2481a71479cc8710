"""Read safetensors headers and single tensor rows without torch.

``dfcache doctor`` must not pay for a torch import, yet some of its checks need shapes (the
drafter's ``fc.weight``, the target's embedding) and one embedding row (the MASK token's). The
safetensors layout is simple enough to read directly: an 8-byte little-endian header length, a
JSON header mapping names to ``{dtype, shape, data_offsets}``, then the raw bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

_NP_DTYPES = {"F32": "float32", "F16": "float16", "F64": "float64", "I64": "int64", "I32": "int32",
              "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the tensor's data in ``file``
    stop: int


def _header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        n = struct.unpack("<Q", raw)[0]
        if n > 100 << 20:
            raise ValueError(f"{path} declares a {n}-byte header; not a safetensors file")
        hdr = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, spec in hdr.items():
        if name == "__metadata__" or not isinstance(spec, dict):
            continue
        b, e = spec["data_offsets"]
        out[name] = TensorInfo(path, str(spec["dtype"]), tuple(int(s) for s in spec["shape"]), base + b, base + e)
    return out


def tensor_index(model_dir: str | Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo over every safetensors file of a (possibly sharded) checkpoint."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    files: list[Path]
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted({d / f for f in weight_map.values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    out: dict[str, TensorInfo] = {}
    for f in files:
        if f.is_file():
            out.update(_header(f))
    return out


def read_rows(info: TensorInfo, rows: list[int]):
    """Rows of a 2-D tensor as float32 (a numpy array), reading only their bytes."""
    import numpy as np  # here: planning reads headers and small int tensors without numpy

    if len(info.shape) != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {info.shape}")
    width = info.shape[1]
    if info.dtype == "BF16":
        import ml_dtypes

        np_dtype = np.dtype(ml_dtypes.bfloat16)
    elif info.dtype in _NP_DTYPES:
        np_dtype = np.dtype(_NP_DTYPES[info.dtype])
    else:
        raise ValueError(f"unsupported safetensors dtype {info.dtype}")
    row_bytes = width * np_dtype.itemsize
    out = np.empty((len(rows), width), dtype=np.float32)
    with open(info.file, "rb") as f:
        for i, r in enumerate(rows):
            f.seek(info.start + r * row_bytes)
            out[i] = np.frombuffer(f.read(row_bytes), dtype=np_dtype).astype(np.float32)
    return out


def read_ints(info: TensorInfo) -> list[int]:
    """A small integer tensor (I64/I32, e.g. EAGLE-3's ``d2t``), flattened, without numpy."""
    import array

    codes = {"I64": "q", "I32": "i"}
    if info.dtype not in codes:
        raise ValueError(f"{info.file}: tensor is {info.dtype}, not an integer tensor (I64/I32)")
    a = array.array(codes[info.dtype])
    with open(info.file, "rb") as f:
        f.seek(info.start)
        data = f.read(info.stop - info.start)
    if len(data) != info.stop - info.start or len(data) % a.itemsize:
        raise ValueError(f"{info.file} is shorter than its header says")
    a.frombytes(data)
    if struct.pack("=H", 1) != struct.pack("<H", 1):
        a.byteswap()  # safetensors is little-endian
    return a.tolist()

