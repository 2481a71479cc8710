"""Where completions come from: an OpenAI-compatible server, SGLang's native API, or local greedy
generation with transformers.

Every source has the same shape: ``prepare()`` once (readiness and model-name check for a
server, model loading for local), then ``complete(record) -> Completion`` per prompt record,
which either returns a usable completion or raises. A source never retries and never returns
an empty or failed completion, so nothing broken reaches the store.

Kinds (``Completion.tokens_source`` says where the completion's token ids come from):

``openai``  ``POST /v1/chat/completions`` (SGLang, vLLM, ``transformers serve``). The server
            applies the chat template. A vLLM server (``owned_by: "vllm"`` at ``/v1/models``) is
            asked for the ids it generated: ``return_token_ids`` from vLLM 0.10.2 (``/version``),
            ``logprobs`` with ``return_tokens_as_token_ids`` before it (``server``). Other servers
            are sent no field they may not know: ``transformers serve`` answers an unknown field
            with HTTP 422, and SGLang's chat endpoint returns no completion ids (its non-streaming
            response fills ``prompt_token_ids`` only). Their text is ``retokenized`` and checked
            (runner/stages/completions/ids.py).
``sglang``  SGLang's native ``POST /generate``. The prompt goes through the target's chat
            template here and is sent as ``input_ids``, so the server sees exactly the prompt
            ids the tokens stage records. SGLang returns ``output_ids`` (``server``).
``local``   ``model.generate(do_sample=False)`` with transformers from the target directory:
            exact greedy ids (``local``). The first generated token is the prefill argmax; it is
            kept, the completion is exactly the greedy output.

Prompt rendering is shared (:func:`encode_prompt`) so the sglang and local sources and the
tokens stage agree on every prompt id.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dfcache.errors import BadInputError, NetworkError, ServerHTTPError, UsageError

from ...core.graph import RunCache
from ...core.values import int_list

if TYPE_CHECKING:  # dfcache.http (http.client, ssl) is imported where a server is talked to
    from dfcache.http import HttpClient

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    enable_thinking: bool = False


@dataclass
class Completion:
    """One finished completion. ``token_ids`` is None when the source gave only text."""

    text: str
    finish_reason: str
    token_ids: list[int] | None
    tokens_source: str  # server | local | retokenized
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    extra: dict = field(default_factory=dict)

    def to_doc(self, index: int, record_id: str) -> dict:
        doc = {"index": index, "id": record_id, "text": self.text, "finish_reason": self.finish_reason,
               "token_ids": self.token_ids, "tokens_source": self.tokens_source,
               "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        doc.update(self.extra)
        return doc


# ----------------------------------------------------------------------------- prompts


def load_tokenizer(target_dir: str | Path, cache: RunCache | None = None):
    """``AutoTokenizer`` of the target, loaded once per run when the run's ``cache`` is given."""
    key = str(target_dir)
    if cache is not None and key in cache.tokenizers:
        return cache.tokenizers[key]
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir))
    except (OSError, ValueError, TypeError, KeyError) as e:
        # transformers' message spans many lines; planning checks the files, this is what is left.
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise BadInputError(f"the tokenizer of {target_dir} cannot be loaded ({first}); pass a model "
                            "directory with a complete tokenizer (tokenizer.json).") from None
    if cache is not None:
        cache.tokenizers[key] = tok
    return tok


def render_prompt(tokenizer, messages: list[dict], enable_thinking: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)


def encode_prompt(tokenizer, messages: list[dict], enable_thinking: bool) -> list[int]:
    """Prompt ids: the chat template rendered as text, then encoded without added special tokens
    (the template already holds them; adding a BOS again would shift every position)."""
    text = render_prompt(tokenizer, messages, enable_thinking)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------- servers

# dfcache.http's fixes in the runner's words: which of our flags to change (dfcache.http knows none).
SERVER_FIXES = {
    "bad_url": "Pass --server http://HOST:PORT.",
    "refused": "Start the server there or pass the right --server URL (if it is starting, pass "
               "--wait-server SECONDS).",
    "refused.waited": "Start the server there or pass the right --server URL (if it is starting, pass a "
                      "larger --wait-server).",
    "not_ready": "Wait until it has loaded the model, or pass --wait-server SECONDS to wait for it.",
    "not_ready.waited": "Wait until it has loaded the model, or pass a larger --wait-server.",
    "read_timeout": "The server may be hung or overloaded: check its log, lower --concurrency or raise "
                    "--request-timeout.",
    "ready_timeout": "It accepts connections but did not answer its readiness check (each check waits up to "
                     "10 s): it may still be loading or be hung. Check its log, or pass --wait-server SECONDS "
                     "to wait for it.",
    "ready_timeout.waited": "It accepts connections but never answered its readiness check: it may still be "
                            "loading or be hung. Check its log, or pass a larger --wait-server.",
    "unresolvable": "Check the host name in --server and the network.",
    "no_route": "Check --server and the network (VPN, firewall).",
    "other": "Check that the server is running and --server is right.",
    "bad_json": "Check that --server points at an OpenAI-compatible or SGLang server and look at its log.",
    "http_not_found": "Check that --server points at the right server and --server-api matches it.",
    "http_client": "Check the request options (--served-model, sampling options) against the server's log.",
}


# The most bytes one generation's answer may have (dfcache.http reads no more; beyond it the
# request fails with exit 4, and DFCACHE_MAX_RESPONSE_BYTES replaces the bound). Per generated
# token: its text JSON-escaped (a 16-character token of \uXXXX escapes is ~100 bytes), its id, and
# room for a server that adds 20 top log-probabilities (OpenAI's shape, ~60 bytes each): 4 KiB.
# Fixed part: the prompt's token ids where a server echoes them (vLLM's return_token_ids, ~7 bytes
# each: 4 MiB holds ~600k), usage and other metadata. 2048 tokens: 12 MiB; 32768: 132 MiB; at
# most 1 GiB.
RESPONSE_BASE_BYTES = 4 << 20
RESPONSE_TOKEN_BYTES = 4 << 10
RESPONSE_MAX_BYTES = 1 << 30


def response_bytes(max_new_tokens: int) -> int:
    """The size bound of one generation's answer (see RESPONSE_TOKEN_BYTES)."""
    return min(RESPONSE_MAX_BYTES, RESPONSE_BASE_BYTES + max(0, int(max_new_tokens)) * RESPONSE_TOKEN_BYTES)


def server_url(url: str | None) -> str:
    """``--server`` as a base URL (``host:port`` and ``.../v1`` accepted)."""
    from dfcache.http import normalize_base_url

    return normalize_base_url(url or "", SERVER_FIXES)



def check_served_model(client: HttpClient, base: str, wanted: str | None,
                       api: str = "openai") -> tuple[str, str | None]:
    """The model name to request, checked against what the server lists at ``/v1/models``, and the
    ``owned_by`` of its entry (vLLM says ``vllm``, SGLang ``sglang``: what tells the servers apart).

    With ``wanted`` given it must be listed; without, the server must serve exactly one model.
    SGLang servers without ``/v1/models`` are asked ``/get_model_info`` instead.
    """
    try:
        data = client.get_json(base + "/v1/models", timeout=60)
        entries = data.get("data") if isinstance(data, dict) else None
        entries = [m for m in entries or [] if isinstance(m, dict) and m.get("id")]
        owners = {str(m["id"]): m.get("owned_by") if isinstance(m.get("owned_by"), str) else None for m in entries}
    except ServerHTTPError as e:
        if api != "sglang" or e.status != 404:
            raise
        info = client.get_json(base + "/get_model_info", timeout=60)
        owners = {str(info["model_path"]): "sglang"} if isinstance(info, dict) and info.get("model_path") else {}
    names = list(owners)
    if not names:
        raise ServerHTTPError(f"the server at {base} lists no models at /v1/models; check that it has "
                              "loaded the target and that --server points at it.", url=base + "/v1/models")
    if wanted is not None:
        if wanted in names:
            return wanted, owners[wanted]
        raise ServerHTTPError(
            f"the server at {base} serves {', '.join(repr(n) for n in names)}, not the requested model "
            f"{wanted!r}; pass --served-model {names[0]!r} if that is the target, or point --server at "
            f"the server of {wanted!r}.", url=base + "/v1/models")
    if len(names) == 1:
        return names[0], owners[names[0]]
    raise ServerHTTPError(f"the server at {base} serves {len(names)} models ({', '.join(names[:8])}); "
                          "choose one with --served-model NAME.", url=base + "/v1/models")


# vLLM's chat request has return_token_ids (the ids in choices[i].token_ids) from 0.10.2; before it,
# logprobs with return_tokens_as_token_ids give each generated token as "token_id:N" (read at
# vllm/entrypoints/openai/chat_completion/protocol.py and serving.py, chat_completion_full_generator).
VLLM_RETURN_TOKEN_IDS = (0, 10, 2)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def vllm_version(client: HttpClient, base: str) -> tuple[int, int, int] | None:
    """vLLM's version from its ``/version`` (``{"version": "0.11.0"}``), or None where it has none."""
    try:
        data = client.get_json(base + "/version", timeout=60)
    except ServerHTTPError:
        return None
    m = _VERSION.match(str(data.get("version", ""))) if isinstance(data, dict) else None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def ids_from_logprobs(logprobs) -> list[int] | None:
    """The generated ids from OpenAI-style logprobs whose tokens vLLM wrote as ``token_id:N``
    (``return_tokens_as_token_ids``); None unless every entry has that form."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content:
        return None
    ids = []
    for entry in content:
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str) or not token.startswith("token_id:") or not token[9:].isdigit():
            return None
        ids.append(int(token[9:]))
    return ids


class _ServerSource:
    kind = "server"

    def __init__(self, base_url: str, params: SamplingParams, *, served_model: str | None = None,
                 client: HttpClient | None = None, wait_seconds: float = 0.0, progress=True,
                 out=None, request_timeout: float | None = None, cache: RunCache | None = None) -> None:
        self.cache = cache if cache is not None else RunCache()
        self.base = server_url(base_url)
        self.params = params
        self.wanted_model = served_model
        self.model: str | None = None
        self.info: dict = {}  # what check_server learnt: owned_by, vLLM's version
        if client is None:
            from dfcache.http import HttpClient

            client = HttpClient(fixes=SERVER_FIXES)
        self.client = client
        self.wait_seconds = wait_seconds
        self.progress = progress
        self.out = out
        self.request_timeout = request_timeout

    def check_server(self) -> str:
        """Readiness, then the model name: once per run and server, before any generation request."""
        key = (self.base, self.kind, self.wanted_model)
        if key not in self.cache.served_models:
            from dfcache.http import wait_ready

            try:
                wait_ready(self.base, self.wait_seconds, self.progress, client=self.client, out=self.out)
            except NetworkError as e:
                if getattr(e, "reason", None) != "read_timeout":
                    raise
                # The readiness probe's own timeout (10 s at most), which --request-timeout does not
                # change: its fix says "raise --request-timeout", which did nothing here.
                raise e.with_fix(SERVER_FIXES["ready_timeout.waited" if self.wait_seconds else "ready_timeout"]) from None
            name, owner = check_served_model(self.client, self.base, self.wanted_model, self.kind)
            info = {"owned_by": owner}
            if self.kind == "openai" and owner == "vllm":
                info["version"] = vllm_version(self.client, self.base)
            self.cache.server_info[key] = info
            self.cache.served_models[key] = name
        self.model = self.cache.served_models[key]
        self.info = self.cache.server_info.get(key, {})
        return self.model

    def prepare(self) -> None:
        self.check_server()

    @property
    def provenance(self) -> dict:
        prov = {"endpoint": self.kind, "server": self.base, "served_model": self.model,
                "server_owned_by": self.info.get("owned_by")}
        if self.info.get("version") is not None:
            prov["server_version"] = ".".join(map(str, self.info["version"]))
        return prov

    def close(self) -> None:
        self.client.close()

    def _bad(self, url: str, what: str, record_id: str) -> ServerHTTPError:
        return ServerHTTPError(f"{url} answered prompt {record_id!r} with {what}; nothing was cached for "
                               "it. Check the server's log and run again (finished completions are kept).",
                               url=url, status=200)


class OpenAIChatSource(_ServerSource):
    """``/v1/chat/completions``; the server applies its chat template.

    What is asked for the ids (``ids_request``) follows what :meth:`check_server` learnt, once per
    run and server, never by trying a request and retrying another: ``return_token_ids`` for vLLM
    0.10.2 and later (or a vLLM without ``/version``), ``logprobs`` + ``return_tokens_as_token_ids``
    for older vLLM, nothing for other servers. Ids a server sends unasked in ``choices[0].token_ids``
    are used too (after the stage checks them against the text).
    """

    kind = "openai"

    @property
    def ids_request(self) -> str | None:
        if self.info.get("owned_by") != "vllm":
            return None
        version = self.info.get("version")
        return "logprobs" if version is not None and version < VLLM_RETURN_TOKEN_IDS else "return_token_ids"

    @property
    def provenance(self) -> dict:
        return {**super().provenance, "ids_request": self.ids_request}

    def request_body(self, record: dict) -> dict:
        p = self.params
        body = {"model": self.model, "messages": record["messages"], "temperature": p.temperature,
                "top_p": p.top_p, "max_tokens": p.max_new_tokens, "stream": False,
                "chat_template_kwargs": {"enable_thinking": p.enable_thinking}}
        if p.seed is not None:
            body["seed"] = p.seed
        if self.ids_request == "return_token_ids":
            body["return_token_ids"] = True
        elif self.ids_request == "logprobs":
            body["logprobs"] = True
            body["return_tokens_as_token_ids"] = True
        return body

    def complete(self, record: dict) -> Completion:
        url = self.base + "/v1/chat/completions"
        resp = self.client.post_json(url, self.request_body(record), timeout=self.request_timeout,
                                     max_bytes=response_bytes(self.params.max_new_tokens))
        rid = record["id"]
        choices = resp.get("choices") if isinstance(resp, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._bad(url, "no choices", rid)
        choice = choices[0]
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        content = message.get("content")
        finish = choice.get("finish_reason")
        if finish not in FINISH_REASONS:
            raise self._bad(url, f"finish_reason {finish!r} (expected stop or length)", rid)
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        reasoning = reasoning if isinstance(reasoning, str) and reasoning else None
        content = content if isinstance(content, str) else ""
        if not content and reasoning is None:
            raise self._bad(url, "an empty completion", rid)
        extra: dict = {}
        ids = int_list(choice.get("token_ids"))  # vLLM's return_token_ids; others send none
        if ids is not None:
            extra["server_ids_from"] = "token_ids"
        elif self.ids_request == "logprobs":
            ids = ids_from_logprobs(choice.get("logprobs"))
            if ids is not None:
                extra["server_ids_from"] = "logprobs"
        matched = choice.get("matched_stop")  # SGLang's name for the stop token, where it sends ids
        if ids is not None and finish == "stop" and isinstance(matched, int) and not isinstance(matched, bool) \
                and ids[-1] != matched:
            ids = ids + [matched]
            extra["stop_token_appended"] = True
        usage = resp.get("usage") if isinstance(resp.get("usage"), dict) else {}
        if reasoning is not None:
            # A server-side reasoning parser moved the thinking out of the content: neither part
            # alone is the generation (the stage puts them back together, ids.put_back).
            extra["reasoning_content"] = reasoning
        return Completion(text=content, finish_reason=finish, token_ids=ids,
                          tokens_source="server" if ids else "retokenized",
                          prompt_tokens=usage.get("prompt_tokens"),
                          completion_tokens=usage.get("completion_tokens"), extra=extra)


class SGLangNativeSource(_ServerSource):
    """SGLang ``/generate`` with the prompt rendered by the target's chat template here.

    Request and response as SGLang documents them (docs: basic_usage/native_api and
    sampling_params; code: python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py
    ``GenerateReqInput``, tokenizer_manager.py)::

        {"input_ids": [...], "sampling_params": {"temperature", "top_p", "max_new_tokens",
         "sampling_seed"?}, "stream": false}
        → {"text": "...", "output_ids": [...],
           "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", "matched"?: id|str},
                         "prompt_tokens": n, "completion_tokens": m, ...}}
    """

    kind = "sglang"

    def __init__(self, base_url: str, params: SamplingParams, *, target_dir: str | Path, **kw) -> None:
        super().__init__(base_url, params, **kw)
        self.target_dir = target_dir
        self.tokenizer = None
        self._lock = threading.Lock()  # HF fast tokenizers are not safe to call from many threads

    def prepare(self) -> None:
        super().prepare()
        self.tokenizer = load_tokenizer(self.target_dir, self.cache)

    def request_body(self, record: dict) -> dict:
        p = self.params
        with self._lock:
            ids = encode_prompt(self.tokenizer, record["messages"], p.enable_thinking)
        sampling = {"temperature": p.temperature, "top_p": p.top_p, "max_new_tokens": p.max_new_tokens}
        if p.seed is not None:
            sampling["sampling_seed"] = p.seed
        return {"input_ids": ids, "sampling_params": sampling, "stream": False}

    def complete(self, record: dict) -> Completion:
        url = self.base + "/generate"
        resp = self.client.post_json(url, self.request_body(record), timeout=self.request_timeout,
                                     max_bytes=response_bytes(self.params.max_new_tokens))
        rid = record["id"]
        if isinstance(resp, list):
            resp = resp[0] if resp else None
        if not isinstance(resp, dict):
            raise self._bad(url, "a body that is not a generate result", rid)
        meta = resp.get("meta_info") if isinstance(resp.get("meta_info"), dict) else {}
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else fr
        if ftype not in FINISH_REASONS:
            detail = fr.get("message") if isinstance(fr, dict) and fr.get("message") else fr
            raise self._bad(url, f"finish_reason {detail!r} (expected stop or length)", rid)
        ids = int_list(resp.get("output_ids")) or int_list(meta.get("output_ids"))
        text = resp.get("text")
        extra: dict = {}
        if ids is not None and ftype == "stop" and isinstance(fr, dict):
            matched = fr.get("matched")
            # Greedy output ends with the stop token (transformers' generate keeps it); keep the
            # ids in that form whether or not this SGLang version listed it in output_ids.
            if isinstance(matched, int) and not isinstance(matched, bool) and ids[-1] != matched:
                ids = ids + [matched]
                extra["stop_token_appended"] = True
        if not isinstance(text, str):
            if ids is None:
                raise self._bad(url, "neither text nor output_ids", rid)
            with self._lock:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)  # --skip-tokenizer-init
        if not text and not ids:
            raise self._bad(url, "an empty completion", rid)
        return Completion(text=text, finish_reason=ftype, token_ids=ids,
                          tokens_source="server" if ids else "retokenized",
                          prompt_tokens=meta.get("prompt_tokens"),
                          completion_tokens=meta.get("completion_tokens"), extra=extra)


# ----------------------------------------------------------------------------- local


class LocalGreedySource:
    """Greedy generation with transformers on this machine, one prompt at a time (batch 1 keeps
    the ids independent of padding and of which prompts share a batch).

    The model is loaded by :func:`runner.models.target.load_target` for the backend class that
    planning resolved (kernel family, device, dtype, attention implementation), so the ids come
    from the numerics the key names, and it is shared with the hidden-states stage of the same
    run instead of being loaded twice.
    """

    kind = "local"

    def __init__(self, target_dir: str | Path, params: SamplingParams, backend, *,
                 cache: RunCache | None = None) -> None:
        self.target_dir = Path(target_dir)
        self.params = params
        self.backend = backend
        self.cache = cache if cache is not None else RunCache()
        self.target = None
        self.tokenizer = None
        self.eos_ids: list[int] = []

    def prepare(self) -> None:
        from ...models.resolve import eos_token_ids
        from ...models.target import load_target

        # The same cache entry as the hidden-states stage: one copy of the target per run.
        key = (str(self.target_dir), self.backend.label)
        if key not in self.cache.targets:
            self.cache.targets[key] = load_target(self.target_dir, self.backend)
        self.target = self.cache.targets[key]
        self.tokenizer = load_tokenizer(self.target_dir, self.cache)
        self.eos_ids = eos_token_ids(self.target_dir)
        if not self.eos_ids and self.tokenizer.eos_token_id is not None:
            self.eos_ids = [int(self.tokenizer.eos_token_id)]

    @property
    def provenance(self) -> dict:
        return {"endpoint": "local", "backend": self.backend.label, **(self.target.provenance or {})}

    def complete(self, record: dict) -> Completion:
        import torch

        ids = encode_prompt(self.tokenizer, record["messages"], self.params.enable_thinking)
        inp = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.eos_ids[0] if self.eos_ids else 0
        self.target.rebind()  # kernel bindings are module globals; another stage may have moved them
        with torch.no_grad():
            out = self.target.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp),
                                             do_sample=False, max_new_tokens=self.params.max_new_tokens,
                                             pad_token_id=pad)
        new = [int(t) for t in out[0, len(ids):].tolist()]
        if not new:
            raise BadInputError(f"local generation produced no token for prompt {record['id']!r}; "
                                "check --max-new-tokens and the target.")
        finish = "stop" if new[-1] in self.eos_ids else "length"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Completion(text=text, finish_reason=finish, token_ids=new, tokens_source="local",
                          prompt_tokens=len(ids), completion_tokens=len(new))

    def close(self) -> None:
        pass


def local_kernel(opts, target_dir: str | Path):
    """The backend class local generation runs with, resolved without importing torch."""
    from ...models.target import read_model_info, resolve_kernel

    info = read_model_info(target_dir)
    return resolve_kernel(opts.backend, opts.device, opts.dtype,
                           getattr(opts, "attn_implementation", "sdpa"),
                           has_linear_attention=info.has_linear_attention, check=False)


def make_source(ctx, target_dir: str | Path, client: HttpClient | None = None):
    """The completion source ``ctx.options`` asks for (not prepared yet)."""
    o = ctx.options
    params = SamplingParams(temperature=float(o.temperature), top_p=float(o.top_p),
                            max_new_tokens=int(o.max_new_tokens), seed=o.seed,
                            enable_thinking=bool(o.enable_thinking))
    # The options are valid here (EvalOptions.validate): local, or a server with --server given.
    if o.completions == "local":
        return LocalGreedySource(target_dir, params, local_kernel(o, target_dir), cache=ctx.cache)
    from dfcache.http import HttpClient

    client = client or HttpClient(offline=o.offline, timeout=o.request_timeout,
                                  pool_size=max(1, int(o.concurrency)), fixes=SERVER_FIXES)
    # The readiness wait is reported even without progress bars: it is the one place a run may
    # sit still, and the user must see why.
    kw = dict(served_model=o.served_model, client=client, wait_seconds=o.wait_server,
              progress=True, out=ctx.out, request_timeout=o.request_timeout, cache=ctx.cache)
    if o.server_api == "sglang":
        return SGLangNativeSource(o.server, params, target_dir=target_dir, **kw)
    return OpenAIChatSource(o.server, params, **kw)
