"""`dfcache ls`: list a store's artifacts (dfcache.maintenance.ls_entries, printed by
dfcache.listing). The executable answers the plain forms of it from the listing index before
this module is imported (dfcache/__main__.py), with the same output."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ..listing import ls_output, selection_output
from ..maintenance import ls_entries
from .common import EndpointOpt, StageOpt, WhereOpt, examples, get_store, state

EPILOG = examples("dfcache ls", "dfcache ls --stage hidden-states --backend fla",
                  "dfcache --json ls --where 'fla<0.7' | jq '.[].key'", "dfcache ls --remote s3://bucket/cache")


def ls(stage: StageOpt = None,
       backend: Annotated[Optional[str], typer.Option(
           "--backend", metavar="KERNEL", show_default=False,
           help="Only hidden states of this kernel family (fla, torch), the first part of the BACKEND column.")] = None,
       remote: Annotated[Optional[str], typer.Option(
           "--remote", metavar="URL", show_default=False,
           help="List a remote store instead: s3://bucket/prefix, file:///path or a configured name.")] = None,
       endpoint_url: EndpointOpt = None,
       where: WhereOpt = None,
       by: Annotated[str, typer.Option(
           "--by", metavar="artifact|selection",
           help="artifact: a line per stored artifact (segment); selection: a line per partition and prompt set "
                "(the segments of one run together).")] = "artifact") -> None:
    """List artifacts: key, stage, size, created, backend, inputs."""
    if by not in ("artifact", "selection"):
        raise UsageError(f"--by {by!r} is not one of artifact, selection.")
    if remote:
        from ..transfer import open_remote

        store = open_remote(remote, endpoint_url=endpoint_url, offline=state.offline or None, create=False)
    else:
        store = get_store(create=False)
    entries, n_errors, stage = ls_entries(store, stage=stage, kernel=backend, where=where,
                                          known_stages=state.known_stages, known_kernels=state.known_kernels)
    output = selection_output if by == "selection" else ls_output
    sys.stdout.write(output(entries, json_out=state.json, url=store.url, stage=stage, errors=n_errors))
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("ls", epilog=EPILOG)(ls)
