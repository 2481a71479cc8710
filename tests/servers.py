"""Real servers for tests, and a helper that runs the stage graph.

- :class:`TransformersServe`: ``transformers serve`` (a real OpenAI-compatible server) on a free
  port, as a subprocess; counts requests from its own log.
- :class:`SGLangTestServer`: a small server that speaks SGLang's native API (``/generate``,
  ``/v1/models``, ``/get_model_info``, ``/health``) with the request and response shapes SGLang
  documents, backed by the tiny model's greedy generation. SGLang itself cannot run here (it
  needs a GPU build); this stands in for it.
- :class:`VLLMTestServer`: vLLM's OpenAI-compatible chat endpoint as its protocol code answers it
  (ids when asked, ``/version``, ``owned_by: "vllm"``, a reasoning parser's split), backed by the
  tiny model's greedy generation. vLLM cannot run here either.
- :class:`ScriptedServer`: an OpenAI-shaped server whose chat endpoint fails on purpose
  (HTTP 500, garbage JSON, hanging, empty answer, 503 while "loading").
- :class:`RecordingListener`: a TCP listener that counts connection attempts, to prove that a
  run opened none.
- :class:`SilentListener`: a port that accepts connections and never answers (timeouts).
- :func:`run_pipeline`: build the graph up to a stage, resolve it and execute it, as the CLI does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClosedPort:
    """A port where nothing listens, and that nothing else can take while this is open: a socket
    bound to it but not listening, so every connect is refused. A port from free_port() is only
    free for a moment; on a machine running other tests (CI beside other work) another server may
    take it before the client connects, which made "connection refused" cases flaky."""

    def __init__(self, ports: range | None = None) -> None:
        self.sock = socket.socket()
        for port in ports or [0]:  # (``ports``: the first free one of them)
            try:
                self.sock.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        else:
            raise OSError(f"no free port in {ports}")
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "ClosedPort":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


# ----------------------------------------------------------------------------- transformers serve


# The line serve writes for each request, before generating: "[Request received] Model: ..." up to
# 5.24; from 5.25 "Request <id>: model ..." from the transformers.cli.serving.requests logger,
# which is off unless --enable-log-requests (an option 5.24 rejects).
_REQUEST_LINE = re.compile(r"\[Request received\]|\bRequest \S+: model ")


def _request_log_flag() -> list[str]:
    """``--enable-log-requests`` where this transformers' serve has it (read from its source, so
    that the test process need not import the CLI)."""
    spec = importlib.util.find_spec("transformers.cli.serve")
    try:
        has = "enable_log_requests" in Path(spec.origin).read_text()
    except (AttributeError, TypeError, OSError):
        has = False
    return ["--enable-log-requests"] if has else []


class TransformersServe:
    """``transformers serve MODEL_DIR --host 127.0.0.1 --port P --device cpu`` as a subprocess.

    The served model name is ``str(model_dir)`` (the server is pinned to it). Its log goes to
    ``log_path``; :meth:`chat_requests` counts the chat requests it received.
    """

    def __init__(self, model_dir: str | Path, log_path: str | Path, port: int | None = None) -> None:
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    @property
    def model_name(self) -> str:
        return self.model_dir

    def start(self, timeout: float = 120.0) -> "TransformersServe":
        return self.launch().wait_ready(timeout)

    def launch(self) -> "TransformersServe":
        """Start the process without waiting (start several, then wait for each)."""
        exe = Path(sys.executable).with_name("transformers")
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", PYTHONUNBUFFERED="1")
        env.pop("DFCACHE_OFFLINE", None)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(exe), "serve", self.model_dir, "--host", "127.0.0.1",
                                      "--port", str(self.port), "--device", "cpu", *_request_log_flag()],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 120.0) -> "TransformersServe":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _http_ok(self.url + "/health"):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"transformers serve did not answer /health within {timeout} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def chat_requests(self) -> int:
        """Chat requests the server received (it logs each one before generating)."""
        return len(_REQUEST_LINE.findall(self.log_text()))

    def kill_after(self, received: int) -> threading.Thread:
        """SIGKILL the server as soon as it has received ``received`` chat requests."""

        def watch() -> None:
            while self.proc is not None and self.proc.poll() is None:
                if self.chat_requests() >= received:
                    self.kill()
                    return
                time.sleep(0.005)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        return t

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> "TransformersServe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------- in-process servers


class _Server:
    """A threaded HTTP server on a free port; subclasses route requests in ``handle``."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.released = threading.Event()  # frees handlers that hang on purpose
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def _serve(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                with outer._lock:
                    outer.requests.append((method, self.path))
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                status, payload = outer.handle(method, self.path, body)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def count(self, method: str, path: str) -> int:
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and p == path)

    def handle(self, method: str, path: str, body) -> tuple[int, object]:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SGLangTestServer(_Server):
    """SGLang's native API over the tiny model's greedy generation.

    Shapes follow SGLang's docs (basic_usage/native_api, sampling_params) and code
    (entrypoints/http_server.py, managers/tokenizer_manager.py): ``/generate`` takes ``text`` or
    ``input_ids`` and ``sampling_params``; it answers ``{"text", "output_ids", "meta_info":
    {"id", "finish_reason": {"type": "length", "length": n} | {"type": "stop", "matched": id},
    "prompt_tokens", "completion_tokens", ...}}``. ``/v1/models`` lists the served model name,
    ``/get_model_info`` its path.
    """

    def __init__(self, model_dir: str | Path, served_name: str = "tiny-qwen") -> None:
        super().__init__()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model_dir = str(model_dir)
        self.served_name = served_name
        self.tok = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id
        self._gen_lock = threading.Lock()

    def handle(self, method, path, body):
        if path == "/health":
            return 200, b""
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": 0,
                                                     "owned_by": "sglang", "root": self.model_dir,
                                                     "max_model_len": 4096}]}
        if path == "/get_model_info":
            return 200, {"model_path": self.model_dir, "tokenizer_path": self.model_dir, "is_generation": True}
        if path == "/generate" and method == "POST":
            return self._generate(body or {})
        return 404, {"detail": "Not Found"}

    def _generate(self, body: dict):
        sp = body.get("sampling_params") or {}
        if float(sp.get("temperature", 1.0)) != 0.0:
            return 400, {"error": {"message": "this test server is greedy only (temperature 0)"}}
        if body.get("input_ids") is not None:
            ids = list(body["input_ids"])
        elif isinstance(body.get("text"), str):
            ids = self.tok(body["text"])["input_ids"]
        else:
            return 400, {"error": {"message": "Either text or input_ids should be provided."}}
        n = int(sp.get("max_new_tokens", 128))
        torch = self.torch
        with self._gen_lock, torch.no_grad():
            inp = torch.tensor([ids])
            out = self.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                      max_new_tokens=n, pad_token_id=self.tok.pad_token_id)
        new = out[0, len(ids):].tolist()
        eos = self.eos if isinstance(self.eos, list) else [self.eos]
        if new and new[-1] in eos:
            finish = {"type": "stop", "matched": new[-1]}
        else:
            finish = {"type": "length", "length": len(new)}
        return 200, {"text": self.tok.decode(new, skip_special_tokens=True), "output_ids": new,
                     "meta_info": {"id": f"req-{len(self.requests)}", "finish_reason": finish,
                                   "prompt_tokens": len(ids), "completion_tokens": len(new),
                                   "cached_tokens": 0, "e2e_latency": 0.01}}


# What a server serving the tiny target counts for the scripted answer "hello" ending with its stop
# token: the tiny tokenizer's 4 ids of "hello" (runner/models/tiny.py builds it deterministically) and the
# stop token. With it the answer's ids rebuilt from its text pass their check, as a real server's
# would; tests/test_completion_ids.py checks the count.
SCRIPTED_TOKENS = 5


class VLLMTestServer(_Server):
    """vLLM's OpenAI-compatible server, as it answers ``/v1/chat/completions``, over the tiny
    model's greedy generation. vLLM cannot run here (it needs a GPU build); this is written from
    its own protocol code, read at vllm-project/vllm:

    - vllm/entrypoints/openai/chat_completion/protocol.py: ``ChatCompletionRequest``
      (``return_token_ids``, ``logprobs``, ``return_tokens_as_token_ids``, ``max_tokens``,
      ``chat_template_kwargs``; unknown fields are accepted, ``OpenAIBaseModel`` has
      ``extra="allow"``), ``ChatCompletionResponseChoice`` (``token_ids``, ``stop_reason``),
      ``ChatCompletionResponse`` (``prompt_token_ids``), ``ChatMessage.reasoning``;
    - chat_completion/serving.py ``chat_completion_full_generator``: ``token_ids`` is
      ``output.token_ids`` when ``return_token_ids``; ``usage.completion_tokens`` is
      ``len(output.token_ids)``; logprobs give one entry per generated token, written
      ``token_id:N`` with ``return_tokens_as_token_ids``; with a reasoning parser the text is
      split into ``reasoning`` and ``content``;
    - v1/core/sched/utils.py ``check_stop``: the EOS token stays in the output ids;
    - ``/v1/models`` entries are owned by ``"vllm"``, ``/version`` answers ``{"version": ...}``.

    ``return_token_ids`` / ``tokens_as_ids``: whether this "version" honours those request fields
    (an older vLLM ignores a field it does not know). ``reasoning_parser``: split the text at
    ``</think>`` as vLLM's DeepSeek-R1/Qwen3 parsers do (all of it is reasoning when the end tag
    is missing, the prompt having opened the thinking). ``script``: user message text -> the ids to
    answer with instead of generating (a thinking model's output the tiny model cannot produce).
    ``tamper(user_text, ids, text) -> (ids, text)``: a server whose answer is wrong on purpose.
    ``requests`` keeps every chat request body (``bodies``).
    """

    def __init__(self, model_dir: str | Path, served_name: str = "tiny-qwen", *, version: str = "0.11.0",
                 return_token_ids: bool = True, tokens_as_ids: bool = True, reasoning_parser: bool = False,
                 script: dict | None = None, tamper=None) -> None:
        super().__init__()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model_dir = str(model_dir)
        self.served_name = served_name
        self.version = version
        self.honours_ids = return_token_ids
        self.honours_tokens_as_ids = tokens_as_ids
        self.reasoning_parser = reasoning_parser
        self.script = dict(script or {})
        self.tamper = tamper
        self.bodies: list[dict] = []
        self.tok = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = eos if isinstance(eos, list) else [eos]
        self._gen_lock = threading.Lock()

    def handle(self, method, path, body):
        if path == "/health":
            return 200, b""
        if path == "/version":
            return 200, {"version": self.version}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": 0,
                                                     "owned_by": "vllm", "root": self.model_dir, "parent": None,
                                                     "max_model_len": 4096}]}
        if path == "/v1/chat/completions" and method == "POST":
            with self._lock:
                self.bodies.append(body or {})
            return self._chat(body or {})
        return 404, {"detail": "Not Found"}

    def _chat(self, body: dict):
        if body.get("model") not in (None, self.served_name):
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}}
        if float(body.get("temperature", 1.0)) != 0.0:
            return 400, {"error": {"message": "this test server is greedy only (temperature 0)"}}
        messages = body["messages"]
        kwargs = body.get("chat_template_kwargs") or {}
        prompt = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]  # vLLM: add_special_tokens=False
        user = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if user in self.script:
            ids = list(self.script[user])[:n]
        else:
            torch = self.torch
            with self._gen_lock, torch.no_grad():
                inp = torch.tensor([p_ids])
                out = self.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                          max_new_tokens=n, pad_token_id=self.tok.pad_token_id)
            ids = out[0, len(p_ids):].tolist()
        finish = "stop" if ids and ids[-1] in self.eos else "length"
        text = self.tok.decode(ids, skip_special_tokens=True)
        if self.tamper is not None:
            ids, text = self.tamper(user, ids, text)
        message = {"role": "assistant", "content": text, "reasoning": None, "tool_calls": []}
        if self.reasoning_parser:
            if "</think>" in text:
                reasoning, _, content = text.partition("</think>")
                reasoning = reasoning.split("<think>", 1)[-1]
            else:
                reasoning, content = text, ""
            message.update(reasoning=reasoning or None, content=content or None)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                  "token_ids": ids if self.honours_ids and body.get("return_token_ids") else None}
        if body.get("logprobs"):
            as_ids = self.honours_tokens_as_ids and body.get("return_tokens_as_token_ids")
            choice["logprobs"] = {"content": [
                {"token": f"token_id:{t}" if as_ids else self.tok.decode([t]), "logprob": -0.1, "bytes": None,
                 "top_logprobs": []} for t in ids]}
        return 200, {"id": f"chatcmpl-{len(self.bodies)}", "object": "chat.completion", "created": 0,
                     "model": self.served_name, "choices": [choice],
                     "usage": {"prompt_tokens": len(p_ids), "completion_tokens": len(ids),
                               "total_tokens": len(p_ids) + len(ids)},
                     "prompt_token_ids": p_ids if self.honours_ids and body.get("return_token_ids") else None}


class ScriptedServer(_Server):
    """OpenAI-shaped server whose chat endpoint misbehaves as told.

    ``chat``: ``"500"`` (HTTP 500 with an OpenAI error body), ``"garbage"`` (HTTP 200, not JSON),
    ``"hang"`` (never answers until stopped), ``"empty"`` (HTTP 200, empty content),
    ``"loading"`` (HTTP 503 while loading), ``"ok"`` (a short answer), ``"slow"`` (a short answer
    after 0.2 s; ``max_in_flight`` records the most requests served at once).
    ``health``: ``"ok"``, ``"loading"`` (503) or ``"missing"`` (404, so clients use /v1/models).
    ``hold_after=N``: chat requests after the N-th wait until ``released`` is set (or the server
    stops), so that a test can interrupt a client at a known request, whatever the load.
    """

    def __init__(self, chat: str = "ok", health: str = "ok", models: tuple[str, ...] = ("scripted-model",),
                 port: int = 0, hold_after: int | None = None):
        super().__init__(port)
        self.hold_after = hold_after
        self._chats = 0
        self.chat = chat
        self.health = health
        self.models = list(models)
        self.in_flight = 0
        self.max_in_flight = 0

    def handle(self, method, path, body):
        if path == "/health":
            if self.health == "loading":
                return 503, {"error": "model is loading"}
            if self.health == "missing":
                return 404, {"detail": "Not Found"}
            return 200, {"status": "ok"}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        if path == "/v1/chat/completions":
            mode = self.chat
            with self._lock:
                self._chats += 1
                held = self.hold_after is not None and self._chats > self.hold_after
            if held:
                self.released.wait(300)
            if mode == "500":
                return 500, {"error": {"message": "CUDA out of memory (scripted)", "type": "InternalError"}}
            if mode == "garbage":
                return 200, b"<html>upstream proxy error</html>"
            if mode == "hang":
                self.released.wait(30)
                return 200, {}
            if mode == "loading":
                return 503, {"error": {"message": "Model is loading"}}
            if mode == "slow":  # answers after 0.2 s and records how many requests overlapped
                with self._lock:
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
                time.sleep(0.2)
                with self._lock:
                    self.in_flight -= 1
            content = "" if mode == "empty" else "hello"
            return 200, {"choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content}}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": SCRIPTED_TOKENS}}
        return 404, {"detail": "Not Found"}


class RecordingListener:
    """Accepts TCP connections on a port, counts them and closes them at once."""

    def __init__(self, port: int | None = None) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port or 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.connections += 1
            conn.close()

    def settle(self) -> int:
        """Every connection made so far, counted without waiting: stop the accept loop, then take
        what is still in the kernel's backlog. A client's connect() returns only once the
        handshake is done, so a client that has returned (or exited) is in one or the other."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.sock.setblocking(False)
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:  # (BlockingIOError: the backlog is empty)
                    break
                self.connections += 1
                conn.close()
        return self.connections

    def close(self) -> None:
        self.settle()
        self.sock.close()

    def __enter__(self) -> "RecordingListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SilentListener:
    """A port that completes TCP handshakes (the kernel's backlog) but never reads or answers, like
    a hung server: connecting succeeds and every request times out."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "SilentListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- running stages


def run_pipeline(store_dir, upto: str = "tokens", **options):
    """Build the graph up to ``upto``, resolve it and execute it. Returns ``(ctx, {stage: node})``."""
    from dfcache import open_store
    from runner.core.graph import RunContext, resolve
    from runner.core.pipeline import execute
    from runner.core.options import EvalOptions
    from runner.core.pipeline import build_graph

    options.setdefault("progress", False)
    ctx = RunContext(open_store(store_dir), EvalOptions(**options), argv=["run", upto])
    nodes = build_graph(ctx, upto=upto)
    resolve(ctx, nodes)
    execute(ctx, nodes)
    return ctx, {n.stage: n for n in nodes}


class HostileServer:
    """An HTTP server that answers chosen paths the way a broken or hostile server would, written
    on raw sockets so that it can send what no well-behaved framework sends:

    ``"endless"``: HTTP 200, a chunked body that never ends; ``"huge"``: ``Content-Length`` of
    8 GiB, then bytes until the client hangs up; ``"drip"``: a 4 KB JSON body sent one byte every
    0.5 s; ``"drip-head"``: the status line and headers one byte every 0.5 s; ``"ok"``: a normal
    OpenAI-shaped answer (the default for ``/health``, ``/v1/models`` and the chat endpoint).

    ``sent[path]`` counts the body bytes written for each path, so a test can say how much a
    client took before it gave up (a count, not a duration). Connections are kept alive."""

    OK = {"/health": {"status": "ok"},
          "/v1/models": {"object": "list", "data": [{"id": "scripted-model", "object": "model"}]},
          "/v1/chat/completions": {"choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": "hello"}}],
                                   "usage": {"prompt_tokens": 3, "completion_tokens": SCRIPTED_TOKENS}}}

    def __init__(self, modes: dict[str, str]) -> None:
        self.modes = dict(modes)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.sent: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _count(self, path: str, n: int) -> None:
        with self._lock:
            self.sent[path] = self.sent.get(path, 0) + n

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                while len(buf) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                buf = buf[length:]
                with self._lock:
                    self.requests.append((method, path))
                if not self._answer(conn, path, self.modes.get(path, "ok")):
                    return
        except OSError:
            return
        finally:
            conn.close()

    def _answer(self, conn: socket.socket, path: str, mode: str) -> bool:
        """Answer one request; False: the connection is done."""
        if mode == "ok":
            body = json.dumps(self.OK.get(path, {"detail": "Not Found"})).encode()
            status = "200 OK" if path in self.OK else "404 Not Found"
            conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                         .encode() + body)
            self._count(path, len(body))
            return True
        if mode == "endless":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            piece = b'{"pad": "' + b"x" * 65000 + b'"}\n'
            frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
            while not self._stop.is_set():
                conn.sendall(frame)
                self._count(path, len(piece))
            return False
        if mode == "huge":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8589934592\r\n\r\n")
            piece = b" " * 65536
            while not self._stop.is_set():
                conn.sendall(piece)
                self._count(path, len(piece))
            return False
        if mode in ("drip", "drip-head"):
            body = json.dumps({**self.OK.get(path, {}), "pad": "x" * 4000}).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            if mode == "drip":
                conn.sendall(head)
            for i, b in enumerate(head + body if mode == "drip-head" else body):
                if self._stop.wait(0.5):
                    return False
                conn.sendall(bytes([b]))
                self._count(path, 1)
            return True
        raise ValueError(f"unknown mode {mode!r}")

    def count(self, method: str, path: str) -> int:
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and p == path)

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def __enter__(self) -> "HostileServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
