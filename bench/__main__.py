"""``python -m bench``: run the dfcache benchmarks, print a table of ratios with targets, write JSON.

    python -m bench                          # every benchmark, default (medium) sizes
    python -m bench --size small             # or large, or a factor: --size 0.5
    python -m bench --only write,read        # some of them
    python -m bench --out bench/out/x.json   # default bench/out/latest.json
    python -m bench --gpu-json gpu.json      # include GPU results made by bench/gpu_extract.py
    python -m bench --markdown [--from A.json,B.json] [--doc docs/benchmarks.md]
                                             # the latest figure of every judged row, as markdown
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

from . import BENCHMARKS
from ._common import OUT_DIR, REPO, Ctx, Row, parse_size, rmtree

DEFAULT_OUT = OUT_DIR / "latest.json"
DOC_BEGIN = "<!-- BEGIN GENERATED: python -m bench --markdown -->"
DOC_END = "<!-- END GENERATED -->"


def machine_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    pkgs = {}
    for p in ("dfcache", "numpy", "torch", "zarr", "safetensors", "transformers", "xxhash", "google-crc32c",
              "numcodecs"):
        try:
            pkgs[p] = version(p)
        except PackageNotFoundError:
            pkgs[p] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"cpu_model": cpu, "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "mem_gib": mem_gib, "kernel": platform.release(), "python": platform.python_version(),
            "packages": pkgs, "git_commit": commit, "git_dirty": dirty}


# ------------------------------------------------------------------------------------ output

COLS = ("benchmark", "measure", "dfcache", "competitor", "ratio", "target", "result")


def _cells(r: dict) -> list[str]:
    return [r["bench"], r["measure"], r["dfcache"], r["competitor"], r["ratio_text"], r["target_text"],
            r["status"]]


def format_table(rows: list[dict]) -> str:
    cells = [list(COLS)] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLS))]
    widths[1] = min(widths[1], 72)
    lines = []
    for j, c in enumerate(cells):
        parts = []
        for i, v in enumerate(c):
            if i == 1 and len(v) > widths[1]:
                v = v[: widths[1] - 1] + "…"
            parts.append(v.rjust(widths[i]) if i in (4,) else v.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [(i, r) for i, r in enumerate(rows, 1) if r.get("note")]
    if notes:
        lines.append("")
        for i, r in notes:
            lines.append(f"  [{r['bench']}] {r['measure']}: {r['note']}")
    return "\n".join(lines)


def _run_source(doc: dict) -> str:
    """When and where a run was made: its date, CPU and cores, and "busy" with the load average
    when the machine ran more than one runnable thread per core (start and end of the run
    averaged): the condition CPU-time rows are judged in (issue 36)."""
    m, mach = doc["meta"], doc["meta"]["machine"]
    cores = f"{mach['usable_cpus']} cores" if mach.get("usable_cpus") else "cores unknown"
    loads = [x[0] for x in (m.get("load_avg_start"), m.get("load_avg_end")) if x]
    busy = ""
    if loads and mach.get("usable_cpus") and sum(loads) / len(loads) > mach["usable_cpus"]:
        busy = f", busy (load {sum(loads) / len(loads):.1f})"
    return f"{m['date'][:10]}, {mach['cpu_model']} ({cores}{busy})"


def latest_rows(docs: list[dict]) -> list[dict]:
    """The judged rows of several runs, a later run's benchmark replacing an earlier run's rows of
    the same benchmark; each row says where and when it was measured (``source``)."""
    by_bench: dict[str, list[dict]] = {}
    for doc in docs:
        for name in doc["meta"].get("benchmarks_run") or sorted({r["bench"] for r in doc["rows"]}):
            rows = [dict(r) for r in doc["rows"] if r["bench"] == name]
            for r in rows:
                r["source"] = r.get("source") or f"{_run_source(doc)}, `{doc['meta']['command']}`"
            if rows:
                by_bench.pop(name, None)
                by_bench[name] = rows
    return [r for rows in by_bench.values() for r in rows if r["status"] != "INFO"]


def format_markdown(docs: list[dict]) -> str:
    """The one table of docs/benchmarks.md: the latest figure of every row with a target, where,
    when and by what command it was measured. INFO rows (context, breakdowns, profiles) stay in
    the runs' JSON."""
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| benchmark | measure | dfcache | competitor | ratio | target | result | measured |",
             "|---|---|---|---|---:|---|---|---|"]
    rows = latest_rows(docs)
    for r in rows:
        lines.append("| " + " | ".join(esc(c) for c in _cells(r)) + f" | {esc(r['source'])} |")
    notes = [r for r in rows if r.get("note")]
    if notes:
        lines += ["", "Notes:", ""]
        for r in notes:
            lines.append(f"- **{esc(r['bench'])}**, {esc(r['measure'])}: {esc(r['note'])}")
    return "\n".join(lines) + "\n"


def write_doc(doc_path: Path, md: str) -> None:
    text = doc_path.read_text() if doc_path.exists() else ""
    block = f"{DOC_BEGIN}\n{md}{DOC_END}"
    if DOC_BEGIN in text and DOC_END in text:
        head, rest = text.split(DOC_BEGIN, 1)
        tail = rest.split(DOC_END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    doc_path.write_text(text)


# --------------------------------------------------------------------------------------- run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium", help="small | medium (default) | large | a factor (1 = medium)")
    ap.add_argument("--only", default=None, help="comma-separated: " + ",".join(BENCHMARKS))
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results (default bench/out/latest.json)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per contender (default per benchmark)")
    ap.add_argument("--gpu-json", default=None, help="GPU results made by bench/gpu_extract.py")
    ap.add_argument("--noop-fill-timeout", type=float, default=600,
                    help="seconds allowed for the untimed fill of the noop-eval example store (default 600)")
    ap.add_argument("--keep-tmp", action="store_true", help="keep bench/out/tmp-* scratch data")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target fails or a benchmark errors")
    ap.add_argument("--markdown", action="store_true", help="print the markdown table of a finished run")
    ap.add_argument("--from", dest="from_json", default=str(DEFAULT_OUT), help="JSON of runs to read with --markdown, comma-separated, oldest first (a later run's benchmark replaces an earlier run's)")
    ap.add_argument("--doc", default=None, help="with --markdown: also write it into this file between markers")
    args = ap.parse_args(argv)

    if args.markdown:
        docs = [json.loads(Path(p.strip()).read_text()) for p in args.from_json.split(",") if p.strip()]
        md = format_markdown(docs)
        if args.doc:
            write_doc(Path(args.doc), md)
            print(f"wrote the table of {args.from_json} into {args.doc}", file=sys.stderr)
        else:
            sys.stdout.write(md)
        return 0

    size_name, factor = parse_size(args.size)
    names = list(BENCHMARKS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BENCHMARKS]
        if unknown:
            ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    work = OUT_DIR / f"tmp-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(factor=factor, size_name=size_name, reps=args.reps, work=work, gpu_json=args.gpu_json,
              verbose=not args.quiet, options={"noop_fill_timeout": args.noop_fill_timeout})
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python -m bench" + "".join(" " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    started = time.time()
    doc = {"meta": {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "command": cmd,
                    "size": size_name, "factor": factor, "machine": machine_info(),
                    "load_avg_start": list(os.getloadavg()), "load_avg_end": None, "duration_s": None,
                    "benchmarks_run": names},
           "benchmarks": {}, "rows": []}

    @contextlib.contextmanager
    def torch_threads_kept():
        """Each benchmark starts at torch's default thread count: some pin one thread for
        steadier timings, and `eval-batching` judges its target at the default."""
        try:
            import torch
        except ImportError:
            yield
            return
        default = ctx.options.setdefault("torch_threads", torch.get_num_threads())
        torch.set_num_threads(default)
        try:
            yield
        finally:
            torch.set_num_threads(default)

    def save() -> None:
        doc["meta"]["duration_s"] = round(time.time() - started, 1)
        doc["meta"]["load_avg_end"] = list(os.getloadavg())
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        os.replace(tmp, out_path)

    try:
        for name in names:
            print(f"== {name}", file=sys.stderr, flush=True)
            t0 = time.time()
            entry: dict = {}
            try:
                mod = importlib.import_module(BENCHMARKS[name])
                with torch_threads_kept():
                    res = mod.run(ctx)
                entry = {"rows": [r.to_dict() for r in res.rows], "details": res.details}
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # one broken benchmark must not lose the others
                tb = traceback.format_exc()
                print(tb, file=sys.stderr)
                row = Row(name, "benchmark crashed", status="ERROR", note=f"{type(e).__name__}: {e}"[:300])
                entry = {"rows": [row.to_dict()], "details": {"traceback": tb}}
            entry["elapsed_s"] = round(time.time() - t0, 1)
            doc["benchmarks"][name] = entry
            doc["rows"].extend(entry["rows"])
            save()
            print(f"   {name} took {entry['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
    finally:
        if not args.keep_tmp:
            rmtree(work)
        save()

    print()
    print(f"dfcache benchmarks, size {size_name} (factor {factor:g}), {doc['meta']['date']}, "
          f"{doc['meta']['machine']['cpu_model']} x{doc['meta']['machine']['usable_cpus']}")
    print(format_table(doc["rows"]))
    statuses = [r["status"] for r in doc["rows"]]
    print()
    print(f"{statuses.count('PASS')} pass, {statuses.count('FAIL')} fail, {statuses.count('ERROR')} error, "
          f"{statuses.count('SKIPPED')} skipped, {statuses.count('INFO')} info; "
          f"{doc['meta']['duration_s']:.0f} s; JSON in {out_path}")
    if args.strict and any(s in ("FAIL", "ERROR") for s in statuses):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
