"""`dfcache export` and `dfcache import`: the store and the peers' on-disk layouts.

Both take the selection options of `dfcache run` (``--target``, ``--drafter`` or ``--layer``,
``--prompts``, ``--backend``, ...), so a selection is named the same way everywhere.
"""

from __future__ import annotations

import inspect
import sys
from typing import Optional

import typer

from dfcache.cli._common import emit_json, get_store, human_bytes

# Eval-only options that do not select states.
_NOT_SELECTION = ("target", "tree_budget", "end_rule", "max_blocks", "trained_on")


def _selection_params() -> list[inspect.Parameter]:
    from .cli import _make_command

    sig = inspect.signature(_make_command("options"), eval_str=True)
    return [p for p in sig.parameters.values() if p.name not in _NOT_SELECTION]


def _with_params(func, extra: list[inspect.Parameter]):
    params = _selection_params()
    ctx_param, rest = params[0], params[1:]
    func.__signature__ = inspect.Signature([ctx_param, *extra, *rest])
    return func


def _options(ctx: typer.Context, kw: dict):
    from .cli import _make_command

    return _make_command("options")(ctx, target="hidden-states", tree_budget=None, end_rule="within",
                                    max_blocks=None, trained_on=None, **kw)


def _argv(ctx: typer.Context) -> list[str]:
    from .cli import _run_argv

    return _run_argv(ctx, "hidden-states")


def export_command(ctx: typer.Context, **kw) -> None:
    """Write a selection's cached hidden states in SpecForge's or speculators' layout."""
    from .export import export
    from .samples import resolve_selection

    fmt, out = kw.pop("format"), kw.pop("out")
    opts = _options(ctx, kw)
    store = get_store(create=False)
    sel = resolve_selection(opts, store=store, argv=_argv(ctx), last_layer_last=(fmt == "speculators"))
    progress = None
    if opts.progress:
        from tqdm.auto import tqdm

        progress = lambda n: tqdm(total=n, desc=f"export {fmt}", unit="sample", file=sys.stderr,  # noqa: E731
                                  leave=False)
    res = export(sel, fmt, out, progress=progress)
    if opts.json:
        emit_json(res.to_dict())
        return
    print(f"exported {res.samples} sample(s) of layers {res.layers} as {fmt} to {res.out}: "
          f"{res.written} written ({human_bytes(res.bytes_written)}), {res.skipped} already there")
    for f in res.files[:3]:
        print(f"  {f}")
    if len(res.files) > 3:
        print(f"  ... {len(res.files) - 3} more")
    for note in res.notes:
        print(f"note: {note}")
    print(f"manifest: {res.out / 'dfcache-export.json'}")


def register(app: typer.Typer) -> None:
    export_params = [
        inspect.Parameter("format", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                          default=typer.Option(..., "--format", help="specforge|speculators")),
        inspect.Parameter("out", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                          default=typer.Option(..., "--out", help="Directory to write (new, empty, or a "
                                               "previous export of the same selection, which resumes).")),
    ]
    app.command("export", context_settings={"allow_interspersed_args": True})(
        _with_params(export_command, export_params))
