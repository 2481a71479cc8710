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
from importlib import resources
from pathlib import Path

from dfcache.errors import BadInputError
from dfcache.samples import record_digest

from ..graph import KeyRecipe, Node, RunContext

KEY = KeyRecipe("prompts", 2, inputs={}, sample='record_digest({"messages": messages})')
NAME = KEY.stage
VERSION = KEY.version

BUILTIN_SETS = {"coding": "coding.jsonl", "reasoning": "reasoning.jsonl"}


def _builtin_names() -> str:
    return ", ".join(f"builtin:{n}" for n in BUILTIN_SETS)


def parse_records(text: str, source: str) -> list[dict]:
    """Parse JSONL prompt records; every problem names the file and line."""
    records: list[dict] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise BadInputError(f"{source}:{lineno}: not valid JSON ({e.msg}); each line must be "
                                '{"id": ..., "messages": [...]} or {"id": ..., "prompt": "..."}.') from None
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
        elif "prompt" in rec:
            if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
                raise BadInputError(f"{source}:{lineno}: \"prompt\" must be a non-empty string.")
            messages = [{"role": "user", "content": rec["prompt"]}]
        else:
            raise BadInputError(f"{source}:{lineno}: the record has neither \"messages\" nor \"prompt\".")
        records.append({"id": pid, "messages": messages})
    if not records:
        raise BadInputError(f"{source}: the prompt set is empty; give at least one prompt record.")
    return records


def load_records(spec: str) -> list[dict]:
    """Read ``builtin:NAME`` or a JSONL file."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in BUILTIN_SETS:
            raise BadInputError(f"unknown prompt set {spec!r}; built-in sets are {_builtin_names()}.")
        text = resources.files("runner").joinpath("data", BUILTIN_SETS[name]).read_text()
        return parse_records(text, spec)
    path = Path(spec)
    if not path.is_file():
        raise BadInputError(f"prompt file {spec} does not exist; pass a JSONL file or one of "
                            f"{_builtin_names()} with --prompts.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"prompt file {spec} cannot be read ({e}); pass a UTF-8 JSONL file.") from None
    return parse_records(text, spec)


def build(ctx: RunContext) -> Node:
    opts = ctx.options
    records = load_records(opts.prompts)
    if opts.num_prompts is not None:
        # More prompts than the set holds is a well-formed value (EvalOptions.validate checks
        # the form) that the content contradicts (6, docs/cli.md).
        if opts.num_prompts > len(records):
            raise BadInputError(f"--num-prompts {opts.num_prompts}, but {opts.prompts} holds only {len(records)} "
                                f"prompt(s); pass --num-prompts {len(records)} or fewer, or leave it out to "
                                "use them all.")
        records = records[: opts.num_prompts]
    upstream = [record_digest({"messages": r["messages"]}) for r in records]
    return KEY.samples(inputs={}, upstream_samples=upstream, ids=[r["id"] for r in records],
                       needs="cpu", label="prompts", payload=records,
                       summary=f"{len(records)} prompts from {opts.prompts}")


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    from dfcache.samples import SampleSink

    for node in nodes:
        with SampleSink(ctx.store, node.partition, summary="prompt records",
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
