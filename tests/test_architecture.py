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
