"""The website's live explorers (issue 47) in headless Chromium, served from 127.0.0.1 with every other host refused:
each "Make it live" button starts its explorer in the page (Pyodide running gpipe_ref's own widgets), the first
cold within 20 s, then a move of one control changes what it shows to exactly what the same explorer shows in
CPython after the same move (website/live/bridge.py in this process), with no console error and no request leaving
the machine."""

from __future__ import annotations

import html
import importlib.util
import json
import re
import time
from html.parser import HTMLParser

import pytest
from test_browser_site import browser_page, site  # noqa: F401  (fixtures)

from conftest import ROOT

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]
COLD_START_S = 20.0
BUTTON = re.compile(r'<button class="gpipe-make-live" data-factory="(\w+)" data-options="([^"]*)">')
# One move in the page: the node at pre-order position `at` (every drawn node carries data-id), set and reported as
# a reader's change; a button is pressed.
MOVE = """([which, at, value]) => {
    const host = document.querySelectorAll('.live-explorer')[which];
    const node = host.querySelectorAll('[data-id]')[at];
    const control = node.matches('button') ? node : node.querySelector('select, input, textarea, button');
    if (control.matches('button')) { control.click(); return; }
    control.value = String(value);
    control.dispatchEvent(new Event('change'));
}"""
SHOWN = """(which) => [...document.querySelectorAll('.live-explorer')[which].querySelectorAll('.live-html')]
    .map(e => e.textContent)"""


def load_bridge():
    """website/live/bridge.py in this process (by path: website/live/ must not go on sys.path, as its IPython
    stand-in would hide the real one)."""
    spec = importlib.util.spec_from_file_location("live_bridge", ROOT / "website" / "live" / "bridge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Text(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)


def text_of(markup: str) -> str:
    """What a browser's textContent gives for ``markup``, whitespace runs made one space."""
    parser = _Text()
    parser.feed(markup)
    return " ".join("".join(parser.parts).split())


def preorder(node: dict) -> list[dict]:
    return [node] + [n for child in node.get("children", []) for n in preorder(child)]


def shown(tree: dict) -> list[str]:
    return [text_of(node["value"]) for node in preorder(tree) if node["kind"] in ("HTML", "Label")]


def moves_for(bridge, factory: str, options: dict) -> tuple[list[tuple[int, object]], list[str]]:
    """The first move (a menu's next option, a slider's next step) that changes what the explorer shows, with a
    "load" press after it where the explorer needs one (the playground); and what it shows after, in CPython."""
    first = json.loads(bridge.start(factory, **options))
    nodes = preorder(first)
    for at, node in enumerate(nodes):
        if node.get("disabled") or node["kind"] not in ("Dropdown", "IntSlider", "FloatSlider"):
            continue
        if "options" in node:
            value = (node["index"] + 1) % len(node["options"])
        else:
            up = node["value"] + node["step"] <= node["max"]
            value = round(node["value"] + node["step"] if up else node["value"] - node["step"], 10)
        moves: list[tuple[int, object]] = [(at, value)]
        loads = [i for i, n in enumerate(nodes) if n["kind"] == "Button" and n.get("description") == "load"]
        moves += [(i, None) for i in loads]
        json.loads(bridge.start(factory, **options))  # afresh: the moves start from the saved settings
        for where, move in moves:
            tree = json.loads(bridge.set_value(factory, preorder(json.loads(bridge.tree(factory)))[where]["id"], move))
        if shown(tree) != shown(first):
            return moves, shown(tree)
    raise AssertionError(f"no control of {factory} changes what it shows")


def test_every_live_explorer_starts_offline_and_answers_a_move_as_in_cpython(site, browser_page, artifacts_dir):  # noqa: F811
    base, folder = site
    buttons = [(page.relative_to(folder).as_posix(), k, factory, json.loads(html.unescape(options)))
               for page in sorted(folder.glob("notebooks/*.html"))
               for k, (factory, options) in enumerate(BUTTON.findall(page.read_text()))]
    assert len({factory for _, _, factory, _ in buttons}) == 11, buttons
    assert "Not live here: it trains a model with torch" in (folder / "notebooks" / "06_pipedream.html").read_text()
    bridge = load_bridge()
    problems, cold, fetched = [], None, []
    browser_page.on("request", lambda request: fetched.append(request.url))
    for rel, k, factory, options in buttons:  # a page's buttons in order, one visit a page (one Pyodide)
        if k == 0:
            browser_page.errors.clear()
            browser_page.offsite.clear()
            fetched.clear()
            browser_page.goto(base + rel, wait_until="networkidle")
            early = [url for url in fetched if "/vendor/pyodide/" in url or "/live/" in url]
            problems += [f"{rel}: fetched before any press: {url}" for url in early]
        fetched.clear()
        began = time.monotonic()
        browser_page.locator("button.gpipe-make-live").nth(0).click()  # the pressed one is gone: the next is first
        browser_page.locator(".live-explorer").nth(k).wait_for(timeout=60_000)
        started = time.monotonic() - began
        if cold is None:  # the first press: how long, and how many bytes it fetched (the files it asked for)
            cold = started
            paths = {re.sub(r"^https?://[^/]+/", "", url).split("?")[0] for url in fetched}
            press_bytes = sum((folder / path).stat().st_size for path in paths if (folder / path).is_file())
        moves, expected = moves_for(bridge, factory, options)
        before = browser_page.evaluate(SHOWN, k)
        for at, value in moves:
            browser_page.evaluate(MOVE, [k, at, value])
        browser_page.wait_for_function(f"() => JSON.stringify(({SHOWN})({k})) !== {json.dumps(json.dumps(before))}",
                                       timeout=30_000)
        after = [" ".join(text.split()) for text in browser_page.evaluate(SHOWN, k)]
        if after != expected:
            problems.append(f"{rel} {factory}: after {moves} the page shows {after[:2]}..., CPython {expected[:2]}...")
        problems += [f"{rel} {factory}: {error}" for error in browser_page.errors]
        problems += [f"{rel} {factory}: off-site request {url}" for url in browser_page.offsite]
        if factory == "bubble_explorer" and k == 0:
            browser_page.locator(".live-explorer").nth(k).scroll_into_view_if_needed()
            browser_page.screenshot(path=str(artifacts_dir / "site_live_bubble.png"))
    assert not problems, "\n".join(problems)
    assert cold is not None and cold < COLD_START_S, f"the first explorer took {cold:.1f} s to start cold"
    print(f"{len(buttons)} live explorers; the first started cold in {cold:.1f} s, fetching {press_bytes / 1e6:.1f} MB")
