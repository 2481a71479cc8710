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


def test_every_error_prints_its_message():
    """str(err) is the message for every class: DfcacheError.__str__ comes first in each one's MRO
    (a KeyError would quote it, an OSError would prefix an errno)."""
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.DfcacheError)]
    for cls in classes:
        assert str(cls("the key 'x' is bad.")) == "the key 'x' is bad.", cls.__name__


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


# --------------------------------------------------------------------------- the import graph


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_statements(tree: ast.AST):
    """Every import statement, inside functions too, but not under ``if TYPE_CHECKING:`` (never
    run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking(node):
            for sub in node.orelse:
                yield from _import_statements(ast.Module(body=[sub], type_ignores=[]))
        else:
            yield from _import_statements(node)


def _module_graph() -> dict[str, set[str]]:
    """Module of dfcache/ or runner/ -> the modules of either that importing it runs: each one
    it imports, and the packages above that one (their ``__init__`` runs first) other than its
    own."""
    files = {_module_name(p): p for p in PRODUCT}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        for node in _import_statements(_tree(path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if not name or name == mod:
                    continue
                graph[mod].add(name)
                graph[mod] |= {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)} - own - {mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def _a_loop(graph: dict[str, set[str]], comp: frozenset) -> str:
    """One loop through ``comp``, as ``a -> b -> a``, to start reading from."""
    start = min(comp)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                return " -> ".join(paths[v] + [start])
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return ", ".join(sorted(comp))


# The runner's import loops that existed when this test was written. The runner's step of issue 31
# removes them and empties this list; it may only shrink (a loop found that is not inside one of
# these fails the test).
KNOWN_RUNNER_CYCLES = [
    frozenset({"runner.api", "runner.core.concat", "runner.distributed", "runner.peers.import_check", "runner.peers.imports",
               "runner.models.target", "runner.core.pipeline", "runner.core.provenance_keys", "runner.core.samples",
               "runner.stages.completions", "runner.stages.completions.ids", "runner.stages.completions.sources",
               "runner.stages.drafter_eval", "runner.stages.hidden_states", "runner.stages.report",
               "runner.stages.tokens"}),
    frozenset({"runner.commands.run", "runner.commands.peers", "runner.commands.trust", "runner.commands.watch"}),
]


def test_no_import_loops_and_nothing_imports_upward():
    """docs/architecture.md: each layer imports only the one below it, with no loops, hidden or
    not: imports inside functions count (only ``if TYPE_CHECKING:`` blocks, which never run, do
    not), and dfcache/ imports nothing of runner/ (the runner's commands come in by entry point)."""
    graph = _module_graph()
    assert len(graph) > 100 and "dfcache.store._reader" in graph["dfcache.store._store"]
    upward = sorted(f"{m} imports {d}" for m in graph if m.split(".")[0] == "dfcache"
                    for d in graph[m] if d.split(".")[0] == "runner")
    assert upward == [], "dfcache/ knows nothing of the runner: give it an entry point (dfcache/plugins.py)"
    cycles = _cycles(graph)
    in_dfcache = [_a_loop(graph, c) for c in cycles if any(m.split(".")[0] == "dfcache" for m in c)]
    assert in_dfcache == [], "import loops in dfcache/"
    new = [_a_loop(graph, c) for c in cycles if not any(c <= known for known in KNOWN_RUNNER_CYCLES)]
    assert new == [], "new import loops in runner/ (KNOWN_RUNNER_CYCLES may only shrink)"
    gone = [sorted(k)[:3] for k in KNOWN_RUNNER_CYCLES if not any(c & k for c in cycles)]
    assert gone == [], "these loops are gone: delete their entries from KNOWN_RUNNER_CYCLES"


def test_the_import_graph_sees_what_python_runs():
    """The walk counts imports in functions, resolves relative imports and packages, and leaves
    out ``if TYPE_CHECKING:`` blocks: checked on modules whose imports are known."""
    graph = _module_graph()
    # `_local.for_untrusted_reads` imports `_file_remote` inside the method.
    assert "dfcache.store._file_remote" in graph["dfcache.store._local"]
    # `from ..store import CommitOnExit` in a subpackage: the package dfcache.store.
    assert "dfcache.store" in graph["dfcache.samples._segment"]
    # `from . import _diff, _gc, ...` inside a function of dfcache/cli/__init__.py.
    assert {"dfcache.cli._ls", "dfcache.cli._gc"} <= graph["dfcache.cli"]
    # Under `if TYPE_CHECKING:` only.
    assert "dfcache.store._store" not in graph["dfcache.store._writer"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert _a_loop({"a": {"b"}, "b": {"a", "c"}, "c": set()}, frozenset("ab")) == "a -> b -> a"


def test_backends_are_private_to_the_store_package():
    reaching = []
    for path in PRODUCT:
        if _rel(path).startswith("dfcache/store/"):
            continue
        for name in _imports(path):
            if re.match(r"dfcache\.store\._", name):
                reaching.append(f"{_rel(path)}: {name}")
    assert reaching == [], "outside dfcache/store/, use dfcache.store and dfcache.store.format"


def test_public_names_of_the_split_packages_resolve():
    """dfcache.store and dfcache.samples load their modules on first use: every public name
    resolves, to what its module defines."""
    import importlib

    for pkg in ("dfcache.store", "dfcache.samples"):
        mod = importlib.import_module(pkg)
        assert sorted(mod.__all__) == sorted(set(mod.__all__))
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{pkg}.{name}"


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
    store_src = (REPO / "dfcache/store/_reader.py").read_text()
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


def _safetensors(name: str, shape: tuple[int, int], fill: int) -> bytes:
    """A valid safetensors file of one F32 tensor, every byte ``fill`` (planning checks headers)."""
    import json
    import struct

    header = json.dumps({name: {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 4 * shape[0] * shape[1]]}},
                        separators=(",", ":")).encode()
    return struct.pack("<Q", len(header)) + header + bytes([fill]) * (4 * shape[0] * shape[1])


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
    "model.safetensors": _safetensors("model.embed_tokens.weight", (512, 64), 0),
}
_DRAFTER = {
    "config.json": '{"model_type": "dflash", "hidden_size": 64, "block_size": 4, "dflash_config": '
                   '{"target_layer_ids": [0, 2], "mask_token_id": 5, "block_size": 4}}',
    "model.safetensors": _safetensors("fc.weight", (64, 128), 1),
}
PINNED_PLANS = [  # the set key of each node (a per-sample node's covers its partition and every sample key)
    (["--completions", "server", "--server", "http://127.0.0.1:9", "--tree-budget", "4"],
     [("prompts", "518b5ab8232407c0ba3cd76d6d86e497"), ("completions", "5c19e4cfd3eb69ff4b3a802f24c3bebd"),
      ("tokens", "dd2db03a9d3becbe3b870332a4e1fefa"), ("hidden_states", "9540ba095679fef48fab5985e7590297"),
      ("hidden_states", "a8d3e6137146ca2fc2722c1cbcd10d60"), ("drafter_eval", "00dc36d1adf96570f6dcc3e6b6aabd2e"),
      ("report", "d6034e2de46c7afc57874eae510308e9")]),
    (["--completions", "local", "--num-prompts", "2", "--max-new-tokens", "8", "--dtype", "float32",
      "--max-blocks", "3", "--tree-budget", "8", "--tree-budget", "2"],
     [("prompts", "e09e2daa5d6a2c2d0683949e9218f00f"), ("completions", "d57de10d8fe86e7a3a37eea3d3be5e77"),
      ("tokens", "3e285e6ed8545bd6d1eaf0361ef99095"), ("hidden_states", "49e953319727595ed040851c0b152e60"),
      ("hidden_states", "d2dedc96eecbabda06fc073d74ebcbef"), ("drafter_eval", "337f79389ed2e008d54ad9b6a6e80d23"),
      ("report", "3d49dac01d57f94f7b70332212a1de8c")]),
]


@pytest.mark.parametrize("args,keys", PINNED_PLANS, ids=["server", "local"])
def test_plan_keys_are_pinned(args, keys, tmp_path):
    """Every stage's key for fixed model bytes: a refactor of the stages or the store must leave
    them as they are, or every cached artifact would miss. A stage whose output changes on purpose
    bumps its version and updates its keys here (per-sample stages: version 2, drafter_eval 4; report: version 6)."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cli_util import dfcache

    for name, files in (("t", _TARGET), ("d", _DRAFTER)):
        (tmp_path / name).mkdir()
        for fname, text in files.items():
            (tmp_path / name / fname).write_bytes(text if isinstance(text, bytes) else text.encode())
    r = dfcache("plan", "eval", "--target", tmp_path / "t", "--drafter", tmp_path / "d", *args, "--json",
                store=tmp_path / "store", env={"DFCACHE_HOME": str(tmp_path / "home"), "DFCACHE_OFFLINE": "0",
                                                  "HF_HUB_OFFLINE": "0"})  # planning contacts nothing
    assert r.code == 0, r.err
    assert [(n["stage"], n["key"]) for n in json.loads(r.out)] == keys


# ------------------------------------------------------------------------------ runner and CLI


def test_runner_uses_only_public_dfcache():
    bad = []
    for path in sorted((REPO / "runner").rglob("*.py")):
        for name in _imports(path):
            if re.match(r"dfcache(\.\w+)*\._", name):
                bad.append(f"{_rel(path)}: {name}")
        if re.search(r"\.backend\.(root|local_root)\b", path.read_text()):
            bad.append(f"{_rel(path)}: reaches the store's directory (use Store.local_dir)")
    assert bad == []


def test_graph_imports_no_stage_and_stages_are_in_one_table():
    graph = _imports(REPO / "runner/core/graph.py")
    assert not [n for n in graph if "stages" in n or "importlib" in n]
    from runner.core.pipeline import STAGES

    on_disk = {p.stem if p.suffix == ".py" else p.name for p in (REPO / "runner/stages").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert set(STAGES) == on_disk


def test_key_recipes_are_the_docstrings():
    import textwrap

    from runner.core.pipeline import STAGES

    for name, mod in STAGES.items():
        assert mod.KEY.stage == name == mod.NAME and mod.VERSION == mod.KEY.version
        assert textwrap.indent(mod.KEY.describe(), "    ") in mod.__doc__, f"{name}: regenerate its docstring"


def test_key_recipe_refuses_undeclared_inputs():
    from dfcache.errors import InternalError
    from runner.core.graph import KeyRecipe

    recipe = KeyRecipe("demo", 1, inputs={"a": "x", "b": "y"}, upstream={"up": "a key"}, optional=frozenset({"b"}))
    node = recipe.node(inputs={"a": 1}, upstream={"up": "0" * 32}, needs="cpu")
    assert node.key == compute_key("demo", 1, {"a": 1}, {"up": "0" * 32})
    for inputs, upstream in (({"a": 1, "c": 2}, {"up": "0" * 32}), ({"b": 1}, {"up": "0" * 32}), ({"a": 1}, {})):
        with pytest.raises(InternalError) as e:
            recipe.node(inputs=inputs, upstream=upstream, needs="cpu")
        assert e.value.exit_code == 1
    # A per-sample recipe: the partition is compute_key of the same material, each sample
    # sample_key(partition, its upstream sample); set-level and per-sample builders do not mix.
    from dfcache.samples import sample_key

    per = KeyRecipe("demo", 2, inputs={"a": "x"}, upstream={"sample": "a partition"}, sample="upstream sample key")
    node = per.samples(inputs={"a": 1}, upstream_samples=["1" * 32, "2" * 32], partition_upstream={"sample": "0" * 32},
                       ids=["p1", "p2"], needs="cpu")
    part = compute_key("demo", 2, {"a": 1}, {"sample": "0" * 32})
    assert node.partition.key == part and node.sample_keys == [sample_key(part, "1" * 32), sample_key(part, "2" * 32)]
    assert "sample    = sample_key(partition, upstream sample key)" in per.describe()
    for call in (lambda: per.samples(inputs={"a": 1, "z": 0}, upstream_samples=[], partition_upstream={"sample": "0"},
                                     ids=[], needs="cpu"),
                 lambda: per.node(inputs={"a": 1}, upstream={"sample": "0" * 32}, needs="cpu"),
                 lambda: recipe.samples(inputs={"a": 1}, upstream_samples=[], partition_upstream={"up": "0"}, ids=[],
                                        needs="cpu")):
        with pytest.raises(InternalError):
            call()


def _cli_without_entry_points(*argv: str, plugin: str | None = None):
    import subprocess
    import sys

    code = ("import importlib.metadata as md, sys\n"
            f"eps = [md.EntryPoint('p', {plugin!r}, 'dfcache.commands')] if {plugin!r} else []\n"
            "md.entry_points = lambda **kw: eps\n"
            "from dfcache.cli import main\n"
            f"sys.exit(main({list(argv)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_run_and_plan_exist_without_an_installed_entry_point():
    r = _cli_without_entry_points("--help")
    assert r.returncode == 0 and re.search(r"^\s+run\s", r.stdout, re.M) and re.search(r"^\s+plan\s", r.stdout, re.M)


def test_a_broken_plugin_is_never_dropped_silently(tmp_path):
    from dfcache.store import open_store

    open_store(tmp_path / "s")  # (`ls` creates no store)
    r = _cli_without_entry_points("--store", str(tmp_path / "s"), "ls", plugin="dfcache_no_such_plugin:register")
    assert r.returncode == 0 and "warning: command plugin dfcache_no_such_plugin:register failed to load" in r.stderr
    r = _cli_without_entry_points("frobnicate", plugin="dfcache_no_such_plugin:register")
    assert r.returncode == 1 and "error: command plugin dfcache_no_such_plugin:register failed" in r.stderr
