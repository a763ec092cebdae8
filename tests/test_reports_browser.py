"""report.html in a real browser: the script runs, filters work, and the page paints.

Headless Chromium loads the file with the network stack idle (no QUIC, no background fetches),
so a page that needed the network would show broken images here. Skipped only on a developer
machine without Chromium; under CI (the CI variable set) a missing browser is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from rlconform.reports import write_reports
from rlconform.reports._common import is_flat
from rlconform.reports.sample import example_report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but no headless browser is installed (looked for {BROWSERS})")
    pytest.skip("no Chromium on this machine (apt-get install chromium); CI runs this test")


def _run(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        "--window-size=1400,2000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


class _Dom(HTMLParser):
    """Just enough of the dumped DOM: clause rows, images, the body's data-js flag, texts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str | None]] = []
        self.images: list[dict[str, str | None]] = []
        self.figures: list[dict[str, str | None]] = []
        self.body: dict[str, str | None] = {}
        self.by_id: dict[str, dict[str, str | None]] = {}
        self._text_of: str | None = None
        self.texts: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag == "tr" and "clause" in (a.get("class") or "").split():
            self.rows.append(a)
        if tag == "img":
            self.images.append(a)
        if tag == "figure":
            self.figures.append(a)
        if a.get("id"):
            self.by_id[a["id"]] = a
            if a["id"] in ("f-count", "verdict"):
                self._text_of = a["id"]
                self.texts[a["id"]] = ""

    def handle_data(self, data):
        if self._text_of:
            self.texts[self._text_of] += data

    def handle_endtag(self, tag):
        self._text_of = None


def _dom(browser: str, tmp_path: Path, url: str) -> _Dom:
    out = _run(browser, tmp_path / "profile-dom", "--dump-dom", url)
    dom = _Dom()
    dom.feed(out.stdout)
    return dom


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    report = example_report(failing=True)
    paths = write_reports(report, out)
    return report, paths["html"]


def test_page_runs_its_script_and_shows_clauses_and_plots(rendered, tmp_path):
    browser = _browser()
    report, html = rendered
    dom = _dom(browser, tmp_path, html.as_uri())
    assert dom.body.get("data-js") == "ready", "the inline script did not run to its end"
    assert "clauses" in dom.by_id
    n = len(report["clauses"])
    assert len(dom.rows) == n
    assert not any("hidden" in row for row in dom.rows)
    assert dom.texts["f-count"].strip() == f"Showing {n} of {n} clauses"
    assert dom.texts["verdict"].strip() == "FAIL"
    # details start collapsed once the script ran
    assert all("hidden" in dom.by_id[f"{row['id']}-detail"] for row in dom.rows)
    plotted = sum(  # a constant distribution is a table row, not a plot
        m["kind"] == "series" or (m["kind"] == "distribution" and not is_flat(m))
        for c in report["clauses"]
        for m in (c.get("metrics") or {}).values()
    )
    plots = [i for i in dom.images if (i.get("src") or "").startswith("data:image/png;base64,")]
    assert len(plots) == len(dom.images) == plotted >= 5


def test_filters_from_the_url_hide_other_clauses(rendered, tmp_path):
    browser = _browser()
    report, html = rendered
    dom = _dom(browser, tmp_path, html.as_uri() + "#status=failed&surface=trainer")
    shown = [row["data-status"] for row in dom.rows if "hidden" not in row]
    expected = [
        c for c in report["clauses"] if c["status"] == "failed" and c["surface"] == "trainer"
    ]
    assert len(shown) == len(expected) == 2 and set(shown) == {"failed"}
    assert dom.texts["f-count"].strip() == f"Showing 2 of {len(report['clauses'])} clauses"
    # the plots follow the clause filter
    visible = {f["data-row"] for f in dom.figures if "hidden" not in f}
    assert visible == {f"clause-{c['id']}" for c in expected if c.get("metrics")}
    assert len(visible) < len({f["data-row"] for f in dom.figures})


def test_linking_to_a_clause_opens_its_details(rendered, tmp_path):
    browser = _browser()
    _, html = rendered
    dom = _dom(browser, tmp_path, html.as_uri() + "#clause-TRAIN-FIELD-PARITY")
    assert "hidden" not in dom.by_id["clause-TRAIN-FIELD-PARITY-detail"]
    assert "hidden" in dom.by_id["clause-DP-ROUNDTRIP-detail"]


def test_screenshot_is_a_painted_page(rendered, tmp_path):
    from PIL import Image

    browser = _browser()
    _, html = rendered
    png = tmp_path / "report.png"
    _run(browser, tmp_path / "profile-shot", f"--screenshot={png}", html.as_uri())
    assert png.stat().st_size > 50_000
    with Image.open(png) as im:
        assert im.size == (1400, 2000)
        rgb = np.asarray(im.convert("RGB")).astype(int)
    colours = np.unique(rgb.reshape(-1, 3), axis=0)
    assert len(colours) > 200, "the screenshot is (nearly) one colour"
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    assert ((r > 180) & (g < 80) & (b < 80)).any(), "no red FAIL badge painted"
    assert ((g > 100) & (r < 60) & (b < 90)).any(), "no green passed badge painted"
    assert (rgb.std(axis=(0, 1)) > 10).all()


def test_a_missing_browser_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        _browser()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no Chromium"):
        _browser()
