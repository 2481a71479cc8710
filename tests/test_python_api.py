"""docs/python.md runs as written (doctest), against a tiny real target and drafter."""

from __future__ import annotations

import doctest
import os
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "python.md"


@pytest.fixture
def in_example_dir(tiny_target, tmp_path):
    import torch

    from runner.models.train_tiny import make_untrained_drafter

    os.symlink(tiny_target, tmp_path / "target")
    make_untrained_drafter(tiny_target, tmp_path / "drafter", layer_ids=[3, 1])
    cwd, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(tmp_path)
    torch.set_num_threads(1)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)


def test_python_md_examples_run(in_example_dir):
    res = doctest.testfile(str(DOC), module_relative=False, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False, report=True)
    assert res.attempted > 15
    assert res.failed == 0


# ------------------------------------------------------------------ the API means what the CLI means


@pytest.fixture
def fresh_cli_state():
    # dfcache.cli.main keeps global options (--json, --store) in a module-level state.
    from dfcache.cli.common import REGISTERED_FIELDS, GlobalState, state

    yield state
    for k, v in vars(GlobalState()).items():
        if k not in REGISTERED_FIELDS:  # what the commands registered, once a process (dfcache.cli._register_all)
            setattr(state, k, v)


def _cli_plan(capsys, *args) -> list[dict]:
    import json

    from dfcache.cli import main as cli_main

    capsys.readouterr()
    code = cli_main([*args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_server_means_server_completions_as_on_the_command_line(tiny_target, tmp_path, capsys, fresh_cli_state):
    """`server=URL` alone takes completions from that server, as `--server URL` does: the same
    nodes and keys as the command line's plan; `completions="local"` beside it is refused, in
    Python's words. Nothing is contacted to plan (a closed port)."""
    from dfcache.errors import UsageError
    from runner import api

    from tests.servers import ClosedPort

    port = ClosedPort()
    try:
        sel = dict(target=str(tiny_target), num_prompts=2, max_new_tokens=8)
        got = api.plan("tokens", store=tmp_path / "s", server=port.url, **sel)
        cli = _cli_plan(capsys, "plan", "tokens", "--store", str(tmp_path / "s"), "--server", port.url,
                        "--target", str(tiny_target), "--num-prompts", "2", "--max-new-tokens", "8")
        assert [(n.stage, n.key) for n in got.nodes] == [(n["stage"], n["key"]) for n in cli]
        (comp,) = [n for n in got.nodes if n.stage == "completions"]
        assert comp.status == "network" and comp.label == "completions (openai server)"
        local = api.plan("tokens", store=tmp_path / "s", **sel)
        assert [n.key for n in local.nodes if n.stage == "completions"] != [comp.key]
        with pytest.raises(UsageError) as e:
            api.plan("tokens", store=tmp_path / "s", server=port.url, completions="local", **sel)
        assert "completions='local' does not use server=" in str(e.value) and "--" not in str(e.value)
    finally:
        port.close()


def test_fixes_name_the_keywords_of_the_call_and_the_cli_keeps_its_flags(tiny_target, tmp_path, capsys,
                                                                         fresh_cli_state):
    from dfcache.cli import main as cli_main
    from dfcache.errors import BadInputError, UsageError
    from runner import api

    with pytest.raises(UsageError) as e:
        api.run("completions", store=tmp_path / "s", target=str(tiny_target), completions="server")
    assert str(e.value) == ("completions='server' needs server=URL (e.g. server='http://127.0.0.1:30000'), or use "
                            "completions='local'.")
    with pytest.raises(BadInputError) as e:  # raised by a stage, not by the options check
        api.plan("tokens", store=tmp_path / "s", target=str(tiny_target), num_prompts=500)
    assert "num_prompts=500, but builtin:coding holds only" in str(e.value) and "--num-prompts" not in str(e.value)
    assert isinstance(e.value, BadInputError) and e.value.exit_code == 6
    # The command line's messages are its own.
    assert cli_main(["--store", str(tmp_path / "s"), "run", "completions", "--target", str(tiny_target),
                     "--completions", "server"]) == 2
    assert "--completions server needs --server URL" in capsys.readouterr().err


def test_the_store_comes_from_the_call_or_the_environment_never_the_cli_state(tiny_target, tmp_path, monkeypatch,
                                                                              fresh_cli_state):
    from runner import api

    fresh_cli_state.store_location = str(tmp_path / "cli-store")  # what an earlier dfcache.cli.main left
    monkeypatch.setenv("DFCACHE_STORE", str(tmp_path / "env-store"))
    api.run("prompts", target=str(tiny_target), num_prompts=2)
    assert (tmp_path / "env-store").is_dir() and not (tmp_path / "cli-store").exists()


def test_runs_print_nothing_and_give_progress_to_log(tiny_target, tmp_path, capfd):
    """No line or bar on stdout or stderr from a run that computes (the model loads: transformers'
    own "Loading weights" bar is off too, and as it was afterwards); ``log=`` gets the lines."""
    import transformers.utils.logging as tlog

    from runner import api
    from runner.core.options import EvalOptions

    sel = dict(target=str(tiny_target), num_prompts=2, max_new_tokens=8, backend="torch", device="cpu",
               completions="local", layers=[1])
    bars, verbosity = tlog.is_progress_bar_enabled(), tlog.get_verbosity()
    capfd.readouterr()
    api.plan("hidden-states", store=tmp_path / "s", **sel)
    api.run("hidden-states", store=tmp_path / "s", options=EvalOptions(**sel))  # its progress field is on
    api.hidden_state_dataset(store=tmp_path / "s", **sel)
    assert capfd.readouterr() == ("", "")
    assert (tlog.is_progress_bar_enabled(), tlog.get_verbosity()) == (bars, verbosity)
    lines = []
    api.run("hidden-states", store=tmp_path / "s", log=lines.append, **{**sel, "num_prompts": 3})
    assert capfd.readouterr() == ("", "")
    assert any(line.startswith("completions: 2 of 3 already stored, 1 to fetch") for line in lines), lines
    assert any(line.startswith("hidden states: 1 sample(s), layers [1]") for line in lines), lines
    api.run("hidden-states", store=tmp_path / "s", progress=True, **{**sel, "num_prompts": 4})
    assert "hidden states: 1 sample(s)" in capfd.readouterr().err  # asked for: the CLI's lines on stderr


def test_a_server_selection_reads_offline_and_its_fix_resolves_as_the_call(tiny_target, tmp_path, capsys,
                                                                            fresh_cli_state):
    """States made from a server's completions are found by the same selection offline (the
    server is gone), and for a layer not stored the command in the error plans the very nodes the
    call reported missing."""
    import shlex

    from dfcache.errors import OfflineMissingError
    from runner import api

    from tests.servers import SGLangTestServer

    sel = dict(target=str(tiny_target), num_prompts=2, max_new_tokens=8, backend="torch", device="cpu",
               server_api="sglang")
    store = tmp_path / "store"
    with SGLangTestServer(tiny_target) as s:
        api.run("hidden-states", store=store, server=s.url, layers=[1], **sel)
        assert s.count("POST", "/generate") == 2
    ds = api.hidden_state_dataset(store=store, server=s.url, offline=True, layers=[1], **sel)
    assert len(ds) == 2
    with pytest.raises(OfflineMissingError) as e:
        api.hidden_state_dataset(store=store, server=s.url, offline=True, layers=[2], **sel)
    msg = str(e.value)
    (missing,) = e.value.missing
    assert missing["stage"] == "hidden_states" and "server=" not in msg
    cmd = msg.split("Produce them first with: ", 1)[1].strip()
    argv = shlex.split(cmd)
    assert argv[:4] == ["dfcache", "--store", str(store), "run"] and "--server" in argv and "--offline" in argv
    nodes = _cli_plan(capsys, *["plan" if a == "run" else a for a in argv[1:]])  # `plan` takes what `run` does
    assert [n for n in nodes if n["key"] == missing["key"]]
    assert all(n["status"] == "cached" for n in nodes if n["stage"] in ("completions", "tokens"))
