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
import stat
from pathlib import Path

import xxhash

from dfcache.errors import BadInputError
from dfcache.keys import messages_digest  # record_digest({"messages": ...}), spelled out for speed

from ..core.graph import KeyRecipe, Node, RunContext

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


# The roles chat templates know (OpenAI's chat API and the Hugging Face templates): anything else
# is rendered as nothing, or as a turn the model never saw in training, and cached as if it were fine.
ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_roles(messages: list[dict], source: str, lineno: int) -> None:
    for m in messages:
        if m["role"] not in ROLES:
            raise BadInputError(f"{source}:{lineno}: unknown role {m['role']!r}; a message's role is one of "
                                f"{', '.join(ROLES)}.")
    if not any(m["role"] == "user" for m in messages):
        # Only a system prompt, or only an assistant turn: there is nothing to answer, and the
        # model's completion of it is not a response the drafter will ever be asked to speed up.
        raise BadInputError(f"{source}:{lineno}: the messages have no \"user\" turn (roles: "
                            f"{', '.join(m['role'] for m in messages)}); give each prompt a user message.")


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


def load_records(spec: str) -> list[dict]:
    """Read ``builtin:NAME`` or a JSONL file."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in BUILTIN_SETS:
            raise BadInputError(f"unknown prompt set {spec!r}; built-in sets are {_builtin_names()}.")
        return parse_records(_builtin_text(BUILTIN_SETS[name]), spec)
    return parse_records(_read_prompt_file(spec), spec)


def _not_a_file(st) -> str:
    if st is None:
        return "does not exist"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if stat.S_ISFIFO(st.st_mode):
        return "is a FIFO (a named pipe), not a regular file"
    if stat.S_ISSOCK(st.st_mode):
        return "is a socket, not a regular file"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return "is a device, not a regular file"
    return "is not a regular file"


def _read_prompt_file(spec: str) -> str:
    """The text of a prompt file. A directory, FIFO, socket or device is named as what it is, and
    nothing here can block: the file is opened non-blocking and checked to be a regular file
    before it is read (a FIFO opened for reading waits for a writer forever)."""
    fix = f"pass a JSONL file or one of {_builtin_names()} with --prompts."
    try:
        st = os.stat(spec)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise BadInputError(f"prompt file {spec} cannot be read ({e.strerror}); {fix}") from None
    if st is None or not stat.S_ISREG(st.st_mode):
        raise BadInputError(f"prompt file {spec} {_not_a_file(st)}; {fix}")
    try:
        fd = os.open(spec, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise BadInputError(f"prompt file {spec} cannot be read ({e.strerror}); {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the two looks
            raise BadInputError(f"prompt file {spec} {_not_a_file(st)}; {fix}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as e:
        raise BadInputError(f"prompt file {spec} cannot be read ({e.strerror}); {fix}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInputError(f"prompt file {spec} cannot be read ({e}); pass a UTF-8 JSONL file.") from None


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


def _write_memo(memo: Path, ids: list[str], digests: list[str]) -> None:
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"ids": ids, "digests": digests}, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, memo)
    except OSError:
        pass  # only a speed-up


class PromptRecords:
    """The first ``n`` records of a prompt file, parsed on first use (a plan never needs them)."""

    def __init__(self, spec: str, ids: list[str]) -> None:
        self.spec, self.ids, self._records = spec, ids, None

    def _load(self) -> list[dict]:
        if self._records is None:
            records = load_records(self.spec)[: len(self.ids)]
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


def load_set(spec: str) -> tuple[list[str], list[str], "list[dict] | None"]:
    """The ids of ``builtin:NAME`` or a JSONL file's records, each one's upstream digest
    (:func:`messages_digest` of its messages) and the records (None when the ids and digests came
    from the memo: :class:`PromptRecords` reads them when needed)."""
    if spec.startswith("builtin:"):
        records = load_records(spec)
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


def build(ctx: RunContext) -> Node:
    opts = ctx.options
    ids, upstream, records = load_set(opts.prompts)
    if opts.num_prompts is not None:
        # More prompts than the set holds is a well-formed value (EvalOptions.validate checks
        # the form) that the content contradicts (6, docs/cli.md).
        if opts.num_prompts > len(ids):
            raise BadInputError(f"--num-prompts {opts.num_prompts}, but {opts.prompts} holds only {len(ids)} "
                                f"prompt(s); pass --num-prompts {len(ids)} or fewer, or leave it out to "
                                "use them all.")
        ids, upstream = ids[: opts.num_prompts], upstream[: opts.num_prompts]
    records = records[: len(ids)] if records is not None else PromptRecords(opts.prompts, ids)
    return KEY.samples(inputs={}, upstream_samples=upstream, ids=ids, needs="cpu", label="prompts",
                       payload=records, summary=f"{len(ids)} prompts from {opts.prompts}")


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    from dfcache.samples import SampleSink

    from ..core.summaries import prompt_set_name

    for node in nodes:
        # The set's name in the summary: `dfcache ls --by selection` shows one line per set.
        with SampleSink(ctx.store, node.partition, summary=f"prompt records of {prompt_set_name(node)}",
                        provenance={"source": "builtin" if ctx.options.prompts.startswith("builtin:")
                                    else "file"}) as sink:
            for i in node.positions_distinct(node.produce):
                sink.add(node.upstream_samples[i], doc={"messages": node.payload[i]["messages"]})


def read_messages(store, node: Node, positions) -> list[list[dict]]:
    """The messages of the prompts at ``positions`` of a prompts node, from the store."""
    from dfcache.samples import SampleSet

    positions = list(positions)
    docs = SampleSet(store, node.partition.key, [node.sample_keys[i] for i in positions]).docs()
    return [d["messages"] for d in docs]
