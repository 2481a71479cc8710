"""The prompts stage: built-in sets, files keyed by content, and errors that name file and line."""

import json

import pytest

from dfcache.errors import BadInputError
from runner.stages.prompts import BUILTIN_SETS, load_records, parse_records

from cli_util import dfcache

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")


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


def test_fast_digest_is_record_digest_and_lines_parse_as_json_loads(tmp_path):
    from dfcache.samples import record_digest
    from runner.stages.prompts import messages_digest

    tricky = ['plain', 'quote " and \\ backslash', "tab\tnewline\n\x00\x1f", "ünïcødé ✓ 𝄞", "/abs/path"]
    for t in tricky:
        msgs = [{"role": "system", "content": t}, {"role": "user", "content": t[::-1]}]
        assert messages_digest(msgs) == record_digest({"messages": msgs})
    lines = ['  {"id": "a", "prompt": "x"}  ', '{"id": 2, "prompt": "y", "extra": [1, {"k": NaN}]}']
    assert parse_records("\n".join(lines), "x") == [{"id": "a", "messages": [{"role": "user", "content": "x"}]},
                                                   {"id": "2", "messages": [{"role": "user", "content": "y"}]}]
    for bad in ('{"id": "a", "prompt": "x"} {"id": "b"}', '{"id": "a", "prompt": "x"},'):
        with pytest.raises(BadInputError, match="not valid JSON"):
            parse_records(bad, "x")


def test_large_prompt_file_memo_gives_the_same_set_and_follows_edits(tmp_path, monkeypatch):
    from runner.stages import prompts

    monkeypatch.setenv("DFCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(prompts, "MEMO_MIN_RECORDS", 2)
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q {i}"}) + "\n" for i in range(3)))
    ids, digests, records = prompts.load_set(str(f))
    assert records is not None and list((tmp_path / "home" / "prompt-sets").iterdir())
    again = prompts.load_set(str(f))
    assert again[:2] == (ids, digests) and again[2] is None  # from the memo, records not parsed
    lazy = prompts.PromptRecords(str(f), ids[:2])
    assert len(lazy) == 2 and list(lazy) == records[:2] and lazy[1] == records[1]
    f.write_text(f.read_text().replace("q 1", "q one"))  # an edit: another size, another memo
    edited = prompts.load_set(str(f))
    assert edited[2] is not None and edited[1][1] != digests[1] and edited[1][0] == digests[0]
