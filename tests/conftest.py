"""Shared pytest fixtures. Add fixtures here; keep this file small."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny random Qwen3.5 target + tokenizer with a chat template, built once per session."""
    from runner.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")
