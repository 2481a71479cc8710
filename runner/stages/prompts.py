"""Stage `prompts`: one sample per prompt record, keyed by its content.

Key recipe (per sample, see docs/format.md "Samples and segments"; ``KEY`` below, ``build()``
makes its nodes through it)::

    partition = compute_key('prompts', 2, inputs, upstream)
    sample    = sample_key(partition, record_digest({"messages": messages}))
    inputs:
        (none)
    upstream:
        (none)

The path of a prompt file is never key material, nor is a record's id: the same messages from
two files, or under two ids, are one sample (ids name prompts in messages and reports, they do
not change what the model is asked). Output, per sample: the document ``{"messages": [...]}``
(a ``prompt`` string becomes one user message).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from dfcache.errors import BadInputError
from dfcache.keys import messages_digest  # record_digest({"messages": ...}), spelled out for speed

from ..core.graph import KeyRecipe, Node, PromptsSpec, RunContext
from ..suites import sets
from ..suites.sources import ROLES, FieldMap, read_table, read_text_file, rows_to_records
from ..suites.sources import check_roles as _check_roles  # noqa: F401  (ROLES: public here too)

KEY = KeyRecipe("prompts", 2, inputs={}, sample='record_digest({"messages": messages})')
NAME = KEY.stage
VERSION = KEY.version

BUILTIN_SETS = {"coding": "coding.jsonl", "reasoning": "reasoning.jsonl"}


def _builtin_names() -> str:
    return ", ".join(f"builtin:{n}" for n in BUILTIN_SETS)


_SCAN = json.JSONDecoder().scan_once


def _parse_line(line: str):
    """``json.loads(line)``, through the C scanner directly: json.loads' own per-call overhead
    is most of the cost of a 100,000-line prompt file."""
    s = line.strip()
    try:
        rec, end = _SCAN(s, 0)
        if end == len(s):
            return rec
    except (StopIteration, ValueError):
        pass
    return json.loads(line)  # the exact error (or value) json.loads gives


def parse_records(text: str, source: str) -> list[dict]:
    """Parse JSONL prompt records; every problem names the file and line."""
    records: list[dict] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = _parse_line(line)
        except ValueError as e:
            raise BadInputError(f"{source}:{lineno}: not valid JSON ({e.msg}); each line must be "
                                '{"id": ..., "messages": [...]} or {"id": ..., "prompt": "..."}.') from None
        except RecursionError:  # the parser recurses per level: 100,000 brackets exhaust its stack
            raise BadInputError(f"{source}:{lineno}: JSON nested too deeply to read; a prompt record is "
                                '{"id": ..., "messages": [{"role": ..., "content": "..."}]} or {"id": ..., '
                                '"prompt": "..."}.') from None
        if not isinstance(rec, dict):
            raise BadInputError(f"{source}:{lineno}: a line must be a JSON object with \"id\" and "
                                "\"messages\" or \"prompt\".")
        pid = rec.get("id")
        if not isinstance(pid, (str, int)) or isinstance(pid, bool) or str(pid) == "":
            raise BadInputError(f"{source}:{lineno}: missing or invalid \"id\" (a non-empty string or "
                                "integer); give every prompt a unique id.")
        pid = str(pid)
        if pid in seen:
            raise BadInputError(f"{source}:{lineno}: duplicate id {pid!r} (first on line {seen[pid]}); "
                                "ids must be unique.")
        seen[pid] = lineno
        if "messages" in rec:
            msgs = rec["messages"]
            if (not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in msgs)):
                raise BadInputError(f"{source}:{lineno}: \"messages\" must be a non-empty list of "
                                    '{"role": str, "content": str} objects.')
            messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
            _check_roles(messages, source, lineno)
        elif "prompt" in rec:
            if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
                raise BadInputError(f"{source}:{lineno}: \"prompt\" must be a non-empty string.")
            messages = [{"role": "user", "content": rec["prompt"]}]
        else:
            raise BadInputError(f"{source}:{lineno}: the record has neither \"messages\" nor \"prompt\".")
        if "\\ud" in line or "\\uD" in line:  # only an escape can spell a lone surrogate
            try:
                for text_ in [pid] + [m["role"] + m["content"] for m in messages]:
                    text_.encode("utf-8")
            except UnicodeEncodeError:
                raise BadInputError(f"{source}:{lineno}: the record holds a lone UTF-16 surrogate escape "
                                    "(e.g. \\ud800), which is not text; fix or drop that escape.") from None
        records.append({"id": pid, "messages": messages})
    if not records:
        raise BadInputError(f"{source}: the prompt set is empty; give at least one prompt record.")
    return records


def _builtin_text(filename: str) -> str:
    """A built-in prompt set's text: read from the package directory when it is one (importlib's
    resource readers, zipfile among them, cost a fully cached run more than the read), else
    through importlib.resources."""
    try:
        return (Path(__file__).resolve().parents[1] / "data" / filename).read_text(encoding="utf-8")
    except OSError:
        from importlib import resources

        return resources.files("runner").joinpath("data", filename).read_text()


def load_records(spec: str, fields: FieldMap = FieldMap()) -> list[dict]:
    """Read ``builtin:NAME``, ``suite:NAME``, ``hf:NAME[:CONFIG][:SPLIT]`` (the local datasets
    cache), a Parquet or JSON file, or a JSONL file; ``fields``: which row fields hold the
    prompt (runner/suites/sources.py)."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in BUILTIN_SETS:
            raise BadInputError(f"unknown prompt set {spec!r}; built-in sets are {_builtin_names()}.")
        return parse_records(_builtin_text(BUILTIN_SETS[name]), spec)
    if spec.startswith("suite:"):
        from ..suites import catalog

        return catalog.load(spec)
    if spec.startswith("hf:"):
        from ..suites.sources import parse_hf, read_hf

        return rows_to_records(read_hf(parse_hf(spec))[1], fields, spec)
    text = None if spec.endswith(".parquet") else _read_prompt_file(spec)
    if text is not None and not fields.given and not (spec.endswith(".json") and text.lstrip().startswith("[")):
        return parse_records(text, spec)  # a JSONL prompt file, as always
    return rows_to_records(read_table(spec, text), fields, spec)


def _read_prompt_file(spec: str) -> str:
    return read_text_file(spec, f"pass a JSONL file or one of {_builtin_names()} with --prompts.")


# A large prompt file's ids and digests are kept in $DFCACHE_HOME/prompt-sets/, by (path, size,
# mtime_ns, inode) as the fingerprint memo keeps file digests: planning a cached 100,000-prompt
# set then reads one small JSON document instead of parsing and hashing every line; the records
# themselves are parsed only if a stage needs them (PromptRecords).
MEMO_MIN_RECORDS = 5000
MEMO_VERSION = 2  # 2: records with an unknown role or no user turn are refused


def _memo_path(path: Path, st) -> Path:
    from dfcache.config import dfcache_home

    ident = f"{MEMO_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    return dfcache_home() / "prompt-sets" / f"{xxhash.xxh3_128_hexdigest(ident.encode())}.json"


def _read_memo(memo: Path):
    try:
        data = json.loads(memo.read_bytes())
        ids, digests = data["ids"], data["digests"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(ids, list) and isinstance(digests, list) and len(ids) == len(digests) > 0):
        return None
    return ids, digests


def _write_memo(memo: Path, ids: list[str], digests: list[str], turns: dict | None = None) -> None:
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        doc = {"ids": ids, "digests": digests, **({"turns": turns} if turns is not None else {})}
        tmp.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, memo)
    except OSError:
        pass  # only a speed-up


class PromptRecords:
    """The first ``n`` records of a prompt file, parsed on first use (a plan never needs them)."""

    def __init__(self, spec: str, ids: list[str], fields: FieldMap = FieldMap()) -> None:
        self.spec, self.ids, self.fields, self._records = spec, ids, fields, None

    def _load(self) -> list[dict]:
        if self._records is None:
            records = load_records(self.spec, self.fields)[: len(self.ids)]
            if [r["id"] for r in records] != self.ids:
                raise BadInputError(f"prompt file {self.spec} changed during the run; run again.")
            self._records = records
        return self._records

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self._load()[i]

    def __iter__(self):
        return iter(self._load())


def load_set(spec: str, fields: FieldMap = FieldMap()) -> tuple[list[str], list[str], "list[dict] | None"]:
    """The ids of ``builtin:NAME`` or a JSONL file's records, each one's upstream digest
    (:func:`messages_digest` of its messages) and the records (None when the ids and digests came
    from the memo: :class:`PromptRecords` reads them when needed)."""
    if spec.startswith(("suite:", "hf:")):
        return _load_dataset_set(spec, fields)
    if spec.startswith("builtin:") or fields.given or spec.endswith((".parquet", ".json")):
        records = load_records(spec, fields)
        return [r["id"] for r in records], [messages_digest(r["messages"]) for r in records], records
    path = Path(spec)
    memo = None
    try:
        st = path.stat() if path.is_file() else None
        if st is not None and st.st_size > 0:
            memo = _memo_path(path, st)
            got = _read_memo(memo)
            if got is not None:
                return got[0], got[1], None
    except OSError:
        pass  # load_records names the problem
    records = load_records(spec)
    ids, digests = [r["id"] for r in records], [messages_digest(r["messages"]) for r in records]
    if memo is not None and len(records) >= MEMO_MIN_RECORDS:
        _write_memo(memo, ids, digests)
    return ids, digests, records


def _dataset_memo(spec: str, fields: FieldMap) -> Path | None:
    from ..suites.catalog import source_ident

    ident = source_ident(spec, fields)
    if ident is None:
        return None
    from dfcache.config import dfcache_home

    digest = xxhash.xxh3_128_hexdigest(f"{MEMO_VERSION}\0{ident}".encode())
    return dfcache_home() / "prompt-sets" / f"{digest}.json"


def _load_dataset_set(spec: str, fields: FieldMap):
    """:func:`load_set` of ``suite:`` and ``hf:`` sets, through the memo by the identity of the cached
    files they are read from (runner/suites/catalog.py ``source_ident``): a cached run of a suite
    then imports neither the datasets library nor pyarrow (2.4 s against 0.4 s for the example)."""
    memo = _dataset_memo(spec, fields)
    if memo is not None:
        got = _read_memo(memo)
        if got is not None:
            return got[0], got[1], None
    records = load_records(spec, fields)
    ids, digests = [r["id"] for r in records], [messages_digest(r["messages"]) for r in records]
    if memo is not None:
        _write_memo(memo, ids, digests, _turns_of(records))
    return ids, digests, records


def _turns_of(records) -> dict[int, list[str]]:
    return {i: r["turns"] for i, r in enumerate(records) if "turns" in r}


def load_turns(spec: str, fields: FieldMap, records) -> dict[int, list[str]]:
    """The user turns of a set's multi-turn records (``suite:mt-bench``), by position: from
    ``records`` when :func:`load_set` read them, else from its memo (a cached run of the suite
    reads no dataset). Only suites have them."""
    if not spec.startswith("suite:"):
        return {}
    if records is not None:
        return _turns_of(records)
    memo = _dataset_memo(spec, fields)
    try:
        turns = json.loads(memo.read_bytes()).get("turns") if memo is not None else None
        if isinstance(turns, dict):
            return {int(i): t for i, t in turns.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return _turns_of(load_records(spec, fields))


def fields_of(opts) -> FieldMap:
    return FieldMap(prompt=opts.prompt_field, messages=opts.messages_field, id=opts.id_field)


def build(ctx: RunContext) -> Node:
    opts = ctx.options
    specs, fields = sets.specs(opts.prompts), fields_of(opts)
    if fields.given and all(s.startswith(("builtin:", "suite:")) for s in specs):
        raise BadInputError("--prompt-field, --messages-field and --id-field map the rows of hf:, Parquet, JSON and "
                            f"JSONL sets; {sets.display(opts.prompts)} has its own construction: drop them.")
    turns: dict[int, list[str]] = {}
    if len(specs) == 1:
        ids, upstream, records = _first(specs[0], *load_set(specs[0], fields), opts.num_prompts)
        turns = {i: t for i, t in load_turns(specs[0], fields, records).items() if i < len(ids)}
        records = records if records is not None else PromptRecords(specs[0], ids, fields)
    else:
        # Several sets (suites): one prompt set, ids "SET/ID" (runner/suites/sets.py); --num-prompts
        # takes the first N of each set.
        ids, upstream, records = [], [], []
        for name, spec in zip(sets.names(opts.prompts), specs):
            i_, u_, r_ = _first(spec, *load_set(spec, fields), opts.num_prompts)
            turns.update({len(ids) + i: t for i, t in load_turns(spec, fields, r_).items() if i < len(i_)})
            ids += [f"{name}/{i}" for i in i_]
            upstream += u_
            records += list(r_ if r_ is not None else PromptRecords(spec, i_, fields))
    if opts.mix is not None:
        sets.parse_mix(opts.mix, sets.names(opts.prompts))  # before any work: exit 6 naming the fix
    return node(ids, upstream, records, turns, f"{len(ids)} prompts from {sets.display(opts.prompts)}")


def node(ids: list[str], upstream: list[str], records, turns: dict[int, list[str]], summary: str) -> Node:
    """The prompts node of a prompt set (``turns``: the user turns of its multi-turn records, by
    position; runner/core/pipeline.py makes their later turns' prompts)."""
    return KEY.samples(inputs={}, upstream_samples=upstream, ids=ids, needs="cpu", label="prompts",
                       spec=PromptsSpec(records, turns), summary=summary)


class JoinedRecords:
    """Records of a set followed by more (a set's later turns), without reading the first ones."""

    def __init__(self, first, more: list[dict]) -> None:
        self.first, self.more = first, more

    def __len__(self) -> int:
        return len(self.first) + len(self.more)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.first[i] if i < len(self.first) else self.more[i - len(self.first)]

    def __iter__(self):
        yield from self.first
        yield from self.more


def _first(spec: str, ids: list[str], upstream: list[str], records, n: int | None):
    """The first ``n`` prompts of a set (all when ``n`` is None)."""
    if n is None:
        return ids, upstream, records
    if n > len(ids):
        # More prompts than the set holds is a well-formed value (EvalOptions.validate checks
        # the form) that the content contradicts (6, docs/cli.md).
        raise BadInputError(f"--num-prompts {n}, but {spec} holds only {len(ids)} prompt(s); pass --num-prompts "
                            f"{len(ids)} or fewer, or leave it out to use them all.")
    return ids[:n], upstream[:n], records[:n] if records is not None else None


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    from dfcache.samples import SampleSink

    from ..core.summaries import prompt_set_name

    for node in nodes:
        # The set's name in the summary: `dfcache ls --by selection` shows one line per set.
        with SampleSink(ctx.store, node.partition, summary=f"prompt records of {prompt_set_name(node)}",
                        provenance={"source": _source_kind(ctx.options.prompts)}) as sink:
            for i in node.positions_distinct(node.produce):
                sink.add(node.upstream_samples[i], doc={"messages": node.spec.records[i]["messages"]})


def _source_kind(prompts) -> str:
    kinds = {s.partition(":")[0] if s.startswith(("builtin:", "suite:", "hf:")) else "file" for s in sets.specs(prompts)}
    return kinds.pop() if len(kinds) == 1 else "several"


def read_messages(store, node: Node, positions) -> list[list[dict]]:
    """The messages of the prompts at ``positions`` of a prompts node, from the store."""
    from dfcache.samples import SampleSet

    positions = list(positions)
    docs = SampleSet(store, node.partition.key, [node.sample_keys[i] for i in positions]).docs()
    return [d["messages"] for d in docs]
