"""Put the figures of a reliability run into docs/reliability.md.

    DFCACHE_RELIABILITY_SUMMARY=/tmp/rel.json python -m pytest -q tests/reliability
    python tests/reliability/render_figures.py /tmp/rel.json            # rewrites the doc's section
    python tests/reliability/render_figures.py /tmp/rel.json --print    # prints it instead

Only the text between ``<!-- figures:begin -->`` and ``<!-- figures:end -->`` is replaced.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"


def _phases(d: dict) -> str:
    order = ["staging", "chunks", "checkpoint", "publish", "between", "exited"]
    k = d.get("kills_by_phase", {})
    return ", ".join(f"{p} {k[p]}" for p in order if k.get(p))


def render(s: dict) -> str:
    f = s.get("figures", {})
    t = s.get("tests", {})
    out = [f"Last recorded run: {s['date']}, `{s['command']}`{' (--stress)' if s.get('stress') else ''}, "
           f"on {s['machine']}, Python {s['python']}: {s['seconds']:.0f} s in the reliability tests"
           + (f" ({s['session_seconds']:.0f} s for the whole session)" if s.get("session_seconds", 0) > s["seconds"] + 30
              else "") + ".",
           "",
           "Tests: " + ", ".join(f"{n} {k}" for k, n in sorted(t.items())) + ".",
           ""]
    rows = []
    if "crash_store_writers" in f:
        d = f["crash_store_writers"]
        rows.append(("store writers SIGKILLed", d["trials"], f"kills by phase: {_phases(d)}; "
                     f"{d['artifacts_committed']} artifacts committed, none lost, every rerun completed"))
    if "crash_resumable_writers" in f:
        d = f["crash_resumable_writers"]
        rows.append(("resumable writers SIGKILLed", d["trials"], f"kills by phase: {_phases(d)}; "
                     f"{d['resumed_runs']} reruns resumed (mean {d['rows_resumed_mean']} rows kept), "
                     "all byte-identical to an uninterrupted run"))
    if "crash_pull" in f:
        d = f["crash_pull"]
        rows.append(("`dfcache pull` SIGKILLed", d["trials"], f"{d['killed_mid_pull']} killed mid-pull"))
    if "crash_run_hidden_states" in f:
        d = f["crash_run_hidden_states"]
        rows.append(("`dfcache run hidden-states` SIGKILLed", d["trials"],
                     f"{d['resumed']} reruns resumed; states byte-identical to an uninterrupted run"))
    races = {k: v for k, v in f.items() if k.startswith("race_")}
    labels = {"race_same_key": "race: 8 writers of one key", "race_different_keys": "race: 8 writers of 8 keys",
              "race_gc_loop_grace_60": "race: `gc --yes` loop while writing", "race_gc_loop_grace_0":
              "race: `gc --yes --grace 0` loop while writing", "race_resumable_same_key":
              "race: 8 resumable writers of one key"}
    for k, d in sorted(races.items()):
        rows.append((labels.get(k, k), 1, ", ".join(f"{a.replace('_', ' ')} {b}" for a, b in d.items())
                     + "; every process exited 0, one copy per key, every read verified"))
    for key, label, outcome in (
            ("corruption_cases", "corruption kinds", "each: `verify` exit 5 naming the artifact, reads refused, "
             "`gc --bad --yes` and a rerun repaired it (a deleted manifest: absent, recomputed)"),
            ("corruption_runs", "runs given a corrupt input", "exit 5, one message naming the key and "
             "`dfcache gc --key ... --yes`, store unchanged"),
            ("bad_input_cases", "bad-input cases through the CLI", "the design's exit code, one message, no "
             "traceback, store unchanged"),
            ("hostile_remote_cases", "hostile-remote cases", "refused (exit 5) before anything unverified was "
             "written locally"),
            ("offline", "offline runs under the socket guard", "see below")):
        if key in f:
            rows.append((label, len(f[key]), outcome))
    out += ["| what | trials / cases | outcome |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    if "bad_input_cases" in f:
        codes: dict[int, int] = {}
        for v in f["bad_input_cases"].values():
            codes[v["exit"]] = codes.get(v["exit"], 0) + 1
        out += ["", "Bad-input cases by exit code: " + ", ".join(f"{c}: {n}" for c, n in sorted(codes.items())) + "."]
    if "offline" in f:
        out += ["", "Offline runs: " + "; ".join(f"{k}: {v}" for k, v in f["offline"].items()) + "."]
    out += ["", f"Failures: {', '.join(s['failed']) if s.get('failed') else 'none'}."]
    if s.get("skipped"):
        out += ["", "Skipped or known gaps:"]
        out += [f"- `{k.split('::', 1)[-1]}`: {v}" for k, v in sorted(s["skipped"].items())]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    summary = json.loads(Path(argv[0]).read_text())
    text = render(summary)
    if "--print" in argv:
        print(text)
        return 0
    doc = DOC.read_text()
    a, b = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:a] + "\n" + text + "\n" + doc[b:])
    print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
