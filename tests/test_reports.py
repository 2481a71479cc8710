"""Reports that explain themselves (issue 30, points 2-5): verdicts decided when results are shown,
never stored (``--trained-on``, ``--accept-retokenized``); every row saying where its completion
ids came from; the whole selection in report.json/md/html; ``show`` and ``doctor
--completions-from`` following a report's per-sample upstreams; ``dfcache explain``.

Real parts: the tiny Qwen3.5 target (session fixture), a tiny drafter trained on its states and
an untrained one, a real store. The models run in this process once per selection (the fixtures);
every command under test runs in its own process through ``python -m dfcache`` (a fully cached
``run eval`` is answered by runner/commands/fast_run.py there, without torch).

Retokenized completions: their tokens samples are written through the tokens partition the real
graph plans for a server selection, with the documents the tokens stage records (``tokens_source``
and ``ids_check``, the contract of runner/core/completion_source.py) and the ids of the local run; no
server is contacted, since nothing under a stored tokens sample is needed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_util import hub_offline_env, python_c

from dfcache.errors import EXIT_BAD_INPUT, EXIT_USAGE

FLAGS = ["--num-prompts", "4", "--max-new-tokens", "16", "--dtype", "float32", "--device", "cpu", "--backend", "torch",
         "--tree-budget", "4"]
COMMON = dict(num_prompts=4, max_new_tokens=16, dtype="float32", device="cpu", backend="torch", tree_budgets=[4],
              progress=False)

# Runs the executable as installed (dfcache/__main__.py, its fast paths included) and reports, on
# its last stderr line, whether torch got imported.
_EXE = r"""
import json, runpy, sys
try:
    runpy.run_module("dfcache", run_name="__main__", alter_sys=True)
    rc = 0
except SystemExit as e:
    rc = e.code
sys.stderr.write("\n@@reports-test " + json.dumps({"rc": rc, "torch": "torch" in sys.modules}) + "\n")
sys.exit(rc)
"""


@dataclass
class Run:
    code: int
    out: str
    err: str
    torch: bool

    def json(self):
        return json.loads(self.out)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return hub_offline_env(tmp_path_factory.mktemp("reports-home"))


# cli() runs _EXE in children of a fork server started with the module's `env` (cli_util.python_c):
# ~1 s of CPU less a command; it imports no torch, so whether a command did is still seen.
_ZYGOTE = None


@pytest.fixture(scope="module", autouse=True)
def _fork_server(module_fork_server):  # conftest: sets _ZYGOTE
    yield


def cli(env, store, *args, timeout=300) -> Run:
    p = python_c(_ZYGOTE, _EXE, "--store", store, *args, env=env, cwd=Path(store).parent, timeout=timeout)
    err, _, tail = p.stderr.rpartition("@@reports-test ")
    info = json.loads(tail) if tail.strip() else {"rc": p.returncode, "torch": None}
    assert info["rc"] == p.returncode
    return Run(p.returncode, p.stdout, err.rstrip("\n"), info["torch"])


def one_error(r: Run) -> str:
    assert "Traceback" not in r.err, r.err
    assert r.err.startswith("error: ") and r.err.count("error:") == 1, r.err
    return r.err


def run_here(store, target, drafters, **over):
    """``api.run("eval")`` in this process (torch is imported once for the module), on one torch
    thread: these models are too small to split, and two threads on a busy 2-core machine wait
    for each other (runner.models.train_tiny.single_thread)."""
    from runner import api
    from runner.models.train_tiny import single_thread

    with single_thread():
        return api.run("eval", store=str(store), target=str(target), drafters=[str(d) for d in drafters],
                       **{**COMMON, **over})


def _edited(src: Path, dst: Path, **dflash) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dflash_config"].update(dflash)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def made(tiny_target, tmp_path_factory):
    """Two drafters (one trained briefly, so τ varies by prompt), a copy of the untrained one that
    declares fla in its config, and the eval of the first two over 4 prompts."""
    from runner.models.train_tiny import (DEFAULT_LAYER_IDS, build_training_data, make_untrained_drafter,
                                          single_thread, train_tiny_drafter)

    root = tmp_path_factory.mktemp("reports")
    with single_thread():
        data = build_training_data(tiny_target, DEFAULT_LAYER_IDS, max_new_tokens=16)
        trained = train_tiny_drafter(tiny_target, root / "trained", steps=24, data=data)
    plain = make_untrained_drafter(tiny_target, root / "plain", seed=1)
    declared = _edited(plain, root / "declared-fla", trained_on_backend="fla")
    store = root / "store"
    base = run_here(store, tiny_target, [trained, plain])
    run_here(store, tiny_target, [declared])  # its eval, so that the command under test finds it stored
    return {"root": root, "store": store, "target": tiny_target, "trained": trained, "plain": plain,
            "declared": declared, "base": base}


def _eval_args(made, *drafters, extra=()):
    return ["run", "eval", "--target", made["target"], *[a for d in drafters for a in ("--drafter", made[d])], *FLAGS,
            *extra]


def _files(doc: dict) -> dict[str, str]:
    return {name: Path(path).read_text() for name, path in doc["files"].items() if not name.endswith(".png")}


# ----------------------------------------------------------------------------- verdicts when shown


def test_trained_on_is_decided_each_time_results_are_shown(made, env):
    """The issue's reproduction: the same cached report, shown without and with --trained-on fla,
    says what each run asked, in --json, the text and the files under reports/<key>/."""
    store, args = made["store"], _eval_args(made, "trained", "plain")
    plain = cli(env, store, *args, "--json")
    assert plain.code == 0, plain.err
    doc = plain.json()
    assert doc["computed"] == [] and doc["report_key"] == made["base"].report_key
    assert not plain.torch, "a fully cached run imports no torch"
    assert doc["warnings"] == [] and doc["verdicts"] == {"trained_on": None, "accept_retokenized": False}
    assert [(d["trained_on"], d["backend_mismatch"]) for d in doc["drafters"]] == [(None, False)] * 2
    assert all("WARNING" not in text for text in _files(doc).values())

    fla = cli(env, store, *args, "--trained-on", "fla", "--json")
    assert fla.code == 0, fla.err
    doc = fla.json()
    assert doc["computed"] == [] and doc["report_key"] == made["base"].report_key and not fla.torch
    assert [(d["trained_on"], d["trained_on_source"], d["backend_mismatch"]) for d in doc["drafters"]] == \
        [("fla", "--trained-on", True)] * 2
    assert len(doc["warnings"]) == 2 and all("trained on fla" in w and "--backend fla" in w for w in doc["warnings"])
    files = _files(doc)
    assert json.loads(files["report.json"])["warnings"] == doc["warnings"]
    assert "⚠ trained on fla" in files["report.md"] and files["report.md"].count("WARNING: drafter") == 2
    assert "⚠ trained on fla" in files["report.html"] and "WARNING: drafter trained was trained on fla" in files["report.html"]
    text = cli(env, store, *args, "--trained-on", "fla")
    assert text.code == 0 and text.out.index("WARNING: drafter trained") < text.out.index("| drafter |")

    for again in ([], ["--trained-on", "torch"]):  # and back: nothing of the fla run sticks
        r = cli(env, store, *args, *again, "--json")
        assert r.code == 0, r.err
        doc = r.json()
        assert doc["warnings"] == [] and not any(d["backend_mismatch"] for d in doc["drafters"])
        assert all("WARNING" not in t and "⚠ trained on" not in t for t in _files(doc).values())


def test_a_report_first_shown_with_trained_on_keeps_no_verdict(made, env):
    """The reverse: a selection whose report is made by a run with --trained-on fla shows no
    warning to a later run without it, or with --trained-on torch."""
    store, args = made["store"], _eval_args(made, "plain")
    first = cli(env, store, *args, "--trained-on", "fla", "--json")
    assert first.code == 0, first.err
    assert len(first.json()["computed"]) == 1 and len(first.json()["warnings"]) == 1  # the report only
    stored = json.loads(json.dumps(_stored(store, first.json()["report_key"])))
    assert "warnings" not in stored and all("backend_mismatch" not in d and "trained_on" not in d
                                            for d in stored["drafters"])
    for again in ([], ["--trained-on", "torch"]):
        r = cli(env, store, *args, *again, "--json")
        assert r.code == 0 and r.json()["computed"] == [] and r.json()["warnings"] == [], r.err
        assert all("WARNING" not in t for t in _files(r.json()).values())


def _stored(store, key) -> dict:
    from dfcache import open_store

    return open_store(store).open(key).json("report")


def test_declared_trained_on_warns_and_the_flag_overrides_it(made, env):
    """A checkpoint declaring trained_on_backend=fla (covered by its fingerprint) is stored as declared
    and warned about when shown on torch states; --trained-on torch, the run's own claim, lifts it."""
    store, args = made["store"], _eval_args(made, "declared")
    r = cli(env, store, *args, "--json")
    assert r.code == 0, r.err
    (d,) = r.json()["drafters"]
    assert (d["trained_on_declared"], d["trained_on"], d["trained_on_source"], d["backend_mismatch"]) == \
        ("fla", "fla", "declared", True)
    assert "as its config declares" in r.json()["warnings"][0]
    assert _stored(store, r.json()["report_key"])["drafters"][0]["trained_on_declared"] == "fla"
    r = cli(env, store, *args, "--trained-on", "torch", "--json")
    (d,) = r.json()["drafters"]
    assert r.code == 0 and r.json()["computed"] == [] and r.json()["warnings"] == []
    assert (d["trained_on"], d["trained_on_source"], d["backend_mismatch"]) == ("torch", "--trained-on", False)


# ----------------------------------------------------------------------------- completion sources


@pytest.fixture(scope="module")
def retokenized(made, env):
    """A server selection of 3 prompts whose tokens samples say: server ids, retokenized and verified,
    retokenized and failed (kept by --accept-retokenized); evaluated with --accept-retokenized."""
    from dfcache import open_store
    from dfcache.samples import SampleArray, SampleSet, SampleSink
    from runner import api
    from runner.stages.tokens import read_tokens

    store = open_store(made["store"])
    opts = dict(target=str(made["target"]), num_prompts=3, max_new_tokens=16, dtype="float32", device="cpu",
                backend="torch", progress=False)
    server = "http://127.0.0.1:9"  # planned only: a stored tokens sample needs nothing under it
    _, nodes = api.resolve_graph("tokens", api.make_options(completions="server", server=server, **opts), store)
    tok = nodes[-1]
    _, local = api.resolve_graph("tokens", api.make_options(completions="local", **opts), store)
    ids = read_tokens(store, local[-1])
    docs = SampleSet(store, local[-1].partition.key, local[-1].sample_keys).docs()
    checks = [({"tokens_source": "server"}),
              ({"tokens_source": "retokenized", "ids_check": {"ok": True, "ids": 17, "server_count": 17,
                                                               "round_trip": True, "problem": None}}),
              ({"tokens_source": "retokenized", "ids_check": {"ok": False, "ids": 19, "server_count": 16,
                                                               "round_trip": True,
                                                               "problem": "19 ids, the server counted 16"}})]
    with SampleSink(store, tok.partition, arrays={"ids": SampleArray((), "int32")}) as sink:
        for i, facts in enumerate(checks):
            sink.add(tok.upstream_samples[i], {"ids": ids.sample(i)}, {**docs[i], **facts})
    run_here(made["store"], made["target"], [made["trained"]], num_prompts=3, completions="server", server=server,
             accept_retokenized=True)
    args = ["run", "eval", "--target", made["target"], "--drafter", made["trained"], "--server", server, "--num-prompts",
            "3", *FLAGS[2:]]
    accepted = cli(env, made["store"], *args, "--accept-retokenized", "--json")
    assert accepted.code == 0, accepted.err
    return {"args": args, "doc": accepted.json(), "ids": tok.ids}


def test_every_row_says_where_its_completion_ids_came_from(made, retokenized, env):
    doc = retokenized["doc"]
    (d,) = doc["drafters"]
    mixed = "server ids; retokenized, verified; retokenized, unverified (accepted)"
    assert d["completion_sources"] == {"server ids": 1, "retokenized, verified": 1,
                                       "retokenized, unverified (accepted)": 1}
    assert d["completions"] == "1 " + mixed.replace("; ", "; 1 ")
    sel = doc["selection"]["completions"]
    assert sel["ids"] == d["completion_sources"] and sel["source"] == "openai" and sel["server"] == "http://127.0.0.1:9"
    assert sel["not_exact"] == {"retokenized, verified": [retokenized["ids"][1]],
                                "retokenized, unverified (accepted)": [retokenized["ids"][2]]}
    assert doc["verdicts"]["accept_retokenized"] is True
    assert doc["banner"][0].startswith("NOTE: not every completion's token ids")
    assert any("kept by --accept-retokenized" in line for line in doc["banner"])
    files = _files(doc)
    md = files["report.md"]
    assert md.index("NOTE: not every completion") < md.index("| drafter |") and "retokenized, verified" in md
    assert "class=\"warn banner\"" in files["report.html"]
    text = cli(env, made["store"], *retokenized["args"], "--accept-retokenized")
    assert text.code == 0 and text.out.index("NOTE: not every") < text.out.index("| drafter |")
    assert "1 retokenized, unverified (accepted) ⚠ |" in text.out

    # Exact sources: one label, no count, no banner (the local run of the same prompts).
    base = cli(env, made["store"], *_eval_args(made, "trained", "plain"), "--json").json()
    assert [d["completions"] for d in base["drafters"]] == ["local greedy"] * 2
    assert base["banner"] == [] and base["selection"]["completions"]["ids"] == {"local greedy": 4}


def test_unaccepted_retokenized_ids_are_refused_when_shown(made, retokenized, env):
    """The same cached report, shown by a run without --accept-retokenized: exit 6, one message
    naming how many completions and which prompt, and the fixes; nothing printed, nothing stored."""
    from dfcache import open_store

    before = set(open_store(made["store"]).keys())
    files = {k: Path(v).read_bytes() for k, v in retokenized["doc"]["files"].items()}
    r = cli(env, made["store"], *retokenized["args"])
    assert r.code == EXIT_BAD_INPUT and r.out == ""
    msg = one_error(r)
    for words in ("1 completion(s)", repr(retokenized["ids"][2]), "failed their check", "--accept-retokenized",
                  "--server-api sglang", "vLLM", "--completions local"):
        assert words in msg, (words, msg)
    r = cli(env, made["store"], *retokenized["args"], "--json")
    assert r.code == EXIT_BAD_INPUT and r.json()["exit_code"] == EXIT_BAD_INPUT and "--accept-retokenized" in r.json()["error"]
    assert set(open_store(made["store"]).keys()) == before
    assert {k: Path(v).read_bytes() for k, v in retokenized["doc"]["files"].items()} == files


# ----------------------------------------------------------------------------- the selection


def test_reports_carry_their_whole_selection(made, env):
    import dfcache
    import torch

    from dfcache.keys import fingerprint_path
    from runner.models.resolve import chat_template_hash

    r = cli(env, made["store"], *_eval_args(made, "trained", "plain"), "--json")
    doc = r.json()
    on_disk = json.loads(Path(doc["files"]["report.json"]).read_text())
    assert on_disk["selection"] == doc["selection"] and on_disk["report_key"] == doc["report_key"]
    sel = doc["selection"]
    target = Path(made["target"])
    assert sel["target"]["path"] == str(target.resolve()) and sel["target"]["revision"] is None
    assert sel["target"]["fingerprint"] == fingerprint_path(target)
    assert sel["prompts"]["source"] == "builtin:coding" and sel["prompts"]["count"] == 4
    assert sel["prompts"]["digest"] == next(n for n in doc["stages"] if n["stage"] == "prompts")["key"]
    c = sel["completions"]
    assert (c["source"], c["server"], c["served_model"], c["temperature"], c["top_p"], c["seed"], c["max_new_tokens"],
            c["enable_thinking"]) == ("local", None, None, 0.0, 1.0, None, 16, False)
    assert c["chat_template"] == chat_template_hash(target) and c["backend"]["kernel"] == "torch"
    h = sel["hidden_states"]
    assert h["backend"] == {"kernel": "torch", "device": "cpu", "dtype": "float32", "attn_implementation": "sdpa"}
    assert h["layers"] == [1, 3, 5] and h["versions"]["torch"] == torch.__version__
    assert h["model_class"] == "Qwen3_5ForCausalLM"
    assert sel["eval"] == {"end_rule": "within", "tree_budgets": [4], "max_blocks": None, "dtype": "float32",
                           "device": "cpu"}
    assert sel["dfcache_version"] == dfcache.__version__ and doc["end_rule"] == "within_output"
    for d, name in zip(doc["drafters"], ("trained", "plain")):
        assert d["path"] == str(Path(made[name]).resolve()) and d["fingerprint"] == fingerprint_path(made[name])
        assert d["step"] is None and d["trained_on_declared"] is None and d["target_layer_ids"] == [1, 3, 5]
        assert d["eval"]["inputs"]["drafter"] == d["fingerprint"]
    # Each stage's key inputs, as `explain` names them.
    assert sel["stages"]["completions"]["inputs"]["enable_thinking"] is False
    assert set(sel["stages"]["hidden_states"]) == {"1", "3", "5"}
    files = _files(doc)
    assert "Selection:" in files["report.md"] and f"fingerprint {sel['target']['fingerprint'][:12]}" in files["report.md"]
    assert "<h2>Selection</h2>" in files["report.html"] and "builtin:coding ×4" in files["report.html"]


# ----------------------------------------------------------------------------- show and doctor


def test_show_of_a_report_follows_its_samples(made, env, tmp_path):
    key = made["base"].report_key
    r = cli(env, made["store"], "show", key[:12])
    assert r.code == 0, r.err
    chain = r.out[r.out.index("upstream chain:"):]
    assert "not in this store" not in chain and "?" not in chain.split("\n")[1]
    for stage in ("drafter_eval", "tokens", "completions", "prompts", "hidden_states"):
        assert f"{stage} partition " in chain and "4 of 4 sample(s)" in chain, (stage, chain)
    doc = cli(env, made["store"], "show", key, "--json").json()
    stages = [c["stage"] for c in doc["upstream_chain"]]
    assert stages.count("drafter_eval") == 2 and stages.count("hidden_states") == 3
    assert all(c["present"] and c["kind"] == "samples" and c["segments"] for c in doc["upstream_chain"])

    # A store that lost some completions says which partition lacks how many (on a copy).
    copy = tmp_path / "store"
    shutil.copytree(made["store"], copy)
    comp = next(c for c in doc["upstream_chain"] if c["stage"] == "completions")
    gone = cli(env, copy, "gc", "--key", comp["segments"][0], "--force", "--yes")
    assert gone.code == 0, gone.err
    r = cli(env, copy, "show", key, "--json")
    lost = next(c for c in r.json()["upstream_chain"] if c["stage"] == "completions" or c["key"] == comp["key"])
    assert not lost["present"] and lost["samples"]["present"] < lost["samples"]["needed"] == 4
    assert "not in this store" in cli(env, copy, "show", key).out


def test_doctor_takes_a_report_key(made, env):
    r = cli(env, made["store"], "doctor", "--target", made["target"], "--drafter", made["trained"],
            "--completions-from", made["base"].report_key[:10], "--json")
    assert r.code == 0, r.out + r.err
    (check,) = [c for c in r.json()["checks"] if c["check"] == "chat template / thinking"]
    assert check["severity"] == "info" and "used this target's chat template" in check["found"]
    assert not r.torch


# ----------------------------------------------------------------------------- explain


def _key(run) -> str:
    return run.report_key


@pytest.fixture(scope="module")
def variants(made, tmp_path_factory):
    """Reports of the same drafters over other selections: thinking on, eager attention, the first
    two prompts, and a prompt file that renames one of them and adds one."""
    def run(**over):
        return run_here(made["store"], made["target"], [made["trained"], made["plain"]], **over)

    prompts = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    from runner.stages.prompts import load_records

    second = load_records("builtin:coding")[1]
    prompts.write_text(json.dumps({"id": "renamed", "messages": second["messages"]}) + "\n"
                       + json.dumps({"id": "fresh", "prompt": "def fib(n):"}) + "\n")
    return {"thinking": run(enable_thinking=True), "eager": run(attn_implementation="eager"),
            "first2": run(num_prompts=2), "file": run(prompts=str(prompts), num_prompts=None),
            "first_id": second["id"]}


def test_explain_names_thinking_as_the_key_inputs_it_changes(made, variants, env):
    r = cli(env, made["store"], "explain", _key(made["base"])[:12], _key(variants["thinking"]), "--json")
    assert r.code == 0, r.err
    assert not r.torch
    res = r.json()
    assert [(d["input"], d["a"], d["b"]) for d in res["differences"]] == [
        ("completions.enable_thinking", False, True), ("tokens.enable_thinking", False, True)]
    assert res["prompts"] == {"shared": 4, "only_a": 0, "only_b": 0, "only_a_ids": [], "only_b_ids": []}
    # The tiny target's template ignores enable_thinking: the keys differ, the stored bytes do not.
    assert res["samples"]["completions"] == {"same_key": 0, "same_bytes": 4, "different": 0, "unknown": 0}
    assert res["samples"]["tokens"]["same_bytes"] == 4
    assert [(row["a"], row["b"]) for row in res["rows"]] == [("trained", "trained"), ("plain", "plain")]
    assert all(p["delta"] == 0.0 for row in res["rows"] for p in row["per_prompt"])
    text = cli(env, made["store"], "explain", _key(made["base"]), _key(variants["thinking"]))
    assert "completions.enable_thinking" in text.out and "false -> true" in text.out
    assert "4 different keys, same bytes" in text.out


def test_explain_names_a_backend_difference(made, variants, env):
    res = cli(env, made["store"], "explain", _key(made["base"]), _key(variants["eager"]), "--json").json()
    names = {d["input"]: (d["a"], d["b"]) for d in res["differences"]}
    assert names == {"completions.backend.attn_implementation": ("sdpa", "eager"),
                     "hidden_states.backend.attn_implementation": ("sdpa", "eager")}
    assert res["samples"]["hidden_states"]["same_key"] == 0 and res["samples"]["hidden_states"]["unknown"] == 0


def test_explain_prompt_subsets_and_renamed_prompts(made, variants, env):
    res = cli(env, made["store"], "explain", _key(made["base"]), _key(variants["first2"]), "--json").json()
    assert res["differences"] == [] and res["prompts"]["shared"] == 2 and res["prompts"]["only_b"] == 0
    from runner.stages.prompts import load_records

    assert res["prompts"]["only_a_ids"] == [r["id"] for r in load_records("builtin:coding")[2:4]]
    assert res["samples"]["completions"]["same_key"] == 2 and res["rows"][0]["evals"]["same_key"] == 2
    # Prompts match by content: the renamed one is shared under both ids, the new one is B's only.
    res = cli(env, made["store"], "explain", _key(made["base"]), _key(variants["file"]), "--json").json()
    assert res["prompts"]["shared"] == 1 and res["prompts"]["only_b_ids"] == ["fresh"]
    (p,) = res["rows"][0]["per_prompt"]
    assert (p["id_a"], p["id_b"], p["delta"]) == (variants["first_id"], "renamed", 0.0)
    assert res["samples"]["tokens"]["same_key"] == 1


def test_explain_two_rows_of_one_report(made, env):
    """Two rows of one report: the drafter is the one key input that differs; per-prompt deltas are
    the rows' τ per prompt as the eval stage stored them, largest first."""
    from dfcache import open_store
    from runner import api
    from runner.stages.drafter_eval import read_responses

    key = _key(made["base"])
    r = cli(env, made["store"], "explain", f"{key[:12]}:trained", f"{key[:12]}:2", "--json")
    assert r.code == 0, r.err
    res = r.json()
    (row,) = res["rows"]
    assert res["differences"] == [] and res["samples"]["tokens"]["same_key"] == 4
    assert [d["input"] for d in row["differences"]] == ["drafter_eval.drafter"]
    store = open_store(made["store"])
    _, nodes = api.resolve_graph("eval", api.make_options(target=str(made["target"]),
                                                          drafters=[str(made["trained"]), str(made["plain"])], **COMMON),
                                 store)
    evals = [n for n in nodes if n.stage == "drafter_eval"]
    tau = [{r["id"]: sum(r["chain"]) / len(r["chain"]) for r in read_responses(store, e)} for e in evals]
    expected = sorted(((pid, tau[1][pid] - tau[0][pid]) for pid in tau[0]), key=lambda x: -abs(x[1]))
    got = [(p["id_a"], p["delta"]) for p in row["per_prompt"]]
    assert [pid for pid, _ in got] == [pid for pid, _ in expected]
    assert [d for _, d in got] == pytest.approx([d for _, d in expected])
    assert row["tau_chain"]["delta"] == pytest.approx(row["tau_chain"]["b"] - row["tau_chain"]["a"])
    assert any(d != 0 for _, d in got), "the trained drafter accepts more on some prompt"
    text = cli(env, made["store"], "explain", f"{key}:1", f"{key}:plain", "--top", "2")
    assert text.code == 0 and "drafter_eval.drafter" in text.out and "(2 of 4; --top N shows more)" in text.out


def test_explain_refuses_what_it_cannot_compare(made, env, tmp_path_factory):
    from runner.models.tiny import build_tiny_target
    from runner.models.train_tiny import make_untrained_drafter

    store, key = made["store"], _key(made["base"])
    segment = next(c for c in cli(env, store, "show", key, "--json").json()["upstream_chain"]
                   if c["stage"] == "tokens")["segments"][0]
    r = cli(env, store, "explain", key, segment)
    assert r.code == EXIT_BAD_INPUT and "is a tokens artifact, not a report" in one_error(r)
    r = cli(env, store, "explain", key, "0123abcd")
    assert r.code == EXIT_USAGE and "no artifact key starts with 0123abcd" in one_error(r)
    r = cli(env, store, "explain", f"{key[:12]}:nope", key)
    assert r.code == EXIT_USAGE and "has no row 'nope'" in one_error(r) and "1 trained, 2 plain" in r.err
    r = cli(env, store, "explain", key, key, "--json")
    assert r.code == 0 and r.json()["differences"] == []

    root = tmp_path_factory.mktemp("other-target")
    other = build_tiny_target(root / "target", seed=7)
    drafter = make_untrained_drafter(other, root / "d", seed=1)
    run = run_here(store, other, [drafter], num_prompts=1, max_new_tokens=4)
    r = cli(env, store, "explain", key, run.report_key)
    msg = one_error(r)
    assert r.code == EXIT_BAD_INPUT and "different targets" in msg
    assert made["base"].report["selection"]["target"]["fingerprint"][:12] in msg
    assert run.report["selection"]["target"]["fingerprint"][:12] in msg
    r = cli(env, store, "explain", key, run.report_key, "--json")
    assert r.code == EXIT_BAD_INPUT and r.json()["exit_code"] == EXIT_BAD_INPUT
