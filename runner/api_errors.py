"""Errors raised to Python callers of :mod:`runner.api`, in Python's spelling.

Stages and option checks write their messages for the command line ("pass --server URL",
"--num-prompts 5, but ..."): the CLI and the API share them, and the CLI's stay as they are. A
Python caller passes keyword arguments, so :func:`for_python` rewrites, in an error leaving
``runner.api``, every option of `dfcache run` that the message names into the keyword argument
that means the same (``server=URL``, ``num_prompts=5``, ``layers=[1, 3]``, ``offline=True``).
Shell commands inside a message ("produce it with: dfcache run ...", anything in backquotes)
are left as they are: they are commands to run, and they resolve as the call did
(:func:`runner.core.execution.cli_args`). A flag that is no keyword of the API (``--json``, ``--format``)
is left too.
"""

from __future__ import annotations

import re
from dataclasses import fields

from .core.options import CHOICES, RUN_OPTIONS, EvalOptions

# Flags whose field name is not the flag's spelling (runner/core/options.py declares them).
_RENAMED = {f: o.name for o in RUN_OPTIONS if o.field for f in o.flags if f != "--" + o.name.replace("_", "-")}
_LISTS = tuple(o.name for o in RUN_OPTIONS if o.is_list)
# Keywords of the API functions themselves, not EvalOptions fields.
_CALL = {"--store": "store", "--shard": "shard"}
_MORE_CHOICES = {"shard": ("slurm",)}


def _keywords() -> dict[str, tuple[str, type | None]]:
    """flag -> (keyword, the field's type: bool for switches, None for values)."""
    out: dict[str, tuple[str, type | None]] = {}
    for f in fields(EvalOptions):
        if f.name in ("json", "progress"):
            continue
        flag = next((k for k, v in _RENAMED.items() if v == f.name), "--" + f.name.replace("_", "-"))
        kind = bool if isinstance(getattr(EvalOptions(), f.name), bool) else None
        out[flag] = (f.name, kind)
        if kind is bool:
            out["--no-" + flag[2:]] = (f.name, bool)
    for flag, name in _RENAMED.items():
        out.setdefault(flag, (name, None))
    out["--no-progress"] = ("progress", bool)
    for flag, name in _CALL.items():
        out[flag] = (name, None)
    return out


_KEYWORDS = _keywords()
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?:(=)|(\s+))?")
_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(?:/[A-Z][A-Z0-9_]*)?")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
_COMMAND = re.compile(r"`[^`]*`|\(dfcache [^)]*\)|(?<![\w./-])dfcache (?:[a-z]|--)[^\n]*")


def _value(text: str, start: int, name: str) -> tuple[str, int] | None:
    """The value written at ``start`` after a flag, as Python spells it, and where it ends; None
    when the next word is part of the sentence ("pass --target with a model directory")."""
    word = r"[a-z0-9_-]+(?:,[a-z0-9_-]+)*" if name == "key_versions" else r"[^\s,;()]+"
    m = re.match(r"'[^'\n]*'|\"[^\"\n]*\"|" + word, text[start:])
    if not m:
        return None
    raw = m.group(0)
    if raw[0] in "'\"":
        return raw, start + len(raw)
    raw = raw.rstrip(".:")  # the end of a sentence, not of the value
    choices = CHOICES.get(name, (None, ()))[1] or _MORE_CHOICES.get(name, ())
    if _NUMBER.fullmatch(raw) or _PLACEHOLDER.fullmatch(raw):
        spelled = raw
    elif raw in choices:
        spelled = repr(raw)
    elif "|" in raw and all(c in choices for c in raw.split("|")):
        spelled = "|".join(repr(c) for c in raw.split("|"))  # the choices: --backend fla|torch
    elif name == "key_versions" and re.fullmatch(r"[a-z0-9_,-]+", raw):
        return "[" + ", ".join(repr(p) for p in raw.split(",")) + "]", start + len(raw)
    elif any(c in raw for c in "/:~.") or name in ("served_model", "target_revision"):
        spelled = repr(raw)  # a path, URL, Hugging Face id, builtin:NAME
    else:
        return None
    return spelled, start + len(raw)


def _spell_prose(text: str) -> str:
    # Pieces: plain text, or [keyword, values] for a flag (values None: named, not given).
    pieces: list = []
    pos = 0
    for m in _FLAG.finditer(text):
        if m.start() < pos or m.group(1) not in _KEYWORDS:
            continue
        flag = m.group(1)
        name, kind = _KEYWORDS[flag]
        pieces.append(text[pos:m.start()])
        pos = m.start() + len(flag)
        if kind is bool:
            pieces.append([name, [str(not flag.startswith("--no-"))]])
            continue
        got = _value(text, m.end(), name) if (m.group(2) or m.group(3)) else None
        if got is None:
            # Named, not given a value: "--temperature is 0.7" reads "temperature is 0.7", a
            # flag that ends the sentence ("drop --server.") the keyword "server=".
            word_follows = re.match(r"\s+[a-z]|:", text[pos:])
            pieces.append(name if word_follows else [name, None])
            continue
        value, pos = got
        prev = pieces[-2] if len(pieces) >= 2 else None
        if (name in _LISTS and not value.startswith("[") and isinstance(prev, list) and prev[0] == name
                and prev[1] is not None and not pieces[-1].strip()):
            prev[1].append(value)  # --layer 1 --layer 3: one list
            pieces.pop()
            continue
        pieces.append([name, [value]])
    pieces.append(text[pos:])
    out = []
    for p in pieces:
        if isinstance(p, str):
            out.append(p)
        elif p[1] is None:
            out.append(f"{p[0]}=")
        elif p[0] in _LISTS and not p[1][0].startswith("["):
            out.append(f"{p[0]}=[{', '.join(p[1])}]")
        else:
            out.append(f"{p[0]}={p[1][0]}")
    return "".join(out)


def spell(text: str | None) -> str | None:
    """``text`` with the `dfcache run` options it names as the API's keyword arguments; shell
    commands in it (after ``dfcache``, in backquotes) unchanged."""
    if not text:
        return text
    out, pos = [], 0
    for m in _COMMAND.finditer(text):
        out.append(_spell_prose(text[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(_spell_prose(text[pos:]))
    return "".join(out)


def for_python(err):
    """``err`` (a :class:`dfcache.errors.DfcacheError`) with its problem and fix in Python's
    spelling: the same class and fields, so callers catch it as before."""
    import copy

    problem, fix = spell(err.problem), spell(err.fix)
    if (problem, fix) == (err.problem, err.fix):
        return err
    new = copy.copy(err)
    new.problem, new.fix = problem, fix
    new.args = (new.message, *err.args[1:])
    return new
