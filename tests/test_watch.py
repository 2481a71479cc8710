"""Training-loop companion: `--drafter` globs and training directories, `dfcache watch`, the
τ-by-step report and its HTML page (checked in a real headless Chromium).

One tiny target (the session fixture), one short training whose checkpoints at steps 2, 6 and
12 are saved in the Hugging Face Trainer layout, and a reference drafter trained longer, are
built once; every command runs in its own process through the real command line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_util import hub_offline_env, python_c

from runner.drafters.checkpoints import (expand_drafter_arg, glob_checkpoints, incomplete_reason, step_from_name,
                                         training_checkpoints)
from runner.commands.watch import Readiness

STEPS = (2, 6, 12)
EVAL = ["--num-prompts", "2", "--max-new-tokens", "16", "--tree-budget", "4", "--dtype", "float32",
        "--device", "cpu", "--backend", "torch", "--no-progress"]

# Runs dfcache.cli.main and reports, on its last stderr line, the exit code and whether torch got imported.
_WRAPPER = r"""
import json, sys
from dfcache.cli import main
rc = main(sys.argv[1:])
sys.stderr.write("\n@@watch-test " + json.dumps({"torch": "torch" in sys.modules}) + "\n")
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return hub_offline_env(tmp_path_factory.mktemp("watch-home"))


# cli() runs _WRAPPER in children of a fork server started with the module's `env`
# (cli_util.python_c): ~1 s of CPU less a command; it imports no torch, so whether a command did is
# still seen. The Ctrl-C test below starts its own interpreter.
_ZYGOTE = None


@pytest.fixture(scope="module", autouse=True)
def _fork_server(module_fork_server):  # conftest: sets _ZYGOTE
    yield


def cli(env, store, *args, timeout=300):
    p = python_c(_ZYGOTE, _WRAPPER, "--store", store, *args, env=env, cwd=store.parent, timeout=timeout)
    err, _, tail = p.stderr.rpartition("@@watch-test ")
    torch_imported = json.loads(tail)["torch"] if tail.strip() else None
    return p.returncode, p.stdout, err, torch_imported


def save_checkpoint(src: Path, dest: Path, step: int) -> Path:
    """Copy a drafter into ``dest`` as the Trainer does: a staging name, then one rename."""
    tmp = dest.with_name(f"tmp-{dest.name}")
    shutil.copytree(src, tmp)
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    os.rename(tmp, dest)
    return dest


@pytest.fixture(scope="module")
def training(tiny_target, tmp_path_factory):
    from runner.models.train_tiny import DEFAULT_LAYER_IDS, build_training_data, single_thread, train_tiny_drafter

    root = tmp_path_factory.mktemp("training")
    with single_thread():
        data = build_training_data(tiny_target, DEFAULT_LAYER_IDS, max_new_tokens=16)
    made = root / "made"
    for step in STEPS:
        train_tiny_drafter(tiny_target, made / f"s{step}", steps=step, data=data)
    train_tiny_drafter(tiny_target, root / "reference", steps=24, data=data)
    run = root / "run"
    run.mkdir()
    for step in STEPS:
        save_checkpoint(made / f"s{step}", run / f"checkpoint-{step}", step)
    (run / "runs").mkdir()  # what a Trainer also writes there (tensorboard logs): not a checkpoint
    return {"root": root, "run": run, "made": made, "reference": root / "reference", "target": tiny_target}


@pytest.fixture(scope="module")
def watched(training, env, tmp_path_factory):
    """`watch RUN --once --reference REF --json` into a fresh store: everything is computed."""
    import contextlib
    import dataclasses
    import io

    from dfcache.cli import main
    from dfcache.cli.common import state

    # In this process, whose torch and transformers are already imported (the training above):
    # that is most of a first run's time. The other tests run the command line in subprocesses.
    store = tmp_path_factory.mktemp("watch-store") / "store"
    saved = dataclasses.replace(state)
    keep = {k: os.environ.get(k) for k in env}
    os.environ.update({k: env[k] for k in ("DFCACHE_HOME", "DFCACHE_CONFIG")})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--store", str(store), "watch", str(training["run"]), "--once", "--interval", "0",
                       "--reference", str(training["reference"]), "--target", str(training["target"]), *EVAL,
                       "--json"])
    finally:
        for k, v in dataclasses.asdict(saved).items():
            setattr(state, k, v)
        for k in ("DFCACHE_HOME", "DFCACHE_CONFIG"):
            if keep[k] is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = keep[k]
    assert rc == 0, err.getvalue()
    return {"store": store, "doc": json.loads(out.getvalue()), "err": err.getvalue()}


# ----------------------------------------------------------------------------- checkpoints


def test_steps_come_from_trainer_state_or_the_name_and_order_the_checkpoints(tmp_path):
    names = {"checkpoint-500": 500, "checkpoint_7": 7, "step_1200": 1200, "step-30": 30, "global_step90": 90,
             "iter_0000400": 400, "epoch_1_step_800": 800, "ckpt-3": 3, "tmp-checkpoint-9": None,
             "final": None, "logs": None}
    assert {n: step_from_name(n) for n in names} == names
    assert step_from_name("drafter-v2-20k-at-2000", loose=True) == 2000
    for name in ("checkpoint-1000", "checkpoint-200", "step_50", "tmp-checkpoint-300", ".checkpoint-5", "logs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    # A Trainer resumed into a renamed directory: trainer_state.json's global_step wins over the name.
    (tmp_path / "last").mkdir()
    (tmp_path / "last" / "config.json").write_text("{}")
    (tmp_path / "last" / "trainer_state.json").write_text('{"global_step": 1500}')
    found = training_checkpoints(tmp_path)
    assert [(c.path.name, c.step) for c in found] == [("step_50", 50), ("checkpoint-200", 200),
                                                      ("checkpoint-1000", 1000), ("last", 1500)]
    assert [c.path.name for c in glob_checkpoints(str(tmp_path / "checkpoint-*"))] == ["checkpoint-200",
                                                                                      "checkpoint-1000"]
    several, many = expand_drafter_arg(str(tmp_path))
    assert many and [c.step for c in several] == [50, 200, 1000, 1500]
    single, many = expand_drafter_arg(str(tmp_path / "checkpoint-200"))
    assert not many and [(c.path.name, c.step) for c in single] == [("checkpoint-200", 200)]


def test_a_checkpoint_being_written_is_never_complete(training, tmp_path):
    ck = shutil.copytree(training["run"] / "checkpoint-2", tmp_path / "checkpoint-2")
    assert incomplete_reason(ck) is None
    weights = ck / "model.safetensors"
    data = weights.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for cut, words in ((4, "shorter than a safetensors header"), (8 + n // 2, "header"),
                       (len(data) - 100, "header describes")):
        weights.write_bytes(data[:cut])
        assert words in incomplete_reason(ck), cut
    weights.write_bytes(data)
    (ck / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert "model-00002-of-00002.safetensors" in incomplete_reason(ck)
    (ck / "model.safetensors.index.json").unlink()
    (ck / "config.json").write_text('{"dflash_config": ')
    assert "config.json" in incomplete_reason(ck)


def test_readiness_waits_until_nothing_changed_for_the_interval(training, tmp_path):
    now = [1_000_000.0]
    ck = shutil.copytree(training["run"] / "checkpoint-2", tmp_path / "checkpoint-2")

    def touch(t):
        for f in ck.iterdir():
            os.utime(f, (t, t))

    touch(now[0])  # just written
    r = Readiness(30.0, clock=lambda: now[0])
    ok, why, wait = r.check(ck)
    assert not ok and "being written" in why and wait == 30.0
    now[0] += 10
    assert not r.check(ck)[0]
    now[0] += 25  # unchanged for 35 s
    assert r.check(ck)[0]
    (ck / "model.safetensors").write_bytes((ck / "model.safetensors").read_bytes())  # rewritten
    touch(now[0])
    assert not r.check(ck)[0]
    touch(now[0] - 3600)  # an old checkpoint is taken at the first look
    assert Readiness(30.0, clock=lambda: now[0]).check(ck)[0]


# ----------------------------------------------------------------------------- run eval --drafter GLOB|DIR


def test_run_eval_takes_a_glob_or_a_training_directory_in_step_order(training, watched, env, tmp_path):
    run, store = training["run"], watched["store"]
    half = shutil.copytree(run / "checkpoint-2", tmp_path / "checkpoint-99")
    weights = half / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # the trainer is still writing it
    shutil.copytree(run / "checkpoint-6", tmp_path / "checkpoint-6")
    shutil.copytree(run / "checkpoint-12", tmp_path / "checkpoint-12")
    rc, out, err, _ = cli(env, store, "run", "eval", "--drafter", str(tmp_path / "checkpoint-*"),
                          "--target", training["target"], *EVAL, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [(d["drafter"], d["step"]) for d in doc["drafters"]] == [("checkpoint-6", 6), ("checkpoint-12", 12)]
    assert "skipping" in err and "checkpoint-99" in err
    # The same checkpoints as watch evaluated them: same keys (content fingerprints), nothing recomputed
    # but the report.
    by_step = {c["step"]: c["key"] for c in watched["doc"]["checkpoints"]}
    assert [d["key"] for d in doc["drafters"]] == [by_step[6], by_step[12]]
    assert [open_stage(store, k) for k in doc["computed"]] == ["report"]
    rc, out, err, _ = cli(env, store, "run", "eval", "--drafter", run, "--drafter", training["reference"],
                          "--target", training["target"], *EVAL, "--json")
    assert rc == 0, err
    assert [d["step"] for d in json.loads(out)["drafters"]] == [*STEPS, None]
    html = Path(json.loads(out)["files"]["report.html"]).read_text()
    assert 'id="summary"' in html and html.count('class="per-prompt"') in (2, 3)
    # The latest is the highest step, not the last --drafter (the reference, which has none).
    assert 'data-drafter="latest: checkpoint-12 (step 12)"' in html \
        and re.search(r'data-drafter="(best: )?reference"', html)
    assert Path(json.loads(out)["files"]["tau_by_step.png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def open_stage(store, key):
    from dfcache import open_store

    return open_store(store).manifest(key).stage


@pytest.mark.parametrize("value, words", [
    ("{run}/step_*", "matches no checkpoint directory"),
    ("{run}/runs", "has no config.json and no checkpoint subdirectories"),
    ("{root}/absent", "is not a directory"),
])
def test_a_drafter_glob_or_directory_without_checkpoints_is_one_clear_message(value, words, training, env, tmp_path):
    store = tmp_path / "store"
    rc, out, err, _ = cli(env, store, "run", "eval", "--drafter", value.format(**training),
                          "--target", training["target"], *EVAL)
    assert rc == 6, err
    assert words in err and "Traceback" not in err and err.count("error:") == 1, err
    assert committed(store) == set()


def committed(store) -> set:
    from dfcache import open_store

    return set(open_store(store).keys()) if store.exists() else set()


# ----------------------------------------------------------------------------- watch


def test_watch_once_evaluates_every_checkpoint_in_step_order(watched, training):
    doc = watched["doc"]
    cps = doc["checkpoints"]
    assert [c["step"] for c in cps] == list(STEPS)
    assert [Path(c["path"]).name for c in cps] == [f"checkpoint-{s}" for s in STEPS]
    assert all(c["computed"] for c in cps) and doc["reference"]["computed"]
    assert len({c["key"] for c in cps}) == 3
    for c in cps + [doc["reference"]]:
        assert 1.0 <= c["tau_chain"] <= 8.0 and set(c["tau_tree"]) == {"4"}
    # the longer-trained reference drafts better than the 2-step checkpoint
    assert doc["reference"]["tau_chain"] > cps[0]["tau_chain"]
    assert doc["pending"] == [] and doc["failed"] == []
    files = {k: Path(v) for k, v in doc["files"].items()}
    assert set(files) == {"watch.json", "watch.md", "tau_by_step.png", "histograms.png", "report.html"}
    assert json.loads(files["watch.json"].read_text())["checkpoints"] == cps
    for name in ("tau_by_step.png", "histograms.png"):
        assert files[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = files["watch.md"].read_text()
    assert md.index("| 2 | checkpoint-2") < md.index("| 6 | checkpoint-6") < md.index("| 12 | checkpoint-12")


def test_watch_again_reuses_everything_imports_no_torch_and_shows_the_chosen_checkpoint(watched, training, env):
    rc, out, err, torch_imported = cli(env, watched["store"], "watch", training["run"], "--once", "--interval", "0",
                                       "--reference", training["reference"], "--target", training["target"],
                                       *EVAL, "--json", "--html-checkpoint", "6")
    assert rc == 0, err
    doc = json.loads(out)
    assert [c["key"] for c in doc["checkpoints"]] == [c["key"] for c in watched["doc"]["checkpoints"]]
    assert not any(c["computed"] for c in doc["checkpoints"]) and not doc["reference"]["computed"]
    assert torch_imported is False
    html = Path(doc["files"]["report.html"]).read_text()
    assert 'data-drafter="latest: checkpoint-12 (step 12)"' in html
    assert 'data-drafter="chosen: checkpoint-6 (step 6)"' in html
    assert 'data-drafter="reference: reference"' in html


def test_watch_keeps_watching_takes_new_complete_checkpoints_and_stops_cleanly_on_ctrl_c(watched, training, env,
                                                                                          tmp_path):
    store, run = watched["store"], tmp_path / "run"
    run.mkdir()
    save_checkpoint(training["made"] / "s2", run / "checkpoint-2", 2)
    # Saved a while ago: settled at the first poll however fast the watch starts (it waits for a
    # checkpoint's files to be --interval seconds old, and its start-up takes less than that now).
    old = time.time() - 60
    for f in (run / "checkpoint-2").rglob("*"):
        os.utime(f, (old, old))
    out_dir = tmp_path / "report"
    p = subprocess.Popen([sys.executable, "-c", _WRAPPER, "--store", str(store), "watch", str(run), "--interval", "0.2",
                          "--target", str(training["target"]), *EVAL, "--json", "--out", str(out_dir)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
    try:
        first = json.loads(p.stdout.readline())
        assert [c["step"] for c in first["checkpoints"]] == [2]
        # One checkpoint still being written (truncated weights), one complete.
        staged = shutil.copytree(training["made"] / "s12", tmp_path / "staged")
        full = (staged / "model.safetensors").read_bytes()
        (staged / "model.safetensors").write_bytes(full[: len(full) // 2])
        partial = run / "checkpoint-12"
        os.rename(staged, partial)
        weights = partial / "model.safetensors"
        bad = shutil.copytree(training["made"] / "s2", tmp_path / "bad")
        (bad / "config.json").write_text('{"hidden_size": 128}')  # no dflash_config: never evaluable
        os.rename(bad, run / "checkpoint-4")
        save_checkpoint(training["made"] / "s6", run / "checkpoint-6", 6)
        second = json.loads(p.stdout.readline())
        assert [c["step"] for c in second["checkpoints"]] == [2, 6]
        assert [x["path"] for x in second["pending"]] == [str(partial)]
        assert [x["path"] for x in second["failed"]] == [str(run / "checkpoint-4")]
        assert "target_layer_ids" in second["failed"][0]["error"]
        weights.write_bytes(full)  # the trainer finished it
        third = json.loads(p.stdout.readline())
        assert [c["step"] for c in third["checkpoints"]] == [2, 6, 12]
        assert json.loads((out_dir / "watch.json").read_text())["checkpoints"] == third["checkpoints"]
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "watch stopped: 3 checkpoint(s) evaluated" in err
    assert not list(out_dir.glob(".*.tmp"))
    rc, out, verr, _ = cli(env, store, "verify")
    assert rc == 0, verr


def test_watch_dir_that_is_not_a_training_directory_is_one_clear_message(training, env, tmp_path):
    for value, words in ((training["root"] / "absent", "is not a directory"),
                         (training["reference"], "is a checkpoint itself"),
                         (training["run"] / "runs", "holds no checkpoint")):
        rc, out, err, _ = cli(env, tmp_path / "store", "watch", value, "--once", "--target", training["target"], *EVAL)
        assert rc == 6 and words in err and "Traceback" not in err, (value, err)


# ----------------------------------------------------------------------------- the page in a browser


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed and the test set-up (.ci/run) could not install it "
                "(apt-get install chromium)")


def test_html_report_renders_in_headless_chromium(watched, tmp_path):
    chromium = _chromium()
    page = Path(watched["doc"]["files"]["report.html"])
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
             "--disable-dev-shm-usage"]
    dom = subprocess.run([chromium, *flags, f"--user-data-dir={tmp_path / 'profile-dom'}", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert '<table id="summary">' in html
    summary = html[html.index('<table id="summary">'):]
    summary = summary[:summary.index("</table>")]
    assert summary.count("<tr") == 1 + 1 + len(STEPS)  # header, reference, checkpoints
    assert 'class="per-prompt" data-drafter="latest: checkpoint-12 (step 12)"' in html
    assert html.count('class="blk a') > 10 and 'title="block 1: root position' in html
    assert html.count('src="data:image/png;base64,') == 2
    shot = tmp_path / "report.png"
    r = subprocess.run([chromium, *flags, f"--user-data-dir={tmp_path / 'profile-shot'}", f"--screenshot={shot}",
                        "--window-size=1200,1600", "--hide-scrollbars", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1200, 1600)
    keep = os.environ.get("DFCACHE_TEST_SCREENSHOT")
    if keep:  # to look at it
        shutil.copy(shot, keep)


# ----------------------------------------------------------------------------- --once and checkpoints being written


def _tiny_checkpoint(path: Path, t: float) -> Path:
    """A complete checkpoint as the readiness check sees it (config.json, one whole safetensors
    file), its files last written at ``t``."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"dflash_config": {}}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    for f in path.iterdir():
        os.utime(f, (t, t))
    return path


def _watch_once(run: Path, clock, sleep, out_dir: Path):
    from runner.core.options import EvalOptions
    from runner.commands.watch import Watch

    seen: list = []

    class Only(Watch):  # the polling and waiting of --once; no model work, no report files
        def check_inputs(self) -> None:
            pass

        def evaluate(self, ready):
            seen.extend(c.path for c in ready)
            return []

        def write_report(self):
            return {}

    w = Only(None, EvalOptions(json=False), directory=str(run), reference=None, interval=30.0, once=True,
             out_dir=out_dir, html_step=None, argv=[], remotes=[], clock=clock, sleep=sleep)
    return w.run(), seen


def test_watch_once_waits_until_a_checkpoint_written_just_now_has_settled(tmp_path, capsys):
    """`--once` on a checkpoint written a second ago: it waits and evaluates it. The wall clock the
    quiet time is measured on advances here a little less than each sleep (rounding, NTP slewing):
    one sleep of the announced length left it "being written" and pending before."""
    now = [1_000_000.0]
    ck = _tiny_checkpoint(tmp_path / "run" / "checkpoint-5", now[0] - 1)

    def sleep(s: float) -> None:
        now[0] += max(s - 0.01, 0.001)

    result, seen = _watch_once(tmp_path / "run", lambda: now[0], sleep, tmp_path / "out")
    assert seen == [ck] and result["pending"] == []
    assert "skipped" not in capsys.readouterr().err


def test_watch_once_reports_a_checkpoint_still_being_written_as_skipped(tmp_path, capsys):
    """One that keeps changing for the whole interval is left for the next watch, and says so on
    stderr whatever the terminal (the note never showed on one)."""
    now = [1_000_000.0]
    ck = _tiny_checkpoint(tmp_path / "run" / "checkpoint-7", now[0])

    def sleep(s: float) -> None:  # the trainer writes again while we wait
        now[0] += s
        (ck / "config.json").write_text('{"dflash_config": {}, "at": %r}' % now[0])
        os.utime(ck / "config.json", (now[0], now[0]))

    result, seen = _watch_once(tmp_path / "run", lambda: now[0], sleep, tmp_path / "out")
    assert seen == [] and [p["path"] for p in result["pending"]] == [str(ck)]
    assert now[0] - 1_000_000.0 <= 30.0 + 1.0 + 1e-6  # at most one interval (and the slack)
    err = capsys.readouterr().err
    assert f"skipped (still being written): {ck}: being written" in err
