"""`dfcache ls / show / verify / gc` through the real command line."""

import json

import pytest

from dfcache.keys import compute_key
from dfcache.store import open_store
from dfcache.testing.store_conformance import write_example

from cli_util import dfcache

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")


@pytest.fixture
def filled(tmp_path):
    store = open_store(tmp_path / "store")
    keys = [write_example(store, i=i, rows=200, chunk_rows=50)[0] for i in range(3)]
    return tmp_path / "store", keys


def test_ls_json_schema(filled):
    store, keys = filled
    r = dfcache("ls", "--json", store=store)
    assert r.code == 0, r.err
    rows = json.loads(r.out)
    assert sorted(row["key"] for row in rows) == sorted(keys)
    for row in rows:
        assert {"key", "stage", "size_bytes", "created", "backend", "inputs", "provenance"} <= set(row)
        assert row["stage"] == "conformance" and row["size_bytes"] > 0 and row["backend"] is None


def test_ls_table_and_filters(filled):
    store, keys = filled
    r = dfcache("ls", store=store)
    assert r.code == 0 and "3 artifact(s)" in r.out and keys[0][:12] in r.out
    r = dfcache("ls", "--stage", "tokens", "--json", store=store)
    assert json.loads(r.out) == []


def test_show_prefix_and_errors(filled):
    store, keys = filled
    r = dfcache("show", keys[0][:8], "--json", store=store)
    assert r.code == 0 and json.loads(r.out)["key"] == keys[0]
    r = dfcache("show", "zz", store=store)
    assert r.code == 2 and "Traceback" not in r.err and "zz" in r.err


def test_verify_flipped_byte_and_deleted_chunk(filled):
    store, keys = filled
    assert dfcache("verify", store=store).code == 0
    chunk = store / "artifacts" / keys[1][:2] / keys[1] / "hidden" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1
    chunk.write_bytes(bytes(data))
    (store / "artifacts" / keys[2][:2] / keys[2] / "hidden" / "c" / "0" / "0").unlink()
    r = dfcache("verify", store=store)
    assert r.code == 5, r.err
    assert keys[1] in r.out and keys[2] in r.out and keys[0] not in r.out
    assert "Traceback" not in r.err and "recompute" in r.err


def test_gc_needs_a_flag_and_dry_run_changes_nothing(filled):
    store, keys = filled
    before = sorted(p.name for p in store.rglob("*"))
    r = dfcache("gc", store=store)
    assert r.code == 2 and "--dry-run" in r.err
    r = dfcache("gc", "--dry-run", "--stage", "conformance", store=store)
    assert r.code == 0 and "would be freed" in r.out
    assert sorted(p.name for p in store.rglob("*")) == before
    r = dfcache("gc", "--yes", "--key", keys[0][:10], store=store)
    assert r.code == 0
    assert not open_store(store).has(keys[0]) and open_store(store).has(keys[1])


def test_store_from_environment(filled, tmp_path):
    store, keys = filled
    r = dfcache("ls", "--json", env={"DFCACHE_STORE": str(store)})
    assert r.code == 0 and len(json.loads(r.out)) == 3


def _main(capsys, *args):
    from dfcache.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_global_options_after_every_command(filled, tmp_path, capsys, monkeypatch):
    """--store, --json, --offline, --debug and --no-progress follow any command name (docs/cli.md);
    every command the app has is in the table, so a new command cannot miss them."""
    from dfcache.cli import _register_all, app

    store, keys = filled
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # a --store not taken would make ./store here
    remote = f"file://{tmp_path / 'remote'}"
    table = {
        "ls": ["ls"], "show": ["show", keys[0][:8]], "verify": ["verify"], "gc": ["gc", "--dry-run"],
        "diff": ["diff", keys[0], keys[1]], "push": ["push", remote, "--all"], "status": ["status", remote],
        "pull": ["pull", remote, "--all"], "plan": ["plan", "prompts", "--num-prompts", "1"],
        "run": ["run", "prompts", "--num-prompts", "1"],
    }
    import typer

    _register_all()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # every command, those not run below included
        opts = {o for p in command.params for o in getattr(p, "opts", [])}
        assert {"--store", "--json", "--debug", "--offline", "--no-progress"} <= opts, name
    for name, args in table.items():
        code, out, err = _main(capsys, *args, "--store", store, "--json", "--offline", "--no-progress", "--debug")
        assert code == 0, f"{name}: {err}"
        json.loads(out)  # --json took effect
    assert not (tmp_path / "cwd" / "store").exists()


def test_ls_stage_spelled_as_run_spells_it(tmp_path, capsys):
    store = tmp_path / "store"
    code, out, err = _main(capsys, "--store", store, "run", "prompts", "--num-prompts", "1", "--json")
    assert code == 0, err
    for spelling in ("prompts", " prompts", "hidden-states", "hidden_states"):
        code, out, err = _main(capsys, "ls", "--stage", spelling, "--store", store, "--json")
        assert code == 0, err
        assert [r["stage"] for r in json.loads(out)] == ([] if "hidden" in spelling else ["prompts"])


def test_show_json_has_the_backend_object_ls_has(tmp_path, capsys):
    s = open_store(tmp_path / "store")
    backend = {"kernel": "fla", "device": "cuda", "dtype": "bfloat16", "attn_implementation": "sdpa"}
    key = compute_key("hidden_states", 1, {"layer": 1, "backend": backend})
    with s.writer(key, stage="hidden_states", stage_version=1, inputs={"layer": 1, "backend": backend}) as w:
        w.put_json("x", {})
    code, out, _ = _main(capsys, "--store", tmp_path / "store", "show", key[:6], "--json")
    shown = json.loads(out)
    code, out, _ = _main(capsys, "--store", tmp_path / "store", "ls", "--json")
    assert shown["backend"] == json.loads(out)[0]["backend"] == backend


def test_gc_refuses_dependents_force_removes_and_verify_reports_the_broken_chain(tmp_path, capsys):
    s = open_store(tmp_path / "store")
    up, _ = write_example(s, i=0, rows=50, chunk_rows=25)
    down = compute_key("conformance2", 1, {}, {"states": [up]})
    with s.writer(down, stage="conformance2", stage_version=1, inputs={}, upstream={"states": [up]}) as w:
        w.put_json("x", {})
    store = tmp_path / "store"
    code, out, err = _main(capsys, "--store", store, "gc", "--yes", "--key", up[:8])
    assert code == 2 and f"{up[:12]} is needed by {down[:12]}" in err and "--force" in err
    assert s.has(up)
    # Removing both together is fine; so is --force, which leaves the chain broken.
    code, out, err = _main(capsys, "--store", store, "gc", "--dry-run", "--key", up[:8], "--key", down[:8])
    assert code == 0, err
    code, out, err = _main(capsys, "--store", store, "gc", "--yes", "--force", "--key", up[:8])
    assert code == 0 and not s.has(up) and s.has(down)
    code, out, err = _main(capsys, "--store", store, "verify")
    assert code == 0 and f"BROKEN CHAIN {down} (conformance2): upstream {up} is not in this store" in out
    assert err.count("warning:") == 1 and "1 artifact(s) depend on upstream artifacts" in err and "error" not in err
    code, out, err = _main(capsys, "--store", store, "verify", "--json")
    assert json.loads(out)["missing_upstream"] == [{"key": down, "stage": "conformance2", "upstream": up}]


def test_ls_summary_is_cut_between_words(tmp_path):
    from dfcache.maintenance import input_summary

    s = open_store(tmp_path / "store")
    text = "layer 12/64 (qwen3_5_text): reasoning-prompts-v2.jsonl×1000, openai server model Qwen3.5-27B-FP8"
    with s.writer("ef" * 16, stage="hidden_states", stage_version=1, inputs={}, summary=text) as w:
        w.put_json("x", {})
    short = input_summary(s.manifest("ef" * 16), width=60)
    assert short.endswith("…") and len(short) <= 60
    assert text.startswith(short[:-1]) and text[len(short) - 1] in " ,"  # ends at a word's end


DFCACHE_COMMANDS = ("ls", "show", "verify", "gc", "diff", "push", "pull", "status", "migrate")


@pytest.mark.parametrize("command", DFCACHE_COMMANDS)
def test_help_is_what_users_of_hf_and_dvc_expect(command, capsys):
    """`-h` as well as `--help`; arguments and values named by what they are (KEY, URL, N, DAYS,
    SECONDS, PATH), never by their Python type or in braces; help text on every option; examples."""
    import re

    import typer

    from dfcache.cli import _register_all, app, main

    assert main([command, "-h"]) == 0
    short = capsys.readouterr().out
    assert main([command, "--help"]) == 0
    assert capsys.readouterr().out == short
    usage = short.splitlines()[0]
    assert usage.startswith(f"Usage: dfcache {command} [OPTIONS]") and "{" not in usage, usage
    assert not re.search(r"<(str|int|float|list\[str\]|int range|float range)>", short), short
    examples = short[short.index("Examples:"):].splitlines()[1:]
    assert len([line for line in examples if line.strip().startswith(f"$ dfcache")]) >= 2, short
    _register_all()
    cmd = typer.main.get_command(app).commands[command]
    for param in cmd.params:
        assert (param.help or "").strip(), f"{command}: {param.name} has no help"
        if param.param_type_name == "argument":
            assert param.metavar and param.metavar.strip("[].").isupper(), f"{command}: {param.name}"
        elif not param.is_flag:
            assert param.metavar and re.fullmatch(r"[A-Z_]+|[a-z]+(\|[a-z]+)+", param.metavar), \
                f"{command}: {param.opts} has metavar {param.metavar!r}"


def test_units_are_in_the_metavars(capsys):
    from dfcache.cli import main

    assert main(["gc", "-h"]) == 0
    out = capsys.readouterr().out
    assert "--older-than DAYS" in out and "--grace SECONDS" in out and "--key KEY" in out
    assert main(["push", "-h"]) == 0
    out = capsys.readouterr().out
    assert "Usage: dfcache push [OPTIONS] URL [KEY]..." in out and "-j, --jobs N" in out
    assert main(["-h"]) == 0
    assert "--store PATH" in capsys.readouterr().out
