"""One run's prompt sets: ``--prompts`` given once or several times (``suite:gsm8k --prompts
suite:humaneval``). Several sets make one prompt set whose ids are ``SET/ID`` (SET: the set's
name, :func:`set_name`), so the report can be cut by set when it is shown; the keys are the
content, as always, so a prompt in two sets is one sample."""

from __future__ import annotations

from pathlib import PurePath

from dfcache.errors import BadInputError


def specs(value) -> list[str]:
    """``--prompts`` as a list (EvalOptions.prompts is one string when given once)."""
    return [value] if isinstance(value, str) else list(value)


def set_name(spec: str) -> str:
    """``suite:gsm8k`` -> gsm8k, ``builtin:coding`` -> coding, ``hf:openai/gsm8k:main`` -> gsm8k,
    ``data/chat.jsonl`` -> chat: the name a set has in ids, per-set tables and ``--mix``."""
    if spec.startswith("suite:"):
        from .catalog import ALIASES

        name = spec[len("suite:"):].partition("@")[0]
        return ALIASES.get(name, name)
    if spec.startswith("builtin:"):
        return spec[len("builtin:"):]
    if spec.startswith("hf:"):
        return spec[len("hf:"):].split(":")[0].rpartition("/")[2]
    return PurePath(spec).stem


def names(value) -> list[str]:
    """The set names of ``--prompts``, checked to be distinct (they prefix the ids)."""
    out = [set_name(s) for s in specs(value)]
    for i, n in enumerate(out):
        if n in out[:i]:
            raise BadInputError(f"--prompts: two prompt sets are named {n!r} ({specs(value)[out.index(n)]}, "
                                f"{specs(value)[i]}); give each set once, or rename one file.")
    return out


def display(value) -> str:
    """``--prompts`` as summaries name it: the spec, or several joined by ``+``."""
    return "+".join(specs(value))


def group_of(pid: str) -> str:
    """The set of a prompt id of a run over several sets (``gsm8k/17`` -> gsm8k)."""
    return pid.partition("/")[0]


def turn_of(pid: str) -> int:
    """The turn a prompt id asks: K for a later turn of a multi-turn record (``81/turn2``, made by
    runner/core/pipeline.py ``later_turns``), else 1."""
    tail = pid.rpartition("/")[2]
    return int(tail[4:]) if tail.startswith("turn") and tail[4:].isdigit() and int(tail[4:]) > 1 else 1


def parse_mix_form(text: str) -> dict[str, float]:
    """``gsm8k=0.3,humaneval=0.5,mt-bench=0.2`` -> {set: weight}; a malformed value is a usage
    error (exit 2). Which sets and whether the weights sum to 1 is :func:`parse_mix`'s."""
    import math

    from dfcache.errors import UsageError

    out: dict[str, float] = {}
    for part in text.split(","):
        name, eq, w = part.strip().partition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = float("nan")
        if not eq or not name or not math.isfinite(weight) or weight < 0 or name in out:
            raise UsageError(f"--mix {text!r}: give SET=WEIGHT pairs separated by commas, each set once, weights "
                             "0 or more (e.g. --mix gsm8k=0.3,humaneval=0.5,mt-bench=0.2).")
        out[name] = weight
    return out


def parse_mix(text: str, run_sets: list[str]) -> dict[str, float]:
    """:func:`parse_mix_form`, every set one of this run's and the weights summing to 1 (exit 6)."""
    mix = parse_mix_form(text)
    unknown = [n for n in mix if n not in run_sets]
    if unknown:
        raise BadInputError(f"--mix names {', '.join(unknown)}, not a prompt set of this run ({', '.join(run_sets)}); "
                            f"add --prompts suite:{unknown[0]} (or the set's file), or drop it from --mix.")
    total = sum(mix.values())
    if abs(total - 1.0) > 1e-6:
        raise BadInputError(f"--mix weights sum to {total:g}, not 1; give each set its share of the traffic "
                            "(e.g. gsm8k=0.3,humaneval=0.5,mt-bench=0.2).")
    return mix
