"""The report pages (runner/core/reporting.py, `run eval`'s report.html and `watch`'s) stay inside a
1400 px window, measured in a real headless Chromium: it scrolled sideways there (a summary table
of many drafters or checkpoints, long unbroken ids and completions). Skipped, saying why, where
Chromium is not installed (.ci/run installs Debian's package)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from runner.core import reporting

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed (apt-get install chromium; .ci/run does)")


def _wide_page() -> str:
    """A page as wide as real ones get: 24 checkpoints side by side with 4 tree budgets, 64-char
    keys, a prompt id and a completion with no space to break at."""
    headers = ["drafter"] + [f"τ tree-{b}" for b in (2, 4, 8, 16, 32, 64)] + ["blocks", "tokens/block", "key"]
    rows = [("", [f"checkpoint-{1000 * i}-of-a-long-training-run-name", *["3.14"] * 6, "1234", "2.71",
                  "0123456789abcdef" * 4]) for i in range(24)]
    table = reporting.table_html(headers, rows)
    per_prompt_headers = ["prompt", "tokens"] + [f"checkpoint-{1000 * i}<br>τ chain" for i in range(24)]
    wide = reporting.table_html(per_prompt_headers, [("", ["p" * 120, "512", *["2.50"] * 24])], table_id="pp")
    completion = '<div class="completion">' + "x" * 4000 + "</div>"
    heading = f"<h4>{'prompt-id-without-spaces-' * 12}: τ chain 2.00</h4>"
    return reporting.page(title="dfcache eval", subtitle="k" * 300, table=table, images=[],
                          sections=[wide, heading, completion, "<pre>" + "y" * 3000 + "</pre>"])


def test_a_wide_report_page_fits_a_1400px_window(tmp_path):
    chromium = _chromium()
    html = _wide_page().replace(
        "</body>", "<script>document.title = document.documentElement.scrollWidth + ',' + "
                   "document.documentElement.clientWidth;</script></body>")
    page = tmp_path / "report.html"
    page.write_text(html, encoding="utf-8")
    dom = subprocess.run([chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    scroll, client = map(int, re.search(r"<title>(\d+),(\d+)</title>", dom.stdout).groups())
    assert client > 1000, (scroll, client)
    assert scroll <= client, f"the page is {scroll} px wide in a {client} px window: it scrolls sideways"
