"""A chunk is bound to its place, and a manifest to its key (issue 30, point 6).

Chunk files moved between artifacts, arrays or positions keep a valid crc32c, so a check of the
chunk's own checksum passes them: reads must compare a chunk with what the manifest names for
that place (its digest). Each case moves real chunk files of a real store (made through the store
API, or by `dfcache run eval` on the tiny target), then reads through the Python API and the
command line: exit 5 (IntegrityError), a message naming the artifact, the place and the fix, and
the store unchanged by the refused read.

A manifest edited to claim other inputs (a backend) still validates; its claims no longer give its
key, and `ls` (both its paths), `--where`, `gc` scopes and `verify` must not trust it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_util import dfcache
from rel_helpers import artifacts_listing, copy_store, has_stage

from dfcache.errors import EXIT_INTEGRITY, IntegrityError
from dfcache.keys import compute_key
from dfcache.samples import Partition, SampleArray, SampleSet, SegmentWriter
from dfcache.store import open_store

# `dfcache` commands as forks of one interpreter with its light modules imported (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("forked_cli")

ROWS, COLS, CHUNK = 256, 32, 64  # four chunks of 64 rows, every chunk file the same size
TORCH = {"kernel": "torch", "device": "cpu", "dtype": "float32", "attn_implementation": "sdpa"}


def art_dir(store: Path, key: str) -> Path:
    return Path(store) / "artifacts" / key[:2] / key


def chunk_file(store: Path, key: str, array: str, index: int) -> Path:
    return art_dir(store, key) / array / "c" / str(index) / "0"


def swap(a: Path, b: Path) -> None:
    """Exchange two files' bytes in place (same inodes; each keeps a valid crc32c, and an
    uncompressed chunk its size: nothing but the place tells them apart)."""
    da, db = a.read_bytes(), b.read_bytes()
    assert da != db, "a swap must move different chunks"
    a.write_bytes(db)
    b.write_bytes(da)


def rows_of(layer: int) -> np.ndarray:
    return np.random.default_rng(layer).standard_normal((ROWS, COLS)).astype(np.float32)


def write_layer(store, layer: int, codec: str) -> str:
    inputs = {"layer": layer, "backend": TORCH, "codec": codec}
    key = compute_key("binding", 1, inputs)
    with store.writer(key, stage="binding", stage_version=1, inputs=inputs) as w:
        w.write_array("hidden", rows_of(layer), chunk_rows=CHUNK, codec=codec)
    return key


def assert_moved(err: IntegrityError, key: str, where: str) -> None:
    text = str(err)
    assert err.exit_code == EXIT_INTEGRITY
    assert key in text and where in text and "does not match its digest" in text, text
    assert f"dfcache gc --key {key[:12]} --yes" in text and "dfcache verify" in text, text


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_reads_refuse_a_chunk_moved_from_another_artifact(codec, tmp_path, monkeypatch):
    from dfcache.store import _reader

    root = tmp_path / "store"
    store = open_store(root)
    one, three = write_layer(store, 1, codec), write_layer(store, 3, codec)
    # Read once first, the checks remembered (as they are for files older than RACY_NS): a check
    # remembered from before the move must not let the moved file through.
    monkeypatch.setattr(_reader, "RACY_NS", 0)
    assert store.open(one).array("hidden").read_raw(0, ROWS).tobytes() == rows_of(1).tobytes()
    assert store.open(one).array("hidden").read_raw(0, ROWS, mapped=True).tobytes() == rows_of(1).tobytes()
    if codec == "none":
        assert (one, "hidden", 0) in store._verified and (one, "hidden", 0) in store._mapped
    if codec == "none":
        assert chunk_file(root, one, "hidden", 0).stat().st_size == chunk_file(root, three, "hidden", 0).stat().st_size
    swap(chunk_file(root, one, "hidden", 0), chunk_file(root, three, "hidden", 0))
    before = artifacts_listing(root)
    for fresh in (store, open_store(root)):  # the same store object (remembered checks) and a new one
        arr = fresh.open(one).array("hidden")
        with pytest.raises(IntegrityError) as e:
            arr.read_raw(0, 16)  # a few rows of the moved chunk
        assert_moved(e.value, one, "chunk 0 of array hidden")
        assert "another array, artifact or position" in str(e.value)
        with pytest.raises(IntegrityError):
            arr.read_raw(0, ROWS, mapped=True)  # the training path (memory-mapped chunks)
        assert arr.map_rows(0, 16) is None  # no copy-free view of an unchecked chunk
        with pytest.raises(IntegrityError) as e:
            fresh.open(three).array("hidden").read()
        assert_moved(e.value, three, "chunk 0 of array hidden")
        # The chunks nobody moved still read.
        assert arr.read_raw(CHUNK, ROWS).tobytes() == rows_of(1)[CHUNK:].tobytes()
    assert artifacts_listing(root) == before, "a refused read changed the store"
    r = dfcache("verify", store=root)
    assert r.code == EXIT_INTEGRITY and f"BAD {one}" in r.out and f"BAD {three}" in r.out, r.out + r.err


def test_reads_refuse_chunks_swapped_within_one_array(tmp_path):
    root = tmp_path / "store"
    store = open_store(root)
    key = write_layer(store, 1, "none")
    swap(chunk_file(root, key, "hidden", 1), chunk_file(root, key, "hidden", 2))
    arr = store.open(key).array("hidden")
    assert arr.read_raw(0, CHUNK).tobytes() == rows_of(1)[:CHUNK].tobytes()
    with pytest.raises(IntegrityError) as e:
        arr.read_raw(CHUNK, 2 * CHUNK)
    assert_moved(e.value, key, "chunk 1 of array hidden")
    assert "it holds the rows of chunk 2 of the same array" in str(e.value)


def _segment(store, part: Partition, upstream: list[str], layer: int) -> str:
    rows = rows_of(layer)
    with SegmentWriter(store, part, upstream, doc=False, rows={"hidden": ROWS},
                       arrays={"hidden": SampleArray((COLS,), "float32")}) as w:
        for i in range(len(upstream)):
            w.add({"hidden": rows[i * CHUNK:(i + 1) * CHUNK]})
    return w.key


def test_reads_refuse_a_chunk_moved_between_two_segments_of_one_partition(tmp_path):
    root = tmp_path / "store"
    store = open_store(root)
    part = Partition("hidden_states", 1, {"layer": 1, "backend": TORCH}, {"sample": "0" * 32})
    up_a = [f"{i:032x}" for i in range(0, 4)]
    up_b = [f"{i:032x}" for i in range(4, 8)]
    seg_a, seg_b = _segment(store, part, up_a, 1), _segment(store, part, up_b, 3)
    # One chunk per segment (its rows are known): both files the same size, each with a valid crc32c.
    swap(chunk_file(root, seg_a, "hidden", 0), chunk_file(root, seg_b, "hidden", 0))
    before = artifacts_listing(root)
    ss = SampleSet(open_store(root), part.key, part.sample_keys(up_a + up_b))
    for i in (0, 5):
        with pytest.raises(IntegrityError) as e:
            ss.read(i, "hidden")
        assert_moved(e.value, seg_a if i < 4 else seg_b, "chunk 0 of array hidden")
    assert artifacts_listing(root) == before
    r = dfcache("verify", store=root)
    assert r.code == EXIT_INTEGRITY and f"BAD {seg_a}" in r.out and f"BAD {seg_b}" in r.out, r.out + r.err


# ------------------------------------------------------------------------------ the case


@pytest.mark.skipif(not has_stage("drafter_eval"), reason="needs runner/stages/drafter_eval/")
def test_run_eval_refuses_hidden_states_swapped_between_layers(heavy_zygote, base_store, tmp_path):
    """The issue's case: swap the first chunk file between the layer-1 and layer-3 hidden states,
    drop the evals and the report so they are computed again from the states: `run eval` exits 5
    naming the artifact and the fix, writes nothing; the fix works and gives the first run's τ."""
    from runner.models.train_tiny import make_untrained_drafter

    store = copy_store(base_store, tmp_path / "store")
    drafter = make_untrained_drafter(base_store["args"][1], tmp_path / "drafter", seed=1, layer_ids=(1, 3))
    args = ["--store", store, "run", "eval", *base_store["args"], "--offline", "--drafter", drafter,
            "--backend", "torch", "--device", "cpu", "--dtype", "float32", "--tree-budget", "2",
            "--no-progress", "--json"]
    first = heavy_zygote.cli(*args, timeout=600)
    assert first.code == 0, first.err
    s = open_store(store)
    layers = {m.inputs["layer"]: m.key for m in s.list_manifests(stage="hidden_states")}
    assert sorted(layers) == [1, 3]
    swap(chunk_file(store, layers[1], "hidden", 0), chunk_file(store, layers[3], "hidden", 0))
    for m in s.list_manifests():
        if m.stage in ("drafter_eval", "report"):
            assert s.delete(m.key)
    before = artifacts_listing(store)

    r = heavy_zygote.cli(*args, timeout=600)
    assert r.code == EXIT_INTEGRITY, f"exit {r.code}\n{r.out}\n{r.err[-3000:]}"
    msg = [ln for ln in r.err.splitlines() if ln.startswith("error: ")]
    assert len(msg) == 1 and "Traceback" not in r.err, r.err
    bad = next(k for k in layers.values() if k in msg[0])
    assert "does not match its digest" in msg[0] and f"dfcache gc --key {bad[:12]} --yes" in msg[0], msg[0]
    assert "dfcache verify" in msg[0], msg[0]
    assert artifacts_listing(store) == before, "a refused run changed the store"

    # The Python reader refuses the same states.
    with pytest.raises(IntegrityError):
        open_store(store).open(layers[3]).array("hidden").read()

    # The fixes the message gives: verify names both layers, gc --bad removes them, a rerun
    # recomputes them and evaluates to the first run's numbers.
    v = heavy_zygote.cli("--store", store, "verify")
    assert v.code == EXIT_INTEGRITY and all(f"BAD {k}" in v.out for k in layers.values()), v.out
    assert heavy_zygote.cli("--store", store, "gc", "--bad", "--yes").code == 0
    again = heavy_zygote.cli(*args, timeout=600)
    assert again.code == 0, again.err
    tau = lambda out: [(d["tau_chain"], d["tau_tree"]) for d in json.loads(out)["drafters"]]  # noqa: E731
    assert tau(again.out) == tau(first.out)
    assert heavy_zygote.cli("--store", store, "verify").code == 0


# ------------------------------------------------------------------------------ manifest claims


def _claims_store(root: Path) -> dict:
    """Hidden states of two layers as per-sample segments (torch), and a set-level artifact."""
    store = open_store(root)
    keys = {}
    for layer in (1, 3):
        part = Partition("hidden_states", 1, {"layer": layer, "backend": TORCH}, {"sample": "0" * 32})
        keys[layer] = _segment(store, part, [f"{i:032x}" for i in range(4)], layer)
    keys["set"] = write_layer(store, 5, "none")
    return keys


def _edit(root: Path, key: str, change) -> None:
    p = art_dir(root, key) / "manifest.json"
    m = json.loads(p.read_text())
    change(m)
    p.write_text(json.dumps(m, indent=1, sort_keys=True))


def _listed(r) -> set[str]:
    assert r.code == 0, r.err
    return {row["key"] for row in json.loads(r.out)}


@pytest.mark.parametrize("fast", [True, False], ids=["index", "full-cli"])
def test_ls_skips_a_manifest_edited_to_claim_another_backend(fast, tmp_path, zygote):
    root = tmp_path / "store"
    keys = _claims_store(root)
    ls = (lambda *a: dfcache(*a, store=root)) if fast else (lambda *a: zygote.cli("--store", root, *a))
    assert _listed(ls("ls", "--json")) == set(keys.values())  # (builds the listing index)
    assert _listed(ls("ls", "--backend", "fla", "--json")) == set()

    def to_fla(m):
        m["inputs"]["backend"]["kernel"] = "fla"
    _edit(root, keys[1], to_fla)  # a segment: its partition no longer derives from its inputs
    _edit(root, keys["set"], to_fla)  # a set-level artifact: its key no longer derives

    r = ls("ls", "--backend", "fla")
    assert r.code == 0 and keys[1][:12] not in r.out and keys["set"][:12] not in r.out, r.out
    assert r.err.count("warning:") + r.out.count("warning:") == 1, r.out + r.err
    assert "2 manifest(s) failed validation" in r.out + r.err
    assert _listed(ls("ls", "--backend", "fla", "--json")) == set()
    assert _listed(ls("ls", "--json")) == {keys[3]}
    assert _listed(ls("ls", "--where", "kernel==fla", "--json")) == set()

    # Decisions taken on claims skip it too; verify names it (exit 5) and gc --bad removes it.
    gc = zygote.cli("--store", root, "gc", "--stage", "hidden-states", "--dry-run", "--json")
    assert gc.code == 0, gc.err
    assert [i["name"] for i in json.loads(gc.out)["items"]] == [keys[3]]
    v = zygote.cli("--store", root, "verify")
    assert v.code == EXIT_INTEGRITY, v.out + v.err
    assert f"BAD {keys[1]}" in v.out and "partition" in v.out and f"BAD {keys['set']}" in v.out, v.out
    assert zygote.cli("--store", root, "gc", "--bad", "--yes").code == 0
    assert sorted(p.name for p in (root / "artifacts").glob("*/*")) == [keys[3]]
    assert dfcache("verify", store=root).code == 0


def test_a_partition_with_an_edited_segment_is_refused_when_read(tmp_path):
    """The sample index decides which samples a partition holds from its segments' claims: a
    segment whose claims no longer give its partition is refused there (exit 5), not trusted."""
    from dfcache.errors import UntrustedManifestError

    root = tmp_path / "store"
    keys = _claims_store(root)
    part = Partition("hidden_states", 1, {"layer": 1, "backend": TORCH}, {"sample": "0" * 32})
    sample_keys = part.sample_keys([f"{i:032x}" for i in range(4)])
    assert SampleSet(open_store(root), part.key, sample_keys).read(0, "hidden").tobytes() == \
        rows_of(1)[:CHUNK].tobytes()
    _edit(root, keys[1], lambda m: m["inputs"]["backend"].update(kernel="fla"))
    with pytest.raises(UntrustedManifestError) as e:
        SampleSet(open_store(root), part.key, sample_keys)
    assert e.value.exit_code == EXIT_INTEGRITY and keys[1] in str(e.value) and "partition" in str(e.value)
    assert f"dfcache gc --key {keys[1][:12]}" in str(e.value)


def test_pull_refuses_a_manifest_whose_claims_do_not_give_its_key(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    keys = _claims_store(src)
    open_store(dst)
    _edit(src, keys["set"], lambda m: m["inputs"].update(layer=7))
    r = dfcache("pull", f"file://{src}", keys["set"], store=dst)
    assert r.code == EXIT_INTEGRITY and keys["set"] in r.err and "Traceback" not in r.err, r.err
    assert artifacts_listing(dst) == []
    shutil.rmtree(src)
