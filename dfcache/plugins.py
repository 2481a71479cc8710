"""Plugins of the ``dfcache`` command line, found by entry point: how the runner (and any other
package) adds commands without dfcache importing it.

Two groups:

- ``dfcache.commands``: ``module:register``, called as ``register(app)`` with the typer app, adds
  commands (the runner's ``run``, ``plan``, ``export``...).
- ``dfcache.fast_paths``: ``module:main``, named for the command it answers (``run``): called as
  ``main(argv)`` by the executable before typer is imported (dfcache/__main__.py), it answers a
  command line it understands completely and that needs no work, or returns None to leave it to
  the full command line.

Where they are declared:

- dfcache's own (the runner ships in the same distribution) by the copy of dfcache that runs:
  the ``[project.entry-points."GROUP"]`` tables of the ``pyproject.toml`` beside the ``dfcache``
  package when it runs from a source checkout (an editable install, or a plain checkout with no
  install at all: ``python -m dfcache`` from the repository root), else its installed
  distribution's ``entry_points.txt`` (a wheel). So a checkout always runs the commands it
  declares, whatever an install of another checkout (or an older one) recorded;
- every other distribution's in its installed metadata (:mod:`importlib.metadata`); its own
  ``dfcache`` entries are skipped there, they are read as above.

Fast paths are dfcache's own only: finding one in every installed distribution means importing
:mod:`importlib.metadata` (24 ms on the 2-core VM) and reading every ``entry_points.txt`` (5.6
ms for 125 distributions), a third of a fully cached ``run``; a plugin's command is answered by
the full command line. Reading dfcache's own declarations costs a fraction of a millisecond (no
``tomllib``, 7 ms to import: the tables are read with :func:`read_pyproject_entry_points`, and a
test checks that it agrees with ``tomllib`` on the repository's own file).
"""

from __future__ import annotations

import os

COMMANDS = "dfcache.commands"
FAST_PATHS = "dfcache.fast_paths"
DISTRIBUTION = "dfcache"

_own: dict | None = None


def _unquote(text: str) -> str | None:
    """A TOML basic or literal string's value (no escapes: names and entry points have none)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'" and "\\" not in text:
        return text[1:-1]
    return None


def _without_comment(line: str) -> str:
    """The line without a ``#`` comment outside quotes."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == "#":
            return line[:i].strip()
    return line.strip()


def _table_name(text: str) -> tuple[str, ...]:
    """``project.entry-points."dfcache.commands"`` as its parts."""
    parts, part, quote = [], "", None
    for c in text:
        if quote:
            if c == quote:
                quote = None
            else:
                part += c
        elif c in "\"'":
            quote = c
        elif c == ".":
            parts.append(part.strip())
            part = ""
        else:
            part += c
    return (*parts, part.strip())


def read_pyproject_entry_points(text: str) -> tuple[str | None, dict[str, dict[str, str]]]:
    """(``[project] name``, {group: {name: "module:attr"}}) of a ``pyproject.toml``'s
    ``[project.entry-points."GROUP"]`` and ``[project.scripts]`` tables: the subset of TOML they
    are written in (one ``name = "value"`` a line, comments after ``#``). String methods only:
    the executable reads it on every fast path."""
    name, groups, table = None, {}, ()
    for raw in text.splitlines():
        line = _without_comment(raw)
        if line.startswith("[") and line.endswith("]") and not line.startswith("[["):
            table = _table_name(line[1:-1])
            continue
        key, eq, value = line.partition("=")
        value = _unquote(value) if eq else None
        if value is None:
            continue
        key = _unquote(key) if key.strip()[:1] in "\"'" else key.strip()
        if table == ("project",) and key == "name":
            name = value
        elif len(table) == 3 and table[:2] == ("project", "entry-points"):
            groups.setdefault(table[2], {})[key] = value
        elif table == ("project", "scripts"):
            groups.setdefault("console_scripts", {})[key] = value
    return name, groups


def read_entry_points_txt(text: str) -> dict[str, dict[str, str]]:
    """{group: {name: value}} of an installed distribution's ``entry_points.txt`` (INI)."""
    groups: dict[str, dict[str, str]] = {}
    group = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            group = line[1:-1].strip()
        elif group is not None and "=" in line:
            key, _, value = line.partition("=")
            groups.setdefault(group, {})[key.strip()] = value.strip()
    return groups


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def own_entry_points() -> dict[str, dict[str, str]]:
    """{group: {name: value}} that the running copy of dfcache declares: its checkout's
    ``pyproject.toml``, else its installed distribution's ``entry_points.txt``, else nothing."""
    global _own
    if _own is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        text = _read(os.path.join(root, "pyproject.toml"))
        found: dict = {}
        if text is not None:
            name, groups = read_pyproject_entry_points(text)
            if name == DISTRIBUTION:
                found = groups
        if not found:
            try:
                names = os.listdir(root)
            except OSError:
                names = []
            for n in sorted(names):
                if n.startswith(DISTRIBUTION + "-") and n.endswith(".dist-info"):
                    found = read_entry_points_txt(_read(os.path.join(root, n, "entry_points.txt")) or "")
                    break
        _own = found
    return _own


def entry_points(group: str) -> list[tuple[str, str]]:
    """(name, "module:attr") of every entry point of ``group``: dfcache's own first, then every
    other installed distribution's, each value once."""
    from importlib.metadata import entry_points as installed

    out = list(own_entry_points().get(group, {}).items())
    seen = {value for _, value in out}
    for ep in installed(group=group):
        dist = getattr(ep, "dist", None)
        if dist is not None and (dist.name or "").lower().replace("_", "-") == DISTRIBUTION:
            continue  # dfcache's own, read from the copy that runs
        if ep.value not in seen:
            seen.add(ep.value)
            out.append((ep.name, ep.value))
    return out


def load(value: str):
    """The object an entry point's ``module:attr`` names."""
    from importlib import import_module

    module, _, attr = value.partition(":")
    obj = import_module(module.strip())
    for part in attr.strip().split(".") if attr.strip() else ():
        obj = getattr(obj, part)
    return obj
