"""The options of `dfcache run|plan` are declared once (runner/core/options.py, RUN_OPTIONS): the
typer commands, EvalOptions, the cached-run fast path, the Python API and docs/cli.md's tables are
derived from it, and each is checked against it here, so that none can drift."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import typer

from runner.core.options import (BY_NAME, GROUPS, RUN_OPTIONS, EvalOptions, default_of, markdown_tables,
                                 run_argv)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def commands():
    """The runner's click commands, as the `dfcache` command line registers them."""
    from runner.commands import register

    app = typer.Typer()
    register(app)
    return typer.main.get_command(app).commands


def _sample(o):
    """A value of ``o`` other than its default that validates (None: the option is left out)."""
    if o.type is bool:
        return True
    if o.name in ("completions", "end_rule", "temperature"):  # the others need --server or are refused
        return None
    if o.choices:
        return next(c for c in o.choices if c != o.default)
    if o.comma:
        return ["torch", "transformers"]
    if o.name == "mix":
        return None  # needs several sets
    if o.name == "eagle_trees":
        return ["8,5,32", "4,3,16"]
    if o.one_or_list:
        return "x/y"
    one = {int: 3, float: 0.5, str: "x/y"}[o.type]
    return [one, one + 1 if o.type is int else "z"] if o.repeat else one


def _args(values: dict) -> list[str]:
    return [a for name, v in values.items() for a in BY_NAME[name].spell(v)]


def _options(command, args: list[str]) -> tuple[EvalOptions, list[str]]:
    from runner.commands.run_options import command_argv, options_from

    ctx = command.make_context(command.name, list(args))
    kw = {k: v for k, v in ctx.params.items() if k != "upto"}
    return options_from(ctx, kw, run=command.name == "run"), command_argv(ctx, ctx.params["upto"])


def _fields(opts) -> dict:
    return {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)
            if f.name not in ("offline", "json", "progress", "progress_every")}


def test_the_typer_commands_are_the_declaration(commands):
    for name in ("run", "plan"):
        params = {p.name: p for p in commands[name].params}
        assert [p.name for p in commands[name].params] == ["upto", *(o.name for o in RUN_OPTIONS)]
        for o in RUN_OPTIONS:
            p = params[o.name]
            assert (p.opts, p.secondary_opts) == ((list(o.flags), [o.off]) if o.off else (list(o.flags), [])), o.name
            assert (p.help, p.metavar, p.multiple, p.rich_help_panel) == (
                o.help, o.shown_metavar, o.repeat, GROUPS[o.group]), o.name
            assert p.default == o.cli_default, o.name
            assert o.help and o.group in GROUPS


def test_evaloptions_is_the_declaration():
    declared = {o.name: ([] if o.default == () else o.default) for o in RUN_OPTIONS if o.field}
    assert EvalOptions(prompts=["builtin:coding", "builtin:reasoning"]).validate().prompts[1] == "builtin:reasoning"
    have = {f.name: default_of(f.name) for f in dataclasses.fields(EvalOptions)}
    assert {k: have[k] for k in declared} == declared
    assert set(have) - set(declared) == {"offline", "json", "progress", "progress_every"}
    EvalOptions().validate()


def test_the_full_and_the_fast_command_line_agree(commands):
    """Every option the fast path takes, given a value: both parsers make the same options and
    rebuild the same command line for fix messages."""
    from runner.commands.fast_run import parse, run_argv as fast_argv

    values = {o.name: _sample(o) for o in RUN_OPTIONS if o.fast and _sample(o) is not None}
    args = ["hidden-states", *_args(values)]
    full, full_argv = _options(commands["run"], args)
    p = parse(["--store", "s", "run", *args, "--json"])
    fast = EvalOptions(**p["values"])
    assert _fields(fast) == _fields(full)
    assert {k: getattr(full, k) for k in values} == values  # each value arrived where it belongs
    assert fast_argv(p) == ["--store", "s", *full_argv, "--json"]
    assert full_argv == run_argv("hidden-states", values)
    # An option the fast path does not take leaves the command to the full command line.
    assert parse(["run", "--server", "http://h"]) is None


def test_the_python_api_spells_what_it_was_given(commands):
    """api keywords are the EvalOptions fields; the command a Python call's fix message names
    (runner.core.execution.cli_args) gives the same options back on the command line."""
    from runner import api
    from runner.core.execution import cli_args

    values = {o.name: _sample(o) for o in RUN_OPTIONS if o.field and _sample(o) is not None}
    values.update(server="http://127.0.0.1:9", concurrency=2)
    opts = api.make_options(**values)
    back, _ = _options(commands["plan"], cli_args(opts))
    assert _fields(back) == _fields(opts)
    with pytest.raises(Exception, match="unknown option"):
        api.make_options(tree_budget=[4])


def test_docs_cli_md_holds_the_tables():
    text = (REPO / "docs/cli.md").read_text()
    m = re.search(r"<!-- run options: begin.*?-->\n(.*?)<!-- run options: end -->", text, re.S)
    assert m, "docs/cli.md: the markers of the run options' tables"
    assert m.group(1) == markdown_tables(), "regenerate with: python -m runner.core.options"


def test_one_list_of_attention_implementations():
    """--attn-implementation takes what the target's loader takes (flex_attention drifted)."""
    from runner.models import target

    assert target.ATTN_CHOICES is BY_NAME["attn_implementation"].choices
    assert "flex_attention" in target.ATTN_CHOICES
    EvalOptions(attn_implementation="flex_attention").validate()


def test_every_option_of_every_runner_command_has_help(commands):
    missing = [f"{name} {p.opts[0]}" for name, c in commands.items() for p in c.params
               if p.param_type_name == "option" and not p.help]
    assert missing == []
    # Every value has a metavar that says what to give (N, SECONDS, URL, a|b...), not a type.
    bad = [f"{name} {p.opts[0]}" for name, c in commands.items() for p in c.params
           if p.param_type_name == "option" and not p.is_flag and not p.metavar]
    assert bad == []
    # And the main commands show examples.
    assert [n for n, c in commands.items() if "Examples:" not in (c.epilog or "")] == []
