"""Published τ tables, as data, shown beside a run's per-suite rows (marked published, with the
settings they were measured under, and which of those the run does not share).

Sources (read, figures transcribed; τ is the acceptance length, the second number of each
"speedup / τ" cell):

* ``z-lab/dflash: README.md`` at bb48ef9 (B200; ``run_benchmark.sh`` of that commit: 2048 new
  tokens, the suites' counts, thinking off, bf16, block size 16).
* ``liranringel/ddtree`` branch ``site``: ``src/data/results.tex`` (the paper's table; the
  +DDTree column is the best node budget of 16 … 1024 per dataset, model and temperature).

Both run MT-Bench over every turn (each a response); dfcache's ``suite:mt-bench`` holds first turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUITES = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "swe-bench-lite",
          "mt-bench", "alpaca")

ZLAB = "z-lab/dflash README.md @bb48ef9"
DDTREE = "liranringel/ddtree site:src/data/results.tex"

# The settings both sources ran under (their run_benchmark.sh and benchmark.py).
COMMON = {"max_new_tokens": 2048, "enable_thinking": False, "dtype": "bfloat16", "block_size": 16,
          "mt_bench_turns": "all turns"}


@dataclass(frozen=True)
class Published:
    source: str
    target: str  # Hugging Face id of the target
    drafter: str
    method: str  # "chain" (DFlash) or "tree best of 16..1024" (DFlash+DDTree)
    temperature: float
    tau: dict[str, float]  # suite -> τ
    settings: dict = field(default_factory=lambda: dict(COMMON))

    def to_dict(self) -> dict:
        return {"source": self.source, "target": self.target, "drafter": self.drafter, "method": self.method,
                "temperature": self.temperature, "tau": dict(self.tau), "settings": dict(self.settings)}


def _row(values: str) -> dict[str, float]:
    return dict(zip(SUITES, (float(v) for v in values.split())))


#                       gsm8k math500 aime24 aime25 humaneval mbpp lcb  swe  mt-bench alpaca
TABLES: list[Published] = [
    Published(ZLAB, "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "chain", 0.0,
              _row("6.50 7.84 7.47 7.28 6.63 6.19 6.97 3.70 4.35 3.10")),
    Published(ZLAB, "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "chain", 0.0,
              _row("6.55 7.87 7.48 7.31 6.55 6.00 7.12 3.69 4.25 3.16")),
    Published(ZLAB, "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "chain", 1.0,
              _row("5.98 6.67 4.97 5.01 6.05 5.55 6.60 3.09 4.03 2.99")),
    Published(ZLAB, "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "chain", 1.0,
              _row("6.04 6.57 5.06 5.03 5.40 5.17 6.79 2.82 3.74 2.88")),
    Published(DDTREE, "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "chain", 0.0,
              _row("6.51 7.72 7.54 7.37 6.62 6.10 7.02 3.66 4.38 3.11")),
    Published(DDTREE, "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "tree best of 16..1024", 0.0,
              _row("9.33 10.71 10.37 10.23 9.44 9.16 9.79 5.99 6.70 5.35")),
    Published(DDTREE, "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "chain", 0.0,
              _row("6.57 7.79 7.46 7.39 6.61 5.99 7.22 3.60 4.28 3.12")),
    Published(DDTREE, "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "tree best of 16..1024", 0.0,
              _row("9.54 10.73 10.42 9.86 9.67 9.07 10.28 5.91 6.58 5.09")),
    Published(DDTREE, "Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", "chain", 0.0,
              _row("5.18 5.58 5.16 5.13 8.02 7.19 6.32 3.61 3.52 2.22")),
    Published(DDTREE, "Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash",
              "tree best of 16..1024", 0.0, _row("7.55 8.10 7.87 7.63 10.72 9.94 8.63 5.71 5.36 3.55")),
    Published(DDTREE, "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "chain", 1.0,
              _row("5.99 6.60 5.01 4.79 5.97 5.56 6.53 3.07 4.05 2.96")),
    Published(DDTREE, "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "tree best of 16..1024", 1.0,
              _row("8.87 9.61 7.82 7.22 9.18 8.72 9.44 5.20 6.27 4.97")),
    Published(DDTREE, "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "chain", 1.0,
              _row("5.93 6.46 4.98 4.79 5.48 5.30 6.61 2.82 3.77 2.94")),
    Published(DDTREE, "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "tree best of 16..1024", 1.0,
              _row("8.95 9.54 7.79 7.71 8.59 8.34 9.53 4.86 6.02 4.89")),
    Published(DDTREE, "Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", "chain", 1.0,
              _row("5.08 5.32 4.23 4.26 7.60 7.03 5.57 3.16 3.43 2.14")),
    Published(DDTREE, "Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash",
              "tree best of 16..1024", 1.0, _row("7.38 7.76 7.32 6.62 10.42 9.76 7.79 4.96 5.14 3.51")),
]


def _name(target: str | None) -> str:
    return (target or "").rstrip("/").rpartition("/")[2].lower()


def for_run(target: str | None, suites: list[str]) -> list[Published]:
    """The published rows for this target (a Hugging Face id, or a local directory of that model's
    name) that cover any of ``suites``."""
    name = _name(target)
    return [p for p in TABLES if name and _name(p.target) == name and any(s in p.tau for s in suites)]


def differences(p: Published, run: dict) -> list[dict]:
    """The settings a published row was measured under that this run does not share: ``run`` holds
    temperature, max_new_tokens, enable_thinking, dtype, block_size (the drafter's) and prompts
    (suite -> count)."""
    from .catalog import SUITES as CATALOG

    out = []
    theirs = {**p.settings, "temperature": p.temperature}
    for name in ("temperature", "max_new_tokens", "enable_thinking", "dtype", "block_size"):
        if run.get(name) is not None and run[name] != theirs[name]:
            out.append({"setting": name, "run": run[name], "published": theirs[name]})
    for suite, n in (run.get("prompts") or {}).items():
        if suite in p.tau and suite in CATALOG and n != CATALOG[suite].samples:
            out.append({"setting": f"prompts of {suite}", "run": n, "published": CATALOG[suite].samples})
    if "mt-bench" in (run.get("prompts") or {}) and "mt-bench" in p.tau:
        turns = run.get("mt_bench_turns", "first turns")  # reports made before later turns were asked
        if turns != theirs["mt_bench_turns"]:
            out.append({"setting": "mt-bench turns", "run": turns, "published": theirs["mt_bench_turns"]})
    if p.method != "chain":
        out.append({"setting": "tree budget", "run": run.get("tree_budgets"), "published": "best of 16..1024"})
    return out


def compare(key: str, doc: dict, prompts: dict, row: int | None, which: str) -> dict:
    """``dfcache explain REPORT published[:zlab|:ddtree]``: a stored report's rows beside the published
    rows for its target and suites, τ chain per suite (from the report's per-prompt τ, cut by the
    ``SET/ID`` ids) and the settings each published row differs in."""
    from dfcache.errors import BadInputError

    from .sets import set_name, turn_of

    wanted = {"published": None, "published:zlab": ZLAB, "published:ddtree": DDTREE}
    if which not in wanted:
        raise BadInputError(f"{which!r}: compare with published, published:zlab or published:ddtree.")
    sel = doc["selection"]
    target = sel["target"].get("name") or sel["target"].get("path")
    specs = str(sel["prompts"]["source"]).split("+")
    names = [set_name(s) for s in specs]
    suites = [set_name(s) for s in specs if s.startswith("suite:")]
    pubs = [p for p in for_run(target, suites) if wanted[which] in (None, p.source)]
    if not pubs:
        have = sorted({p.target for p in TABLES})
        raise BadInputError(f"no published table covers target {target} on {', '.join(names)}; published tables "
                            f"cover {', '.join(have)} on suite:{', suite:'.join(SUITES)}: run those suites "
                            "(--prompts suite:NAME) with one of those targets.")
    groups: dict[str, list[int]] = {n: [] for n in names}
    for pos, pid in enumerate(prompts["ids"]):
        groups[pid.partition("/")[0] if len(names) > 1 else names[0]].append(pos)
    # a multi-turn suite counts its records (first turns) as the peers' sample counts do; τ is over all turns
    records = {n: sum(1 for k in groups[n] if turn_of(prompts["ids"][k]) == 1) for n in names}
    all_turns = "all turns" if any(turn_of(i) > 1 for i in prompts["ids"]) else "first turns"
    comp, ev = sel.get("completions") or {}, sel.get("eval") or {}
    out = []
    for i in (range(len(doc["drafters"])) if row is None else [row]):
        d = doc["drafters"][i]
        taus = prompts["tau_chain"][i]
        run = {"temperature": comp.get("temperature"), "max_new_tokens": comp.get("max_new_tokens"),
               "enable_thinking": comp.get("enable_thinking"), "dtype": ev.get("dtype"),
               "block_size": d.get("block_size"), "tree_budgets": ev.get("tree_budgets"),
               "prompts": {n: records[n] for n in suites}, "mt_bench_turns": all_turns}
        for p in pubs:
            per = {}
            for n in suites:
                if n in p.tau:
                    vals = [taus[k] for k in groups[n] if taus[k] is not None]
                    per[n] = {"prompts": len(groups[n]), "run": sum(vals) / len(vals) if vals else None,
                              "published": p.tau[n]}
            out.append({"row": d["drafter"], "published": p.to_dict(), "tau": per,
                        "differs": differences(p, run)})
    return {"report": key, "target": target, "published_comparison": out}


def format_compare(res: dict) -> str:
    lines = [f"report {res['report'][:12]}, target {res['target']}: τ chain per suite beside published figures "
             "(not measured here)"]
    for c in res["published_comparison"]:
        p = c["published"]
        lines += ["", f"{c['row']}  vs  {p['drafter']} ({p['method']}, T={p['temperature']:g}; {p['source']})"]
        for n, t in c["tau"].items():
            run = "-" if t["run"] is None else f"{t['run']:.2f}"
            lines.append(f"  {n:<16} run {run} over {t['prompts']} prompt(s), published {t['published']:.2f}")
        if c["differs"]:
            lines.append("  settings that differ: " + "; ".join(
                f"{d['setting']} (run {d['run']}, published {d['published']})" for d in c["differs"]))
        else:
            lines.append("  no recorded setting differs")
    return "\n".join(lines)
