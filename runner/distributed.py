"""Many workers, one store, no coordinator: who this worker is and which samples are its own.

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

import heapq
import re
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Mapping, Sequence

from dfcache.errors import BadInputError, UsageError

__all__ = ["Group", "StoreProgress", "Worker", "cuda_device", "discover", "parse_shard", "share", "shares",
           "split_concurrency"]

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_SHARD_FIX = ("give I/N with 0 <= I < N (worker I of N; e.g. --shard 0/4), or --shard slurm in a Slurm "
              "array job (then I is SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN and N is SLURM_ARRAY_TASK_COUNT).")
# The workers wait for the slowest at the end; a worker that dies is torchrun's to handle (it
# stops the others), so this only bounds a wait nobody is watching.
BARRIER_TIMEOUT_S = 7 * 24 * 3600


@dataclass(frozen=True)
class Worker:
    """This process's place in a distributed run (rank 0 of 1 when run alone)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0  # which GPU of its host (cuda:LOCAL_RANK)
    launcher: str = "single"  # single | torchrun | shard | torchrun+shard
    can_meet: bool = False  # every worker of ``world`` can reach one barrier (torchrun, no --shard)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def tag(self) -> str:
        return f"[rank {self.rank}/{self.world}] " if self.distributed else ""

    def to_dict(self) -> dict:
        return {"rank": self.rank, "world": self.world, "local_rank": self.local_rank, "launcher": self.launcher,
                "shares_missing": self.can_meet}


def parse_shard(text: str | None, env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``"I/N"`` -> (I, N); ``"slurm"`` reads the Slurm array variables; None -> None."""
    if text is None:
        return None
    if text.strip().lower() == "slurm":
        from dfcache.config import launcher_env

        env = launcher_env() if env is None else env
        try:
            i = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
            n = int(env["SLURM_ARRAY_TASK_COUNT"])
        except KeyError as e:
            raise UsageError(f"--shard slurm: {e.args[0]} is not set, so this is not a Slurm array task; "
                             f"{_SHARD_FIX}") from None
        except ValueError:
            raise UsageError("--shard slurm: the SLURM_ARRAY_TASK_* variables are not integers; "
                             f"{_SHARD_FIX}") from None
        if not 0 <= i < n:
            raise UsageError(f"--shard slurm: task {i} of {n} (an array with a step, e.g. --array=0-15:2, "
                             f"has gaps); pass --shard I/N yourself: {_SHARD_FIX}")
        return i, n
    m = _SHARD.match(text)
    if not m:
        raise UsageError(f"--shard {text!r} is not of the form I/N; {_SHARD_FIX}")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or i >= n:
        raise UsageError(f"--shard {text!r}: worker {i} of {n} does not exist; {_SHARD_FIX}")
    return i, n


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value.strip() == "":
        if default is None:
            raise UsageError(f"WORLD_SIZE is set but {name} is not: start the workers with torchrun (it sets "
                             "RANK, WORLD_SIZE and LOCAL_RANK), or unset WORLD_SIZE and use --shard I/N.")
        return default
    try:
        out = int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer; start the workers with torchrun, or unset "
                         "RANK/WORLD_SIZE/LOCAL_RANK and use --shard I/N.") from None
    if out < 0:
        raise UsageError(f"{name}={value!r} is negative; start the workers with torchrun.")
    return out


def discover(shard: str | None = None, env: Mapping[str, str] | None = None) -> Worker:
    """This worker's place: torchrun's variables, ``--shard I/N``, both, or neither.

    With both, each torchrun group of W workers is shard I of N: worker ``I*W + RANK`` of ``N*W``
    (a Slurm array of torchrun jobs).
    """
    if env is None:
        from dfcache.config import launcher_env

        env = launcher_env()
    i_n = parse_shard(shard, env)
    rank, world, local = 0, 1, 0
    torchrun = "WORLD_SIZE" in env or "RANK" in env
    if torchrun:
        if "WORLD_SIZE" not in env:
            raise UsageError("RANK is set but WORLD_SIZE is not: start the workers with torchrun, or unset RANK.")
        world = _env_int(env, "WORLD_SIZE")
        rank = _env_int(env, "RANK")
        local = _env_int(env, "LOCAL_RANK", default=0)
        if world < 1 or rank >= world:
            raise UsageError(f"RANK={rank} with WORLD_SIZE={world}: no such worker; start the workers with torchrun.")
    if i_n is None:
        return Worker(rank, world, local, "torchrun" if torchrun else "single",
                      can_meet=torchrun and world > 1 and "MASTER_ADDR" in env and "MASTER_PORT" in env)
    i, n = i_n
    if not torchrun:
        return Worker(i, n, 0, "shard", can_meet=False)
    return Worker(i * world + rank, n * world, local, "torchrun+shard", can_meet=False)


# ------------------------------------------------------------------------------------ the share


def shares(items: Iterable[tuple[str, int]], world: int) -> list[list[str]]:
    """Every worker's share of ``items`` ((key, tokens) pairs), balanced by tokens.

    Deterministic in the items alone (not their order): sorted by (tokens descending, key), each
    goes to the least-loaded worker (ties: fewer items, then lower rank). The shares are disjoint
    and their union is every distinct key; each lists its keys in that sorted order. The largest
    load exceeds the smallest by at most the largest item.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise UsageError(f"a world of {world!r} workers: give at least one.")
    weight: dict[str, int] = {}
    for key, tokens in items:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise UsageError(f"sample {key}: {tokens!r} tokens; give a count >= 0.")
        weight[key] = max(weight.get(key, 0), tokens)
    order = sorted(weight, key=lambda k: (-weight[k], k))
    out: list[list[str]] = [[] for _ in range(world)]
    heap = [(0, 0, r) for r in range(world)]
    for key in order:
        load, count, r = heapq.heappop(heap)
        out[r].append(key)
        heapq.heappush(heap, (load + weight[key], count + 1, r))
    return out


def share(items: Iterable[tuple[str, int]], rank: int, world: int) -> list[str]:
    """Worker ``rank``'s part of :func:`shares`."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < max(1, world):
        raise UsageError(f"rank {rank!r} of {world} workers does not exist.")
    return shares(items, world)[rank]


def split_concurrency(total: int, worker: Worker) -> int:
    """This worker's part of a server's ``--concurrency`` budget, which the workers share.

    The parts add up to ``total`` when there are at least as many requests as workers; with
    fewer, every worker still sends one (a worker with nothing to send would leave its share of
    the prompts undone), so the server sees ``world`` at once.
    """
    total = max(1, int(total))
    base, extra = divmod(total, worker.world)
    return max(1, base + (1 if worker.rank < extra else 0))


def cuda_device(worker: Worker) -> str:
    """``cuda:LOCAL_RANK``, made the current device, so that plain ``"cuda"`` means it too."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if worker.local_rank >= count:
        from dfcache.config import launcher_env

        visible = launcher_env().get("CUDA_VISIBLE_DEVICES")
        raise BadInputError(f"{worker.tag}LOCAL_RANK {worker.local_rank} needs GPU {worker.local_rank}, but torch "
                            f"sees {count} CUDA device(s){f' (CUDA_VISIBLE_DEVICES={visible})' if visible else ''}. "
                            "Start at most that many workers per host (torchrun --nproc-per-node), or run on CPU "
                            "(--device cpu).")
    torch.cuda.set_device(worker.local_rank)
    return f"cuda:{worker.local_rank}"


def device_for(worker: Worker, device_type: str) -> str:
    """The torch device this worker computes on for a planned device type (cuda | cpu)."""
    return cuda_device(worker) if device_type == "cuda" else "cpu"


# ------------------------------------------------------------------------------------ meeting


class Group:
    """The barrier and the final gather, when the workers can meet (else no-ops).

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
