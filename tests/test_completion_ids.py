"""Exact completion ids from servers, and the check of ids rebuilt from text (issue 30, point 1).

Servers: VLLMTestServer (vLLM's OpenAI chat endpoint as its protocol code answers it: ids when
asked, a reasoning parser's split), SGLangTestServer (native /generate ids), ScriptedServer. The
`transformers serve` cases (a real server that gives text only) are in tests/test_completions.py,
which already runs one for its module.
"""

from __future__ import annotations

import pytest
from servers import SCRIPTED_TOKENS, SGLangTestServer, VLLMTestServer, run_pipeline

from dfcache import open_store
from dfcache.errors import EXIT_BAD_INPUT, CompletionIdsRefused
from dfcache.samples import SampleSet, index_of
from runner.core.completion_source import ACCEPTED, LOCAL, SERVER, VERIFIED, label_of
from runner.stages.completions import read_completions
from runner.stages.tokens import read_tokens

N = 4


@pytest.fixture(autouse=True)
def _online(monkeypatch):
    monkeypatch.delenv("DFCACHE_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def _opts(target, url, **kw):
    return {**dict(target=str(target), completions="server", server=url, num_prompts=N, max_new_tokens=8), **kw}


@pytest.fixture(scope="module")
def local_tokens(tiny_target, tmp_path_factory):
    """Local greedy tokens of the N prompts (8 and 3 new tokens), produced once."""
    out = {}
    for n in (8, 3):
        ctx, nodes = run_pipeline(tmp_path_factory.mktemp("local") / "store", "tokens", target=str(tiny_target),
                                  completions="local", num_prompts=N, max_new_tokens=n, dtype="float32", device="cpu")
        toks = read_tokens(ctx.store, nodes["tokens"])
        out[n] = [toks.sample(i).tolist() for i in range(N)], _docs(ctx.store, nodes["tokens"])
    return out


def _docs(store, node):
    return SampleSet(store, node.partition.key, node.sample_keys).docs()


def _stored(store, node) -> list[bool]:
    missing = set(index_of(open_store(store)).missing(node.partition.key, node.sample_keys))
    return [k not in missing for k in node.sample_keys]


@pytest.mark.parametrize("version, asked", [("0.11.0", "return_token_ids"), ("0.9.2", "logprobs")])
def test_vllm_is_asked_for_its_ids_and_they_equal_local_greedy(version, asked, tiny_target, local_tokens, tmp_path):
    """The issue's τ 1.01 (retokenized) against 2.72 (local): with vLLM's own ids the tokens are the
    local greedy tokens, id for id, so every downstream number is the same."""
    with VLLMTestServer(tiny_target, version=version, return_token_ids=version >= "0.10.2") as s:
        ctx, nodes = run_pipeline(tmp_path / "store", "tokens", **_opts(tiny_target, s.url))
        bodies = s.bodies
    assert len(bodies) == N
    if asked == "return_token_ids":
        assert all(b.get("return_token_ids") is True and "logprobs" not in b for b in bodies)
    else:  # before 0.10.2: logprobs with every token written token_id:N
        assert all(b.get("logprobs") is True and b.get("return_tokens_as_token_ids") is True
                   and "return_token_ids" not in b for b in bodies)
    comps = read_completions(ctx.store, nodes["completions"])
    assert [c.tokens_source for c in comps] == ["server"] * N
    toks = read_tokens(ctx.store, nodes["tokens"])
    local_ids, local_docs = local_tokens[8]
    assert [toks.sample(i).tolist() for i in range(N)] == local_ids
    assert [label_of(d) for d in _docs(ctx.store, nodes["tokens"])] == [SERVER] * N
    assert [label_of(d) for d in local_docs] == [LOCAL] * N
    seg = next(iter(index_of(ctx.store).segments(nodes["completions"].partition.key).values()))
    assert seg.provenance["server_owned_by"] == "vllm" and seg.provenance["ids_request"] == asked
    assert seg.provenance["server_version"] == version


def test_sglang_native_ids_are_labelled_server(tiny_target, local_tokens, tmp_path):
    with SGLangTestServer(tiny_target, served_name="tiny-qwen") as s:
        ctx, nodes = run_pipeline(tmp_path / "store", "tokens",
                                  **_opts(tiny_target, s.url, server_api="sglang", served_model="tiny-qwen"))
    assert [label_of(d) for d in _docs(ctx.store, nodes["tokens"])] == [SERVER] * N
    toks = read_tokens(ctx.store, nodes["tokens"])
    assert [toks.sample(i).tolist() for i in range(N)] == local_tokens[8][0]


def test_text_only_answers_are_checked_refused_and_accepted(tiny_target, local_tokens, tmp_path):
    """A vLLM too old for either way of returning ids gives text only. At 3 new tokens, two of the
    four texts end inside a multi-byte character (U+FFFD, 5 ids for the 3 generated): those are
    refused, exit 6 naming them with the counts, nothing cached for them, the other two kept
    (verified). --accept-retokenized then fetches only the two and keeps them, marked."""
    store = tmp_path / "store"
    old = dict(version="0.9.2", return_token_ids=False, tokens_as_ids=False)
    with VLLMTestServer(tiny_target, **old) as s:
        with pytest.raises(CompletionIdsRefused) as e:
            run_pipeline(store, "tokens", **_opts(tiny_target, s.url, max_new_tokens=3))
        assert len(s.bodies) == N
    err = e.value
    assert err.exit_code == EXIT_BAD_INPUT
    assert [r["id"] for r in err.refused] == ["code-01", "code-02"] and all(r["acceptable"] for r in err.refused)
    msg = str(err)
    assert msg.startswith("2 of the 4 completion(s) fetched are refused, so nothing was cached for them "
                          "(the other 2 were):")
    assert "'code-01': the server counted 3 completion tokens, the text retokenizes to 5" in msg
    assert "U+FFFD" in msg and "'code-00'" not in msg
    for fix in ("--server-api sglang", "a vLLM server", "--completions local", "--accept-retokenized"):
        assert fix in msg

    ctx = _ctx(store, tiny_target, "http://x:1", max_new_tokens=3)
    comps_node = {n.stage: n for n in _resolved(ctx, "completions")}["completions"]
    assert _stored(store, comps_node) == [True, False, False, True]
    docs = SampleSet(ctx.store, comps_node.partition.key, [comps_node.sample_keys[i] for i in (0, 3)]).docs()
    assert [d["ids_check"]["ok"] for d in docs] == [True, True]
    assert docs[0]["ids_check"] == {"ok": True, "ids": 3, "server_count": 3, "round_trip": True, "problem": None,
                                    "replacement_chars": 0, "reasoning_put_back": False}

    with VLLMTestServer(tiny_target, **old) as s:
        ctx, nodes = run_pipeline(store, "tokens", **_opts(tiny_target, s.url, max_new_tokens=3,
                                                           accept_retokenized=True))
        assert len(s.bodies) == 2  # only the refused two are fetched again
    tdocs = _docs(ctx.store, nodes["tokens"])
    assert [label_of(d) for d in tdocs] == [VERIFIED, ACCEPTED, ACCEPTED, VERIFIED]
    assert tdocs[1]["ids_check"]["server_count"] == 3 and tdocs[1]["ids_check"]["ids"] == 5
    toks = read_tokens(ctx.store, nodes["tokens"])
    local = local_tokens[3][0]
    # The verified ones are the generation; the accepted ones are not (why they are marked).
    assert [toks.sample(i).tolist() == local[i] for i in range(N)] == [True, False, False, True]

    # A later run that computes from the stored, accepted tokens decides again: refused without the
    # flag (nothing computed), computed with it.
    hs = dict(_opts(tiny_target, "http://127.0.0.1:9", max_new_tokens=3), layers=[1], backend="torch",
              device="cpu", dtype="float32")
    with pytest.raises(CompletionIdsRefused) as e:
        run_pipeline(store, "hidden-states", **hs)
    assert [r["id"] for r in e.value.refused] == ["code-01", "code-02"]
    assert "stored sample(s) this run would compute from" in str(e.value)
    assert not any(m.stage == "hidden_states" for m in open_store(store).list_manifests())
    ctx, nodes = run_pipeline(store, "hidden-states", **hs, accept_retokenized=True)
    assert any(m.stage == "hidden_states" for m in open_store(store).list_manifests())


def test_completions_cached_before_checks_are_checked_by_the_tokens_stage(tiny_target, tmp_path):
    """A store written before checks existed holds text-only completions without ``ids_check``:
    the tokens stage checks them when it makes their ids, and refuses the same way."""
    from dfcache.samples import SampleSink
    from runner.core.graph import RunContext, resolve
    from runner.core.options import EvalOptions
    from runner.core.pipeline import build_graph, execute

    store = tmp_path / "store"
    opts = _opts(tiny_target, "http://127.0.0.1:9", max_new_tokens=8)
    ctx = RunContext(open_store(store), EvalOptions(progress=False, **opts))
    nodes = {n.stage: n for n in resolve(ctx, build_graph(ctx, upto="prompts"))}
    execute(ctx, list(nodes.values()))
    nodes = {n.stage: n for n in resolve(ctx, build_graph(ctx, upto="completions"))}
    comps = nodes["completions"]
    texts = [("hello", SCRIPTED_TOKENS), ("hello", 2), ("hello", SCRIPTED_TOKENS), (" lists the\ufffd", 3)]
    with SampleSink(ctx.store, comps.partition) as sink:  # what the previous version stored
        for i, (text, count) in enumerate(texts):
            sink.add(comps.upstream_samples[i], doc={"text": text, "finish_reason": "stop" if i < 3 else "length",
                                                     "token_ids": None, "tokens_source": "retokenized",
                                                     "prompt_tokens": 9, "completion_tokens": count})
    with pytest.raises(CompletionIdsRefused) as e:
        run_pipeline(store, "tokens", **opts)
    assert [r["id"] for r in e.value.refused] == ["code-01", "code-03"]
    msg = str(e.value)
    assert "the stored completions of 2 of 4 prompt(s)" in msg
    assert "'code-01': the server counted 2 completion tokens, the text retokenizes to 5 (with the stop token)" in msg
    ctx, nodes = run_pipeline(store, "tokens", **opts, accept_retokenized=True)
    assert [label_of(d) for d in _docs(ctx.store, nodes["tokens"])] == [VERIFIED, ACCEPTED, VERIFIED, ACCEPTED]


def test_scripted_answer_is_what_a_server_of_the_tiny_target_counts(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    assert SCRIPTED_TOKENS == len(tok("hello", add_special_tokens=False)["input_ids"]) + 1  # + the stop token


def test_ids_that_disagree_with_the_servers_text_are_refused_even_when_accepting(tiny_target, tmp_path):
    prompts = _user_texts(N)

    def lie(user, ids, text):  # code-01 gets the ids of another answer, code-02 an id no tokenizer has
        if user == prompts[1]:
            return [i + 1 for i in ids], text
        return ([-5] + ids[1:], text) if user == prompts[2] else (ids, text)

    store = tmp_path / "store"
    with VLLMTestServer(tiny_target, tamper=lie) as s:
        with pytest.raises(CompletionIdsRefused) as e:
            run_pipeline(store, "completions", **_opts(tiny_target, s.url, accept_retokenized=True))
    assert [(r["id"], r["acceptable"]) for r in e.value.refused] == [("code-01", False), ("code-02", False)]
    msg = str(e.value)
    assert "'code-01': its 8 token ids decode to text that does not hold the server's own text" in msg
    assert "'code-02': its token ids include values no tokenizer has" in msg
    assert "--accept-retokenized" not in msg and "never kept" in msg
    ctx = _ctx(store, tiny_target, s.url)
    comps = {n.stage: n for n in _resolved(ctx, "completions")}["completions"]
    assert _stored(store, comps) == [True, False, False, True]


QWEN3_STYLE = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
    "{%- set r = m.get('reasoning_content') or '' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + m['content'].lstrip('\\n')"
    " + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def thinking_target(tiny_target, tmp_path_factory):
    """The tiny target with a chat template in Qwen3's form: the generation prompt opens
    ``<think>\\n`` and an assistant turn renders ``<think>\\nR\\n</think>\\n\\nC``."""
    import shutil

    out = tmp_path_factory.mktemp("thinking") / "target"
    shutil.copytree(tiny_target, out)
    (out / "chat_template.jinja").write_text(QWEN3_STYLE)
    return out


def test_a_reasoning_split_is_put_back_in_the_templates_form_and_checked(thinking_target, tmp_path):
    """A text-only server with a reasoning parser: prompt code-00's answer (scripted: the tiny model
    never writes </think>) is put back together and verified, id for id what was generated; the
    others, cut inside their thinking, put back with a closing tag they never generated, fail
    their count and are refused."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(thinking_target))
    answer = "I add them.\n</think>\n\nThe answer is 42"
    gen = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompts = _user_texts(N)
    store = tmp_path / "store"
    with VLLMTestServer(thinking_target, version="0.9.2", return_token_ids=False, tokens_as_ids=False,
                        reasoning_parser=True, script={prompts[0]: gen}) as s:
        with pytest.raises(CompletionIdsRefused) as e:
            run_pipeline(store, "tokens", **_opts(thinking_target, s.url, enable_thinking=True, max_new_tokens=32))
    assert [r["id"] for r in e.value.refused] == ["code-01", "code-02", "code-03"], str(e.value)
    ctx = _ctx(store, thinking_target, s.url, enable_thinking=True, max_new_tokens=32)
    comps = {n.stage: n for n in _resolved(ctx, "completions")}["completions"]
    assert _stored(store, comps) == [True, False, False, False]
    doc = SampleSet(ctx.store, comps.partition.key, comps.sample_keys[:1]).docs()[0]
    assert (doc["text"], doc["reasoning_content"]) == ("\n\nThe answer is 42", "I add them.\n")
    assert doc["ids_check"]["ok"] and doc["ids_check"]["reasoning_put_back"]

    with VLLMTestServer(thinking_target, version="0.9.2", return_token_ids=False, tokens_as_ids=False,
                        reasoning_parser=True, script={prompts[0]: gen}) as s:
        ctx, nodes = run_pipeline(store, "tokens", **_opts(thinking_target, s.url, enable_thinking=True,
                                                           max_new_tokens=32, num_prompts=1))
    toks = read_tokens(ctx.store, nodes["tokens"])
    assert toks.completion(0).tolist() == gen
    prompt = tok.apply_chat_template(_records(1)[0]["messages"], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=True)
    assert tok.decode(toks.sample(0).tolist()) == prompt + answer + "<|im_end|>"
    assert label_of(_docs(ctx.store, nodes["tokens"])[0]) == VERIFIED


def test_reasoning_the_template_cannot_put_back_is_refused_even_when_accepting(tiny_target, tmp_path):
    """The tiny target's template has no place for reasoning: a server that split some off cannot
    be put back together. Exit 6 naming the prompts, nothing cached, whatever the options."""
    store = tmp_path / "store"
    with VLLMTestServer(tiny_target, version="0.9.2", return_token_ids=False, tokens_as_ids=False,
                        reasoning_parser=True) as s:
        with pytest.raises(CompletionIdsRefused) as e:
            run_pipeline(store, "completions", **_opts(tiny_target, s.url, num_prompts=2, accept_retokenized=True))
    assert [(r["id"], r["acceptable"]) for r in e.value.refused] == [("code-00", False), ("code-01", False)]
    assert "its reasoning_content cannot be put back: the target's chat template has no place for the reasoning" \
        in str(e.value)
    assert not any(m.stage == "completions" for m in open_store(store).list_manifests())


def test_a_vllm_with_a_reasoning_parser_still_gives_the_whole_generation_as_ids(thinking_target, tmp_path):
    """With ids the split does not matter: they are the whole generation, checked against the
    reasoning and the content together."""
    with VLLMTestServer(thinking_target, reasoning_parser=True) as s:
        ctx, nodes = run_pipeline(tmp_path / "store", "tokens", **_opts(thinking_target, s.url,
                                                                        enable_thinking=True, num_prompts=2))
    comps = read_completions(ctx.store, nodes["completions"])
    assert all(c.tokens_source == "server" and c.reasoning_content and not c.text for c in comps)
    assert [label_of(d) for d in _docs(ctx.store, nodes["tokens"])] == [SERVER] * 2


# ----------------------------------------------------------------------------- helpers


def _records(n):
    from runner.stages.prompts import load_records

    return load_records("builtin:coding")[:n]


def _user_texts(n):
    return [r["messages"][-1]["content"] for r in _records(n)]


def _ctx(store, target, url, **kw):
    from runner.core.graph import RunContext
    from runner.core.options import EvalOptions

    return RunContext(open_store(store), EvalOptions(progress=False, **_opts(target, url, **kw)))


def _resolved(ctx, upto):
    from runner.core.graph import resolve
    from runner.core.pipeline import build_graph

    return resolve(ctx, build_graph(ctx, upto=upto))
