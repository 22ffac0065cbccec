"""Check the built website the way a reader uses it: in a real (headless) browser.

    python tools/check_site.py [--html _build/html]

Serves the built site on localhost and drives Debian's Chromium through Playwright (no browser
download). For every page: it loads with no console error and no request leaving localhost, every
image loads, math is typeset by MathJax, every internal link and anchor resolves, and every notebook
page's Colab button points at that notebook in the course's repository. Full-text search must find
a word from the course. Screenshots of the landing page and of chapter 01 go to _build/screenshots/.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--html", type=Path, default=ROOT / "_build" / "html")
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
            if rel == "book/intro.html":
                page.screenshot(path=str(shots / "landing.png"), full_page=False)
            if rel == "notebooks/01_vector_add.html":
                page.screenshot(path=str(shots / "chapter01.png"), full_page=False)
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
