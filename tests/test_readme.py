"""The README's two commands and .ci/run agree."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```")[0].strip() for b in readme.split("```bash\n")[1:]]
    main_job, tests = blocks[0], blocks[1]
    assert main_job.endswith("dfcache run eval --example")
    ci = (ROOT / ".ci" / "run").read_text()
    # .ci/run creates the venv and installs torch itself, then runs the rest verbatim
    tail = tests.split("pip install torch==2.13.0 && ", 1)[1]
    assert tail in ci
    assert "pip install -q torch==2.13.0" in ci
