"""`dfcache diff KEY_A KEY_B`: numeric comparison of two artifacts' arrays (see dfcache.diff)."""

from __future__ import annotations

from typing import List, Optional

import typer

from .common import emit_json, get_store, state


def register(app: typer.Typer) -> None:
    @app.command("diff")
    def diff(key_a: str = typer.Argument(..., help="Reference artifact: a key or unique key prefix."),
             key_b: str = typer.Argument(..., help="Artifact compared with it: a key or unique key prefix."),
             array: Optional[List[str]] = typer.Option(None, "--array", help="Only this array (repeatable); default: every array both hold.")) -> None:
        """Compare two artifacts' arrays: relative L2 error, max |diff|, per-row cosine, equal share.

        For hidden states, diff the same layer of two backends (e.g. fla on GPU against the torch
        fallback, or bfloat16 against float32) made from the same tokens.
        """
        from ..diff import diff_artifacts, format_report

        store = get_store(create=False)
        a, b = store.resolve(key_a), store.resolve(key_b)
        report = diff_artifacts(store, a, b, arrays=list(array) if array else None)
        if state.json:
            emit_json(report.to_dict())
        else:
            print(format_report(report))
