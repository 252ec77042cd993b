"""The docs site as a reader sees it: ``mkdocs build --strict``, then every page of the
nav rendered by headless Chromium (its DOM after scripts ran, and a screenshot kept in a
temporary folder whose path the test prints), failing on markup that did not render:
a literal ``\\|`` in a table, an RST ``::``, ``**`` or a Markdown list left as a
paragraph; and on the API reference, private names and one signature per overload.
The built site's links are walked too (no browser needed): every relative ``href`` and
``src`` of every page must reach a file of the site, and its anchor must exist.

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


class _Links(HTMLParser):
    """A page's link targets (``href`` and ``src``) and its anchors (``id``, ``name``)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.targets: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("href", "src"):
                self.targets.append(value)
            elif name == "id" or (tag == "a" and name == "name"):
                self.anchors.add(value)


_SCHEME = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:|//)")  # http:, mailto:, data:, //host


def broken_links(site: Path) -> list[str]:
    """Every relative ``href``/``src`` of every HTML page of ``site`` that does not resolve:
    to a missing file (a folder means its ``index.html``), or to an anchor its page lacks.
    One line each: ``page: target (why)``. Absolute URLs (with a scheme) are not followed."""
    from urllib.parse import unquote, urlsplit

    pages: dict[Path, _Links] = {}
    for page in sorted(site.rglob("*.html")):
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        pages[page.resolve()] = parser
    found = []
    for page, links in pages.items():
        for target in links.targets:
            if _SCHEME.match(target):
                continue
            parts = urlsplit(target)
            path = unquote(parts.path)
            if not path:
                file = page
            elif path.startswith("/"):
                file = (site / path.lstrip("/")).resolve()
            else:
                file = (page.parent / path).resolve()
            if file.is_dir():
                file = file / "index.html"
            where = f"{page.relative_to(site.resolve())}: {target}"
            if not file.is_relative_to(site.resolve()):
                found.append(f"{where} (outside the site)")
            elif not file.is_file():
                found.append(f"{where} (no such file)")
            elif (
                parts.fragment
                and file in pages
                and unquote(parts.fragment) not in pages[file].anchors
            ):
                found.append(f"{where} (no such anchor)")
    return found


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
def built_site() -> Iterator[Path]:
    """``mkdocs build --strict`` of this checkout into a temporary folder: the site."""
    pytest.importorskip("mkdocs", reason="needs the docs dependency group (mkdocs)")
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
    yield site
    shutil.rmtree(site, ignore_errors=True)  # the screenshots stay


@pytest.fixture(scope="module")
def rendered(built_site: Path) -> dict[str, Rendered]:
    chromium = _chromium()
    site = built_site
    shots = site.parent / "screenshots"
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
    return pages


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
def test_the_link_walker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "cli").mkdir()
    (tmp_path / "servers").mkdir()
    (tmp_path / "servers" / "index.html").write_text('<h2 id="a-real-model">x</h2>')
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "app.js").write_text("")
    (tmp_path / "cli" / "index.html").write_text(
        '<a href="../README.md#a-real-model">readme</a>'  # outside docs/: not built
        '<a href="../servers/#a-real-model">ok</a><a href="../servers/#gone">anchor</a>'
        '<a href="#here" id="here">self</a><a href="#nowhere">self</a>'
        '<script src="../assets/app.js"></script><img src="../../up.png">'
        '<a href="https://example.org/x">external</a><a href="mailto:a@b">mail</a>'
    )
    found = broken_links(tmp_path)
    assert [f.split(" (")[1] for f in found] == [
        "no such file)",
        "no such anchor)",
        "no such anchor)",
        "outside the site)",
    ], found
    assert "README.md" in found[0]


@pytest.mark.xdist_group("browser")  # one worker builds the site for this and the browser
def test_every_relative_link_of_the_built_site_resolves(built_site: Path) -> None:
    """issue 32: a link that `mkdocs build --strict` let through (docs/cli.md pointed at
    ../README.md, which is not part of the site) breaks here: every relative href and src
    of every built page reaches a file of the site, and its anchor, if any, exists."""
    pages = list(built_site.rglob("*.html"))
    assert len(pages) > len(NAV_PAGES), pages  # the nav's pages, 404.html, ...
    found = broken_links(built_site)
    assert not found, "\n".join(found)


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
