"""Where prompt rows come from besides a prompt JSONL file: the local datasets cache
(``hf:NAME[:CONFIG][:SPLIT]``) and Parquet, JSON and JSONL files read through a field mapping.

Nothing here downloads. ``hf:`` reads what the ``datasets`` library prepared in its cache
(``$HF_DATASETS_CACHE``, ``<namespace>___<name>/<config>/<version>/<hash>/``) through its own
``cache`` builder, the builder ``load_dataset`` falls back to when offline; a dataset, config or
split that is not there is one error naming what is there and the command that would fetch it.
Rows become prompt records (``{"id", "messages"}``) through :func:`rows_to_records`, which checks
them as ``runner/stages/prompts.py`` checks a JSONL file: the key is the messages, wherever they
were read from.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from dfcache.errors import BadInputError, OfflineMissingError

# ShareGPT-style turns ({"from": "human", "value": ...}) name their roles differently.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool"}


@dataclass(frozen=True)
class FieldMap:
    """Which fields of a row hold the prompt: ``prompt`` (one user message), ``messages`` (a chat)
    and ``id``. None: the default (``messages``, else ``prompt``; ``id``, else the row number)."""

    prompt: str | None = None
    messages: str | None = None
    id: str | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.prompt, self.messages, self.id))


# The roles chat templates know (OpenAI's chat API and the Hugging Face templates): anything else
# is rendered as nothing, or as a turn the model never saw in training, and cached as if it were fine.
ROLES = ("system", "developer", "user", "assistant", "tool")


def check_roles(messages: list[dict], source: str, where) -> None:
    """Every role one of ROLES, and a user turn; ``where``: the line or row, for the message."""
    for m in messages:
        if m["role"] not in ROLES:
            raise BadInputError(f"{source}:{where}: unknown role {m['role']!r}; a message's role is one of "
                                f"{', '.join(ROLES)}.")
    if not any(m["role"] == "user" for m in messages):
        # Only a system prompt, or only an assistant turn: there is nothing to answer, and the
        # model's completion of it is not a response the drafter will ever be asked to speed up.
        raise BadInputError(f"{source}:{where}: the messages have no \"user\" turn (roles: "
                            f"{', '.join(m['role'] for m in messages)}); give each prompt a user message.")


# --------------------------------------------------------------------------------------------
# hf:NAME[:CONFIG][:SPLIT] from the local datasets cache
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HfSpec:
    name: str
    config: str | None = None
    split: str | None = None

    def fetch_command(self) -> str:
        args = [repr(self.name)] + ([repr(self.config)] if self.config else [])
        split = f", split={self.split!r}" if self.split else ""
        return f"python -c \"import datasets; datasets.load_dataset({', '.join(args)}{split})\""


def parse_hf(spec: str) -> HfSpec:
    """``hf:NAME[:CONFIG][:SPLIT]``; NAME is ``namespace/name`` or ``name``. With two parts the
    second is a config when the cache holds one of that name, else a split (:func:`read_hf`)."""
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3 or any(p == "" for p in parts) or parts[0].count("/") > 1:
        raise BadInputError(f"--prompts {spec}: give hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT "
                            "(e.g. hf:openai/gsm8k:main:test).")
    return HfSpec(*parts) if len(parts) != 2 else HfSpec(parts[0], parts[1], None)


def _snake(name: str) -> str:
    from re import sub

    # datasets.naming.camelcase_to_snakecase, which names the cache folder
    name = sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return sub(r"([a-z\d])([A-Z])", r"\1_\2", name).lower()


def cached_configs(name: str, cache: Path) -> dict[str, Path]:
    """The configs of dataset ``name`` prepared in the datasets cache ``cache``: config -> its
    newest prepared folder (one holding ``dataset_info.json``)."""
    ns, _, base = name.rpartition("/")
    root = cache / (f"{ns}___{_snake(base)}" if ns else _snake(base))
    out: dict[str, tuple[float, Path]] = {}
    if not root.is_dir():
        return {}
    for info in root.glob("*/*/*/dataset_info.json"):
        folder = info.parent
        config = folder.parts[-3]
        t = info.stat().st_mtime
        if config not in out or t > out[config][0]:
            out[config] = (t, folder)
    return {c: p for c, (_, p) in sorted(out.items())}


def _missing(spec: HfSpec, cache: Path, what: str) -> OfflineMissingError:
    return OfflineMissingError(f"{what} is not in the local datasets cache ({cache}); dfcache never downloads "
                               f"a dataset: fetch it once with {spec.fetch_command()} (on a machine with "
                               "network, then copy the cache), or set HF_DATASETS_CACHE to where it is.")


def resolve_hf(spec: HfSpec, cache: Path) -> tuple[HfSpec, Path, list[str]]:
    """The cached config folder of ``spec`` and its splits, with config and split made explicit;
    every problem is an error before any row is read."""
    configs = cached_configs(spec.name, cache)
    if not configs:
        raise _missing(spec, cache, f"dataset {spec.name}")
    config, split = spec.config, spec.split
    if config is not None and split is None and config not in configs:
        config, split = None, config  # hf:NAME:SPLIT
    if config is None:
        if len(configs) > 1:
            raise BadInputError(f"dataset {spec.name} has several configs in the cache ({', '.join(configs)}); "
                                f"name one: hf:{spec.name}:CONFIG[:SPLIT].")
        config = next(iter(configs))
    if config not in configs:
        raise _missing(HfSpec(spec.name, config, split), cache,
                       f"config {config!r} of dataset {spec.name} (cached: {', '.join(configs)})")
    folder = configs[config]
    try:
        info = json.loads((folder / "dataset_info.json").read_text(encoding="utf-8"))
        splits = list((info.get("splits") or {}).keys())
    except (OSError, ValueError) as e:
        raise BadInputError(f"the cached dataset {spec.name} ({folder}) cannot be read ({e}); fetch it again "
                            f"with {HfSpec(spec.name, config, split).fetch_command()}.") from None
    if split is None:
        if len(splits) != 1:
            raise BadInputError(f"dataset {spec.name} ({config}) has splits {', '.join(splits)}; name one: "
                                f"hf:{spec.name}:{config}:SPLIT.")
        split = splits[0]
    if split not in splits:
        raise BadInputError(f"dataset {spec.name} ({config}) has no split {split!r}; its splits are "
                            f"{', '.join(splits)}: pass hf:{spec.name}:{config}:{splits[0] if splits else 'SPLIT'}.")
    return HfSpec(spec.name, config, split), folder, splits


def read_hf(spec: HfSpec) -> tuple[HfSpec, list[dict]]:
    """The rows of a dataset split from the local datasets cache (never the network)."""
    from dfcache.config import datasets_cache_dir

    cache = datasets_cache_dir()
    full, folder, _ = resolve_hf(spec, cache)
    try:
        from datasets.packaged_modules.cache.cache import Cache
    except ImportError:
        raise BadInputError("--prompts hf:... needs the datasets library; install it (pip install datasets) "
                            "or pass a JSONL, JSON or Parquet file.") from None
    ns, _, base = full.name.rpartition("/")
    builder = Cache(cache_dir=str(cache), dataset_name=base, repo_id=full.name if ns else None,
                    config_name=full.config, version=folder.parts[-2], hash=folder.parts[-1])
    try:
        ds = builder.as_dataset(split=full.split)
    except (OSError, ValueError) as e:
        raise BadInputError(f"the cached dataset {full.name} ({full.config}/{full.split}, {folder}) cannot be "
                            f"read ({e}); fetch it again with {full.fetch_command()}.") from None
    return full, ds.to_list()


# --------------------------------------------------------------------------------------------
# Parquet, JSON and JSONL files
# --------------------------------------------------------------------------------------------

TABLE_SUFFIXES = (".parquet", ".json", ".jsonl", ".ndjson")


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


def read_text_file(spec: str, fix: str) -> str:
    """The text of a prompt file. A directory, FIFO, socket or device is named as what it is, and
    nothing here can block: the file is opened non-blocking and checked to be a regular file
    before it is read (a FIFO opened for reading waits for a writer forever)."""
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
        raise BadInputError(f"prompt file {spec} cannot be read ({e}); pass a UTF-8 file.") from None


def read_table(path: str, text: "str | None" = None) -> list[dict]:
    """The rows of a Parquet file, a JSON array of objects (or ``{"data"|"rows"|...: [...]}``
    with one list) or a JSONL file (``text``: its decoded contents, read by the caller)."""
    if path.endswith(".parquet"):
        if not os.path.isfile(path):
            raise BadInputError(f"prompt file {path} does not exist (or is not a regular file); pass a Parquet, "
                                "JSON or JSONL file.")
        try:
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        except ImportError:
            raise BadInputError(f"prompt file {path}: reading Parquet needs pyarrow; install it, or pass a "
                                "JSONL file.") from None
        except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common base
            raise BadInputError(f"prompt file {path} is not a readable Parquet file ({e}); pass a Parquet, JSON "
                                "or JSONL file.") from None
    if text is None:
        text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise BadInputError(f"prompt file {path}: not valid JSON ({e}); a .json prompt file is an array of "
                                "objects.") from None
        if isinstance(doc, dict):
            lists = [v for v in doc.values() if isinstance(v, list)]
            doc = lists[0] if len(lists) == 1 else doc
        if not isinstance(doc, list):
            raise BadInputError(f"prompt file {path}: a .json prompt file is an array of objects (or an object "
                                "holding one such array).")
        return doc
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise BadInputError(f"{path}:{lineno}: not valid JSON ({e}); each line must be one JSON "
                                    "object.") from None
    return rows


def _fields_of(rows: list) -> list[str]:
    names: dict[str, None] = {}
    for r in rows[:100]:
        if isinstance(r, dict):
            names.update(dict.fromkeys(r))
    return list(names)


def check_fields(rows: list, fields: FieldMap, source: str) -> tuple[str, str, str | None]:
    """(kind "messages"|"prompt", its field, the id field or None for row numbers), the fields
    given checked against the rows before any is converted."""
    have = _fields_of(rows)
    listed = ", ".join(have) or "none"
    for flag, name in (("--prompt-field", fields.prompt), ("--messages-field", fields.messages),
                       ("--id-field", fields.id)):
        if name is not None and name not in have:
            raise BadInputError(f"{source}: no field {name!r} ({flag}); its fields are {listed}: pass "
                                f"{flag} with one of them.")
    if fields.messages is not None and fields.prompt is not None:
        raise BadInputError("--messages-field and --prompt-field name two sources of one prompt; pass one.")
    if fields.messages is not None:
        kind, field = "messages", fields.messages
    elif fields.prompt is not None:
        kind, field = "prompt", fields.prompt
    elif "messages" in have:
        kind, field = "messages", "messages"
    elif "prompt" in have:
        kind, field = "prompt", "prompt"
    else:
        raise BadInputError(f"{source}: no \"messages\" or \"prompt\" field (its fields are {listed}); pass "
                            "--prompt-field NAME (a text field) or --messages-field NAME (a chat field).")
    return kind, field, fields.id if fields.id is not None else ("id" if "id" in have else None)


def _messages(value, source: str, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadInputError(f"{source}:{where}: the messages field must be a non-empty list of "
                            '{"role": str, "content": str} objects.')
    out = []
    for m in value:
        if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
            out.append({"role": m["role"], "content": m["content"]})
        elif isinstance(m, dict) and m.get("from") in _SHAREGPT_ROLES and isinstance(m.get("value"), str):
            out.append({"role": _SHAREGPT_ROLES[m["from"]], "content": m["value"]})
        else:
            raise BadInputError(f"{source}:{where}: the messages field must be a non-empty list of "
                                '{"role": str, "content": str} (or ShareGPT {"from", "value"}) objects.')
    return out


def rows_to_records(rows: list, fields: FieldMap, source: str) -> list[dict]:
    """Prompt records ``{"id", "messages"}`` from rows, as ``parse_records`` makes them from a
    JSONL file: unique non-empty ids, known roles, a user turn."""
    if not rows:
        raise BadInputError(f"{source}: the prompt set is empty; give at least one prompt record.")
    kind, field, id_field = check_fields(rows, fields, source)
    records, seen = [], {}
    for i, row in enumerate(rows):
        where = f"row {i}"
        if not isinstance(row, dict):
            raise BadInputError(f"{source}:{where}: a row must be an object with the field {field!r}.")
        if id_field is None:
            pid = str(i)
        else:
            pid = row.get(id_field)
            if not isinstance(pid, (str, int)) or isinstance(pid, bool) or str(pid) == "":
                raise BadInputError(f"{source}:{where}: missing or invalid id field {id_field!r} (a non-empty "
                                    "string or integer); pass --id-field with a field that names every row.")
            pid = str(pid)
        if pid in seen:
            raise BadInputError(f"{source}:{where}: duplicate id {pid!r} (first on row {seen[pid]}); ids must be "
                                "unique: pass --id-field with a unique field.")
        seen[pid] = i
        value = row.get(field)
        if kind == "messages":
            messages = _messages(value, source, where)
        else:
            if not isinstance(value, str) or not value.strip():
                raise BadInputError(f"{source}:{where}: the prompt field {field!r} must be a non-empty string.")
            messages = [{"role": "user", "content": value}]
        check_roles(messages, source, where)
        records.append({"id": pid, "messages": messages})
    return records
