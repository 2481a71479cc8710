"""`dfcache push / pull / status`: share artifacts with a remote store (s3://, file://, or a
``[remote.NAME]`` from dfcache.toml). Each command is a few lines over
:func:`dfcache.sample_transfer.transfer_selection` (artifacts as they are, segments by sample) and
:func:`dfcache.transfer.compare`."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import (EndpointOpt, KeysArg, RemoteArg, StageOpt, check_stage, emit_json, err, examples, get_store,
                     human_bytes, progress_enabled, state)

# The options push and pull share.
AllOpt = Annotated[bool, typer.Option("--all", help="Every artifact of the store.")]
JobsOpt = Annotated[int, typer.Option("--jobs", "-j", metavar="N", min=1, help="Files transferred in parallel.")]
NoUpstreamOpt = Annotated[bool, typer.Option(
    "--no-upstream", help="Only the artifacts named, not what they were made from.")]


def _offline() -> bool:
    from ..config import offline_from_env

    return state.offline or offline_from_env()


def _remote(url: str, endpoint_url: str | None, *, create: bool, offline: bool):
    from ..transfer import open_remote

    return open_remote(url, endpoint_url=endpoint_url, offline=offline, create=create)


def push(url: RemoteArg, keys: KeysArg = None, all_: AllOpt = False, stage: StageOpt = None,
         endpoint_url: EndpointOpt = None, jobs: JobsOpt = 8, no_upstream: NoUpstreamOpt = False) -> None:
    """Copy artifacts (and what they were made from) that the remote lacks; local data is
    verified first. Name them by key, --stage or --all."""
    from ..sample_transfer import transfer_selection
    from ..transfer import select_keys

    offline = _offline()
    local = get_store(create=False)
    chosen = select_keys(local, keys or [], all_keys=all_, stage=check_stage(stage, local.list_manifests))
    remote = _remote(url, endpoint_url, create=True, offline=offline)
    _report(*transfer_selection("push", local, remote, chosen, with_upstream=not no_upstream, jobs=jobs,
                                progress=progress_enabled(), offline=offline))


def pull(url: RemoteArg, keys: KeysArg = None, all_: AllOpt = False, stage: StageOpt = None,
         endpoint_url: EndpointOpt = None, jobs: JobsOpt = 8, no_upstream: NoUpstreamOpt = False) -> None:
    """Fetch artifacts (and what they were made from) that the local store lacks; each is
    verified against its manifest before it is committed. Name them by key, --stage or --all."""
    from ..sample_transfer import transfer_selection
    from ..store import Store
    from ..transfer import select_keys

    offline = _offline()
    remote = _remote(url, endpoint_url, create=False, offline=offline)
    chosen = select_keys(remote, keys or [], all_keys=all_, stage=check_stage(stage, remote.list_manifests))
    local = get_store(create=True)
    # The remote's manifests and samples documents are read as untrusted, as pull_keys reads them.
    _report(*transfer_selection("pull", Store(remote.backend.for_untrusted_reads()), local, chosen,
                                with_upstream=not no_upstream, jobs=jobs, progress=progress_enabled(),
                                offline=offline))


def _report(result, samples=None) -> None:
    if state.json:
        emit_json({**result.to_dict(), "samples": samples.to_dict() if samples is not None else None})
        return
    for key in result.missing_upstream:
        err(f"warning: upstream artifact {key} is in neither store; it was not transferred.")
    if samples is not None and samples.missing:
        err(f"warning: {len(samples.missing)} sample(s) are in neither store (first {samples.missing[0][:12]}); "
            "they were not transferred.")
    if result.transferred or result.skipped or result.missing_upstream or samples is None:
        print(result.summary())
    if samples is not None:
        print(samples.summary())


def status(url: RemoteArg, endpoint_url: EndpointOpt = None) -> None:
    """Which artifacts are only local, only in the remote, or in both (segments counted by the
    samples they hold)."""
    from ..sample_transfer import compare_samples
    from ..transfer import compare

    offline = _offline()
    remote = _remote(url, endpoint_url, create=False, offline=offline)
    local = get_store(create=False)
    cmp = compare(local, remote, offline=offline)
    samples = compare_samples(local, remote, offline=offline)
    if state.json:
        emit_json({**cmp.to_dict(), "samples": samples})
        return
    # Segments are compared by the samples they hold (the same samples may sit in other
    # segments on the other side), not listed one by one.
    for title, ms in (("only local", cmp.only_local), ("only remote", cmp.only_remote)):
        ms = [m for m in ms if not m.samples]
        if ms:
            print(f"{title} ({len(ms)}):")
            for m in ms:
                print(f"  {m.key[:12]}  {m.stage:<14}  {human_bytes(m.size_bytes):>9}  {m.summary}")
    if samples:
        print("samples by partition:")
        for r in samples:
            print(f"  {r['partition'][:12]}  {r['stage'] or '?':<14}  {r['only_local']} only local, "
                  f"{r['only_remote']} only remote, {r['both']} in both")

    def arts(ms):
        ms = [m for m in ms if not m.samples]
        return f"{len(ms)} ({human_bytes(sum(m.size_bytes for m in ms))})"

    line = (f"artifacts: {arts(cmp.only_local)} only local, {arts(cmp.only_remote)} only remote, "
            f"{len([m for m in cmp.both if not m.samples])} in both")
    if samples:
        line += (f"; samples: {sum(r['only_local'] for r in samples)} only local, "
                 f"{sum(r['only_remote'] for r in samples)} only remote, {sum(r['both'] for r in samples)} in both")
    print(f"{line}; local {cmp.local}, remote {cmp.remote}")


def register(app: typer.Typer) -> None:
    app.command("push", epilog=examples("dfcache push s3://bucket/cache --all",
                                        "dfcache push team --stage hidden-states --jobs 16",
                                        "dfcache push file:///mnt/shared/cache 3f2a9c1e --no-upstream"))(push)
    app.command("pull", epilog=examples("dfcache pull s3://bucket/cache --all",
                                        "dfcache pull team 3f2a9c1e",
                                        "dfcache pull s3://bucket/cache --stage report --endpoint-url http://minio:9000"))(pull)
    app.command("status", epilog=examples("dfcache status s3://bucket/cache",
                                          "dfcache --json status team | jq .samples"))(status)
