"""The course website (tools/build_site.py) in headless Chromium at 1280 px, served from 127.0.0.1 with every
other host refused: each page loads with no console error and no request leaving the machine, the table of
contents resolves, every saved widget view shows (not a blank box) with its note, nothing is wider than the
page, no picture or text timeline is cut off or wrapped, and a glossary link from a lesson lands on its term.
Screenshots of three pages go to test-artifacts/."""

from __future__ import annotations

import functools
import http.server
import re
import threading
from urllib.parse import urlparse

import pytest
from test_browser import CHROMIUM, CHROMIUM_ARGS, require_browser

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]
WIDTH, HEIGHT = 1280, 900
LESSONS = ["00_welcome", "01_data_parallel", "02_tensor_parallel", "03_model_parallel", "04_gpipe",
           "05_rematerialization", "06_pipedream", "07_beyond", "08_zero", "09_v_schedules"]
PAGE_FACTS = """() => {
    const views = [...document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')];
    const blank = views.filter(s => { const w = s.parentElement.querySelector('.jupyter-widgets');
        return !w || w.getBoundingClientRect().height < 50; }).length;
    const notes = document.querySelectorAll('p.widget-note').length;
    const cut = [...document.querySelectorAll('.cell_output svg, .cell_output img')]
        .filter(p => !p.parentElement.closest('svg') && p.getBoundingClientRect().width > 0)
        .filter(p => p.getBoundingClientRect().right > p.closest('.cell_output').getBoundingClientRect().right + 1)
        .map(p => `a ${Math.round(p.getBoundingClientRect().width)} px picture`);
    const controls = [...document.querySelectorAll('.cell_output .jupyter-widgets :is(.widget-label, '
        + '.widget-readout, .widget-dropdown, .widget-slider, .widget-text, button, select, input)')]
        .filter(e => e.offsetParent !== null)
        .filter(e => e.getBoundingClientRect().right > e.closest('.cell_output').getBoundingClientRect().right + 1
                     || e.scrollWidth > e.clientWidth + 1)
        .map(e => `a widget control cut short: "${(e.textContent || e.value || e.className).trim().slice(0, 40)}"`);
    const texts = [...document.querySelectorAll('.cell_output pre')];
    const clipped = texts.filter(t => t.scrollWidth > t.clientWidth + 1)
        .map(t => `a text output of ${t.scrollWidth} px in ${t.clientWidth}: ${t.textContent.slice(0, 60)}`);
    const code = [...document.querySelectorAll('.cell_input pre')].filter(t => t.scrollWidth > t.clientWidth + 1)
        .map(t => `a code block of ${t.scrollWidth} px in ${t.clientWidth}: ${t.textContent.slice(0, 60)}`);
    const small = [...document.querySelectorAll('.cell_output svg text')]
        .filter(t => t.getBoundingClientRect().width > 0)
        .map(t => [t, parseFloat(getComputedStyle(t).fontSize) * Math.hypot(t.getScreenCTM().a, t.getScreenCTM().b)])
        .filter(([t, px]) => px < 10).map(([t, px]) => `a ${px.toFixed(1)} px label in a picture: "${t.textContent}"`);
    const tables = [...document.querySelectorAll('.cell_output pre.text-table')];
    const wrapped = tables.filter(t => getComputedStyle(t).whiteSpace !== 'pre').length;
    const links = [...document.querySelectorAll('nav a[href], article a[href]')].map(a => a.href);
    return {views: views.length, blank, notes, cut: cut.concat(controls, clipped, code, small.slice(0, 3)), wrapped,
            tables: tables.length, links,
            width: document.documentElement.scrollWidth};
}"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site(built_site):
    """The built site served on a free loopback port: (base URL, folder)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(built_site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/", built_site
    server.shutdown()


@pytest.fixture(scope="module")
def browser_page():
    """One Chromium page for the module; it records console errors and refuses (and records) off-site requests."""
    sync_api = require_browser()
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
        page = context.new_page()
        page.errors, page.offsite = [], []

        def route(request_route):
            if urlparse(request_route.request.url).hostname == "127.0.0.1":
                request_route.continue_()
            else:
                page.offsite.append(request_route.request.url)
                request_route.abort()

        context.route("**/*", route)
        page.on("console", lambda message: message.type == "error" and page.errors.append(message.text))
        page.on("pageerror", lambda error: page.errors.append(str(error)))
        yield page
        browser.close()


def _pages(folder) -> list[str]:
    return sorted(str(path.relative_to(folder)) for pattern in ["index.html", "notebooks/*.html", "exercises/*.html"]
                  for path in folder.glob(pattern))


def _visit(page, url: str) -> dict:
    page.errors.clear()
    page.offsite.clear()
    page.goto(url, wait_until="networkidle")
    if page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count():
        page.wait_for_function("() => [...document.querySelectorAll("
                               "'script[type=\"application/vnd.jupyter.widget-view+json\"]')]"
                               ".every(s => s.parentElement.querySelector('.jupyter-widgets'))", timeout=30_000)
    page.evaluate("async () => { if (window.MathJax && MathJax.startup) await MathJax.startup.promise; }")
    return page.evaluate(PAGE_FACTS)


def _resolves(folder, href: str) -> bool:
    url = urlparse(href)
    target = folder / url.path.lstrip("/")
    target = target / "index.html" if target.is_dir() else target
    return target.is_file() and (not url.fragment or f'id="{url.fragment}"' in target.read_text())


def test_every_page_loads_clean_and_fits_1280_px(site, browser_page, artifacts_dir):
    base, folder = site
    pages = _pages(folder)
    assert {f"notebooks/{lesson}.html" for lesson in LESSONS} | {"index.html", "notebooks/GLOSSARY.html"} \
        <= set(pages), pages
    problems, views, tables = [], 0, 0
    for rel in pages:
        facts = _visit(browser_page, base + rel)
        views += facts["views"]
        tables += facts["tables"]
        found = [*browser_page.errors, *(f"off-site request {url}" for url in browser_page.offsite)]
        found += [f"{facts['blank']} of {facts['views']} widget views blank"] * bool(facts["blank"])
        found += [f"{facts['views']} widget views but {facts['notes']} notes"] * (facts["notes"] != facts["views"])
        found += [f"page {facts['width']} px wide"] * (facts["width"] > WIDTH)
        found += facts["cut"] + [f"{facts['wrapped']} text tables wrap"] * bool(facts["wrapped"])
        found += [f"broken link {href}" for href in sorted(set(facts["links"]))
                  if urlparse(href).hostname == "127.0.0.1" and not _resolves(folder, href)]
        problems += [f"{rel}: {problem}" for problem in found]
        if rel == "notebooks/04_gpipe.html":
            browser_page.screenshot(path=str(artifacts_dir / "site_04_gpipe.png"), full_page=False)
            browser_page.locator(".jupyter-widgets").first.scroll_into_view_if_needed()
            browser_page.screenshot(path=str(artifacts_dir / "site_04_gpipe_widget.png"))
        if rel == "index.html":
            browser_page.screenshot(path=str(artifacts_dir / "site_index.png"))
    assert not problems, "\n".join(problems)
    assert views >= len(LESSONS) and tables >= len(LESSONS), f"{views} widget views, {tables} text tables"


def test_the_table_of_contents_lists_the_lessons_in_course_order(site, browser_page):
    base, _ = site
    browser_page.goto(base + "index.html")
    hrefs = browser_page.eval_on_selector_all("nav.bd-docs-nav a.reference.internal",
                                              "links => links.map(a => a.getAttribute('href'))")
    lessons = [href for href in hrefs if href.startswith("notebooks/0")]
    assert lessons == [f"notebooks/{lesson}.html" for lesson in LESSONS], hrefs
    assert "notebooks/GLOSSARY.html" in hrefs and sum(href.startswith("exercises/") for href in hrefs) >= 9, hrefs
    listed = browser_page.eval_on_selector_all(".toctree-wrapper a.reference.internal",
                                               "links => links.map(a => a.getAttribute('href'))")
    assert [h for h in listed if h.startswith("notebooks/0")] == [f"notebooks/{lesson}.html" for lesson in LESSONS], \
        "one entry per lesson on the index (lesson 04's second part is no lesson of its own)"


def test_a_glossary_link_from_a_lesson_lands_on_its_term(site, browser_page, artifacts_dir):
    """Clicked in lesson 01, a glossary link lands on its term's row; each lesson's first glossary link, opened
    from the page's own HTML, lands on its row too (a lesson page with its widgets takes seconds to load)."""
    base, folder = site
    browser_page.goto(f"{base}notebooks/{LESSONS[0]}.html")
    browser_page.locator('article a[href*="GLOSSARY.html#term-"]').first.click()
    browser_page.wait_for_load_state()
    assert "GLOSSARY.html#term-" in browser_page.url, browser_page.url
    landed = []
    for lesson in LESSONS:
        html = (folder / "notebooks" / f"{lesson}.html").read_text()
        article = html[html.index("<article"):]
        href = re.search(r'href="((?:\.\./notebooks/|)GLOSSARY\.html#(term-[^"]+))"', article)
        assert href, f"{lesson} links no glossary term"
        fragment = href.group(2)
        if lesson != LESSONS[0]:
            browser_page.goto(f"{base}notebooks/GLOSSARY.html#{fragment}")
            browser_page.wait_for_load_state()
        top = browser_page.evaluate("f => { const row = document.getElementById(f);"
                                    " return row && row.matches(':target') && row.tagName === 'TR'"
                                    " ? row.getBoundingClientRect().top : null; }", fragment)
        assert top is not None and 0 <= top < HEIGHT, f"{lesson}: {fragment} did not land on its row (top {top})"
        landed.append(fragment)
        if lesson == LESSONS[0]:
            browser_page.screenshot(path=str(artifacts_dir / "site_glossary_term.png"))
    assert len(landed) == len(LESSONS)
