"""Shared pytest fixtures. Add fixtures here; keep this file small."""

from __future__ import annotations

import os
import signal

import pytest

# A shell without job control starts background commands (`bash .ci/run &`, nohup'd jobs) with
# SIGINT ignored, and every process started from here would inherit that: Python then installs no
# KeyboardInterrupt handler, and the tests that press Ctrl-C on a child (test_watch, the reliability
# SIGINT cases) saw the child finish or hang. Children get the default disposition, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The environment the session started with (before any test's monkeypatch).
_SESSION_ENV = dict(os.environ)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny random Qwen3.5 target + tokenizer with a chat template, built once per session."""
    from runner.models.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def cpu_target(tiny_target):
    """The tiny target loaded as the torch backend runs it on the CPU (float32, sdpa), at one torch
    thread while the module runs: a module's extraction tests share it."""
    import torch

    from runner.models.target import load_target, resolve_kernel

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_target(tiny_target, resolve_kernel("torch", "cpu", "float32", "sdpa"))
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def trained_drafter(tiny_target, tmp_path_factory):
    """The tiny target's DFlash drafter as `run eval --example` trains it (train_tiny_drafter, seed 0,
    default steps and data, one thread), trained once for the session (~8 s of CPU): (its directory,
    its TrainStats). test_fidelity checks it; test_suites puts it into an example directory."""
    from runner.models.train_tiny import single_thread, train_tiny_drafter

    stats: list = []
    with single_thread():
        path = train_tiny_drafter(tiny_target, tmp_path_factory.mktemp("trained") / "drafter", seed=0, stats=stats)
    return path, stats[0]


@pytest.fixture(scope="session")
def _serve_holder():
    holder = {}
    yield holder
    if holder.get("server") is not None:
        holder["server"].stop()


@pytest.fixture(scope="module")
def transformers_serve(_serve_holder, tiny_target, tmp_path_factory):
    """`transformers serve` of the tiny target, launched (not waited for: ``wait_ready()``) once for
    the session (its start costs ~5 s of CPU): test_completions and test_runner_cli share it. Tests
    count its requests as differences; one that stops it (test_runner_cli's replay, the last user)
    leaves a later module a new one."""
    from servers import TransformersServe

    server = _serve_holder.get("server")
    if server is None or server.proc.poll() is not None:
        server = TransformersServe(tiny_target, tmp_path_factory.mktemp("serve") / "serve.log").launch()
        _serve_holder["server"] = server
    return server


@pytest.fixture(scope="session")
def _cli_fork_server(tmp_path_factory):
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for p in (str(here), str(here / "reliability")):
        if p not in sys.path:
            sys.path.insert(0, p)
    import cli_util
    from zygote import Zygote

    # Started from the session's environment (not from the first opted-in test's, which may have
    # changed it): the modules it imports read nothing else.
    z = Zygote(cli_util.FORK_PRELOAD, tmp_path_factory.mktemp("cli-fork"), env=_SESSION_ENV)
    z.session_env = _SESSION_ENV
    yield z
    z.close()


@pytest.fixture
def forked_cli(_cli_fork_server):
    """``cli_util.dfcache`` runs each command in a child forked from one interpreter that imported
    dfcache's light modules, instead of a new interpreter (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("forked_cli")``). The child runs dfcache/__main__.py as
    ``__main__`` with the call's own environment, directory and timeout."""
    import cli_util

    cli_util._FORK = _cli_fork_server
    yield
    cli_util._FORK = None


@pytest.fixture(scope="module")
def module_fork_server(request, env, tmp_path_factory):
    """A fork server started with the module's own ``env`` fixture, set as the module's ``_ZYGOTE``
    for its ``cli()`` wrapper (``cli_util.python_c``): ~1 s of CPU less a command than a new
    interpreter. It imports no torch, so whether a command did is still seen. A module takes it
    with an autouse fixture of its own."""
    from cli_util import fork_server

    with fork_server(env, tmp_path_factory.mktemp("cli-fork")) as zygote:
        request.module._ZYGOTE = zygote
        yield zygote
    request.module._ZYGOTE = None


@pytest.fixture(scope="module")
def module_model_fork_server(request, env, tmp_path_factory):
    """As ``module_fork_server``, with torch and transformers imported too (cli_util.MODEL_PRELOAD),
    set as the module's ``_MODEL_ZYGOTE``: for the commands that load a model and whose imports a
    test does not look at."""
    from cli_util import FORK_PRELOAD, MODEL_PRELOAD, fork_server

    with fork_server(env, tmp_path_factory.mktemp("cli-model-fork"), FORK_PRELOAD + MODEL_PRELOAD) as zygote:
        request.module._MODEL_ZYGOTE = zygote
        yield zygote
    request.module._MODEL_ZYGOTE = None
