"""The documentation site builds with warnings as errors, and renders in a real browser.

``mkdocs build --strict`` fails on a broken link or anchor, a page missing from the navigation, a snippet that is
not there, or a docstring mkdocstrings cannot read (mkdocs.yml's ``validation``). The built site is then served
on 127.0.0.1 and opened in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, through selenium):
the landing page, the search and one API page must render. Without Chromium the browser test is skipped, except
under CI (``CI=true``), where .ci/run installs it and a missing browser is a failure.
"""
from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert sorted(_nav_pages(config["nav"])) == sorted(pages)


def test_site_builds_strict(site):
    assert (site / "index.html").exists() and (site / "search" / "search_index.json").exists()


def test_options_reference_has_every_field(site):
    import dataclasses

    from moe_compile import MoECompileConfig

    html = (site / "reference" / "options" / "index.html").read_text()
    for field in dataclasses.fields(MoECompileConfig):
        assert f"MOE_COMPILE_{field.name.upper()}" in html, field.name
    assert html.count("<h3 id=") == len(dataclasses.fields(MoECompileConfig))


def _chromium() -> tuple[str, str] | None:
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def browser():
    found = _chromium()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no Chromium / chromedriver on this CI machine: .ci/run installs Debian's chromium and "
                        "chromium-driver")
        pytest.skip("no Chromium / chromedriver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=found[1]))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on 127.0.0.1 (the search runs in a web worker, which file:// pages cannot start)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def _wait(driver, css: str, count: int = 1, timeout: float = 30):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(
        lambda d: found if len(found := [e for e in d.find_elements(By.CSS_SELECTOR, css) if e.text.strip()]) >= count
        else False)


def test_landing_page_renders(browser, served):
    browser.get(served + "/")
    assert browser.title.startswith("moe_compile")
    (heading,) = _wait(browser, "article h1")
    assert heading.text.strip().startswith("moe_compile")
    body = browser.find_element("css selector", "article").text
    assert "backend=\"moe\"" in body and "544.6" in body  # the one-line example, the performance table
    nav = " ".join(e.get_attribute("textContent") for e in browser.find_elements("css selector", "nav.md-nav a"))
    assert "Getting started" in nav and "Troubleshooting" in nav and "API" in nav


def test_search_finds_a_guide(browser, served):
    browser.get(served + "/")
    _wait(browser, "article h1")
    browser.find_element("css selector", "label.md-search__icon, label[for='__search']").click()
    query = browser.find_element("css selector", "input.md-search__input")
    query.send_keys("shard_experts")
    results = _wait(browser, "li.md-search-result__item")
    links = [a.get_attribute("href") for r in results for a in r.find_elements("css selector", "a")]
    assert any(re.search(r"/guides/expert-parallelism/", link) for link in links), links
    meta = browser.find_element("css selector", ".md-search-result__meta").text
    assert re.match(r"\d+ matching documents?", meta), meta


def test_api_page_renders_the_docstrings(browser, served):
    browser.get(served + "/reference/api/")
    headings = {h.get_attribute("id"): h for h in _wait(browser, "h3.doc-heading", count=10)}
    assert "shard_experts" in headings["moe_compile.shard_experts"].text
    signature, contents = (browser.find_element("xpath", f"//h3[@id='moe_compile.shard_experts']/following-sibling::div"
                                                         f"[contains(@class, '{kind}')][1]").text
                           for kind in ("doc-signature", "doc-contents"))
    assert "options: Mapping[str, Any] | None = None" in signature
    assert "Keep only this rank's experts" in contents
