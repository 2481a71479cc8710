"""Stored samples as training data: a map-style torch Dataset and a length-bucketing sampler.

Imports torch (a training tool needs it; nothing on the CLI's cached path imports this module).
Generic on purpose (dfcache knows nothing about drafters): a :class:`SampleSource` lists the
samples of a selection and reads one sample's arrays by name; :class:`HiddenStateDataset` turns
them into torch tensors. ``runner.core.samples`` builds the source for a target, backend, prompt set
and layer list (``runner.api.hidden_state_dataset``), and that is the one place that knows how
the eval pipeline's artifacts are laid out.

Worker processes: a source is pickled to spawn workers and copied into forked ones; it must
not carry an open store handle across processes. Sources open their store lazily, once per
process (keyed by the pid), so ``DataLoader(num_workers=N)`` works with either start method.

Example::

    from runner.api import hidden_state_dataset
    ds = hidden_state_dataset(store="./store", target="./target", drafters=["./drafter"])
    item = ds[0]   # {"input_ids": [1, n] int64, "loss_mask": [1, n] int64,
                   #  "hidden_states": [1, n, layers * hidden] bfloat16, "key": str}
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["HiddenStateDataset", "LengthBucketSampler", "Sample", "SampleSource", "copy_rows", "pad_collate",
           "to_torch"]


@dataclass
class Sample:
    """One sample as stored: its key and its arrays by name (bf16 as uint16 bits, see ``dtypes``)."""

    key: str
    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]  # logical dtype of each array ("bfloat16", "int64", ...)
    # Arrays that live in a torch tensor already (read into memory from ``alloc``): the tensor,
    # bf16 as its int16 bits; the dataset hands it on as it is.
    tensors: dict = field(default_factory=dict)


@runtime_checkable
class SampleSource(Protocol):
    """The samples of one selection, readable one at a time (by position)."""

    def __len__(self) -> int: ...

    def keys(self) -> list[str]:
        """The sample keys, in the selection's order."""
        ...

    def lengths(self) -> Sequence[int]:
        """Tokens (rows) of each sample, without reading any sample."""
        ...

    def read(self, index: int) -> Sample:
        """One sample's arrays; reads only the chunks its rows touch."""
        ...


_TORCH_OF = {np.dtype(np.uint16): torch.int16, np.dtype(np.int16): torch.int16, np.dtype(np.float32): torch.float32,
             np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.int8): torch.int8,
             np.dtype(np.uint8): torch.uint8, np.dtype(np.float64): torch.float64}


def shared_alloc(shape: tuple, dtype) -> tuple[np.ndarray, torch.Tensor]:
    """An uninitialised array in shared memory and the tensor over it (bf16 bits as int16).

    In a DataLoader worker an item's tensors are moved into shared memory to reach the main
    process (a copy of every byte); rows read straight into shared memory are sent as they are,
    as torch's own ``default_collate`` does for batches built in workers.

    The pages are made present in one call before the rows are copied in: the layers' columns
    are written one layer at a time, and the fresh shared pages' faults then cost more than the
    copy (issue 36, 2-core VM: a 4.6 MB item of four layers in 4.67 ms against 5.07 ms; torch's
    own copy of a contiguous tensor into shared memory, what SpecForge's items get, 4.00 ms)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    storage = torch.UntypedStorage._new_shared(nbytes)
    if nbytes >= 1 << 20:
        from dfcache.store import populate_write

        populate_write(storage.data_ptr(), nbytes)  # (refused: the copy faults the pages in instead)
    t = torch.empty(0, dtype=_TORCH_OF[dtype]).set_(storage, 0, tuple(shape))
    return t.numpy().view(dtype), t


def recycled_alloc(shape: tuple, dtype) -> tuple[np.ndarray, torch.Tensor]:
    """An uninitialised array and the tensor over it (bf16 bits as int16) in a recycled buffer:
    one whose previous item (and every tensor or array made from it) is gone, so a training loop
    that drops each item before the next but one pays no fresh pages (a page fault and a zeroed
    page per 4 KiB, about as much as reading the rows). Items kept are never written over."""
    from dfcache.store import recycled_empty

    arr = recycled_empty(tuple(shape), dtype)
    return arr, torch.from_numpy(arr.view(np.int16) if arr.dtype == np.uint16 else arr)


_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class _AsSource:
    """A read-only array's memory described as writable, only to be the *source* of a torch copy:
    ``torch.from_numpy`` warns about a read-only array (and then never again in the process, for
    the user's own calls too); a filter or ``catch_warnings`` around it would change the global
    warning state, not thread-safely. Nothing writes through it."""

    def __init__(self, a: np.ndarray) -> None:
        self.keep = a  # the array (and the memory map under it) live as long as this view
        face = dict(a.__array_interface__)
        face["data"] = (face["data"][0], False)
        self.__array_interface__ = face


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (one dtype and shape) by torch's copy, the ``copy`` a per-layer read
    into an item's columns uses (``ArrayReader.read_raw``): into the columns of a wider array
    numpy's assignment is the slower one (issue 36, per-layer layout; ``python -m
    bench.copy_variants`` on the 2-core AMD EPYC VM, one thread, 4 layers of 1024 bf16: 11.6 GB/s
    numpy against 15.0 GB/s torch at 1024 rows, 5.6 against 9.2 at 4096). ``src`` may be a
    read-only memory map."""
    as_int = _INT_OF_SIZE.get(dst.dtype.itemsize)
    if as_int is None or dst.dtype != src.dtype or dst.shape != src.shape:
        dst[...] = src
        return
    src = src.view(as_int)
    if not src.flags.writeable:
        src = np.asarray(_AsSource(src))
    torch.from_numpy(dst.view(as_int)).copy_(torch.from_numpy(src))


def _in_worker() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


def to_torch(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """A stored array as a tensor of its stored dtype (bf16 arrive as their uint16 bits, float8_e4m3fn
    as their uint8 bits), no copy."""
    if dtype == "float8_e4m3fn":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8)).view(torch.float8_e4m3fn)
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(arr)
        if bits.dtype != np.uint16:
            bits = bits.view(np.uint16)
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr))


class HiddenStateDataset(Dataset):
    """Map-style dataset over a :class:`SampleSource`; item ``i`` is sample ``i`` of the selection.

    Each item is a dict: every array of the sample as a torch tensor with a leading batch
    dimension of 1 (``[1, n, ...]``, the shape SpecForge's DFlash offline normalizer gives and
    its collator pads), bf16 arrays as ``torch.bfloat16`` bit for bit, and ``"key"`` (the
    sample key, a str). ``max_len`` truncates every array to its first ``max_len`` rows, as
    SpecForge's ``max_len`` does.

    Picklable, and safe under ``DataLoader(num_workers>0)`` with fork or spawn: the source reopens its store
    in each process.


    FP8 states (``--compression fp8-e4m3``, :mod:`dfcache.fp8`) come as a source's
    ``float8_e4m3fn`` array ``X`` ``[n, G x H]`` with ``X_scales`` ``[n, G]`` (one float32 per token
    and layer). ``fp8="bf16"`` (default) hands ``X`` on dequantized to bf16, as hs-connectors'
    reader dequantizes (``code.to(bf16) * scale.to(bf16)``), and drops ``X_scales``;
    ``fp8="raw"`` hands on ``X`` as ``torch.float8_e4m3fn`` and ``X_scales`` as float32.
    """

    FP8_MODES = ("bf16", "raw")

    def __init__(self, source: SampleSource, *, max_len: int | None = None, fp8: str = "bf16") -> None:
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len={max_len}: give a positive number of tokens (or None).")
        if fp8 not in self.FP8_MODES:
            raise ValueError(f"fp8={fp8!r}: give 'bf16' (dequantized, the default) or 'raw' (codes and scales).")
        self.source = source
        self.max_len = max_len
        self.fp8 = fp8

    def __len__(self) -> int:
        return len(self.source)

    def keys(self) -> list[str]:
        return self.source.keys()

    def lengths(self) -> list[int]:
        """Tokens per item (after ``max_len``), for :class:`LengthBucketSampler`."""
        lens = [int(n) for n in self.source.lengths()]
        return [min(n, self.max_len) for n in lens] if self.max_len else lens

    def __getitem__(self, index: int) -> dict:
        n = len(self)
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"index {index!r}: items are read by position (an int)")
        i = int(index) + (n if index < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        # Sources that take ``alloc`` (StoredSamples) read a worker's large arrays into shared
        # memory, the main process's into recycled buffers.
        if getattr(self.source, "takes_alloc", False):
            sample = self.source.read(i, alloc=shared_alloc if _in_worker() else recycled_alloc)
        else:
            sample = self.source.read(i)
        item: dict = {}
        arrays = dict(sample.arrays)
        dtypes = dict(sample.dtypes)
        for name in [n for n, d in dtypes.items() if d == "float8_e4m3fn"]:
            if self.fp8 == "bf16":  # dequantized: what a bf16 reader of these states gets
                from .fp8 import dequantize_codes

                arrays[name] = dequantize_codes(arrays[name], arrays.pop(f"{name}_scales"))
                dtypes[name] = "bfloat16"
                dtypes.pop(f"{name}_scales", None)
        for name, arr in arrays.items():
            dtype = dtypes.get(name, arr.dtype.name)
            t = sample.tensors.get(name)
            if t is not None:
                t = t.view(torch.bfloat16) if dtype == "bfloat16" else t
            else:
                t = to_torch(arr, dtype)
            if self.max_len is not None:
                t = t[: self.max_len]
            item[name] = t.unsqueeze(0)
        item["key"] = sample.key
        return item


class LengthBucketSampler:
    """Batches of sample indices of similar length, at most ``max_tokens`` padded tokens each.

    Samples are sorted by length inside windows of ``bucket_size`` shuffled samples, cut into
    batches whose padded size (longest x count) stays within ``max_tokens``, and the batches
    are shuffled; ``seed`` and ``set_epoch`` make the order reproducible. Use as
    ``DataLoader(ds, batch_sampler=LengthBucketSampler(ds.lengths(), max_tokens=16384),
    collate_fn=pad_collate)``.
    """

    def __init__(self, lengths: Sequence[int], *, max_tokens: int, bucket_size: int = 1024,
                 shuffle: bool = True, seed: int = 0) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: give a positive number of tokens.")
        self.lengths = [int(n) for n in lengths]
        self.max_tokens = max_tokens
        self.bucket_size = max(1, bucket_size)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        if self.shuffle:
            rng.shuffle(order)
        batches: list[list[int]] = []
        for w in range(0, len(order), self.bucket_size):
            window = sorted(order[w:w + self.bucket_size], key=lambda i: self.lengths[i])
            batch: list[int] = []
            longest = 0
            for i in window:
                n = self.lengths[i]
                if batch and max(longest, n) * (len(batch) + 1) > self.max_tokens:
                    batches.append(batch)
                    batch, longest = [], 0
                batch.append(i)
                longest = max(longest, n)
            if batch:
                batches.append(batch)
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def pad_collate(items: list[dict], pad_values: dict[str, int] | None = None) -> dict:
    """Right-pad items of a batch along the sequence axis and concatenate them on the batch axis.

    Tensors are ``[1, n, ...]`` (as items come); padding is 0 unless ``pad_values`` says otherwise.
    Adds ``attention_mask`` ([B, n_max], 1 on real tokens) and keeps ``key`` as a list.
    """
    pad_values = pad_values or {}
    out: dict = {"key": [it["key"] for it in items]}
    names = [k for k in items[0] if k != "key"]
    longest = max(it[names[0]].shape[1] for it in items) if names else 0
    for name in names:
        parts = []
        for it in items:
            t = it[name]
            if t.shape[1] < longest:
                pad = t.new_full((1, longest - t.shape[1], *t.shape[2:]), pad_values.get(name, 0))
                t = torch.cat([t, pad], dim=1)
            parts.append(t)
        out[name] = torch.cat(parts, dim=0)
    if names:
        mask = torch.zeros((len(items), longest), dtype=torch.long)
        for b, it in enumerate(items):
            mask[b, : it[names[0]].shape[1]] = 1
        out["attention_mask"] = mask
    return out
