"""The hidden-state extraction pipeline: batched forwards overlapped with copies and store writes.

Work is cut into *windows* of consecutive samples. Inside a window, samples are sorted by length
and grouped into batches of **equal-length** samples only (at most ``batch_tokens`` tokens a
batch; a longer sample runs alone). Padding is avoided on purpose: with right padding and an
attention mask, the PyTorch gated-DeltaNet and attention paths give different low-order bits for
the real tokens than an unpadded forward (measured on CPU, fp32: up to 6e-8), and dfcache's
contract is that stored states equal a plain forward of each sample, bit for bit on CPU in fp32.
Equal-length rows are independent in every layer in exact arithmetic, but not always in the
bits: a GPU library may pick another GEMM kernel (another reduction order) for a batch of b rows
than for one (measured on an H200 at hidden 4096: 5.6 % of the bits of layer 33 survive batching
8 x 2048, against 100 % at hidden 2048). So the first batch of every (batch size, length) shape is
checked against a one-sample forward of its first sample; a shape that changes bits is not used
again: its batches run as halves (each size checked the same way), down to one sample per
forward. Stored rows are therefore a one-sample forward's bits on every backend, and the batch
sizes really used are reported (``ExtractStats.extra["batch_shapes"]``).

Overlap, per window:

* the compute thread runs the forwards and copies each sample's rows of each layer into a window
  buffer (on CUDA: pinned host memory, ``non_blocking`` copies issued on a separate copy stream
  after an event, so the next forward runs while the copy is in flight);
* a writer thread waits for the window's last copy event, appends each layer's rows, in token
  order, to that layer's :class:`dfcache.store.ArrayWriter` (one task per layer on a small pool),
  then checkpoints every resumable writer;
* there are two window buffers, so compute runs one window ahead of the writer and blocks when
  the writer falls behind (bounded host memory: two windows of ``2 x batch_tokens`` tokens).

Resuming: each layer's writer keeps the rows of its last checkpoint (``rows_written``). The
extraction restarts at the last sample boundary that every layer has passed and skips, per layer,
the rows that layer already holds, so nothing checkpointed is computed twice.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

WINDOW_BATCHES = 2  # window size in units of batch_tokens
NUM_BUFFERS = 2  # window buffers: one being filled, one being written
WRITER_THREADS = 8  # most layers encoded and written at once (one thread each)


@dataclass
class Batch:
    samples: list[int]  # sample indices, all of length `length` (unless packed)
    length: int
    lengths: list[int] | None = None  # packed: each sample's length, concatenated in one row


@dataclass
class Window:
    index: int
    first: int  # samples [first, stop)
    stop: int
    token_start: int  # global token range [token_start, token_stop)
    token_stop: int
    batches: list[Batch]

    @property
    def tokens(self) -> int:
        return self.token_stop - self.token_start


@dataclass
class LayerSink:
    """Where one layer's rows go: a resumable artifact writer and its ``hidden`` array."""

    layer: int
    writer: object  # dfcache.store.ArtifactWriter
    array: object  # dfcache.store.ArrayWriter
    skip: int = 0  # rows of the next windows this layer already holds (resume)


@dataclass
class ExtractStats:
    tokens: int = 0  # tokens committed to the store in this call
    tokens_resumed: int = 0  # tokens found already written (checkpointed earlier)
    windows: int = 0
    batches: int = 0
    forward_s: float = 0.0  # wall time of the compute loop (forwards + issuing copies)
    forward_gpu_s: float = 0.0  # CUDA: GPU time between each forward's start and end events
    checks: int = 0  # one-sample forwards run to check a batch shape (see the module docstring)
    wall_s: float = 0.0
    writer_wait_s: float = 0.0  # time compute waited for a free window buffer (writer behind)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def plan_batches(lengths: dict[int, int], batch_tokens: int) -> list[Batch]:
    """Equal-length batches of at most ``batch_tokens`` tokens, longest first (so an
    out-of-memory batch shows up at once), samples in index order within a length."""
    by_len: dict[int, list[int]] = {}
    for s, n in lengths.items():
        by_len.setdefault(n, []).append(s)
    batches = []
    for n in sorted(by_len, reverse=True):
        per = max(1, batch_tokens // max(1, n))
        group = sorted(by_len[n])
        for i in range(0, len(group), per):
            batches.append(Batch(samples=group[i:i + per], length=n))
    return batches


def plan_packed(lengths: dict[int, int], batch_tokens: int) -> list[Batch]:
    """Mixed-length batches for packed forwards: samples in index order, concatenated until the
    next would pass ``batch_tokens`` (a longer sample runs alone)."""
    batches: list[Batch] = []
    cur: list[int] = []
    total = 0
    for s in sorted(lengths):
        n = lengths[s]
        if cur and total + n > batch_tokens:
            batches.append(Batch(samples=cur, length=total, lengths=[lengths[i] for i in cur]))
            cur, total = [], 0
        cur.append(s)
        total += n
    if cur:
        batches.append(Batch(samples=cur, length=total, lengths=[lengths[i] for i in cur]))
    return batches


def plan_windows(offsets: np.ndarray, start_sample: int, batch_tokens: int,
                 pack: bool = False) -> tuple[list[Window], int]:
    """Windows of consecutive samples from ``start_sample``; returns them and the buffer rows."""
    n = len(offsets) - 1
    lens = np.diff(offsets).astype(np.int64)
    longest = int(lens[start_sample:].max()) if n > start_sample else 0
    capacity = max(WINDOW_BATCHES * batch_tokens, longest, 1)
    windows: list[Window] = []
    s = start_sample
    while s < n:
        e = s
        while e < n and (e == s or offsets[e + 1] - offsets[s] <= capacity):
            e += 1
        lengths = {i: int(lens[i]) for i in range(s, e) if lens[i] > 0}
        windows.append(Window(index=len(windows), first=s, stop=e, token_start=int(offsets[s]),
                              token_stop=int(offsets[e]),
                              batches=(plan_packed if pack else plan_batches)(lengths, batch_tokens)))
        s = e
    return windows, capacity


def resume_point(offsets: np.ndarray, rows_written: list[int]) -> tuple[int, int]:
    """(first sample to compute, its first token): the last sample boundary every layer passed."""
    kept = min(rows_written) if rows_written else 0
    s = int(np.searchsorted(offsets, kept, side="right")) - 1
    s = max(0, min(s, len(offsets) - 1))
    return s, int(offsets[s])


class _Job:
    def __init__(self, window: Window, buffers: dict, event, release: Callable[[], None]) -> None:
        self.window = window
        self.buffers = buffers  # layer -> numpy view of the window buffer (storage dtype)
        self.event = event
        self.release = release


class _WindowWriter(threading.Thread):
    """Appends finished windows to the layer arrays in token order and checkpoints them."""

    def __init__(self, sinks: list[LayerSink], on_checkpoint, progress, stats: ExtractStats,
                 boundaries: list[int] | None = None, on_boundary=None) -> None:
        super().__init__(name="dfcache-hidden-writer", daemon=True)
        self.sinks = sinks
        self.on_checkpoint = on_checkpoint
        self.boundaries = list(boundaries or [])
        self.next_boundary = 0
        self.on_boundary = on_boundary
        self.progress = progress
        self.stats = stats
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        # Layers are separate artifacts: their encodes and file writes run in parallel.
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(len(sinks), WRITER_THREADS)),
                                       thread_name_prefix="dfcache-layer-writer")

    def run(self) -> None:
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                try:
                    if self.error is None:
                        self._write(job)
                except BaseException as e:  # surfaced by the compute thread
                    self.error = e
                finally:
                    job.release()
        finally:
            self.pool.shutdown(wait=True)

    def _write(self, job: _Job) -> None:
        w = job.window
        if job.event is not None:
            job.event.synchronize()
        state = {"samples_done": w.stop, "tokens_done": w.token_stop}

        def one(sink: LayerSink, a: int, b: int) -> None:
            rows = job.buffers[sink.layer][a:b]
            if sink.skip:
                k = min(sink.skip, len(rows))
                rows = rows[k:]
                sink.skip -= k
            if len(rows):
                sink.array.append(rows)

        # Rows go out in pieces that end at the caller's boundaries: at each one every sink has
        # all rows before it and none after, and on_boundary runs before the next piece.
        a = 0
        while True:
            cut = w.tokens
            at_boundary = self.next_boundary < len(self.boundaries) and \
                self.boundaries[self.next_boundary] - w.token_start <= w.tokens
            if at_boundary:
                cut = max(a, self.boundaries[self.next_boundary] - w.token_start)
            if cut > a:
                for f in [self.pool.submit(one, sink, a, cut) for sink in self.sinks]:
                    f.result()
            a = cut
            if not at_boundary:
                break
            self.next_boundary += 1
            self.on_boundary(self.next_boundary - 1, w.token_start + cut)
        for f in [self.pool.submit(sink.writer.checkpoint, state) for sink in self.sinks]:
            f.result()
        self.stats.tokens += w.tokens
        self.stats.windows += 1
        if self.progress is not None:
            self.progress.update(w.tokens)
        if self.on_checkpoint is not None:
            self.on_checkpoint(w.index, w.token_stop)


_VERDICTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _verdicts(target) -> dict:
    """Per loaded target, whether a (batch size, length) shape gives one-sample bits (True/False).
    Kept while the target lives: a later extraction with the same model reuses the checks."""
    try:
        return _VERDICTS.setdefault(target, {})
    except TypeError:  # not weak-referenceable: check again per call
        return {}


def _exact_chunks(samples: list[int], length: int, verdicts: dict) -> list[list[int]]:
    """``samples`` (one equal-length batch) cut into the largest chunks not known to change bits."""
    b = len(samples)
    while b > 1 and verdicts.get((b, length)) is False:
        b //= 2
    return [samples[i:i + b] for i in range(0, len(samples), b)]


def _same_bits(a, b) -> bool:
    import torch

    if a.dtype.is_floating_point and a.dtype.itemsize == 2:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b)


def _storage_view(t) -> np.ndarray:
    """A numpy view of a CPU tensor in the store's storage dtype (bf16 as its uint16 bits)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def extract(target, token_ids: np.ndarray, offsets: np.ndarray, sinks: list[LayerSink], *,
            batch_tokens: int, progress_factory=None, on_checkpoint=None, log=None,
            pack: dict | None = None, boundaries: list[int] | None = None, on_boundary=None) -> ExtractStats:
    """Compute the sinks' layers for every sample and append them in token order.

    ``target`` is a :class:`runner.models.target.TargetModel`. ``sinks`` may be resumed writers;
    rows they already hold are not recomputed. ``on_checkpoint(window_index, tokens_done)`` runs
    in the writer thread after each window is checkpointed (an exception there stops the
    extraction like a crash would, after that window). Returns throughput figures.

    ``pack`` (keyword arguments of :func:`runner.models.packed.forward_layers_packed`, e.g.
    ``{}``) runs mixed-length samples concatenated in one forward instead of equal-length
    batches. Packed rows need not equal one-sample forwards bit for bit (another kernel class):
    callers that store them must key them as such.

    ``boundaries`` (ascending token offsets, repeats allowed) with ``on_boundary(i, token)``: the
    writer thread calls ``on_boundary`` for boundary i once every sink holds exactly the rows
    before it, and before any later row is appended (the hidden-states stage commits a segment
    there, so one pipeline runs across segments). Boundaries past the rows computed here (and
    all of them when there is nothing to compute) are the caller's to handle.
    """
    import torch

    stats = ExtractStats()
    t0 = time.perf_counter()
    total = int(offsets[-1])
    layers = sorted(s.layer for s in sinks)
    start_sample, start_token = resume_point(offsets, [s.array.rows_written for s in sinks])
    for s in sinks:
        s.skip = s.array.rows_written - start_token
    stats.tokens_resumed = start_token
    if start_token and log is not None:
        log(f"hidden states: resuming at sample {start_sample} ({start_token} of {total} tokens kept)")
    windows, capacity = plan_windows(offsets, start_sample, batch_tokens, pack=pack is not None)
    if not windows:
        stats.wall_s = time.perf_counter() - t0
        return stats

    cuda = target.device.type == "cuda"
    H = target.hidden_size
    buffers: queue.Queue = queue.Queue()
    for _ in range(min(NUM_BUFFERS, len(windows))):
        bufs = {k: torch.empty((capacity, H), dtype=target.torch_dtype, pin_memory=cuda) for k in layers}
        buffers.put((bufs, {k: _storage_view(v) for k, v in bufs.items()}))

    progress = progress_factory(total - start_token) if progress_factory else None
    writer = _WindowWriter(sinks, on_checkpoint, progress, stats, boundaries, on_boundary)
    writer.start()
    copy_stream = torch.cuda.Stream(device=target.device) if cuda else None
    verdicts = _verdicts(target)
    used: dict[tuple[int, int], int] = {}
    gpu_spans: list = []

    def timed(fn):
        if not cuda:
            return fn()
        ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev[0].record()
        out = fn()
        ev[1].record()
        gpu_spans.append(ev)
        return out

    def forward(rows: np.ndarray) -> dict:
        ids = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        if cuda:
            ids = ids.pin_memory().to(target.device, non_blocking=True)
        return timed(lambda: target.forward_layers(ids, layers))

    compute_t0 = time.perf_counter()
    try:
        for w in windows:
            wait0 = time.perf_counter()
            while True:
                if writer.error is not None:
                    raise writer.error
                try:
                    bufs, views = buffers.get(timeout=0.05)
                    break
                except queue.Empty:
                    continue
            stats.writer_wait_s += time.perf_counter() - wait0
            event = None
            for b in w.batches:
                if writer.error is not None:
                    buffers.put((bufs, views))
                    raise writer.error
                starts = [int(offsets[s]) for s in b.samples]
                if b.lengths is not None:
                    from ...models.packed import forward_layers_packed

                    ids = torch.from_numpy(np.concatenate(
                        [token_ids[a:a + n] for a, n in zip(starts, b.lengths)]).astype(np.int64))[None]
                    if cuda:
                        ids = ids.pin_memory().to(target.device, non_blocking=True)
                    outs = timed(lambda: forward_layers_packed(target, ids, b.lengths, layers, **pack))
                    # one row; (row, start in it, length) per sample
                    pieces = []
                    at = 0
                    for a, n in zip(starts, b.lengths):
                        pieces.append((0, at, a, n))
                        at += n
                    runs = [(outs, pieces)]
                else:
                    runs = []
                    todo = [list(b.samples)]
                    while todo:
                        for chunk in _exact_chunks(todo.pop(0), b.length, verdicts):
                            shape = (len(chunk), b.length)
                            if verdicts.get(shape) is False:  # found out on an earlier chunk of this batch
                                todo.append(chunk)
                                continue
                            c_starts = [int(offsets[s]) for s in chunk]
                            outs = forward(np.stack([token_ids[a:a + b.length] for a in c_starts]))
                            if len(chunk) > 1 and shape not in verdicts:
                                # first use of this shape: does it give the first sample's one-sample bits?
                                one = forward(token_ids[c_starts[0]:c_starts[0] + b.length][None])
                                stats.checks += 1
                                verdicts[shape] = all(_same_bits(outs[k][0], one[k][0]) for k in outs)
                                del one
                                if not verdicts[shape]:
                                    todo.append(chunk)  # recomputed in smaller chunks
                                    outs = None
                                    continue
                            used[shape] = used.get(shape, 0) + 1
                            runs.append((outs, [(row, 0, a, b.length) for row, a in enumerate(c_starts)]))
                for outs, pieces in runs:
                    stats.batches += 1
                    for k, t in outs.items():
                        if t.dtype != target.torch_dtype or t.shape[-1] != H:
                            # copy_ would convert silently; the store must hold what the layer gave
                            raise RuntimeError(f"layer {k} gave {t.dtype} rows of width {t.shape[-1]}, not the "
                                               f"model's {target.torch_dtype} x {H}; dfcache cannot store it exactly.")
                    if cuda:
                        # The copy stream starts after this forward; the next forward does not wait.
                        copy_stream.wait_stream(torch.cuda.current_stream(target.device))
                        with torch.cuda.stream(copy_stream):
                            for k, t in outs.items():
                                for row, at, a, n in pieces:
                                    o = a - w.token_start
                                    bufs[k][o:o + n].copy_(t[row, at:at + n], non_blocking=True)
                                t.record_stream(copy_stream)  # keep the allocator off it until copied
                    else:
                        for k, t in outs.items():
                            for row, at, a, n in pieces:
                                o = a - w.token_start
                                bufs[k][o:o + n].copy_(t[row, at:at + n])
                outs = runs = None
            if cuda:
                event = torch.cuda.Event()
                event.record(copy_stream)

            def release(item=(bufs, views)) -> None:
                buffers.put(item)

            writer.jobs.put(_Job(w, views, event, release))
        stats.forward_s = time.perf_counter() - compute_t0
    finally:
        writer.jobs.put(None)
        writer.join()
        if progress is not None:
            progress.close()
    if writer.error is not None:
        raise writer.error
    if gpu_spans:
        gpu_spans[-1][1].synchronize()
        stats.forward_gpu_s = sum(a.elapsed_time(b) for a, b in gpu_spans) / 1e3
    stats.extra["batch_shapes"] = {f"{n}x{length}": count for (n, length), count in sorted(used.items())}
    stats.extra["shapes_changing_bits"] = sorted(f"{n}x{length}" for (n, length), ok in verdicts.items() if not ok)
    stats.wall_s = time.perf_counter() - t0
    return stats
