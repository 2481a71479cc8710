"""The runner through the real `dfcache` command line, each command in its own process: plan
statuses, offline refusal before any work, the up-front server check, fully cached runs that
import no torch, server completions replayed after the server is gone, and bad input.

Store outcome of a failing run, as asserted below:
- failures found before any work (usage, bad input, offline, the server check: refused, not
  ready, timed out, wrong model) leave the store without any artifact;
- failures of a generation request (HTTP 500, garbage body, timeout) come after the prompts
  artifact was committed (it is computed here and valid); the completions artifact is not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_util import python_c
from servers import ClosedPort, RecordingListener, ScriptedServer, SilentListener

from dfcache import open_store
from dfcache.errors import EXIT_BAD_INPUT, EXIT_NETWORK, EXIT_OFFLINE_MISSING, EXIT_USAGE

N = 2  # prompts
MAX_NEW = 4
REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")
# "At once" is checked by what happened, not by a clock (CI machines are shared): no model
# imported, no "waiting for server" line, no request beyond the first per prompt.

# Runs dfcache.cli.main in a fresh interpreter and reports, on its last stderr line, the exit code,
# the seconds main() took and which heavy modules got imported.
_WRAPPER = r"""
import json, sys, time
from dfcache.cli import main
t0 = time.perf_counter()
rc = main(sys.argv[1:])
dt = time.perf_counter() - t0
heavy = [m for m in HEAVY if m in sys.modules]
sys.stderr.write("\n@@dfcache-test " + json.dumps({"rc": rc, "seconds": dt, "heavy": heavy}) + "\n")
sys.exit(rc)
""".replace("HEAVY", repr(HEAVY))


@dataclass
class Run:
    code: int
    out: str
    err: str
    wall: float  # seconds, the whole process
    seconds: float  # seconds inside main()
    heavy: list
    lazy: list | None = None  # of LAZY, those imported (exe() only)

    def json(self):
        return json.loads(self.out)

    def one_error(self) -> str:
        """The one message a failed run prints: a single 'error: ...' paragraph, no traceback."""
        assert "Traceback" not in self.err, self.err
        assert self.err.startswith("error: "), self.err
        assert self.err.count("error:") == 1, self.err
        return self.err


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A clean environment: online, no config file or store from this machine, own DFCACHE_HOME."""
    home = tmp_path_factory.mktemp("dfcache-home")
    e = {k: v for k, v in os.environ.items()
         if k not in ("DFCACHE_OFFLINE", "HF_HUB_OFFLINE", "DFCACHE_STORE", "DFCACHE_DEBUG", "DFCACHE_CONFIG")}
    # Timed progress lines (every 10 s off a terminal) only where a test asks for them: under load a
    # run took longer than that and a line came before the one 'error:' paragraph (CI-like, busy).
    e.update(DFCACHE_HOME=str(home), DFCACHE_CONFIG=str(home / "absent.toml"),
             HF_HUB_DISABLE_UPDATE_CHECK="1", PYTHONPATH=str(REPO), DFCACHE_PROGRESS_INTERVAL="86400")
    return e


# A fork server started with the module's `env`: cli() runs _WRAPPER as `python -c` in its
# children instead of a new interpreter each (its start-up, imports of dfcache's CLI, typer, numpy
# and zarr, cost ~1 s of CPU a command; cli_util.python_c). It imports neither torch nor
# transformers (HEAVY), so what a command imports is still seen.
_ZYGOTE = None
# A second one with torch and transformers imported (conftest: module_model_fork_server), for the
# commands that load the target (cli(..., loads_model=True)): a local-completions run cost 6.8 s
# of CPU forked from the first, an eval run 6.2 s. Their Run.heavy is None (not seen).
_MODEL_ZYGOTE = None


@pytest.fixture(scope="module", autouse=True)
def _fork_server(module_fork_server):  # conftest: sets _ZYGOTE
    yield


def cli(env: dict, store, *args, extra_env: dict | None = None, timeout: float = 180, cwd=None,
        loads_model: bool = False) -> Run:
    """``dfcache --store STORE ARGS...`` in a subprocess (through ``dfcache.cli.main``);
    ``loads_model``: in a child of the fork server that imported torch and transformers (only
    DFCACHE_* variables may be added: those libraries read others when imported)."""
    store_args = ["--store", str(store)] if store is not None else []
    zygote = _ZYGOTE
    if loads_model:
        assert all(k.startswith("DFCACHE_") for k in (extra_env or {})), extra_env
        zygote = _MODEL_ZYGOTE
    t0 = time.perf_counter()
    p = python_c(zygote, _WRAPPER, *store_args, *args, env={**env, **(extra_env or {})},
                 cwd=str(cwd or (store.parent if store else REPO)), timeout=timeout)
    wall = time.perf_counter() - t0
    err, marker, tail = p.stderr.rpartition("@@dfcache-test ")
    if marker:
        info = json.loads(tail)
    else:  # main() raised (--debug): no report line
        err, info = p.stderr, {"rc": None, "seconds": wall, "heavy": None}
    assert info["rc"] in (None, p.returncode)
    return Run(p.returncode, p.stdout, err.rstrip("\n") + ("\n" if err.strip() else ""), wall,
               info["seconds"], None if loads_model else info["heavy"])


def committed(store) -> set[str]:
    return set(open_store(store).keys()) if Path(store).exists() else set()


def stages_in(store) -> dict[str, int]:
    """stage -> samples (segments) or artifacts committed in a store."""
    out: dict[str, int] = {}
    if Path(store).exists():
        for m in open_store(store).list_manifests():
            out[m.stage] = out.get(m.stage, 0) + (len(m.samples["keys"]) if m.samples else 1)
    return out


def _stop_listening(listener) -> int:
    return listener.settle()  # (the backlog too: anything that connected just before exit)


def _args(target, *extra):
    return ["--target", target, "--num-prompts", N, "--max-new-tokens", MAX_NEW, *extra]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def serve(request):
    """`transformers serve` for the replay test (conftest's, shared with test_completions), launched
    before the quick tests where it is not running yet, so that its start overlaps them; the replay
    test stops it."""
    if not any(item.name.startswith("test_server_completions_replay") for item in request.session.items):
        return None
    return request.getfixturevalue("transformers_serve")


@pytest.fixture(scope="module")
def local_run(tiny_target, env, tmp_path_factory, module_model_fork_server):
    """`dfcache run tokens --completions local` once through the CLI (the one run that loads a model)."""
    store = tmp_path_factory.mktemp("local") / "store"
    r = cli(env, store, "run", "tokens", *_args(tiny_target, "--completions", "local"), "--json", loads_model=True)
    assert r.code == 0, r.err
    return store, r


@pytest.fixture(scope="module")
def server_plan(tiny_target, env, tmp_path_factory):
    """The plan of server completions + tokens in an empty store; the server URL is not keyed."""
    store = tmp_path_factory.mktemp("plan") / "store"
    with RecordingListener() as listener:
        r = cli(env, store, "plan", "tokens", *_args(tiny_target, "--completions", "server",
                                                      "--server", listener.url), "--json")
        assert _stop_listening(listener) == 0, "planning contacted the server"
    assert r.code == 0, r.err
    nodes = {n["stage"]: n for n in r.json()}
    assert committed(store) == set(), "plan did work"
    return nodes


@pytest.fixture(scope="module")
def local_plan(tiny_target, env, tmp_path_factory):
    """The plan of local completions in an empty store (no model is loaded to plan)."""
    store = tmp_path_factory.mktemp("local-plan") / "store"
    r = cli(env, store, "plan", "completions", *_args(tiny_target), "--json")
    assert r.code == 0, r.err
    assert r.heavy == [] and committed(store) == set()
    return r.json()


# ----------------------------------------------------------------------------- 1. plan


def test_plan_json_gives_each_node_its_status(server_plan, local_plan):
    for node in server_plan.values():
        assert {"stage", "key", "status", "needs"} <= set(node), node
        assert re.fullmatch(r"[0-9a-f]{32}", node["key"])
    assert [server_plan[s]["status"] for s in ("prompts", "completions", "tokens")] == \
        ["compute (cpu)", "network", "compute (cpu)"]
    assert server_plan["completions"]["needs"] == "network"
    assert server_plan["completions"]["contacts"].startswith("http://127.0.0.1:")
    assert server_plan["tokens"]["upstream"] == {"sample": server_plan["completions"]["partition"]}
    assert server_plan["tokens"]["samples"] == {"total": N, "cached": 0, "remote": 0, "missing": N, "to_pull": 0,
                                                "to_produce": N, "pulled": 0, "produced": 0}
    # The fix is a `run` line even when planning, rebuilt from the options given.
    fix = server_plan["completions"]["fix"]
    assert fix.startswith("dfcache --store ") and " run tokens " in fix and " plan " not in fix
    assert f"--server {server_plan['completions']['contacts']}" in fix

    # Local completions are computed here, on the CPU.
    local = {n["stage"]: n for n in local_plan}
    assert local["completions"]["status"] == "compute (cpu)"
    assert local["completions"]["needs"] == "cpu"
    assert local["completions"]["key"] != server_plan["completions"]["key"]  # the endpoint is keyed


# ----------------------------------------------------------------------------- 2. offline


@pytest.mark.parametrize("how", ["--offline before run", "--offline after run", "DFCACHE_OFFLINE=1",
                                 "--offline after run, HF_HUB_OFFLINE=1"])
def test_offline_missing_network_artifact_exits_3_at_once_without_connecting(how, server_plan, tiny_target,
                                                                             env, tmp_path):
    store = tmp_path / "store"
    with RecordingListener() as listener:
        args = ["run", "tokens", *_args(tiny_target, "--completions", "server", "--server", listener.url)]
        extra_env = None
        if how == "--offline before run":
            args = ["--offline", *args]
        elif how.startswith("--offline after run"):
            args = [*args, "--offline"]
            extra_env = {"HF_HUB_OFFLINE": "1"} if "HF_HUB" in how else None
        else:
            name = how.split("=")[0]
            extra_env = {name: "1"}
        r = cli(env, store, *args, extra_env=extra_env)
        connections = _stop_listening(listener)
    assert r.code == EXIT_OFFLINE_MISSING, r.err
    assert connections == 0
    assert r.heavy == [], "no model may be loaded before refusing"
    msg = r.one_error()
    key = server_plan["completions"]["key"]
    assert key in msg and "completions" in msg
    assert listener.url in msg
    fix = re.search(r"produce it with: (.*)", msg).group(1)
    assert fix.startswith(f"dfcache --store {store} run tokens ")
    assert f"--server {listener.url}" in fix and "--completions server" in fix
    assert "--offline" not in fix
    assert "reaches the server" in msg
    assert committed(store) == set(), "offline refusal must come before any work"


def test_hf_hub_offline_still_reaches_the_completion_server(env, tiny_target, tmp_path):
    """HF_HUB_OFFLINE=1 keeps transformers and huggingface_hub off the Hub; it does not make
    dfcache offline, so a cluster that sets it everywhere still gets completions from its server."""
    store = tmp_path / "store"
    with ScriptedServer(chat="ok") as server:
        r = cli(env, store, "run", "completions", *_args(tiny_target, "--server", server.url), "--json",
                extra_env={"HF_HUB_OFFLINE": "1"})
        requests = server.count("POST", "/v1/chat/completions")
    assert r.code == 0, r.err
    assert requests == N and len(r.json()["computed"]) == 2  # prompts and completions


# ----------------------------------------------------------------------------- 3. server check


def _server_check_cases():
    return [
        # (name, server kind, --wait-server, words in the message, words it must not contain)
        ("refused", "closed", 0, ["connection refused", "nothing listens"], ["timed out", "no answer", "not ready ("]),
        ("refused, waited", "closed", 3, ["not ready after waiting 3 s", "connection refused",
                                          "pass a larger --wait-server"], ["no answer", "--wait-server SECONDS"]),
        ("not ready", "loading", 0, ["is not ready (HTTP 503", "--wait-server"], ["refused", "no answer"]),
        ("not ready, waited", "loading", 1, ["not ready after waiting 1 s", "HTTP 503"], ["refused", "no answer"]),
        ("timeout, waited", "silent", 1.5, ["not ready after waiting 1.5 s", "got no answer within",
                                            "pass a larger --wait-server"], ["refused", "HTTP 503", "--request-timeout"]),
        # The check's own 10 s: --request-timeout (what the fix said to raise) does not change it.
        ("timeout", "silent", 0, ["got no answer within 10 s", "readiness check", "--wait-server SECONDS"],
         ["refused", "--request-timeout"]),
    ]


@pytest.mark.parametrize("name,kind,wait,words,not_words", _server_check_cases(),
                         ids=[c[0] for c in _server_check_cases()])
def test_server_check_fails_once_up_front_with_exit_4(name, kind, wait, words, not_words, tiny_target, env,
                                                      tmp_path):
    store = tmp_path / "store"
    if kind == "closed":
        server = ClosedPort()
        url = server.url
    elif kind == "loading":
        server = ScriptedServer(health="loading").start()
        url = server.url
    else:
        server = SilentListener()
        url = server.url
    try:
        r = cli(env, store, "run", "tokens", *_args(tiny_target, "--server", url, "--wait-server", wait))
    finally:
        if server is not None:
            server.stop() if kind == "loading" else server.close()
    assert r.code == EXIT_NETWORK, r.err
    if wait == 0:
        assert "waiting for server" not in r.err and "after waiting" not in r.err
    else:
        assert r.seconds >= wait, f"{name}: gave up after {r.seconds:.1f} s with --wait-server {wait}"
        progress = [ln for ln in r.err.splitlines() if ln.startswith(f"waiting for server at {url}:")]
        # Visible, with the reason; a hung server shows its line when the check times out.
        reason = {"closed": "connection refused", "loading": "not ready", "silent": "timed out"}[kind]
        assert len(progress) >= (1 if kind == "silent" else 2) and progress[-1].endswith(f"({reason})"), r.err
        r.err = r.err[r.err.index("error: "):]
    msg = r.one_error()
    for w in words:
        assert w in msg, f"{name}: {w!r} not in {msg!r}"
    if kind == "silent":  # seconds rounded ("4.4905 s" was printed as computed)
        assert re.search(r"got no answer within [0-9]+(\.[0-9])? s[.,]", msg), msg
    for w in not_words:
        assert w not in msg, f"{name}: {w!r} in {msg!r}"
    assert url in msg
    if kind == "loading":
        assert server.count("POST", "/v1/chat/completions") == 0
    assert r.heavy == []
    assert committed(store) == set(), "the server check must come before any work"


# ----------------------------------------------------------------------------- 6. bad input (before 4, 5: quick)


def _bad_input_cases():
    missing = "{tmp}/models/missing-target"
    return [
        # (id, extra args, exit code, words)
        ("unknown backend", ["--backend", "gpu"], EXIT_USAGE, ["--backend 'gpu'", "auto, fla, torch"]),
        ("server without --server", ["--completions", "server"], EXIT_USAGE,
         ["--completions server needs --server URL"]),
        ("local with --server", ["--completions", "local", "--server", "http://127.0.0.1:9"], EXIT_USAGE,
         ["--completions local does not use --server"]),
        ("bad server URL", ["--server", "ftp://host"], EXIT_USAGE, ["not an http(s) URL"]),
        ("missing target dir", ["--target", missing], EXIT_BAD_INPUT, [missing, "does not exist"]),
        ("uncached hub id", ["--target", "no-such-org/no-such-model"], EXIT_BAD_INPUT,
         ["{tmp}/hub/models--no-such-org--no-such-model", "never downloads"]),
    ]


@pytest.mark.parametrize("case", _bad_input_cases(), ids=[c[0] for c in _bad_input_cases()])
def test_bad_command_line_input_is_one_clear_message(case, tiny_target, env, tmp_path):
    name, extra, code, words = case
    store = tmp_path / "store"
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    args = ["--target", tiny_target, "--num-prompts", N]
    args += extra  # a later --target wins
    r = cli(env, store, "run", "tokens", *args, extra_env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.code == code, f"{name}: {r.code} {r.err}"
    msg = r.one_error()
    assert msg.count("\n") == 1, msg
    for w in words:
        assert w.replace("{tmp}", str(tmp_path)) in msg, f"{name}: {w!r} not in {msg!r}"
    assert r.out == ""
    assert r.heavy == []
    assert committed(store) == set()


@pytest.mark.parametrize("mode,extra,words,prompts_committed", [
    ("wrong model", ["--served-model", "not-the-target"], ["serves 'scripted-model'", "'not-the-target'",
                                                          "--served-model 'scripted-model'"], False),
    ("500", [], ["HTTP 500", "CUDA out of memory (scripted)", "look at its log"], True),
    ("garbage", [], ["not valid JSON", "<html>upstream proxy error"], True),
    ("hang", ["--request-timeout", "1"], ["got no answer within 1 s", "--request-timeout"], True),
])
def test_server_failures_exit_4_and_cache_no_completions(mode, extra, words, prompts_committed, server_plan,
                                                        tiny_target, env, tmp_path):
    store = tmp_path / "store"
    chat = "ok" if mode == "wrong model" else mode
    with ScriptedServer(chat=chat) as server:
        r = cli(env, store, "run", "tokens", *_args(tiny_target, "--server", server.url, *extra))
        chat_requests = server.count("POST", "/v1/chat/completions")
    assert r.code == EXIT_NETWORK, r.err
    msg = r.one_error()
    for w in words:
        assert w in msg, f"{mode}: {w!r} not in {msg!r}"
    assert server.url in msg
    assert r.heavy == []
    if prompts_committed:
        assert chat_requests >= 1
        assert stages_in(store) == {"prompts": N}, "only the prompts may be committed"
    else:
        assert chat_requests == 0
        assert stages_in(store) == {}
    assert chat_requests <= N and "waiting for server" not in r.err  # no retries, no waiting


def test_long_stages_print_progress_lines_when_stderr_is_not_a_terminal(tiny_target, env, tmp_path,
                                                                        module_model_fork_server):
    """No terminal (a log file, a batch job): bars are off and a long stage prints a line every
    DFCACHE_PROGRESS_INTERVAL seconds instead (0: at every step), as pip and DVC do; eight minutes
    of server generation showed nothing before. --no-progress silences them."""
    with ScriptedServer(chat="ok") as server:
        base = ["run", "completions", *_args(tiny_target, "--server", server.url)]
        r = cli(env, tmp_path / "a", *base, extra_env={"DFCACHE_PROGRESS_INTERVAL": "0"}, loads_model=True)
        quiet = cli(env, tmp_path / "b", *base, "--no-progress", extra_env={"DFCACHE_PROGRESS_INTERVAL": "0"},
                    loads_model=True)
    assert r.code == 0 and quiet.code == 0, r.err + quiet.err
    lines = [ln for ln in r.err.splitlines() if ln.startswith("completions: ")]
    assert [ln.split(",")[0] for ln in lines] == [f"completions: {i}/{N} req ({100 * i // N}%)" for i in range(1, N + 1)]
    assert all("elapsed" in ln for ln in lines) and "\r" not in r.err
    assert not [ln for ln in quiet.err.splitlines() if ln.startswith("completions: ")], quiet.err


def test_options_after_the_command(env, tmp_path):
    """Usage errors from the parser exit 2; --store and --debug work after the command (§7)."""
    r = cli(env, tmp_path / "s1", "run", "tokens", "--no-such-flag")
    assert r.code == EXIT_USAGE and "No such option: --no-such-flag" in r.err, r.err
    assert "Traceback" not in r.err and "internal error" not in r.err
    store = tmp_path / "after" / "store"
    r = cli(env, None, "run", "prompts", "--num-prompts", 1, "--store", store, "--json", cwd=tmp_path)
    assert r.code == 0, r.err
    assert len(r.json()["computed"]) == 1 and stages_in(store) == {"prompts": 1}
    assert not (tmp_path / "store").exists()  # not the default ./store
    r = cli(env, tmp_path / "s1", "run", "tokens", "--backend", "gpu", "--debug")
    assert r.code != 0 and "Traceback" in r.err and "UsageError: --backend 'gpu'" in r.err, r.err


# ----------------------------------------------------------------------------- 4. cached runs


def test_plan_after_a_run_says_cached(local_run, local_plan, tiny_target, env):
    store, run = local_run
    r = cli(env, store, "plan", "tokens", *_args(tiny_target, "--completions", "local"), "--json")
    assert r.code == 0, r.err
    assert [n["status"] for n in r.json()] == ["cached"] * 3
    assert [n["key"] for n in r.json()] == [n["key"] for n in run.json()["nodes"]]
    # What the plan in an empty store announced is what the run produced.
    assert [n["key"] for n in local_plan] == [n["key"] for n in r.json()][:2]
    assert r.heavy == []


def test_fully_cached_tokens_run_does_no_work_and_imports_no_torch(local_run, tiny_target, env):
    store, first = local_run
    stages = [n["stage"] for n in first.json()["nodes"]]
    assert stages == ["prompts", "completions", "tokens"]
    assert sorted(first.json()["computed"]) == sorted(n["key"] for n in first.json()["nodes"])
    assert stages_in(store) == {"prompts": N, "completions": N, "tokens": N}
    before = committed(store)

    r = cli(env, store, "run", "tokens", *_args(tiny_target, "--completions", "local"), "--json")
    assert r.code == 0, r.err
    assert r.json()["computed"] == []
    assert [n["status"] for n in r.json()["nodes"]] == ["cached"] * 3
    assert r.heavy == [], f"a fully cached run imported {r.heavy}"
    assert committed(store) == before
    # Offline changes nothing for a run that needs nothing.
    r = cli(env, store, "run", "tokens", *_args(tiny_target, "--completions", "local"), "--json",
            extra_env={"DFCACHE_OFFLINE": "1"})
    assert r.code == 0, r.err
    assert r.json()["computed"] == [] and r.heavy == []


_NO_EVAL = pytest.mark.skipif(not (REPO / "runner" / "stages" / "drafter_eval" / "__init__.py").exists(),
                              reason="runner/stages/drafter_eval/ is not there yet")


@_NO_EVAL
def test_fully_cached_eval_does_no_work_and_imports_no_torch(local_run, tiny_target, env, tmp_path_factory,
                                                            module_model_fork_server):
    """`run eval` twice on the store of the tokens run: the first adds hidden states, the drafter
    eval and the report; the second computes nothing and imports no torch."""
    from runner.models.train_tiny import make_untrained_drafter

    store, tokens_run = local_run
    drafter = make_untrained_drafter(tiny_target, tmp_path_factory.mktemp("drafter") / "d", seed=1)
    args = ["run", "eval", *_args(tiny_target, "--completions", "local", "--drafter", drafter), "--json"]
    before = committed(store)
    first = cli(env, store, *args, loads_model=True)
    assert first.code == 0, first.err
    computed = first.json()["computed"]
    assert computed and not set(computed) & set(tokens_run.json()["computed"]), "the tokens run's samples are reused"
    counts = {row["stage"]: row["samples"] for row in first.json()["stages"] if "samples" in row}
    assert counts["tokens"]["reused"] == N and counts["tokens"]["computed"] == 0
    before = committed(store)
    r = cli(env, store, *args)
    assert r.code == 0, r.err
    assert r.json()["computed"] == []
    assert r.heavy == [], f"a fully cached eval imported {r.heavy}"
    assert committed(store) == before


@_NO_EVAL
def test_run_prints_every_stage_and_what_happened_to_the_report(local_run, tiny_target, env, tmp_path_factory):
    """After the report table, one line per node: a fully cached run printed a blank line there; a
    run that only pulled the report said "0 reused, 0 pulled, 0 computed" for every stage and never
    that it pulled the report. The labels' column is as wide as the longest label (`completions
    (local, torch/cpu/bfloat16/sdpa)`), in `run` and in `plan`."""
    from runner.models.train_tiny import make_untrained_drafter

    store, _ = local_run
    drafter = make_untrained_drafter(tiny_target, tmp_path_factory.mktemp("drafter-lines") / "d", seed=1)
    args = ["run", "eval", *_args(tiny_target, "--completions", "local", "--drafter", drafter)]
    assert cli(env, store, *args).code == 0
    r = cli(env, store, *args)
    assert r.code == 0, r.err
    tail = r.out[r.out.index("report.html"):].splitlines()[2:]
    rows = [ln for ln in tail if ln and "node(s)" not in ln]
    labels = ["prompts", "completions (local, ", "tokens", "hidden_states[1]", "drafter_eval d", "report"]
    for label in labels:
        assert any(ln.startswith(label) for ln in rows), f"no line for {label}:\n{r.out}"
    at = {ln.index(f"{N} reused") for ln in rows if "samples" in ln}
    longest = next(ln for ln in rows if ln.startswith("completions"))
    assert at == {longest.index(")") + 2}, rows  # every count starts one space after the longest label
    assert [ln.split("  ")[-1].strip() for ln in rows if ln.startswith("report")] == ["reused (in the store)"]
    assert tail[-1].startswith("0 node(s) did work, ") and "reused" in tail[-1]

    plan = cli(env, store, "plan", *args[1:])
    assert plan.code == 0, plan.err
    lines = plan.out.splitlines()[:-1]
    key_col = lines[0].index("KEY")
    assert all(re.fullmatch(r"[0-9a-f]{12}", ln[key_col:key_col + 12]) for ln in lines[1:]), plan.out

    # Only the report in a remote: it is pulled, and nothing under it is needed.
    key = next(ln.split("/")[-2] for ln in r.out.splitlines() if ln.startswith("report.json"))
    remote = tmp_path_factory.mktemp("report-remote") / "r"
    push = cli(env, store, "push", f"file://{remote}", key, "--no-upstream")
    assert push.code == 0, push.err
    other = tmp_path_factory.mktemp("pulls-report") / "store"
    pulled = cli(env, other, *args, "--remote", f"file://{remote}")
    assert pulled.code == 0, pulled.err
    rows = pulled.out[pulled.out.index("report.html"):].splitlines()[2:]
    assert [ln for ln in rows if ln.startswith("report")][0].endswith("pulled from a remote"), pulled.out
    assert all(ln.endswith(f"({N} not needed)") for ln in rows if ln.startswith(("prompts", "tokens"))), pulled.out
    assert "1 pulled" in rows[-1] and "not needed" in rows[-1], pulled.out


# `python -m dfcache` as the installed executable runs it (dfcache/__main__.py and its fast
# paths), reporting on its last stderr line the exit code, whether typer was imported, and which
# of the modules a fully cached run must not import were (LAZY: numpy alone costs such a run more
# than everything else it does, docs/benchmarks.md noop-eval).
LAZY = ("numpy", "crc32c", "google_crc32c", "zarr", "numcodecs", "http.client")
_EXE = r"""
import json, runpy, sys
try:
    runpy.run_module("dfcache", run_name="__main__", alter_sys=True)
    rc = 0
except SystemExit as e:
    rc = e.code
heavy = [m for m in HEAVY if m in sys.modules]
lazy = [m for m in LAZY if m in sys.modules]
sys.stderr.write("\n@@dfcache-exe " + json.dumps({"rc": rc, "typer": "typer" in sys.modules, "heavy": heavy,
                                                  "lazy": lazy}) + "\n")
sys.exit(rc)
""".replace("HEAVY", repr(HEAVY)).replace("LAZY", repr(LAZY))


def exe(env: dict, *args, cwd=None) -> tuple[Run, bool]:
    p = subprocess.run([sys.executable, "-c", _EXE, *map(str, args)], capture_output=True, text=True,
                       timeout=180, env=env, cwd=str(cwd or REPO))
    err, _, tail = p.stderr.rpartition("@@dfcache-exe ")
    info = json.loads(tail)
    assert info["rc"] == p.returncode
    return Run(p.returncode, p.stdout, err.rstrip("\n") + ("\n" if err.strip() else ""), 0.0, 0.0,
               info["heavy"], info["lazy"]), info["typer"]


def _no_seconds(out: str) -> str:
    out = re.sub(r'"seconds":[0-9.e-]+', '"seconds":S', out)
    return re.sub(r"(; | in )[0-9.]+ s(\.?)$", r"\1S s\2", out, flags=re.M)  # the summary line's seconds


@_NO_EVAL
def test_fully_cached_run_is_answered_before_typer_with_the_same_output(local_run, tiny_target, env,
                                                                         tmp_path_factory):
    """The executable answers a fully cached `run` without typer (runner/commands/fast_run.py) and prints
    what the full command line prints, byte for byte but the seconds, importing no numpy; anything
    else goes to it."""
    from runner.models.train_tiny import make_untrained_drafter

    store, _ = local_run
    drafter = make_untrained_drafter(tiny_target, tmp_path_factory.mktemp("drafter-fast") / "d", seed=1)
    args = ["run", "eval", *_args(tiny_target, "--completions", "local", "--drafter", drafter)]
    assert cli(env, store, *args, "--json").code == 0  # fills what is missing
    lines = [["--store", store, *args, "--json"], ["--store", store, *args, "--no-progress"],
             [*args, "--store", store, "--json", "--offline"],
             ["--store", store, "run", "tokens", *_args(tiny_target, "--completions", "local"), "--json"]]
    for line in lines:
        fast, typer_used = exe(env, *line)
        full = cli(env, None, *line)
        assert fast.code == full.code == 0, fast.err + full.err
        assert not typer_used and fast.heavy == [], line
        # Resolving keys, reading manifests and printing a cached result need no array code.
        assert fast.lazy == [], f"{line}: a fully cached run imported {fast.lazy}"
        assert _no_seconds(fast.out) == _no_seconds(full.out) and fast.out.strip()
        assert fast.err == full.err
    # Not understood completely (--debug), or work to do (a new prompt): the full CLI answers.
    debug, typer_used = exe(env, "--store", store, *args, "--json", "--debug")
    assert debug.code == 0 and typer_used and _no_seconds(debug.out) == _no_seconds(exe(env, *lines[0])[0].out)
    prompts = tmp_path_factory.mktemp("fast-prompts") / "p.jsonl"
    prompts.write_text('{"id": "new", "prompt": "a prompt no run has seen"}\n')
    before = committed(store)
    new, typer_used = exe(env, "--store", store, "run", "prompts", "--prompts", prompts, "--json")
    assert new.code == 0 and typer_used and new.json()["computed"]
    assert committed(store) > before
    bad, typer_used = exe(env, "--store", store, "run", "eval", "--num-prompts", "0", "--json")
    assert bad.code == EXIT_USAGE and typer_used and "--num-prompts" in bad.json()["error"]


@_NO_EVAL
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DFCACHE_SLOW_TESTS"),
                    reason="builds and trains the example models (minutes on a CPU); DFCACHE_SLOW_TESTS=1 runs it")
def test_fully_cached_example_eval_does_no_work_and_imports_no_torch(env, tmp_path):
    store = tmp_path / "store"
    first = cli(env, store, "run", "eval", "--example", "--json", timeout=3600)
    assert first.code == 0, first.err
    assert first.json()["computed"], "the first example run must compute"
    before = committed(store)
    r = cli(env, store, "run", "eval", "--example", "--json")
    assert r.code == 0, r.err
    assert r.json()["computed"] == []
    assert r.heavy == [], f"a fully cached eval imported {r.heavy}"
    assert committed(store) == before


# ----------------------------------------------------------------------------- 5. real server


def test_server_completions_replay_from_cache_after_the_server_is_gone(serve, tiny_target, env, tmp_path,
                                                                       module_model_fork_server):
    store = tmp_path / "store"
    args = ["run", "completions", *_args(tiny_target, "--server", serve.url), "--json"]
    serve.wait_ready()
    # serve answers with trimmed text only, whose rebuilt ids fail their check: exit 6, nothing cached.
    before = serve.chat_requests()
    refused = cli(env, store, *args, loads_model=True)
    assert refused.code == EXIT_BAD_INPUT, refused.err
    assert "--accept-retokenized" in refused.one_error() and "Traceback" not in refused.err
    assert serve.chat_requests() - before == N
    args.append("--accept-retokenized")
    first = cli(env, store, *args)
    assert first.code == 0, first.err + serve.log_tail()
    assert serve.chat_requests() - before == 2 * N
    serve.stop()
    port = serve.port
    nodes = first.json()["nodes"]
    assert [n["stage"] for n in nodes] == ["prompts", "completions"]
    assert nodes[1]["needs"] == "network" and nodes[1]["status"] == "network"
    assert sorted(first.json()["computed"]) == sorted(n["key"] for n in nodes[1:])  # prompts: the first run's
    # Checking text-only answers loads the target's tokenizer (transformers); the replay below loads nothing.
    assert "transformers" in first.heavy

    with RecordingListener(port=port) as listener:  # the server's port, now nobody's
        again = cli(env, store, *args)
        plan = cli(env, store, "plan", *args[1:])
        connections = _stop_listening(listener)
    assert again.code == 0, again.err
    assert again.json()["computed"] == []
    assert [n["status"] for n in again.json()["nodes"]] == ["cached", "cached"]
    assert plan.code == 0 and [n["status"] for n in plan.json()] == ["cached", "cached"]
    assert connections == 0
    assert again.heavy == []
