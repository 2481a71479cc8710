"""Opt-in version keying and the attention implementation as key material, checked on planned keys."""

from __future__ import annotations

import importlib.metadata

import pytest

from dfcache import open_store
from dfcache.errors import UsageError
from runner.core.graph import RunContext
from runner.core.options import EvalOptions
from runner.core.pipeline import build_graph
from runner.core.provenance_keys import parse_key_versions


def hs_nodes(store, target, **kw):
    opts = EvalOptions(target=str(target), layers=[1, 3], backend="torch", device="cpu", dtype="float32",
                       num_prompts=1, max_new_tokens=4, **kw)
    return [n for n in build_graph(RunContext(store, opts, argv=[]), "hidden-states") if n.stage == "hidden_states"]


def test_key_versions_are_opt_in_and_change_only_hidden_state_keys(tiny_target, tmp_path):
    store = open_store(tmp_path / "s")
    plain = hs_nodes(store, tiny_target)
    assert all("versions" not in n.inputs for n in plain)
    keyed = hs_nodes(store, tiny_target, key_versions=parse_key_versions("fla,transformers"))
    tf = importlib.metadata.version("transformers")
    for a, b in zip(plain, keyed):
        assert a.key != b.key and a.upstream == b.upstream  # same tokens, new states key
        assert b.inputs["versions"]["transformers"] == tf
        assert set(b.inputs["versions"]) == {"flash-linear-attention", "transformers"}
    eager = hs_nodes(store, tiny_target, attn_implementation="eager")
    assert {n.inputs["backend"]["attn_implementation"] for n in eager} == {"eager"}
    assert not {n.key for n in eager} & {n.key for n in plain}


def test_unknown_key_version_package_is_a_usage_error():
    assert parse_key_versions(" Transformers, fla ,fla") == ["flash-linear-attention", "transformers"]
    with pytest.raises(UsageError, match="unknown package 'numpyy'"):
        parse_key_versions("numpyy")
