"""The tokens stage, keys of completions/tokens, target resolution, and planning without torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from servers import run_pipeline

from dfcache import open_store
from dfcache.errors import EXIT_BAD_INPUT, ModelNotFoundError, UsageError
from runner.core.graph import RunContext
from runner.models.resolve import resolve_target
from runner.core.options import EvalOptions
from runner.core.pipeline import build_graph
from runner.stages.completions import read_completions
from runner.stages.prompts import load_records
from runner.stages.tokens import read_tokens

ROOT = Path(__file__).resolve().parents[1]


def _local(target, **kw):
    opts = dict(target=str(target), completions="local", num_prompts=3, max_new_tokens=10,
                dtype="float32", device="cpu")
    opts.update(kw)
    return opts


def _plan(store, **opts):
    ctx = RunContext(open_store(store), EvalOptions(progress=False, **opts), argv=[])
    return {n.stage: n for n in build_graph(ctx, upto="tokens")}


@pytest.fixture(scope="module")
def local_tokens(tiny_target, tmp_path_factory):
    """A store holding local completions and their tokens, produced once."""
    store = tmp_path_factory.mktemp("tokens") / "store"
    ctx, nodes = run_pipeline(store, "tokens", **_local(tiny_target))
    return store, ctx, nodes


def test_tokens_are_chat_template_prompt_plus_completion(tiny_target, local_tokens):
    from transformers import AutoTokenizer

    _, ctx, nodes = local_tokens
    toks = read_tokens(ctx.store, nodes["tokens"])
    comps = read_completions(ctx.store, nodes["completions"])
    n = len(comps)
    assert len(toks) == n == 3
    assert toks.token_ids.dtype == np.int32 and toks.offsets.dtype == np.int64
    assert toks.prompt_lens.dtype == np.int32
    assert toks.offsets[0] == 0 and toks.offsets[-1] == len(toks.token_ids)
    assert np.array_equal(np.diff(toks.offsets), toks.prompt_lens + toks.completion_lens)
    assert toks.sample_ids == [c.id for c in comps]
    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    for i, rec in enumerate(load_records("builtin:coding")[:n]):
        text = tok.apply_chat_template(rec["messages"], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
        assert toks.prompt(i).tolist() == tok(text).input_ids
        assert toks.prompt(i).tolist() == tok.apply_chat_template(
            rec["messages"], add_generation_prompt=True, return_dict=True)["input_ids"]
        assert toks.completion(i).tolist() == comps[i].token_ids  # local ids are used as given
    from dfcache.samples import SampleSet

    samples = SampleSet(ctx.store, nodes["tokens"].partition.key, nodes["tokens"].sample_keys).docs()
    assert [s["tokens_source"] for s in samples] == ["local"] * n
    assert nodes["tokens"].spec.target_dir == str(Path(tiny_target).absolute())
    assert nodes["tokens"].inputs["target"] == nodes["completions"].inputs["target"]


def test_a_fully_cached_run_imports_neither_torch_nor_transformers(tiny_target, local_tokens):
    store = local_tokens[0]
    code = (
        "import sys, json; sys.path[:0] = [%r, %r]\n"
        "from servers import run_pipeline\n"
        "ctx, nodes = run_pipeline(%r, 'tokens', **json.loads(%r))\n"
        "assert ctx.work_done == [], ctx.work_done\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'transformers')}))\n"
    ) % (str(ROOT), str(ROOT / "tests"), str(store), json.dumps(_local(tiny_target)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"torch": False, "transformers": False}


def test_keys_cover_what_changes_the_bytes_and_not_the_url(tiny_target, tmp_path):
    store = tmp_path / "store"
    srv = dict(target=str(tiny_target), completions="server", server="http://a:1", num_prompts=3)
    base = _plan(store, **srv)
    assert _plan(store, **{**srv, "server": "http://b:2/v1"})["completions"].key == base["completions"].key
    for change in ({"completions": "local"}, {"server_api": "sglang"}, {"temperature": 0.5},
                   {"top_p": 0.9}, {"max_new_tokens": 12}, {"seed": 1}, {"enable_thinking": True},
                   {"served_model": "m"}, {"num_prompts": 2}):
        other = _plan(store, **{**srv, **change})
        assert other["completions"].key != base["completions"].key, change
        assert other["tokens"].key != base["tokens"].key, change
    assert base["completions"].needs == "network" and base["completions"].contacts == "http://a:1"
    assert _plan(store, **_local(tiny_target))["completions"].needs == "cpu"
    assert _plan(store, **_local(tiny_target, dtype="bfloat16"))["completions"].key != \
        _plan(store, **_local(tiny_target))["completions"].key
    with pytest.raises(UsageError, match="greedy"):
        _plan(store, **_local(tiny_target, temperature=0.7))
    with pytest.raises(UsageError, match="--server"):
        _plan(store, **{**srv, "server": None})


def test_target_from_the_local_hub_cache_never_downloads(tiny_target, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen"
    shutil.copytree(tiny_target, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_target("tiny-org/tiny-qwen") == repo / "snapshots" / commit
    assert resolve_target("tiny-org/tiny-qwen", commit) == repo / "snapshots" / commit
    # Same content in another place: same keys.
    by_id = _plan(tmp_path / "store", **_local("tiny-org/tiny-qwen"))
    by_dir = _plan(tmp_path / "store", **_local(tiny_target))
    assert by_id["tokens"].key == by_dir["tokens"].key
    with pytest.raises(ModelNotFoundError) as e:
        resolve_target("tiny-org/tiny-qwen", "dev")
    assert str(repo / "refs" / "dev") in str(e.value) and "never downloads" in str(e.value)
    assert e.value.exit_code == EXIT_BAD_INPUT
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "home" / "hub")):
        resolve_target("tiny-org/tiny-qwen")
