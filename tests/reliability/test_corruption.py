"""Corruption: damage a committed artifact behind dfcache's back, then check that `dfcache verify`
finds it (exit 5, naming it), that reading it fails instead of returning wrong data, that
`dfcache gc --bad --yes` plus a rerun repairs it, and that `dfcache run` refuses a corrupt
upstream artifact with a message naming its key and the `dfcache gc --key ... --yes` fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from children import check_artifact, key_of
from rel_helpers import artifacts_listing, copy_store, has_stage

from dfcache.errors import IntegrityError
from dfcache.store import open_store

SPECS = [{"i": 700 + j, "rows": 1000, "cols": 16, "chunk_rows": 256, "dtype": "float32", "codec": c}
         for j, c in enumerate(["none", "zstd", "none"])]


def art_dir(store: Path, key: str) -> Path:
    return store / "artifacts" / key[:2] / key


def _manifest(store, key):
    return json.loads((art_dir(store, key) / "manifest.json").read_text())


def _write_manifest(store, key, m):
    (art_dir(store, key) / "manifest.json").write_text(json.dumps(m))


def flip_byte(store, key):
    p = art_dir(store, key) / "x/c/1/0"
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x10
    p.write_bytes(bytes(b))


def truncate_chunk(store, key):
    p = art_dir(store, key) / "x/c/2/0"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def empty_chunk(store, key):
    (art_dir(store, key) / "x/c/0/0").write_bytes(b"")


def delete_chunk(store, key):
    (art_dir(store, key) / "x/c/3/0").unlink()


def delete_array_meta(store, key):
    (art_dir(store, key) / "x/zarr.json").unlink()


def edit_document(store, key):
    p = art_dir(store, key) / "blobs/meta.json"
    p.write_bytes(p.read_bytes().replace(b"1000", b"1001"))


def edit_shape_consistently(store, key):
    """One row fewer, nbytes adjusted: the manifest still validates, the chunk count is the same."""
    m = _manifest(store, key)
    a = m["arrays"]["x"]
    a["shape"][0] -= 1
    a["nbytes"] = a["shape"][0] * a["shape"][1] * 4
    _write_manifest(store, key, m)


def edit_shape_only(store, key):
    m = _manifest(store, key)
    m["arrays"]["x"]["shape"] = [1000, 32]
    _write_manifest(store, key, m)


def wrong_dtype_same_size(store, key):
    m = _manifest(store, key)
    m["arrays"]["x"]["dtype"] = "int32"  # float32 → int32: same itemsize, same nbytes, same checksums
    _write_manifest(store, key, m)


def wrong_dtype_other_size(store, key):
    m = _manifest(store, key)
    m["arrays"]["x"]["dtype"] = "float64"
    _write_manifest(store, key, m)


def garbage_manifest(store, key):
    (art_dir(store, key) / "manifest.json").write_bytes(b'{"key": "' + key.encode() + b'", trunc')


def foreign_manifest(store, key):
    other = key_of(SPECS[2])
    shutil.copy(art_dir(store, other) / "manifest.json", art_dir(store, key) / "manifest.json")


def delete_manifest(store, key):
    (art_dir(store, key) / "manifest.json").unlink()


# damage, what verify must say, whether the manifest still validates (the artifact is listed)
DAMAGES = [
    (flip_byte, "chunk 1 of array x", True),
    (truncate_chunk, "chunk 2 of array x", True),
    (empty_chunk, "chunk 0 of array x", True),
    (delete_chunk, "chunk 3 of array x", True),
    (delete_array_meta, "array x: zarr.json is missing", True),
    (edit_document, "document meta", True),
    (edit_shape_consistently, "zarr.json says shape [1000, 16]", True),
    (edit_shape_only, "claims", False),
    (wrong_dtype_same_size, "zarr.json says shape [1000, 16] float32", True),
    (wrong_dtype_other_size, "claims", False),
    (garbage_manifest, "not valid JSON", False),
    (foreign_manifest, "is stored under", False),
    (delete_manifest, None, False),
]


@pytest.fixture(scope="module")
def pristine(zygote, tmp_path_factory):
    store = tmp_path_factory.mktemp("corrupt") / "pristine"
    r = zygote.run("children:writer_job", store, json.dumps({"artifacts": SPECS}))
    assert r.code == 0, r.err
    return store


@pytest.mark.parametrize("damage,words,listed", DAMAGES, ids=[d[0].__name__ for d in DAMAGES])
def test_verify_finds_damage_and_reads_refuse_it(damage, words, listed, pristine, zygote, tmp_path, figures):
    store = tmp_path / "store"
    shutil.copytree(pristine, store)
    key, others = key_of(SPECS[0]), [key_of(s) for s in SPECS[1:]]
    damage(store, key)

    r = zygote.cli("--store", store, "verify")
    ls = zygote.cli("--store", store, "ls", "--json")
    assert ls.code == 0, ls.err
    keys = {row["key"] for row in json.loads(ls.out)}
    if words is None:  # no manifest: no artifact. verify is clean; the key is recomputed
        assert r.code == 0, r.out + r.err
        assert keys == set(others)
        again = zygote.run("children:writer_job", store, json.dumps({"artifacts": SPECS}))
        assert again.code == 0 and f"D {SPECS[0]['i']} {key}" in again.out
        assert check_artifact(open_store(store), SPECS[0]) == []
        figures.record("corruption_cases", **{damage.__name__: "absent: verify clean, not listed, recomputed"})
        return
    assert r.code == 5, f"{damage.__name__}: verify exit {r.code}\n{r.out}\n{r.err}"
    assert f"BAD {key}" in r.out and words in r.out, r.out
    assert not any(f"BAD {o}" in r.out for o in others), r.out
    assert "Traceback" not in r.err and r.err.startswith("error: ") and key[:12] in r.err
    assert "dfcache gc --bad --yes" in r.err
    assert (key in keys) == listed
    one = zygote.cli("--store", store, "verify", key[:10])
    assert one.code == 5 and "Traceback" not in one.err

    # Reading it fails loudly, naming it and the fix; it never returns the damaged bytes as good.
    with pytest.raises(IntegrityError) as e:
        check_artifact(open_store(store), SPECS[0], verify=False)
    assert key in str(e.value) and f"dfcache gc --key {key[:12]} --yes" in str(e.value), str(e.value)
    assert e.value.exit_code == 5

    # The fix the messages give works: gc --bad removes exactly it, and a rerun recomputes it.
    gc = zygote.cli("--store", store, "gc", "--bad", "--yes")
    assert gc.code == 0, gc.err
    assert {row["key"] for row in json.loads(zygote.cli("--store", store, "ls", "--json").out)} == set(others)
    again = zygote.run("children:writer_job", store, json.dumps({"artifacts": SPECS}))
    assert again.code == 0, again.err
    assert zygote.cli("--store", store, "verify").code == 0
    assert all(check_artifact(open_store(store), s) == [] for s in SPECS)
    figures.record("corruption_cases", **{damage.__name__: "verify exit 5, read refused, gc --bad + rerun repaired"})


# ------------------------------------------------------------------------------ runs refuse corrupt inputs


def _flip_chunk(store, key, array):
    p = next((art_dir(store, key) / array / "c").rglob("0"))
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))


def _offsets_as_float(store, key, array="offsets", was="int64"):
    m = _manifest(store, key)
    assert m["arrays"][array]["dtype"] == was
    m["arrays"][array]["dtype"] = "float64" if was == "int64" else "float32"
    _write_manifest(store, key, m)


def _edit_blob(store, key, blob):
    p = art_dir(store, key) / "blobs" / f"{blob}.json"
    p.write_bytes(p.read_bytes().replace(b'"', b"'", 1))


def assert_refused(r, key: str, store: Path, before: list[str]) -> None:
    assert r.code == 5, f"exit {r.code}:\n{r.err[-2000:]}"
    err = "\n".join(line for line in r.err.splitlines() if line.startswith("error:") or not line.strip() == "")
    msg = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(msg) == 1 and "Traceback" not in r.err, r.err
    assert key in msg[0] and f"dfcache gc --key {key[:12]} --yes" in msg[0], msg[0]
    assert artifacts_listing(store) == before, "a refused run changed the store"


def test_run_tokens_refuses_corrupt_completions(heavy_zygote, base_store, tmp_path, figures):
    store = copy_store(base_store, tmp_path / "store")
    keys = base_store["keys"]
    (art_dir(store, keys["tokens"]) / "manifest.json").unlink()  # tokens must be recomputed from completions
    shutil.rmtree(art_dir(store, keys["tokens"]))
    _flip_chunk(store, keys["completions"], "doc")
    before = artifacts_listing(store)
    r = heavy_zygote.cli("--store", store, "run", "tokens", *base_store["args"], "--offline")
    assert_refused(r, keys["completions"], store, before)
    figures.record("corruption_runs", run_tokens_with_corrupt_completions="exit 5, names key and gc command")


HS = has_stage("hidden_states")


@pytest.mark.skipif(not HS, reason="runner/stages/hidden_states/ (the hidden-states stage) is not there yet")
@pytest.mark.parametrize("damage", ["flipped token_ids chunk", "offsets dtype edited"])
def test_run_hidden_states_refuses_corrupt_tokens(damage, heavy_zygote, base_store, tmp_path, figures):
    store = copy_store(base_store, tmp_path / "store")
    tokens = base_store["keys"]["tokens"]
    if damage.startswith("flipped"):
        _flip_chunk(store, tokens, "ids")
    else:
        _offsets_as_float(store, tokens, "ids", "int32")
    before = artifacts_listing(store)
    args = [*base_store["args"], "--offline", "--layer", "2", "--backend", "torch", "--device", "cpu",
            "--dtype", "float32"]
    r = heavy_zygote.cli("--store", store, "run", "hidden-states", *args, timeout=300)
    assert_refused(r, tokens, store, before)
    figures.record("corruption_runs", **{f"run_hidden_states_with_{damage.replace(' ', '_')}":
                                         "exit 5, names key and gc command"})
    if not damage.startswith("flipped"):
        return
    # the fix in the message works: delete it, run again, the tokens are recomputed and used
    gc = heavy_zygote.cli("--store", store, "gc", "--key", tokens[:12], "--yes")
    assert gc.code == 0, gc.err
    again = heavy_zygote.cli("--store", store, "run", "hidden-states", *args, "--json", timeout=300)
    assert again.code == 0, again.err
    assert base_store["sets"]["tokens"] in json.loads(again.out)["computed"]
    assert heavy_zygote.cli("--store", store, "verify").code == 0
    figures.record("corruption_runs", **{f"run_hidden_states_with_{damage.replace(' ', '_')}":
                                         "exit 5, names key and gc command; gc + rerun recomputes"})
