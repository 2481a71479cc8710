"""What `dfcache plan` and `dfcache run` do around the graph without the command-line framework:
the remotes to consult, keeping libraries quiet, and printing results.

Apart from runner.commands.run (typer) so that a fully cached run can be answered by
:mod:`runner.commands.fast_run` before typer, click or pydantic are imported (docs/benchmarks.md,
``noop-eval``); both print through the functions here, so their output is the same bytes.
"""

from __future__ import annotations

import sys

from dfcache.console import emit_json

from ..core.options import EvalOptions


def open_remotes(opts: EvalOptions, log=None) -> list:
    """The remotes to look in: --remote flags, else the config's default remotes. Offline,
    a remote that needs the network is refused (a file:// remote is fine). ``log``: where the
    note about that goes (default: stderr)."""
    from dfcache.config import load_config

    names = opts.remotes or load_config().default_remotes
    if not names:
        return []
    from dfcache.errors import OfflineModeIsEnabled
    from dfcache.transfer import open_remote

    remotes = []
    for name in names:
        try:
            remotes.append(open_remote(name, endpoint_url=opts.endpoint_url, offline=opts.offline, create=False))
        except OfflineModeIsEnabled:
            # Offline, a network remote is simply not consulted (it must not fail a run that has
            # everything it needs locally); what is missing is then reported as needing the network.
            note = f"note: offline mode is on, so remote {name} (it needs the network) is not consulted."
            if log is not None:
                log(note)
            else:
                print(note, file=sys.stderr, flush=True)
    return remotes


def quiet_libraries(*, bars: bool, notices: bool) -> None:
    """Keep transformers and huggingface_hub in line with our own progress settings: no
    "Loading weights" bars when ours are off (no terminal, --json, --no-progress), and with
    --no-progress none of their notices either (kernel fallback warnings). Set through the
    environment before they are imported (a run imports them only when it computes), and through
    their APIs when already imported."""
    from dfcache.config import quiet_hub_libraries

    quiet_hub_libraries(bars=bars, notices=notices)
    if "transformers" in sys.modules:
        from transformers.utils import logging as tlog

        if not bars:
            tlog.disable_progress_bar()
        if not notices:
            tlog.set_verbosity_error()
    if not bars and "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def print_run(result, opts: EvalOptions, worker=None) -> None:
    """What `dfcache run` prints for a :class:`runner.api.RunResult` (``worker``: the
    :class:`runner.distributed.WorkerRun` of a distributed run)."""
    if worker is not None:
        _print_worker(result, opts, worker)
        if not worker.complete:
            return
    extra = {"worker": worker.to_dict()} if worker is not None else {}
    if result.upto == "eval":
        if opts.json:
            emit_json({**result.report, "report_key": result.report_key,
                       "files": {k: str(v) for k, v in result.files.items()},
                       "computed": result.computed, "stages": [n.stage_row() for n in result.nodes],
                       "seconds": round(result.seconds, 3), **extra})
            return
        print(result.markdown)  # the banner and the warnings (this run's verdicts) come first
        print()
        for name, path in result.files.items():
            print(f"{name:<28} {path}")
        print()
        # Every stage, cached or not (a fully cached run printed nothing here), and the report
        # itself: a run that only pulled the report says so.
        width = label_width(result.nodes)
        for n in result.nodes:
            print(f"{n.label:<{width}} {_sample_outcome(n) if n.samples is not None else _node_outcome(n)}")
        print(f"\n{_work_summary(result)}; {result.seconds:.1f} s.")
        return
    if opts.json:
        emit_json({"nodes": [n.to_dict() for n in result.nodes], "stages": [n.stage_row() for n in result.nodes],
                   "computed": result.computed, "seconds": round(result.seconds, 3), **extra})
        return
    width = label_width(result.nodes)
    for n in result.nodes:
        print(f"{n.label:<{width}} {n.key[:12]}  {_sample_outcome(n) if n.samples is not None else _node_outcome(n)}")
    print(f"{_work_summary(result)} in {result.seconds:.1f} s")


def label_width(nodes, least: int = 28) -> int:
    """The width of the label column: the longest label (``completions (local,
    torch/cpu/float32/sdpa)`` is 43 characters), so the columns after it line up."""
    return max([least] + [len(getattr(n, "label", None) or n.stage) for n in nodes])


def _node_outcome(n) -> str:
    """A set-level node (the report) after a run: computed, pulled from a remote, or reused."""
    return {"computed": "computed", "pulled": "pulled from a remote", "cached": "reused (in the store)"}.get(
        n.outcome, n.outcome or n.status)


def _work_summary(result) -> str:
    done = set(result.computed)
    pulled = sum(1 for n in result.nodes if n.key not in done and n.outcome == "pulled")
    idle = sum(1 for n in result.nodes if n.key not in done and n.outcome != "pulled" and n.status == "not needed")
    what = f"{len(done)} node(s) did work"
    if pulled:
        what += f", {pulled} pulled"
    what += f", {len(result.nodes) - len(done) - pulled - idle} reused"
    return what + (f", {idle} not needed" if idle else "")


def _print_worker(result, opts: EvalOptions, w) -> None:
    """A distributed run's own lines: which worker, its share, and (when other workers' shares are
    still missing) its part of the result; the full summary follows when the set is complete."""
    if opts.json:
        if not w.complete:
            emit_json({"worker": w.to_dict(), "nodes": [n.to_dict() for n in result.nodes],
                       "stages": [n.stage_row() for n in result.nodes], "computed": result.computed,
                       "seconds": round(result.seconds, 3)})
        return
    me = w.worker
    what = (f"{w.job_units} missing prompt(s) shared by {me.world} ranks ({me.launcher})" if w.shares_missing else
            f"the set's {w.job_units} prompt(s) shared by {me.world} workers ({me.launcher}); each makes the missing part of its share")
    print(f"worker {me.rank}/{me.world}: {what}; its own share was {w.my_units} prompt(s), ~{w.my_tokens} tokens.")
    if not w.complete:
        width = label_width(result.nodes)
        for n in result.nodes:
            if n.samples is not None:
                s = n.stage_row()["samples"]
                print(f"{n.label:<{width}} {s['reused']} reused, {s['pulled']} pulled, {s['computed']} computed here of "
                      f"{s['total']} samples")
        print(f"{w.missing} prompt(s) of the set are still missing: other workers' shares. When every worker has "
              "finished, the same command run once more (any --shard, or none) computes nothing stored and "
              f"{'makes the report' if result.upto == 'eval' else 'reports the whole set'}.")


def _sample_outcome(n) -> str:
    s = n.stage_row()["samples"]
    text = f"{s['reused']} reused, {s['pulled']} pulled, {s['computed']} computed of {s['total']} samples"
    if s["not_needed"]:  # e.g. the report was pulled: nothing under it was read or made
        text += f" ({s['not_needed']} not needed)"
    return text


def _print_plan(nodes, opts: EvalOptions, estimate: list | None = None, estimate_lines: list | None = None) -> None:
    if opts.json:
        plan = [n.to_plan_dict() for n in nodes]
        emit_json(plan if estimate is None else {"nodes": plan, "estimate": estimate})
        return
    width = label_width(nodes)
    print(f"{'STAGE':<{width}} {'KEY':<12}  {'STATUS':<14} {'NEEDS':<8} SAMPLES")
    for n in nodes:
        extra = f"  ({n.contacts})" if n.status == "network" and n.contacts else ""
        samples = "-"
        if n.partition is not None:
            c = n.samples_dict()
            samples = f"{c['cached']}/{c['total']} cached"
            if c["remote"]:
                samples += f", {c['remote']} in a remote"
            if c["missing"]:
                samples += f", {c['missing']} missing"
            if c["to_produce"] != c["missing"] or c["to_pull"] != c["remote"]:
                samples += f" ({c['to_pull']} to pull, {c['to_produce']} to produce)"
        print(f"{n.label or n.stage:<{width}} {n.key[:12]}  {n.status:<14} {n.needs:<8} {samples}{extra}")
    todo = sum(1 for n in nodes if n.status not in ("cached", "not needed"))
    print(f"{len(nodes)} node(s), {len(nodes) - todo} cached or not needed, {todo} to produce")
    for line in estimate_lines or []:  # `plan --estimate` (runner/core/estimate.py)
        print(line)
