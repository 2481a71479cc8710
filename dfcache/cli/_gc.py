"""`dfcache gc`: remove stale temporaries and, with a scope, artifacts (dfcache.maintenance:
gc_plan lists what would go, GcPlan.execute removes it)."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from ..errors import DependentsError, UsageError
from ..maintenance import gc_plan, where_scope
from .common import StageOpt, WhereOpt, check_stage, emit_json, err, examples, get_store, human_bytes, state

EPILOG = examples("dfcache gc --dry-run", "dfcache gc --stage hidden-states --older-than 30 --dry-run",
                  "dfcache gc --bad --yes")


def gc(dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be removed; remove nothing.")] = False,
       yes: Annotated[bool, typer.Option("--yes", help="Remove it.")] = False,
       tmp: Annotated[bool, typer.Option(
           "--tmp", help="Stale temporaries: crashed writers' staging areas (part of the default scope).")] = False,
       stage: StageOpt = None,
       older_than: Annotated[Optional[float], typer.Option(
           "--older-than", metavar="DAYS", show_default=False,
           help="Artifacts created more than DAYS days ago (fractions allowed: 0.5 is 12 hours).")] = None,
       key: Annotated[Optional[List[str]], typer.Option(
           "--key", metavar="KEY", show_default=False,
           help="This artifact: a key or unique prefix (repeatable).")] = None,
       bad: Annotated[bool, typer.Option("--bad", help="Artifacts that fail verification.")] = False,
       where: WhereOpt = None,
       grace: Annotated[float, typer.Option(
           "--grace", metavar="SECONDS", help="Keep temporaries younger than SECONDS (a writer may still be "
                                              "starting).")] = 60.0,
       duplicates: Annotated[bool, typer.Option(
           "--duplicates", help="Segments whose every sample is also in another segment (part of the default "
                                "scope).")] = False,
       force: Annotated[bool, typer.Option(
           "--force", help="Remove artifacts even if others depend on them (`verify` then reports the broken "
                           "chains).")] = False) -> None:
    """Remove stale temporaries and, with a scope, artifacts. Needs --dry-run or --yes.

    Without a scope (--stage, --older-than, --key, --bad, --where, --duplicates) it removes
    temporaries and duplicate segments only; --stage, --older-than and --where narrow each other.
    """
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


def register(app: typer.Typer) -> None:
    app.command("gc", epilog=EPILOG)(gc)
