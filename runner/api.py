"""The runner's Python API: what `dfcache plan` and `dfcache run` do, returning results.

Nothing here prints (progress bars go to stderr only when ``progress=True``); the CLI prints
from the same results. Options are the fields of :class:`runner.options.EvalOptions`, the
ones the command line fills in (``--num-prompts 4`` is ``num_prompts=4``)::

    from runner import api
    result = api.run("eval", store="./store", example=True, progress=False)
    result.report["drafters"][0]["tau_chain"]

See docs/python.md for the whole API, doctested by tests/test_python_api.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

from .options import EvalOptions

TARGETS = ("prompts", "completions", "tokens", "hidden-states", "eval")


@dataclass(frozen=True)
class NodeResult:
    """One artifact of the graph and where it stands."""

    stage: str
    key: str
    label: str
    status: str  # plan: cached | remote | compute (cpu) | compute (gpu) | network
    needs: str  # none | cpu | gpu | network
    upstream: dict
    contacts: str | None = None
    fix: str | None = None
    outcome: str | None = None  # after a run: computed | pulled | cached
    # Per-sample nodes: the partition and {total, cached, remote, missing, to_pull, to_produce,
    # pulled, produced} (runner/sampling.py); None for set-level nodes (the report).
    partition: str | None = None
    samples: dict | None = None

    def to_dict(self) -> dict:
        d = {"stage": self.stage, "key": self.key, "status": self.status, "needs": self.needs,
             "label": self.label, "upstream": self.upstream, "contacts": self.contacts, "fix": self.fix}
        if self.samples is not None:
            d["partition"] = self.partition
            d["samples"] = self.samples
        return d

    def stage_row(self) -> dict:
        """What `run --json` says per node: how many samples were reused, pulled and computed."""
        row = {"stage": self.stage, "label": self.label, "key": self.key, "status": self.status}
        if self.samples is not None:
            c = self.samples
            row["samples"] = {"total": c["total"], "reused": c["cached"], "pulled": c["pulled"],
                              "computed": c["produced"],
                              "not_needed": c["total"] - c["cached"] - c["to_pull"] - c["to_produce"]}
        return row


@dataclass
class PlanResult:
    """The graph up to ``upto``, every node resolved, nothing done."""

    upto: str
    nodes: list[NodeResult]

    @property
    def to_produce(self) -> list[NodeResult]:
        return [n for n in self.nodes if n.status != "cached"]

    @property
    def needs_network(self) -> list[NodeResult]:
        return [n for n in self.nodes if n.status == "network"]


@dataclass
class RunResult:
    """A finished run: every node with its outcome, and for ``eval`` the report."""

    upto: str
    nodes: list[NodeResult]
    computed: list[str]
    seconds: float
    report: dict | None = None  # the report JSON (docs/metrics.md), for target "eval"
    report_key: str | None = None
    markdown: str | None = None
    files: dict[str, Path] = field(default_factory=dict)  # report files materialized in the store
    # One worker of a distributed run (torchrun, or ``shard=``; docs/distributed.md): its place and
    # share (``rank``, ``world``, ``my_prompts``, ``complete``, ...), None for a run of one process.
    # ``complete`` False: other workers' shares are not all stored yet, so ``nodes`` says what this
    # worker did and there is no report; a torchrun rank other than 0 gets no nodes at all (rank 0
    # speaks for the job).
    worker: dict | None = None

    @property
    def complete(self) -> bool:
        return self.worker is None or bool(self.worker.get("complete"))


def make_options(options: EvalOptions | None = None, **fields_) -> EvalOptions:
    """``options`` (default: the CLI's defaults) with ``fields_`` replaced; unknown names refused."""
    from dfcache.errors import UsageError

    known = {f.name for f in fields(EvalOptions)}
    unknown = sorted(set(fields_) - known)
    if unknown:
        raise UsageError(f"unknown option(s) {', '.join(unknown)}; the options are the fields of "
                         "runner.options.EvalOptions.")
    base = options if options is not None else EvalOptions(progress=False)
    return replace(base, **fields_)


def _open(store):
    from dfcache import open_store
    from dfcache.store import Store

    if isinstance(store, Store):
        return store
    if store is None:
        from dfcache.cli.common import get_store

        return get_store()
    return open_store(store)


_FLAGS = {"target": "--target", "target_revision": "--revision", "drafters": "--drafter", "layers": "--layer",
          "tree_budgets": "--tree-budget", "remotes": "--remote"}
_NO_FLAG = ("json", "progress", "progress_every", "attn_implementation")


def cli_args(opts: EvalOptions) -> list[str]:
    """The command-line flags that give ``opts`` (those that differ from the defaults), for
    "produce it with: dfcache ..." messages of Python calls."""
    default = EvalOptions()
    args: list[str] = []
    for f in fields(EvalOptions):
        value = getattr(opts, f.name)
        if f.name in _NO_FLAG or value == getattr(default, f.name):
            continue
        flag = _FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            for v in value:
                args += [flag, str(v)]
        elif value is not None:
            args += [flag, str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)]
    return args


def _argv(upto: str, argv: list[str] | None, opts: EvalOptions | None = None) -> list[str]:
    return list(argv) if argv is not None else ["run", upto, *(cli_args(opts) if opts else [])]


def resolve_graph(upto: str, opts: EvalOptions, store=None, *, argv: list[str] | None = None,
                  log: Callable[[str], None] | None = None):
    """Build and resolve the graph (no work). Returns ``(ctx, nodes)``: the runner's own objects."""
    from dfcache.errors import UsageError

    from .graph import RunContext, resolve
    from .pipeline import build_graph

    if upto not in TARGETS:
        raise UsageError(f"unknown target {upto!r}; use {', '.join(TARGETS)}.")
    st = _open(store)
    if opts.example:
        from .example import apply_example

        apply_example(st, opts, log=log or (lambda m: None))
    from .cli_support import open_remotes

    ctx = RunContext(st, opts, remotes=open_remotes(opts), argv=_argv(upto, argv, opts))
    nodes = resolve(ctx, build_graph(ctx, upto))
    return ctx, nodes


def _node_result(n, outcome: str | None = None) -> NodeResult:
    return NodeResult(stage=n.stage, key=n.key, label=n.label or n.stage, status=n.status, needs=n.needs,
                      upstream=n.upstream, contacts=n.contacts, fix=n.fix, outcome=outcome,
                      partition=n.partition.key if n.partition is not None else None, samples=n.samples_dict())


def plan(upto: str = "eval", *, store=None, options: EvalOptions | None = None,
         argv: list[str] | None = None, **fields_) -> PlanResult:
    """Resolve the graph up to ``upto`` and give each node its status; does no work.

    Offline (``offline=True``), missing nodes that need the network raise
    :class:`dfcache.errors.OfflineMissingError` (exit code 3 on the command line), all together.
    """
    from .graph import check_offline

    opts = make_options(options, **fields_)
    ctx, nodes = resolve_graph(upto, opts, store, argv=argv)
    if opts.offline:
        check_offline(ctx, nodes)
    return PlanResult(upto=upto, nodes=[_node_result(n) for n in nodes])


def run(upto: str = "eval", *, store=None, options: EvalOptions | None = None,
        argv: list[str] | None = None, log: Callable[[str], None] | None = None, shard: str | None = None,
        **fields_) -> RunResult:
    """Produce the graph up to ``upto``, reusing everything cached; returns what happened.

    Under torchrun (``RANK``/``WORLD_SIZE`` set), or with ``shard="I/N"`` (or ``"slurm"``), this
    process is one worker of a distributed run, as ``dfcache run`` is: it makes its share of the
    missing samples into the shared store (docs/distributed.md) and ``result.worker`` says which.

    Raises the errors the command line turns into exit codes (``OfflineMissingError`` 3,
    ``NetworkError`` 4, ``BadInputError`` 6, ...; see docs/cli.md).
    """
    started = time.perf_counter()
    opts = make_options(options, **fields_)
    from .distributed import discover, run_worker

    worker = discover(shard)
    if not worker.distributed:
        ctx, nodes = _run(upto, opts, store, argv=argv, log=log)
        return _result(upto, ctx, nodes, time.perf_counter() - started)
    done = run_worker(upto, opts, _open(store), worker=worker, argv=argv, log=log)
    return worker_result(upto, done, time.perf_counter() - started)


def worker_result(upto: str, done, seconds: float) -> RunResult:
    """The :class:`RunResult` of one worker's :class:`runner.distributed.WorkerRun`."""
    if done.ctx is None:  # a torchrun rank other than 0: rank 0 has the job's result
        return RunResult(upto=upto, nodes=[], computed=[], seconds=seconds, worker=done.to_dict())
    if not done.complete:
        res = RunResult(upto=upto, nodes=[_node_result(n, "computed" if n.key in done.ctx.work_done else "cached")
                                          for n in done.nodes], computed=list(done.ctx.work_done), seconds=seconds)
    else:
        res = _result(upto, done.ctx, done.nodes, seconds)
    res.worker = done.to_dict() if done.worker.distributed else None
    return res


def _run(upto: str, opts: EvalOptions, store, *, argv=None, log=None, out=None):
    from .graph import check_offline
    from .pipeline import execute

    ctx, nodes = resolve_graph(upto, opts, store, argv=argv, log=log)
    if out is not None:
        ctx.out = out
    check_offline(ctx, nodes)
    execute(ctx, nodes)
    return ctx, nodes


def _result(upto: str, ctx, nodes, seconds: float) -> RunResult:
    done = set(ctx.work_done)
    results = [_node_result(n, "computed" if n.key in done else ("pulled" if n.status == "remote" else "cached"))
               for n in nodes]
    res = RunResult(upto=upto, nodes=results, computed=list(ctx.work_done), seconds=seconds)
    if upto == "eval":
        from .stages import report

        art = ctx.store.open(nodes[-1].key)
        res.report = art.json("report")
        res.markdown = art.json("markdown")
        res.report_key = nodes[-1].key
        res.files = report.materialize(ctx.store, nodes[-1].key)
    return res


def hidden_state_dataset(*, store=None, options: EvalOptions | None = None, layers: list[int] | None = None,
                         max_len: int | None = None, tokens_key: str | None = None, concatenated: bool = False,
                         progress=None, **fields_):
    """A :class:`dfcache.training.HiddenStateDataset` over the stored states of a selection.

    The selection is what ``dfcache run hidden-states`` would use with the same options
    (``target``, ``drafters`` or ``layers``, ``prompts``, ``backend``, ...). Hidden states are
    concatenated in the drafter's ``target_layer_ids`` order (or ``layers``' order). Nothing is
    computed: a selection that is not fully cached raises
    :class:`dfcache.errors.OfflineMissingError` naming what is missing and the command that
    produces it.

    ``tokens_key=KEY`` with ``layers=[...]`` selects by key instead (an imported set: `dfcache
    import` prints its tokens key).

    ``concatenated=True``: read from the selection's concatenated copy (``runner.concat``, what
    `dfcache concat` writes), written first for the samples not in it yet (``progress(n)``: a
    tqdm-like bar). The layers are then stored side by side once more, and an item's hidden
    states are a private memory map of its rows instead of a copy: the same items, faster to
    read, at the cost of the selected layers' bytes again on disk.
    """
    from dfcache.training import HiddenStateDataset

    from .samples import resolve_selection, stored_selection

    if tokens_key is not None:
        if not layers:
            from dfcache.errors import UsageError

            raise UsageError("tokens_key= needs layers=[...] (the layer ids, in the order to concatenate).")
        st = _open(store)
        source = stored_selection(st, tokens_key, list(layers), backend=fields_.pop("backend_key", None)).source()
        if concatenated:
            from .concat import concat

            concat(source, st, progress=progress)
        return HiddenStateDataset(source, max_len=max_len)
    opts = make_options(options, **fields_)
    sel = resolve_selection(opts, store=_open(store), layers=layers, argv=_argv("hidden-states", None, opts))
    source = sel.source()
    if concatenated:
        from .concat import concat

        concat(source, sel.store, progress=progress)
    return HiddenStateDataset(source, max_len=max_len)


__all__ = ["NodeResult", "PlanResult", "RunResult", "hidden_state_dataset", "make_options", "plan", "run",
           "resolve_graph"]

