"""`dfcache diff KEY_A KEY_B`: numeric comparison of two artifacts' arrays (see dfcache.diff)."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from .common import emit_json, examples, get_store, state

EPILOG = examples("dfcache diff 3f2a9c1e 77b0d4e2", "dfcache diff 3f2a9c1e 77b0d4e2 --array hidden",
                  "dfcache --json diff 3f2a9c1e 77b0d4e2 | jq '.arrays[].rel_l2'")


def diff(key_a: Annotated[str, typer.Argument(metavar="KEY_A", show_default=False,
                                              help="The reference artifact: a key or unique key prefix.")],
         key_b: Annotated[str, typer.Argument(metavar="KEY_B", show_default=False,
                                              help="The artifact compared with it: a key or unique key prefix.")],
         array: Annotated[Optional[List[str]], typer.Option(
             "--array", metavar="NAME", show_default=False,
             help="Only this array (repeatable; default: every array both hold).")] = None) -> None:
    """Compare two artifacts' arrays: relative L2 error, max |diff|, per-row cosine, equal share.

    For hidden states, diff the same layer of two backends (e.g. fla on GPU against the torch
    fallback, or bfloat16 against float32) made from the same tokens.
    """
    from ..diff import diff_artifacts, format_report

    store = get_store(create=False)
    report = diff_artifacts(store, store.resolve(key_a), store.resolve(key_b), arrays=list(array) if array else None)
    if state.json:
        emit_json(report.to_dict())
    else:
        print(format_report(report))


def register(app: typer.Typer) -> None:
    app.command("diff", epilog=EPILOG)(diff)
