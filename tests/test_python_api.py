"""docs/python.md runs as written (doctest), against a tiny real target and drafter."""

from __future__ import annotations

import doctest
import os
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "python.md"


@pytest.fixture
def in_example_dir(tiny_target, tmp_path):
    import torch

    from runner.train_tiny import make_untrained_drafter

    os.symlink(tiny_target, tmp_path / "target")
    make_untrained_drafter(tiny_target, tmp_path / "drafter", layer_ids=[3, 1])
    cwd, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(tmp_path)
    torch.set_num_threads(1)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)


def test_python_md_examples_run(in_example_dir):
    res = doctest.testfile(str(DOC), module_relative=False, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False, report=True)
    assert res.attempted > 15
    assert res.failed == 0
