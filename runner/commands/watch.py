"""`dfcache watch DIR`: evaluate a training run's checkpoints as they appear, τ by step.

Each poll lists DIR's checkpoints (``runner/drafters/checkpoints.py``: ``checkpoint-N``, ``step_N``, ...,
or the directories a glob matches), takes those that are completely written and not yet
evaluated, and evaluates them through the normal eval graph: prompts, completions, tokens and
hidden states are resolved like ``run eval`` does, so the target side is computed once (or
found in the store) and every checkpoint costs only its drafter passes. A checkpoint counts as
completely written when ``config.json`` parses, every safetensors file's header is readable and
its data reaches the end of the file, and none of its files changed for ``--interval`` seconds
(seen unchanged over one interval, or last modified longer ago than that). A checkpoint that
fails (bad config, another target's width) is reported and skipped until its files change.

After each round that evaluated something, or changed which checkpoints wait or failed, the
report directory is rewritten (each file replaced atomically): watch.json (what ``--json`` prints), watch.md, tau_by_step.png, histograms.png and report.html.
``--once`` evaluates what is there (waiting at most one interval for a checkpoint that was just
written to settle) and exits; without it the watch runs until interrupted. Ctrl-C exits with 130:
artifacts are committed atomically by the store, report files are replaced whole, so nothing is
half-written. Under ``--json`` a continuous watch prints one JSON object per round (JSON Lines).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from dfcache.cli.common import emit_json, examples, get_store
from dfcache.errors import BadInputError, DfcacheError, UsageError

from ..drafters.checkpoints import (Checkpoint, glob_checkpoints, incomplete_reason, is_glob, newest_mtime, snapshot,
                                    training_checkpoints)
from ..core.options import EvalOptions
from .run_options import CONTEXT, GroupedCommand, command_argv, options_from, parameters

FILES = ("watch.json", "watch.md", "tau_by_step.png", "histograms.png", "report.html")
SETTLE_SLACK = 1.0  # seconds `--once` may wait past one interval, for the clock's rounding


# --------------------------------------------------------------------------------------------
# When a checkpoint is completely written
# --------------------------------------------------------------------------------------------

class Readiness:
    """Whether a checkpoint is complete and has not changed for ``settle`` seconds.

    A checkpoint is settled when the same snapshot (names, sizes, mtimes) was seen ``settle``
    seconds apart, or when its newest file is older than ``settle`` (so an old checkpoint is
    taken at the first look, and a fresh one after one interval).
    """

    def __init__(self, settle: float, clock: Callable[[], float] = time.time) -> None:
        self.settle = settle
        self.clock = clock
        self.seen: dict[Path, tuple[tuple, float]] = {}

    def check(self, path: Path) -> tuple[bool, str | None, float]:
        """(ready, why not, seconds until it could be settled)."""
        snap = snapshot(path)
        now = self.clock()
        prev = self.seen.get(path)
        if prev is None or prev[0] != snap:
            self.seen[path] = (snap, now)
            since = now
        else:
            since = prev[1]
        problem = incomplete_reason(path)
        if problem:
            return False, problem, self.settle
        quiet = max(now - since, now - (newest_mtime(snap) or now))
        if quiet >= self.settle:
            return True, None, 0.0
        return False, f"being written (changed {quiet:.0f} s ago, waiting for {self.settle:g} s without change)", \
            self.settle - quiet

    def changed(self, path: Path) -> bool:
        prev = self.seen.get(path)
        return prev is None or not path.exists() or snapshot(path) != prev[0]

    def forget(self, path: Path) -> None:
        self.seen.pop(path, None)


# --------------------------------------------------------------------------------------------
# The watch
# --------------------------------------------------------------------------------------------

@dataclass
class Evaluated:
    step: int | None
    path: str
    name: str
    key: str
    computed: bool
    summary: dict
    snapshot: tuple = ()
    node: Any = None  # the drafter_eval node (its samples: the per-prompt views read them)

    def to_dict(self) -> dict:
        s = self.summary
        return {"step": self.step, "path": self.path, "name": self.name, "tau_chain": s["chain"]["tau"],
                "tau_tree": {b: t["tau"] for b, t in s["tree"].items()}, "computed": self.computed,
                "key": self.key, "blocks": s["chain"]["num_blocks"],
                "tokens_per_block": s["chain"]["tokens_per_block"], "responses": s["chain"]["num_responses"]}


def default_report_dir(store, directory: str) -> Path:
    import xxhash

    base = Path(directory.split("*")[0] if is_glob(directory) else directory)
    name = (base.name or base.resolve().name or "run").strip("-_") or "run"
    tag = xxhash.xxh3_64_hexdigest(os.path.abspath(os.path.expanduser(directory)).encode())[:8]
    reports = store.local_dir("reports")
    return (reports if reports is not None else Path("reports")) / f"watch-{name}-{tag}"


class Watch:
    def __init__(self, store, opts: EvalOptions, *, directory: str, reference: str | None, interval: float,
                 once: bool, out_dir: Path, html_step: int | None, argv: list[str], remotes: list,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        self.store = store
        self.opts = opts
        self.directory = directory
        self.reference_arg = reference
        self.interval = interval
        self.once = once
        self.out_dir = out_dir
        self.html_step = html_step
        self.argv = argv
        self.remotes = remotes
        self.sleep = sleep
        self.readiness = Readiness(interval, clock)
        self.records: dict[str, Evaluated] = {}
        self.failed: dict[str, tuple[tuple, str]] = {}
        self.pending: dict[str, str] = {}
        self.reference: Evaluated | None = None
        self.reference_ref = None
        self.tokens_key: str | None = None
        self.tokens_node = None
        self.target_dir: str | None = None
        self.budgets = sorted({int(b) for b in opts.tree_budgets})
        self.started = time.perf_counter()
        self.computed_keys: set[str] = set()  # evaluated by this process (a record may be redone from cache)
        self._header = False

    # ------------------------------------------------------------------ discovery

    def check_inputs(self) -> None:
        """Bad DIR or --reference: exit 6 before any work."""
        from ..stages.drafter_eval import read_drafter_in

        if not is_glob(self.directory):
            d = Path(self.directory).expanduser()
            if not d.is_dir():
                raise BadInputError(f"watch: {self.directory} is not a directory; pass the training output "
                                    "directory (the one holding checkpoint-N/ or step_N/ subdirectories), or a "
                                    "quoted glob such as 'runs/x/checkpoint-*'.")
            if (d / "config.json").exists() and not training_checkpoints(d):
                raise BadInputError(f"watch: {self.directory} is a checkpoint itself, not a training output "
                                    f"directory; watch its parent, or evaluate it with dfcache run eval "
                                    f"--drafter {self.directory}.")
        if self.reference_arg:
            from ..core.graph import RunContext

            planning = RunContext(self.store, self.opts, remotes=self.remotes, argv=self.argv)
            self.reference_ref = read_drafter_in(planning, self.reference_arg)

    def discover(self) -> list[Checkpoint]:
        if is_glob(self.directory):
            return glob_checkpoints(self.directory)
        return training_checkpoints(Path(self.directory).expanduser())

    def poll(self) -> tuple[list[Checkpoint], float | None]:
        """The checkpoints ready to evaluate now, and how long until a settling one may be ready."""
        ready, soonest = [], None
        self.pending = {}
        for c in self.discover():
            p = str(c.path)
            done = self.records.get(p)
            if done is not None:
                if snapshot(c.path) == done.snapshot:
                    continue
                del self.records[p]  # rewritten in place (a restarted run): evaluate it again
            failed = self.failed.get(p)
            if failed is not None:
                if snapshot(c.path) == failed[0]:
                    continue
                del self.failed[p]
            ok, why, wait = self.readiness.check(c.path)
            if ok:
                ready.append(c)
            else:
                self.pending[p] = why
                if why.startswith("being written"):
                    soonest = wait if soonest is None else min(soonest, wait)
        return ready, soonest

    def _fail(self, path: Path, message: str) -> None:
        self.failed[str(path)] = (snapshot(path) if path.exists() else (), message)
        self.log(f"warning: skipping checkpoint {path}: {message}")

    def log(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, ready: list[Checkpoint]) -> list[Evaluated]:
        from ..core.graph import RunContext, check_offline, resolve, topo_order
        from ..core.pipeline import execute
        from ..stages import completions, drafter_eval, hidden_states, prompts, tokens

        refs = []
        planning = RunContext(self.store, self.opts, remotes=self.remotes, argv=self.argv)
        for c in ready:
            try:
                ref = drafter_eval.read_drafter_in(planning, str(c.path))  # its family's plan, against the target
            except BadInputError as e:
                self._fail(c.path, str(e))
                continue
            ref.step = c.step
            refs.append(ref)
        with_reference = self.reference_ref is not None and self.reference is None
        todo = ([self.reference_ref] if with_reference else []) + refs
        if not todo:
            return []
        ctx = RunContext(self.store, self.opts, remotes=self.remotes, argv=self.argv)
        tok = tokens.build(ctx, completions.build(ctx, prompts.build(ctx)))
        self.tokens_key, self.tokens_node, self.target_dir = tok.key, tok, tok.spec.target_dir
        hs = hidden_states.build(ctx, tok, hidden_states.requested_layers(ctx, todo))
        evals = []
        for ref in todo:
            try:
                evals.append((ref, drafter_eval.build(ctx, tok, hs, ref)))
            except BadInputError as e:
                if ref is self.reference_ref:
                    raise
                self._fail(ref.path, str(e))
        if not evals:
            return []
        nodes = resolve(ctx, topo_order([n for _, n in evals]))
        check_offline(ctx, nodes)
        execute(ctx, [n for n in nodes if n.stage != drafter_eval.NAME])  # the target side, once
        out = []
        for ref, node in evals:
            is_reference = ref is self.reference_ref
            try:
                execute(ctx, [node])
            except DfcacheError as e:
                if is_reference or not isinstance(e, BadInputError):
                    raise
                self._fail(ref.path, str(e))
                continue
            except Exception as e:
                # A checkpoint removed (the trainer's rotation) or rewritten while it was read is
                # not an error: it is looked at again once it is stable.
                if is_reference or not self.readiness.changed(ref.path):
                    raise
                self.readiness.forget(ref.path)
                self.log(f"note: checkpoint {ref.path} changed while it was evaluated ({type(e).__name__}); "
                         "it is evaluated again once it is stable.")
                continue
            if node.key in ctx.work_done:
                self.computed_keys.add(node.key)
            rec = Evaluated(ref.step, str(ref.path), ref.name, node.key, node.key in self.computed_keys,
                            drafter_eval.read_summary(self.store, node),
                            () if is_reference else self.readiness.seen.get(ref.path, ((), 0))[0], node)
            if is_reference:
                self.reference = rec
            else:
                self.records[rec.path] = rec
                out.append(rec)
        return out

    # ------------------------------------------------------------------ results

    def ordered(self) -> list[Evaluated]:
        return sorted(self.records.values(), key=lambda r: (r.step is None, r.step or 0, r.name))

    def result(self, files: dict[str, Path]) -> dict:
        ref = self.reference
        return {
            "dir": self.directory,
            "reference": None if ref is None else {k: v for k, v in ref.to_dict().items() if k != "step"},
            "checkpoints": [r.to_dict() for r in self.ordered()],
            "pending": [{"path": p, "reason": why} for p, why in sorted(self.pending.items())],
            "failed": [{"path": p, "error": msg} for p, (_, msg) in sorted(self.failed.items())],
            "tree_budgets": self.budgets, "end_rule": self.end_rule(),
            "report_dir": str(self.out_dir), "files": {k: str(v) for k, v in files.items()},
            "seconds": round(time.perf_counter() - self.started, 3),
        }

    def end_rule(self) -> str | None:
        for r in [self.reference, *self.records.values()]:
            if r is not None:
                return r.summary.get("rule")
        return None

    def print_rows(self, rows: list[Evaluated]) -> None:
        if self.opts.json:
            return
        if not self._header:
            head = f"{'STEP':>8}  {'CHECKPOINT':<24} {'τ chain':>8}" + "".join(f" {'τ tree-' + str(b):>10}"
                                                                           for b in self.budgets)
            print(head + f"  {'KEY':<12}  STATUS", flush=True)
            self._header = True
        for r in rows:
            d = r.to_dict()
            step = "ref" if r is self.reference else ("-" if r.step is None else str(r.step))
            line = f"{step:>8}  {r.name[:24]:<24} {fmt(d['tau_chain']):>8}" + "".join(
                f" {fmt(d['tau_tree'].get(str(b))):>10}" for b in self.budgets)
            print(line + f"  {r.key[:12]}  {'computed' if r.computed else 'cached'}", flush=True)

    # ------------------------------------------------------------------ the report

    def write_report(self) -> dict[str, Path]:
        from ..core import reporting

        records = self.ordered()
        points = [_point(r) for r in records]
        ref = _point(self.reference) if self.reference else None
        latest = records[-1] if records else None
        best = max(records, key=lambda r: (r.summary["chain"]["tau"] or 0, r.step or 0)) if records else None
        chosen = best
        if self.html_step is not None:
            hits = [r for r in records if r.step == self.html_step]
            if hits:
                chosen = hits[-1]
            elif self.once:
                self.log(f"note: no evaluated checkpoint has step {self.html_step}; the page shows the best one.")
        files: dict[str, bytes] = {}
        doc = self.result({name: self.out_dir / name for name in FILES})
        files["watch.json"] = (json.dumps(doc, indent=1) + "\n").encode()
        files["watch.md"] = (self.markdown(records) + "\n").encode()
        files["tau_by_step.png"] = reporting.tau_by_step_png(points, ref, self.budgets)
        hists = []
        for label, r in (("latest", latest), ("best", best)):
            if r is not None and (label == "latest" or r is not latest):
                hists.append((f"{label}: {r.name} (τ {fmt(r.summary['chain']['tau'])})", r.summary["chain"]["histogram"]))
        if self.reference:
            hists.append((f"reference: {self.reference.name} (τ {fmt(self.reference.summary['chain']['tau'])})",
                          self.reference.summary["chain"]["histogram"]))
        files["histograms.png"] = reporting.histograms_png(hists)
        files["report.html"] = self.html(records, latest, best, chosen, files).encode()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name in FILES:  # each file replaced whole: a reader never sees half of one
            path = self.out_dir / name
            tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
            tmp.write_bytes(files[name])
            os.replace(tmp, path)
            paths[name] = path
        return paths

    def markdown(self, records: list[Evaluated]) -> str:
        head = ["step", "checkpoint", "τ chain"] + [f"τ tree-{b}" for b in self.budgets] + ["blocks", "tokens/block", "key"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        rows = ([("reference", self.reference)] if self.reference else []) + \
            [("-" if r.step is None else str(r.step), r) for r in records]
        for step, r in rows:
            d = r.to_dict()
            cells = [step, r.name, fmt(d["tau_chain"])] + [fmt(d["tau_tree"].get(str(b))) for b in self.budgets] + \
                [str(d["blocks"]), fmt(d["tokens_per_block"]), r.key[:12]]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + f"\n\nEnd rule: {self.end_rule()} (see docs/metrics.md)."

    def html(self, records, latest, best, chosen, files: dict[str, bytes]) -> str:
        from ..core import reporting
        from ..stages import drafter_eval
        from ..stages.tokens import read_tokens

        headers = ["step", "checkpoint", "τ chain"] + [f"τ tree-{b}" for b in self.budgets] + \
            ["blocks", "tokens/block", "responses", "key"]
        rows = []
        for r in ([self.reference] if self.reference else []) + records:
            d = r.to_dict()
            cls = "reference" if r is self.reference else " ".join(
                c for c, hit in (("best", r is best), ("latest", r is latest)) if hit)
            step = "reference" if r is self.reference else ("-" if r.step is None else str(r.step))
            rows.append((cls, [step, r.name, fmt(d["tau_chain"])] + [fmt(d["tau_tree"].get(str(b)))
                                                                    for b in self.budgets]
                         + [d["blocks"], fmt(d["tokens_per_block"]), d["responses"], r.key[:12]]))
        shown = [("latest", latest)] + ([("chosen" if self.html_step is not None else "best", chosen)]
                                        if chosen is not None and chosen is not latest else [])
        if self.reference:
            shown.append(("reference", self.reference))
        views = [reporting.DrafterView(f"{label}: {r.name}" + (f" (step {r.step})" if r.step is not None and label != "reference" else ""),
                                       drafter_eval.read_responses(self.store, r.node), int(r.summary["block_size"]))
                 for label, r in shown if r is not None]
        toks = read_tokens(self.store, self.tokens_node) if self.tokens_node is not None and views else None
        block = max((v.block_size for v in views), default=2)
        section = ("<h2>Per prompt</h2>" + reporting.legend_html(block)
                   + reporting.per_prompt_html(views, toks, reporting.TokenText.from_target(self.target_dir), self.budgets))
        subtitle = (f"{self.directory}: {len(records)} checkpoint(s) evaluated"
                    + (f", reference {self.reference.name}" if self.reference else "")
                    + f"; end rule {self.end_rule()}; {time.strftime('%Y-%m-%d %H:%M:%S')}")
        pending = [f"not yet evaluated: {p} ({why})" for p, why in sorted(self.pending.items())]
        pending += [f"skipped: {p}: {msg}" for p, (_, msg) in sorted(self.failed.items())]
        return reporting.page(title="dfcache watch: τ by step", subtitle=subtitle,
                              table=reporting.table_html(headers, rows),
                              images=[("τ by training step", files["tau_by_step.png"]),
                                      ("acceptance histograms", files["histograms.png"])],
                              sections=[section], warnings=pending)

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict:
        self.check_inputs()
        if self.once:
            found = self.discover()
            if not found:
                raise BadInputError(f"watch: {self.directory} holds no checkpoint (checkpoint-N, step_N, ... "
                                    "directories); pass the training output directory or a glob that matches them.")
        else:
            self.log(f"watching {self.directory} every {self.interval:g} s (Ctrl-C to stop); report in {self.out_dir}")
        first = True
        paths: dict[str, Path] = {}
        shown_waiting: tuple = ((), ())
        try:
            while True:
                ready, soonest = self.poll()
                if self.once and soonest is not None and first:
                    ready = self._settle_once(ready, soonest)
                new = self.evaluate(ready) if ready or first else []
                if first and self.reference:
                    self.print_rows([self.reference])
                self.print_rows(new)
                waiting = (tuple(sorted(self.pending)), tuple(sorted(self.failed)))
                if new or first or waiting != shown_waiting:  # the page lists what is not evaluated
                    paths = self.write_report()
                    shown_waiting = waiting
                    if self.opts.json and not self.once and (new or first):
                        emit_json(self.result(paths))
                first = False
                if self.once:
                    break
                self.sleep(max(self.interval, 0.1))  # --interval 0 must not spin
        except KeyboardInterrupt:
            self.log(f"watch stopped: {len(self.records)} checkpoint(s) evaluated; report in {self.out_dir}")
            raise
        result = self.result(paths)
        for p, why in sorted(self.pending.items()):  # on stderr whatever the output, terminal or not
            self.log(f"skipped (still being written): {p}: {why}; run the watch again once it is complete.")
        if self.opts.json:
            emit_json(result)
        else:
            for name, path in paths.items():
                print(f"{name:<28} {path}")
        return result

    def _settle_once(self, ready: list[Checkpoint], soonest: float) -> list[Checkpoint]:
        """``--once``: wait, at most one interval from the first look, for the checkpoints being
        written to settle, looking again after each wait. One wait was not enough: the wall clock
        the checkpoint's quiet time is measured on may advance a little less than the sleep did
        (rounding, NTP slewing), so a checkpoint unchanged for the whole wait was still "29.99 s
        quiet" and left pending. A checkpoint that changes meanwhile keeps waiting until the end."""
        clock = self.readiness.clock
        deadline = clock() + self.interval + SETTLE_SLACK
        self.log(f"waiting up to {min(soonest, self.interval):.1f} s for checkpoints being written to settle")
        while soonest is not None:
            left = deadline - clock()
            if left <= 0:
                break
            self.sleep(min(max(soonest, 0.05), left))
            more, soonest = self.poll()
            ready += [c for c in more if c.path not in {r.path for r in ready}]
        return ready


def fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _point(r: Evaluated):
    from ..core.reporting import Point

    s = r.summary
    return Point(r.name, r.step, s["chain"]["tau"], {b: t["tau"] for b, t in s["tree"].items()},
                 s["chain"]["histogram"], r.key)


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

_EXAMPLES = examples("dfcache watch runs/x --target ./qwen3-8b --server http://127.0.0.1:30000",
                     "dfcache watch 'runs/x/checkpoint-*' --example --once",
                     "dfcache watch runs/x --target ./qwen3-8b --reference ./dflash-release --interval 600")
_OWN = ("ctx", "directory", "reference", "interval", "once", "html_checkpoint", "out")
_DROPPED = ("ctx", "upto", "drafters", "example", "estimate")  # of run's options: DIR and --reference replace them


def _command():
    def watch(ctx: typer.Context,
              directory: str = typer.Argument(..., metavar="DIR", help="A training output directory (checkpoint-N/, step_N/ ...) or a quoted glob."),
              reference: Optional[str] = typer.Option(None, "--reference", metavar="PATH", help="A reference drafter checkpoint, drawn as a horizontal line."),
              interval: float = typer.Option(30.0, "--interval", metavar="SECONDS", help="Seconds between looks; a checkpoint must be unchanged this long."),
              once: bool = typer.Option(False, "--once", help="Evaluate what is there and exit."),
              html_checkpoint: Optional[int] = typer.Option(None, "--html-checkpoint", metavar="STEP", help="Step whose per-prompt view the HTML report shows beside the latest (default: the best)."),
              out: Optional[str] = typer.Option(None, "--out", metavar="DIR", help="Report directory (default: <store>/reports/watch-<name>-<hash>/)."),
              **kw) -> None:
        """Evaluate a training run's checkpoints as they are written: τ by step, plots, HTML."""
        opts = options_from(ctx, kw)
        if not interval >= 0:
            raise UsageError(f"--interval {interval:g}: give a number of seconds (0 or more).")
        from ..core.execution import open_remotes

        # Fix messages quote this command line: `watch DIR ...` in place of `run eval ...`.
        marker = "\0watch-dir"
        argv = command_argv(ctx, marker)
        i = argv.index(marker)
        argv[i - 1:i + 1] = ["watch", directory]
        store = get_store()
        w = Watch(store, opts, directory=directory, reference=reference, interval=interval, once=once,
                  out_dir=Path(out) if out else default_report_dir(store, directory), html_step=html_checkpoint,
                  argv=argv, remotes=open_remotes(opts))
        w.run()

    own = inspect.signature(watch, eval_str=True).parameters
    params = [own[n] for n in _OWN] + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                                       for p in parameters(drop=_DROPPED)]
    watch.__signature__ = inspect.Signature(params)
    return watch


def register(app: typer.Typer) -> None:
    app.command("watch", cls=GroupedCommand, context_settings=CONTEXT, epilog=_EXAMPLES)(_command())
