"""runner/core/progress.py: the progress lines long stages print when stderr is not a terminal."""

import io
import time

from runner.core.progress import LineProgress


def test_a_line_while_no_step_finishes_and_one_at_the_end():
    """A slow server finishes no request for minutes: the line still comes, from a timer, so the
    log shows the run is alive; closing prints how it ended (only if something was printed)."""
    out = io.StringIO()
    bar = LineProgress(80, "completions", "req", out, every=0.01)
    deadline = time.monotonic() + 60
    while not out.getvalue() and time.monotonic() < deadline:  # waits for an event, asserts no time
        time.sleep(0.01)
    assert out.getvalue().startswith("completions: 0/80 req (0%), ")
    bar.update(80)
    bar.close()
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("completions: 80/80 req (100%), ") and "left" not in last


def test_a_short_stage_prints_nothing_and_counts_scale():
    out = io.StringIO()
    bar = LineProgress(10, "eval d", "resp", out, every=3600)
    bar.update(10)
    bar.close()
    assert out.getvalue() == ""
    out = io.StringIO()
    bar = LineProgress(45_600, "hidden states L1", "tok", out, every=0, unit_scale=True)
    bar.update(12_345)
    assert out.getvalue().startswith("hidden states L1: 12.3k/45.6k tok (27%), ")
    assert "about" in out.getvalue() and "left" in out.getvalue()
    bar.close()
