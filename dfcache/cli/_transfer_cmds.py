"""`dfcache push / pull / status`: share artifacts with a remote store (s3://, file://, or a
``[remote.NAME]`` from dfcache.toml). A thin layer over :mod:`dfcache.transfer`."""

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


def _report(result) -> None:
    if state.json:
        emit_json(result.to_dict())
        return
    for key in result.missing_upstream:
        err(f"warning: upstream artifact {key} is in neither store; it was not transferred.")
    print(result.summary())


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
        from ..transfer import push_keys, select_keys

        offline = _offline()
        local = get_store(create=False)
        chosen = select_keys(local, keys or [], all_keys=all_, stage=check_stage(stage, local.list_manifests))
        remote = _remote(url, endpoint_url, create=True, offline=offline)
        result = push_keys(local, remote, chosen, with_upstream=not no_upstream,
                           progress=progress_enabled(), jobs=jobs, offline=offline)
        _report(result)

    @app.command("pull")
    def pull(url: str = typer.Argument(..., help="Remote URL (s3://bucket/prefix, file:///path) or configured name."),
             keys: Optional[List[str]] = _KEYS, all_: bool = _ALL, stage: Optional[str] = _STAGE,
             endpoint_url: Optional[str] = _ENDPOINT, jobs: int = _JOBS, no_upstream: bool = _NO_UP) -> None:
        """Fetch artifacts (and their upstream chains) the local store lacks; each is verified
        against its manifest before it is committed."""
        from ..transfer import pull_keys, select_keys

        offline = _offline()
        remote = _remote(url, endpoint_url, create=False, offline=offline)
        chosen = select_keys(remote, keys or [], all_keys=all_, stage=check_stage(stage, remote.list_manifests))
        local = get_store(create=True)
        result = pull_keys(remote, local, chosen, with_upstream=not no_upstream,
                           progress=progress_enabled(), jobs=jobs, offline=offline)
        _report(result)

    @app.command("status")
    def status(url: str = typer.Argument(..., help="Remote URL or configured name."),
               endpoint_url: Optional[str] = _ENDPOINT) -> None:
        """Which artifacts are only local, only in the remote, or in both."""
        from ..transfer import compare

        offline = _offline()
        remote = _remote(url, endpoint_url, create=False, offline=offline)
        local = get_store(create=False)
        cmp = compare(local, remote, offline=offline)
        if state.json:
            emit_json(cmp.to_dict())
            return
        for title, ms in (("only local", cmp.only_local), ("only remote", cmp.only_remote)):
            if ms:
                print(f"{title} ({len(ms)}):")
                for m in ms:
                    print(f"  {m.key[:12]}  {m.stage:<14}  {human_bytes(m.size_bytes):>9}  {m.summary}")
        print(f"{len(cmp.only_local)} only local ({human_bytes(sum(m.size_bytes for m in cmp.only_local))}), "
              f"{len(cmp.only_remote)} only remote ({human_bytes(sum(m.size_bytes for m in cmp.only_remote))}), "
              f"{len(cmp.both)} in both; local {cmp.local}, remote {cmp.remote}")
