"""Prompt sources and suites (issue 35): `hf:NAME` from a local datasets cache the test prepares
with the datasets library itself (its Parquet builder writing the cache folder a Hub load writes,
read back through the builder `load_dataset` uses offline), Parquet/JSON/JSONL with a field
mapping, the named suites against the prompt construction of the DFlash/DDTree scripts, several
sets in one run with τ per set and a traffic mix, and bad input refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_util import dfcache
from dfcache.errors import BadInputError, OfflineMissingError, UsageError
from runner.core.options import EvalOptions
from runner.stages.prompts import load_records
from runner.suites import catalog, sets, tables
from runner.suites.sources import FieldMap

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")

pytest.importorskip("datasets")


def cache_dataset(cache: Path, repo_id: str, config: str | None, splits: dict[str, list[dict]],
                  revision: str = "0123456789abcdef") -> None:
    """Prepare ``repo_id`` (config, splits) in the datasets cache ``cache`` as a Hub load does:
    the library's Parquet builder over files this test writes, named as the Hub module names it
    (``namespace___name/config/0.0.0/hash``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = cache.parent / "src" / repo_id.replace("/", "_") / (config or "default") / revision
    src.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), src / f"{split}.parquet")
        files[split] = str(src / f"{split}.parquet")
    builder = Parquet(cache_dir=str(cache), dataset_name=repo_id.rpartition("/")[2], config_name=config or "default",
                      config_id=config or "default", data_files=files, hash=revision)
    # The Hub module factory passes repo_id with the Hub's own file URLs; local files under a
    # repo_id are refused, so the name is given after construction, before the folder is made.
    builder.repo_id = repo_id
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()


GSM8K = [{"question": f"Tom has {i} apples and buys {i + 2}. How many?", "answer": str(2 * i + 2)} for i in range(130)]


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-datasets"
    cache_dataset(cache, "openai/gsm8k", "main", {"test": GSM8K, "train": GSM8K[:3]})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------------------------
# hf: from the local datasets cache
# --------------------------------------------------------------------------------------------

def test_hf_reads_the_cache_and_keys_are_the_content(hf_cache, tmp_path):
    from runner import api

    recs = load_records("hf:openai/gsm8k:main:test", FieldMap(prompt="question"))
    assert [r["messages"] for r in recs] == [_user(r["question"]) for r in GSM8K]
    assert [r["id"] for r in recs][:3] == ["0", "1", "2"]  # no id field: the row number
    # The split alone (the config is the only cached one) and NAME:SPLIT read the same rows.
    assert load_records("hf:openai/gsm8k:main:train", FieldMap(prompt="question")) == recs[:3]
    assert load_records("hf:openai/gsm8k:train", FieldMap(prompt="question")) == recs[:3]
    # The same prompts from a JSONL file under other ids reach the same prompt samples.
    f = tmp_path / "same.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "prompt": r["question"]}) + "\n" for i, r in enumerate(GSM8K)))
    store = tmp_path / "store"
    keys = []
    for spec, field in (("hf:openai/gsm8k:main:test", "question"), (str(f), None)):
        _, nodes = api.resolve_graph("prompts", EvalOptions(prompts=spec, prompt_field=field), str(store))
        keys.append(nodes[0].sample_keys)
    assert keys[0] == keys[1] and len(set(keys[0])) == len(GSM8K)


def test_dataset_sets_are_memoized_by_their_cached_files(hf_cache, tmp_path, monkeypatch):
    from runner.stages.prompts import load_set

    monkeypatch.setenv("DFCACHE_HOME", str(tmp_path / "home"))
    fm = FieldMap(prompt="question")
    for spec, f in (("hf:openai/gsm8k:main:train", fm), ("suite:gsm8k", FieldMap())):
        ids, digests, records = load_set(spec, f)
        assert records is not None  # read through the datasets library
        again = load_set(spec, f)
        assert again == (ids, digests, None)  # from the memo: the records are read only if a stage needs them
    # A newer revision of the dataset prepared in the cache (the newest is read): the memo no longer applies.
    other = [{"question": "Something else?", "answer": "1"}]
    cache_dataset(hf_cache, "openai/gsm8k", "main", {"test": GSM8K, "train": other}, revision="fedcba9876543210")
    ids, digests, records = load_set("hf:openai/gsm8k:main:train", fm)
    assert records == [{"id": "0", "messages": _user("Something else?")}]


def test_hf_bad_input_before_any_work(hf_cache, tmp_path):
    store = tmp_path / "store"
    env = {"HF_DATASETS_CACHE": str(hf_cache)}
    r = dfcache("run", "prompts", "--prompts", "hf:openai/nope:main:test", "--prompt-field", "question",
                store=store, env=env)
    assert r.code == 3, r.err
    assert "not in the local datasets cache" in r.err and "datasets.load_dataset('openai/nope', 'main', split='test')" in r.err
    assert "Traceback" not in r.err
    r = dfcache("run", "prompts", "--prompts", "hf:openai/gsm8k:socratic:test", "--prompt-field", "question",
                store=store, env=env)
    assert r.code == 3 and "config 'socratic'" in r.err and "cached: main" in r.err, r.err
    r = dfcache("run", "prompts", "--prompts", "hf:openai/gsm8k:main:validation", "--prompt-field", "question",
                store=store, env=env)
    assert r.code == 6 and "no split 'validation'" in r.err and "test, train" in r.err, r.err
    r = dfcache("run", "prompts", "--prompts", "hf:openai/gsm8k:main:test", "--prompt-field", "problem",
                store=store, env=env)
    assert r.code == 6 and "no field 'problem' (--prompt-field)" in r.err and "question, answer" in r.err, r.err
    r = dfcache("run", "prompts", "--prompts", "hf:openai/gsm8k:main:test", store=store, env=env)
    assert r.code == 6 and "--prompt-field NAME" in r.err, r.err
    r = dfcache("run", "prompts", "--prompts", "suite:gsm8k", "--id-field", "question", store=store, env=env)
    assert r.code == 6 and "suite:gsm8k has its own construction: drop them" in r.err, r.err
    assert not (store / "artifacts").exists() or not any((store / "artifacts").rglob("*.json"))


def test_hf_run_prompts_through_the_cli(hf_cache, tmp_path):
    store = tmp_path / "store"
    r = dfcache("run", "prompts", "--prompts", "hf:openai/gsm8k:main:train", "--prompt-field", "question",
                store=store, env={"HF_DATASETS_CACHE": str(hf_cache)})
    assert r.code == 0, r.err
    assert "3 computed of 3" in r.out


# --------------------------------------------------------------------------------------------
# Local files with a field mapping
# --------------------------------------------------------------------------------------------

def test_parquet_json_jsonl_with_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"qid": "a", "text": "hello", "conv": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                                                  {"from": "human", "value": "more"}]},
            {"qid": "b", "text": "world", "conv": [{"role": "user", "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("p.parquet", "p.json", "p.jsonl"):
        spec = str(tmp_path / name)
        assert load_records(spec, FieldMap(prompt="text", id="qid")) == [
            {"id": "a", "messages": _user("hello")}, {"id": "b", "messages": _user("world")}]
        assert load_records(spec, FieldMap(messages="conv"))[0] == {"id": "0", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]}
    with pytest.raises(BadInputError, match="no field 'nope' \\(--id-field\\); its fields are qid, text, conv"):
        load_records(str(tmp_path / "p.parquet"), FieldMap(prompt="text", id="nope"))
    (tmp_path / "dup.json").write_text(json.dumps([{"k": "1", "t": "a"}, {"k": "1", "t": "b"}]))
    with pytest.raises(BadInputError, match="duplicate id '1'"):
        load_records(str(tmp_path / "dup.json"), FieldMap(prompt="t", id="k"))
    # A .json file of JSON lines is still a JSONL prompt file, as before.
    (tmp_path / "lines.json").write_text('{"id": "x", "prompt": "p"}\n')
    assert load_records(str(tmp_path / "lines.json")) == [{"id": "x", "messages": _user("p")}]


# --------------------------------------------------------------------------------------------
# Suites: the reference scripts' datasets and prompt construction
# --------------------------------------------------------------------------------------------

# Expected prompts, written from liranringel/ddtree model/utils.py (load_and_process_dataset).
MATH_TAIL = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_suite_gsm8k_matches_the_reference_subsample(hf_cache):
    from datasets import Dataset

    recs = load_records("suite:gsm8k")
    assert len(recs) == 128  # run_benchmark.sh gsm8k:128 of the 130 rows here
    # benchmark.py: dataset.shuffle(seed=0).select(range(max_samples)), on the datasets library itself
    ref = Dataset.from_list(GSM8K).shuffle(seed=0, keep_in_memory=True).select(range(128))
    assert [r["messages"] for r in recs] == [_user(q + MATH_TAIL) for q in ref["question"]]
    assert [r["messages"][0]["content"] for r in recs][0].endswith("within \\boxed{}.")


@pytest.mark.parametrize("name,dataset,config,split,row,expected", [
    ("math500", "HuggingFaceH4/MATH-500", None, "test", {"problem": "Find $x$.", "unique_id": "test/a.json"},
     "Find $x$." + MATH_TAIL),
    ("aime24", "HuggingFaceH4/aime_2024", None, "train", {"problem": "P {a}", "id": 60}, "P {a}" + MATH_TAIL),
    ("aime25", "MathArena/aime_2025", None, "train", {"problem": "Q", "problem_idx": 1}, "Q" + MATH_TAIL),
    ("humaneval", "openai/openai_humaneval", None, "test", {"prompt": "def f():\n", "task_id": "HumanEval/0"},
     "Write a solution to the following problem and make sure that it passes the tests:\n```python\ndef f():\n\n```"),
    ("mbpp", "google-research-datasets/mbpp", "sanitized", "test", {"prompt": "Write f.", "task_id": 2}, "Write f."),
    ("swe-bench-lite", "princeton-nlp/SWE-bench_Lite", None, "test", {"problem_statement": "Bug", "instance_id": "x__y-1"},
     "Problem Statement:\nBug\nPlease fix the issue described above."),
    ("mt-bench", "HuggingFaceH4/mt_bench_prompts", None, "train", {"prompt": ["Turn one", "Turn two"], "prompt_id": 81},
     "Turn one"),
    ("alpaca", "tatsu-lab/alpaca", None, "train", {"instruction": "Sum", "input": "1 2", "output": "3"},
     "Sum\n\nInput:\n1 2"),
    ("alpaca", "tatsu-lab/alpaca", None, "train", {"instruction": "Say hi", "input": "", "output": "hi"}, "Say hi"),
])
def test_suite_prompt_construction(tmp_path, monkeypatch, name, dataset, config, split, row, expected):
    cache = tmp_path / "hf-datasets"
    cache_dataset(cache, dataset, config, {split: [row]})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    (rec,) = load_records(f"suite:{name}")
    assert rec["messages"] == _user(expected)
    field = catalog.get(name).id_field
    assert rec["id"] == (str(row[field]) if field in row else "0")


def test_suite_livecodebench_from_hub_files_or_a_local_copy(tmp_path, monkeypatch):
    rows = [{"question_id": "abc", "question_content": "Add.", "starter_code": "class S:\n    pass"},
            {"question_id": "def", "question_content": "Mul.", "starter_code": ""}]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(OfflineMissingError, match="hf download livecodebench/code_generation_lite test.jsonl"):
        load_records("suite:livecodebench")
    f = tmp_path / "lcb.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = load_records(f"suite:livecodebench@{f}")
    system = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
              "generate a correct Python program that matches the specification and passes all tests. You will NOT "
              "return anything except for the program")
    assert recs[0]["id"] == "abc" and recs[0]["messages"] == _user(
        f"{system}\n\n### Question:\nAdd.\n\n### Format: Use the following code structure:\n```python\nclass S:\n"
        "    pass\n```\n\n### Answer: (use the provided format with backticks)")
    assert recs[1]["messages"][0]["content"].endswith(
        "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```\n\n"
        "### Answer: (use the provided format with backticks)")


def test_suite_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty"))
    with pytest.raises(BadInputError, match="unknown suite 'gsm9k'; the suites are suite:gsm8k"):
        load_records("suite:gsm9k")
    with pytest.raises(OfflineMissingError, match="datasets.load_dataset\\('openai/gsm8k', 'main', split='test'\\)"):
        load_records("suite:gsm8k")
    f = tmp_path / "g.jsonl"
    f.write_text(json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(BadInputError, match="no field 'question'"):
        load_records(f"suite:gsm8k@{f}")


# --------------------------------------------------------------------------------------------
# Several sets, the traffic mix
# --------------------------------------------------------------------------------------------

def test_set_names_and_mix_checks():
    assert [sets.set_name(s) for s in ("suite:gsm8k", "suite:swe-bench@x.jsonl", "builtin:coding",
                                      "hf:openai/gsm8k:main", "d/chat.jsonl")] == \
        ["gsm8k", "swe-bench-lite", "coding", "gsm8k", "chat"]
    with pytest.raises(BadInputError, match="two prompt sets are named 'gsm8k'"):
        sets.names(["suite:gsm8k", "hf:openai/gsm8k"])
    assert sets.parse_mix("a=0.25,b=0.75", ["a", "b"]) == {"a": 0.25, "b": 0.75}
    with pytest.raises(BadInputError, match="--mix names c, not a prompt set of this run"):
        sets.parse_mix("a=0.5,c=0.5", ["a", "b"])
    with pytest.raises(BadInputError, match="weights sum to 0.9, not 1"):
        sets.parse_mix("a=0.5,b=0.4", ["a", "b"])
    with pytest.raises(UsageError, match="SET=WEIGHT"):
        EvalOptions(mix="a=half").validate()


def test_mix_interval_covers_the_weighted_mean():
    per = {"a": [2.0, 4.0, 6.0, 8.0], "b": [1.0, 1.5, 1.0, 1.5, 1.0]}
    iv = tables.mix_interval(per, {"a": 0.3, "b": 0.7})
    assert iv["tau"] == pytest.approx(0.3 * 5.0 + 0.7 * 1.2)
    assert iv["low"] < iv["tau"] < iv["high"]
    assert iv == tables.mix_interval(per, {"a": 0.3, "b": 0.7})  # a fixed seed: the same interval again
    # A set that is always the same value adds no width.
    flat = tables.mix_interval({"a": [3.0] * 5, "b": [1.0] * 5}, {"a": 0.5, "b": 0.5})
    assert flat["low"] == flat["high"] == pytest.approx(2.0)


def test_per_set_tables_cut_the_responses_by_set():
    ids = ["x/0", "x/1", "y/0"]
    docs = [{"chain": [2, 4], "tree": {"4": [3, 3]}}, {"chain": [6], "tree": {"4": [5]}},
            {"chain": [1, 1], "tree": {"4": [2]}}]
    doc = tables.per_set(ids, ["x", "y"], [{"drafter": "d", "block_size": 8}], [docs], {"x": 0.5, "y": 0.5})
    row = doc["rows"][0]
    assert row["sets"]["x"] == {"prompts": 2, "chain": 4.5, "tree 4": 4.0}
    assert row["sets"]["y"] == {"prompts": 1, "chain": 1.0, "tree 4": 2.0}
    assert row["overall"]["chain"] == pytest.approx((3 + 6 + 1) / 3)
    assert row["mix"]["chain"]["tau"] == pytest.approx(0.5 * 4.5 + 0.5 * 1.0)
    md = tables.markdown(doc)
    assert "| d | chain | 4.50 | 1.00 | 3.33 | 2.75 [" in md


def test_several_sets_in_one_run(hf_cache, tmp_path, tiny_target, trained_drafter):
    import shutil

    from runner.models.example import DONE

    store = tmp_path / "store"
    args = ("run", "eval", "--example", "--prompts", "builtin:coding", "--prompts", "suite:gsm8k", "--num-prompts", "2")
    r = dfcache(*args, "--mix", "coding=0.5,gsm8k=0.4", store=store)
    assert r.code == 6 and "--mix weights sum to 0.9, not 1" in r.err, r.err
    assert not (store / "artifacts").exists() or not any((store / "artifacts").rglob("manifest*"))
    assert not (store / "example").exists()  # refused before any work: the example's models not built
    r = dfcache(*args, "--mix", "coding=0.5,humaneval=0.5", store=store)
    assert r.code == 6 and "--mix names humaneval, not a prompt set of this run (coding, gsm8k)" in r.err, r.err
    # The example's target and trained DFlash drafter are the session's (the same default build and
    # training, test_fidelity's too): the run builds the other two drafters (~8 s of CPU less).
    for name, src in (("target", tiny_target), ("drafter-trained", trained_drafter[0])):
        shutil.copytree(src, store / "example" / name)
        (store / "example" / name / DONE).write_text("ok\n")
    r = dfcache(*args, "--mix", "coding=0.25,gsm8k=0.75", "--json", store=store)
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    ps = doc["prompt_sets"]
    assert ps["sets"] == ["coding", "gsm8k"] and ps["mix"] == {"coding": 0.25, "gsm8k": 0.75}
    for row, d in zip(ps["rows"], doc["drafters"]):
        assert row["overall"]["chain"] == pytest.approx(d["tau_chain"])  # the whole set is the report's τ
        assert set(row["sets"]) == {"coding", "gsm8k"} and row["sets"]["gsm8k"]["prompts"] == 2
        assert row["mix"]["chain"]["tau"] == pytest.approx(
            0.25 * row["sets"]["coding"]["chain"] + 0.75 * row["sets"]["gsm8k"]["chain"])
        # DDTree budgets are DFlash's; the example's EAGLE-3 drafter has its chain (and --eagle-tree trees)
        trees = {"tree 4", "tree 8"} if d.get("family", "dflash") == "dflash" else set()
        assert set(row["sets"]["coding"]) == {"prompts", "chain", *trees}
    assert {Path(p).name for p in doc["files"].values()} >= {"set-coding-2-histogram.png", "set-gsm8k-2-histogram.png",
                                                         "prompt_sets.md", "prompt_sets.json"}
    # The per-set tables, the mix row with its interval, in report.md, report.html and report.json.
    head = "| drafter | τ | coding (2) | gsm8k (2) | overall | mix coding=0.25,gsm8k=0.75 [95% interval] |"
    assert head in Path(doc["files"]["report.md"]).read_text()
    assert "<th>mix coding=0.25,gsm8k=0.75 [95% interval]</th>" in Path(doc["files"]["report.html"]).read_text()
    assert json.loads(Path(doc["files"]["report.json"]).read_text())["prompt_sets"]["mix"] == ps["mix"]
    assert ps["published"] == []  # the example's target is no published model
    # The same target under a published model's name: every sample reused, the published rows of
    # the suite beside the run's, with the settings they differ in.
    shutil.copytree(store / "example" / "target", tmp_path / "Qwen3-8B")
    r = dfcache("run", "eval", "--example", "--target", tmp_path / "Qwen3-8B", "--prompts", "builtin:coding",
                "--prompts", "suite:gsm8k", "--num-prompts", "2", store=store)
    assert r.code == 0 and "0 node(s) did work" in r.out, r.out + r.err
    assert "| z-lab/dflash README.md @bb48ef9 | z-lab/Qwen3-8B-DFlash-b16 | chain | - | 6.55 |" in r.out, r.out
    assert "prompts of gsm8k: run 2, published 128" in r.out and "max_new_tokens: run 64, published 2048" in r.out
    # A report made under that name: `explain KEY published` puts its τ per suite beside the tables.
    r = dfcache("run", "eval", "--example", "--target", tmp_path / "Qwen3-8B", "--drafter",
                store / "example" / "drafter-trained", "--prompts", "builtin:coding", "--prompts", "suite:gsm8k",
                "--num-prompts", "2", "--json", store=store)
    assert r.code == 0, r.err
    run = json.loads(r.out)
    gsm8k_tau = run["prompt_sets"]["rows"][0]["sets"]["gsm8k"]["chain"]
    r = dfcache("explain", run["report_key"], "published:zlab", store=store)
    assert r.code == 0, r.err
    assert f"gsm8k            run {gsm8k_tau:.2f} over 2 prompt(s), published 6.55" in r.out, r.out
    assert "prompts of gsm8k (run 2, published 128)" in r.out and "block_size (run 8, published 16)" in r.out
    r = dfcache("explain", run["report_key"], "published:elsewhere", store=store)
    assert r.code == 6 and "compare with published, published:zlab or published:ddtree" in r.err, r.err


# --------------------------------------------------------------------------------------------
# Published rows, thinking side by side
# --------------------------------------------------------------------------------------------

def test_published_rows_for_a_target_and_what_differs():
    from runner.suites import published

    rows = published.for_run("Qwen/Qwen3-8B", ["gsm8k", "mt-bench"])
    assert {(p.source.split()[0], p.method, p.temperature) for p in rows} == {
        ("z-lab/dflash", "chain", 0.0), ("z-lab/dflash", "chain", 1.0),
        ("liranringel/ddtree", "chain", 0.0), ("liranringel/ddtree", "chain", 1.0),
        ("liranringel/ddtree", "tree best of 16..1024", 0.0), ("liranringel/ddtree", "tree best of 16..1024", 1.0)}
    zlab = next(p for p in rows if p.source.startswith("z-lab") and p.temperature == 0.0)
    assert zlab.tau["gsm8k"] == 6.55 and zlab.tau["math500"] == 7.87  # README @bb48ef9, Qwen3-8B-DFlash-b16
    assert published.for_run("/models/Qwen3-8B/", ["gsm8k"])  # a local copy by the model's name
    assert published.for_run("Qwen/Qwen3-8B", ["coding"]) == [] and published.for_run(None, ["gsm8k"]) == []
    run = {"temperature": 0.0, "max_new_tokens": 256, "enable_thinking": False, "dtype": "bfloat16",
           "block_size": 16, "tree_budgets": [], "prompts": {"gsm8k": 128, "mt-bench": 80}}
    diff = {d["setting"]: (d["run"], d["published"]) for d in published.differences(zlab, run)}
    assert diff == {"max_new_tokens": (256, 2048), "mt-bench turns": ("first turns", "all turns")}


def test_markdown_shows_thinking_side_by_side_and_published_rows():
    from runner.suites import published

    doc = tables.per_set(["0", "1"], ["gsm8k"], [{"drafter": "d", "block_size": 16}],
                         [[{"chain": [5], "tree": {}}, {"chain": [7], "tree": {}}]], None)
    other = tables.per_set(["0", "1"], ["gsm8k"], [{"drafter": "d", "block_size": 16}],
                           [[{"chain": [9], "tree": {}}, {"chain": [11], "tree": {}}]], None)
    doc["enable_thinking"] = False
    doc["other_thinking"] = {"enable_thinking": True, "rows": other["rows"]}
    (zlab,) = [p for p in published.for_run("Qwen/Qwen3-8B", ["gsm8k"])
               if p.source.startswith("z-lab") and p.temperature == 0.0]
    (t1,) = [p for p in published.for_run("Qwen/Qwen3-8B", ["gsm8k"])
             if p.source.startswith("z-lab") and p.temperature == 1.0]
    doc["published"] = [{**p.to_dict(), "differs": published.differences(p, {"temperature": 0.0})}
                        for p in (zlab, t1)]
    md = tables.markdown(doc)
    assert "thinking off):" in md and "| d | chain | 6.00 | 6.00 |" in md
    assert "thinking on (stored: the same run with --enable-thinking)" in md and "| d | chain | 10.00 | 10.00 |" in md
    assert "| z-lab/dflash README.md @bb48ef9 | z-lab/Qwen3-8B-DFlash-b16 | chain | 6.55 |" in md
    assert md.count("z-lab/Qwen3-8B-DFlash-b16 | chain") == 1  # the T=1 row (temperature differs) is JSON only


# --------------------------------------------------------------------------------------------
# MT-Bench's later turns, asked after the target's own answers
# --------------------------------------------------------------------------------------------

MT_BENCH = [{"prompt": [f"Write a haiku about {w}.", f"Now one about {w}s at night."], "prompt_id": 81 + i,
             "category": "writing"} for i, w in enumerate(("cat", "owl"))]


def test_mt_bench_second_turns_follow_the_targets_answers(tiny_target, tmp_path, monkeypatch):
    """Turn 2 is asked as the peers ask it ([user turn 1, the target's answer, user turn 2]), its
    prompt made from the stored turn-1 completion; offline, a cached run redoes nothing and a
    missing turn 1 is the usual error."""
    from runner import api
    from runner.stages.completions import read_completions
    from runner.stages.prompts import read_messages
    from tests.servers import ClosedPort

    cache = tmp_path / "hf-datasets"
    cache_dataset(cache, "HuggingFaceH4/mt_bench_prompts", None, {"train": MT_BENCH})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("DFCACHE_HOME", str(tmp_path / "home"))
    store = tmp_path / "store"
    sel = dict(target=str(tiny_target), completions="local", prompts="suite:mt-bench", max_new_tokens=4,
               dtype="float32", device="cpu")
    planned = api.plan("completions", store=store, **sel)
    assert planned.waits and "turn 2 of 2 multi-turn prompt(s)" in planned.waits  # what `dfcache plan` notes
    res = api.run("completions", store=store, **sel)
    assert api.plan("completions", store=store, **sel).waits is None
    assert [(n.stage, n.samples["produced"], n.samples["cached"]) for n in res.nodes] == [
        ("prompts", 4, 0), ("completions", 4, 0)]  # turn 1's, made by the run's first graph, count as made
    ctx, nodes = api.resolve_graph("completions", api.make_options(**sel), str(store))
    prompts, comps = nodes[0], nodes[-1]
    assert prompts.ids == ["81", "82", "81/turn2", "82/turn2"]
    answers = [c.text for c in read_completions(ctx.store, comps)]
    for i, row in enumerate(MT_BENCH):
        first, second = row["prompt"]
        assert read_messages(ctx.store, prompts, [i + 2])[0] == [
            {"role": "user", "content": first}, {"role": "assistant", "content": answers[i]},
            {"role": "user", "content": second}]
    # Cached: offline, nothing is made again.
    assert api.run("completions", store=store, offline=True, **sel).computed == []
    # From a server, offline, with turn 1 missing: the usual error, naming the turn-1 prompts.
    with ClosedPort() as port:
        with pytest.raises(OfflineMissingError, match=r"2 of 2 sample\(s\) missing \(prompt ids '81', '82'"):
            api.run("completions", store=tmp_path / "other", offline=True,
                    **{**sel, "completions": "server", "server": port.url})


def test_mt_bench_second_turns_are_shared_by_shard_workers(tiny_target, tmp_path, monkeypatch):
    """--shard workers share the second turns as they share the first: the worker that finds every
    first turn stored goes on with its share of the second in the same run (before, the second
    turns waited for later runs of every worker), and nothing is made twice."""
    from runner import api

    cache = tmp_path / "hf-datasets"
    cache_dataset(cache, "HuggingFaceH4/mt_bench_prompts", None, {"train": MT_BENCH})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("DFCACHE_HOME", str(tmp_path / "home"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DFCACHE_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    store = tmp_path / "store"
    sel = dict(target=str(tiny_target), completions="local", prompts="suite:mt-bench", max_new_tokens=4,
               dtype="float32", device="cpu")

    def stored_turn2() -> int:
        ctx, nodes = api.resolve_graph("completions", api.make_options(**sel), str(store))
        if ctx.waiting_turns is not None:
            return 0
        comps = nodes[-1]
        return len([i for i in comps.local if nodes[0].ids[i].endswith("/turn2")])

    first = api.run("completions", store=store, shard="0/2", **sel)
    assert not first.complete and stored_turn2() == 0  # its first turns; the other worker owes the rest
    lines: list[str] = []
    second = api.run("completions", store=store, shard="1/2", log=lines.append, **sel)
    assert any("so the workers go on with that turn" in line for line in lines), lines
    made = stored_turn2()
    third = api.run("completions", store=store, shard="0/2", **sel)
    assert third.complete and stored_turn2() == 2  # two runs of worker 0 and one of worker 1: every turn
    produced = sum(n.samples["produced"] for n in third.nodes if n.stage == "completions")
    assert produced == 2 - made and second.complete == (made == 2)



def test_per_turn_columns_and_the_mix_over_all_turns():
    ids = ["a/0", "mt-bench/81", "mt-bench/81/turn2"]
    docs = [{"chain": [2]}, {"chain": [4]}, {"chain": [2, 2]}]
    doc = tables.per_set(ids, ["a", "mt-bench"], [{"drafter": "d", "block_size": 8}], [docs],
                         {"a": 0.5, "mt-bench": 0.5}, {"mt-bench"})
    assert doc["sets"] == ["a", "mt-bench", "mt-bench/turn1", "mt-bench/turn2"]
    row = doc["rows"][0]
    assert row["sets"]["mt-bench"]["chain"] == 3.0  # both turns, as the peers average them
    assert (row["sets"]["mt-bench/turn1"]["chain"], row["sets"]["mt-bench/turn2"]["chain"]) == (4.0, 2.0)
    assert row["mix"]["chain"]["tau"] == pytest.approx(0.5 * 2 + 0.5 * 3)
    assert "| d | chain | 2.00 | 3.00 | 4.00 | 2.00 | 2.67 | 2.50 [" in tables.markdown(doc)
    assert '<table id="prompt-sets-0">' in tables.html(doc) and "mix a=0.5,mt-bench=0.5" in tables.html(doc)
