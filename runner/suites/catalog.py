"""The named suites (``--prompts suite:NAME``): the benchmark sets of the DFlash and DDTree papers,
with the dataset, split, sample count, subsampling and prompt construction of their scripts.

Read from (never copied; the prompt texts are data, reproduced to the character):

* ``liranringel/ddtree: model/utils.py`` (``load_and_process_dataset``: datasets, splits, prompt
  construction), ``run_benchmark.sh`` (``TASKS``: the sample count of each dataset),
  ``benchmark.py`` (``dataset.shuffle(seed=0).select(range(max_samples))`` when a dataset holds
  more rows than that; ``enable_thinking=False``), at c96427a. The same loader as
  ``z-lab/dflash: model/utils.py`` and ``run_benchmark.sh`` at bb48ef9, which made the README's
  table; z-lab/dflash's later ``dflash/benchmark.py`` (44947fb) keeps the datasets and prompts of
  gsm8k, math500, humaneval, mbpp and mt-bench but subsamples with ``random.shuffle``.
* MT-Bench: every turn is a response, the second asked after the target's own first answer
  (``benchmark.py`` of both: ``messages`` grows by ``{"role": "user", ...}`` per turn and by
  ``{"role": "assistant", "content": tokenizer.decode(generated, skip_special_tokens=True)}``
  after each answer, the chat template rendered with ``add_generation_prompt=True``; every turn's
  response is one entry of ``responses``, so their τ averages over all turns). Here a record keeps
  its user turns (``turns``); the first is its prompt, and the prompts of the later ones are made
  from the target's stored completion of the turn before (runner/core/pipeline.py ``later_turns``),
  whose ``text`` is that decode for local greedy and a server's content for a server.

A suite's prompt set is its records' content, as any prompt set: the same prompts read from the
cache or a local copy (``suite:NAME@PATH``) are the same samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from dfcache.errors import BadInputError, OfflineMissingError

from .sources import FieldMap, HfSpec, parse_hf, read_hf, read_table, read_text_file, resolve_hf, rows_to_records

# The suites' definitions: a memoized prompt set (runner/stages/prompts.py) is read again when it changes.
# 2: the memo holds a multi-turn record's user turns.
VERSION = 2

MATH = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
SWE = ("Problem Statement:\n", "\nPlease fix the issue described above.")
LCB_SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
              "generate a correct Python program that matches the specification and passes all tests. You will NOT "
              "return anything except for the program")


def _lcb(row: dict) -> str:
    if row.get("starter_code"):
        fmt, code = "### Format: Use the following code structure:", f"```python\n{row['starter_code']}\n```"
    else:
        fmt, code = "### Format: Write your code in the following format:", "```python\n# YOUR CODE HERE\n```"
    return (f"{LCB_SYSTEM}\n\n### Question:\n{row['question_content']}\n\n{fmt}\n{code}\n\n"
            "### Answer: (use the provided format with backticks)")


def _alpaca(row: dict) -> str:
    return f"{row['instruction']}\n\nInput:\n{row['input']}" if row["input"] else row["instruction"]


@dataclass(frozen=True)
class Suite:
    name: str
    dataset: str  # Hugging Face dataset id
    config: str | None
    split: str
    samples: int  # ddtree run_benchmark.sh TASKS
    turns: Callable[[dict], list[str]]  # a row's user turns, as the reference builds them
    fields: tuple[str, ...]  # the row fields the construction reads
    id_field: str | None = None  # a field naming each row, where the dataset has one (else the row number)
    files: tuple[str, ...] = ()  # read as raw files of the dataset repo (the reference loads them by URL)

    def spec(self) -> HfSpec:
        return HfSpec(self.dataset, self.config, self.split)


def _one(f: Callable[[dict], str]) -> Callable[[dict], list[str]]:
    return lambda row: [f(row)]


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("gsm8k", "openai/gsm8k", "main", "test", 128, _one(lambda r: r["question"] + MATH), ("question",)),
    Suite("math500", "HuggingFaceH4/MATH-500", None, "test", 128, _one(lambda r: r["problem"] + MATH), ("problem",),
          "unique_id"),
    Suite("aime24", "HuggingFaceH4/aime_2024", None, "train", 30, _one(lambda r: r["problem"] + MATH), ("problem",),
          "id"),
    Suite("aime25", "MathArena/aime_2025", None, "train", 30, _one(lambda r: r["problem"] + MATH), ("problem",),
          "problem_idx"),
    Suite("humaneval", "openai/openai_humaneval", None, "test", 164,
          _one(lambda r: HUMANEVAL + r["prompt"] + "\n```"), ("prompt",), "task_id"),
    Suite("mbpp", "google-research-datasets/mbpp", "sanitized", "test", 128, _one(lambda r: r["prompt"]),
          ("prompt",), "task_id"),
    Suite("livecodebench", "livecodebench/code_generation_lite", None, "test", 128, _one(_lcb),
          ("question_content",), "question_id",
          files=tuple(f"test{i}.jsonl" for i in ("", "2", "3", "4", "5", "6"))),
    Suite("swe-bench-lite", "princeton-nlp/SWE-bench_Lite", None, "test", 128,
          _one(lambda r: SWE[0] + r["problem_statement"] + SWE[1]), ("problem_statement",), "instance_id"),
    Suite("mt-bench", "HuggingFaceH4/mt_bench_prompts", None, "train", 80, lambda r: list(r["prompt"]),
          ("prompt",), "prompt_id"),
    Suite("alpaca", "tatsu-lab/alpaca", None, "train", 128, _one(_alpaca), ("instruction", "input")),
)}
ALIASES = {"swe-bench": "swe-bench-lite", "math-500": "math500", "mtbench": "mt-bench", "lcb": "livecodebench"}


def names() -> str:
    return ", ".join(f"suite:{n}" for n in SUITES)


def get(name: str) -> Suite:
    s = SUITES.get(ALIASES.get(name, name))
    if s is None:
        raise BadInputError(f"unknown suite {name!r}; the suites are {names()} (docs/cli.md lists their sources).")
    return s


def subsample(n_rows: int, samples: int) -> list[int]:
    """The rows the reference evaluates: all of them in order when the dataset holds at most
    ``samples``, else the first ``samples`` of the permutation ``Dataset.shuffle(seed=0)`` makes
    (numpy's ``default_rng(0).permutation``)."""
    if n_rows <= samples:
        return list(range(n_rows))
    import numpy as np

    return [int(i) for i in np.random.default_rng(0).permutation(n_rows)[:samples]]


def _hub_files(suite: Suite) -> list[dict]:
    """The rows of a suite the reference reads as raw files of its dataset repo, from the
    huggingface_hub cache."""
    from dfcache.config import hub_cache_dir
    from huggingface_hub import try_to_load_from_cache

    rows, missing = [], []
    for name in suite.files:
        path = try_to_load_from_cache(suite.dataset, name, cache_dir=str(hub_cache_dir()), repo_type="dataset")
        if not isinstance(path, str):
            missing.append(name)
            continue
        rows += read_table(path if path.endswith(".jsonl") else path + ".jsonl")
    if missing:
        raise OfflineMissingError(f"suite:{suite.name} reads {', '.join(suite.files)} of the dataset repo "
                                  f"{suite.dataset}; {', '.join(missing)} not in the local Hugging Face cache "
                                  f"({hub_cache_dir()}): fetch them once with hf download {suite.dataset} "
                                  f"{' '.join(suite.files)} --repo-type dataset, or pass suite:{suite.name}@PATH "
                                  "with a local copy.")
    return rows


def load(spec: str) -> list[dict]:
    """The prompt records of ``suite:NAME`` (from the local datasets cache) or ``suite:NAME@PATH``
    (the suite's construction over a local Parquet, JSON or JSONL copy of the dataset)."""
    name, _, path = spec[len("suite:"):].partition("@")
    suite = get(name)
    if path:
        fix = "pass suite:NAME@PATH with a Parquet, JSON or JSONL copy of the suite's dataset split."
        rows = read_table(path, None if path.endswith(".parquet") else read_text_file(path, fix))
    elif suite.files:
        rows = _hub_files(suite)
    else:
        rows = read_hf(suite.spec())[1]
    if rows and isinstance(rows[0], dict):
        lacking = [f for f in suite.fields if f not in rows[0]]
        if lacking:
            raise BadInputError(f"{spec}: the rows have no field {', '.join(map(repr, lacking))} (fields: "
                                f"{', '.join(rows[0])}); suite:{suite.name} reads {suite.dataset}"
                                f"{':' + suite.config if suite.config else ''}:{suite.split}.")
    chosen = subsample(len(rows), suite.samples)
    id_field = suite.id_field if rows and isinstance(rows[0], dict) and suite.id_field in rows[0] else None
    built, turns = [], []
    for i in chosen:
        turns.append(suite.turns(rows[i]))
        built.append({"id": str(rows[i][id_field]) if id_field else str(i), "prompt": turns[-1][0]})
    records = rows_to_records(built, FieldMap(prompt="prompt", id="id"), spec)
    for rec, t in zip(records, turns):
        if len(t) > 1:  # its later turns are asked after the target's answers (the module's docstring)
            if not all(isinstance(x, str) and x.strip() for x in t):
                raise BadInputError(f"{spec}: record {rec['id']!r} has an empty or non-text turn; every turn of "
                                    f"suite:{suite.name} is a non-empty string (check the copy of {suite.dataset}).")
            rec["turns"] = list(t)
    return records


def _files_ident(paths) -> str:
    parts = []
    for p in sorted(paths):
        st = os.stat(p)
        parts.append(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}")
    return "\0".join(parts)


def source_ident(spec: str, fields: FieldMap) -> str | None:
    """What a ``hf:`` or ``suite:`` set is read from, as a string that changes when the rows could
    (the spec, the field mapping, the suites' construction version, each cached file's path, size,
    mtime and inode); None where there is no cheap identity (a suite read from Hub files). Checks
    nothing a load would not: a missing dataset raises as the load does."""
    from dfcache.config import datasets_cache_dir

    head = f"{spec}\0{fields.prompt}\0{fields.messages}\0{fields.id}"
    if spec.startswith("hf:"):
        _, folder, _ = resolve_hf(parse_hf(spec), datasets_cache_dir())
    else:
        name, _, path = spec[len("suite:"):].partition("@")
        suite = get(name)
        head += f"\0{VERSION}"
        if path:
            return head + "\0" + _files_ident([os.path.abspath(path)]) if os.path.isfile(path) else None
        if suite.files:
            return None
        _, folder, _ = resolve_hf(suite.spec(), datasets_cache_dir())
    return head + "\0" + _files_ident([str(p) for p in folder.iterdir() if p.is_file() and not p.name.endswith(".lock")])
