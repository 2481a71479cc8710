"""Commands reach the `dfcache` command line by entry point (dfcache/plugins.py), in a plain
checkout, an editable install and a wheel alike; dfcache imports nothing of the runner."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from dfcache import plugins

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_reader_agrees_with_tomllib():
    """The executable reads its checkout's entry points without tomllib (7 ms to import): on the
    repository's own pyproject.toml it must find exactly what tomllib finds."""
    text = (REPO / "pyproject.toml").read_text()
    project = tomllib.loads(text)["project"]
    name, groups = plugins.read_pyproject_entry_points(text)
    want = {**project.get("entry-points", {}), "console_scripts": project.get("scripts", {})}
    assert name == project["name"] == "dfcache"
    assert groups == want
    assert groups[plugins.COMMANDS] and groups[plugins.FAST_PATHS]["run"] == "runner.commands.fast_run:main"


def test_entry_points_txt_reader_agrees_with_importlib_metadata():
    """What a wheel records (entry_points.txt) read as importlib.metadata reads it, on every
    distribution installed here that has entry points."""
    from importlib.metadata import distributions

    checked = 0
    for dist in distributions():
        text = dist.read_text("entry_points.txt")
        if not text:
            continue
        want: dict = {}
        for ep in dist.entry_points:
            want.setdefault(ep.group, {})[ep.name] = ep.value
        assert plugins.read_entry_points_txt(text) == want, dist.metadata["Name"]
        checked += 1
    assert checked >= 3


def test_the_checkout_declares_the_runner_commands():
    """A plain checkout (these tests run from one) has the runner's commands from its own
    pyproject.toml, whatever the installed metadata says (tests/test_architecture.py checks that
    dfcache imports nothing of the runner)."""
    assert plugins.own_entry_points()[plugins.COMMANDS] == {"runner": "runner.commands.run:register"}


def test_a_wheel_declares_the_runner_commands_and_fast_path(tmp_path):
    """Built and unpacked as pip installs it (site-packages holds dfcache/, runner/ and the
    dist-info, no pyproject.toml): the command line has `run` and `plan`, and the executable
    finds the fast path of `run` in the wheel's own metadata."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("dfcache", "runner"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    site = tmp_path / "site"
    with zipfile.ZipFile(next((tmp_path / "dist").glob("dfcache-*.whl"))) as whl:
        whl.extractall(site)
    assert not (site / "pyproject.toml").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from dfcache import plugins\n"
            "assert plugins.__file__.startswith(sys.argv[1]), plugins.__file__\n"
            "print(plugins.own_entry_points()[plugins.FAST_PATHS]['run'])\n"
            "from dfcache.cli import main\n"
            "sys.exit(main(['--help']))\n")
    r = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "runner.commands.fast_run:main"
    assert any(line.split()[:1] == ["run"] for line in lines) and any(line.split()[:1] == ["plan"] for line in lines)
