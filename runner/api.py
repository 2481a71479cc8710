"""The runner's Python API: what `dfcache plan` and `dfcache run` do, returning results.

Nothing here prints: progress lines go to ``log=`` (a callable taking one line) when given,
progress bars and lines to stderr only with ``progress=True``, and transformers' own bars and
notices are off for the length of a call that computes; the CLI prints from the same results.
Options are the fields of :class:`runner.core.options.EvalOptions`, the ones the command line fills
in (``--num-prompts 4`` is ``num_prompts=4``), and mean what the flags mean: ``server=URL``
takes completions from that server, as ``--server`` does. Errors name these keywords in their
fixes (``server=URL``, not ``--server URL``; runner/api_errors.py)::

    from runner import api
    result = api.run("eval", store="./store", example=True)
    result.report["drafters"][0]["tau_chain"]

See docs/python.md for the whole API, doctested by tests/test_python_api.py.
"""

from __future__ import annotations

import functools
import io
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

from .core.execution import TARGETS, command_argv, open_store_arg, resolve_graph, run_graph
from .core.options import EvalOptions



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
    # pulled, produced} (runner/core/sampling.py); None for set-level nodes (the report).
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
    # What the graph cannot plan yet (a multi-turn set's later turn is made from the target's
    # earlier answers): the note `dfcache plan` prints; ``run`` makes that turn, then the rest.
    waits: str | None = None

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
    """``options`` (default: the CLI's defaults) with ``fields_`` replaced; unknown names refused.
    Progress output is the call's own: ``progress=True`` as a keyword, never an options object's
    field (whose dataclass default, the CLI's, is on), so nothing prints unless asked.

    ``server=URL`` means completions from that server, as ``--server`` does on the command line
    (runner/commands/run.py): ``completions`` becomes ``"server"`` unless given, and ``completions="local"``
    given beside ``server=`` is refused, as ``--completions local --server URL`` is.
    """
    from dfcache.errors import UsageError

    known = {f.name for f in fields(EvalOptions)}
    unknown = sorted(set(fields_) - known)
    if unknown:
        raise UsageError(f"unknown option(s) {', '.join(unknown)}; the options are the fields of "
                         "runner.core.options.EvalOptions.")
    base = options if options is not None else EvalOptions()
    opts = replace(base, **{"progress": False, **fields_})
    if opts.server is not None and opts.completions == "local":
        if "completions" in fields_:
            raise UsageError("completions='local' does not use server=; drop server=, or pass "
                             "completions='server' to take completions from it.")
        opts.completions = "server"  # a server named and no source chosen: that server's completions
    return opts


class _Lines:
    """A stream that hands each whole line to ``log`` (a Python caller's progress callback)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self._part = log, ""

    def write(self, text: str) -> int:
        *lines, self._part = (self._part + text).split("\n")
        for line in lines:
            line = line.rsplit("\r", 1)[-1]  # what a terminal would show of a rewritten line
            if line.strip():
                self.log(line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _Output:
    """Where one call's progress goes: lines to ``log`` if given, else to stderr with
    ``progress=True``, else nowhere; bars (tqdm) to stderr with ``progress=True`` only.

    transformers prints bars of its own ("Loading weights", "Writing model shards") and notices;
    without ``progress=True`` they are off while the call computes and as they were afterwards.
    :meth:`hush` is called only where the call is about to compute (it imports transformers'
    logging module, 1.7 s here): a fully cached call imports no transformers."""

    def __init__(self, opts: EvalOptions, log: Callable[[str], None] | None) -> None:
        self.out = _Lines(log) if log is not None else (sys.stderr if opts.progress else _Null())
        self.bars = sys.stderr if opts.progress else None
        self.quiet = not opts.progress
        self._saved = None

    def line(self, message: str) -> None:
        self.out.write(message + "\n")
        self.out.flush()

    def hush(self) -> None:
        if not self.quiet or self._saved is not None:
            return
        from transformers.utils import logging as tlog

        self._saved = (tlog.is_progress_bar_enabled(), tlog.get_verbosity())
        tlog.disable_progress_bar()
        tlog.set_verbosity_error()

    def __enter__(self) -> "_Output":
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        from transformers.utils import logging as tlog

        bars, verbosity = self._saved
        if bars:
            tlog.enable_progress_bar()
        tlog.set_verbosity(verbosity)
        self._saved = None


def _python_errors(func):
    """Errors leaving ``func`` name the API's keywords in their fixes (runner/api_errors.py)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from dfcache.errors import DfcacheError

        try:
            return func(*args, **kwargs)
        except DfcacheError as e:
            from .api_errors import for_python

            new = for_python(e)
            if new is e:
                raise
            raise new.with_traceback(e.__traceback__) from None

    return wrapper


def _prepare(upto: str, opts: EvalOptions, store, output: _Output):
    """The store opened for a call, and the example built (quietly) where the call asks for it."""
    from dfcache.errors import UsageError

    if upto not in TARGETS:
        raise UsageError(f"unknown target {upto!r}; use {', '.join(TARGETS)}.")
    st = open_store_arg(store, opts)
    if opts.example:
        from .models.example import example_built

        if not example_built(st):
            output.hush()  # the build saves and loads models with transformers
    return st


def _node_result(n, outcome: str | None = None) -> NodeResult:
    return NodeResult(stage=n.stage, key=n.key, label=n.label or n.stage, status=n.status, needs=n.needs,
                      upstream=n.upstream, contacts=n.contacts, fix=n.fix, outcome=outcome,
                      partition=n.partition.key if n.partition is not None else None, samples=n.samples_dict())


@_python_errors
def plan(upto: str = "eval", *, store=None, options: EvalOptions | None = None,
         argv: list[str] | None = None, log: Callable[[str], None] | None = None, **fields_) -> PlanResult:
    """Resolve the graph up to ``upto`` and give each node its status; does no work.

    Offline (``offline=True``), missing nodes that need the network raise
    :class:`dfcache.errors.OfflineMissingError` (exit code 3 on the command line), all together.
    ``log``: a callable given each progress line (the example's build, notes about remotes).
    """
    from .core.graph import check_offline

    opts = make_options(options, **fields_)
    with _Output(opts, log) as output:
        st = _prepare(upto, opts, store, output)
        ctx, nodes = resolve_graph(upto, opts, st, argv=argv, log=output.line, out=output.out, bars=output.bars)
    if opts.offline:
        check_offline(ctx, nodes)
    return PlanResult(upto=upto, nodes=[_node_result(n) for n in nodes], waits=ctx.waiting_turns)


@_python_errors
def run(upto: str = "eval", *, store=None, options: EvalOptions | None = None,
        argv: list[str] | None = None, log: Callable[[str], None] | None = None, shard: str | None = None,
        **fields_) -> RunResult:
    """Produce the graph up to ``upto``, reusing everything cached; returns what happened.

    Prints nothing: ``log`` (a callable) is given each progress line ("hidden states: 2
    sample(s) ..."); ``progress=True`` shows bars and lines on stderr, as the command line does.

    Under torchrun (``RANK``/``WORLD_SIZE`` set), or with ``shard="I/N"`` (or ``"slurm"``), this
    process is one worker of a distributed run, as ``dfcache run`` is: it makes its share of the
    missing samples into the shared store (docs/distributed.md) and ``result.worker`` says which.

    Raises the errors the command line turns into exit codes (``OfflineMissingError`` 3,
    ``NetworkError`` 4, ``BadInputError`` 6, ...; see docs/cli.md), their fixes naming this
    function's keywords.
    """
    started = time.perf_counter()
    opts = make_options(options, **fields_)
    from .core.worker import discover
    from .distributed import run_worker

    worker = discover(shard)
    with _Output(opts, log) as output:
        st = _prepare(upto, opts, store, output)
        if not worker.distributed:
            ctx, nodes = run_graph(upto, opts, st, argv=argv, log=output.line, output=output)
            return _result(upto, ctx, nodes, time.perf_counter() - started)
        output.hush()  # a distributed worker computes (its share, or the report)
        done = run_worker(upto, opts, st, worker=worker, argv=argv or command_argv(upto, None, opts, st), log=output.line,
                          out=output.out)
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


def _result(upto: str, ctx, nodes, seconds: float) -> RunResult:
    done = set(ctx.work_done)
    results = [_node_result(n, "computed" if n.key in done else ("pulled" if n.status == "remote" else "cached"))
               for n in nodes]
    res = RunResult(upto=upto, nodes=results, computed=list(ctx.work_done), seconds=seconds)
    if upto == "eval":
        from .core.report_view import ShownSections, show
        from .stages.drafter_eval import read_responses
        from .suites.tables import section

        res.report_key = nodes[-1].key
        # Several prompt sets, a multi-turn set or --mix: τ per set (and turn), overall and mixed,
        # cut from the stored evals by the run's ids when shown (the stored report is the whole set),
        # in report.json, report.md and report.html as this run shows them.
        extra = section(ctx.store, nodes, ctx.options, res.report_key, read_responses, _other_thinking(ctx))
        sections = None if extra is None else ShownSections("prompt_sets", extra["doc"], extra["markdown"],
                                                            extra["html"])
        # Shown with this run's verdicts (--trained-on, --accept-retokenized): never stored.
        res.report, res.markdown, res.files = show(ctx.store, res.report_key, ctx.options, sections)
        if extra is not None:
            res.files = {**res.files, **extra["files"]}
    return res


def _other_thinking(ctx):
    """The nodes of this run with --enable-thinking the other way, when every one is stored
    (issue 35: thinking on and off side by side), else None. Only for runs over several prompt
    sets or a mix (the per-set tables are what shows them)."""
    from dfcache.errors import DfcacheError

    from .suites import sets

    opts = ctx.options
    if len(sets.specs(opts.prompts)) < 2 and opts.mix is None:
        return None
    try:
        _, nodes = resolve_graph("eval", replace(opts, enable_thinking=not opts.enable_thinking), ctx.store,
                                 out=io.StringIO())
    except DfcacheError:
        return None
    return nodes if all(n.status in ("cached", "not needed") for n in nodes) else None


@_python_errors
def hidden_state_dataset(*, store=None, options: EvalOptions | None = None, layers: list[int] | None = None,
                         max_len: int | None = None, tokens_key: str | None = None, concatenated: bool = False,
                         progress=None, log: Callable[[str], None] | None = None, fp8: str = "bf16", **fields_):
    """A :class:`dfcache.training.HiddenStateDataset` over the stored states of a selection.

    The selection is what ``dfcache run hidden-states`` would use with the same options
    (``target``, ``drafters`` or ``layers``, ``prompts``, ``backend``, ``server``, ...). Hidden
    states are concatenated in the drafter's ``target_layer_ids`` order (or ``layers``' order).
    Nothing is computed: a selection that is not fully cached raises
    :class:`dfcache.errors.OfflineMissingError` naming what is missing and the command that
    produces it.

    ``tokens_key=KEY`` with ``layers=[...]`` selects by key instead (an imported set: `dfcache
    import` prints its tokens key).

    ``concatenated=True``: read from the selection's concatenated copy (``runner.core.concat``, what
    `dfcache concat` writes), written first for the samples not in it yet. The layers are then
    stored side by side once more, and an item's hidden states are a private memory map of its
    rows instead of a copy: the same items, faster to read, at the cost of the selected layers'
    bytes again on disk. ``progress``: ``True`` for a bar on stderr while the copy is written, or a
    tqdm-like factory ``progress(n)``; default none. ``log``: a callable given progress lines.

    FP8 states (``compression="fp8-e4m3"``): items are dequantized to bf16, or with ``fp8="raw"``
    the float8_e4m3fn codes and ``hidden_states_scales`` [1, n, layers] (see HiddenStateDataset).
    """
    from dfcache.training import HiddenStateDataset

    from .core.samples import resolve_selection, stored_selection

    bar = _bar_factory(progress)
    if tokens_key is not None:
        if not layers:
            from dfcache.errors import UsageError

            raise UsageError("tokens_key= needs layers=[...] (the layer ids, in the order to concatenate).")
        st = open_store_arg(store)
        source = stored_selection(st, tokens_key, list(layers), backend=fields_.pop("backend_key", None)).source()
        if concatenated:
            from .core.concat import concat

            _concat_fp8_refused(source)
            concat(source, st, progress=bar)
        return HiddenStateDataset(source, max_len=max_len, fp8=fp8)
    opts = make_options(options, **fields_)
    st = open_store_arg(store, opts)
    out = _Output(replace(opts, progress=False), log).out
    sel = resolve_selection(opts, store=st, layers=layers, argv=command_argv("hidden-states", None, opts, st), out=out)
    source = sel.source()
    if concatenated:
        from .core.concat import concat

        _concat_fp8_refused(source)
        concat(source, sel.store, progress=bar)
    return HiddenStateDataset(source, max_len=max_len, fp8=fp8)


def _concat_fp8_refused(source) -> None:
    if getattr(source, "fp8", False):
        from dfcache.errors import UsageError

        raise UsageError("concatenated=True is not available for FP8 states (their per-layer scales have no "
                         "concatenated layout yet); read them per layer (concatenated=False).")


def _bar_factory(progress):
    if progress is None or progress is False:
        return None
    if progress is True:
        def bar(n: int):
            from tqdm.auto import tqdm

            return tqdm(total=n, desc="concat", unit="sample", file=sys.stderr, leave=False)

        return bar
    return progress


__all__ = ["NodeResult", "PlanResult", "RunResult", "hidden_state_dataset", "make_options", "plan", "run",
           "resolve_graph"]

