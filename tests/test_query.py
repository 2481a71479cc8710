"""`ls --where` / `gc --where`: provenance queries over a real store's manifests."""

from __future__ import annotations

import json

import pytest

from cli_util import dfcache
from dfcache import compute_key, open_store
from dfcache.errors import EXIT_USAGE, UsageError
from dfcache.query import matches, parse_where

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")

H100 = {"versions": {"torch": "2.13.0", "transformers": "5.24.0", "flash-linear-attention": "0.6.0"},
        "gpu": "NVIDIA H100 80GB HBM3", "torch_cuda": "12.8"}
H200 = {"versions": {"torch": "2.13.0", "transformers": "5.25.1", "flash-linear-attention": "0.10.0"},
        "gpu": "NVIDIA H200", "torch_cuda": "13.0"}
CPU = {"versions": {"torch": "2.13.0", "transformers": "5.24.0"}}


def put(store, name, provenance, kernel):
    inputs = {"name": name, "backend": {"kernel": kernel, "device": "cuda" if "gpu" in provenance else "cpu",
                                        "dtype": "bfloat16", "attn_implementation": "sdpa"}}
    key = compute_key("hidden_states", 1, inputs, {})
    with store.writer(key, stage="hidden_states", stage_version=1, inputs=inputs, upstream={},
                      provenance=provenance) as w:
        w.put_json("x", {"n": name})
    return key


@pytest.fixture()
def store(tmp_path):
    s = open_store(tmp_path / "store")
    keys = {"h100": put(s, "h100", H100, "fla"), "h200": put(s, "h200", H200, "fla"), "cpu": put(s, "cpu", CPU, "torch")}
    return tmp_path / "store", keys


def ls_keys(path, *where):
    args = ["ls", "--json"] + [a for w in where for a in ("--where", w)]
    r = dfcache(*args, store=path)
    assert r.code == 0, r.err
    return {row["key"] for row in json.loads(r.out)}


def test_ls_where_versions_and_hardware(store):
    path, k = store
    assert ls_keys(path, "fla<0.7") == {k["h100"]}            # the CPU states record no fla version
    assert ls_keys(path, "fla>=0.7") == {k["h200"]}           # version order: 0.10 > 0.7
    assert ls_keys(path, "gpu~h100") == {k["h100"]}
    assert ls_keys(path, "transformers==5.24") == {k["h100"], k["cpu"]}  # 5.24 == 5.24.0
    assert ls_keys(path, "transformers<5.25", "kernel=fla") == {k["h100"]}
    assert ls_keys(path, "cuda>=13") == {k["h200"]}
    assert ls_keys(path, "provenance.versions.torch=2.13.0") == set(k.values())
    assert ls_keys(path, "fla<0.7", "gpu~H200") == set()


def test_bad_where_is_a_usage_error(store):
    path, _ = store
    r = dfcache("ls", "--where", "fla", store=path)
    assert r.code == EXIT_USAGE and "FIELD OP VALUE" in r.err and "Traceback" not in r.err
    with pytest.raises(UsageError):
        parse_where("<0.7")
    assert parse_where("gpu ~ H100") == parse_where("gpu~H100")


def test_gc_where_dry_run_then_yes(store):
    path, k = store
    r = dfcache("gc", "--where", "fla<0.7", "--dry-run", "--json", store=path)
    assert r.code == 0, r.err
    assert [i["name"] for i in json.loads(r.out)["items"]] == [k["h100"]]
    assert ls_keys(path) == set(k.values())                   # a dry run removes nothing
    r = dfcache("gc", "--where", "fla<0.7", "--stage", "hidden_states", "--yes", store=path)
    assert r.code == 0, r.err
    assert ls_keys(path) == {k["h200"], k["cpu"]}


def test_missing_field_never_matches():
    m = {"stage": "hidden_states", "inputs": {}, "provenance": CPU}
    assert not matches(m, parse_where("fla!=0.6.0")) and not matches(m, parse_where("gpu!~H100"))
    assert matches(m, parse_where("stage=hidden_states"))
