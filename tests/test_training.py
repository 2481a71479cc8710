"""The store as training data: HiddenStateDataset, DataLoader workers, export to the peers' layouts.

Real parts only: a tiny real target, states extracted by the real pipeline into a real store,
and the exports read back with SpecForge's and speculators' own reader code (installed from the
package registry with --no-deps; the tests that need them skip when they are absent).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dfcache import open_store  # noqa: E402
from dfcache.cli import main as cli_main  # noqa: E402
from dfcache.errors import OfflineMissingError  # noqa: E402
from dfcache.training import HiddenStateDataset, LengthBucketSampler, pad_collate  # noqa: E402
from runner import api  # noqa: E402

@pytest.fixture(autouse=True)
def fresh_cli_state():
    # dfcache.cli.main keeps global options (--json, --store) in a module-level state.
    from dfcache.cli.common import REGISTERED_FIELDS, GlobalState, state

    yield
    for k, v in vars(GlobalState()).items():
        if k not in REGISTERED_FIELDS:  # what the commands registered, once a process (dfcache.cli._register_all)
            setattr(state, k, v)


DRAFTER_LAYERS = [3, 1]  # deliberately not sorted: concatenation follows the drafter's order
CHECKED = "imported (layers checked against a recomputed sample)"
UNCHECKED = "imported (declared, not checked: --no-check)"
LAST = 5  # the tiny target has 6 layers


@pytest.fixture(scope="module")
def cached(tiny_target, tmp_path_factory):
    """A store holding tokens and layers 1, 3, 5 of four prompts, and a drafter needing [3, 1]."""
    from runner.models.train_tiny import make_untrained_drafter

    root = tmp_path_factory.mktemp("training")
    drafter = make_untrained_drafter(tiny_target, root / "drafter", layer_ids=DRAFTER_LAYERS)
    sel = dict(target=str(tiny_target), num_prompts=4, max_new_tokens=12, backend="torch", device="cpu",
               dtype="bfloat16", completions="local")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        api.run("hidden-states", store=root / "store", layers=[1, 3, LAST], **sel)
    finally:
        torch.set_num_threads(before)
    return {"store": root / "store", "drafter": drafter, "sel": sel, "root": root}


def _cli_sel(cached) -> list[str]:
    s = cached["sel"]
    return ["--target", s["target"], "--num-prompts", "4", "--max-new-tokens", "12", "--backend", "torch",
            "--device", "cpu"]


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def test_dataset_items_are_the_stored_rows_in_the_drafters_layer_order(cached):
    from dfcache.samples import SampleSet

    ds = api.hidden_state_dataset(store=cached["store"], drafters=[str(cached["drafter"])], **cached["sel"])
    assert isinstance(ds, torch.utils.data.Dataset) and len(ds) == 4
    src = ds.source
    assert src.layers == DRAFTER_LAYERS
    store = open_store(cached["store"])
    tok_set = SampleSet(store, src.tokens_partition, src.tokens_keys)
    ids = tok_set.read_many("ids")
    docs = tok_set.docs()

    class toks:  # the stored tokens, read directly
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])])
        prompt_lens = [d["prompt_len"] for d in docs]
        completion_lens = [d["completion_len"] for d in docs]

        @staticmethod
        def sample(i):
            return ids[i]

    layer_set = {k: SampleSet(store, p, keys) for k, p, keys in zip(src.layers, src.layer_partitions,
                                                                     src.layer_sample_keys)}

    def read_layer(k, i):
        raw = layer_set[k].read_raw(i, "hidden")
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)

    keys = set()
    for i in range(len(ds)):
        item = ds[i]
        a, b = int(toks.offsets[i]), int(toks.offsets[i + 1])
        n = b - a
        assert item["input_ids"].shape == (1, n) and item["input_ids"].dtype == torch.int64
        assert item["input_ids"][0].tolist() == toks.sample(i).tolist()
        # loss_mask: the completion's tokens (SpecForge's assistant-turn tokens of a one-turn sample)
        want_mask = [0] * int(toks.prompt_lens[i]) + [1] * int(toks.completion_lens[i])
        assert item["loss_mask"][0].tolist() == want_mask and item["loss_mask"].dtype == torch.int64
        want = torch.cat([read_layer(k, i) for k in DRAFTER_LAYERS], dim=1)
        assert item["hidden_states"].dtype == torch.bfloat16
        assert _same(item["hidden_states"][0], want)
        keys.add(item["key"])
    assert len(keys) == 4
    assert ds.keys() == [ds[i]["key"] for i in range(4)]
    # max_len truncates every array the way SpecForge's max_len does
    short = HiddenStateDataset(src, max_len=5)
    assert short[0]["hidden_states"].shape == (1, 5, 2 * 128) and short.lengths() == [5] * 4


def _collect(ds, context: str, workers: int) -> dict:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                         multiprocessing_context=context)
    return {item["key"]: item for item in loader}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_the_same_items(cached, context):
    if context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {context} start method here")
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1, LAST], **cached["sel"])
    ds[0]  # the parent has opened the store: a forked worker must not reuse that handle
    got = _collect(ds, context, workers=2 if context == "fork" else 1)
    assert sorted(got) == sorted(ds.keys())
    for i in range(len(ds)):
        mine = ds[i]
        for name in ("input_ids", "loss_mask", "hidden_states"):
            assert _same(got[mine["key"]][name], mine[name])


def test_a_grown_set_reads_the_cached_samples_from_several_segments(cached, tmp_path):
    """2 prompts extracted, then 4: the 4-prompt dataset reads samples from both runs' segments,
    in prompt order, bitwise equal to extracting all 4 at once; a subset reads the same samples."""
    from dfcache.samples import index_of

    store = tmp_path / "grown"
    sel = {**cached["sel"], "num_prompts": 2}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        api.run("hidden-states", store=store, layers=[1, 3], **sel)
        api.run("hidden-states", store=store, layers=[1, 3], **cached["sel"])
    finally:
        torch.set_num_threads(before)
    grown = api.hidden_state_dataset(store=store, drafters=[str(cached["drafter"])], **cached["sel"])
    once = api.hidden_state_dataset(store=cached["store"], drafters=[str(cached["drafter"])], **cached["sel"])
    st = open_store(store)
    for part in grown.source.layer_partitions:
        assert len(index_of(st).segments(part)) == 2  # each run committed its own samples
    assert grown.keys() == once.keys()
    _assert_same_dataset(grown, once)
    subset = api.hidden_state_dataset(store=store, drafters=[str(cached["drafter"])], **sel)
    assert subset.keys() == grown.keys()[:2]
    _assert_same_dataset(subset, [once[0], once[1]])


def test_length_bucket_sampler_covers_every_sample_once_within_the_token_budget(cached):
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1], **cached["sel"])
    lengths = ds.lengths()
    budget = max(lengths) + 10
    sampler = LengthBucketSampler(lengths, max_tokens=budget, seed=3)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(ds)))
    assert all(max(lengths[i] for i in b) * len(b) <= budget for b in batches)
    assert list(sampler) == batches  # same seed and epoch: same order
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate)
    for batch, idx in zip(loader, batches):
        longest = max(lengths[i] for i in idx)
        assert batch["hidden_states"].shape == (len(idx), longest, 128)
        assert batch["attention_mask"].sum(1).tolist() == [lengths[i] for i in idx]


def test_a_selection_not_fully_cached_names_the_command(cached):
    with pytest.raises(OfflineMissingError) as e:
        api.hidden_state_dataset(store=cached["store"], layers=[2], **cached["sel"])
    assert "hidden_states[2]" in str(e.value) and "run hidden-states" in str(e.value)


def _export(cached, fmt, out, *extra, capsys=None) -> int:
    return cli_main(["--store", str(cached["store"]), "export", "--format", fmt, "--out", str(out),
                     "--drafter", str(cached["drafter"]), "--no-progress", *_cli_sel(cached), *extra])


def test_export_specforge_reads_back_with_specforges_loader(cached, tmp_path, capsys):
    feature_store = pytest.importorskip("specforge.runtime.data_plane.feature_store")
    offline_reader = pytest.importorskip("specforge.runtime.data_plane.offline_reader")
    dflash_data = pytest.importorskip("specforge.algorithms.common.dflash_family_data")
    out = tmp_path / "sf"
    assert _export(cached, "specforge", out) == 0
    assert "4 written" in capsys.readouterr().out
    ds = api.hidden_state_dataset(store=cached["store"], drafters=[str(cached["drafter"])], **cached["sel"])
    files = offline_reader.list_feature_files(str(out))
    assert [Path(f).relative_to(out).as_posix() for f in files] == [f"rows_0-2000/data_{i}.ckpt" for i in range(4)]
    for f in files:
        i = int(Path(f).name[len("data_"):-len(".ckpt")])
        raw = feature_store.load_feature_file(f)
        assert list(raw) == ["input_ids", "loss_mask", "hidden_states"]
        assert raw["hidden_states"].dtype == torch.bfloat16 and raw["hidden_states"].dim() == 3
        item = dflash_data.normalize_offline_sample(raw, max_len=4096)
        mine = ds[i]
        assert set(item) == {"input_ids", "loss_mask", "hidden_states"}
        for name in item:
            assert _same(item[name], mine[name]), name
    man = json.loads((out / "dfcache-export.json").read_text())
    assert man["complete"] is True and [x["key"] for x in man["files"]] == ds.keys()
    # Again: a previous export of the same selection resumes (nothing rewritten).
    (out / "rows_0-2000" / "data_2.ckpt").unlink()
    (out / "rows_0-2000" / ".data_1.ckpt.dead.partial").write_bytes(b"half a file")
    assert _export(cached, "specforge", out) == 0
    assert "1 written" in capsys.readouterr().out and (out / "rows_0-2000" / "data_2.ckpt").exists()
    assert len(offline_reader.list_feature_files(str(out))) == 4


def test_export_speculators_reads_back_with_speculators_loader(cached, tmp_path, capsys):
    pytest.importorskip("datasets")
    data = pytest.importorskip("speculators.train.data")
    out = tmp_path / "sp"
    assert _export(cached, "speculators", out, "--json") == 0
    res = json.loads(capsys.readouterr().out)
    assert res["layers"] == DRAFTER_LAYERS + [LAST] and res["written"] == 4
    man = json.loads((out / "dfcache-export.json").read_text())
    assert man["aux_hidden_state_layer_ids"] == [k + 1 for k in DRAFTER_LAYERS]
    theirs = data.ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    ours = api.hidden_state_dataset(store=cached["store"], drafters=[str(cached["drafter"])], **cached["sel"])
    last = api.hidden_state_dataset(store=cached["store"], layers=[LAST], **cached["sel"])
    assert len(theirs) == 4
    for i in range(4):
        item, mine = theirs[i], ours[i]
        assert _same(item["hidden_states"], mine["hidden_states"][0])
        assert _same(item["verifier_last_hidden_states"], last[i]["hidden_states"][0])
        assert _same(item["input_ids"], mine["input_ids"][0])
        assert _same(item["loss_mask"], mine["loss_mask"][0])
    from safetensors import safe_open

    with safe_open(str(out / "hidden_states" / "hs_0.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["hidden_states", "token_ids"]
        assert f.get_tensor("hidden_states").shape[1:] == (3, 128)
        assert f.get_tensor("token_ids").dtype == torch.int64


def test_export_speculators_without_datasets_is_bad_input_naming_the_extra(cached, tmp_path, capsys, monkeypatch):
    """A well-formed command this install cannot carry out: exit 6 (it was 2, a usage error), the
    message naming the package and the extra that brings it, and nothing written."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails as if absent
    out = tmp_path / "sp"
    assert _export(cached, "speculators", out) == 6
    err = capsys.readouterr().err
    assert "`datasets` package, which is not installed" in err and "pip install 'dfcache[peers]'" in err, err
    assert err.count("error:") == 1 and not out.exists()


EAGLE_LAYERS = [3, 1, LAST]  # an EAGLE-3 drafter's three layers, the target's last among them


@pytest.fixture(scope="module")
def eagle_drafter(cached, tiny_target):
    """An (untrained) EAGLE-3 checkpoint in SpecForge's layout reading layers 3, 1 and the last."""
    from runner.drafters.dflash import load_target_head
    from runner.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_weights, save_eagle3

    head = load_target_head(tiny_target)
    H, V, DV = head.hidden_size, head.vocab_size, 64
    cfg = Eagle3Config(hidden_size=H, target_hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=H // 4, intermediate_size=2 * H, rms_norm_eps=1e-6, rope_theta=10000.0,
                       vocab_size=V, draft_vocab_size=DV, target_layer_ids=list(EAGLE_LAYERS))
    d = init_eagle3_weights(Eagle3Drafter(cfg), 0)
    d.d2t = torch.zeros(DV, dtype=torch.long)  # draft token j is target token j
    return save_eagle3(d, cached["root"] / "eagle3")


def test_export_eagle3_speculators_reads_back_its_three_layers_and_the_last(cached, eagle_drafter, tmp_path, capsys):
    """Issue 32 point 4: an EAGLE-3 drafter's export in speculators' layout holds its three layers
    as they are (the target's last one too) and then the last layer; speculators' own reader and its
    EAGLE-3 batch shift give the stored rows."""
    pytest.importorskip("datasets")
    data = pytest.importorskip("speculators.train.data")
    shift = pytest.importorskip("speculators.models.eagle3.data")
    out = tmp_path / "sp-eagle"
    assert cli_main(["--store", str(cached["store"]), "export", "--format", "speculators", "--out", str(out),
                     "--drafter", str(eagle_drafter), "--no-progress", "--json", *_cli_sel(cached)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["layers"] == EAGLE_LAYERS + [LAST] and res["written"] == 4
    man = json.loads((out / "dfcache-export.json").read_text())
    assert man["drafter_family"] == "eagle3" and man["aux_hidden_state_layer_ids"] == [k + 1 for k in EAGLE_LAYERS]
    theirs = data.ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    aux = api.hidden_state_dataset(store=cached["store"], layers=EAGLE_LAYERS, **cached["sel"])
    last = api.hidden_state_dataset(store=cached["store"], layers=[LAST], **cached["sel"])
    assert len(theirs) == 4
    for i in range(4):
        item, mine = theirs[i], aux[i]
        assert item["hidden_states"].shape == (mine["input_ids"].shape[1], 3 * 128)
        assert _same(item["hidden_states"], mine["hidden_states"][0])
        assert _same(item["verifier_last_hidden_states"], last[i]["hidden_states"][0])
        assert _same(item["input_ids"], mine["input_ids"][0])
        assert _same(item["loss_mask"], mine["loss_mask"][0])
        n = item["input_ids"].shape[0]
        b = shift.shift_batch({**item, "lengths": torch.tensor([n]), "position_ids": torch.arange(n)})
        assert _same(b["hidden_states"], mine["hidden_states"][0][:-1])
        assert _same(b["verifier_last_hidden_states"], last[i]["hidden_states"][0][1:])


def test_export_eagle3_and_dspark_specforge_carry_the_final_state_specforges_readers_take(cached, eagle_drafter,
                                                                                          tmp_path, capsys):
    """Issue 32 points 3-4: SpecForge's offline EAGLE-3 files hold `hidden_state`, the target's state after
    its final norm: the hidden-state layer "final", keyed apart. Missing, the export is exit 3 naming the
    command; `run hidden-states --drafter` of an EAGLE-3 drafter extracts it (only it: the layers are
    cached); SpecForge's reader and normalizer take the files, and lm_head(hidden_state) is the target's
    logits; `import` brings it back as layer "final". A DSpark drafter's export then reuses that same
    artifact as `target_last_hidden_states`."""
    import shutil

    offline_reader = pytest.importorskip("specforge.runtime.data_plane.offline_reader")
    feature_store = pytest.importorskip("specforge.runtime.data_plane.feature_store")
    eagle3_data = pytest.importorskip("specforge.algorithms.eagle3.data")
    dflash_data = pytest.importorskip("specforge.algorithms.common.dflash_family_data")
    from transformers import AutoModelForCausalLM

    from runner.models.train_tiny import single_thread

    store = tmp_path / "store"
    shutil.copytree(cached["store"], store)  # the module's store stays without the final state
    out = tmp_path / "sf-eagle"
    sf = ["--format", "specforge", "--no-progress", *_cli_sel(cached)]
    code = cli_main(["--store", str(store), "export", "--out", str(out), "--drafter", str(eagle_drafter), *sf])
    err = capsys.readouterr().err
    assert code == 3 and "hidden_states[final]" in err and "--final-state" in err and not out.exists(), err
    with single_thread():
        assert cli_main(["--store", str(store), "--json", "run", "hidden-states", "--drafter", str(eagle_drafter),
                         "--no-progress", *_cli_sel(cached)]) == 0
    run = json.loads(capsys.readouterr().out)
    labels = {n["key"]: n.get("label") for n in run["nodes"] if n["stage"] == "hidden_states"}
    assert sorted(labels.values()) == sorted(f"hidden_states[{k}]" for k in EAGLE_LAYERS + ["final"])
    assert [labels[k] for k in run["computed"]] == ["hidden_states[final]"]  # the layers were cached
    assert cli_main(["--store", str(store), "export", "--out", str(out), "--drafter", str(eagle_drafter), *sf]) == 0
    capsys.readouterr()
    man = json.loads((out / "dfcache-export.json").read_text())
    assert man["layers"] == EAGLE_LAYERS + ["final"] and man["specforge_layout"] == "eagle3"
    aux = api.hidden_state_dataset(store=store, layers=EAGLE_LAYERS, **cached["sel"])
    target = AutoModelForCausalLM.from_pretrained(cached["sel"]["target"], dtype=torch.bfloat16)
    refs = offline_reader.OfflineManifestReader(str(out), strategy="eagle3", validate_files=True).read()
    assert len(refs) == 4
    finals = {}
    for ref in refs:
        path = ref.feature_store_uri[len("file://"):]
        i = int(Path(path).name[len("data_"):-len(".ckpt")])
        raw = feature_store.load_feature_file(path)
        assert sorted(raw) == sorted(offline_reader._OFFLINE_EAGLE3_KEYS)
        item = eagle3_data.normalize_offline_sample(raw, max_len=4096)
        mine = aux[i]
        assert _same(item["hidden_state"], mine["hidden_states"]) and _same(item["input_ids"], mine["input_ids"])
        n = item["input_ids"].shape[1]
        assert item["target"].shape == (1, n, 128) and item["target"].dtype == torch.bfloat16
        finals[i] = item["target"]
    with torch.no_grad(), single_thread():  # the teacher: the target's own logits from the stored final state
        logits = target(input_ids=aux[0]["input_ids"]).logits
        assert torch.equal(target.lm_head(finals[0]), logits)
    # Imported back (`import --format specforge` of SpecForge's EAGLE-3 files): the final state comes in
    # as layer "final", checked against the recomputed sample's state after the final norm.
    with single_thread():
        assert _import(tmp_path / "imported", "specforge", out, cached["sel"]["target"], *EAGLE_LAYERS,
                       extra=["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["layer_keys"]) == [str(k) for k in EAGLE_LAYERS] + ["final"] and res["refused"] == []
    final_col = res["layer_check"]["columns"][-1]
    assert final_col["declared"] == "final" and final_col["nearest"] == "final norm" and final_col["ok"]
    assert final_col["declared_distance"] == 0.0  # the same class recomputed: the same bits
    back = api.hidden_state_dataset(store=tmp_path / "imported", tokens_key=res["tokens_key"], layers=["final"])
    for i in range(4):
        assert _same(back[i]["hidden_states"], finals[i])
    # DSpark (the untrained DFlash drafter's backbone, layers [3, 1], with a Markov head): the same
    # final state, nothing extracted, in SpecForge's DSpark layout.
    spark = cached["root"] / "dspark-export"
    if not spark.exists():
        shutil.copytree(cached["drafter"], spark)
        cfg = json.loads((spark / "config.json").read_text())
        cfg["architectures"] = ["DSparkDraftModel"]
        cfg["dflash_config"] = {**cfg["dflash_config"], "projector_type": "dspark", "markov_rank": 8}
        (spark / "config.json").write_text(json.dumps(cfg))
    out2 = tmp_path / "sf-dspark"
    assert cli_main(["--store", str(store), "export", "--out", str(out2), "--drafter", str(spark), *sf]) == 0
    assert "4 written" in capsys.readouterr().out
    ds = api.hidden_state_dataset(store=store, drafters=[str(cached["drafter"])], **cached["sel"])
    for f in offline_reader.list_feature_files(str(out2)):
        i = int(Path(f).name[len("data_"):-len(".ckpt")])
        item = dflash_data.normalize_dspark_offline_sample(feature_store.load_feature_file(f), max_len=4096)
        assert _same(item["hidden_states"], ds[i]["hidden_states"])
        assert _same(item["target_last_hidden_states"], finals[i])
    # speculators' layouts hold no final state: --final-state there is exit 6, nothing written.
    code = cli_main(["--store", str(store), "export", "--format", "speculators", "--out", str(tmp_path / "sp"),
                     "--layer", "1", "--final-state", "--no-progress", *_cli_sel(cached)])
    err = capsys.readouterr().err
    assert code == 6 and "verifier_norm" in err and not (tmp_path / "sp").exists(), err


def test_fp8_states_export_in_speculators_fp8_layout_and_their_reader_gives_our_bf16(cached, tmp_path, capsys):
    """Issue 33: FP8 states go out as stored (codes and scales, no requantization); hs-connectors'
    FP8Transfer (speculators' FP8 backend reader) dequantizes them to the dataset's bf16 bit for bit."""
    pytest.importorskip("datasets")
    from hs_connectors import FP8Transfer

    fp8 = ["--compression", "fp8-e4m3"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli_main(["--store", str(cached["store"]), "run", "hidden-states", "--layer", "1", "--layer", "3",
                         "--layer", str(LAST), "--no-progress", *_cli_sel(cached), *fp8]) == 0
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()
    out = tmp_path / "sp8"
    assert _export(cached, "speculators", out, "--json", *fp8) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["written"] == 4 and any("FP8" in n for n in res["notes"])
    ours = api.hidden_state_dataset(store=cached["store"], layers=DRAFTER_LAYERS + [LAST], compression="fp8-e4m3",
                                    **cached["sel"])
    exact = api.hidden_state_dataset(store=cached["store"], layers=DRAFTER_LAYERS + [LAST], **cached["sel"])
    theirs = FP8Transfer(out / "hidden_states")
    from safetensors import safe_open

    with safe_open(str(out / "hidden_states" / "hs_0.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["hidden_states", "hidden_states_scales", "token_ids"]
        assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert f.get_tensor("hidden_states").shape[1:] == (3, 128)
        assert f.get_tensor("hidden_states_scales").shape[1:] == (3, 1)
    for i in range(4):
        item, mine = theirs.get_cached(i), ours[i]["hidden_states"][0]
        n = mine.shape[0]
        assert _same(item["hidden_states"].reshape(n, -1), mine)
        assert not _same(mine, exact[i]["hidden_states"][0])  # lossy: not the bf16 states
        assert _same(item["token_ids"], ours[i]["input_ids"][0])
    sf = tmp_path / "sf8"  # SpecForge has no FP8 layout: dequantized bf16
    assert _export(cached, "specforge", sf, *fp8) == 0
    d = torch.load(sf / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    assert _same(d["hidden_states"][0], ours[0]["hidden_states"][0][:, :256])


def test_export_refuses_a_foreign_or_other_selection_directory(cached, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert _export(cached, "specforge", foreign) == 2
    assert "not empty" in capsys.readouterr().err
    assert sorted(os.listdir(foreign)) == ["notes.txt"]
    other = tmp_path / "other"
    assert cli_main(["--store", str(cached["store"]), "export", "--format", "specforge", "--out", str(other),
                     "--layer", "1", "--no-progress", *_cli_sel(cached)]) == 0
    capsys.readouterr()
    assert _export(cached, "specforge", other) == 2
    assert "another selection" in capsys.readouterr().err


def test_export_of_an_uncached_selection_exits_3_with_the_command(cached, tmp_path, capsys):
    out = tmp_path / "never"
    code = cli_main(["--store", str(cached["store"]), "export", "--format", "specforge", "--out", str(out),
                     "--layer", "2", "--no-progress", *_cli_sel(cached)])
    err = capsys.readouterr().err
    assert code == 3
    assert "dfcache --store" in err and "run hidden-states" in err and "--layer 2" in err and "--format" not in err
    assert not out.exists()


# ----------------------------------------------------------------------------------- import


def _import(store, fmt, src, target, *layers, extra=()) -> int:
    args = ["--store", str(store), "import", str(src), "--format", fmt, "--target", str(target),
            "--backend", "torch", "--device", "cpu", "--no-progress", *extra]
    for k in layers:
        args += ["--layer", str(k)]
    return cli_main(args)


@pytest.fixture
def target_path(cached):
    return cached["sel"]["target"]


def _assert_same_dataset(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        for name in ("input_ids", "loss_mask", "hidden_states"):
            assert _same(a[i][name], b[i][name]), (i, name)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_import_of_an_export_gives_back_the_same_samples_marked_imported(cached, target_path, tmp_path, capsys, fmt):
    if fmt == "specforge":
        pytest.importorskip("specforge")
    else:
        pytest.importorskip("datasets")
    out = tmp_path / "export"
    assert _export(cached, fmt, out) == 0
    capsys.readouterr()
    layers = DRAFTER_LAYERS + ([LAST] if fmt == "speculators" else [])
    store = tmp_path / "other-store"
    assert _import(store, fmt, out, target_path, *layers, extra=["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["samples"] == 4 and res["refused"] == [] and res["provenance"] == CHECKED
    check = res["layer_check"]  # the declaration checked on a recomputed sample: the same class, the same bits
    assert check["ok"] and check["same_class"] and [c["declared"] for c in check["columns"]] == layers
    assert all(c["declared_distance"] == 0.0 and c["nearest"] == f"layer {c['declared']}" for c in check["columns"])
    imported = api.hidden_state_dataset(store=store, tokens_key=res["tokens_key"], layers=DRAFTER_LAYERS)
    original = api.hidden_state_dataset(store=cached["store"], drafters=[str(cached["drafter"])], **cached["sel"])
    _assert_same_dataset(imported, original)
    st = open_store(store)
    for m in st.list_manifests():
        assert m.provenance["imported"] == CHECKED
    # Per-sample segments: each layer's samples in the partition extraction keys for those tokens, with
    # the declared backend inside; the import artifact lists the set's samples in file order.
    tokens = st.list_manifests(stage="tokens")
    assert len(tokens) == 1 and tokens[0].samples["partition_upstream"] == {}
    hs = [m for m in st.list_manifests(stage="hidden_states")]
    assert sorted(int(m.inputs["layer"]) for m in hs) == sorted(layers)
    assert all(m.inputs["backend"]["kernel"] == "torch" and m.samples["partition_upstream"] ==
               {"sample": tokens[0].samples["partition"]} for m in hs)
    assert {str(m.inputs["layer"]): m.samples["partition"] for m in hs} == res["layer_keys"]
    assert cli_main(["--store", str(store), "ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["stage"] for r in rows) == sorted(["import", "tokens"] + ["hidden_states"] * len(layers))
    assert all(CHECKED in r["summary"] for r in rows), [r["summary"] for r in rows]
    assert _import(store, fmt, out, target_path, *layers, extra=["--json"]) == 0  # again: nothing new
    again = json.loads(capsys.readouterr().out)
    assert again["already_imported"] is True and again["reused"] == 4
    # gc knows the import reads these segments: removing one is refused (exit 2 naming the import)
    (imp,) = st.list_manifests(stage="import")
    assert cli_main(["--store", str(store), "gc", "--yes", "--key", hs[0].key]) == 2
    assert imp.key[:12] in capsys.readouterr().err
    assert open_store(store).has(hs[0].key)


def test_import_modelopt_dumps(cached, target_path, tmp_path, capsys):
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1, 3], **cached["sel"])
    src = tmp_path / "modelopt"
    src.mkdir()
    for i in range(3):  # ModelOpt's compute_hidden_states_hf.py layout, one .pt per conversation
        it = ds[i]
        torch.save({"input_ids": it["input_ids"][0], "hidden_states": it["hidden_states"][0, :, :128].clone(),
                    "aux_hidden_states": it["hidden_states"][0].clone(), "conversation_id": 100 + i},
                   src / f"{100 + i}.pt")
    store = tmp_path / "mo-store"
    assert _import(store, "modelopt", src, target_path, 1, 3, extra=["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    got = api.hidden_state_dataset(store=store, tokens_key=res["tokens_key"], layers=[1, 3])
    assert len(got) == 3 and "every token counts" in res["notes"][0]
    for i in range(3):
        assert _same(got[i]["hidden_states"], ds[i]["hidden_states"])
        assert got[i]["loss_mask"].sum() == got[i]["loss_mask"].shape[1]


def test_import_refuses_bad_samples_one_by_one_and_keeps_the_good(cached, target_path, tmp_path, capsys):
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1], **cached["sel"])
    src = tmp_path / "sf" / "rows_0-2000"
    src.mkdir(parents=True)

    def record(i, **change):
        it = ds[i]
        rec = {"input_ids": it["input_ids"][0].clone(), "loss_mask": it["loss_mask"][0].clone(),
               "hidden_states": it["hidden_states"].clone()}
        rec.update(change)
        return rec

    torch.save(record(0), src / "data_0.ckpt")
    torch.save(record(1), src / "data_1.ckpt")
    nan = record(2)
    nan["hidden_states"][0, 3, 7] = float("nan")
    torch.save(nan, src / "data_2.ckpt")
    torch.save(record(3, input_ids=ds[3]["input_ids"][0][:-2].clone()), src / "data_3.ckpt")
    torch.save(record(0), src / "data_4.ckpt")
    data = (src / "data_4.ckpt").read_bytes()
    (src / "data_4.ckpt").write_bytes(data[: len(data) // 2])  # a crash-truncated file
    store = tmp_path / "bad-store"
    assert _import(store, "specforge", src.parent, target_path, 1) == 6
    err = capsys.readouterr().err
    assert "refused 3 of 5" in err and "(2 imported)" in err
    assert "data_2.ckpt: hidden states hold 1 NaN/Inf" in err
    assert "data_3.ckpt: holds" in err and "rows of hidden states for" in err
    assert "data_4.ckpt: unreadable (truncated or corrupt)" in err
    st = open_store(store)
    tokens = st.list_manifests(stage="tokens")
    assert len(tokens) == 1 and len(tokens[0].samples["keys"]) == 2
    (imp,) = st.list_manifests(stage="import")
    got = api.hidden_state_dataset(store=store, tokens_key=imp.key, layers=[1])
    _assert_same_dataset(got, [ds[0], ds[1]])


def test_import_needs_declared_layers_and_backend(cached, target_path, tmp_path, capsys):
    src = tmp_path / "empty"
    src.mkdir()
    assert cli_main(["--store", str(tmp_path / "s"), "import", str(src), "--format", "specforge", "--target",
                     target_path, "--layer", "1"]) == 2
    assert "--backend fla|torch and --device cuda|cpu" in capsys.readouterr().err
    assert _import(tmp_path / "s", "specforge", src, target_path) == 2
    assert "--layer K" in capsys.readouterr().err


def _shifted_import(fmt, out, store, target_path, capsys, layers, extra=()):
    code = _import(store, fmt, out, target_path, *layers, extra=list(extra))
    return code, capsys.readouterr()


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_import_refuses_shifted_layers_naming_the_ones_the_files_hold(cached, target_path, tmp_path, capsys, fmt):
    """Files in the peer's own layout (an export, read back by the peers' readers above) declared
    one layer off, as vLLM and speculators number layers (the input of layer k): refused before
    anything is written, naming the layers the columns hold; --no-check imports them marked."""
    pytest.importorskip("specforge" if fmt == "specforge" else "datasets")
    out = tmp_path / "export"
    assert _export(cached, fmt, out) == 0
    capsys.readouterr()
    store = tmp_path / "store"
    shifted = [k + 1 for k in DRAFTER_LAYERS] + ([LAST] if fmt == "speculators" else [])
    code, (_, err) = _shifted_import(fmt, out, store, target_path, capsys, shifted)
    assert code == 6 and "Traceback" not in err
    assert "column 0 (declared layer 4): matches layer 3, the output of decoder layer 3: the input of layer 4" in err
    assert "column 1 (declared layer 2): matches layer 1" in err
    held = "--layer 3 --layer 1" + (" --layer 5" if fmt == "speculators" else "")
    assert f"Import them with the layers they hold: {held} (" in err and "--no-check" in err
    assert open_store(store).list_manifests() == []  # nothing written
    code, (o, _) = _shifted_import(fmt, out, store, target_path, capsys, shifted, extra=["--json"])
    doc = json.loads(o)
    assert code == 6 and doc["exit_code"] == 6 and not doc["layer_check"]["ok"]
    assert [(c["declared"], c["layer"]) for c in doc["layer_check"]["columns"]][:2] == [(4, 3), (2, 1)]
    # --no-check: imported as declared, and marked so where `ls` and `show` look
    code, (o, _) = _shifted_import(fmt, out, store, target_path, capsys, shifted, extra=["--no-check", "--json"])
    res = json.loads(o)
    assert code == 0 and res["provenance"] == UNCHECKED and res["layer_check"] == {"checked": False,
                                                                                  "reason": "--no-check"}
    assert cli_main(["--store", str(store), "ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(UNCHECKED in r["summary"] for r in rows), [r["summary"] for r in rows]
    assert cli_main(["--store", str(store), "show", res["tokens_key"], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["provenance"]["imported"] == UNCHECKED and shown["provenance"]["layer_check"]["checked"] is False
    # The right declaration, checked, is its own import artifact over the same samples.
    right = DRAFTER_LAYERS + ([LAST] if fmt == "speculators" else [])
    code, (o, _) = _shifted_import(fmt, out, store, target_path, capsys, right, extra=["--json"])
    ok = json.loads(o)
    assert code == 0 and ok["provenance"] == CHECKED and not ok["already_imported"] and ok["reused"] == 4


def _hf_dir(target_path, ds, root, pick, n=2):
    """A SpecForge directory made the way its transformers backend makes one: a plain
    ``output_hidden_states`` forward, ``pick(hidden_states)`` the columns, in bfloat16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.bfloat16).eval()
    (root / "rows_0-2000").mkdir(parents=True)
    for i in range(n):
        it = ds[i]
        with torch.no_grad():
            hs = model(input_ids=it["input_ids"], output_hidden_states=True).hidden_states
        torch.save({"input_ids": it["input_ids"][0].clone(), "loss_mask": it["loss_mask"][0].clone(),
                    "hidden_states": torch.cat(pick(hs), dim=-1).clone()}, root / "rows_0-2000" / f"data_{i}.ckpt")
    return root


def test_import_check_knows_transformers_indices_the_final_norm_and_the_embeddings(cached, target_path, tmp_path,
                                                                                  capsys):
    """transformers' hidden_states[k+1] is dfcache's layer k (SpecForge's HF backend): accepted.
    Its last entry is after the final norm and its first the embeddings: declared as layers 5
    and 0, both refused, named for what they are."""
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1], **cached["sel"])
    right = _hf_dir(target_path, ds, tmp_path / "right", lambda hs: [hs[4], hs[2]])
    assert _import(tmp_path / "s1", "specforge", right, target_path, 3, 1, extra=["--json"]) == 0
    check = json.loads(capsys.readouterr().out)["layer_check"]
    assert check["ok"] and all(c["declared_distance"] <= check["tolerance"] for c in check["columns"])
    ends = _hf_dir(target_path, ds, tmp_path / "ends", lambda hs: [hs[-1], hs[0]])
    assert _import(tmp_path / "s2", "specforge", ends, target_path, LAST, 0) == 6
    err = capsys.readouterr().err
    assert "column 0 (declared layer 5): matches the last layer after the final norm" in err
    assert "column 1 (declared layer 0): matches the embedding output" in err
    assert err.count("which no dfcache layer id names") == 2 and "before the final norm" in err


def test_gpu_declared_states_are_checked_on_the_cpu_within_the_cross_kernel_tolerance(cached, target_path,
                                                                                      tmp_path, capsys):
    from runner.peers.import_check import TOLERANCE_CROSS

    ds = api.hidden_state_dataset(store=cached["store"], layers=[1, 3], **cached["sel"])
    src = _modelopt_dir(ds, tmp_path / "mo", n=2)
    gpu = ["--backend", "fla", "--device", "cuda"]  # declared (key material); nothing here runs on a GPU
    args = ["--store", str(tmp_path / "s"), "import", str(src), "--format", "modelopt", "--target", target_path,
            *gpu, "--no-progress", "--json"]
    assert cli_main([*args, "--layer", "1", "--layer", "3"]) == 0
    check = json.loads(capsys.readouterr().out)["layer_check"]
    assert check["ok"] and not check["same_class"] and check["tolerance"] == TOLERANCE_CROSS
    assert check["recomputed_with"] == "torch/cpu/bfloat16/sdpa"
    assert cli_main([*args, "--layer", "2", "--layer", "4"]) == 6
    assert [c["layer"] for c in json.loads(capsys.readouterr().out)["layer_check"]["columns"]] == [1, 3]
    # The right layers, but 3 % off: not this CPU class's rounding (declared torch/cpu, tolerance 1e-2).
    for f in src.glob("*.pt"):
        rec = torch.load(f, weights_only=True)
        rec["aux_hidden_states"] = (rec["aux_hidden_states"].float() * 1.03).to(torch.bfloat16)
        torch.save(rec, f)
    assert _import(tmp_path / "s2", "modelopt", src, target_path, 1, 3) == 6
    err = capsys.readouterr().err
    assert "nearest is the declared layer, but at 2.9e-02, over the tolerance 0.01 of this backend class" in err, err


def test_layer_check_tolerance_lies_between_kernel_rounding_and_the_next_layer(cached, target_path):
    """What TOLERANCE_CROSS rests on, measured here: bf16 states against a float32 CPU
    recomputation (another rounding, as another kernel class gives) stay under it; the nearest
    other layer stays over it; the same class recomputed is the same bits."""
    from runner.peers.import_check import TOLERANCE_CROSS, candidates, distance, recompute
    from runner.models.target import KernelSpec

    ds = api.hidden_state_dataset(store=cached["store"], layers=[1, 3, LAST], **cached["sel"])
    it = ds[0]
    ids, stored = it["input_ids"][0].numpy(), it["hidden_states"][0].float().numpy()
    cands = candidates([1, 3, LAST], 6)
    same = recompute(target_path, KernelSpec("torch", "cpu", "bfloat16", "sdpa"), ids, cands)
    wide = recompute(target_path, KernelSpec("torch", "cpu", "float32", "sdpa"), ids, cands)
    for j, k in enumerate([1, 3, LAST]):
        col = stored[:, j * 128:(j + 1) * 128]
        assert distance(col, same[f"layer {k}"]) == 0.0
        rounding = distance(col, wide[f"layer {k}"])
        nearest_other = min(distance(col, v) for name, v in same.items() if name != f"layer {k}")
        assert 0 < rounding < TOLERANCE_CROSS / 3 and nearest_other > TOLERANCE_CROSS, (k, rounding, nearest_other)


def _modelopt_dir(ds, root, n=3):
    root.mkdir()
    for i in range(n):  # ModelOpt's layout: input_ids and the layers concatenated as aux_hidden_states
        it = ds[i]
        torch.save({"input_ids": it["input_ids"][0], "aux_hidden_states": it["hidden_states"][0].clone()},
                   root / f"{i}.pt")
    return root


def test_verify_recompute_agrees_on_an_honest_import_and_flags_a_wrong_declaration(cached, target_path, tmp_path,
                                                                                   capsys):
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1, 3], **cached["sel"])
    src = _modelopt_dir(ds, tmp_path / "mo")
    honest, wrong = tmp_path / "honest", tmp_path / "wrong"
    assert _import(honest, "modelopt", src, target_path, 1, 3) == 0
    assert _import(wrong, "modelopt", src, target_path, 3, 1) == 6  # declares the layers swapped: refused
    assert "--layer 1 --layer 3" in capsys.readouterr().err
    assert _import(wrong, "modelopt", src, target_path, 3, 1, extra=["--no-check"]) == 0  # imported as declared
    capsys.readouterr()
    assert cli_main(["--store", str(honest), "verify", "--recompute", "2", "--json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out)
    (got,) = res["recomputed"]
    assert got["layers"] == [1, 3] and got["samples_in_set"] == 3 and got["recomputed"] == 2 and got["agrees"]
    assert [s["index"] for s in got["samples"]] == [0, 2]  # spread over the set, first and last
    for s in got["samples"]:
        assert all(x["rel_l2"] <= 1e-2 and x["cos_min"] > 0.999 for x in s["layers"])
    assert cli_main(["--store", str(wrong), "verify", "--recompute", "1", "--no-progress"]) == 5
    out, err = capsys.readouterr()
    assert "0 of 1 sample(s) agree" in out and "DIFF sample 0" in out
    assert "disagree with a recomputation" in err and "import again" in err
    assert cli_main(["--store", str(honest), "verify", "--recompute", "0"]) == 2
    assert "positive number" in capsys.readouterr().err
    assert cli_main(["--store", str(cached["store"]), "verify", "--recompute", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recomputed"] == []  # nothing imported there


def test_a_grown_or_subset_import_reuses_the_cached_samples(cached, target_path, tmp_path, capsys):
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1, 3], **cached["sel"])
    full = _modelopt_dir(ds, tmp_path / "all", n=4)
    first = tmp_path / "first"
    first.mkdir()
    for i in (2, 0):
        (first / f"{i}.pt").write_bytes((full / f"{i}.pt").read_bytes())
    store = tmp_path / "grow"
    assert _import(store, "modelopt", first, target_path, 1, 3, extra=["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reused"] == 0
    st = open_store(store)
    segments = {m.key for m in st.list_manifests() if m.samples}
    assert _import(store, "modelopt", full, target_path, 1, 3, extra=["--json"]) == 0
    grown = json.loads(capsys.readouterr().out)
    assert grown["samples"] == 4 and grown["reused"] == 2
    st = open_store(store)
    new = [m for m in st.list_manifests() if m.samples and m.key not in segments]
    assert len(new) == 3 and all(len(m.samples["keys"]) == 2 for m in new)  # tokens + 2 layers, 2 new samples each
    got = api.hidden_state_dataset(store=store, tokens_key=grown["tokens_key"], layers=[3, 1])
    assert len(got) == 4  # in file order, assembled from both imports' segments
    for i in range(4):
        want = torch.cat([ds[i]["hidden_states"][0, :, 128:], ds[i]["hidden_states"][0, :, :128]], dim=1)
        assert _same(got[i]["hidden_states"][0], want) and _same(got[i]["input_ids"], ds[i]["input_ids"])
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "3.pt").write_bytes((full / "3.pt").read_bytes())
    (sub / "1.pt").write_bytes((full / "1.pt").read_bytes())
    assert _import(store, "modelopt", sub, target_path, 1, 3, extra=["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reused"] == 2
    assert len([m for m in open_store(store).list_manifests() if m.samples]) == len(segments) + 3  # nothing new
    one = api.hidden_state_dataset(store=store, tokens_key=json.loads(json.dumps(grown))["tokens_key"], layers=[1])
    assert one.keys() != got.keys() and len(set(one.keys())) == 4


def test_export_and_import_errors_are_json_under_json(cached, target_path, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert _export(cached, "specforge", foreign, "--json") == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 2 and "not empty" in doc["error"] and doc["type"] == "UsageError"
    code = cli_main(["--store", str(cached["store"]), "export", "--format", "specforge", "--out",
                     str(tmp_path / "never"), "--layer", "2", "--json", *_cli_sel(cached)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 3 and doc["exit_code"] == 3 and "run hidden-states" in doc["error"] and doc["missing"]
    assert _import(tmp_path / "s", "specforge", tmp_path / "absent", target_path, 1, extra=["--json"]) == 6
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 6 and "not a directory" in doc["error"]
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1], **cached["sel"])
    src = _modelopt_dir(ds, tmp_path / "mo", n=2)
    (src / "5.pt").write_bytes((src / "0.pt").read_bytes()[:100])  # truncated
    assert _import(tmp_path / "s", "modelopt", src, target_path, 1, extra=["--json"]) == 6
    doc = json.loads(capsys.readouterr().out)  # one object: what was imported, and the error
    assert doc["exit_code"] == 6 and doc["samples"] == 2 and [r["file"] for r in doc["refused"]] == ["5.pt"]
    assert "refused 1 of 3" in doc["error"]


def test_read_raw_into_a_reused_buffer(cached):
    from dfcache.errors import UsageError

    ds = api.hidden_state_dataset(store=cached["store"], layers=[1], **cached["sel"])
    arr = open_store(cached["store"]).open(_layer_segment(ds.source)).array("hidden")
    n = arr.shape[0]
    assert n >= 8
    buf = np.full((n + 10,) + arr.shape[1:], 7, dtype=np.uint16)
    got = arr.read_raw(2, n, out=buf)
    assert got.base is buf or got.base is buf.base
    assert np.array_equal(got, arr.read_raw(2, n))
    with pytest.raises(UsageError):
        arr.read_raw(0, n // 2, out=buf[: n // 4])  # too few rows


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float32, np.int64])
def test_copy_rows_keeps_every_bit_into_the_columns_of_a_wider_array_from_a_read_only_map(tmp_path, dtype):
    import mmap
    import warnings

    from dfcache.training import copy_rows

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=37 * 24 * np.dtype(dtype).itemsize, dtype=np.uint8)  # NaN payloads too
    path = tmp_path / "rows.bin"
    path.write_bytes(raw.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    src = np.frombuffer(mm, dtype=dtype).reshape(37, 24)  # read-only, as a mapped chunk
    wide = np.zeros((37, 3 * 24), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning about a read-only array must not reach the user
        copy_rows(wide[:, 24:48], src)
    assert wide[:, 24:48].tobytes() == src.tobytes()
    assert not wide[:, :24].any() and not wide[:, 48:].any()  # nothing written beside the columns
    del src
    mm.close()


def test_mapped_reads_copy_through_the_callers_copy(cached):
    ds = api.hidden_state_dataset(store=cached["store"], layers=[1], **cached["sel"])
    arr = open_store(cached["store"]).open(_layer_segment(ds.source)).array("hidden")
    n = arr.shape[0]
    calls = []

    def copy(dst, src):
        calls.append(len(src))
        dst[...] = src

    out = np.zeros((n, 2) + arr.shape[1:], dtype=np.uint16)[:, 1]  # strided rows, as an item's columns
    got = arr.read_raw(0, n, out=out, mapped=True, copy=copy)
    assert sum(calls) == n  # every row went through it, chunk by chunk
    assert np.array_equal(got, arr.read_raw(0, n))


def _layer_segment(source) -> str:
    """The key of the segment that holds the selection's first sample of its first layer."""
    return source._open()["layers"][0].segment(0)[0].key


def test_mapped_reads_check_each_chunk_and_refuse_a_corrupt_one(cached, tmp_path):
    import shutil

    from dfcache.errors import IntegrityError

    store_dir = tmp_path / "copy"
    shutil.copytree(cached["store"], store_dir)
    ds = api.hidden_state_dataset(store=store_dir, layers=[1], **cached["sel"])
    arr = open_store(store_dir).open(_layer_segment(ds.source)).array("hidden")
    n = arr.shape[0]
    assert np.array_equal(arr.read_raw(0, n, mapped=True), arr.read_raw(0, n))
    wide = np.zeros((n, 3 * 128), dtype=np.uint16)
    arr.read_raw(0, n, out=wide[:, 128:256], mapped=True)  # columns of a wider array
    assert np.array_equal(wide[:, 128:256], arr.read_raw(0, n)) and not wide[:, :128].any()
    key = _layer_segment(ds.source)
    chunk = next(p for p in store_dir.rglob("hidden/c/0/0") if key in str(p))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    fresh = open_store(store_dir).open(_layer_segment(ds.source)).array("hidden")
    with pytest.raises(IntegrityError, match="crc32c"):
        fresh.read_raw(0, 10, mapped=True)


def test_a_chunk_changed_after_the_parent_read_it_is_refused_in_a_forked_worker(cached, tmp_path, monkeypatch):
    """A forked worker inherits the parent's mapped, checked chunks; one changed on disk since is
    checked again (in the worker, and in the parent's next read), never served as it was."""
    import shutil

    from dfcache.errors import IntegrityError
    from dfcache.store import _reader

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method here")
    monkeypatch.setattr(_reader, "RACY_NS", -(1 << 62))  # the parent's checks are remembered at once
    store_dir = tmp_path / "copy"
    shutil.copytree(cached["store"], store_dir)
    ds = api.hidden_state_dataset(store=store_dir, layers=[1], **cached["sel"])
    assert _collect(ds, "fork", workers=1)  # reads fine, and the parent maps every chunk:
    for i in range(len(ds)):
        ds[i]
    key = _layer_segment(ds.source)
    chunk = next(p for p in store_dir.rglob("hidden/c/0/0") if key in str(p))
    st = os.stat(chunk)
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    with open(chunk, "r+b") as f:
        f.write(bytes(data))
    os.utime(chunk, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(Exception, match="crc32c"):
        _collect(ds, "fork", workers=1)
    with pytest.raises(IntegrityError, match="crc32c"):
        for i in range(len(ds)):
            ds[i]


# ------------------------------------------------------------------------------ concatenated


def _store_copy(cached, tmp_path):
    import shutil

    shutil.copytree(cached["store"], tmp_path / "copy")
    return tmp_path / "copy"


def _mapped_file_of(ptr: int) -> str | None:
    """The file the memory at ``ptr`` is a map of (/proc/self/maps), None for anonymous memory."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) == 6 and parts[5].strip().startswith("/") else None
    return None


def test_concatenated_items_are_the_same_items_as_maps_of_their_rows(cached, tmp_path, monkeypatch):
    from dfcache.store import _reader

    monkeypatch.setattr(_reader, "RACY_NS", -(1 << 62))  # checks remembered at once (no 2 s wait)
    store_dir = _store_copy(cached, tmp_path)
    plain = api.hidden_state_dataset(store=store_dir, drafters=[str(cached["drafter"])], **cached["sel"])
    ds = api.hidden_state_dataset(store=store_dir, drafters=[str(cached["drafter"])], concatenated=True, **cached["sel"])
    assert ds.source.concatenated is not None and len(ds) == len(plain) == 4
    for i in range(len(ds)):
        a, b = plain[i], ds[i]
        assert a["key"] == b["key"]
        for name in ("input_ids", "loss_mask", "hidden_states"):
            assert _same(a[name], b[name]), (i, name)
    # No copy: the item's hidden states are memory of the concatenated copy's chunk file itself.
    if os.path.exists("/proc/self/maps"):
        item = ds[2]
        where = _mapped_file_of(item["hidden_states"].data_ptr())
        assert where is not None and "/hidden/c/0" in where and str(store_dir) in where, where
        assert _mapped_file_of(plain[2]["hidden_states"].data_ptr()) is None  # the per-layer item is a copy
    # Private: writing to an item changes neither the file nor a later read of the sample.
    before = plain[1]["hidden_states"].clone()
    ds[1]["hidden_states"].zero_()
    assert _same(ds[1]["hidden_states"], before) and _same(plain[1]["hidden_states"], before)
    # Workers read the same items (forked: into shared memory, not maps of the parent's pages).
    if "fork" in multiprocessing.get_all_start_methods():
        got = _collect(ds, "fork", workers=2)
        assert sorted(got) == sorted(ds.keys())
        for i in range(len(ds)):
            assert _same(got[ds[i]["key"]]["hidden_states"], plain[i]["hidden_states"])


def test_concat_writes_only_what_is_missing_and_resumes_after_an_interrupt(cached, tmp_path, monkeypatch):
    from runner.core import concat as concat_mod

    store_dir = _store_copy(cached, tmp_path)
    monkeypatch.setattr(concat_mod, "SEGMENT_BYTES", 1)  # a segment per sample: commits to count
    sel = {**cached["sel"], "num_prompts": 2}
    source = api.hidden_state_dataset(store=store_dir, layers=[1, LAST], **sel).source
    res = concat_mod.concat(source, open_store(store_dir))
    assert (res.written, res.already, len(res.segments)) == (2, 0, 2)

    class Interrupt:  # a progress bar that stops the run after its first sample, as Ctrl-C would
        def __init__(self, n):
            self.n = n

        def update(self, k):
            raise KeyboardInterrupt

        def close(self):
            pass

    grown = api.hidden_state_dataset(store=store_dir, layers=[1, LAST], **cached["sel"]).source
    with pytest.raises(KeyboardInterrupt):
        concat_mod.concat(grown, open_store(store_dir), progress=Interrupt)
    res = concat_mod.concat(grown, open_store(store_dir))  # the grown set: 2 cached, 1 from the interrupted run
    assert (res.samples, res.written, res.already) == (4, 1, 3)
    again = concat_mod.concat(grown, open_store(store_dir))
    assert (again.written, again.already, again.bytes_written) == (0, 4, 0)
    plain = api.hidden_state_dataset(store=store_dir, layers=[1, LAST], **cached["sel"])
    _assert_same_dataset(plain, HiddenStateDataset(grown))
    # Another layer order is another copy (its rows differ), never a stale hit.
    other = api.hidden_state_dataset(store=store_dir, layers=[LAST, 1], concatenated=True, **cached["sel"])
    assert other.source.concatenated[0] != grown.concatenated[0]
    assert _same(other[0]["hidden_states"][0, :, :128], plain[0]["hidden_states"][0, :, 128:])


def test_a_corrupt_concatenated_chunk_is_refused(cached, tmp_path, monkeypatch):
    from dfcache.errors import IntegrityError
    from dfcache.store import _reader

    monkeypatch.setattr(_reader, "RACY_NS", -(1 << 62))
    store_dir = _store_copy(cached, tmp_path)
    ds = api.hidden_state_dataset(store=store_dir, layers=[1], concatenated=True, **cached["sel"])
    seg = ds.source._open()["concatenated"].segment(0)[0].key
    chunk = next(p for p in store_dir.rglob("hidden/c/0/0") if seg in str(p))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    fresh = api.hidden_state_dataset(store=store_dir, layers=[1], concatenated=True, **cached["sel"])
    with pytest.raises(IntegrityError, match="crc32c"):
        fresh[0]


def test_concat_command_prints_and_json_and_refuses_an_uncached_selection(cached, tmp_path, capsys):
    store_dir = _store_copy(cached, tmp_path)
    code = cli_main(["--store", str(store_dir), "concat", "--drafter", str(cached["drafter"]), "--no-progress",
                     *_cli_sel(cached)])
    out = capsys.readouterr().out
    assert code == 0 and "stored 4 sample(s) of layers [3, 1] concatenated" in out and "concatenated_hidden_states" in out
    code = cli_main(["--store", str(store_dir), "--json", "concat", "--drafter", str(cached["drafter"]),
                     *_cli_sel(cached)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["written"] == 0 and doc["already"] == 4 and doc["layers"] == DRAFTER_LAYERS
    code = cli_main(["--store", str(store_dir), "--json", "ls"])
    listed = json.loads(capsys.readouterr().out)
    rows = listed if isinstance(listed, list) else listed.get("artifacts", [])
    assert any(r.get("stage") == "concatenated_hidden_states" for r in rows)
    before = sorted(p.relative_to(store_dir) for p in store_dir.rglob("*") if "index" not in p.parts)
    code = cli_main(["--store", str(store_dir), "concat", "--layer", "2", "--no-progress", *_cli_sel(cached)])
    err = capsys.readouterr().err
    assert code == 3 and "run hidden-states" in err and "--layer 2" in err and "Traceback" not in err
    assert sorted(p.relative_to(store_dir) for p in store_dir.rglob("*") if "index" not in p.parts) == before
    # gc removes the copy (nothing depends on it); the per-layer states stay and a later call rewrites it.
    code = cli_main(["--store", str(store_dir), "gc", "--stage", "concatenated_hidden_states", "--yes"])
    capsys.readouterr()
    assert code == 0
    from runner.core.concat import concat

    plain = api.hidden_state_dataset(store=store_dir, drafters=[str(cached["drafter"])], **cached["sel"])
    again = api.hidden_state_dataset(store=store_dir, drafters=[str(cached["drafter"])], **cached["sel"])
    assert concat(again.source, open_store(store_dir)).written == 4
    _assert_same_dataset(plain, again)
