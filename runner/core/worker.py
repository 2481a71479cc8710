"""Who this worker is in a run: its rank, world and GPU (:class:`Worker`, found by :func:`discover`
from torchrun's variables or ``--shard I/N``), its share of the samples (:func:`shares`, balanced by
tokens) and its torch device. The worker travels on the run context (``RunContext.worker``): the
stages and the target's loader read it there, and nothing keeps it in a module global.

The distributed run itself (meeting, progress, one worker's run) is :mod:`runner.distributed`;
docs/distributed.md says how the shares are chosen.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from dfcache.errors import BadInputError, UsageError

__all__ = ["Worker", "cuda_device", "device_for", "discover", "parse_shard", "share", "shares", "split_concurrency"]

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_SHARD_FIX = ("give I/N with 0 <= I < N (worker I of N; e.g. --shard 0/4), or --shard slurm in a Slurm "
              "array job (then I is SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN and N is SLURM_ARRAY_TASK_COUNT).")


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
