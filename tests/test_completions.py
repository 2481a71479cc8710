"""The completions stage against real servers: transformers serve, an SGLang-native test server,
scripted failures, and local greedy generation."""

from __future__ import annotations

import json
import re
import time

import pytest
from cli_util import dfcache
from servers import (ClosedPort, RecordingListener, ScriptedServer, SGLangTestServer, TransformersServe,
                     run_pipeline)

from dfcache import open_store
from dfcache.errors import (EXIT_BAD_INPUT, EXIT_NETWORK, CompletionIdsRefused, ConnectionRefused, NetworkError,
                            OfflineMissingError, OfflineModeIsEnabled, ServerHTTPError, ServerTimeout)
from runner.core.completion_source import ACCEPTED, label_of
from runner.stages.completions import read_completions
from runner.stages.tokens import read_tokens

N = 4


@pytest.fixture(autouse=True)
def _online(monkeypatch):
    monkeypatch.delenv("DFCACHE_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture(scope="module")
def servers(transformers_serve, tiny_target, tmp_path_factory):
    """Two transformers serve processes, starting together: the session's (conftest; it counts
    requests as differences), and one that a test kills."""
    live = transformers_serve
    dying = TransformersServe(tiny_target, tmp_path_factory.mktemp("serve") / "dying.log").launch()
    try:
        live.wait_ready()
        dying.wait_ready()
        yield live, dying
    finally:
        dying.stop()


@pytest.fixture
def serve(servers):
    return servers[0]


@pytest.fixture(scope="module")
def local_greedy(tiny_target, tmp_path_factory):
    """Local greedy completions of the N prompts, produced once for the comparisons below."""
    ctx, nodes = run_pipeline(tmp_path_factory.mktemp("local") / "store", "completions",
                              **_local_opts(tiny_target))
    return nodes["completions"].key, read_completions(ctx.store, nodes["completions"])


def _server_opts(target, url, **kw):
    opts = dict(target=str(target), completions="server", server=url, num_prompts=N, max_new_tokens=8)
    opts.update(kw)
    return opts


def _local_opts(target, **kw):
    opts = dict(target=str(target), completions="local", num_prompts=N, max_new_tokens=8,
                dtype="float32", device="cpu")
    opts.update(kw)
    return opts


def test_text_only_answers_of_transformers_serve_are_refused_then_accepted_and_marked(serve, local_greedy,
                                                                                        tiny_target, tmp_path):
    """`transformers serve` returns text only, and trims it: every completion's first token is
    " lists", served as "lists", which retokenizes to other ids (the issue's case: the server
    counted 8 tokens, the text makes more). Refused (exit 6, every prompt named with its counts,
    nothing cached); kept and marked with --accept-retokenized, and then replayed without the server."""
    store = tmp_path / "store"
    before = serve.chat_requests()
    with pytest.raises(CompletionIdsRefused) as e:
        run_pipeline(store, "completions", **_server_opts(tiny_target, serve.url))
    assert serve.chat_requests() - before == N
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert [r["id"] for r in e.value.refused] == [f"code-{i:02d}" for i in range(N)]
    msg = str(e.value)
    assert msg.startswith(f"{N} of the {N} completion(s) fetched are refused, so nothing was cached for them:")
    assert re.search(r"'code-00': the server counted 8 completion tokens, the text retokenizes to \d+", msg)
    assert "--server-api sglang" in msg and "--completions local" in msg and "--accept-retokenized" in msg
    assert [m.stage for m in open_store(store).list_manifests()] == ["prompts"]

    before = serve.chat_requests()
    ctx, nodes = run_pipeline(store, "completions", **_server_opts(tiny_target, serve.url, accept_retokenized=True))
    assert serve.chat_requests() - before == N
    comps = read_completions(ctx.store, nodes["completions"])
    assert [c.id for c in comps] == [f"code-{i:02d}" for i in range(N)]
    assert all(c.text and c.finish_reason in ("stop", "length") for c in comps)
    assert all(c.tokens_source == "retokenized" and c.token_ids is None for c in comps)
    assert all(c.ids_check["server_count"] == 8 and not c.ids_check["ok"] for c in comps)
    assert [label_of({"tokens_source": c.tokens_source, "ids_check": c.ids_check}) for c in comps] == [ACCEPTED] * N
    from dfcache.samples import index_of

    segs = index_of(ctx.store).segments(nodes["completions"].partition.key).values()
    assert sum(len(m.samples["keys"]) for m in segs) == N
    assert all(m.provenance["served_model"] == serve.model_name and m.provenance["endpoint"] == "openai"
               and m.provenance["ids_request"] is None for m in segs)  # serve answers 422 to unknown fields

    # The server is gone (a listener that counts connections stands at another address; the
    # URL is not key material): completions come from the store, tokens are computed locally,
    # once more refused without the flag (the verdict is the run's), made and marked with it.
    with RecordingListener() as listener:
        with pytest.raises(CompletionIdsRefused) as e:
            run_pipeline(store, "tokens", **_server_opts(tiny_target, listener.url, wait_server=5))
        assert "the stored completions of 4 of 4 prompt(s)" in str(e.value)
        ctx2, nodes2 = run_pipeline(store, "tokens", **_server_opts(tiny_target, listener.url, wait_server=5,
                                                                     accept_retokenized=True))
        assert listener.settle() == 0
    assert nodes2["completions"].key == nodes["completions"].key
    assert nodes2["completions"].status == "cached"
    assert ctx2.work_done == [nodes2["tokens"].key]
    toks = read_tokens(ctx2.store, nodes2["tokens"])
    from dfcache.samples import SampleSet

    tdocs = SampleSet(ctx2.store, nodes2["tokens"].partition.key, nodes2["tokens"].sample_keys).docs()
    assert [label_of(d) for d in tdocs] == [ACCEPTED] * N
    tok = _tokenizer(tiny_target)
    for i, c in enumerate(comps):
        expect = tok(c.text, add_special_tokens=False)["input_ids"]
        if c.finish_reason == "stop":
            expect = expect + [tok.eos_token_id]
        assert toks.completion(i).tolist() == expect
        assert tdocs[i]["ids_check"]["ids"] == len(expect) != 8

    # transformers serve is greedy at temperature 0: its text is our local greedy text, except
    # that it trims the content's whitespace (why its retokenized ids are refused).
    local_key, local = local_greedy
    assert local_key != nodes["completions"].key  # server and local completions differ
    assert [c.text.strip() for c in local] == [c.text.strip() for c in comps]
    assert all(c.text != lc.text for c, lc in zip(comps, local))


def test_wrong_served_model_name_is_clear_and_sends_no_generation(serve, tiny_target, tmp_path):
    before = serve.chat_requests()
    with pytest.raises(ServerHTTPError) as e:
        run_pipeline(tmp_path / "store", "completions",
                     **_server_opts(tiny_target, serve.url, served_model="Qwen/Qwen3-8B"))
    msg = str(e.value)
    assert "'Qwen/Qwen3-8B'" in msg and repr(serve.model_name) in msg and "--served-model" in msg
    assert e.value.exit_code == EXIT_NETWORK
    assert serve.chat_requests() == before


def test_killed_server_keeps_finished_and_resume_fetches_only_the_rest(servers, tiny_target, tmp_path, capsys):
    serve, dying = servers
    n, k = 6, 3
    store = tmp_path / "store"
    try:
        dying.kill_after(k)  # SIGKILL while it generates the k-th completion
        with pytest.raises(NetworkError) as e:
            run_pipeline(store, "completions", **_server_opts(tiny_target, dying.url, num_prompts=n,
                                                              concurrency=1, accept_retokenized=True))
        assert e.value.exit_code == EXIT_NETWORK
    finally:
        dying.stop()
    msg = str(e.value)
    assert dying.url in msg and ("closed the connection" in msg or "connection refused" in msg)
    # What finished before the kill is committed (the segment in flight is flushed on the error).
    kept = sum(len(m.samples["keys"]) for m in open_store(store).list_manifests() if m.stage == "completions")
    assert k - 1 <= kept <= k

    before = serve.chat_requests()
    capsys.readouterr()
    ctx, nodes = run_pipeline(store, "completions", **_server_opts(tiny_target, serve.url, num_prompts=n,
                                                                   accept_retokenized=True))
    fetched = serve.chat_requests() - before
    saved = n - fetched
    assert saved == kept  # everything that finished before the kill was kept, and only the rest fetched
    assert f"completions: {saved} of {n} already stored, {fetched} to fetch" in capsys.readouterr().err
    comps = read_completions(ctx.store, nodes["completions"])
    assert len(comps) == n and all(c.text for c in comps)

    # Same port as the killed server, now a listener: a cached run opens no connection at all.
    with RecordingListener(port=dying.port) as listener:
        _, nodes2 = run_pipeline(store, "completions",
                                 **_server_opts(tiny_target, dying.url, num_prompts=n, wait_server=3,
                                                accept_retokenized=True))
        assert listener.settle() == 0
    assert nodes2["completions"].status == "cached"


@pytest.mark.parametrize("mode, error, words", [
    ("500", ServerHTTPError, ["HTTP 500", "CUDA out of memory (scripted)"]),
    ("garbage", ServerHTTPError, ["not valid JSON"]),
    ("empty", ServerHTTPError, ["empty completion", "nothing was cached"]),
    ("hang", ServerTimeout, ["no answer within 1 s", "--request-timeout"]),
])
def test_failed_answers_are_never_cached(mode, error, words, tiny_target, tmp_path):
    store = tmp_path / "store"
    with ScriptedServer(chat=mode) as bad:
        with pytest.raises(error) as e:
            run_pipeline(store, "completions", **_server_opts(tiny_target, bad.url, request_timeout=1.0,
                                                              concurrency=2))
        assert bad.count("POST", "/v1/chat/completions") <= 2  # stopped at the first failure
    for w in words:
        assert w in str(e.value)
    with ScriptedServer(chat="ok") as good:
        ctx, nodes = run_pipeline(store, "completions", **_server_opts(tiny_target, good.url))
        assert good.count("POST", "/v1/chat/completions") == N  # nothing bad was kept
    assert [c.text for c in read_completions(ctx.store, nodes["completions"])] == ["hello"] * N


def test_requests_run_concurrently_within_the_bound(tiny_target, tmp_path):
    with ScriptedServer(chat="slow") as s:
        run_pipeline(tmp_path / "store", "completions",
                     **_server_opts(tiny_target, s.url, num_prompts=8, concurrency=3))
    assert s.max_in_flight == 3


def test_closed_port_fails_at_once_and_wait_server_waits(tiny_target, tmp_path, capsys):
    closed = ClosedPort()  # refused for the whole test (held until it ends)
    url = closed.url
    with pytest.raises(ConnectionRefused):
        run_pipeline(tmp_path / "store", "completions", **_server_opts(tiny_target, url))
    assert "waiting for server" not in capsys.readouterr().err  # one check, no wait
    t = time.monotonic()
    with pytest.raises(ConnectionRefused):
        run_pipeline(tmp_path / "store", "completions", **_server_opts(tiny_target, url, wait_server=2))
    assert time.monotonic() - t >= 2
    assert f"waiting for server at {url}: 2.0/2 s (connection refused)" in capsys.readouterr().err


def test_offline_makes_no_connection(tiny_target, tmp_path, monkeypatch):
    with RecordingListener() as listener:
        # Planning reports the missing artifact with the command that produces it.
        from runner.core.graph import RunContext, check_offline, resolve
        from runner.core.options import EvalOptions
        from runner.core.pipeline import build_graph

        opts = EvalOptions(**_server_opts(tiny_target, listener.url), offline=True)
        ctx = RunContext(open_store(tmp_path / "store"), opts,
                         argv=["run", "completions", "--server", listener.url, "--offline"])
        nodes = resolve(ctx, build_graph(ctx, upto="completions"))
        with pytest.raises(OfflineMissingError) as e:
            check_offline(ctx, nodes)
        node = [n for n in nodes if n.stage == "completions"][0]
        assert f"{N} of {N} sample(s) missing" in str(e.value) and "'code-00'" in str(e.value)
        assert listener.url in str(e.value)
        assert node.fix == f"dfcache run completions --server {listener.url}"
        # Whatever path reaches the transport while offline is refused there.
        monkeypatch.setenv("DFCACHE_OFFLINE", "1")
        with pytest.raises(OfflineModeIsEnabled):
            run_pipeline(tmp_path / "store", "completions", **_server_opts(tiny_target, listener.url))
        assert listener.settle() == 0


def test_sglang_native_gives_server_token_ids_equal_to_local_greedy(tiny_target, local_greedy, tmp_path):
    with SGLangTestServer(tiny_target, served_name="tiny-qwen") as s:
        ctx, nodes = run_pipeline(tmp_path / "store", "tokens",
                                  **_server_opts(tiny_target, s.url, server_api="sglang",
                                                 served_model="tiny-qwen"))
        assert s.count("POST", "/generate") == N
    comps = read_completions(ctx.store, nodes["completions"])
    assert all(c.tokens_source == "server" and c.token_ids for c in comps)
    assert [c.token_ids for c in comps] == [c.token_ids for c in local_greedy[1]]
    toks = read_tokens(ctx.store, nodes["tokens"])
    assert [toks.completion(i).tolist() for i in range(N)] == [c.token_ids for c in comps]


def test_local_greedy_equals_transformers_generate(tiny_target, local_greedy):
    import torch
    from transformers import AutoModelForCausalLM

    from runner.stages.prompts import load_records

    comps = local_greedy[1]
    assert all(c.tokens_source == "local" for c in comps)
    tok = _tokenizer(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    for rec, c in zip(load_records("builtin:coding")[:N], comps):
        ids = tok.apply_chat_template(rec["messages"], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id)
        assert c.token_ids == out[0, ids.shape[1]:].tolist()
        assert c.finish_reason == ("stop" if c.token_ids[-1] == tok.eos_token_id else "length")


def _tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target))


def test_preflight_checks_the_server_once_before_any_work(tiny_target, tmp_path):
    from runner.core.graph import RunContext, resolve
    from runner.core.pipeline import execute
    from runner.core.options import EvalOptions
    from runner.core.pipeline import build_graph
    from runner.stages import completions

    def plan(url):
        ctx = RunContext(open_store(tmp_path / "store"), EvalOptions(progress=False, **_server_opts(tiny_target, url)))
        return ctx, resolve(ctx, build_graph(ctx, upto="tokens"))

    closed = ClosedPort()
    ctx, nodes = plan(closed.url)
    with pytest.raises(ConnectionRefused):
        completions.preflight(ctx, nodes)
    assert ctx.store.list_manifests() == []  # failed before any stage ran
    with ScriptedServer(chat="ok") as s:
        ctx, nodes = plan(s.url)
        completions.preflight(ctx, nodes)
        execute(ctx, nodes)
        assert (s.count("GET", "/health"), s.count("GET", "/v1/models")) == (1, 1)
        assert s.count("POST", "/v1/chat/completions") == N



def _prompt_file(path, order):
    from runner.stages.prompts import load_records

    recs = load_records("builtin:coding")
    path.write_text("".join(json.dumps(recs[i]) + "\n" for i in order))
    return str(path)


def test_any_subset_superset_or_order_of_fetched_prompts_reuses_every_completion(serve, tiny_target, tmp_path):
    """Fetch 4 prompts; with the server gone (a listener counting connections at another address),
    a 2-prompt subset and the 4 reordered run offline with no connection; a superset of 5 exits 3
    naming the one missing prompt; online, the superset sends exactly one request. (serve's text-only
    answers fail their check: accepted here, where reuse is what is tested.)"""
    store = tmp_path / "store"
    before = serve.chat_requests()
    run_pipeline(store, "completions", **_server_opts(tiny_target, serve.url, accept_retokenized=True,
                                                      prompts=_prompt_file(tmp_path / "four.jsonl", [0, 1, 2, 3])))
    assert serve.chat_requests() - before == 4
    with RecordingListener() as gone:
        for name, order in (("two", [2, 0]), ("reordered", [3, 1, 0, 2])):
            ctx, nodes = run_pipeline(store, "tokens", offline=True, accept_retokenized=True,
                                      **_server_opts(tiny_target, gone.url, num_prompts=len(order),
                                                     prompts=_prompt_file(tmp_path / f"{name}.jsonl", order)))
            assert nodes["completions"].status == "cached"
            assert [c.id for c in read_completions(ctx.store, nodes["completions"])] == \
                [f"code-{i:02d}" for i in order]
        five = _prompt_file(tmp_path / "five.jsonl", [4, 0, 1, 2, 3])
        r = dfcache("run", "tokens", "--target", tiny_target, "--prompts", five, "--server", gone.url,
                    "--max-new-tokens", 8, "--offline", store=store, env={"HF_HUB_OFFLINE": "1"})
        time.sleep(0.2)
        assert gone.connections == 0
    assert r.code == 3, r.err
    assert "1 of 5 sample(s) missing" in r.err and "'code-04'" in r.err and "code-00" not in r.err
    fix = next(line for line in r.err.splitlines() if "produce it with:" in line)
    assert " run tokens " in fix and "--offline" not in fix and "Traceback" not in r.err
    before = serve.chat_requests()
    ctx, nodes = run_pipeline(store, "tokens", **_server_opts(tiny_target, serve.url, prompts=five, num_prompts=5,
                                                              accept_retokenized=True))
    assert serve.chat_requests() - before == 1
    assert nodes["completions"].samples_dict()["produced"] == 1
    assert nodes["tokens"].samples_dict() == {**nodes["tokens"].samples_dict(), "cached": 4, "produced": 1}


def test_the_context_window_counts_rope_scaling(tmp_path):
    """`--max-new-tokens` is refused at or past the target's context window (exit 6, before any
    work); a YaRN-scaled model serves past max_position_embeddings, so its factor counts."""
    import json as _json

    from runner.models.resolve import context_window

    for cfg, want in (({"max_position_embeddings": 4096}, 4096),
                      ({"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 131072),
                      ({"text_config": {"max_position_embeddings": 100, "rope_parameters": {"factor": 2}}}, 200),
                      ({"vocab_size": 8}, None), ([1, 2], None)):
        (tmp_path / "config.json").write_text(_json.dumps(cfg))
        assert context_window(tmp_path) == want, cfg
