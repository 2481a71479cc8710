"""The prompts stage: built-in sets, files keyed by content, and errors that name file and line."""

import json

import pytest

from dfcache.errors import BadInputError
from runner.stages.prompts import BUILTIN_SETS, load_records, parse_records

from cli_util import dfcache


def test_builtin_sets_are_usable():
    for name in BUILTIN_SETS:
        recs = load_records(f"builtin:{name}")
        assert len(recs) >= 20
        assert len({r["id"] for r in recs}) == len(recs)


@pytest.mark.parametrize("text, needle", [
    ('{"id": 1, "prompt": "a"}\n{oops\n', ":2: not valid JSON"),
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', ":2: duplicate id '1' (first on line 1)"),
    ('{"prompt": "a"}\n', ":1: missing or invalid \"id\""),
    ('{"id": "x"}\n', ":1: the record has neither"),
    ('{"id": "x", "messages": []}\n', ":1: \"messages\" must be"),
    ('[1, 2]\n', ":1: a line must be a JSON object"),
    ('\n\n', "the prompt set is empty"),
])
def test_malformed_files_name_file_and_line(tmp_path, text, needle):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(BadInputError) as e:
        load_records(str(f))
    assert str(f) in str(e.value) and needle in str(e.value)


def test_prompt_string_becomes_a_user_message():
    recs = parse_records('{"id": "a", "prompt": "hi"}', "x")
    assert recs == [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}]


def test_key_follows_content_not_path(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    line = json.dumps({"id": "q", "prompt": "What is 2+2?"}) + "\n"
    a.write_text(line)
    b.write_text(line)
    keys = []
    for f in (a, b):
        r = dfcache("plan", "prompts", "--prompts", f, "--json", store=tmp_path / "store")
        assert r.code == 0, r.err
        keys.append(json.loads(r.out)[0]["key"])
    assert keys[0] == keys[1]
    b.write_text(line.replace("2+2", "2+3"))
    r = dfcache("plan", "prompts", "--prompts", b, "--json", store=tmp_path / "store")
    assert json.loads(r.out)[0]["key"] != keys[0]


def test_cli_bad_prompt_file_exit_6_store_unchanged(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    r = dfcache("run", "prompts", "--prompts", f, store=tmp_path / "store")
    assert r.code == 6 and "p.jsonl:2" in r.err and "Traceback" not in r.err
    assert not list((tmp_path / "store" / "artifacts").iterdir())


def test_run_prompts_then_cached(tmp_path):
    r = dfcache("run", "prompts", "--prompts", "builtin:reasoning", "--num-prompts", "5", "--json",
                store=tmp_path / "store")
    assert r.code == 0, r.err
    first = json.loads(r.out)
    assert len(first["computed"]) == 1
    r = dfcache("run", "prompts", "--prompts", "builtin:reasoning", "--num-prompts", "5", "--json",
                store=tmp_path / "store")
    assert json.loads(r.out)["computed"] == []
    r = dfcache("plan", "prompts", "--prompts", "builtin:reasoning", "--num-prompts", "5", "--json",
                store=tmp_path / "store")
    assert json.loads(r.out)[0]["status"] == "cached"
