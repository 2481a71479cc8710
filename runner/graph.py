"""The stage graph: key recipes, nodes, the run context, and resolution (local → remotes → compute).

A *stage* is a module (or a package, where it has helpers) in ``runner/stages/`` with, at its
top, ``KEY``, its :class:`KeyRecipe` (``NAME`` and ``VERSION`` come from it), a
``build(ctx, ...)`` function returning its node(s) through ``KEY.node(...)`` and a
``produce(ctx, nodes)`` function doing the work (and optionally ``preflight(ctx, nodes)``, run
before any stage starts, for checks of what is outside such as a server's readiness). ``build``
resolves inputs (fingerprints, parameters) and computes keys without doing any work and without
importing torch; ``produce`` writes one artifact per node through ``ctx.store``. Nodes of one
stage that share a ``group`` are produced by one call (all missing hidden-state layers come from
one forward pass).

This module imports no stage: stages import it, and ``runner/pipeline.py`` holds the table of
stages and runs them.

Resolution order for every node: the local store, then each remote in order, then compute.
Offline, every missing node that needs the network is reported together before any work.
"""

from __future__ import annotations

import shlex
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dfcache.errors import InternalError, OfflineMissingError
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


@dataclass(frozen=True)
class KeyRecipe:
    """What a stage's key covers, as data next to the stage's ``build()``.

    ``build()`` makes its nodes with :meth:`node`, which refuses inputs or upstream roles the
    recipe does not list (and listed ones that are missing), so the recipe cannot drift from the
    code; the stage's docstring shows :meth:`describe` (tests/test_architecture.py checks it).
    The key itself is ``compute_key(stage, version, inputs, upstream)``, unchanged.
    """

    stage: str
    version: int
    inputs: dict[str, str]  # name -> what it is and how it is resolved
    upstream: dict[str, str] = field(default_factory=dict)  # role -> whose key(s)
    optional: frozenset[str] = frozenset()  # inputs only some configurations have

    def node(self, *, inputs: dict, upstream: dict | None = None, needs: str, **kw) -> Node:
        upstream = upstream or {}
        extra = sorted(set(inputs) - set(self.inputs))
        missing = sorted(set(self.inputs) - self.optional - set(inputs))
        roles = sorted(set(upstream) ^ set(self.upstream))
        if extra or missing or roles:
            raise InternalError(f"stage {self.stage} built a node that its key recipe does not describe "
                                f"(inputs not in the recipe: {extra}, missing: {missing}, upstream roles "
                                f"differing: {roles}); update KEY in the stage with the change.")
        return Node.make(self.stage, self.version, inputs=inputs, upstream=upstream, needs=needs, **kw)

    def describe(self) -> str:
        """The recipe as the stage's docstring shows it."""
        width = max(len(n) for n in [*self.inputs, *self.upstream, "x" * 12]) + 2

        def rows(items: dict[str, str]) -> list[str]:
            out = []
            for name, what in items.items():
                what = what + (" (only some runs have it)" if name in self.optional else "")
                wrapped = textwrap.wrap(what, 96 - width - 4) or [""]
                out.append(f"    {name:<{width}}{wrapped[0]}")
                out += [f"    {'':<{width}}{w}" for w in wrapped[1:]]
            return out or ["    (none)"]

        return "\n".join([f"key = compute_key({self.stage!r}, {self.version}, inputs, upstream)", "inputs:",
                          *rows(self.inputs), "upstream:", *rows(self.upstream)])


@dataclass
class RunCache:
    """Objects a run makes once and several stages use (loading a target takes seconds)."""

    resolved_targets: dict[tuple, Any] = field(default_factory=dict)  # (target, revision) -> ResolvedTarget
    targets: dict[tuple[str, str], Any] = field(default_factory=dict)  # (dir, kernel label) -> loaded target
    tokenizers: dict[str, Any] = field(default_factory=dict)  # target dir -> tokenizer
    served_models: dict[tuple, str] = field(default_factory=dict)  # (base URL, api, wanted) -> model name


@dataclass
class RunHooks:
    """Callbacks a caller (a test, a benchmark) gives a run; none changes what is computed."""

    # after each checkpointed extraction window: (window index, tokens done)
    on_extract_checkpoint: Callable[[int, int], None] | None = None


class RunContext:
    """What stages see: the store, the options (validated), remotes, progress output, and the
    run's typed shared state (``cache``, ``hooks``, ``last_extract_stats``)."""

    def __init__(self, store, options: EvalOptions, *, remotes: list | None = None, argv: list[str] | None = None,
                 out=None, cache: RunCache | None = None, hooks: RunHooks | None = None) -> None:
        options.validate()
        self.store = store
        self.options = options
        self.remotes = list(remotes or [])
        self.argv = list(argv) if argv is not None else list(sys.argv[1:])
        self.out = out or sys.stderr
        self.cache = cache if cache is not None else RunCache()
        self.hooks = hooks if hooks is not None else RunHooks()
        self.last_extract_stats = None  # the hidden-states stage's last ExtractStats (bench, tests)
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
