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

This module imports no stage: stages import it, and ``runner/core/pipeline.py`` holds the table of
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
from .worker import Worker

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
    spec: "StageSpec | None" = None  # stage-private, never keyed (a resolved local path, nodes it reads)
    status: str = ""  # cached | remote | compute (cpu) | compute (gpu) | network | not needed
    remote: Any = None  # the remote store it was found in
    # Per-sample nodes (see runner/core/sampling.py); None for set-level nodes (a report).
    partition: Any = None  # dfcache.samples.Partition
    upstream_samples: list[str] | None = None  # per position of the prompt set
    sample_keys: list[str] | None = None
    sample_key_bytes: bytes | None = None  # the same as 16-byte values, when the keys memo gave them
    sample_key_distinct: bytes | None = None  # their sorted distinct values, with sample_key_bytes
    ids: list[str] | None = None  # prompt ids per position (messages name them)
    problem: str | None = None  # why missing samples cannot be produced here (hardware)
    precheck: Any = None  # callable run before any work when this run produces samples (weights)
    local: set | range = field(default_factory=set)  # positions stored locally (a range: all of them)
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
                     deps: list["Node"] | None = None, upstream_bytes: bytes | None = None, **kw) -> "Node":
        """A per-sample node over the prompt set: its partition and one sample key per position.
        Its ``key`` names the ordered set (a report is keyed by it), never stored itself."""
        from dfcache.samples import Partition

        from .sampling import sample_keys, set_key

        if needs not in NEEDS:
            raise ValueError(f"needs={needs!r}")
        part = Partition(stage, version, inputs, dict(partition_upstream or {}))
        keys, as_bytes, distinct = sample_keys(part, upstream_samples, upstream_bytes)
        return cls(stage=stage, key=set_key(part.key, keys), needs=needs, inputs=inputs,
                   upstream=dict(partition_upstream or {}), version=version, deps=list(deps or []),
                   partition=part, upstream_samples=list(upstream_samples), sample_keys=keys,
                   sample_key_bytes=as_bytes, sample_key_distinct=distinct, ids=list(ids), **kw)

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

# ------------------------------------------------------------------------------ per-stage specs
# What a stage's produce() needs beyond the keyed inputs: never keyed, one typed record per stage
# (types of the layers above are named in strings: this module imports none of them).


@dataclass
class PromptsSpec:
    records: list  # one record (its "messages" and fields) per position of the prompt set
    # position -> every user turn of a multi-turn record (suite:mt-bench): its later turns are asked
    # after the target's answers (runner/core/pipeline.py later_turns)
    turns: dict[int, list[str]] = field(default_factory=dict)


@dataclass
class CompletionsSpec:
    target_dir: str
    prompts: Node
    server: str | None = None  # the URL, when a server produces them


@dataclass
class TokensSpec:
    target_dir: str
    completions: Node | None = None
    prompts: Node | None = None


@dataclass
class HiddenStatesSpec:
    target_dir: str
    layer: int | str  # a decoder layer's index, or "final": the state after the final norm
    backend: "KernelSpec"  # runner.models.target: how the target runs, its note included
    tokens: Node
    states: str | None = None  # a lossy codec the rows are stored in (keyed in the backend)

    def backend_key(self) -> dict:
        """The ``backend`` of the node's key: the kernel class, and ``states`` when lossy."""
        return {**self.backend.to_key(), **({"states": self.states} if self.states else {})}


@dataclass
class DrafterEvalSpec:
    drafter: "DrafterRef"  # runner.drafters.checkpoints
    target_dir: str
    backend: dict  # the hidden states' keyed backend
    tokens: Node
    layers: list[Node]


@dataclass
class ReportSpec:
    target_dir: str | None


StageSpec = PromptsSpec | CompletionsSpec | TokensSpec | HiddenStatesSpec | DrafterEvalSpec | ReportSpec


@dataclass(frozen=True)
class KeyRecipe:
    """What a stage's key covers, as data next to the stage's ``build()``.

    ``build()`` makes its nodes with :meth:`node` (a set-level artifact) or :meth:`samples` (a
    per-sample stage: a partition and one sample key per prompt), which refuse inputs or upstream
    roles the recipe does not list (and listed ones that are missing), so the recipe cannot drift
    from the code; the stage's docstring shows :meth:`describe` (tests/test_architecture.py
    checks it). The keys themselves are unchanged: ``compute_key(stage, version, inputs,
    upstream)``, and for a per-sample stage that is the partition key, each sample's key
    ``sample_key(partition, upstream sample key)`` (docs/format.md "Samples and segments").
    """

    stage: str
    version: int
    inputs: dict[str, str]  # name -> what it is and how it is resolved
    upstream: dict[str, str] = field(default_factory=dict)  # role -> whose key(s) (partitions, per sample)
    optional: frozenset[str] = frozenset()  # inputs only some configurations have
    sample: str | None = None  # per-sample stages: what each sample's key derives from

    def _check(self, inputs: dict, upstream: dict) -> None:
        extra = sorted(set(inputs) - set(self.inputs))
        missing = sorted(set(self.inputs) - self.optional - set(inputs))
        roles = sorted(set(upstream) ^ set(self.upstream))
        if extra or missing or roles:
            raise InternalError(f"stage {self.stage} built a node that its key recipe does not describe "
                                f"(inputs not in the recipe: {extra}, missing: {missing}, upstream roles "
                                f"differing: {roles}); update KEY in the stage with the change.")

    def node(self, *, inputs: dict, upstream: dict | None = None, needs: str, **kw) -> Node:
        """A set-level node (one artifact)."""
        if self.sample is not None:
            raise InternalError(f"stage {self.stage} is per sample: build its nodes with KEY.samples().")
        upstream = upstream or {}
        self._check(inputs, upstream)
        return Node.make(self.stage, self.version, inputs=inputs, upstream=upstream, needs=needs, **kw)

    def samples(self, *, inputs: dict, upstream_samples: list[str], partition_upstream: dict | None = None,
                needs: str, **kw) -> Node:
        """A per-sample node: its partition over ``inputs``/``partition_upstream``, one sample per
        entry of ``upstream_samples`` (see :meth:`Node.make_samples`)."""
        if self.sample is None:
            raise InternalError(f"stage {self.stage} is set-level: build its nodes with KEY.node().")
        partition_upstream = partition_upstream or {}
        self._check(inputs, partition_upstream)
        return Node.make_samples(self.stage, self.version, inputs=inputs, upstream_samples=upstream_samples,
                                 partition_upstream=partition_upstream, needs=needs, **kw)

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

        head = [f"key = compute_key({self.stage!r}, {self.version}, inputs, upstream)"]
        if self.sample is not None:
            head = [f"partition = compute_key({self.stage!r}, {self.version}, inputs, upstream)",
                    f"sample    = sample_key(partition, {self.sample})"]
        return "\n".join([*head, "inputs:", *rows(self.inputs), "upstream:", *rows(self.upstream)])


@dataclass
class RunCache:
    """Objects a run makes once and several stages use (loading a target takes seconds)."""

    resolved_targets: dict[tuple, Any] = field(default_factory=dict)  # (target, revision) -> ResolvedTarget
    targets: dict[tuple[str, str], Any] = field(default_factory=dict)  # (dir, kernel label) -> loaded target
    tokenizers: dict[str, Any] = field(default_factory=dict)  # target dir -> tokenizer
    served_models: dict[tuple, str] = field(default_factory=dict)  # (base URL, api, wanted) -> model name
    # (base URL, api, wanted) -> what the server is: {"owned_by", "version"} (which ids it can return)
    server_info: dict[tuple, dict] = field(default_factory=dict)


@dataclass
class RunHooks:
    """Callbacks a caller (a test, a benchmark) gives a run; none changes what is computed."""

    # after each committed segment of an extraction: (segment index, tokens done so far)
    on_extract_checkpoint: Callable[[int, int], None] | None = None


class RunContext:
    """What stages see: the store, the options (validated), remotes, progress output, the worker
    (rank, device) and the run's typed shared state (``cache``, ``hooks``, ``last_extract_stats``)."""

    def __init__(self, store, options: EvalOptions, *, remotes: list | None = None, argv: list[str] | None = None,
                 out=None, cache: RunCache | None = None, hooks: RunHooks | None = None, bars=None,
                 worker: Worker | None = None) -> None:
        options.validate()
        self.store = store
        self.options = options
        self.remotes = list(remotes or [])
        self.argv = list(argv) if argv is not None else list(sys.argv[1:])
        self.out = out or sys.stderr
        # Progress bars' stream (default: ``out``); apart for a Python caller whose lines go to a
        # callback while its bars stay on the terminal.
        self.bars = bars
        # This process's place in a distributed run (rank 0 of 1 alone): its share, its GPU.
        self.worker = worker if worker is not None else Worker()
        self.cache = cache if cache is not None else RunCache()
        self.hooks = hooks if hooks is not None else RunHooks()
        self.last_extract_stats = None  # the hidden-states stage's last ExtractStats (bench, tests)
        self.last_lossy_check_s = 0.0  # seconds its lossy-vs-exact comparison took after extracting (bench)
        self.work_done: list[str] = []  # keys produced in this run (tests and --json read it)
        # Set by build_graph when the graph stops at a turn's completions: the prompts of the next
        # turns of a multi-turn set are made from them once they are stored (runner/core/pipeline.py).
        self.waiting_turns: str | None = None

    def log(self, message: str) -> None:
        print(message, file=self.out, flush=True)

    def progress(self, total: int | None, desc: str, unit: str = "it", unit_scale: bool = False):
        """A bar on a terminal; elsewhere, with ``options.progress_every`` set (the command line
        sets it unless --no-progress), a line every so many seconds (runner/core/progress.py)."""
        every = getattr(self.options, "progress_every", None)
        if not self.options.progress and every is not None:
            from .progress import LineProgress

            return LineProgress(total, desc, unit, self.out, every, unit_scale=unit_scale)
        from tqdm.auto import tqdm

        disable = not self.options.progress
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable,
                    file=self.bars or self.out, dynamic_ncols=True, leave=False)

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
    """Give every node its status without doing any work.

    Set-level nodes: stored locally, in a remote, or to produce. Per-sample nodes: where each
    sample is, then what this run must pull and produce (runner/core/sampling.py): a stored report
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
