"""`dfcache export`, `dfcache import` and `dfcache concat`: the store and the peers' on-disk layouts.

They take the selection options of `dfcache run` (``--target``, ``--drafter`` or ``--layer``,
``--prompts``, ``--backend``, ...), so a selection is named the same way everywhere.
"""

from __future__ import annotations

import inspect
import sys
from typing import Optional

import typer

from dfcache.cli.common import emit_json, examples, get_store, human_bytes

from .run_options import CONTEXT, GroupedCommand, command_argv, declared, options_from, parameters

# Eval-only options that do not select states.
_NOT_SELECTION = ("upto", "tree_budgets", "end_rule", "max_blocks", "trained_on", "estimate")


def _selection_params() -> list[inspect.Parameter]:
    return parameters(drop=_NOT_SELECTION)


def _with_params(func, extra: list[inspect.Parameter]):
    params = _selection_params()
    ctx_param, rest = params[0], params[1:]
    func.__signature__ = inspect.Signature([ctx_param, *extra, *rest])
    return func


def _options(ctx: typer.Context, kw: dict):
    return options_from(ctx, kw)


def _argv(ctx: typer.Context) -> list[str]:
    return command_argv(ctx, "hidden-states")


def export_command(ctx: typer.Context, **kw) -> None:
    """Write a selection's cached hidden states in SpecForge's or speculators' layout."""
    from ..peers.export import export
    from ..core.samples import resolve_selection

    fmt, out = kw.pop("format"), kw.pop("out")
    opts = _options(ctx, kw)
    if fmt == "speculators" and opts.final_state:
        from ..peers.export import refuse_final_state_in_speculators

        refuse_final_state_in_speculators()  # before resolving the selection (what export() checks too)
    store = get_store(create=False)
    sel = resolve_selection(opts, store=store, argv=_argv(ctx), last_layer_last=(fmt == "speculators"),
                            export_format=fmt)
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


def concat_command(ctx: typer.Context, **kw) -> None:
    """Store a selection's layers concatenated once more, for training reads with no copy."""
    from ..core.concat import STAGE, concat
    from ..core.samples import resolve_selection

    opts = _options(ctx, kw)
    store = get_store(create=False)
    sel = resolve_selection(opts, store=store, argv=_argv(ctx))
    progress = None
    if opts.progress:
        from tqdm.auto import tqdm

        progress = lambda n: tqdm(total=n, desc="concat", unit="sample", file=sys.stderr, leave=False)  # noqa: E731
    res = concat(sel.source(), store, progress=progress)
    if opts.json:
        emit_json(res.to_dict())
        return
    print(f"stored {res.written} sample(s) of layers {res.layers} concatenated ({human_bytes(res.bytes_written)} "
          f"in {len(res.segments)} segment(s)), {res.already} there already:")
    print(f"  {STAGE}  partition {res.partition}")
    print("read them: runner.api.hidden_state_dataset(..., concatenated=True) with the same selection")


def import_command(
    directory: str = typer.Argument(..., metavar="DIR", help="The directory the peer wrote."),
    fmt: str = typer.Option(..., "--format", metavar="specforge|speculators|modelopt", help="The peer that wrote DIR."),
    model: str = declared("target", ..., help="The target model that made the states (directory or HF id)."),
    revision: Optional[str] = declared("target_revision"),
    layers: Optional[list[int]] = declared("layers", help="Layer ids the files hold, in file order (repeatable)."),
    backend: str = declared("backend", "auto", help="The kernels that made the states (declared)."),
    device: str = declared("device", "auto", help="Where they were made (declared)."),
    attn_implementation: str = declared("attn_implementation", "sdpa", help="Attention implementation (declared)."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output on stdout."),
    store: Optional[str] = typer.Option(None, "--store", metavar="PATH", help="Store path or URL (as before the command)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
    no_check: bool = typer.Option(False, "--no-check", help="Do not check the declared layers on a recomputed "
                                  "sample (the import is marked unchecked)."),
) -> None:
    """Import hidden states made by SpecForge, speculators or ModelOpt, the declared layers checked on a
    recomputed sample."""
    from dfcache.cli.common import state
    from dfcache.errors import BadInputError

    from ..peers.imports import import_dir
    from ..core.options import EvalOptions

    if store is not None:
        state.store_location = store
    as_json = json_out or state.json
    opts = EvalOptions(target=model, target_revision=revision, backend=backend, device=device,
                       attn_implementation=attn_implementation, progress=False)
    progress = None
    if not no_progress and not as_json and sys.stderr.isatty():
        from tqdm.auto import tqdm

        progress = lambda n, what: tqdm(total=n, desc=f"import {fmt} ({what})", unit="sample",  # noqa: E731
                                        file=sys.stderr, leave=False)
    from .common import quiet_libraries

    quiet_libraries(bars=progress is not None, notices=not (no_progress or state.no_progress))
    log = None if (no_progress or state.no_progress) else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        res = import_dir(fmt, directory, opts, get_store(), layers=list(layers or []), progress=progress,
                         check=not no_check, log=log)
    except BadInputError as e:
        check = getattr(e, "layer_check", None)
        if as_json and check is not None:  # the refusal, with the check's figures
            emit_json({"error": str(e), "exit_code": e.exit_code, "type": type(e).__name__,
                       "layer_check": check.to_dict()})
            raise typer.Exit(e.exit_code) from None
        res = getattr(e, "result", None)
        if res is not None and res.samples and not as_json:
            _print_import(res)
        if as_json and res is not None:
            emit_json({**res.to_dict(), "error": str(e), "exit_code": e.exit_code})
            raise typer.Exit(e.exit_code) from None
        raise
    if as_json:
        emit_json(res.to_dict())
        return
    _print_import(res)


def _print_import(res) -> None:
    verb = "already in the store" if res.already else "imported"
    print(f"{res.samples} {res.format} sample(s) {verb}, marked {res.provenance}"
          + (f"; {res.reused} were in the store already" if res.reused and not res.already else "") + ":")
    print(f"  import            {res.tokens_key}")
    for k, key in res.layer_keys.items():
        print(f"  hidden_states[{k}]  partition {key}")
    for note in res.notes:
        print(f"note: {note}")
    if res.layer_check and res.layer_check.get("checked"):
        from ..peers.import_check import summary_of

        print(summary_of(res.layer_check))
    print(f"read them: runner.api.hidden_state_dataset(tokens_key={res.tokens_key[:12]!r}, "
          f"layers={list(res.layer_keys)})")


def register(app: typer.Typer) -> None:
    export_params = [
        inspect.Parameter("format", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                          default=typer.Option(..., "--format", metavar="specforge|speculators",
                                                       help="The peer's layout to write.")),
        inspect.Parameter("out", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str,
                          default=typer.Option(..., "--out", metavar="DIR", help="Directory to write (new, empty, or a "
                                               "previous export of the same selection, which resumes).")),
    ]
    app.command("export", cls=GroupedCommand, context_settings=CONTEXT, epilog=examples(
        "dfcache export --format specforge --out ./sf-data --target ./qwen3-8b --drafter ./dflash-ckpt",
        "dfcache export --format speculators --out ./sp-data --target ./qwen3-8b --layer 1 --layer 17 --prompts p.jsonl",
    ))(_with_params(export_command, export_params))
    app.command("import", context_settings=CONTEXT, epilog=examples(
        "dfcache import ./sf-data --format specforge --target ./qwen3-8b --layer 1 --layer 17 --backend fla --device cuda",
        "dfcache import ./mo-out --format modelopt --target ./qwen3-8b --layer 2 --backend torch --device cpu --json",
    ))(import_command)
    app.command("concat", cls=GroupedCommand, context_settings=CONTEXT, epilog=examples(
        "dfcache concat --target ./qwen3-8b --drafter ./dflash-ckpt",
        "dfcache concat --target ./qwen3-8b --layer 1 --layer 17 --prompts p.jsonl",
    ))(_with_params(concat_command, []))
