"""A completion's token ids, and the checks that say whether they are the ones the target generated.

Three cases, by what the server gave (``tokens_source`` of the completion):

``server`` / ``local``
    the ids came with the completion. Server ids are checked once, when they arrive, against the
    server's own text (:func:`server_ids_problem`): ids that decode to something else than the
    text (a proxy mixing answers, a server bug) are refused, whatever the options.
``retokenized``
    only text came back. The ids are rebuilt as the tokens stage has always built them (the text
    encoded without added special tokens; on ``stop``, the first end-of-sequence id appended,
    since a greedy generation ends with its stop token and a server's text drops it), then
    checked (:func:`rebuild`):

    (a) their count against the server's ``usage.completion_tokens``. Every server read for this
        counts every generated token, the stop token included: vLLM (``len(output.token_ids)``,
        and its scheduler keeps the EOS token in them: v1/core/sched/utils.py ``check_stop``),
        SGLang (``len(output_ids)``) and ``transformers serve`` (``len(generated_ids)``), so the
        rebuilt ids are compared with the stop token appended, no tolerance either way;
    (b) the round trip: decoding the rebuilt ids gives the text back, character for character;
    (c) the text holds no U+FFFD: a replacement character is what a server writes for bytes it
        could not decode (a completion cut inside a multi-byte character), so the ids under it
        are lost whatever the counts say.

    The check cannot see a non-canonical tokenization of the same length (the model wrote "a" "b"
    where the tokenizer makes "ab" plus another split): a verified sample is likely, not proven,
    exact. The check's facts are stored (``ids_check``); whether a run may use a sample that failed
    them is decided by the run (``--accept-retokenized``), never stored.

A server-side reasoning parser splits a thinking model's output into ``reasoning_content`` (vLLM
``reasoning``) and ``content``. Neither alone is the generation: :func:`put_back` renders the
assistant turn with the target's own chat template and takes what follows the generation prompt
(without the turn's closing), e.g. ``<think>\\nR\\n</think>\\n\\nC`` for Qwen3, and that text is
rebuilt and checked as above. A template that has no place for the reasoning, or renders the turn
so that it does not continue the generation prompt, cannot put it back: such a sample is refused.

Everything here is deterministic in the tokenizer, the chat template and the completion document,
which the completions and tokens keys cover, so the completions stage (refusing before anything is
cached) and the tokens stage (checking again, and checking completions cached before checks
existed) reach the same facts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dfcache.errors import CompletionIdsRefused

REPLACEMENT = "\ufffd"
# A sentinel the chat template renders as the assistant's content, to find the turn's closing
# (``<|im_end|>\n``) after it. Private-use characters: no template strips or escapes them.
_SENTINEL = "\ue000dfcache-content\ue001"
_SPACE = re.compile(r"\s+")


@dataclass
class Rebuilt:
    """The completion ids of a text-only completion and the facts of their check."""

    ids: list[int] | None  # None when no text could be formed (problem says why)
    eos_appended: bool
    check: dict | None  # the ``ids_check`` document (facts only), None when ids is None
    problem: str | None  # None: the ids passed; else why they are not shown to be the generation
    acceptable: bool  # --accept-retokenized may keep it (a failed check, not an unusable text)


def stop_ids(target_dir, tokenizer) -> list[int]:
    """End-of-sequence ids as generation uses them (generation_config.json, config.json, then the
    tokenizer's), the first of which ends a ``stop`` completion's rebuilt ids."""
    from ...models.resolve import eos_token_ids

    eos = eos_token_ids(target_dir)
    if not eos and tokenizer.eos_token_id is not None:
        eos = [int(tokenizer.eos_token_id)]
    return eos


def reasoning_of(doc: dict) -> str | None:
    r = doc.get("reasoning_content")
    return r if isinstance(r, str) and r else None


def put_back(tokenizer, messages: list[dict], enable_thinking: bool, reasoning: str,
             content: str) -> tuple[str | None, str | None]:
    """The generation's text from a reasoning parser's split, in the chat template's own form:
    ``(text, None)``, or ``(None, why not)``."""
    from .sources import render_prompt

    def render(turn: dict) -> str:
        return tokenizer.apply_chat_template(list(messages) + [turn], tokenize=False,
                                             add_generation_prompt=False, enable_thinking=enable_thinking)

    try:
        prompt = render_prompt(tokenizer, messages, enable_thinking)
        # Both names: vLLM renamed reasoning_content to reasoning; templates read either.
        full = render({"role": "assistant", "content": content, "reasoning_content": reasoning,
                       "reasoning": reasoning})
        marked = render({"role": "assistant", "content": _SENTINEL})
    except Exception as e:  # a template that raises on an assistant turn (jinja2 errors, raise_exception)
        return None, f"the chat template cannot render the assistant turn ({type(e).__name__}: {e})"[:400]
    if not full.startswith(prompt):
        return None, ("the chat template renders the assistant turn so that it does not continue the generation "
                      "prompt (thinking mode differs from the server's?)")
    body = full[len(prompt):]
    at = marked.find(_SENTINEL)
    closing = marked[at + len(_SENTINEL):] if at >= 0 else ""
    if closing and body.endswith(closing):
        body = body[: len(body) - len(closing)]
    # The template may trim newlines around both parts (Qwen3 does); it must keep them, in order.
    r_at = body.find(reasoning.strip())
    c_at = body.find(content.strip(), r_at + len(reasoning.strip())) if r_at >= 0 else -1
    if r_at < 0 or c_at < 0:
        return None, "the target's chat template has no place for the reasoning (it renders the turn without it)"
    return body, None


def _retokenize(tokenizer, text: str, finish_reason: str, eos: list[int]) -> tuple[list[int], bool]:
    """The ids as the tokens stage has always built them from text (ids of old caches unchanged)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if finish_reason == "stop" and eos and (not ids or ids[-1] not in eos):
        return ids + [int(eos[0])], True
    return ids, False


def rebuild(tokenizer, eos: list[int], messages: list[dict], enable_thinking: bool, doc: dict) -> Rebuilt:
    """Rebuild and check the ids of a text-only completion document (``text``, ``finish_reason``,
    ``completion_tokens``, and ``reasoning_content`` when a reasoning parser split it)."""
    text = doc.get("text") or ""
    reasoning = reasoning_of(doc)
    if reasoning is not None:
        text, why = put_back(tokenizer, messages, enable_thinking, reasoning, text)
        if text is None:
            return Rebuilt(None, False, None, f"its reasoning_content cannot be put back: {why}", False)
    ids, eos_appended = _retokenize(tokenizer, text, doc.get("finish_reason"), eos)
    body = ids[:-1] if eos_appended else ids
    round_trip = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    server = doc.get("completion_tokens")
    server = int(server) if isinstance(server, int) and not isinstance(server, bool) else None
    lossy = text.count(REPLACEMENT)
    problems = []
    if server is None:
        problems.append("the server gave no usage.completion_tokens to check the count against")
    elif server != len(ids):
        problems.append(f"the server counted {server} completion tokens, the text retokenizes to {len(ids)}"
                        + (" (with the stop token)" if eos_appended else ""))
    if not round_trip:
        problems.append("decoding the rebuilt ids does not give the text back")
    if lossy:
        problems.append(f"the text holds {lossy} U+FFFD (bytes the server could not decode)")
    problem = "; ".join(problems) or None
    check = {"ok": problem is None, "ids": len(ids), "server_count": server, "round_trip": round_trip,
             "problem": problem, "replacement_chars": lossy, "reasoning_put_back": reasoning is not None}
    return Rebuilt(ids, eos_appended, check, problem, True)


def _squeeze(text: str) -> str:
    return _SPACE.sub("", text.replace(REPLACEMENT, ""))


def server_ids_problem(tokenizer, ids: list[int], doc: dict) -> str | None:
    """Why a server's ids disagree with its own text, or None when they agree.

    The ids are decoded as a server decodes them (special tokens skipped) and must hold the text
    (and the reasoning, when split off) in order. Whitespace and U+FFFD are left out of the
    comparison: detokenizers differ there (incremental decoding holds back a partial character,
    ``transformers serve`` trims the content) without the ids being wrong.
    """
    if any(i < 0 or i >= 2**31 for i in ids):
        return "its token ids include values no tokenizer has (negative or beyond int32)"
    try:
        decoded = _squeeze(tokenizer.decode(ids, skip_special_tokens=True))
    except (OverflowError, ValueError, TypeError) as e:  # what the tokenizer makes of ids it cannot take
        return f"its token ids cannot be decoded by the target's tokenizer ({type(e).__name__}: {e})"[:300]
    at = 0
    for part in (reasoning_of(doc), doc.get("text")):
        part = _squeeze(part or "")
        if not part:
            continue
        found = decoded.find(part, at)
        if found < 0:
            return (f"its {len(ids)} token ids decode to text that does not hold the server's own text "
                    f"({decoded[:40]!r}... against {part[:40]!r}...)")
        at = found + len(part)
    return None


# ----------------------------------------------------------------------------- refusal


EXACT_FIXES = ("for exact ids use --server-api sglang (SGLang's native /generate returns them), a vLLM server "
               "(dfcache asks it for its ids), or --completions local")


def refusal(refused: list[dict], *, total: int, stage: str, accepted_hint: bool = True) -> CompletionIdsRefused:
    """One exit-6 error for every refused sample of a run: the prompt ids, the counts, the fixes.

    ``refused``: dicts with ``id``, ``problem``, ``acceptable``. ``stage``: ``completions`` (the
    answers were not cached), ``tokens`` (stored completions whose ids were not made) or ``use``
    (stored tokens a run would compute hidden states or evals from)."""
    n = len(refused)
    shown = "; ".join(f"{r['id']!r}: {r['problem']}" for r in refused[:8])
    more = f"; and {n - 8} more" if n > 8 else ""
    if stage == "completions":
        kept = f" (the other {total - n} were)" if total > n else ""
        problem = (f"{n} of the {total} completion(s) fetched are refused, so nothing was cached for them{kept}: "
                   f"{shown}{more}.")
    elif stage == "tokens":
        kept = " (the others' were)" if total > n else ""
        problem = (f"the stored completions of {n} of {total} prompt(s) have no token ids that can be shown to be "
                   f"the target's, so their tokens were not made{kept}: {shown}{more}.")
    else:
        problem = (f"{n} of {total} stored sample(s) this run would compute from have token ids rebuilt from text "
                   f"that are not verified, so nothing was computed: {shown}{more}.")
    acceptable = [r for r in refused if r["acceptable"]]
    fixes = [EXACT_FIXES[0].upper() + EXACT_FIXES[1:]]
    if stage != "completions":
        fixes[0] += " (these samples are stored: completions from another source are other samples, made anew)"
    if acceptable and accepted_hint:
        which = "these samples" if len(acceptable) == n else \
            f"the {len(acceptable)} whose check failed ({', '.join(repr(r['id']) for r in acceptable[:8])})"
        fixes.append(f"or pass --accept-retokenized to keep {which}, marked \"retokenized, unverified "
                     "(accepted)\" in every report row")
    others = [r for r in refused if not r["acceptable"]]
    if others:
        fixes.append("ids that disagree with the server's text, or reasoning the chat template cannot put back, "
                     "are never kept: check the server (its --reasoning-parser, its tokenizer) against the target")
    return CompletionIdsRefused(problem, refused, fix="; ".join(fixes) + ".")
