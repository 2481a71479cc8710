"""Reading option values off a command line, for the executable's fast paths (``dfcache ls``
in :mod:`dfcache.__main__`, a fully cached ``run`` in :mod:`runner.commands.fast_run`), which answer
before the command-line framework is imported and must take a value exactly where it would."""

from __future__ import annotations


def option_value(argv: list[str], i: int, eq: str, value: str) -> tuple[str | None, int]:
    """The value of the option at ``argv[i]`` (``--name=value``, or ``--name value`` when ``eq``
    is empty) and the index of the last argument it took. None for the value when there is none
    or it looks like another option: the fast path then leaves the command line to the parser,
    which says what is wrong."""
    if not eq:
        if i + 1 >= len(argv):
            return None, i
        value, i = argv[i + 1], i + 1
    if not value or value.startswith("-"):
        return None, i
    return value, i
