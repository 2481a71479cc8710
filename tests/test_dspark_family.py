"""A DSpark checkpoint (a DFlash backbone plus a Markov head, SpecForge's layout) is not mistaken for
a DFlash one: `run eval` refuses it at planning (exit 6, store unchanged); without a Markov head it
drafts as its backbone and is DFlash's."""

from __future__ import annotations

import json
import shutil

from runner.drafters.family import DFlash, family_of

from cli_util import dfcache  # noqa: E402  (tests/ is on sys.path under pytest's rootdir)


def _dspark(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["DSparkDraftModel"]
    cfg["dflash_config"] = {**cfg["dflash_config"], "projector_type": "dspark", **fields}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, cfg


def test_dspark_with_a_markov_head_is_refused_before_any_work(tiny_target, tmp_path):
    from runner.models.train_tiny import make_untrained_drafter

    dflash = make_untrained_drafter(tiny_target, tmp_path / "dflash")
    path, _ = _dspark(dflash, tmp_path / "dspark", markov_rank=8, markov_head_type="rnn")
    store = tmp_path / "store"
    r = dfcache("run", "eval", "--target", tiny_target, "--drafter", path, "--completions", "local",
                "--num-prompts", "1", store=store)
    assert r.code == 6, r.err
    assert "DSpark" in r.err and "DSparkDraftModel" in r.err and "markov_rank 0" in r.err
    assert "Traceback" not in r.err
    assert {f.name for f in store.rglob("*") if f.is_file()} <= {"dfcache-store.json"}


def test_dspark_without_a_markov_head_is_dflash(tiny_target, tmp_path):
    from runner.models.train_tiny import make_untrained_drafter

    dflash = make_untrained_drafter(tiny_target, tmp_path / "dflash")
    path, cfg = _dspark(dflash, tmp_path / "dspark", markov_rank=0, confidence_head_alpha=1.0)
    assert family_of(path, cfg) is DFlash
    cfg["dflash_config"]["markov_rank"] = 4
    assert not DFlash.recognises(cfg)
    assert DFlash.recognises(json.loads((dflash / "config.json").read_text()))
