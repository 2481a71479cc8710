"""Checks of values read as JSON (checkpoint configs, server answers), shared by the stages."""

from __future__ import annotations

from typing import Any


def int_list(value: Any) -> list[int] | None:
    """``value`` as a non-empty list of ints, or None if it is anything else (bools are not ints)."""
    if isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [int(x) for x in value]
    return None


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (for "config.json is a JSON array" messages)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(type(value), "value")
