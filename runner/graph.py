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
    status: str = ""  # cached | remote | compute (cpu) | compute (gpu) | network
    remote: Any = None  # the remote store it was found in

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

    def to_plan_dict(self) -> dict:
        return {"stage": self.stage, "key": self.key, "status": self.status, "needs": self.needs,
                "label": self.label or self.stage, "upstream": self.upstream,
                "contacts": self.contacts, "fix": self.fix}


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
    """Give every node its status without doing any work."""
    for n in nodes:
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
        if n.remote is not None:
            n.status = "remote"
        elif n.needs == "network":
            n.status = "network"
        elif n.needs == "gpu":
            n.status = "compute (gpu)"
        else:
            n.status = "compute (cpu)"
    return nodes


def check_offline(ctx: RunContext, nodes: list[Node]) -> None:
    """Offline: report every missing node that needs the network, together, before any work."""
    if not ctx.options.offline:
        return
    missing = [n for n in nodes if n.status == "network"]
    if not missing:
        return
    lines = [f"offline mode is on and {len(missing)} artifact(s) are missing that need the network:"]
    for n in missing:
        lines.append(f"  - {n.label or n.stage} {n.key} (would contact {n.contacts or 'the network'})")
        if n.fix:
            lines.append(f"      produce it with: {n.fix}")
    lines.append("Run that on a machine that reaches the server and share the store (dfcache push/pull), "
                 "or turn offline mode off.")
    raise OfflineMissingError("\n".join(lines), missing=[n.to_plan_dict() for n in missing])


def execute(ctx: RunContext, nodes: list[Node]) -> None:
    """Produce every node that is not cached, in dependency order."""
    pending = [n for n in nodes if n.status != "cached"]
    # Stages that talk to something outside (a server) check it once, before any work starts.
    for stage in dict.fromkeys(n.stage for n in pending if n.status != "remote"):
        check = getattr(stage_module(stage), "preflight", None)
        if check is not None:
            check(ctx, [n for n in pending if n.stage == stage])
    done: set[str] = set()
    for n in pending:
        if n.key in done or ctx.store.has(n.key):
            done.add(n.key)
            continue
        if n.status == "remote":
            from dfcache.transfer import pull_keys

            pull_keys(n.remote, ctx.store, [n.key], with_upstream=False, progress=ctx.options.progress)
            done.add(n.key)
            continue
        group = [m for m in pending if m.stage == n.stage and m.group is not None and m.group == n.group
                 and m.key not in done and m.status != "remote" and not ctx.store.has(m.key)]
        batch = group or [n]
        stage_module(n.stage).produce(ctx, batch)
        for m in batch:
            if not ctx.store.has(m.key):
                raise UsageError(f"internal: stage {m.stage} did not commit {m.key}")
            done.add(m.key)
            ctx.work_done.append(m.key)
