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


def prompt_set_name(prompts_node) -> str:
    """``builtin:coding×8`` or ``q.jsonl×100``: the prompt set a per-sample prompts node was
    built from (its summary says ``8 prompts from builtin:coding``), as summaries name it."""
    text = getattr(prompts_node, "summary", "") or ""
    n, _, spec = text.partition(" prompts from ")
    if not spec:
        return text or "?"
    return f"{spec if spec.startswith('builtin:') else PurePath(spec).name}×{n}"


def samples_origin(store, completions_node) -> str:
    """:func:`completions_origin` of a per-sample completions node: the prompt set from its prompts
    node, the served model from a stored completion's provenance (what the server said it was)."""
    if completions_node is None:
        return "?"
    prompts = getattr(completions_node.spec, "prompts", None)
    set_name = prompt_set_name(prompts)
    endpoint = completions_node.inputs.get("endpoint")
    if endpoint == "local":
        return f"{set_name}, local greedy"
    model = None
    try:
        from dfcache.samples import SampleSet

        seg, _ = SampleSet(store, completions_node.partition.key, completions_node.sample_keys[:1]).segment(0)
        model = seg.artifact.manifest.provenance.get("served_model")
    except Exception:  # not stored yet, or pulled without it: say less, never fail a commit
        pass
    model = model or completions_node.inputs.get("served_model")
    return f"{set_name}, {endpoint} server" + (f" {model}" if model else "")
