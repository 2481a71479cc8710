"""`dfcache push / pull / status`: share artifacts with a remote store (s3://, file://, or a
``[remote.NAME]`` from dfcache.toml). A thin layer over :mod:`dfcache.transfer` (artifacts) and
:mod:`dfcache.sample_transfer` (segments, by sample)."""

from __future__ import annotations

from typing import List, Optional

import typer

from .common import check_stage, emit_json, err, get_store, human_bytes, progress_enabled, state


def _offline() -> bool:
    from ..config import offline_from_env

    return state.offline or offline_from_env()


def _remote(url: str, endpoint_url: Optional[str], *, create: bool, offline: bool):
    from ..transfer import open_remote

    return open_remote(url, endpoint_url=endpoint_url, offline=offline, create=create)


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


def _move(direction: str, src, dst, chosen: list[str], *, with_upstream: bool, jobs: int, offline: bool):
    """Artifacts as they are; segments by sample: only the samples the destination lacks move
    (a source segment whole when all of its samples are wanted), so two stores that hold the same
    samples in other segments exchange nothing."""
    from ..sample_transfer import pull_samples, push_samples, split_selection, with_sample_upstream
    from ..transfer import pull_keys, push_keys

    wanted, plain, referring = split_selection(src, chosen)
    if with_upstream and wanted:
        wanted = with_sample_upstream(src, wanted)
    copy = push_keys if direction == "push" else pull_keys
    copy_samples = push_samples if direction == "push" else pull_samples
    result = copy(src, dst, plain, with_upstream=with_upstream, progress=progress_enabled(), jobs=jobs,
                  offline=offline)
    if referring:
        more = copy(src, dst, referring, with_upstream=False, progress=progress_enabled(), jobs=jobs, offline=offline)
        result.transferred += more.transferred
        result.skipped += more.skipped
        result.files += more.files
        result.bytes += more.bytes
        result.seconds += more.seconds
    samples = (copy_samples(src, dst, wanted, progress=progress_enabled(), jobs=jobs, offline=offline)
               if wanted else None)
    _report(result, samples)


_KEYS = typer.Argument(None, help="Keys or unique key prefixes.")
_ALL = typer.Option(False, "--all", help="Every artifact.")
_STAGE = typer.Option(None, "--stage", help="Every artifact of this stage (or, with keys, only those of it).")
_ENDPOINT = typer.Option(None, "--endpoint-url", help="S3 endpoint (else the remote's config, else AWS_ENDPOINT_URL).")
_JOBS = typer.Option(8, "--jobs", "-j", min=1, help="Files transferred in parallel.")
_NO_UP = typer.Option(False, "--no-upstream", help="Only the named artifacts, not their upstream chains.")


def register(app: typer.Typer) -> None:
    @app.command("push")
    def push(url: str = typer.Argument(..., help="Remote URL (s3://bucket/prefix, file:///path) or configured name."),
             keys: Optional[List[str]] = _KEYS, all_: bool = _ALL, stage: Optional[str] = _STAGE,
             endpoint_url: Optional[str] = _ENDPOINT, jobs: int = _JOBS, no_upstream: bool = _NO_UP) -> None:
        """Copy artifacts (and their upstream chains) the remote lacks; local data is verified first."""
        from ..transfer import select_keys

        offline = _offline()
        local = get_store(create=False)
        chosen = select_keys(local, keys or [], all_keys=all_, stage=check_stage(stage, local.list_manifests))
        remote = _remote(url, endpoint_url, create=True, offline=offline)
        _move("push", local, remote, chosen, with_upstream=not no_upstream, jobs=jobs, offline=offline)

    @app.command("pull")
    def pull(url: str = typer.Argument(..., help="Remote URL (s3://bucket/prefix, file:///path) or configured name."),
             keys: Optional[List[str]] = _KEYS, all_: bool = _ALL, stage: Optional[str] = _STAGE,
             endpoint_url: Optional[str] = _ENDPOINT, jobs: int = _JOBS, no_upstream: bool = _NO_UP) -> None:
        """Fetch artifacts (and their upstream chains) the local store lacks; each is verified
        against its manifest before it is committed."""
        from ..store import Store
        from ..transfer import select_keys

        offline = _offline()
        remote = _remote(url, endpoint_url, create=False, offline=offline)
        chosen = select_keys(remote, keys or [], all_keys=all_, stage=check_stage(stage, remote.list_manifests))
        local = get_store(create=True)
        # The remote's manifests and samples documents are read as untrusted, as pull_keys reads them.
        _move("pull", Store(remote.backend.for_untrusted_reads()), local, chosen, with_upstream=not no_upstream,
              jobs=jobs, offline=offline)

    @app.command("status")
    def status(url: str = typer.Argument(..., help="Remote URL or configured name."),
               endpoint_url: Optional[str] = _ENDPOINT) -> None:
        """Which artifacts are only local, only in the remote, or in both."""
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
