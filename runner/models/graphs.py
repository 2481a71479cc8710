"""CUDA graph replay of a target's truncated forward (``TargetModel.forward_layers``), one graph
per input shape.

Why: one forward of a Qwen3.5-style target launches on the order of a thousand kernels from
Python. Inside the extraction pipeline, the thread that launches them shares the GIL with the
writer threads (digests, crc32c, file writes): an H200 measured the forwards' GPU span at 16.45 s
inside the extraction against 10.9 s for the same one-sample forwards bare, the GPU waiting for
launches (the 2026-12-03 profiles in bench/results/gpu/). A replayed graph is one launch per forward, whatever the
other threads do.

Exactness: a graph replays the kernels its capture recorded with the same launch parameters, on
new data. The first capture of a shape is replayed on the input of the eager forward run just
before it (on the capture stream, which also warms that stream up), and the graph is kept only if
every requested layer's output equals the eager one bit for bit; otherwise, or if the capture
fails (a forward that synchronizes, an operation a graph cannot hold), the shape stays eager and
the reason is recorded. Stored rows are therefore an eager forward's bits and graphs are not key
material.

When: a shape is captured at its second forward, so a length seen once (mixed-length sets) never
pays for a capture; at most :data:`MAX_GRAPHS` shapes per instance, sharing one memory pool (replays
run one after another on one stream and their outputs are cloned at once, so a graph may reuse
another's scratch memory). Forwards side by side (:mod:`runner.models.lanes`) use one instance per
lane: a pool and a capture stream each. ``DFCACHE_CUDA_GRAPHS=0`` turns them off in the extraction.
"""

from __future__ import annotations

from .target import sort_layers

MAX_GRAPHS = 8
CAPTURE_AT = 2  # the forward of a shape at which it is captured (the first ones run eagerly)


def same_bits(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point and a.dtype.itemsize == 2:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


class ForwardGraphs:
    """``forward(ids, layers)`` like ``target.forward_layers``, replaying a CUDA graph per shape
    once it has been captured and checked (see the module docstring). ``ids`` is on the target's
    device. Counters for the caller's statistics: ``replays``, ``captured`` (shape labels) and
    ``refused`` (shape label -> why)."""

    def __init__(self, target, max_graphs: int = MAX_GRAPHS) -> None:
        self.target = target
        self.max_graphs = max_graphs
        self.seen: dict = {}
        self.graphs: dict = {}  # key -> (graph, static ids, static outputs, layer calls per forward)
        self.refused: dict[str, str] = {}
        self.captured: list[str] = []
        self.replays = 0
        self._stream = None
        self._pool = None

    @staticmethod
    def _label(key) -> str:
        return "x".join(map(str, key[0])) + " L" + ",".join(map(str, key[1]))

    def __call__(self, ids, layers) -> dict:
        key = (tuple(ids.shape), tuple(sort_layers(layers)))
        hit = self.graphs.get(key)
        if hit is not None:
            graph, static_ids, static_out, calls = hit
            static_ids.copy_(ids)
            graph.replay()
            self.replays += 1
            self._count(calls, int(ids.numel()))
            # The next replay overwrites the graph's outputs: the caller gets copies (device to device).
            return {k: v.clone() for k, v in static_out.items()}
        n = self.seen[key] = self.seen.get(key, 0) + 1
        if n < CAPTURE_AT or self._label(key) in self.refused or len(self.graphs) >= self.max_graphs:
            return self.target.forward_layers(ids, layers)
        return self._capture(key, ids, layers)

    def _capture(self, key, ids, layers) -> dict:
        import torch

        t = self.target
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=t.device)
            self._pool = torch.cuda.graph_pool_handle()
        cur = torch.cuda.current_stream(t.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            eager = t.forward_layers(ids, layers)  # this call's result and the capture's reference
        cur.wait_stream(self._stream)
        for v in eager.values():
            v.record_stream(cur)
        label = self._label(key)
        executed, forwarded = getattr(t, "layers_executed", 0), getattr(t, "tokens_forwarded", 0)
        try:
            static_ids = ids.clone()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the writer threads' event waits during the capture are not an error.
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                static_out = t.forward_layers(static_ids, layers)
            calls = getattr(t, "layers_executed", 0) - executed
            graph.replay()
            cur.wait_stream(self._stream)
            same = set(static_out) == set(eager) and all(same_bits(static_out[k], eager[k]) for k in eager)
        except Exception as e:  # not capturable: stay eager
            self.refused[label] = f"capture failed: {type(e).__name__}: {e}"[:300]
            return eager
        finally:
            if hasattr(t, "layers_executed"):  # a capture computes nothing
                t.layers_executed, t.tokens_forwarded = executed, forwarded
        if not same:
            self.refused[label] = "the replay's bits differ from the eager forward's"
            del graph, static_out
            return eager
        self.graphs[key] = (graph, static_ids, static_out, calls)
        self.captured.append(label)
        return eager

    def _count(self, calls: int, tokens: int) -> None:
        """Replays run no hooks: keep the target's counters (where it has them) as if they had."""
        t = self.target
        if hasattr(t, "layers_executed"):
            t.layers_executed += calls
            t.tokens_forwarded += tokens

    def stats(self) -> dict:
        return {"captured": list(self.captured), "refused": dict(self.refused), "replays": self.replays}
