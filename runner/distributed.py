"""Many workers, one store, no coordinator: one worker's part of a distributed run.

Who the worker is and which samples are its own: :mod:`runner.core.worker`.

A distributed run is N copies of the same ``dfcache run`` command. Each one finds its place
(:func:`discover`: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from torchrun, or ``--shard I/N`` from a
scheduler without torchrun, such as a Slurm array; both at once split each torchrun group
further), takes its share of the samples (:func:`share`), and commits its own samples into the
shared store. The store is the only thing the workers share: the union of what they commit is
the result, and nothing is merged afterwards.

The share is balanced by tokens (the work of extraction and eval grows with tokens, not with
samples): samples sorted by (tokens descending, key), each given to the least-loaded worker
(ties: fewer samples, then lower rank). Every worker computes the same shares from the same
list, so no message is needed to agree on them.

*Which* list matters. The share of the samples **missing** from the store balances a rerun
(after a killed rank, only its samples are missing, and every worker takes part of them), but it
is safe only if every worker lists the store before any commits: otherwise two workers see two
different missing sets and a sample can fall between their shares. Under torchrun the workers
meet at a barrier (``torch.distributed`` with gloo, CPU-only, for that barrier and the final
summary only) after listing, so they share the missing samples. Workers that cannot meet
(``--shard``: array tasks start whenever the scheduler runs them, maybe hours apart) share the
**whole** set instead, so a sample's owner never depends on what is already stored; each does
the missing part of its share. Either way a rerun with any world size makes exactly what is
still missing. See docs/distributed.md.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

from .core.worker import Worker, device_for, share, split_concurrency

__all__ = ["Group", "StoreProgress", "WorkerRun", "run_worker"]

# The workers wait for the slowest at the end; a worker that dies is torchrun's to handle (it
# stops the others), so this only bounds a wait nobody is watching.
BARRIER_TIMEOUT_S = 7 * 24 * 3600


# ------------------------------------------------------------------------------------ meeting


class Group:
    """The barrier, the gather and rank 0's decisions, when the workers can meet (else no-ops).

    Only ``torch.distributed`` with gloo (it runs on CPU, so CPU workers meet too), initialised
    from torchrun's variables; nothing of ours listens on a port. If it cannot start, the
    workers carry on alone (each says so) and share the whole set, not the missing samples.
    """

    def __init__(self, worker: Worker, log: Callable[[str], None] | None = None,
                 timeout_s: float = BARRIER_TIMEOUT_S) -> None:
        self.worker = worker
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.timeout_s = timeout_s
        self.active = False
        self._ours = False

    def open(self) -> "Group":
        if not self.worker.can_meet or self.active:
            return self
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_gloo_available()):
                raise RuntimeError("this torch build has no gloo backend")
            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=timedelta(seconds=self.timeout_s))
                self._ours = True
            self.active = True
        except Exception as e:  # not fatal: every worker still does its share
            self.log(f"{self.worker.tag}warning: torch.distributed (gloo) did not start ({type(e).__name__}: {e}); "
                     "workers will not wait for each other and share the whole set, not only the missing samples.")
        return self

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj) -> list | None:
        """Every worker's ``obj`` on rank 0 (None elsewhere); ``[obj]`` when the workers cannot meet."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.worker.world if self.worker.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def agree(self, decision: bool) -> bool:
        """Rank 0's ``decision`` on every worker (a worker's own when the workers cannot meet), so
        that all take the same next step and none waits at a barrier the others skip."""
        if not self.active:
            return decision
        import torch.distributed as dist

        box = [decision if self.worker.main else None]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def close(self) -> None:
        if self._ours:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:
                pass
        self.active = self._ours = False

    def __enter__(self) -> "Group":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------ progress


Unit = tuple[Sequence[tuple[str, str]], int]  # ((partition, sample key) pairs it needs, its tokens)


def committed(store, units: Sequence[Unit]) -> tuple[int, int]:
    """(units, tokens) whose every sample is in ``store``, read from its manifests."""
    from dfcache.samples import index_of

    idx = index_of(store)
    idx.refresh()
    have: dict[str, dict] = {}
    n = tokens = 0
    for needs, tok in units:
        ok = True
        for partition, key in needs:
            where = have.get(partition)
            if where is None:
                where = have[partition] = idx.partition(partition)
            if key not in where:
                ok = False
                break
        if ok:
            n += 1
            tokens += tok
    return n, tokens


class StoreProgress:
    """Rank 0's bar for the whole job: samples and tokens committed by every worker.

    Read from the store (a store object of its own, so its index never races the producers'),
    on a background thread; each poll lists the store's manifests, so polls are spaced to at
    least ten times the last poll's duration (a large remote store is not listed back to back).
    """

    def __init__(self, store_url: str, units: Sequence[Unit], *, enabled: bool, desc: str = "all ranks",
                 interval_s: float = 5.0, out=None) -> None:
        self.store_url = store_url
        self.units = list(units)
        self.enabled = enabled and bool(self.units)
        self.desc = desc
        self.interval_s = interval_s
        self.out = out or sys.stderr
        self.samples = self.tokens = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None

    def poll(self) -> tuple[int, int]:
        from dfcache.store import open_store

        self.samples, self.tokens = committed(open_store(self.store_url, create=False), self.units)
        if self._bar is not None:
            self._bar.n = self.tokens
            self._bar.set_postfix_str(f"{self.samples}/{len(self.units)} samples", refresh=False)
            self._bar.refresh()
        return self.samples, self.tokens

    def _run(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            t0 = time.monotonic()
            try:
                self.poll()
            except Exception:  # a store that cannot be listed now is no reason to stop the work
                pass
            wait = max(self.interval_s, 10 * (time.monotonic() - t0))

    def start(self) -> "StoreProgress":
        if not self.enabled:
            return self
        from tqdm.auto import tqdm

        self._bar = tqdm(total=sum(t for _, t in self.units), desc=self.desc, unit="tok", unit_scale=True,
                         file=self.out, dynamic_ncols=True, leave=False)
        self._thread = threading.Thread(target=self._run, name="dfcache-progress", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "StoreProgress":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------ the run

def _estimate(messages, max_new_tokens: int) -> int:
    # About four characters a token, plus the completion's budget: only the balance depends on it,
    # and it must come from the command alone when the workers cannot meet.
    return sum(len(m.get("content", "")) for m in messages) // 4 + 1 + int(max_new_tokens)


@dataclass
class Share:
    """This worker's part of a run: positions of the prompt set it makes, and the job's units."""

    mine: set  # positions of the prompt set
    units: list  # the whole job's units that are missing: [(needs, tokens)] (rank 0's progress)
    job_units: int  # distinct prompts the job covers (missing, or the whole set when not meeting)
    my_units: int
    my_tokens: int


def plan_share(ctx, nodes, worker: Worker, *, missing_only: bool) -> Share:
    """Every worker computes the same shares from the same graph: one unit per distinct prompt
    (all per-sample nodes are over the same positions, so a prompt's completion, tokens, states
    and eval are made by one worker, in order). ``missing_only``: share the prompts some node
    must still produce or pull (the workers listed the store before any of them commits);
    else the whole set, weighed without looking at the store."""
    per = [n for n in nodes if n.partition is not None]
    prompts = next(n for n in per if n.stage == "prompts")
    todo: dict[int, list] = {}
    for n in per:
        for i in set(n.produce) | set(n.pull):
            todo.setdefault(i, []).append((n.partition.key, n.sample_keys[i]))
    positions = sorted(todo) if missing_only else range(len(prompts.sample_keys))
    exact: dict[int, int] = {}
    tokens = next((n for n in per if n.stage == "tokens"), None)
    if missing_only and tokens is not None:
        stored = [i for i in positions if i in tokens.local]
        if stored:
            from dfcache.samples import SampleSet

            ss = SampleSet(ctx.store, tokens.partition.key, [tokens.sample_keys[i] for i in stored])
            exact = {i: ss.rows(j, "ids") for j, i in enumerate(stored)}
    unit_of: dict[str, list[int]] = {}  # a set may hold one prompt twice: one unit
    weight: dict[str, int] = {}
    for i in positions:
        u = prompts.sample_keys[i]
        unit_of.setdefault(u, []).append(i)
        if u not in weight:
            w = exact.get(i)
            weight[u] = w if w is not None else _estimate(prompts.spec.records[i]["messages"], ctx.options.max_new_tokens)
    mine_units = share(weight.items(), worker.rank, worker.world)
    mine = {i for u in mine_units for i in unit_of[u]}
    units = [(todo[unit_of[u][0]], weight[u]) for u in sorted(weight) if unit_of[u][0] in todo]
    return Share(mine=mine, units=units, job_units=len(weight), my_units=len(mine_units),
                 my_tokens=sum(weight[u] for u in mine_units))


def restrict(nodes, mine: set) -> None:
    """Leave every per-sample node only the positions of this worker's share to produce or pull."""
    for n in nodes:
        if n.partition is not None:
            n.produce = [i for i in n.produce if i in mine]
            n.pull = [i for i in n.pull if i in mine]


class _Tagged:
    """A stream that starts every line with the worker's tag and writes whole lines at once, so
    the logs of ranks sharing a terminal interleave by lines, not by characters."""

    def __init__(self, out, tag: str) -> None:
        self.out, self.tag, self._part = out, tag, ""

    def write(self, text: str) -> int:
        *lines, self._part = (self._part + text).split("\n")
        if lines:
            self.out.write("".join(f"{self.tag}{line}\n" if line else "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return False


@dataclass
class WorkerRun:
    """What one worker of a distributed run did, and (where it could tell) the whole job."""

    worker: Worker
    ctx: object = None  # the final graph's context and nodes (None on a quiet rank)
    nodes: list | None = None
    complete: bool = True  # every sample of the graph is stored (and the report made)
    missing: int = 0  # distinct prompts still missing somewhere, when not complete
    my_units: int = 0
    my_tokens: int = 0
    job_units: int = 0
    shares_missing: bool = False

    def to_dict(self) -> dict:
        return {**self.worker.to_dict(), "shares_missing": self.shares_missing, "job_prompts": self.job_units,
                "my_prompts": self.my_units, "my_tokens": self.my_tokens, "complete": self.complete,
                "missing_prompts": self.missing}


def run_worker(upto: str, opts, store, *, worker: Worker, argv=None, log=None, out=None) -> WorkerRun:
    """One worker's part of ``dfcache run`` (any world size, 1 included).

    List the store and resolve the graph; meet the others (torchrun) so that nobody commits
    before everyone has listed; make this worker's share of the missing samples (of the whole
    set, when the workers cannot meet), committing segment by segment into the shared store;
    meet again. Then rank 0 (or, when the workers cannot meet, whichever finds the set complete)
    resolves the full graph, makes what is left (the report), and the caller prints its result.
    Nothing is merged: the store holds the union of what every worker committed. ``log`` and
    ``out``: where progress lines go (default: stderr; runner.api gives a Python caller's).
    """
    from dataclasses import replace

    from .core.execution import resolve_graph, run_graph
    from .core.graph import check_offline
    from .core.pipeline import execute

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if not worker.distributed:
        ctx, nodes = run_graph(upto, opts, store, argv=argv, log=log, out=out, worker=worker)
        return WorkerRun(worker, ctx, nodes)
    if opts.device == "cuda":
        device_for(worker, "cuda")  # a LOCAL_RANK with no GPU fails first, before anything else runs
    tagged = _Tagged(out or sys.stderr, worker.tag)
    wlog = (lambda m: (tagged.write(f"{m}\n"), tagged.flush()))
    show = opts.progress
    # Many ranks' bars on one terminal are noise: under torchrun only rank 0 shows the whole job,
    # read from the store; a --shard worker has a log of its own and shows its own bars.
    own_bars = show and not worker.can_meet
    work_opts = replace(opts, concurrency=split_concurrency(opts.concurrency, worker), progress=own_bars)
    from dfcache.samples import index_of

    def resolved():
        ctx, nodes = resolve_graph(upto, work_opts, store, argv=argv, log=wlog, out=out, worker=worker)
        if worker.can_meet:  # ranks share a terminal (a --shard worker has its own log, and its bars)
            ctx.out = _Tagged(ctx.out, worker.tag)
        return ctx, nodes

    gathered: list = []
    made: dict[str, tuple[set, set]] = {}  # partition -> sample keys to produce, to pull (every round)
    partition_of: dict[str, str] = {}  # node key -> its partition, over every round
    my_units = my_tokens = job_units = 0
    with Group(worker, log=wlog) as group:
        ctx, nodes = resolved()
        while True:  # one round, or one per turn of a multi-turn set (its later turns need the answers)
            check_offline(ctx, nodes)
            if any(n.needs == "gpu" and n.produce for n in nodes):
                device_for(worker, "cuda")  # a LOCAL_RANK with no GPU fails now, not after others' work
            sh = plan_share(ctx, nodes, worker, missing_only=group.active)
            full = {n.key: (list(n.produce), list(n.pull), n.status) for n in nodes if n.partition is not None}
            partition_of.update((n.key, n.partition.key) for n in nodes if n.partition is not None)
            for n in nodes:  # what the job makes, by sample key: an earlier turn's samples count as made
                if n.partition is not None:
                    produce, pull = made.setdefault(n.partition.key, (set(), set()))
                    produce.update(n.sample_keys[i] for i in n.produce)
                    pull.update(n.sample_keys[i] for i in n.pull)
            group.barrier()  # every worker has listed the store; only now may anyone commit
            restrict(nodes, sh.mine)
            work = [n for n in nodes if n.partition is not None and (n.produce or n.pull)]
            progress = StoreProgress(ctx.store.url, sh.units, enabled=show and group.active and worker.main,
                                     desc=f"{worker.world} ranks")
            with progress:
                execute(ctx, work)
            # By partition: a node's key names its sample set, which a later turn's round grows.
            mine = {n.partition.key: (n.pulled, n.produced) for n in nodes if n.partition is not None}
            gathered += group.gather({"counts": mine, "work_done": list(ctx.work_done)}) or []
            my_units, my_tokens, job_units = my_units + sh.my_units, my_tokens + sh.my_tokens, job_units + sh.job_units
            waited = ctx.waiting_turns
            if waited is None:
                break
            # The graph ended at a turn's completions (runner/core/pipeline.py later_turns). Once
            # every worker's are stored (torchrun: all have passed the gather; --shard: this
            # worker finds them all), the next turn is shared like the first, not left to one.
            index_of(ctx.store).refresh()
            ctx_next, nodes_next = resolved()
            if not group.agree(ctx_next.waiting_turns != waited):
                break  # --shard: other workers still owe answers to that turn (a later run goes on)
            wlog(f"prompts: {waited}; they are stored now, so the workers go on with that turn")
            ctx, nodes = ctx_next, nodes_next
        met = group.active
    result = WorkerRun(worker, my_units=my_units, my_tokens=my_tokens, job_units=job_units, shares_missing=met)
    if met and not worker.main:
        return result  # rank 0 speaks for the job
    index_of(ctx.store).refresh()  # it was listed before the other workers committed
    ctx2, nodes2 = resolve_graph(upto, replace(opts, progress=show), ctx.store, argv=argv, log=log, out=out,
                                  worker=worker)
    left = [n for n in nodes2 if n.partition is not None and (n.produce or n.pull)]
    if left and not met:
        # Other workers' shares are not done (yet): this one reports its own part only.
        result.complete = False
        result.missing = len({i for n in left for i in n.produce + n.pull})
        result.ctx, result.nodes = ctx, nodes
        for n in nodes:
            if n.partition is not None:
                n.produce, n.pull, n.status = full[n.key]
        return result
    check_offline(ctx2, nodes2)
    execute(ctx2, nodes2)  # the report; under torchrun also anything no share held (a concurrent writer)
    by_key = {n.key: n for n in nodes}
    counts = [g["counts"] for g in (gathered or [])]
    for n2 in nodes2:
        n1 = by_key.get(n2.key)
        if n2.partition is None or n1 is None:
            continue
        # What was stored when the job started, and what it made or pulled (an earlier turn's samples
        # are stored by the time of the last round, but the job made them).
        produce, pull = made.get(n1.partition.key, (set(), set()))
        keys = n2.sample_keys
        n2.local = {i for i in n1.local if keys[i] not in produce and keys[i] not in pull}
        n2.in_remote = n1.in_remote
        last_produce, last_pull, n2.status = full[n1.key]
        n2.produce = sorted(set(last_produce) | {i for i, k in enumerate(keys) if k in produce})
        n2.pull = sorted((set(last_pull) | {i for i, k in enumerate(keys) if k in pull}) - set(n2.produce))
        n2.pulled += sum(c.get(n1.partition.key, (0, 0))[0] for c in counts)
        n2.produced += sum(c.get(n1.partition.key, (0, 0))[1] for c in counts)
    # An earlier turn's round worked on nodes of a smaller graph: named by the final graph's node
    # of the same partition, as a run of one process names them (core/execution.py _count_earlier).
    final = {n.partition.key: n.key for n in nodes2 if n.partition is not None}
    done = [final.get(partition_of.get(k), k) for g in (gathered or []) for k in g["work_done"]]
    keys2 = {n.key for n in nodes2}
    ctx2.work_done = [k for k in dict.fromkeys(done + ctx2.work_done) if k in keys2]
    result.ctx, result.nodes = ctx2, nodes2
    return result
