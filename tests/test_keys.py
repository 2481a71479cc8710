"""Keys: canonical, stable across processes and dict orders, sensitive to every input."""

import os
import subprocess
import sys

import pytest

from dfcache.keys import KeyMaterialError, canonical_encode, compute_key, fingerprint_path

INPUTS = {"target": "ab" * 16, "layer": 3, "backend": {"kernel": "torch", "device": "cpu", "dtype": "bfloat16"},
          "temperature": 0.0, "seed": None, "budgets": [4, 16], "thinking": False}


def test_dict_order_does_not_matter():
    shuffled = dict(reversed(list(INPUTS.items())))
    shuffled["backend"] = dict(reversed(list(INPUTS["backend"].items())))
    assert compute_key("s", 1, INPUTS) == compute_key("s", 1, shuffled)


def test_same_key_in_another_process():
    code = ("from dfcache.keys import compute_key; import json,sys; "
            "print(compute_key('s', 1, json.loads(sys.argv[1])))")
    import json

    out = subprocess.run([sys.executable, "-c", code, json.dumps(INPUTS)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == compute_key("s", 1, INPUTS)


@pytest.mark.parametrize("change", [
    ("layer", 4), ("temperature", 0.5), ("seed", 0), ("budgets", [16, 4]), ("thinking", True),
    ("backend", {"kernel": "fla", "device": "cpu", "dtype": "bfloat16"}), ("target", "cd" * 16),
])
def test_any_changed_input_changes_the_key(change):
    name, value = change
    assert compute_key("s", 1, {**INPUTS, name: value}) != compute_key("s", 1, INPUTS)


def test_stage_version_and_upstream_are_keyed():
    base = compute_key("s", 1, INPUTS)
    assert compute_key("s", 2, INPUTS) != base
    assert compute_key("t", 1, INPUTS) != base
    assert compute_key("s", 1, INPUTS, {"tokens": "0" * 32}) != base
    assert compute_key("s", 1, INPUTS, {"tokens": "0" * 32}) != compute_key("s", 1, INPUTS, {"tokens": "1" * 32})


def test_one_encoding_per_value():
    assert canonical_encode(1) != canonical_encode(1.0)
    assert canonical_encode(True) != canonical_encode(1)
    assert canonical_encode(0.1) == canonical_encode(float("0.1000"))
    assert canonical_encode([1, 2]) == canonical_encode((1, 2))
    assert canonical_encode(None) != canonical_encode("None")


@pytest.mark.parametrize("bad", [
    {"model": "/home/me/models/qwen"}, {"model": "C:\\models\\qwen"}, {"mtime": 123}, {"nested": {"mtime_ns": 1}},
    {"host": "gpu-1"}, {"x": float("nan")}, {"x": float("inf")}, {"x": object()},
])
def test_machine_local_material_refused(bad):
    with pytest.raises(KeyMaterialError):
        compute_key("s", 1, bad)


def test_fingerprint_by_content_not_path(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text('{"x": 1}')
        (tmp_path / d / "model.safetensors").write_bytes(b"\0" * 1000)
        (tmp_path / d / "README.md").write_text(f"card {d}")  # not model content
    assert fingerprint_path(tmp_path / "a") == fingerprint_path(tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").write_bytes(b"\1" + b"\0" * 999)
    assert fingerprint_path(tmp_path / "a") != fingerprint_path(tmp_path / "b")


def test_fingerprint_memoized(tmp_path, monkeypatch):
    monkeypatch.setenv("DFCACHE_HOME", str(tmp_path / "home"))
    import dfcache.keys as keys

    monkeypatch.setattr(keys, "_memo_loaded", None)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(os.urandom(4 << 20))
    hashed = [0]  # bytes fed to the content hash (counted, not timed)
    real = keys.xxhash.xxh3_128

    class Counting:
        def __init__(self, *a):
            self.h = real(*a)

        def update(self, data):
            hashed[0] += len(data)
            self.h.update(data)

        def __getattr__(self, name):
            return getattr(self.h, name)

    monkeypatch.setattr(keys.xxhash, "xxh3_128", Counting)
    first = fingerprint_path(d)
    assert hashed[0] >= 4 << 20
    hashed[0] = 0
    second = fingerprint_path(d)
    assert first == second
    assert hashed[0] < 1 << 20, "the unchanged weights were hashed again"
    # a changed file (new mtime/size) is re-hashed
    (d / "model.safetensors").write_bytes(os.urandom(4 << 20))
    assert fingerprint_path(d) != first and hashed[0] >= 4 << 20


def test_fast_encoders_give_exactly_the_canonical_bytes():
    """keys.py spells the encodings of sample, segment and set keys out for speed: each must be
    the xxh3-128 of canonical_encode of the same material, or every stored sample would miss."""
    import json

    import xxhash

    from dfcache.keys import messages_digest, record_digest, sample_key, sample_keys, segment_key, set_key

    def h(material) -> str:
        return xxhash.xxh3_128_hexdigest(canonical_encode(material))

    import enum

    class Kind(str, enum.Enum):  # a str subclass is keyed as the str it is, whatever its __str__ says
        FLA = "fla/x"

    assert canonical_encode({"k": Kind.FLA}) == canonical_encode({"k": "fla/x"}) == b'{"k":"fla/x"}'
    part, ups = "0f" * 16, [f"{i:032x}" for i in (7, 3, 11)]
    assert sample_key(part, ups[0]) == h({"partition": part, "sample": ups[0]})
    assert sample_keys(part, ups) == [h({"partition": part, "sample": u}) for u in ups]
    inner = xxhash.xxh3_128_hexdigest(",".join(sorted(ups)).encode())
    assert segment_key(part, ups) == h({"partition": part, "segment": inner})
    ordered = xxhash.xxh3_128_hexdigest(",".join(ups).encode())
    assert set_key(part, ups) == h({"partition": part, "set": ordered}) != set_key(part, sorted(ups))
    # Records are plain sorted JSON (a prompt may hold what looks like a path), not key material.
    for messages in ([{"role": "user", "content": 'ünï "q" \\ \n\t\x00 /etc/passwd'}],
                     [{"content": "a", "role": "system"}, {"role": "user", "content": "b"}],
                     [{"role": "user", "content": "x", "name": "n"}],  # another key: the general encoder
                     [{"role": "user", "content": ["a", {"type": "text"}]}], [{"role": "user"}], []):
        want = xxhash.xxh3_128_hexdigest(json.dumps({"messages": messages}, sort_keys=True, separators=(",", ":"),
                                                    ensure_ascii=False, allow_nan=False).encode())
        assert record_digest({"messages": messages}) == messages_digest(messages) == want
