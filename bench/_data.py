"""Test data shared by the storage benchmarks: bf16 hidden states cut into samples, and the
SpecForge per-sample layout."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._common import fsync_path

WIDTH = 4096  # n_layers x H per token, e.g. 4 target layers of a 1024-wide model (as storage-probe.md)
SPECFORGE_GROUP = 1000  # samples per rows_<g>/ directory


@dataclass
class Hidden:
    states: np.ndarray       # [T, W] uint16 (the bits of bf16), C-contiguous
    lengths: list[int]       # per-sample token counts, sum == T
    input_ids: np.ndarray    # [T] int64
    loss_mask: np.ndarray    # [T] int64

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    @property
    def nbytes(self) -> int:
        return self.states.nbytes

    @property
    def tokens(self) -> int:
        return self.states.shape[0]


def make_hidden(total_bytes: int, *, width: int = WIDTH, lengths: tuple[int, int] = (256, 2048),
                seed: int = 0) -> Hidden:
    """N(0,1) values rounded to bf16, about ``total_bytes`` of them, cut into samples whose
    lengths are uniform in ``lengths``."""
    import torch

    rng = np.random.default_rng(seed)
    want = max(lengths[1], total_bytes // (2 * width))
    lens = []
    while sum(lens) < want:
        lens.append(int(rng.integers(lengths[0], lengths[1] + 1)))
    T = sum(lens)
    out = np.empty((T, width), dtype=np.uint16)
    gen = torch.Generator().manual_seed(seed)
    step = 8192
    for i in range(0, T, step):
        n = min(step, T - i)
        out[i:i + n] = torch.randn(n, width, generator=gen).to(torch.bfloat16).view(torch.uint16).numpy()
    ids = rng.integers(0, 150_000, size=T, dtype=np.int64)
    mask = np.ones(T, dtype=np.int64)
    return Hidden(out, lens, ids, mask)


def specforge_samples(h: Hidden) -> list[dict]:
    """One dict per sample, as SpecForge's hidden-state preparation saves them: fresh tensors
    (a view would make torch.save write the whole parent storage)."""
    import torch

    states = torch.from_numpy(h.states).view(torch.bfloat16)
    out = []
    off = h.offsets
    for i in range(len(h.lengths)):
        a, b = int(off[i]), int(off[i + 1])
        out.append({"input_ids": torch.from_numpy(h.input_ids[a:b].copy()),
                    "loss_mask": torch.from_numpy(h.loss_mask[a:b].copy()),
                    "hidden_states": states[a:b].clone().unsqueeze(0)})
    return out


def specforge_path(root: Path, idx: int) -> Path:
    return root / f"rows_{idx // SPECFORGE_GROUP}" / f"data_{idx}.ckpt"


def specforge_write(root: Path, samples: list[dict], *, fsync: bool = True) -> list[Path]:
    """``torch.save`` each sample to ``rows_<g>/data_<idx>.ckpt``; then fsync files and dirs."""
    import torch

    paths = []
    made = set()
    for idx, sample in enumerate(samples):
        p = specforge_path(root, idx)
        if p.parent not in made:
            p.parent.mkdir(parents=True, exist_ok=True)
            made.add(p.parent)
        torch.save(sample, p)
        paths.append(p)
    if fsync:
        for p in paths:
            fsync_path(p)
        for d in made:
            fsync_path(d)
        fsync_path(root)
    return paths


def numpy_save(path: Path, arr: np.ndarray, *, fsync: bool = True) -> None:
    with open(path, "wb") as f:
        np.save(f, arr)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    if fsync:
        fsync_path(path.parent)
