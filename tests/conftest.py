"""Shared pytest fixtures. Add fixtures here; keep this file small."""

from __future__ import annotations

import signal

import pytest

# A shell without job control starts background commands (`bash .ci/run &`, nohup'd jobs) with
# SIGINT ignored, and every process started from here would inherit that: Python then installs no
# KeyboardInterrupt handler, and the tests that press Ctrl-C on a child (test_watch, the reliability
# SIGINT cases) saw the child finish or hang. Children get the default disposition, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny random Qwen3.5 target + tokenizer with a chat template, built once per session."""
    from runner.models.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")
