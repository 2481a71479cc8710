"""`dfcache doctor`: static checks that a drafter, a target and cached completions belong together
(runner/trust/doctor.py). Imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Optional

import typer

from dfcache.cli.common import emit_json, examples, get_store
from dfcache.errors import EXIT_BAD_INPUT

from .common import json_output
from .run_options import declared

_EXAMPLES = examples(
    "dfcache doctor --target ./qwen3-8b --drafter ./dflash-ckpt",
    "dfcache doctor --target ./qwen3-8b --drafter ./dflash-ckpt --completions-from 3fa2c1",
    "dfcache doctor --target Qwen/Qwen3-8B --revision main --drafter ./dflash-ckpt --json",
)


def doctor(target: str = declared("target", ...),
           drafter: str = declared("drafters", ..., help="A drafter checkpoint directory (DFlash, EAGLE-3 or DSpark)."),
           revision: Optional[str] = declared("target_revision"),
           completions_from: Optional[str] = typer.Option(None, "--completions-from", metavar="KEY", help="Key (or prefix) of cached completions, tokens or an eval, to check template and thinking mode."),
           json_out: bool = typer.Option(False, "--json", help="Print the checks as JSON.")) -> None:
    """Check that a drafter and a target belong together; exit 6 on any error."""
    from ..trust.doctor import format_report, run_doctor

    store = get_store(create=False) if completions_from else None
    rep = run_doctor(target, drafter, target_revision=revision, store=store, completions_from=completions_from)
    if json_output(json_out):
        out = rep.to_dict()
        if not rep.ok:
            out.update(error=f"{rep.count('error')} check(s) failed", exit_code=EXIT_BAD_INPUT)
        emit_json(out)
    else:
        print(format_report(rep))
    if not rep.ok:
        raise typer.Exit(EXIT_BAD_INPUT)


def register(app: typer.Typer) -> None:
    app.command('doctor', epilog=_EXAMPLES)(doctor)
