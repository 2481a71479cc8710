"""The options of `dfcache run|plan` on the command line: typer parameters made from
:data:`runner.core.options.RUN_OPTIONS`, the :class:`EvalOptions` they fill in, and this command
line rebuilt for fix messages. Shared by ``run``/``plan`` (runner/commands/run.py), ``watch`` and
``export``/``concat``, which take the same options; below all of them (none imports another)."""

from __future__ import annotations

import inspect
from typing import List, Optional

import typer

from dfcache.cli.common import progress_enabled, state
from dfcache.errors import UsageError

from ..core.options import BY_NAME, GROUPS, RUN_OPTIONS, EvalOptions, RunOption, run_argv

# TARGET of `run`/`plan` -> the stage the graph stops at.
RUN_TARGETS = {"eval": "eval", "prompts": "prompts", "completions": "completions", "tokens": "tokens",
               "hidden-states": "hidden-states", "hidden_states": "hidden-states"}
CONTEXT = {"allow_interspersed_args": True}  # options after TARGET, as before it


class GroupedCommand(typer.core.TyperCommand):
    """A command whose help lists its options under their groups (GROUPS, each option's
    ``rich_help_panel``), the global options last, in plain text: dfcache's help is not rich's
    (``rich_markup_mode=None``), and typer groups options only with rich."""

    def format_options(self, ctx, formatter) -> None:
        args, groups = [], {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append(record)
            else:
                title = getattr(param, "rich_help_panel", None) or "Store and output (global options)"
                groups.setdefault(title, []).append(record)
        order = list(GROUPS.values())
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        for title in sorted(groups, key=lambda t: order.index(t) if t in order else len(order)):
            with formatter.section(title):
                formatter.write_dl(groups[title])


def _annotation(o: RunOption):
    if o.repeat:
        return Optional[List[o.type]]
    if o.comma:
        return Optional[str]
    if o.type is bool:
        return bool
    return Optional[o.type] if o.default is None else o.type


def _parameter(o: RunOption) -> inspect.Parameter:
    decls = [f"{o.flag}/{o.off}"] if o.off else list(o.flags)
    option = typer.Option(o.cli_default, *decls, help=o.help, metavar=o.shown_metavar, rich_help_panel=GROUPS[o.group])
    return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=_annotation(o))


def declared(name: str, default=None, *, help: str | None = None):
    """A typer option of another command (parity, compare-backends, import...) that means what
    run's option ``name`` means: the same flags and metavar, and the same help unless given."""
    o = BY_NAME[name]
    decls = [f"{o.flag}/{o.off}"] if o.off else list(o.flags)
    return typer.Option(default, *decls, help=help or o.help, metavar=o.shown_metavar)


def parameters(*, drop: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """``ctx``, TARGET (``upto``) and every run option, as typer reads a command's signature."""
    upto = typer.Argument("eval", metavar="TARGET",
                          help="eval, or a stage to stop at: prompts, completions, tokens, hidden-states.")
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
              inspect.Parameter("upto", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=upto, annotation=str)]
    params += [_parameter(o) for o in RUN_OPTIONS]
    return [p for p in params if p.name not in drop]


def options_from(ctx: typer.Context, kw: dict, *, run: bool = False, plan: bool = False) -> EvalOptions:
    """The :class:`EvalOptions` that the run options in ``kw`` (typer's values) and the global
    options give; options not in ``kw`` keep their defaults. Validated. ``run``: ``--shard`` is
    allowed (the command is ``dfcache run``); ``plan``: ``--estimate`` is."""
    from dfcache.config import offline_from_env, progress_interval

    from ..core.provenance_keys import parse_key_versions

    if kw.get("server") is not None:
        # --server alone means "completions from that server": silently generating locally
        # (the default) while a server was named would cost hours on a large target.
        source = ctx.get_parameter_source("completions")
        if source is None or source.name != "COMMANDLINE":
            kw["completions"] = "server"
        elif kw.get("completions") == "local":
            raise UsageError("--completions local does not use --server; drop --server, or pass "
                             "--completions server to take completions from it.")
    if kw.get("shard") is not None and not run:
        raise UsageError(f"--shard applies to `dfcache run` only (it splits the work of a run between "
                         f"workers); drop it from `dfcache {ctx.info_name}`.")
    if kw.get("estimate") and not plan:
        raise UsageError(f"--estimate applies to `dfcache plan` only (it prices the work a plan shows); drop it "
                         f"from `dfcache {ctx.info_name}`, or run `dfcache plan ... --estimate` first.")
    values = {}
    for o in RUN_OPTIONS:
        if not o.field or o.name not in kw:
            continue
        v = kw[o.name]
        if o.comma:
            v = parse_key_versions(v)
        elif o.one_or_list:
            v = o.default if not v else (v[0] if len(v) == 1 else list(v))
        elif o.repeat:
            v = list(v) if v else (None if o.default is None else [])
        values[o.name] = v
    opts = EvalOptions(**values, offline=state.offline or offline_from_env(), json=state.json,
                       progress=progress_enabled(), progress_every=None if state.no_progress else progress_interval())
    return opts.validate()


def _click_args(c, skip: tuple[str, ...]) -> list[str]:
    """The options given on the command line to the click context ``c`` (the global options), as
    given, in declaration order."""
    args: list[str] = []
    for p in c.command.params:
        opts = getattr(p, "opts", None)
        if p.param_type_name != "option" or not opts or p.name in skip or p.name not in c.params:
            continue
        source = c.get_parameter_source(p.name)
        if source is None or source.name != "COMMANDLINE":
            continue
        value = c.params[p.name]
        if p.is_flag:
            if value:
                args.append(opts[0])
            elif p.secondary_opts:
                args.append(p.secondary_opts[0])
            continue
        for v in (value if p.multiple else [value]):
            if v is not None:
                args.extend([opts[0], str(v)])
    return args


def command_argv(ctx: typer.Context, upto: str) -> list[str]:
    """This invocation as ``run`` arguments, rebuilt from what the command line gave.

    Fix messages ("produce it with: dfcache run ...") are built from it. Rebuilt rather than
    taken from ``sys.argv``, which is not this command's when ``dfcache.cli.main([...])`` is
    called from Python, and is a ``plan`` line when planning. Only options given on the command
    line appear, in declaration order; ``--shard`` never (a fix names the whole job, not one
    worker's share).
    """
    root = ctx.find_root()
    run_names = {o.name for o in RUN_OPTIONS if o.field}  # not --shard, --estimate: the job, not how it is run
    given = {}
    for name in ctx.params:
        source = ctx.get_parameter_source(name)
        if name in run_names and source is not None and source.name == "COMMANDLINE":
            given[name] = ctx.params[name]
    before = _click_args(root, skip=("version", "debug")) if root is not ctx else []
    after = _click_args(ctx, skip=("_global_debug", *(o.name for o in RUN_OPTIONS)))
    return run_argv(upto, given, before=before, after=after)
