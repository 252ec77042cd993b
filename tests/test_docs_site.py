"""The docs site as a reader sees it: ``mkdocs build --strict``, then every page of the
nav rendered by headless Chromium (its DOM after scripts ran, and a screenshot kept in a
temporary folder whose path the test prints), failing on markup that did not render:
a literal ``\\|`` in a table, an RST ``::``, ``**`` or a Markdown list left as a
paragraph; and on the API reference, private names and one signature per overload.

Needs the ``docs`` dependency group (mkdocs; the first venv of scripts/test.sh has it: in a venv
without it these tests are skipped, saying so) and Chromium (``apt-get install -y
chromium``; scripts/test.sh installs it; without it they fail, naming the command).
Chromium may reach 127.0.0.1 only (``--host-resolver-rules``); pages are file:// URLs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAV_PAGES = re.findall(
    r"^\s*- [^:\n]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M
)
GUARD = 300.0  # seconds one Chromium run may take before the test fails (a guard)

# Text a reader should never see outside code: markup that did not render.
RAW_MARKUP = {
    "a literal \\| (a table cell's escaped pipe inside code)": re.compile(r"\\\|"),
    "an RST :: (a literal block marker)": re.compile(r"::"),
    "unrendered ** (bold)": re.compile(r"\*\*"),
    "an unrendered Markdown link": re.compile(r"\]\("),
    "an unrendered code fence": re.compile(r"```"),
}


def _page_file(site: Path, page: str) -> Path:
    stem = page.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem}/index.html")


class _Visible(HTMLParser):
    """The article's text outside code, in blocks (one per paragraph, cell, item...)."""

    SKIP = frozenset({"pre", "code", "script", "style", "svg", "button", "label"})
    BLOCKS = frozenset({"p", "li", "td", "th", "h1", "h2", "h3", "h4", "h5", "h6", "div", "dd"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.paragraphs: list[str] = []  # <p> texts, with their line breaks
        self._in_article = 0
        self._skip = 0
        self._current: list[str] = []
        self._p: list[str] | None = None

    def _flush(self) -> None:
        text = "".join(self._current).strip()
        if text:
            self.blocks.append(text)
        self._current = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "article":
            self._in_article += 1
        if not self._in_article:
            return
        if tag in self.SKIP:
            self._skip += 1
        elif tag in self.BLOCKS:
            self._flush()
        if tag == "p":
            self._p = []

    def handle_endtag(self, tag: str) -> None:
        if not self._in_article:
            return
        if tag in self.SKIP:
            self._skip = max(0, self._skip - 1)
        elif tag in self.BLOCKS:
            self._flush()
        if tag == "p" and self._p is not None:
            self.paragraphs.append("".join(self._p))
            self._p = None
        if tag == "article":
            self._in_article -= 1

    def handle_data(self, data: str) -> None:
        if self._in_article and not self._skip:
            self._current.append(data)
        if self._in_article and self._p is not None:
            self._p.append(data)


def raw_markup(dom: str) -> list[str]:
    """What did not render in a page's DOM: one line per finding, with its text."""
    parser = _Visible()
    parser.feed(dom)
    found = [
        f"{what}: {block[:160]!r}"
        for block in parser.blocks
        for what, pattern in RAW_MARKUP.items()
        if pattern.search(block)
    ]
    found += [
        f"a Markdown list rendered as a paragraph: {text[:160]!r}"
        for text in parser.paragraphs
        if re.search(r"\n\s*[-*] \S", text)
    ]
    return found


def api_problems(dom: str) -> list[str]:
    """The API reference: no private name shown, one signature per documented object
    (overloads are not repeated), every object documented once."""
    problems = []
    ids = re.findall(r'<h[2-6] id="(qwen_embed_(?:plugins|tooling)[^"]*)"', dom)
    private = sorted({i for i in ids if any(p.startswith("_") for p in i.split("."))})
    problems += [f"a private object is documented: {i}" for i in private]
    parser = _Visible()
    parser.feed(dom)
    problems += [f"a private name shown: {b[:120]!r}" for b in parser.blocks if "_ClientBase" in b]
    problems += [f"documented twice: {i}" for i in sorted({i for i in ids if ids.count(i) > 1})]
    chunks = re.split(r'(?=<h[2-6] id="qwen_embed_(?:plugins|tooling))', dom)
    for chunk in chunks[1:]:
        name = re.match(r'<h[2-6] id="([^"]+)"', chunk)
        count = chunk.count('class="doc-signature')
        if count > 1:
            problems.append(f"{name.group(1) if name else '?'} shows {count} signatures")
    return problems


# --------------------------------------------------------------------------- fixtures


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail(
        "the docs-site test needs headless Chromium: apt-get install -y chromium "
        "(scripts/test.sh installs it)"
    )


@dataclass(frozen=True)
class Rendered:
    page: str
    dom: str
    screenshot: Path


def _render(chromium: str, url: str, screenshot: Path, profile: str) -> str:
    common = [
        chromium,
        "--headless",
        "--no-sandbox",  # root in CI containers
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",  # nothing leaves
        "--window-size=1280,3000",
    ]
    shot = subprocess.run(
        [*common, f"--screenshot={screenshot}", url],
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    assert screenshot.is_file(), f"no screenshot of {url}: {shot.stderr[-2000:]}"
    # a blank 1280 x 3000 page compresses to ~10 KB; every rendered page here is > 150 KB
    assert screenshot.stat().st_size > 50_000, f"{screenshot} looks blank ({url})"
    dom = subprocess.run(
        [*common, "--dump-dom", url], capture_output=True, text=True, timeout=GUARD, check=False
    )
    assert dom.returncode == 0, f"chromium --dump-dom {url}: {dom.stderr[-2000:]}"
    return dom.stdout


@pytest.fixture(scope="module")
def rendered() -> Iterator[dict[str, Rendered]]:
    pytest.importorskip("mkdocs", reason="needs the docs dependency group (mkdocs)")
    chromium = _chromium()
    out = Path(tempfile.mkdtemp(prefix="qwen-embed-docs-site-"))
    site = out / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stderr}"
    shots = out / "screenshots"
    shots.mkdir()

    def one(page: str) -> Rendered:
        file = _page_file(site, page)
        assert file.is_file(), f"{page} was not built ({file})"
        screenshot = shots / (page.removesuffix(".md") + ".png")
        with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
            dom = _render(chromium, file.as_uri(), screenshot, profile)
        return Rendered(page, dom, screenshot)

    with ThreadPoolExecutor(max_workers=3) as pool:
        pages = {r.page: r for r in pool.map(one, NAV_PAGES)}
    print(f"docs site screenshots: {shots}")  # kept for a look (pytest -s shows it)
    yield pages
    shutil.rmtree(site, ignore_errors=True)  # the screenshots stay


# --------------------------------------------------------------------------- tests


@pytest.mark.unit
def test_the_checks_catch_raw_markup() -> None:
    article = (
        "<article><table><tr><td><code>int \\| None</code> or \\|</td></tr></table>"
        "<p>Instantiate::</p><p>Pages:\n- a\n- b</p><p>**bold**</p>"
        "<pre><code>a::b **kwargs</code></pre></article>"
    )
    found = raw_markup(article)
    assert len(found) == 4, found
    assert not raw_markup("<article><p>fine: <code>**kwargs</code>, a | b</p></article>")
    api = (
        '<h3 id="qwen_embed_plugins.X.f">f</h3><div class="doc-signature">1</div>'
        '<div class="doc-signature">2</div><h2 id="qwen_embed_plugins._B">_B</h2>'
    )
    assert len(api_problems(api)) == 2, api_problems(api)


@pytest.mark.unit
def test_every_page_is_in_the_nav() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert set(NAV_PAGES) == pages, sorted(pages ^ set(NAV_PAGES))


def browser_test(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a test of the rendered site (the site build and two Chromium runs per page,
    ~1-3 min in all): ``slow``, ``browser`` (scripts/test.sh installs Chromium for these)
    and one xdist group, so that one worker builds and renders the site once for all."""
    for mark in (pytest.mark.slow, pytest.mark.browser, pytest.mark.xdist_group("browser")):
        test = mark(test)
    return test


@browser_test
@pytest.mark.parametrize("page", NAV_PAGES)
def test_page_renders_without_raw_markup(page: str, rendered: dict[str, Rendered]) -> None:
    shown = rendered[page]
    assert "<article" in shown.dom, f"{page}: no article in the rendered page"
    problems = raw_markup(shown.dom)
    if page == "api.md":
        problems += api_problems(shown.dom)
    assert not problems, f"{page} (screenshot {shown.screenshot}):\n" + "\n".join(problems)


@browser_test
def test_home_page_starts_with_both_adapters_and_lists_the_pages(
    rendered: dict[str, Rendered],
) -> None:
    dom = rendered["index.md"].dom
    headings = re.findall(r"<h2 id=\"([^\"]+)\"", dom)
    assert headings.index("langchain") < headings.index("the-core-client"), headings
    assert headings.index("llamaindex") < headings.index("the-core-client"), headings
    pages = dom.split('id="pages"', 1)[1]
    assert pages.count("<li>") >= 6, "the home page's list of pages is not a list"
