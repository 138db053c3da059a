"""The report and the dashboard as a person sees them: in headless Chromium (Debian's ``chromium``; ``.ci/run``
installs it). Skipped, with the reason, on a machine without it: tests/evo/test_report.py and
tests/evo/test_dashboard.py check the same pages' content and the live updates over HTTP everywhere."""

from __future__ import annotations

import io
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api")

from dashboard_testlib import KEY, dashboard  # noqa: E402
from report_testlib import add_best, evo, make_run  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install -y chromium)")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("browser"))


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def _plots_loaded(page: object, names: set[str]) -> None:
    """Waits until every named figure has decoded to a picture of real size."""
    for name in sorted(names):
        page.wait_for_function(  # type: ignore[attr-defined]
            "n => { const i = document.querySelector(`img[data-plot='${n}']`); "
            "return i && i.complete && i.naturalWidth > 200; }", arg=name, timeout=30_000)


def _not_blank(png: bytes) -> bool:
    import matplotlib.image

    img = matplotlib.image.imread(io.BytesIO(png), format="png")
    return img.std() > 0.05


def test_the_report_renders_in_a_browser(run, browser, tmp_path):
    out = evo("report", str(run), "-o", str(tmp_path / "r.html"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto((tmp_path / "r.html").as_uri())
    _plots_loaded(page, {"archive_fitness", "progress", "statuses", "operators", "bandit"})
    headings = page.locator("h2").all_inner_texts()
    assert {"Archive", "Progress", "Operators and models", "Measurement quality"} <= set(headings)
    assert any(h.startswith("Lineage of the best") for h in headings)
    assert page.locator("#lineage table tbody tr").count() >= 1
    assert all(u.startswith(("file:", "data:")) for u in requests), requests  # nothing from the network
    assert _not_blank(page.screenshot(full_page=True))
    archive = page.locator("img[data-plot='archive_fitness']")
    assert _not_blank(archive.screenshot())
    page.close()


def test_the_dashboard_logs_a_browser_in_and_follows_the_run(run, browser):
    with dashboard(run, key=KEY) as url:
        context = browser.new_context(viewport={"width": 1200, "height": 900})
        page = context.new_page()
        page.goto(url)
        assert page.url.endswith("/login")  # no cookie yet: the login page, not a 401
        page.fill("input[name=key]", "wrong")
        page.click("button[type=submit]")
        assert "Wrong key" in page.content()
        page.fill("input[name=key]", KEY)
        page.click("button[type=submit]")
        page.wait_for_url(url)
        _plots_loaded(page, {"archive_fitness", "progress"})
        assert _not_blank(page.screenshot(full_page=True))
        before = page.evaluate("document.body.dataset.marker")
        added = add_best(run)
        t0 = time.monotonic()
        page.wait_for_function("id => document.querySelector('#summary').innerText.includes(id)",
                               arg=added[:16], timeout=90_000)  # fmt: skip  (it redraws at a low priority)
        assert page.evaluate("document.body.dataset.marker") != before
        assert time.monotonic() - t0 < 90
        _plots_loaded(page, {"archive_fitness", "progress"})  # the figures drawn again, loaded
        assert page.locator("img.plot").count() >= 5
        context.close()
