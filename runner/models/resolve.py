"""Resolve ``--target`` to a local model directory, and read what keys need from it.

A target is a local directory, or a Hugging Face id looked up in the local hub cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``)::

    models--<org>--<name>/refs/<branch>          holds the commit hash
    models--<org>--<name>/snapshots/<commit>/    the files of that commit

Nothing is ever downloaded: a model that is not there is a :class:`ModelNotFoundError`
(exit 6) that says where dfcache looked and how to fetch it.

Everything here reads files as text or JSON and never imports torch or transformers, because
planning (``build``) uses it and a fully cached run must not pay for those imports.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dfcache.config import hub_cache_dir
from dfcache.errors import BadInputError, ModelNotFoundError, UsageError
from dfcache.keys import canonical_encode, fingerprint_path, fingerprint_text, hash_file

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
# Files that decide how text becomes ids (and back). Weights and config are left out, so that a
# fine-tuned model with the same tokenizer shares token artifacts.
_TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|.*\.model|"
    r"chat_template.*)$")


def _hub_snapshot(repo_id: str, revision: str | None) -> tuple[Path | None, list[str]]:
    """The snapshot directory of ``repo_id`` at ``revision`` in the hub cache, and where we looked."""
    cache = hub_cache_dir()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    looked = []
    if _COMMIT.match(rev):
        snap = repo_dir / "snapshots" / rev
        looked.append(str(snap))
        return (snap if snap.is_dir() else None), looked
    ref = repo_dir / "refs" / rev
    looked.append(str(ref))
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None, looked
    snap = repo_dir / "snapshots" / commit
    looked.append(str(snap))
    return (snap if snap.is_dir() else None), looked


def resolve_target(target: str | None, revision: str | None = None) -> Path:
    """The absolute local directory of ``--target`` (a directory or a cached Hugging Face id).

    Raises:
        UsageError: no target given, or a revision given with a local directory.
        ModelNotFoundError: neither a directory nor in the local hub cache.
    """
    if not target:
        raise UsageError("no target model: pass --target with a local model directory or a Hugging "
                         "Face id that is in the local cache (e.g. --target Qwen/Qwen3-8B).")
    path = Path(target).expanduser()
    if path.is_dir():
        if revision:
            raise UsageError(f"--revision {revision} applies to a Hugging Face id, but --target "
                             f"{target} is a local directory; drop --revision.")
        return path.absolute()
    if path.exists():
        raise BadInputError(f"--target {target} is a file; pass the model directory that holds "
                            "config.json and the weights.")
    if not _REPO_ID.match(target) or target.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model directory {target} does not exist; pass an existing directory "
                                 "or a Hugging Face id (org/name) with --target.")
    snap, looked = _hub_snapshot(target, revision)
    if snap is None:
        rev = revision or "main"
        raise ModelNotFoundError(
            f"model {target} (revision {rev}) is neither a local directory nor in the local Hugging "
            f"Face cache (looked at {', '.join(looked)}). dfcache never downloads models: fetch it "
            f"first with `hf download {target} --revision {rev}` (or set HF_HUB_CACHE / HF_HOME to the "
            "cache that has it), or pass a local directory with --target.")
    return snap


def check_config_object(model_dir: Path) -> None:
    """A ``config.json`` that is there must be one JSON object (an array, or JSON nested past the
    parser's depth, failed later as an internal error); a missing one is the stages' business."""
    f = model_dir / "config.json"
    try:
        raw = f.read_bytes() if f.is_file() else None
    except OSError as e:
        raise BadInputError(f"{f} cannot be read ({e.strerror}); fix its permissions or re-download the model.") from None
    if raw is None:
        return
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadInputError(f"{f} is not valid JSON ({e}); repair or re-download the model.") from None
    if not isinstance(cfg, dict):
        from ..core.values import json_kind

        raise BadInputError(f"{f} is a JSON {json_kind(cfg)}, not an object; a model's config.json is one "
                            "object of its settings: repair or re-download the model.")


def context_window(model_dir: Path) -> int | None:
    """The context window of the model: ``max_position_embeddings`` of its config.json (its
    ``text_config`` first), times a RoPE scaling factor where there is one; None if unknown."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    n = text.get("max_position_embeddings", cfg.get("max_position_embeddings"))
    if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
        return None
    # RoPE scaling (YaRN and the like) stretches the window past max_position_embeddings: never
    # refuse what a server may serve (transformers 5 calls it rope_parameters).
    for name in ("rope_scaling", "rope_parameters"):
        rope = text.get(name, cfg.get(name))
        factor = rope.get("factor") if isinstance(rope, dict) else None
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
            n = max(n, int(n * factor))
    return n


_WEIGHT_FILES = re.compile(r"^(.*\.safetensors|pytorch_model.*\.bin|.*\.safetensors\.index\.json)$")


def require_weights(model_dir: str | os.PathLike, why: str) -> None:
    """Refuse, before any work, a model directory that has no weight files when the run must
    load the model (a directory with only config and tokenizer is enough for tokens)."""
    d = Path(model_dir)
    if not any(f.is_file() and _WEIGHT_FILES.match(f.name) for f in d.iterdir()):
        raise BadInputError(f"model {d} has no weights (no *.safetensors or pytorch_model*.bin file); {why}")
    check_weight_files(d, f"model {d}", "re-download or re-save the model's weights into that directory.")


_SAFETENSORS_HEADER_MAX = 100 << 20  # safetensors itself refuses headers over 100 MB


def check_safetensors(path: str | os.PathLike, owner: str, fix: str) -> None:
    """Read a ``.safetensors`` file's header (8-byte length + JSON) and check that it describes
    the file: a truncated, overwritten or non-safetensors file is a :class:`BadInputError` naming
    it, before any stage does work (loading it later died with ``SafetensorError``, exit 1).
    Reads only the header, never the tensors."""
    import struct

    f = Path(path)
    size = f.stat().st_size

    def bad(why: str) -> BadInputError:
        return BadInputError(f"{owner}: {f} is not a valid safetensors file ({why}); {fix}")

    if size < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n < 2 or n > min(_SAFETENSORS_HEADER_MAX, size - 8):
            raise bad(f"the header length field says {n} bytes, the file has {size}")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise bad(f"its tensors need {8 + n + end} bytes, the file has {size} (truncated?)")


def check_weight_files(model_dir: str | os.PathLike, owner: str, fix: str) -> None:
    """:func:`check_safetensors` for every ``*.safetensors`` file of a model directory."""
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        check_safetensors(f, owner, fix)


def chat_template_text(model_dir: str | os.PathLike) -> str:
    """The chat template as stored in the model directory (text, not rendered).

    Looks at ``chat_template.jinja`` (transformers ≥ 4.43 writes it), ``chat_template.json``
    (processors), then the ``chat_template`` field of ``tokenizer_config.json`` (a string, or a
    list of named templates: all of them are returned, canonically encoded).
    """
    d = Path(model_dir)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = d / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BadInputError(f"{f} cannot be read as JSON ({e}); repair or replace the file.") from None
        tmpl = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(tmpl, str) and tmpl:
            return tmpl
        if isinstance(tmpl, list) and tmpl:
            return canonical_encode(tmpl).decode()
    raise BadInputError(f"model {d} has no chat template (looked at chat_template.jinja, "
                        "chat_template.json and tokenizer_config.json); use a chat/instruct model or "
                        "add its template as chat_template.jinja.")


def check_chat_template(model_dir: str | os.PathLike) -> None:
    """Compile the chat template as transformers does (a sandboxed jinja2 environment with loop
    controls and its ``{% generation %}`` tag), so that a template with a syntax error is one
    :class:`BadInputError` before any work (rendering it later died with TemplateSyntaxError,
    exit 1). Runs where a stage will render it: local completions, tokens."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):  # transformers' AssistantTracker tag, parsed and ignored here
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    text = chat_template_text(model_dir)
    try:
        templates = json.loads(text) if text.startswith("[") else [{"template": text}]
        if not isinstance(templates, list):
            templates = [{"template": text}]
    except ValueError:
        templates = [{"template": text}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    for t in templates:
        source = t.get("template") if isinstance(t, dict) else None
        if not isinstance(source, str):
            continue
        try:
            env.parse(source)
        except jinja2.TemplateSyntaxError as e:
            name = f" {t['name']!r}" if isinstance(t, dict) and t.get("name") else ""
            raise BadInputError(f"the chat template{name} of {Path(model_dir)} has a syntax error (line {e.lineno}: "
                                f"{e.message}); fix chat_template.jinja (or the chat_template of "
                                "tokenizer_config.json), or restore the model's original template.") from None


def chat_template_hash(model_dir: str | os.PathLike) -> str:
    return fingerprint_text(chat_template_text(model_dir))


def tokenizer_fingerprint(model_dir: str | os.PathLike) -> str:
    """xxh3-128 over the names and contents of the tokenizer files in ``model_dir``."""
    d = Path(model_dir)
    entries = {f.name: hash_file(f) for f in sorted(d.iterdir())
               if f.is_file() and _TOKENIZER_FILES.match(f.name)}
    if not any(n.startswith("tokenizer") for n in entries):
        raise BadInputError(f"model {d} has no tokenizer files (tokenizer.json, tokenizer_config.json); "
                            "pass a model directory that includes its tokenizer.")
    # tokenizer_config.json alone says which tokenizer class to build, not its vocabulary: without
    # tokenizer.json or the vocabulary files transformers fails (many lines, late, after a stage
    # has opened its writer). Checked here, at planning.
    vocab = ("tokenizer.json" in entries or any(n.endswith(".model") for n in entries) or "vocab.txt" in entries
             or {"vocab.json", "merges.txt"} <= set(entries))
    if not vocab:
        raise BadInputError(f"model {d} has {', '.join(sorted(n for n in entries if n.startswith('tokenizer')))} "
                            "but no tokenizer.json (nor vocab.json + merges.txt, vocab.txt or a "
                            "sentencepiece *.model), so its tokenizer cannot be built; copy tokenizer.json "
                            f"from the original model into {d}.")
    return fingerprint_text(canonical_encode(entries).decode())


def eos_token_ids(model_dir: str | os.PathLike) -> list[int]:
    """End-of-sequence ids as generation uses them: generation_config.json, else config.json."""
    d = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        try:
            data = json.loads((d / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        eos = data.get("eos_token_id")
        if eos is None and isinstance(data.get("text_config"), dict):
            eos = data["text_config"].get("eos_token_id")
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list) and eos:
            return [int(x) for x in eos]
    return []


@dataclass(frozen=True)
class ResolvedTarget:
    """A target resolved for keying: where it is (never keyed) and what it is (keyed)."""

    dir: Path
    fingerprint: str
    chat_template_hash: str
    tokenizer_fingerprint: str


def resolved_target(ctx) -> ResolvedTarget:
    """Resolve and fingerprint ``ctx.options.target`` once per run (cached in ``ctx.cache``)."""
    opts = ctx.options
    cache_key = (opts.target, opts.target_revision)
    hit = ctx.cache.resolved_targets.get(cache_key)
    if hit is None:
        d = resolve_target(opts.target, opts.target_revision)
        check_config_object(d)
        hit = ResolvedTarget(dir=d, fingerprint=fingerprint_path(d), chat_template_hash=chat_template_hash(d),
                             tokenizer_fingerprint=tokenizer_fingerprint(d))
        ctx.cache.resolved_targets[cache_key] = hit
    return hit
