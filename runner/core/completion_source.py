"""Where a sample's completion ids came from, in the words every report row uses.

The tokens stage records, per sample, ``tokens_source`` (``server`` | ``local`` |
``retokenized``) and, for ids rebuilt from the completion's text, ``ids_check``: the facts of
the check made when they were rebuilt (``{"ok": bool, "ids": n, "server_count": m | None,
"round_trip": bool, "problem": str | None, "replacement_chars": k, "reasoning_put_back": bool}``;
runner/stages/completions/ids.py makes them). A text-only completions sample carries the same
``ids_check`` (the completions stage checks before it caches), so ``label_of`` reads either kind
of document. Whether a run may use a sample whose check failed is decided when results are used
or shown (``--accept-retokenized``), never stored: see DESIGN.md, trust rules. Without the flag
a run refuses them where it computes from them (exit 6): the completions stage does not cache
them, the tokens stage does not make their ids, and a run computing hidden states or evals from
stored tokens stops before it does (runner/stages/tokens.py ``check_use``).

Labels (docs/metrics.md "Where completions come from"):

``server ids``                           the server returned the ids it generated (vLLM asked
                                         with return_token_ids or logprobs as token ids, SGLang's
                                         native output_ids), checked against its own text
``local greedy``                         greedy generation on this machine
``retokenized, verified``                text only; the rebuilt ids passed every check
``retokenized, unverified (accepted)``   text only; a check failed, kept by --accept-retokenized
``retokenized, unchecked``               text only, cached before checks existed

Documents of other origins (``dfcache import``: ``tokens_source`` ``"imported from <format>"``)
have no label of their own here; ``label_of`` gives them ``retokenized, unchecked``.
"""

from __future__ import annotations

SERVER = "server ids"
LOCAL = "local greedy"
VERIFIED = "retokenized, verified"
ACCEPTED = "retokenized, unverified (accepted)"
UNCHECKED = "retokenized, unchecked"
IMPORTED = "imported"
LABELS = (SERVER, LOCAL, VERIFIED, ACCEPTED, UNCHECKED, IMPORTED)
EXACT = frozenset({SERVER, LOCAL})  # ids the target generated, as it generated them


def label_of(doc: dict) -> str:
    """The label of one tokens (or completions) sample document."""
    source = doc.get("tokens_source")
    if source == "server":
        return SERVER
    if source == "local":
        return LOCAL
    if isinstance(source, str) and source.startswith("imported"):
        return IMPORTED  # tokens_source "imported from specforge" and the like (runner/peers/imports.py)
    check = doc.get("ids_check")
    if not isinstance(check, dict):
        return UNCHECKED
    return VERIFIED if check.get("ok") else ACCEPTED
