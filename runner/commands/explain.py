"""`dfcache explain A B`: why two τ differ (runner/trust/explain.py). Imports neither torch nor
transformers.
"""

from __future__ import annotations

import typer

from dfcache.cli.common import emit_json, examples, get_store

from .common import json_output

_EXAMPLES = examples(
    "dfcache explain 3fa2c1 9b7d04",
    "dfcache explain 3fa2c1:0 3fa2c1:1 --top 5",
    "dfcache --json explain 3fa2c1 9b7d04",
)


def explain(a: str = typer.Argument(..., metavar="A", help="A report key or unique prefix, or KEY:ROW (a row's number or drafter name)."),
            b: str = typer.Argument(..., metavar="B", help="The other report (or row), the same way; or published (published:zlab, published:ddtree): the published τ of A's target and suites, with the settings that differ."),
            top: int = typer.Option(10, "--top", metavar="N", help="Per-prompt τ deltas to list per row pair (--json lists all)."),
            json_out: bool = typer.Option(False, "--json", help="Print the explanation as JSON.")) -> None:
    """Why two τ differ: the key inputs that differ, the prompt overlap, per-prompt τ deltas."""
    from dfcache.errors import UsageError

    from ..trust.explain import explain as run_explain, format_explain

    if top < 1:
        raise UsageError(f"--top {top}: give a positive number of prompts.")
    res = run_explain(get_store(create=False), a, b)
    if json_output(json_out):
        emit_json(res)
    else:
        print(format_explain(res, top=top))


def register(app: typer.Typer) -> None:
    app.command('explain', epilog=_EXAMPLES)(explain)
