"""The worker's place and its share of the samples (runner/core/worker.py)."""

from __future__ import annotations

import random

import pytest

from dfcache.errors import EXIT_USAGE, UsageError
from runner.core.worker import discover, parse_shard, share, shares, split_concurrency


def _items(n, seed=0):
    rng = random.Random(seed)
    return [(f"{rng.getrandbits(128):032x}", rng.randint(1, 4000)) for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shares_disjoint_complete_balanced(world):
    items = _items(500)
    parts = shares(items, world)
    flat = [k for p in parts for k in p]
    assert len(flat) == len(set(flat)) == len(items)
    assert set(flat) == {k for k, _ in items}
    tok = dict(items)
    loads = [sum(tok[k] for k in p) for p in parts]
    assert max(loads) - min(loads) <= max(tok.values())
    assert all(share(items, r, world) == parts[r] for r in range(world))


def test_shares_deterministic_whatever_the_order():
    items = _items(200, seed=1)
    shuffled = list(items)
    random.Random(5).shuffle(shuffled)
    assert shares(items, 4) == shares(shuffled, 4)


def test_shares_by_tokens_not_counts():
    items = [("a" * 32, 1000)] + [(f"{i:032x}", 1) for i in range(10)]
    big, small = shares(items, 2)
    assert big == ["a" * 32] and len(small) == 10


def test_zero_token_samples_spread():
    parts = shares([(f"{i:032x}", 0) for i in range(9)], 3)
    assert [len(p) for p in parts] == [3, 3, 3]


@pytest.mark.parametrize("bad", ["3/2", "2/2", "1", "a/b", "-1/2", "0/0", ""])
def test_bad_shard_is_usage_error(bad):
    with pytest.raises(UsageError) as e:
        parse_shard(bad)
    assert e.value.exit_code == EXIT_USAGE and "I/N" in str(e.value)


def test_discover():
    assert discover(None, {}).world == 1
    w = discover("2/5", {})
    assert (w.rank, w.world, w.launcher, w.can_meet) == (2, 5, "shard", False)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    w = discover(None, env)
    assert (w.rank, w.world, w.local_rank, w.can_meet) == (1, 2, 1, True)
    w = discover("1/3", env)  # a Slurm array of torchrun jobs
    assert (w.rank, w.world, w.can_meet) == (3, 6, False)
    slurm = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert discover("slurm", slurm).rank == 3
    for bad in ({"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "2", "WORLD_SIZE": "2"}, {"RANK": "0"}):
        with pytest.raises(UsageError):
            discover(None, bad)
    with pytest.raises(UsageError):
        discover("slurm", {})


def test_concurrency_is_shared():
    for total, world in ((8, 2), (10, 3), (16, 16)):
        parts = [split_concurrency(total, discover(f"{r}/{world}", {})) for r in range(world)]
        assert sum(parts) == total
    assert split_concurrency(2, discover("3/4", {})) == 1
