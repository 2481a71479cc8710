"""`dfcache ls / show / verify / gc`: audit and maintain a store. Reads manifests, not arrays
(except `verify`, whose job is to re-hash them)."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from ..errors import DependentsError, IntegrityError, UsageError
from ..maintenance import (backend_summary, gc_plan, ls_entry, ls_output, missing_upstream, upstream_chain,
                           where_scope)
from ..query import filter_manifests
from .common import check_kernel, check_stage, emit_json, err, get_store, human_bytes, progress_enabled, state


def register(app: typer.Typer) -> None:
    @app.command("ls")
    def ls(stage: Optional[str] = typer.Option(None, "--stage", help="Only this stage."),
           backend: Optional[str] = typer.Option(None, "--backend", help="Only hidden states of this kernel family (fla|torch)."),
           remote: Optional[str] = typer.Option(None, "--remote", help="List a remote store instead (URL or configured name)."),
           endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3 endpoint for --remote."),
           where: Optional[List[str]] = typer.Option(None, "--where", help="Provenance condition, e.g. 'fla<0.7', 'gpu~H100' (repeatable; all must hold)."),
           by: str = typer.Option("artifact", "--by", help="artifact: one line per stored artifact (segment); selection: one line per partition and prompt set (the segments of one run together).")) -> None:
        """List artifacts: key, stage, size, created, backend, inputs."""
        if by not in ("artifact", "selection"):
            raise UsageError(f"--by {by!r} is not one of artifact, selection.")
        import json
        from types import SimpleNamespace

        listed = None
        if remote:
            from ..transfer import open_remote

            store = open_remote(remote, endpoint_url=endpoint_url, offline=state.offline or None, create=False)
        else:
            store = get_store(create=False)
            if not where:  # --where reads whole manifests; the index holds only what ls prints
                listed = store.backend.listing()
        if listed is None:
            errors: list = []
            everything = store.list_manifests(errors=errors)
            stage = check_stage(stage, lambda: everything)
            backend = check_kernel(backend, everything)
            manifests = [m for m in everything if stage is None or m.stage == stage]
            if backend:
                manifests = [m for m in manifests if (m.backend or {}).get("kernel") == backend]
            if where:
                manifests = filter_manifests(manifests, where)
            entries = [ls_entry(m) for m in manifests]
            n_errors = len(errors)
        else:
            entries, n_errors = listed.artifacts, len(listed.errors)
            stage = check_stage(stage, lambda: [SimpleNamespace(stage=e[2]) for e in entries])
            if backend:
                kernels = [(e, json.loads(e[5])["backend"]) for e in entries]
                backend = check_kernel(backend, [SimpleNamespace(backend=b) for _, b in kernels])
                entries = [e for e, b in kernels if (b or {}).get("kernel") == backend]
            entries = [e for e in entries if stage is None or e[2] == stage]
        entries.sort(key=lambda e: (e[0], e[1]))  # (created, key); stable, so directory order between equals
        if by == "selection":
            from ..listing import selection_output

            sys.stdout.write(selection_output(entries, json_out=state.json, url=store.url, stage=stage, errors=n_errors))
            sys.stdout.flush()
            return
        sys.stdout.write(ls_output(entries, json_out=state.json, url=store.url, stage=stage, errors=n_errors))
        sys.stdout.flush()

    @app.command("show")
    def show(key: str = typer.Argument(..., help="A key or unique key prefix.")) -> None:
        """Show one artifact's manifest and its upstream chain."""
        store = get_store(create=False)
        full = store.resolve(key)
        m = store.manifest(full)
        chain = upstream_chain(store, m)
        if state.json:
            emit_json({**m.to_dict(), "backend": m.backend, "upstream_chain": chain})
            return
        print(f"key:          {m.key}")
        print(f"stage:        {m.stage} (version {m.stage_version})")
        print(f"created:      {m.created}  by dfcache {m.dfcache_version}")
        print(f"size:         {human_bytes(m.size_bytes)}")
        if m.summary:
            print(f"summary:      {m.summary}")
        if m.backend:
            print(f"backend:      {backend_summary(m)}")
        print("inputs:")
        for k, v in sorted(m.inputs.items()):
            print(f"  {k}: {v}")
        print("provenance:")
        for k, v in sorted(m.provenance.items()):
            print(f"  {k}: {v}")
        print("arrays:")
        for name, a in sorted(m.arrays.items()):
            print(f"  {name}: {a.dtype} {a.shape} chunks of {a.chunk_rows} rows, codec {a.codec}, "
                  f"{human_bytes(a.nbytes)}, digest {a.digest[:12]}")
        if m.blobs:
            print("documents: " + ", ".join(sorted(m.blobs)))
        print("upstream chain:")
        if not chain:
            print("  (none)")
        for c in chain:
            indent = "  " * c["depth"]
            if c.get("kind") != "samples":
                mark = "" if c["present"] else "  (not in this store)"
                print(f"{indent}{c['key'][:12]} {c['stage'] or '?'}{mark}")
                continue
            n = c["samples"]
            segs = ", ".join(s[:12] for s in c["segments"][:3]) + (", ..." if len(c["segments"]) > 3 else "")
            where = f" in segment(s) {segs}" if segs else ""
            mark = "" if c["present"] else f"  ({n['needed'] - n['present']} not in this store)"
            what = f": {c['summary']}" if c["summary"] else ""
            print(f"{indent}{c['stage'] or '?'} partition {c['key'][:12]}, {n['present']} of {n['needed']} "
                  f"sample(s){where}{mark}{what}")

    @app.command("verify")
    def verify(keys: Optional[List[str]] = typer.Argument(None, help="Keys or prefixes (default: all)."),
               recompute: Optional[int] = typer.Option(None, "--recompute", metavar="N", help="Also recompute N samples "
                                                       "of each imported set and compare (needs its declared backend)."),
               target: Optional[str] = typer.Option(None, "--target", help="With --recompute: the model that "
                                                    "recomputes (default: the one the artifact records).")) -> None:
        """Re-hash artifacts against their manifests; exit 5 if any is corrupt or incomplete."""
        if recompute is not None and recompute < 1:
            raise UsageError(f"--recompute {recompute}: give a positive number of samples.")
        if target is not None and recompute is None:
            raise UsageError("--target is for --recompute N; add --recompute (or drop --target).")
        store = get_store(create=False)
        errors: list = []
        everything = store.list_manifests(errors=errors)
        if keys:
            targets = [store.resolve(k) for k in keys]
        else:
            targets = [m.key for m in everything]
        bad = {k: [msg] for k, msg in errors}
        # A missing upstream artifact is a broken chain, not corrupt data: the dependent's own
        # bytes are fine, and a store may hold an artifact without its inputs on purpose (pulled
        # with --no-upstream, or a run that pulled only the eval it needed). A warning, exit 0,
        # as `pull` warns of an upstream that neither store has.
        wanted = set(targets)
        broken = [(m, u) for m, u in missing_upstream(store, everything) if m.key in wanted]
        progress = None
        if progress_enabled() and len(targets) > 20:  # a bar on a terminal only, never into a pipe
            from tqdm.auto import tqdm

            progress = tqdm(total=len(targets), desc="verifying", unit="artifact", leave=False)
        for k in targets:
            problems = store.verify(k)
            if problems:
                bad[k] = problems
            if progress:
                progress.update(1)
        if progress:
            progress.close()
        recomputed = _recompute(store, [k for k in targets if k not in bad], recompute, target,
                                explicit=bool(keys)) if recompute else None
        if state.json:
            emit_json({"checked": len(targets) + len(errors),
                       "bad": [{"key": k, "problems": p} for k, p in bad.items()],
                       "missing_upstream": [{"key": m.key, "stage": m.stage, "upstream": u} for m, u in broken],
                       **({"recomputed": recomputed["sets"]} if recomputed is not None else {})})
        else:
            for k, problems in bad.items():
                print(f"BAD {k}: " + "; ".join(problems))
            for m, u in broken:
                print(f"BROKEN CHAIN {m.key} ({m.stage}): upstream {u} is not in this store; recompute it "
                      "(run the command that made it) or pull it.")
            print(f"{len(targets) + len(errors)} artifact(s) checked, {len(bad)} bad"
                  + (f", {len(broken)} missing upstream artifact(s)" if broken else ""))
            for line in (recomputed or {}).get("lines", []):
                print(line)
        if broken:
            err(f"warning: {len({m.key for m, _ in broken})} artifact(s) depend on upstream artifacts that are not "
                "in this store (their own data was checked); recompute or pull the upstream if you need it, "
                "or leave it if it was left out on purpose (`pull --no-upstream`).")
        if bad:
            names = ", ".join(k[:12] for k in list(bad)[:5]) + (", ..." if len(bad) > 5 else "")
            one = next(iter(bad))[:12]
            raise IntegrityError(f"{len(bad)} artifact(s) are corrupt or incomplete ({names}); delete them "
                                 f"with `dfcache gc --bad --yes` (or one: `dfcache gc --key {one} --yes`) and "
                                 "run again to recompute them, or pull them again.")
        if recomputed and recomputed["disagree"]:
            raise IntegrityError("; ".join(recomputed["disagree"]) + ". " + recomputed["fix"])

    @app.command("gc")
    def gc(dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be removed."),
           yes: bool = typer.Option(False, "--yes", help="Remove it."),
           tmp: bool = typer.Option(False, "--tmp", help="Stale temporaries: crashed writers' staging areas (the default scope)."),
           stage: Optional[str] = typer.Option(None, "--stage", help="Every artifact of this stage."),
           older_than: Optional[float] = typer.Option(None, "--older-than", help="Artifacts created more than DAYS ago."),
           key: Optional[List[str]] = typer.Option(None, "--key", help="These artifacts (keys or prefixes)."),
           bad: bool = typer.Option(False, "--bad", help="Artifacts that fail verification."),
           where: Optional[List[str]] = typer.Option(None, "--where", help="Artifacts whose provenance matches, e.g. 'fla<0.7' (repeatable; with --stage/--older-than all must hold)."),
           grace: float = typer.Option(60.0, "--grace", help="Keep temporaries younger than this many seconds."),
           duplicates: bool = typer.Option(False, "--duplicates", help="Segments whose every sample is also in another segment (part of the default scope)."),
           force: bool = typer.Option(False, "--force", help="Remove artifacts even if others depend on them "
                                                            "(`verify` then reports the broken chains).")) -> None:
        """Remove stale temporaries and, with a scope, artifacts. Needs --dry-run or --yes."""
        if dry_run == yes:
            raise UsageError("gc needs exactly one of --dry-run (show what would go) or --yes (remove it).")
        store = get_store(create=False)
        stage = check_stage(stage, store.list_manifests)
        keys = [store.resolve(k) for k in (key or [])]
        default_scope = not (stage or older_than is not None or key or bad or duplicates or where)
        if where:
            # --where narrows --stage/--older-than instead of adding to them.
            keys += [m.key for m in where_scope(store, where, stage, older_than)]
            stage, older_than = None, None
        scope = dict(tmp=tmp or default_scope, stage=stage, older_than_days=older_than, keys=keys, bad=bad,
                     grace_s=grace, duplicates=duplicates or default_scope)
        needed: dict = {}
        try:
            plan = gc_plan(store, **scope, force=force)
        except DependentsError as e:
            if not dry_run:
                raise
            # A dry run shows what --force would remove (it exited 2 and showed nothing), and
            # says which of it others depend on: --yes still refuses those without --force.
            needed = e.dependents
            plan = gc_plan(store, **scope, force=True)
        removed = plan.execute(store, grace_s=grace) if yes else []
        if needed:
            lines = [f"  {k[:12]} is needed by {', '.join(d[:12] for d in v[:5])}" + (" ..." if len(v) > 5 else "")
                     for k, v in list(needed.items())[:10]]
            err(f"warning: {len(needed)} of these artifact(s) are needed by others:\n" + "\n".join(lines)
                + "\n--yes refuses to remove them: add the dependents too (--key), or pass --force (the dependents "
                "then show as BROKEN CHAIN in `dfcache verify`).")
        if state.json:
            emit_json({"dry_run": dry_run, "items": [i.__dict__ for i in plan.items],
                       "bytes": plan.total_bytes, "removed": removed, "needed_by": needed})
            return
        for item in plan.items:
            verb = "would remove" if dry_run else ("removed" if item.name in removed else "kept (in use)")
            print(f"{verb}: {item.kind} {item.name} ({human_bytes(item.size_bytes)})")
        freed = sum(i.size_bytes for i in plan.items if i.name in removed)
        if dry_run:
            print(f"{len(plan.items)} item(s), {human_bytes(plan.total_bytes)} would be freed; run with "
                  f"{'--yes --force' if needed else '--yes'} to remove.")
        else:
            print(f"removed {len(removed)} item(s), {human_bytes(freed)} freed.")



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
