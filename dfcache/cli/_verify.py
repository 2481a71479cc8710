"""`dfcache verify [KEY]...`: re-hash artifacts against their manifests
(dfcache.maintenance.verify_artifacts); with ``--recompute N``, recompute samples of imported
sets through the recomputers command plugins register (``state.recomputers``)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from ..errors import IntegrityError, UsageError
from ..maintenance import verify_artifacts
from .common import KeysArg, emit_json, err, examples, get_store, progress_enabled, state

EPILOG = examples("dfcache verify", "dfcache verify 3f2a9c1e 77b0d4e2",
                  "dfcache verify --recompute 4 --target ./Qwen3-8B")


def verify(keys: KeysArg = None,
           recompute: Annotated[Optional[int], typer.Option(
               "--recompute", metavar="N", show_default=False,
               help="Also recompute N samples of each imported set and compare them (needs its declared "
                    "backend).")] = None,
           target: Annotated[Optional[str], typer.Option(
               "--target", metavar="PATH", show_default=False,
               help="With --recompute: the model that recomputes (default: the one the artifact records).")] = None,
           ) -> None:
    """Re-hash artifacts against their manifests (default: all); exit 5 if any is corrupt or
    incomplete."""
    if recompute is not None and recompute < 1:
        raise UsageError(f"--recompute {recompute}: give a positive number of samples.")
    if target is not None and recompute is None:
        raise UsageError("--target is for --recompute N; add --recompute (or drop --target).")
    store = get_store(create=False)
    res = verify_artifacts(store, [store.resolve(k) for k in keys or []], progress=_bar)
    recomputed = _recompute(store, res.good, recompute, target, explicit=bool(keys)) if recompute else None
    if state.json:
        emit_json({"checked": res.checked, "bad": [{"key": k, "problems": p} for k, p in res.bad.items()],
                   "missing_upstream": [{"key": m.key, "stage": m.stage, "upstream": u} for m, u in res.broken],
                   **({"recomputed": recomputed["sets"]} if recomputed is not None else {})})
    else:
        for k, problems in res.bad.items():
            print(f"BAD {k}: " + "; ".join(problems))
        for m, u in res.broken:
            print(f"BROKEN CHAIN {m.key} ({m.stage}): upstream {u} is not in this store; recompute it "
                  "(run the command that made it) or pull it.")
        print(f"{res.checked} artifact(s) checked, {len(res.bad)} bad"
              + (f", {len(res.broken)} missing upstream artifact(s)" if res.broken else ""))
        for line in (recomputed or {}).get("lines", []):
            print(line)
    if res.broken:
        err(f"warning: {len({m.key for m, _ in res.broken})} artifact(s) depend on upstream artifacts that are not "
            "in this store (their own data was checked); recompute or pull the upstream if you need it, "
            "or leave it if it was left out on purpose (`pull --no-upstream`).")
    if res.bad:
        names = ", ".join(k[:12] for k in list(res.bad)[:5]) + (", ..." if len(res.bad) > 5 else "")
        one = next(iter(res.bad))[:12]
        raise IntegrityError(f"{len(res.bad)} artifact(s) are corrupt or incomplete ({names}); delete them "
                             f"with `dfcache gc --bad --yes` (or one: `dfcache gc --key {one} --yes`) and "
                             "run again to recompute them, or pull them again.")
    if recomputed and recomputed["disagree"]:
        raise IntegrityError("; ".join(recomputed["disagree"]) + ". " + recomputed["fix"])


def _bar(total: int):
    """A progress bar of ``total`` artifacts, on a terminal only (never into a pipe) and only
    for more than 20."""
    if total <= 20 or not progress_enabled():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="verifying", unit="artifact", leave=False)


def _recompute(store, keys: list[str], n: int, target: str | None, *, explicit: bool) -> dict:
    """`verify --recompute N`: each stage's recomputer (registered by a command plugin in
    ``state.recomputers``) recomputes N samples of the artifacts among ``keys`` it knows how to
    remake, and reports their agreement: {"sets": [...], "lines": [...], "disagree": [...], "fix": str}."""
    stages = {store.manifest(k).stage for k in keys}
    hooks = {s: state.recomputers[s] for s in sorted(stages) if s in state.recomputers}
    if not hooks:
        known = ", ".join(sorted(state.recomputers)) or "none (no command plugin registered one)"
        if explicit:
            raise UsageError(f"--recompute: none of the given artifacts is of a stage that can be recomputed here "
                             f"(stages with a recomputer: {known}).")
        return {"sets": [], "lines": ["nothing to recompute: no artifact of a stage with a recomputer "
                                      f"({known})."], "disagree": [], "fix": ""}
    progress = None
    if progress_enabled():
        from tqdm.auto import tqdm

        progress = lambda total: tqdm(total=total, desc="recomputing", unit="sample", leave=False)  # noqa: E731
    merged: dict = {"sets": [], "lines": [], "disagree": [], "fix": ""}
    for stage, hook in hooks.items():
        got = hook(store, [k for k in keys if store.manifest(k).stage == stage], n, target=target,
                   progress=progress, log=None if state.json else (lambda m: print(m, file=sys.stderr, flush=True)))
        merged["sets"] += got["sets"]
        merged["lines"] += got["lines"]
        merged["disagree"] += got["disagree"]
        merged["fix"] = merged["fix"] or got.get("fix", "")
    if not merged["sets"]:
        if explicit:
            raise UsageError("--recompute: none of the given artifacts is an import to recompute (only imported "
                             "artifacts are recomputed; `dfcache ls` marks them 'imported').")
        merged["lines"].append("nothing to recompute: the store holds no imported artifacts.")
    return merged


def register(app: typer.Typer) -> None:
    app.command("verify", epilog=EPILOG)(verify)
