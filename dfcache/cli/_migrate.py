"""`dfcache migrate`: upgrade the --store of an older format in place (dfcache.store.migrate_store)."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import EndpointOpt, emit_json, examples, progress_enabled, state

EPILOG = examples("dfcache --store ./store migrate --dry-run", "dfcache --store s3://bucket/cache migrate")


def migrate(dry_run: Annotated[bool, typer.Option("--dry-run", help="Check every manifest; change nothing.")] = False,
            endpoint_url: EndpointOpt = None) -> None:
    """Upgrade a store written by an older dfcache to this format, in place (every artifact is
    kept). Stop other dfcache processes on the store first."""
    from ..store import migrate_store

    bar = None
    if progress_enabled():
        from tqdm.auto import tqdm

        bar = tqdm(desc="checking manifests", unit="artifact", leave=False)
    try:
        res = migrate_store(state.store_location, endpoint_url=endpoint_url, offline=state.offline or None,
                            dry_run=dry_run, progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    if state.json:
        emit_json(res.to_dict())
        return
    if res.from_format == res.to_format:
        print(f"store {res.store} is already format {res.to_format}; nothing to do.")
        return
    verb = "would be upgraded" if dry_run else "upgraded"
    print(f"store {res.store}: format {res.from_format} {verb} to {res.to_format} ({res.artifacts} artifact(s) "
          f"checked, {res.segments} segment(s); every artifact kept as it is).")
    for u in res.unreadable[:10]:
        print(f"  unreadable manifest {u['key']}: {u['problem']}")
    if res.unreadable:
        print(f"{len(res.unreadable)} manifest(s) did not parse and were left alone; `dfcache verify` lists them "
              "and `dfcache gc --bad --yes` removes them.")


def register(app: typer.Typer) -> None:
    app.command("migrate", epilog=EPILOG)(migrate)
