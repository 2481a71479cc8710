"""One-line summaries of what an artifact came from, for `dfcache ls` (manifest ``summary``).

Hidden states of two prompt sets look the same by layer and backend; their summary says which
prompt set, completion source and served model they were made from, read from the upstream
manifests already in the store when the artifact is committed."""

from __future__ import annotations

from pathlib import PurePath


def _prompt_set(store, key: str | None) -> str:
    try:
        m = store.manifest(key)
    except Exception:  # a chain pulled without its upstream: say less, never fail a commit
        return "?"
    text = m.summary or ""
    n, _, spec = text.partition(" prompts from ")
    if not spec:
        return text or "?"
    name = spec if spec.startswith("builtin:") else PurePath(spec).name
    return f"{name}×{n}"


def origin(store, tokens_key: str) -> str:
    """``builtin:coding×8, local greedy`` or ``q.jsonl×100, openai server Qwen3-8B``."""
    try:
        completions_key = store.manifest(tokens_key).upstream["completions"]
    except Exception:
        return "tokens " + tokens_key[:12]
    return completions_origin(store, completions_key)


def completions_origin(store, completions_key: str) -> str:
    try:
        comp = store.manifest(completions_key)
    except Exception:
        return "completions " + completions_key[:12]
    prompts = _prompt_set(store, comp.upstream.get("prompts"))
    endpoint = comp.inputs.get("endpoint")
    if endpoint == "local":
        source = "local greedy"
    else:
        model = comp.provenance.get("served_model") or comp.inputs.get("served_model")
        source = f"{endpoint} server" + (f" {model}" if model else "")
    return f"{prompts}, {source}"
