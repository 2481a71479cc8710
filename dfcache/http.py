"""The one HTTP client of the project, and the bounded readiness check.

Every request dfcache or the runner makes goes through :class:`HttpClient`, so this is where
offline mode is enforced: with offline on (the ``offline`` flag or ``DFCACHE_OFFLINE``; not
``HF_HUB_OFFLINE``, which is about the Hugging Face Hub only), a request raises
:class:`~dfcache.errors.OfflineModeIsEnabled` before a socket is opened. A per-call-site check
is not enough (huggingface_hub needed a transport-level hook for the same reason, PR #3942).

The client never retries. The seed failure of this project was an eval that died in connection
retries against a server that was still loading; a retry loop hides that state and burns time.
The only loop is :func:`wait_ready`: one readiness check before any work, bounded by the
caller's wait and visible on stderr.

Every request has a **deadline** and every answer a **size bound**, whatever the server does:

- the timeout of a request is the time the whole request may take, from connecting to the last
  byte of the body. A socket timeout alone bounds each read, and a body dripped one byte every
  0.5 s never trips a 3 s one; so a watchdog thread shuts the request's socket down at its
  deadline (``_Deadline``), which ends any read in progress at once;
- an answer is read in pieces up to a bound (a ``Content-Length`` above it is refused before
  anything is read); an endless chunked body or a claimed 8 GiB once grew to 6 GB of memory and a
  MemoryError. The bound is the caller's (``max_bytes``; a generation's grows with its token
  count), :data:`DEFAULT_MAX_BYTES` otherwise, and ``DFCACHE_MAX_RESPONSE_BYTES`` replaces it;
- the answer is asked for uncompressed (``Accept-Encoding: identity``); what a server compresses
  anyway is counted after decompression.

Both end in one error, exit 4, like any other network failure.

Failures map to distinct errors (all :class:`~dfcache.errors.NetworkError`, exit code 4)::

    name resolution failed, no route, connection dropped  ServerUnreachable
    nothing listens on the port                           ConnectionRefused
    connect or read timed out, deadline passed            ServerTimeout
    HTTP 503, or a body that says the model is loading    ServerNotReady
    other 4xx/5xx, a body that is not JSON or too large   ServerHTTPError (status, server message)

Each message names the URL and ends with the fix. The fixes here name no command-line flag:
this module does not know the caller's. Each error has a ``reason`` (a key of :data:`FIXES`), and
a caller passes its own fix texts for those reasons (``HttpClient(fixes=...)``); the runner names
its own flags that way.
"""

from __future__ import annotations

import errno
import heapq
import http.client
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .config import offline_from_env
from .errors import (ConnectionRefused, NetworkError, OfflineModeIsEnabled, ServerHTTPError,
                     ServerNotReady, ServerTimeout, ServerUnreachable, UsageError)

if TYPE_CHECKING:
    import requests

# requests is imported where a request is made, not here: importing urllib3 opens a socket (its
# IPv6 probe), and a run whose artifacts are all cached, or an offline one, opens none.

DEFAULT_TIMEOUT = 600.0
DEFAULT_CONNECT_TIMEOUT = 10.0
READY_INTERVAL = 0.5
READY_TIMEOUT = 10.0  # one readiness check (GET /health, then /v1/models) ends within this
# An answer that is not a generation (health, the model list, an error) is small: a model list of a
# few hundred entries is tens of KB. A caller that expects more passes max_bytes.
DEFAULT_MAX_BYTES = 16 << 20
_READ_PIECE = 64 << 10  # bytes read (and counted) at a time
_BODY_SNIPPET = 300

ProgressArg = bool | Callable[[str], None]
DfcacheErrorLike = NetworkError | UsageError

# reason -> the fix a message ends with. "<reason>.waited": the fix once the caller has already
# waited for the server (telling them to wait would be wrong).
FIXES: dict[str, str] = {
    "bad_url": "Give the server's URL as http://HOST:PORT.",
    "refused": "Start the server there or give the right URL (if it is starting, wait for it).",
    "refused.waited": "Start the server there or give the right URL (if it is starting, wait longer).",
    "not_ready": "Wait until it has loaded the model, then run again.",
    "not_ready.waited": "Wait longer, until it has loaded the model.",
    "connect_timeout": "Check that the address is right and that a firewall does not drop the connection.",
    "read_timeout": "The server may be hung or overloaded: check its log, send fewer requests at once or "
                    "allow a longer timeout.",
    "unresolvable": "Check the host name in the URL and the network.",
    "no_route": "Check the URL and the network (VPN, firewall).",
    "dropped": "Check that it is running and run again: finished work is kept.",
    "other": "Check that the server is running and the URL is right.",
    "bad_json": "Check that the URL points at an OpenAI-compatible or SGLang server and look at its log.",
    "http_not_found": "Check that the URL points at the right server and that it serves this API.",
    "http_client": "Check the request (model name, sampling options) against the server's log.",
    "http_server": "The server failed; look at its log and fix or restart it, then run again.",
    "too_large": "Check that the URL points at the right server (and look at its log); if its answers really "
                 "are that large, set DFCACHE_MAX_RESPONSE_BYTES to a larger bound.",
}


def _err(cls, reason: str, problem: str, fixes: dict[str, str], **kw):
    e = cls(problem, fix=fixes.get(reason) or FIXES.get(reason), **kw)
    e.reason = reason
    return e


def normalize_base_url(url: str, fixes: dict[str, str] | None = None) -> str:
    """``host:port``, ``http://host:port/``, ``http://host:port/v1`` → ``http://host:port``.

    People paste the OpenAI base URL (ending in ``/v1``); endpoints are joined to the root.
    """
    fixes = fixes or {}
    url = (url or "").strip()
    if not url:
        raise _err(UsageError, "bad_url", "the server URL is empty.", fixes)
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _err(UsageError, "bad_url", f"the server URL {url!r} is not an http(s) URL.", fixes)
    return url


def _causes(exc: BaseException):
    """The exception and everything it wraps (requests → urllib3 → socket errors)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for nxt in (getattr(e, "reason", None), e.__cause__, e.__context__, *getattr(e, "args", ())):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def _server_message(resp: requests.Response) -> str:
    """The server's own words: FastAPI ``detail``, OpenAI ``error.message``, else the body."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        for key in ("detail", "message", "error"):
            val = body.get(key)
            if isinstance(val, dict):
                val = val.get("message") or val
            if val:
                return str(val)[:_BODY_SNIPPET]
    text = (resp.text or "").strip()
    return text[:_BODY_SNIPPET] or (resp.reason or "")


# ------------------------------------------------------------------------------ deadlines


class _Deadline:
    """One request's deadline: the connections it uses (attached by the connection classes
    below, in the request's thread) are shut down when it passes, which ends a blocked read."""

    __slots__ = ("at", "conns", "expired", "done", "lock")

    def __init__(self, at: float) -> None:
        self.at = at
        self.conns: list = []
        self.expired = False
        self.done = False
        self.lock = threading.Lock()

    def attach(self, conn) -> None:
        with self.lock:
            if self.done:
                return
            self.conns.append(conn)
            if self.expired:
                _shut(conn)

    def expire(self) -> None:
        with self.lock:
            if self.done:
                return
            self.expired = True
            for conn in self.conns:
                _shut(conn)

    def finish(self) -> None:
        with self.lock:
            self.done = True
            self.conns.clear()


def _shut(conn) -> None:
    # shutdown(), not close(): a recv() blocked in another thread returns at once on Linux and
    # macOS after a shutdown, while a close() leaves it waiting.
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Watchdog:
    """The one thread that expires deadlines (started at the first request of a process, and
    again in a forked child, which has none of its parent's threads and gets a fresh state)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, _Deadline]] = []
        self._thread: threading.Thread | None = None

    def add(self, d: _Deadline) -> None:
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dfcache-http-deadlines", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (d.at, id(d), d))
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                heapq.heappop(self._heap)[2].expire()


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):  # (its lock may be held by the parent's thread at the fork)
    os.register_at_fork(after_in_child=_WATCHDOG._reset)
_current = threading.local()  # .deadline: the deadline of the request this thread is making


def _attach_current(conn) -> None:
    d = getattr(_current, "deadline", None)
    if d is not None:
        d.attach(conn)


_POOL_CLASSES: dict | None = None


def _pool_classes() -> dict:
    """urllib3 pool classes whose connections attach themselves to the current request's
    deadline when they connect and when they send (a reused connection does not connect)."""
    global _POOL_CLASSES
    if _POOL_CLASSES is None:
        from urllib3.connection import HTTPConnection, HTTPSConnection
        from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

        class _Attaching:
            def connect(self):
                _attach_current(self)
                return super().connect()

            def request(self, *args, **kwargs):
                _attach_current(self)
                return super().request(*args, **kwargs)

        class _Conn(_Attaching, HTTPConnection):
            pass

        class _SConn(_Attaching, HTTPSConnection):
            pass

        class _Pool(HTTPConnectionPool):
            ConnectionCls = _Conn

        class _SPool(HTTPSConnectionPool):
            ConnectionCls = _SConn

        _POOL_CLASSES = {"http": _Pool, "https": _SPool}
    return _POOL_CLASSES


def _adapter(pool_size: int):
    from requests.adapters import HTTPAdapter

    class _DeadlineAdapter(HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = dict(_pool_classes())

        def proxy_manager_for(self, proxy, **kwargs):
            manager = super().proxy_manager_for(proxy, **kwargs)
            if getattr(manager, "pool_classes_by_scheme", None) is not None:
                manager.pool_classes_by_scheme = dict(_pool_classes())
            return manager

    # max_retries=0: urllib3 would otherwise retry failed connects on its own.
    return _DeadlineAdapter(max_retries=0, pool_connections=4, pool_maxsize=max(1, int(pool_size)))


class _TooLarge(Exception):
    def __init__(self, got: int, claimed: bool) -> None:
        self.got, self.claimed = got, claimed


class _Expired(Exception):
    pass


def _read_body(resp, limit: int, deadline: _Deadline) -> bytes:
    """The whole body, read in pieces: never more than ``limit`` bytes (decompressed), never past
    the deadline."""
    claimed = resp.headers.get("Content-Length")
    if claimed is not None and claimed.strip().isdigit() and int(claimed) > limit:
        raise _TooLarge(int(claimed), True)
    pieces, got = [], 0
    for piece in resp.iter_content(_READ_PIECE):
        got += len(piece)
        if got > limit:
            raise _TooLarge(got, False)
        pieces.append(piece)
        if deadline.expired or time.monotonic() > deadline.at:
            raise _Expired()
    return b"".join(pieces)


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


# ------------------------------------------------------------------------------ the client


class HttpClient:
    """A ``requests`` session with no retries, offline enforcement, a deadline and a size bound
    on every request, and mapped errors.

    Args:
        offline: refuse every request. ``None`` or ``False`` still honours ``DFCACHE_OFFLINE``,
            read at each request.
        timeout: the time one request may take, in seconds, from connecting to the last byte of
            the answer (a whole generation may take minutes).
        connect_timeout: connect timeout in seconds.
        pool_size: connections kept per host; at least the request concurrency.
        fixes: the caller's fix texts by reason, over :data:`FIXES` (a command line names its flags).
        max_bytes: the most bytes an answer may have where a request gives no ``max_bytes``.
    """

    def __init__(self, offline: bool | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, pool_size: int = 16,
                 fixes: dict[str, str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.offline = bool(offline)
        self.fixes = dict(fixes or {})
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_bytes = int(max_bytes)
        import requests

        self.session = requests.Session()
        adapter = _adapter(pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def is_offline(self) -> bool:
        return self.offline or offline_from_env()

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------ requests

    def limit(self, max_bytes: int | None = None) -> int:
        """The most bytes one answer may have: ``DFCACHE_MAX_RESPONSE_BYTES`` if set, else
        ``max_bytes``, else the client's."""
        from .config import max_response_bytes

        override = max_response_bytes()
        return override if override is not None else int(max_bytes if max_bytes is not None else self.max_bytes)

    def request(self, method: str, url: str, *, json: Any = None, timeout: float | None = None,
                max_bytes: int | None = None) -> requests.Response:
        """Send one request; return the response, its body read, if its status is < 400, else raise.

        ``timeout``: the seconds the whole request may take (default: the client's). ``max_bytes``:
        the most bytes the answer may have (default: the client's)."""
        if self.is_offline():
            raise OfflineModeIsEnabled(
                f"offline mode is on (--offline or DFCACHE_OFFLINE), so dfcache did "
                f"not contact {url}; use artifacts already in the store, or turn offline mode off "
                "to reach the server.", url=url)
        total = self.timeout if timeout is None else float(timeout)
        limit = self.limit(max_bytes)
        import requests

        deadline = _Deadline(time.monotonic() + total)
        _WATCHDOG.add(deadline)
        _current.deadline = deadline
        resp = None
        try:
            resp = self.session.request(method, url, json=json, stream=True, headers={"Accept-Encoding": "identity"},
                                        timeout=(min(self.connect_timeout, total), total))
            body = _read_body(resp, limit, deadline)
        except requests.exceptions.RequestException as e:
            if deadline.expired:
                raise self._expired(method, url, total, resp is not None) from None
            raise self._map_exception(e, method, url, total) from None
        except _Expired:
            raise self._expired(method, url, total, True) from None
        except _TooLarge as e:
            status = resp.status_code if resp is not None else None
            how = f"announces {_human(e.got)} ({e.got} bytes)" if e.claimed else f"went on past {_human(limit)}"
            raise _err(ServerHTTPError, "too_large",
                       f"the answer to {method} {url} (HTTP {status}) {how}, more than the {_human(limit)} "
                       "dfcache reads of one answer; it was not read further.", self.fixes, url=url,
                       status=status) from None
        finally:
            deadline.finish()
            _current.deadline = None
            if resp is not None:
                resp.close()  # (a body read whole is already back in the pool; else drop the connection)
        resp._content = body  # what .json() and .text read
        resp._content_consumed = True
        if resp.status_code >= 400:
            raise self._map_status(resp, method, url)
        return resp

    def _expired(self, method: str, url: str, total: float, answering: bool) -> NetworkError:
        what = "got only part of its answer" if answering else "got no answer"
        return _err(ServerTimeout, "read_timeout", f"{method} {url} {what} within {round(total, 1):g} s, the time one "
                    "request may take; dfcache stopped waiting there.", self.fixes, url=url)

    def get_json(self, url: str, *, timeout: float | None = None, max_bytes: int | None = None) -> Any:
        return self._json(self.request("GET", url, timeout=timeout, max_bytes=max_bytes), "GET", url)

    def post_json(self, url: str, body: Any, *, timeout: float | None = None, max_bytes: int | None = None) -> Any:
        return self._json(self.request("POST", url, json=body, timeout=timeout, max_bytes=max_bytes), "POST", url)

    # ------------------------------------------------------------------------------ mapping

    def _json(self, resp: requests.Response, method: str, url: str) -> Any:
        try:
            return resp.json()
        except ValueError:
            snippet = (resp.text or "").strip()[:120]
            raise _err(ServerHTTPError, "bad_json",
                       f"{method} {url} answered HTTP {resp.status_code} with a body that is not valid JSON "
                       f"({snippet!r}).", self.fixes, url=url, status=resp.status_code,
                       server_message=snippet) from None

    def _map_status(self, resp: requests.Response, method: str, url: str) -> NetworkError:
        status = resp.status_code
        msg = _server_message(resp)
        if status == 503 or "loading" in msg.lower():
            return _err(ServerNotReady, "not_ready", f"the server at {url} is not ready (HTTP {status}: {msg}).",
                        self.fixes, url=url)
        reason = ("http_not_found" if status in (404, 405) else "http_client" if 400 <= status < 500
                  else "http_server")
        return _err(ServerHTTPError, reason, f"{method} {url} failed with HTTP {status}: {msg}.", self.fixes,
                    url=url, status=status, server_message=msg)

    def _map_exception(self, e: requests.exceptions.RequestException, method: str, url: str,
                       read_timeout: float) -> DfcacheErrorLike:
        import requests

        where = _host_port(url)
        fixes = self.fixes
        if isinstance(e, requests.exceptions.ConnectTimeout):
            return _err(ServerTimeout, "connect_timeout", f"connecting to {url} ({where}) timed out.", fixes,
                        url=url)
        if isinstance(e, (requests.exceptions.ReadTimeout, requests.exceptions.Timeout)) or any(
                isinstance(c, (socket.timeout, TimeoutError)) or type(c).__name__ == "ReadTimeoutError"
                for c in _causes(e)):
            return _err(ServerTimeout, "read_timeout", f"{method} {url} got no answer within {round(read_timeout, 1):g} s.",
                        fixes, url=url)
        if isinstance(e, (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema,
                          requests.exceptions.InvalidSchema)):
            return _err(UsageError, "bad_url", f"{url} is not a valid URL ({e}).", fixes)
        causes = list(_causes(e))
        if any(isinstance(c, ConnectionRefusedError) or getattr(c, "errno", None) == errno.ECONNREFUSED
               for c in causes):
            return _err(ConnectionRefused, "refused", f"connection refused by {url}: nothing listens on {where}.",
                        fixes, url=url)
        if any(isinstance(c, socket.gaierror) or type(c).__name__ == "NameResolutionError" for c in causes):
            return _err(ServerUnreachable, "unresolvable", f"cannot resolve the host of {url}.", fixes, url=url)
        if any(getattr(c, "errno", None) in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN)
               for c in causes):
            return _err(ServerUnreachable, "no_route", f"no route to {where} for {url}.", fixes, url=url)
        if any(isinstance(c, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
                              http.client.RemoteDisconnected, http.client.IncompleteRead)) for c in causes) \
                or isinstance(e, requests.exceptions.ChunkedEncodingError):
            return _err(ServerUnreachable, "dropped", f"the server at {where} closed the connection during "
                        f"{method} {url} without a full answer (it stopped or crashed).", fixes, url=url)
        return _err(ServerUnreachable, "other", f"{method} {url} failed: {e}.", fixes, url=url)


def _short_reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefused):
        return "connection refused"
    if isinstance(e, ServerNotReady):
        return "not ready"
    if isinstance(e, ServerTimeout):
        return "timed out"
    if isinstance(e, ServerHTTPError):
        return f"HTTP {e.status}" if e.status else "bad answer"
    if isinstance(e, ServerUnreachable):
        return "unreachable"
    return type(e).__name__


def _ready_once(client: HttpClient, base: str, timeout: float) -> str:
    """One readiness check: ``/health``, else ``/v1/models`` where there is no ``/health``."""
    try:
        client.request("GET", base + "/health", timeout=timeout)
        return "health"
    except ServerHTTPError as e:
        if e.status not in (404, 405):
            raise
    client.request("GET", base + "/v1/models", timeout=timeout)
    return "models"


def wait_ready(base_url: str, wait_seconds: float = 0.0, progress: ProgressArg = True, *,
               client: HttpClient | None = None, offline: bool | None = None, out=None,
               interval: float = READY_INTERVAL, fixes: dict[str, str] | None = None) -> str:
    """Check once that the server answers, polling up to ``wait_seconds`` while it does not.

    ``wait_seconds=0`` makes one check. Otherwise the check repeats about every ``interval``
    seconds until the deadline, printing ``waiting for server at URL: 2.5/10 s (connection
    refused)`` to stderr (or calling ``progress(line)``). On failure the last error is raised
    (ConnectionRefused, ServerNotReady, ...) with how long it waited. Returns which endpoint
    answered (``"health"`` or ``"models"``).
    """
    own = client is None
    client = client or HttpClient(offline=offline, fixes=fixes)
    base = normalize_base_url(base_url, client.fixes)
    out = out or sys.stderr
    wait = max(0.0, float(wait_seconds or 0.0))
    start = time.monotonic()
    deadline = start + wait
    is_tty = hasattr(out, "isatty") and out.isatty()
    last_print = -1.0

    def show(line: str, final: bool = False) -> None:
        nonlocal last_print
        if not progress:
            return
        if callable(progress):
            progress(line)
            return
        now = time.monotonic()
        if is_tty:
            out.write("\r" + line + ("\n" if final else ""))
            out.flush()
        elif final or now - last_print >= 1.0:  # a log file gets a line a second, not a flood
            out.write(line + "\n")
            out.flush()
            last_print = now

    try:
        while True:
            remaining = deadline - time.monotonic()
            try:
                # A single check gets a generous timeout; polling never overshoots the deadline much.
                timeout = READY_TIMEOUT if wait == 0 else max(0.5, min(READY_TIMEOUT, remaining))
                found = _ready_once(client, base, timeout)
                if wait > 0 and time.monotonic() - start >= interval:
                    show(f"server at {base} is ready after {time.monotonic() - start:.1f} s", final=True)
                return found
            except OfflineModeIsEnabled:
                raise
            except ServerHTTPError as e:
                if e.status is not None and 400 <= e.status < 500:
                    raise  # a client error does not heal by waiting
                last = e
            except NetworkError as e:
                last = e
            elapsed = time.monotonic() - start
            if wait == 0:
                raise last
            if elapsed >= wait:
                show(f"waiting for server at {base}: {min(elapsed, wait):.1f}/{wait:g} s "
                     f"({_short_reason(last)})", final=True)
                # The check's own fix may say "wait for it": the caller has, so it gets the .waited fix.
                reason = getattr(last, "reason", "other")
                fix = (client.fixes.get(reason + ".waited") or FIXES.get(reason + ".waited")
                       or last.fix)
                final = last.with_fix(fix)
                final.problem = (f"the server at {base} was not ready after waiting {wait:g} s; last check: "
                                 f"{last.problem}")
                raise final
            show(f"waiting for server at {base}: {elapsed:.1f}/{wait:g} s ({_short_reason(last)})")
            time.sleep(max(0.0, min(interval, deadline - time.monotonic())))
    finally:
        if own:
            client.close()
