"""The stage graph: nodes, their resolution (local → remotes → compute) and execution.

A *stage* is a module in ``runner/stages/`` with, at its top, ``NAME``, ``VERSION`` and its key
recipe, a ``build(ctx, ...)`` function returning its node(s) and a ``produce(ctx, nodes)``
function doing the work (and optionally ``preflight(ctx, nodes)``, run before any stage starts,
for checks of what is outside such as a server's readiness). ``build`` resolves inputs (fingerprints, parameters) and computes keys
without doing any work and without importing torch; ``produce`` writes one artifact per node
through ``ctx.store``. Nodes of one stage that share a ``group`` are produced by one call (all
missing hidden-state layers come from one forward pass).

Resolution order for every node: the local store, then each remote in order, then compute.
Offline, every missing node that needs the network is reported together before any work.
"""

from __future__ import annotations

import importlib
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from dfcache.errors import OfflineMissingError, UsageError
from dfcache.keys import compute_key

from .options import EvalOptions

NEEDS = ("none", "cpu", "gpu", "network")


@dataclass
class Node:
    """One artifact of the graph: its key, what producing it needs, and where it stands."""

    stage: str
    key: str
    needs: str
    inputs: dict
    upstream: dict
    version: int
    label: str = ""
    group: str | None = None
    contacts: str | None = None  # what producing it would contact (a URL)
    fix: str | None = None  # a command that produces it on a machine that can
    summary: str = ""
    deps: list["Node"] = field(default_factory=list)
    payload: Any = None  # stage-private, never keyed (e.g. a resolved local path)
    status: str = ""  # cached | remote | compute (cpu) | compute (gpu) | network | not needed
    remote: Any = None  # the remote store it was found in
    # Per-sample nodes (see runner/sampling.py); None for set-level nodes (a report).
    partition: Any = None  # dfcache.samples.Partition
    upstream_samples: list[str] | None = None  # per position of the prompt set
    sample_keys: list[str] | None = None
    ids: list[str] | None = None  # prompt ids per position (messages name them)
    problem: str | None = None  # why missing samples cannot be produced here (hardware)
    precheck: Any = None  # callable run before any work when this run produces samples (weights)
    local: set = field(default_factory=set)  # positions stored locally
    in_remote: set = field(default_factory=set)  # positions only in a remote
    remote_of: dict = field(default_factory=dict)  # sample key -> remote store
    pull: list[int] = field(default_factory=list)  # positions this run pulls
    produce: list[int] = field(default_factory=list)  # positions this run computes or fetches
    pulled: int = 0  # distinct samples pulled / produced by this run
    produced: int = 0

    @classmethod
    def make(cls, stage: str, version: int, *, inputs: dict, upstream: dict | None = None, needs: str,
             deps: list["Node"] | None = None, **kw) -> "Node":
        """Compute the node's key from (stage, version, inputs, upstream keys)."""
        if needs not in NEEDS:
            raise ValueError(f"needs={needs!r}")
        upstream = upstream or {}
        key = compute_key(stage, version, inputs, upstream)
        return cls(stage=stage, key=key, needs=needs, inputs=inputs, upstream=upstream,
                   version=version, deps=list(deps or []), **kw)

    @classmethod
    def make_samples(cls, stage: str, version: int, *, inputs: dict, upstream_samples: list[str],
                     partition_upstream: dict | None = None, ids: list[str], needs: str,
                     deps: list["Node"] | None = None, **kw) -> "Node":
        """A per-sample node over the prompt set: its partition and one sample key per position.
        Its ``key`` names the ordered set (a report is keyed by it), never stored itself."""
        from dfcache.samples import Partition

        from .sampling import set_key

        if needs not in NEEDS:
            raise ValueError(f"needs={needs!r}")
        part = Partition(stage, version, inputs, dict(partition_upstream or {}))
        keys = part.sample_keys(upstream_samples)
        return cls(stage=stage, key=set_key(part.key, keys), needs=needs, inputs=inputs,
                   upstream=dict(partition_upstream or {}), version=version, deps=list(deps or []),
                   partition=part, upstream_samples=list(upstream_samples), sample_keys=keys, ids=list(ids), **kw)

    def positions_distinct(self, positions) -> list[int]:
        """The first position of each distinct sample among ``positions`` (a set may repeat one)."""
        seen, out = set(), []
        for i in positions:
            k = self.sample_keys[i]
            if k not in seen:
                seen.add(k)
                out.append(i)
        return out

    def samples_dict(self) -> dict | None:
        if self.partition is None:
            return None
        from .sampling import sample_counts

        counts = sample_counts(self)
        counts["pulled"], counts["produced"] = self.pulled, self.produced
        return counts

    def to_plan_dict(self) -> dict:
        d = {"stage": self.stage, "key": self.key, "status": self.status, "needs": self.needs,
             "label": self.label or self.stage, "upstream": self.upstream,
             "contacts": self.contacts, "fix": self.fix}
        if self.partition is not None:
            d["partition"] = self.partition.key
            d["samples"] = self.samples_dict()
        return d


class RunContext:
    """What stages see: the store, the options, remotes, progress output and shared objects."""

    def __init__(self, store, options: EvalOptions, *, remotes: list | None = None, argv: list[str] | None = None,
                 out=None) -> None:
        self.store = store
        self.options = options
        self.remotes = list(remotes or [])
        self.argv = list(argv) if argv is not None else list(sys.argv[1:])
        self.out = out or sys.stderr
        self.shared: dict[str, Any] = {}  # loaded models etc., shared between stages of one run
        self.work_done: list[str] = []  # keys produced in this run (tests and --json read it)

    def log(self, message: str) -> None:
        print(message, file=self.out, flush=True)

    def progress(self, total: int | None, desc: str, unit: str = "it", unit_scale: bool = False):
        from tqdm.auto import tqdm

        disable = not self.options.progress
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable,
                    file=self.out, dynamic_ncols=True, leave=False)

    def command_with(self, add: str | None = None, drop: tuple[str, ...] = ()) -> str:
        """This run's command line with flags dropped or added (for "how to fix" messages)."""
        args = []
        skip = False
        for a in self.argv:
            if skip:
                skip = False
                continue
            if a in drop:
                skip = not a.startswith("--offline")
                continue
            if any(a.startswith(d + "=") for d in drop):
                continue
            args.append(a)
        cmd = "dfcache " + shlex.join(args)  # quoted, so it can be pasted into a shell
        return cmd + (f" {add}" if add else "")


def stage_module(name: str):
    return importlib.import_module(f"runner.stages.{name}")


def topo_order(roots: list[Node]) -> list[Node]:
    seen: dict[str, Node] = {}
    order: list[Node] = []

    def visit(n: Node) -> None:
        if n.key in seen:
            return
        seen[n.key] = n
        for d in n.deps:
            visit(d)
        order.append(n)

    for r in roots:
        visit(r)
    return order


def resolve(ctx: RunContext, nodes: list[Node]) -> list[Node]:
    """Give every node its status without doing any work.

    Set-level nodes: stored locally, in a remote, or to produce. Per-sample nodes: where each
    sample is, then what this run must pull and produce (runner/sampling.py): a stored report
    needs nothing under it; a sample nobody downstream needs is left alone."""
    from .sampling import assign_demand, locate

    for n in nodes:
        if n.partition is not None:
            locate(ctx, n, ctx.log)
            continue
        if ctx.store.has(n.key):
            n.status = "cached"
            continue
        n.remote = None
        for remote in ctx.remotes:
            try:
                if remote.has(n.key):
                    n.remote = remote
                    break
            except Exception as e:  # a remote that cannot be listed is not a reason to stop planning
                ctx.log(f"warning: remote {getattr(remote, 'url', remote)} could not be checked: {e}")
        n.status = "remote" if n.remote is not None else _compute_status(n)
    assign_demand(nodes)
    for n in nodes:
        if n.partition is None:
            continue
        if n.produce:
            n.status = _compute_status(n)
        elif n.pull:
            n.status = "remote"
        else:
            n.status = "cached" if len(n.local) == len(n.sample_keys) else "not needed"
    problems = [n for n in nodes if n.produce and n.problem]
    if problems:
        from dfcache.errors import BadInputError

        n = problems[0]
        raise BadInputError(f"{len(n.produce)} sample(s) of {n.label or n.stage} are in no store and cannot be "
                            f"computed here. {n.problem}")
    for n in nodes:
        if n.produce and n.precheck is not None:
            n.precheck()
    return nodes


def _compute_status(n: Node) -> str:
    if n.needs == "network":
        return "network"
    return "compute (gpu)" if n.needs == "gpu" else "compute (cpu)"


def check_offline(ctx: RunContext, nodes: list[Node]) -> None:
    """Offline: report every missing node (or sample) that needs the network, together, before
    any work; per-sample nodes say how many samples and the first few prompt ids."""
    if not ctx.options.offline:
        return
    missing = [n for n in nodes if n.status == "network"]
    if not missing:
        return
    lines = [f"offline mode is on and {len(missing)} node(s) miss what only the network can produce:"]
    for n in missing:
        if n.partition is not None:
            distinct = n.positions_distinct(n.produce)
            ids = [n.ids[i] for i in distinct[:5]]
            more = f" and {len(distinct) - 5} more" if len(distinct) > 5 else ""
            lines.append(f"  - {n.label or n.stage} {n.key}: {len(distinct)} of {len(n.sample_keys)} sample(s) missing "
                         f"(prompt ids {', '.join(map(repr, ids))}{more}; would contact {n.contacts or 'the network'})")
        else:
            lines.append(f"  - {n.label or n.stage} {n.key} (would contact {n.contacts or 'the network'})")
        if n.fix:
            lines.append(f"      produce it with: {n.fix}")
    lines.append("Run that on a machine that reaches the server and share the store (dfcache push/pull), "
                 "or turn offline mode off.")
    raise OfflineMissingError("\n".join(lines), missing=[n.to_plan_dict() for n in missing])


def execute(ctx: RunContext, nodes: list[Node]) -> None:
    """Produce what resolve() said, in dependency order: pull what remotes hold, then compute
    (or fetch) the rest; per-sample nodes only their missing samples."""
    pending = [n for n in nodes if n.status not in ("cached", "not needed")]
    # Stages that talk to something outside (a server) check it once, before any work starts.
    for stage in dict.fromkeys(n.stage for n in pending if n.status != "remote"):
        check = getattr(stage_module(stage), "preflight", None)
        if check is not None:
            check(ctx, [n for n in pending if n.stage == stage and n.status != "remote"])
    done: set[str] = set()
    for n in pending:
        if n.partition is not None:
            _execute_samples(ctx, n, pending, done)
            continue
        if n.key in done or ctx.store.has(n.key):
            done.add(n.key)
            continue
        if n.status == "remote":
            from dfcache.transfer import pull_keys

            pull_keys(n.remote, ctx.store, [n.key], with_upstream=False, progress=ctx.options.progress)
            done.add(n.key)
            continue
        stage_module(n.stage).produce(ctx, [n])
        if not ctx.store.has(n.key):
            raise UsageError(f"internal: stage {n.stage} did not commit {n.key}")
        done.add(n.key)
        ctx.work_done.append(n.key)


def _execute_samples(ctx: RunContext, n: Node, pending: list[Node], done: set[str]) -> None:
    from dfcache.samples import index_of

    if n.pull:
        from dfcache.sample_transfer import pull_samples

        by_remote: dict = {}
        for i in n.positions_distinct(n.pull):
            k = n.sample_keys[i]
            by_remote.setdefault(id(n.remote_of[k]), (n.remote_of[k], []))[1].append(k)
        for remote, keys in by_remote.values():
            r = pull_samples(remote, ctx.store, {n.partition.key: keys}, progress=ctx.options.progress)
            n.pulled += r.copied
    if n.produce and n.key not in done:
        batch = [m for m in pending if m.stage == n.stage and m.partition is not None and m.produce
                 and m.key not in done and (m is n or (n.group is not None and m.group == n.group))]
        stage_module(n.stage).produce(ctx, batch)
        for m in batch:
            done.add(m.key)
            lacking = index_of(ctx.store).missing(m.partition.key, [m.sample_keys[i] for i in m.produce])
            if lacking:
                raise UsageError(f"internal: stage {m.stage} did not commit {len(lacking)} sample(s) of {m.label}")
            m.produced = len(m.positions_distinct(m.produce))
            ctx.work_done.append(m.key)
    done.add(n.key)
