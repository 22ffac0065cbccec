"""Check the built website the way a reader uses it: in a real (headless) browser.

    python tools/check_site.py [--html _build/html]

Serves the built site on localhost and drives Debian's Chromium through Playwright (no browser
download). For every page: it loads with no console error and no request leaving localhost, every
image loads, math is typeset by MathJax, every internal link and anchor resolves, and every notebook
page's Colab button points at that notebook in the course's repository. Full-text search must find
a word from the course.

Then every page again as a reader uses it, at a desktop (1400 x 900) and a phone (390 x 844) size:
the chapter list (primary sidebar) and the page's contents (secondary sidebar) open with their
toggle buttons and can be seen; there is one search box and no top bar covering the sidebar; on the
phone no page scrolls sideways; every notebook page shows a visible "Open in Colab" link to that
notebook; and no page holds text meant for the course's maintainers. A screenshot of every page at
both sizes, and of the sidebars opened on the phone, goes to _build/screenshots/.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

from notebooks import ROOT, config

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SKIP = ("_static/", "_sources/", "_images/", "_sphinx_design_static/", "_panels_static/")
VIEWPORTS = {"desktop": {"width": 1400, "height": 900}, "phone": {"width": 390, "height": 844}}
COLAB_LABEL = "Open in Colab"
# Text for the people who build the course, not for learners: it must not reach a page.
MAINTAINER_TEXT = re.compile(r"\bmaintainers?\b|\bTODO\b|\bFIXME\b|\bXXX\b|\bissue #?\d+|do not edit|"
                             r"generated (?:by|from) `?(?:tools|solutions)/|\bgenerated-note\b", re.IGNORECASE)


def chromium() -> str | None:
    """Debian's Chromium first; Google Chrome (preinstalled on GitHub's runners) also drives."""
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    return next((p for p in (*map(shutil.which, names), "/usr/bin/chromium") if p and Path(p).exists()), None)


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("id", "name") and v:
                self.ids.add(v)


@functools.lru_cache(maxsize=None)
def ids_of(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(parser.ids)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(root: Path):
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def check_links(html: Path, base: str, hrefs: list[str]) -> list[str]:
    problems = []
    for href in hrefs:
        url = urlparse(urljoin(base, href))
        if url.scheme not in ("http", "") or (url.netloc and not url.netloc.startswith("127.0.0.1")):
            continue
        target = html / unquote(url.path).lstrip("/")
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            problems.append(f"broken link {href!r}")
        elif url.fragment and target.suffix == ".html" and unquote(url.fragment) not in ids_of(target):
            problems.append(f"link {href!r}: no anchor #{url.fragment} in {target.relative_to(html)}")
    return problems


def expected_colab(rel_page: str) -> str:
    repo = config()["repository"]
    slug = urlparse(repo["url"]).path.strip("/")
    notebook = rel_page[: -len(".html")] + ".ipynb"
    return f"https://colab.research.google.com/github/{slug}/blob/{repo.get('branch', 'main')}/{notebook}"


SIDEBARS = {"primary": ".bd-sidebar-primary", "secondary": ".bd-sidebar-secondary"}

SHOWN_JS = """sel => { const e = document.querySelector(sel); if (!e) return false;
  const r = e.getBoundingClientRect(), s = getComputedStyle(e);
  return r.width > 40 && r.height > 40 && r.right > 40 && r.left < window.innerWidth - 40
         && s.visibility !== 'hidden' && s.display !== 'none' && parseFloat(s.opacity || '1') > 0.5; }"""

TOGGLE_JS = """kind => Array.from(document.querySelectorAll('button.' + kind + '-toggle, label.' + kind + '-toggle'))
  .filter(b => { const r = b.getBoundingClientRect(); return r.width > 0 && r.height > 0 &&
                 getComputedStyle(b).visibility !== 'hidden'; }).length"""


def _shown(page, selector: str) -> bool:
    return page.evaluate(SHOWN_JS, selector)


def _click_toggle(page, kind: str) -> None:
    page.locator(f"button.{kind}-toggle:visible, label.{kind}-toggle:visible").first.click()
    page.wait_for_timeout(450)  # the sidebar slides in


def check_sidebars(page, shots: Path | None) -> list[str]:
    """Open (or close and reopen) each sidebar with its toggle; it must end up on screen."""
    problems = []
    for kind, selector in SIDEBARS.items():
        if kind == "secondary" and not page.evaluate("document.querySelectorAll('.bd-toc-nav a, "
                                                     "#pst-page-navigation-heading-2').length"):
            continue  # a page with no sections has no contents to show
        shown = _shown(page, selector)
        toggles = page.evaluate(TOGGLE_JS, kind)
        if not toggles and shown:
            continue  # always shown at this width, as the desktop contents sidebar is
        if not toggles:
            problems.append(f"the {kind} sidebar is hidden and no visible button opens it")
            continue
        try:
            if shown:  # shown by default: the toggle must hide it, and bring it back
                _click_toggle(page, kind)
                if _shown(page, selector):
                    problems.append(f"the {kind} sidebar toggle does not hide the sidebar")
                _click_toggle(page, kind)
            else:
                _click_toggle(page, kind)
            if not _shown(page, selector):
                problems.append(f"the {kind} sidebar toggle does not open the {kind} sidebar")
            elif shots is not None:
                page.screenshot(path=str(shots.with_name(f"{shots.stem}-{kind}-open.png")))
        except Exception as exc:  # a toggle that cannot be clicked is the same failure for a reader
            problems.append(f"the {kind} sidebar toggle cannot be used: {str(exc).splitlines()[0]}")
        page.reload(wait_until="load")
    return problems


READER_JS = """() => {
  const shown = e => { const r = e.getBoundingClientRect(), s = getComputedStyle(e);
                       return r.width > 0 && r.height > 0 && s.visibility !== 'hidden' && s.display !== 'none'; };
  const header = document.querySelector('.bd-header');
  const searches = Array.from(document.querySelectorAll('input[type=search], .search-button-field, '
                                                        + 'button.search-button')).filter(shown).length;
  const over = Array.from(document.querySelectorAll('.bd-article *')).filter(e =>
      e.getBoundingClientRect().right > window.innerWidth + 1 && !e.closest('pre, .cell_output, .output, table,'
        + ' .highlight, mjx-container, .MathJax, .table-wrapper, .pst-scrollable-table-container'))
    .slice(0, 3).map(e => e.tagName.toLowerCase() + (e.className ? '.' + String(e.className).split(' ')[0] : '')
                     + ' "' + (e.textContent || '').trim().slice(0, 40) + '"');
  const colab = Array.from(document.querySelectorAll('a[href*="colab.research.google.com"]'))
    .filter(a => shown(a) && a.textContent.includes('%s')).map(a => a.getAttribute('href'));
  const article = document.querySelector('.bd-article') || document.body;
  return {header: header && shown(header) ? header.getBoundingClientRect().height : 0, searches,
          scrollWidth: document.documentElement.scrollWidth, width: window.innerWidth, over, colab,
          text: article.innerText};
}""" % COLAB_LABEL


def check_as_reader(page, rel: str, viewport: str, shots: Path) -> list[str]:
    problems = []
    seen = page.evaluate(READER_JS)
    if seen["header"] > 8:
        problems.append(f"a {seen['header']:.0f} px top bar sits over the page (theme versions out of step?)")
    if seen["searches"] > 1 and rel != "search.html":  # the search page adds its own box, by design
        problems.append(f"{seen['searches']} search boxes are shown; one is enough")
    if viewport == "phone" and seen["scrollWidth"] > seen["width"] + 1:
        problems.append(f"the page scrolls sideways: {seen['scrollWidth']} px wide on a {seen['width']} px "
                        f"screen; too wide: {'; '.join(seen['over']) or 'unknown'}")
    if is_notebook_page(rel):
        want = expected_colab(rel)
        if want not in seen["colab"]:
            problems.append(f"no visible '{COLAB_LABEL}' link to {want} (found {seen['colab'] or 'none'})")
    found = sorted({m.group(0) for m in MAINTAINER_TEXT.finditer(seen["text"])})
    if found:
        problems.append(f"text meant for maintainers, not learners: {', '.join(map(repr, found))}")
    page.screenshot(path=str(shots))
    if rel == "book/intro.html":  # the whole landing page, figure included, as a reader scrolls it
        page.screenshot(path=str(shots.with_name(f"{shots.stem}-full.png")), full_page=True)
    return problems + check_sidebars(page, shots if viewport == "phone" else None)


def is_notebook_page(rel: str) -> bool:
    return rel.split("/")[0] in ("notebooks", "solutions", "exercises") and rel.endswith(".html")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--html", type=Path, default=ROOT / "_build" / "html")
    ap.add_argument("--pages", nargs="*", help="check only these pages (paths under the site, globs allowed)")
    args = ap.parse_args()
    browser_path = chromium()
    if browser_path is None:
        print("The website check needs Chromium, which is not installed. On Debian or Ubuntu:\n"
              "    sudo apt-get install chromium\n"
              "(.ci/run installs it in CI.) Then run `make test` again.")
        return 1
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("The website check needs the playwright package: `.venv/bin/pip install -r requirements.txt`.")
        return 1
    html = args.html.resolve()
    pages = sorted(p for p in html.rglob("*.html") if not str(p.relative_to(html)).startswith(SKIP))
    if args.pages:
        pages = [p for p in pages if any(p.relative_to(html).match(g) for g in args.pages)]
    if not pages:
        print(f"no pages under {html}: run `make book` first")
        return 1
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")} | \
                {p.stem for p in (ROOT / "solutions").glob("*.ipynb")}
    server = serve(html)
    origin = f"http://127.0.0.1:{server.server_address[1]}/"
    failures = 0
    shots = ROOT / "_build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=CHROMIUM_FLAGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        for page_path in pages:
            rel = page_path.relative_to(html).as_posix()
            page = context.new_page()
            problems: list[str] = []
            page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
            page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
            page.on("requestfailed", lambda r: r.url.startswith(origin) and problems.append(f"failed to load {r.url}"))

            def route(r):
                if r.request.url.startswith(origin) or r.request.url.startswith("data:"):
                    return r.continue_()
                problems.append(f"requests a resource outside the site: {r.request.url}")
                return r.abort()

            page.route("**/*", route)
            page.goto(origin + rel, wait_until="load")
            page.wait_for_load_state("networkidle")
            broken = page.evaluate("Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0)"
                                   ".map(i => i.getAttribute('src'))")
            problems += [f"image does not load: {src}" for src in broken]
            if page.evaluate("document.querySelectorAll('.math').length") > 0:
                page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.document"
                                       " && document.querySelectorAll('mjx-container').length > 0", timeout=15000)
                if page.evaluate("document.querySelectorAll('mjx-merror').length"):
                    problems.append("MathJax could not typeset some math")
            hrefs = page.evaluate("Array.from(document.querySelectorAll('a[href]')).map(a => a.getAttribute('href'))")
            # page.url, not the file we asked for: index.html redirects to the landing page
            problems += check_links(html, page.url, sorted(set(hrefs)))
            stem = Path(rel).stem
            if rel.split("/")[0] in ("notebooks", "solutions", "exercises") and (stem in notebooks or
                                                                                  rel.startswith("exercises/")):
                colab = [h for h in hrefs if "colab.research.google.com" in h]
                want = expected_colab(rel)
                if want not in colab:
                    problems.append(f"Colab button should point at {want}, found {colab or 'none'}")
            page.close()
            for viewport, size in VIEWPORTS.items():
                page = browser.new_page(viewport=size)
                page.goto(origin + rel, wait_until="load")
                page.wait_for_load_state("networkidle")
                if page.evaluate("document.querySelectorAll('.math').length") > 0:
                    page.wait_for_function("document.querySelectorAll('mjx-container').length > 0", timeout=15000)
                (shots / viewport).mkdir(exist_ok=True)
                name = Path(rel).with_suffix("").as_posix().replace("/", "_") + ".png"
                problems += [f"{viewport}: {p}" for p in check_as_reader(page, rel, viewport, shots / viewport / name)]
                page.close()
            status = "ok  " if not problems else "FAIL"
            failures += bool(problems)
            print(f"{status} {rel}" + "".join(f"\n       {p}" for p in problems))
        page = context.new_page()
        page.goto(origin + "search.html?q=bandwidth", wait_until="load")
        try:
            page.wait_for_function("document.querySelectorAll('#search-results li').length > 0", timeout=15000)
            hits = page.evaluate("document.querySelectorAll('#search-results li').length")
            print(f"ok   search for 'bandwidth': {hits} results")
        except Exception:
            failures += 1
            print("FAIL search for 'bandwidth' found nothing")
        browser.close()
    server.shutdown()
    print(f"{len(pages)} pages checked, {failures} with problems; screenshots in {shots.relative_to(ROOT)}/")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
