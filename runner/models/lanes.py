"""Forwards side by side: the extraction's one-sample forwards on several CUDA streams ("lanes"),
each lane replaying its own CUDA graphs (:class:`runner.models.graphs.ForwardGraphs`).

Why: the exact extraction runs one sample per forward wherever a batch changes bits (every batch
size at hidden 4096 and 5120), and a one-sample forward leaves the card partly idle: fla's
chunked gated-DeltaNet kernels launch one block per (sample, head) and walk the chunks in turn,
and small kernels run between the GEMMs. On an H100 the 27B-shaped target's one-sample forwards
took 191.7 ms of GPU time a sample inside the extraction against 175.4 ms a sample batched
(2026-12-07, bench/results/gpu/gpu_extract_27b_128_fused_h100_2026-12-07.json): 0.89x. Two such
forwards at once fill the card the way a batch does, with each sample's kernels, shapes and
launch parameters unchanged.

Exactness: a forward's bits depend on its kernels and inputs, not on what runs beside it, unless
two forwards share scratch memory (each lane has its own graph pool and capture stream, so its
own cuBLAS workspace) or a kernel reduces with atomics. That is checked, not assumed: a shape
runs side by side only after both lanes have captured its graph and a pair of samples run side
by side gave the same bits as the same pair run one after the other (:meth:`Lanes.check_pair`;
once per shape and loaded target, kept with the target's lanes). Until then, and for
a shape that failed, each forward waits for the other lanes. Lanes are not key material.

Memory: each further lane keeps an eager working set and a graph pool of its own, so it runs only
forwards of at most ``max_tokens`` tokens (``runner.models.memory.plan``'s ``lane_tokens``);
larger ones run on the first lane, one at a time.
"""

from __future__ import annotations

import weakref

from .graphs import ForwardGraphs, same_bits
from .target import sort_layers

_LANES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lanes_of(target, first: ForwardGraphs, n: int) -> tuple[list, list[ForwardGraphs], dict]:
    """The target's lane streams, graphs (lane 0's are ``first``) and side-by-side verdicts (shape
    key -> bool), kept while it lives, so a later extraction replays the graphs already captured
    and does not check a shape again."""
    import torch

    def make(have=((), (), None)):
        streams, graphs = list(have[0]), list(have[1])
        while len(streams) < n:
            streams.append(torch.cuda.Stream(device=target.device))
            graphs.append(first if not graphs else ForwardGraphs(target))
        return streams, graphs, {} if have[2] is None else have[2]

    try:
        have = _LANES.get(target)
        if have is None or have[1][0] is not first:
            have = _LANES[target] = make()
        elif len(have[0]) < n:
            have = _LANES[target] = make(have)
    except TypeError:  # not weak-referenceable: new lanes per call
        have = make()
    return have[0][:n], have[1][:n], have[2]


class Lanes:
    """Runs ``launch(graphs, rows)`` (a forward through that lane's graphs, returning its outputs)
    on the next lane's stream, side by side with the other lanes only for a shape whose check
    passed (see the module docstring; ``verdicts``: shape key -> bool, kept per target). The
    caller copies the outputs after the returned stream (``copy_stream.wait_stream``)."""

    def __init__(self, target, first: ForwardGraphs, n: int, max_tokens: int) -> None:
        import torch

        self.torch = torch
        self.device = target.device
        self.streams, self.graphs, self.verdicts = lanes_of(target, first, n)
        self.max_tokens = max_tokens
        self.last: list = [None] * n  # the shape key each lane ran last
        self.next = 0
        self.side_by_side = 0  # forwards that did not wait for another lane
        self.checked: dict[str, bool] = {}

    @staticmethod
    def _key(shape, layers) -> tuple:
        return tuple(shape), tuple(sort_layers(layers))

    def verdict(self, shape, layers) -> bool | None:
        """Whether forwards of this shape keep their bits side by side (None: not checked yet)."""
        return self.verdicts.get(self._key(shape, layers))

    def ready_to_check(self, shape, layers) -> bool:
        """Whether the next pair of forwards of this shape should be :meth:`check_pair`."""
        key = self._key(shape, layers)
        return (key not in self.verdicts and shape[0] * shape[1] <= self.max_tokens
                and all(key in g.graphs for g in self.graphs))

    def _after_all(self, s) -> None:
        for o in self.streams:
            if o is not s:
                s.wait_stream(o)

    def _run(self, lane: int, launch, rows, key):
        s = self.streams[lane]
        s.wait_stream(self.torch.cuda.current_stream(self.device))
        with self.torch.cuda.stream(s):
            out = launch(self.graphs[lane], rows)
        self.last[lane] = key
        return out, s

    def forward(self, launch, rows, layers):
        """``(outputs, stream)`` of one forward of ``rows`` (host token ids, [samples, length])."""
        key = self._key(rows.shape, layers)
        if rows.shape[0] * rows.shape[1] > self.max_tokens:
            lane = 0  # too large for the further lanes' memory
        else:
            lane, self.next = self.next, (self.next + 1) % len(self.streams)
        s = self.streams[lane]
        if self.verdicts.get(key) is True and all(k in (None, key) for i, k in enumerate(self.last) if i != lane):
            self.side_by_side += 1
        else:
            self._after_all(s)
        return self._run(lane, launch, rows, key)

    def check_pair(self, launch, rows_a, rows_b, layers) -> list:
        """Two forwards of one shape side by side on lanes 0 and 1, then again one after the other;
        the shape's verdict is whether every layer's bits agree. Returns ``[(outputs, stream)] * 2``
        (the ones run one after the other: right either way)."""
        key = self._key(rows_a.shape, layers)
        (s0, s1), torch = self.streams[:2], self.torch
        for s in self.streams:
            self._after_all(s)
        side = [self._run(0, launch, rows_a, key)[0], self._run(1, launch, rows_b, key)[0]]
        s0.wait_stream(s1)
        a = self._run(0, launch, rows_a, key)
        s1.wait_stream(s0)
        b = self._run(1, launch, rows_b, key)
        cur = torch.cuda.current_stream(self.device)
        cur.wait_stream(s1)
        same = all(set(x) == set(y[0]) and all(same_bits(x[k], y[0][k]) for k in x) for x, y in zip(side, (a, b)))
        self.verdicts[key] = same
        self.checked[ForwardGraphs._label(key)] = same
        for s in self.streams:  # the pair's forwards end before anything else starts
            s.wait_stream(cur)
        return [a, b]

    def stats(self) -> dict:
        return {"lanes": len(self.streams), "max_tokens": self.max_tokens, "side_by_side": self.side_by_side,
                "checked": dict(self.checked),
                "captured": [list(g.captured) for g in self.graphs],
                "refused": [dict(g.refused) for g in self.graphs],
                "replays": sum(g.replays for g in self.graphs)}
