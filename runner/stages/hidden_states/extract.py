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
2, 4 or 8 x 2048, against 100 % at hidden 2048). So every (batch size, length) shape is checked
on its first batch against a one-sample forward of that batch's first sample (whose result is
kept: a check costs the batch forward only when the shape is refused). At a length where nothing
is known yet, pairs are checked first: a refused pair sends the length to one sample per forward
(larger sizes are not tried: they changed bits wherever pairs did); a passed pair lets the next
batch check its full size, and a refused size runs as chunks of the largest size that passed.
Stored rows are therefore a one-sample forward's bits on every backend, and the batch sizes
really used are reported (``ExtractStats.extra["batch_shapes"]``).

On CUDA the forwards go through :class:`runner.models.graphs.ForwardGraphs`: a shape seen twice
is captured as a CUDA graph, checked bit for bit against the eager forward, and replayed (one
launch per forward instead of a thousand from a thread that shares the GIL with the writers).
With ``DFCACHE_CUDA_LANES=2`` (the default) and room in the memory plan, they run on two CUDA
streams side by side (:mod:`runner.models.lanes`), each lane with its own graphs, a shape only
once a pair run side by side gave the bits of the same pair run one after the other.

Overlap, per window:

* the compute thread runs the forwards and copies each sample's rows of each layer into a window
  buffer (on CUDA: pinned host memory, ``non_blocking`` copies issued on a separate copy stream
  after an event, so the next forward runs while the copy is in flight);
* after each batch, the window's rows that are complete from its start on (a token-order
  prefix) go to a writer thread as a piece with its copy event: the writer waits for the event,
  appends the piece's rows to each layer's :class:`dfcache.store.ArrayWriter` (one task per layer
  on a small pool), and after the window's last piece checkpoints every resumable writer. Writing
  starts after the first batch, not the first window, and what is left to write once the last
  forward ends is one batch's rows;
* there are two window buffers, so compute runs at most one window ahead of the writer and blocks
  when the writer falls behind (bounded host memory: two windows of ``2 x batch_tokens`` tokens).

Resuming: each layer's writer keeps the rows of its last checkpoint (``rows_written``). The
extraction restarts at the last sample boundary that every layer has passed and skips, per layer,
the rows that layer already holds, so nothing checkpointed is computed twice.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from dfcache.fp8 import quantize_torch, stored_width

WINDOW_BATCHES = 2  # window size in units of batch_tokens
NUM_BUFFERS = 2  # window buffers: one being filled, one being written
WRITER_THREADS = 8  # most layers encoded and written at once (one thread each; each layer's append
# then writes its chunk files on $DFCACHE_WRITE_THREADS threads: dfcache.store._pools.write_threads)


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

    layer: int | str  # a decoder layer's index, or "final" (runner.models.target.FINAL)
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
    """Rows [start, stop) of a window (tokens relative to its start), ready once ``event`` has
    completed; ``release`` (the window's last piece only) hands the window buffer back."""

    def __init__(self, window: Window, buffers: dict, event, start: int, stop: int,
                 release: Callable[[], None] | None = None) -> None:
        self.window = window
        self.buffers = buffers  # layer -> numpy view of the window buffer (storage dtype)
        self.event = event
        self.start = start
        self.stop = stop
        self.release = release

    @property
    def last(self) -> bool:
        return self.release is not None


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
                    if job.release is not None:
                        job.release()
        finally:
            self.pool.shutdown(wait=True)

    def _write(self, job: _Job) -> None:
        w = job.window
        if job.event is not None:
            job.event.synchronize()

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
        a = job.start
        while True:
            cut = job.stop
            at_boundary = self.next_boundary < len(self.boundaries) and \
                self.boundaries[self.next_boundary] - w.token_start <= job.stop
            if at_boundary:
                cut = max(a, self.boundaries[self.next_boundary] - w.token_start)
            if cut > a:
                for f in [self.pool.submit(one, sink, a, cut) for sink in self.sinks]:
                    f.result()
                if self.progress is not None:
                    self.progress.update(cut - a)
            a = cut
            if not at_boundary:
                break
            self.next_boundary += 1
            self.on_boundary(self.next_boundary - 1, w.token_start + cut)
        if not job.last:
            return
        state = {"samples_done": w.stop, "tokens_done": w.token_stop}
        for f in [self.pool.submit(sink.writer.checkpoint, state) for sink in self.sinks]:
            f.result()
        self.stats.tokens += w.tokens
        self.stats.windows += 1
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


def _lowest_refused(length: int, verdicts: dict) -> float:
    return min((n for (n, L), ok in verdicts.items() if L == length and ok is False), default=float("inf"))


def _known_chunks(samples: list[int], length: int, verdicts: dict) -> list[list[int]]:
    """``samples`` cut, left to right, into the largest chunks of a size known to keep the bits."""
    out, i = [], 0
    while i < len(samples):
        left = len(samples) - i
        size = max((n for (n, L), ok in verdicts.items() if L == length and ok is True and n <= left), default=1)
        out.append(samples[i:i + size])
        i += size
    return out


def _check_size(n: int, length: int, verdicts: dict) -> int | None:
    """The chunk size to check on a batch of ``n`` samples (None: nothing to check, run known
    chunks). A size is checked only below every refused size; where nothing is known at this
    length, pairs are checked first."""
    if n == 1 or verdicts.get((n, length)) is True or n >= _lowest_refused(length, verdicts):
        return None
    return n if n == 2 or verdicts.get((2, length)) is True else 2


_PINNED: list = []  # pinned byte buffers of the last extraction (CUDA), reused by the next one


def _take_buffers(cuda: bool, n: int, capacity: int, H: int, dtype, n_layers: int) -> tuple[list[list], list]:
    """``n`` window buffers, each ``n_layers`` tensors of [capacity, H], and the byte buffers they
    view (for :func:`_give_back_buffers`). On CUDA they are views of
    pinned host memory, which takes about a second per few GB to allocate: the last extraction's
    buffers that are large enough are reused, whatever their dtype (an FP8 extraction after a bf16
    one in the same process took 0.32 s more to set up, 11 % of its run, when buffers were kept
    by dtype: 1.25 B on an H100, 2026-12-07)."""
    import torch

    nbytes = capacity * H * dtype.itemsize
    kept = [b for b in _PINNED if b.numel() >= nbytes] if cuda else []
    _PINNED.clear()
    need = n * n_layers
    flat = kept[:need] + [torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(need - len(kept))]
    views = [b[:nbytes].view(dtype).view(capacity, H) for b in flat]
    return [views[i * n_layers:(i + 1) * n_layers] for i in range(n)], flat


def _give_back_buffers(cuda: bool, flat: list) -> None:
    if cuda:
        _PINNED[:] = flat


_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _graphs_for(target):
    """The target's CUDA graphs (:mod:`runner.models.graphs`), kept while it lives; None when off."""
    from dfcache.config import cuda_graphs

    from ...models import graphs

    if not cuda_graphs():
        return None
    try:
        g = _GRAPHS.get(target)
        if g is None:
            g = _GRAPHS[target] = graphs.ForwardGraphs(target)
        return g
    except TypeError:
        return graphs.ForwardGraphs(target)


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
            pack: dict | None = None, boundaries: list[int] | None = None, on_boundary=None,
            gpu_free_bytes: int | None = None, quantize: bool = False) -> ExtractStats:
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
    before it, and before any later row is appended (the hidden-states stage starts a segment's
    commits there, so one pipeline runs across segments). Boundaries past the rows computed here (and
    all of them when there is nothing to compute) are the caller's to handle.

    Memory (:mod:`runner.models.memory`): on CUDA the batch cap and the CUDA graphs are sized from the GPU
    memory free once the model is loaded (``gpu_free_bytes``, measured when None; given, it is
    applied on any device, which is how the CPU tests exercise it); a set whose longest sample
    cannot run is refused before any forward (BadInputError, exit 6). The choice is logged and
    kept in ``stats.extra["memory_plan"]``.

    On CUDA with room for more than one lane (``$DFCACHE_CUDA_LANES``, the plan's ``lanes``),
    forwards run side by side (:mod:`runner.models.lanes`; ``stats.extra["lanes"]``), and
    ``forward_gpu_s`` sums spans that may overlap.

    ``quantize``: the sinks take FP8 packed rows (``dfcache.fp8``: codes and a per-token scale,
    ``H + 4`` bytes a row): each forward's output is quantized where it was computed (on the GPU
    for a CUDA target, one kernel chain per layer and batch), so only the packed rows, about half
    the bytes, are copied to the host and no host pass touches them again.
    """
    import torch

    stats = ExtractStats()
    t0 = time.perf_counter()
    total = int(offsets[-1])
    from ...models.target import sort_layers

    layers = sort_layers(s.layer for s in sinks)  # decoder layers by index, then "final" (post-norm)
    start_sample, start_token = resume_point(offsets, [s.array.rows_written for s in sinks])
    for s in sinks:
        s.skip = s.array.rows_written - start_token
    stats.tokens_resumed = start_token
    if start_token and log is not None:
        log(f"hidden states: resuming at sample {start_sample} ({start_token} of {total} tokens kept)")
    cuda = target.device.type == "cuda"
    mem = None
    config = getattr(getattr(target, "model", None), "config", None)  # None: no model to size (bench stand-ins)
    if (cuda or gpu_free_bytes is not None) and config is not None and start_sample < len(offsets) - 1:
        from ...models import memory

        free = memory.free_gpu_bytes(target.device) if gpu_free_bytes is None else gpu_free_bytes
        longest = int(np.diff(offsets[start_sample:]).max())
        from dfcache.config import cuda_graphs, cuda_lanes

        graphs_on = cuda and cuda_graphs()
        mem = memory.plan(free, memory.per_token_bytes(config, len(layers), target.torch_dtype.itemsize),
                          longest, batch_tokens, cuda_graphs=graphs_on, lanes=cuda_lanes() if graphs_on else 1)
        batch_tokens = mem.batch_tokens
        stats.extra["memory_plan"] = mem.to_dict()
        if log is not None:
            log(f"hidden states: {mem.describe()}")
    windows, capacity = plan_windows(offsets, start_sample, batch_tokens, pack=pack is not None)
    if not windows:
        stats.wall_s = time.perf_counter() - t0
        return stats

    H = target.hidden_size
    width, buf_dtype = (stored_width(H), torch.uint8) if quantize else (H, target.torch_dtype)
    buffers: queue.Queue = queue.Queue()
    pinned, pinned_bytes = _take_buffers(cuda, min(NUM_BUFFERS, len(windows)), capacity, width, buf_dtype,
                                         len(layers))
    for rows in pinned:
        bufs = dict(zip(layers, rows))
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

    graphs = _graphs_for(target) if cuda and (mem is None or mem.cuda_graphs) else None
    run_forward = graphs if graphs is not None else target.forward_layers
    replays0 = graphs.replays if graphs is not None else 0
    lanes = None
    if graphs is not None and mem is not None and mem.lanes > 1:
        from ...models.lanes import Lanes

        lanes = Lanes(target, graphs, mem.lanes, mem.lane_tokens)
        replays0 = sum(g.replays for g in lanes.graphs)

    def launch(fwd, rows: np.ndarray) -> dict:
        ids = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        if cuda:
            ids = ids.pin_memory().to(target.device, non_blocking=True)
        return timed(lambda: fwd(ids, layers))

    def forward(rows: np.ndarray) -> tuple:
        """(the layers' outputs, the CUDA stream they were computed on: None for the current one)"""
        if lanes is not None:
            return lanes.forward(launch, rows, layers)
        return launch(run_forward, rows), None

    def joined() -> None:
        """The current stream waits for every lane (before it reads their outputs)."""
        if lanes is not None:
            for s in lanes.streams:
                torch.cuda.current_stream(target.device).wait_stream(s)

    def _copied():
        """An event after every copy issued so far (None on the CPU, where copies are done)."""
        if not cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(copy_stream)
        return ev

    compute_t0 = time.perf_counter()
    lens = np.diff(offsets)
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
            done: set[int] = set()
            nxt = w.first  # first sample of the window whose rows are not all copied
            handed = 0  # rows of the window (from its start) handed to the writer
            for b in w.batches:
                if writer.error is not None:
                    buffers.put((bufs, views))
                    raise writer.error
                starts = [int(offsets[s]) for s in b.samples]
                runs = []
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
                    runs.append((outs, pieces, None))
                else:
                    L = b.length

                    def rows_of(chunk: list[int]) -> np.ndarray:
                        return np.stack([token_ids[int(offsets[s]):int(offsets[s]) + L] for s in chunk])

                    def run(chunk: list[int], result=None) -> None:
                        outs, stream = forward(rows_of(chunk)) if result is None else result
                        shape = (len(chunk), L)
                        used[shape] = used.get(shape, 0) + 1
                        runs.append((outs, [(row, 0, int(offsets[s]), L) for row, s in enumerate(chunk)], stream))

                    rest = list(b.samples)
                    size = _check_size(len(rest), L, verdicts)
                    if size is not None:
                        # first use of this shape: does it give the first sample's one-sample bits?
                        chunk, rest = rest[:size], rest[size:]
                        one = forward(rows_of(chunk[:1]))
                        outs = forward(rows_of(chunk))
                        stats.checks += 1
                        joined()
                        verdicts[(size, L)] = all(_same_bits(outs[0][k][0], one[0][k][0]) for k in outs[0])
                        if verdicts[(size, L)]:
                            run(chunk, outs)
                        else:  # the check's forward is the first sample's result; the others go on
                            run(chunk[:1], one)
                            rest = chunk[1:] + rest
                        one = outs = None
                    chunks = _known_chunks(rest, L, verdicts)
                    i = 0
                    while i < len(chunks):
                        pair = chunks[i:i + 2]
                        if (lanes is not None and len(pair) == 2 and len(pair[0]) == len(pair[1])
                                and lanes.ready_to_check((len(pair[0]), L), layers)):
                            for chunk, result in zip(pair, lanes.check_pair(launch, rows_of(pair[0]),
                                                                            rows_of(pair[1]), layers)):
                                run(chunk, result)
                            if lanes.verdict((len(pair[0]), L), layers) is False and log is not None:
                                log(f"hidden states: forwards of {len(pair[0])}x{L} tokens changed bits side by side; "
                                    "they run one at a time")
                            i += 2
                            continue
                        run(chunks[i])
                        i += 1
                for outs, pieces, stream in runs:
                    stats.batches += 1
                    for k, t in outs.items():
                        if t.dtype != target.torch_dtype or t.shape[-1] != H:
                            # copy_ would convert silently; the store must hold what the layer gave
                            raise RuntimeError(f"layer {k} gave {t.dtype} rows of width {t.shape[-1]}, not the "
                                               f"model's {target.torch_dtype} x {H}; dfcache cannot store it exactly.")
                    if quantize:  # on the device (and the lane's stream) that computed them, before any copy
                        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                            outs = {k: quantize_torch(t.reshape(-1, H)).reshape(*t.shape[:-1], width)
                                    for k, t in outs.items()}
                    if cuda:
                        # The copy stream starts after this forward; the next forward does not wait.
                        copy_stream.wait_stream(stream or torch.cuda.current_stream(target.device))
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
                # Hand the writer what is complete from the window's start on (batches run longest
                # first, so with mixed lengths the prefix may grow only at the window's end).
                done.update(b.samples)
                while nxt < w.stop and (nxt in done or lens[nxt] == 0):
                    nxt += 1
                ready = int(offsets[nxt]) - w.token_start
                if nxt < w.stop and ready > handed:
                    writer.jobs.put(_Job(w, views, _copied(), handed, ready))
                    handed = ready

            def release(item=(bufs, views)) -> None:
                buffers.put(item)

            writer.jobs.put(_Job(w, views, _copied(), handed, w.tokens, release))
        stats.forward_s = time.perf_counter() - compute_t0
    finally:
        writer.jobs.put(None)
        writer.join()
        stats.extra["setup_s"] = round(compute_t0 - t0, 3)
        stats.extra["after_compute_s"] = round(time.perf_counter() - compute_t0 - stats.forward_s, 3)
        if progress is not None:
            progress.close()
    _give_back_buffers(cuda, pinned_bytes)
    if writer.error is not None:
        raise writer.error
    if gpu_spans:
        torch.cuda.synchronize(target.device)  # with lanes the last span recorded need not end last
        spans = [a.elapsed_time(b) for a, b in gpu_spans]
        stats.forward_gpu_s = sum(spans) / 1e3
        stats.extra["forward_gpu_ms"] = [round(x, 1) for x in spans[:512]]
    stats.extra["batch_shapes"] = {f"{n}x{length}": count for (n, length), count in sorted(used.items())}
    if lanes is not None:
        st = lanes.stats()
        stats.extra["lanes"] = {k: v for k, v in st.items() if k != "replays"}
        stats.extra["cuda_graphs"] = {**graphs.stats(), "replays": st["replays"] - replays0}
    elif graphs is not None:
        stats.extra["cuda_graphs"] = {**graphs.stats(), "replays": graphs.replays - replays0}
    stats.extra["shapes_changing_bits"] = sorted(f"{n}x{length}" for (n, length), ok in verdicts.items() if not ok)
    stats.wall_s = time.perf_counter() - t0
    return stats
