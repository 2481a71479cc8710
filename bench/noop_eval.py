"""`noop-eval`: a fully cached ``dfcache run eval --example`` vs DVC on an equivalent 5-stage
pipeline that is already up to date (``dvc repro`` and ``dvc status``), wall time of the
commands as a user runs them (subprocesses, interpreter start included for both).

dfcache: ``dfcache run eval --example --store <store>`` once to fill the store (not timed), then
timed repeats. ``<store>`` is ``bench/out/cache/noop-example/store``, kept between runs: the
first fill builds and trains the tiny example models (many minutes on 2 busy cores); later fills
only recompute what changed. The timed runs are no-ops; the last one's output is kept in the
JSON details to show it. If that command fails (the example is being built), the rows are SKIPPED with
the command's last error line. DVC is never installed into the project's venv: the benchmark
uses ``bench/out/dvc-venv/bin/dvc`` (``python -m venv bench/out/dvc-venv &&
bench/out/dvc-venv/bin/pip install dvc``) or a ``dvc`` on PATH, else SKIPPED.
The DVC pipeline mirrors the eval graph: prompts -> completions -> tokens -> hidden_states ->
eval, each stage a small Python script with its file deps and outs (hidden states 8 MB), DVC
initialised with ``--no-scm``, analytics off.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from ._common import (OUT_DIR, REPO, Ctx, Result, Row, alternate, bench_env, dfcache_cmd, last_line, med, ms,
                      rmtree, run_cmd, skipped, summary)

NAME = "noop-eval"
STAGES = ("prompts", "completions", "tokens", "hidden_states", "eval")
DVC_VENV = OUT_DIR / "dvc-venv"

STAGE_PY = textwrap.dedent("""\
    import hashlib, json, sys
    import numpy as np
    stage, src, dst = sys.argv[1:4]
    data = open(src, "rb").read()
    seed = int(hashlib.md5(data).hexdigest()[:8], 16)
    rng = np.random.default_rng(seed)
    if stage == "hidden_states":
        np.save(dst, rng.standard_normal((1024, 4096)).astype(np.float16))
    else:
        json.dump({"stage": stage, "from": hashlib.md5(data).hexdigest(),
                   "values": rng.integers(0, 1000, 256).tolist()}, open(dst, "w"))
""")


def find_dvc() -> str | None:
    cand = DVC_VENV / "bin" / "dvc"
    if cand.exists():
        return str(cand)
    return shutil.which("dvc")


def dvc_pipeline(root: Path, dvc: str, env: dict) -> None:
    (root / "data").mkdir(parents=True)
    (root / "out").mkdir()
    (root / "stage.py").write_text(STAGE_PY)
    (root / "data" / "prompts.jsonl").write_text(
        "".join(f'{{"id": "p{i}", "messages": [{{"role": "user", "content": "prompt {i}"}}]}}\n' for i in range(64)))
    lines = ["stages:"]
    src = "data/prompts.jsonl"
    for s in STAGES:
        dst = f"out/{s}.npy" if s == "hidden_states" else f"out/{s}.json"
        lines += [f"  {s}:", f"    cmd: {sys.executable} stage.py {s} {src} {dst}",
                  "    deps:", "      - stage.py", f"      - {src}", "    outs:", f"      - {dst}"]
        src = dst
    (root / "dvc.yaml").write_text("\n".join(lines) + "\n")
    for cmd in ([dvc, "init", "--no-scm", "-q"], [dvc, "config", "core.analytics", "false"],
                [dvc, "repro", "-q"]):
        _, cp = run_cmd(cmd, env=env, cwd=str(root), timeout=600)
        if cp.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[1:3])} failed: {last_line(cp.stderr) or last_line(cp.stdout)}")


def import_profile(cmd: list[str], env: dict) -> dict:
    """``python -X importtime`` of the command: total and the largest top-level imports."""
    _, cp = run_cmd([cmd[0], "-X", "importtime", *cmd[1:]], env=env, timeout=600)
    top: dict[str, float] = {}
    for line in cp.stderr.decode("utf-8", "replace").splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = line.split("|")
        if len(parts) < 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2]
        if name.startswith(" ") and not name.startswith("  "):  # top level
            top[name.strip()] = top.get(name.strip(), 0) + int(parts[1]) / 1e6
    ranked = dict(sorted(top.items(), key=lambda kv: -kv[1])[:10])
    return {"total_s": round(sum(top.values()), 3), "top": {k: round(v, 3) for k, v in ranked.items()},
            "imports_torch": "torch" in top or any(k.startswith("torch") for k in top)}


def run(ctx: Ctx) -> Result:
    reps = ctx.reps_or(5)
    root = ctx.tmpdir("noop")
    details: dict = {"reps": reps}
    contenders = {}
    env = bench_env()

    # dfcache: fill once
    store = OUT_DIR / "cache" / "noop-example" / "store"
    store.parent.mkdir(parents=True, exist_ok=True)
    forms = [dfcache_cmd("run", "eval", "--example", "--store", str(store), "--no-progress"),
             dfcache_cmd("--store", str(store), "run", "eval", "--example", "--no-progress")]
    dfc_cmd, dfc_skip = None, None
    fill_timeout = ctx.options.get("noop_fill_timeout", 600)
    for cmd in forms:
        ctx.log("filling (not timed): " + " ".join(cmd[2:]))
        try:
            t, cp = run_cmd(cmd, env=env, timeout=fill_timeout)
        except subprocess.TimeoutExpired:
            dfc_skip = (f"filling the example store did not finish within {fill_timeout:.0f} s (the first fill "
                        "builds and trains the tiny example models); run `dfcache --store "
                        f"{store.relative_to(REPO)} run eval --example` once, or pass --noop-fill-timeout")
            details.setdefault("dfcache_failures", []).append(dfc_skip)
            break
        if cp.returncode == 0:
            dfc_cmd = cmd
            details["dfcache_fill_s"] = round(t, 2)
            break
        why = last_line(cp.stderr) or last_line(cp.stdout)
        dfc_skip = f"`{' '.join(['dfcache'] + cmd[3:])}` failed (rc {cp.returncode}): {why}"
        details.setdefault("dfcache_failures", []).append(dfc_skip)
        if "No such option: --store" not in why:
            break
    if dfc_cmd:
        details["dfcache_command"] = "dfcache " + " ".join(dfc_cmd[3:])

        def c_dfcache() -> float:
            t, cp = run_cmd(dfc_cmd, env=env, timeout=600)
            if cp.returncode != 0:
                raise RuntimeError(f"cached dfcache run failed: {last_line(cp.stderr)}")
            details["dfcache_last_output"] = (cp.stdout + cp.stderr).decode("utf-8", "replace")[-2000:]
            return t
        contenders["dfcache"] = c_dfcache

    dvc = find_dvc()
    dvc_skip = None
    if dvc is None:
        dvc_skip = ("SKIPPED: dvc not installed; run `python -m venv bench/out/dvc-venv && "
                    "bench/out/dvc-venv/bin/pip install dvc` (or `pip install dvc` elsewhere on PATH)")
    else:
        denv = bench_env(DVC_NO_ANALYTICS="1", DVC_SITE_CACHE_DIR=str(root / "dvc-site"))
        droot = root / "dvc"
        try:
            ctx.log("building the DVC pipeline (dvc repro, not timed)")
            dvc_pipeline(droot, dvc, denv)
            _, v = run_cmd([dvc, "--version"], env=denv)
            details["dvc_version"] = v.stdout.decode().strip()

            def c_repro() -> float:
                t, cp = run_cmd([dvc, "repro"], env=denv, cwd=str(droot), timeout=600)
                if cp.returncode != 0 or b"up to date" not in cp.stdout + cp.stderr:
                    raise RuntimeError(f"dvc repro was not a no-op: {last_line(cp.stdout + cp.stderr)}")
                return t

            def c_status() -> float:
                t, cp = run_cmd([dvc, "status"], env=denv, cwd=str(droot), timeout=600)
                if cp.returncode != 0:
                    raise RuntimeError(f"dvc status failed: {last_line(cp.stderr)}")
                return t
            contenders["dvc repro"] = c_repro
            contenders["dvc status"] = c_status
        except Exception as e:
            dvc_skip = f"SKIPPED: DVC pipeline could not be built: {e}"

    times = alternate(contenders, reps, log=ctx.log) if contenders else {}
    if dfc_cmd:
        details["dfcache_imports"] = import_profile(dfc_cmd, env)
        got = re.search(r"from the cache; ([0-9.]+) s", details.get("dfcache_last_output", ""))
        details["dfcache_self_reported_s"] = float(got.group(1)) if got else None
    rmtree(root)
    details["seconds"] = {k: summary(v) for k, v in times.items()}
    m = {k: med(v) for k, v in times.items()}
    rows = []
    for comp in ("dvc repro", "dvc status"):
        measure = f"no-op eval, 5 stages cached: dfcache run eval vs {comp}"
        if dvc_skip:
            r = skipped(NAME, measure, dvc_skip)
            if "dfcache" in m:
                r.dfcache = ms(m["dfcache"])
        elif dfc_skip:
            r = skipped(NAME, measure, "SKIPPED: " + dfc_skip)
            r.competitor = ms(m[comp])
        else:
            imp = details.get("dfcache_imports") or {}
            r = Row(NAME, measure, ms(m["dfcache"]), ms(m[comp]), m["dfcache"] / m[comp], target=0.35,
                    direction="<=", note=f"time ratio (lower is better); dvc {details.get('dvc_version', '')}; "
                    f"of dfcache's time, imports take {imp.get('total_s', float('nan')):.2f} s (largest: "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in list(imp.get("top", {}).items())[:3])
                    + f"), the run reports {details.get('dfcache_self_reported_s')} s itself").judge()
        rows.append(r)
    return Result(rows, details)
