"""Screenshot every page of the built book in a headless browser and flag pages showing errors.

A strict build (``-W -n``) catches what Sphinx can see; this looks at what a reader sees. It
serves the built HTML on loopback, opens every page in Chromium through Playwright, waits for
MathJax and for every image, saves a full-page PNG per page, and lists the pages that show:

* a traceback from a code cell (myst-nb ``.output.traceback``; the text "Traceback (most
  recent call last)" in a cell's output);
* ``stderr`` output of a cell (``.output.stderr``: warnings, progress bars left on stderr);
* docutils/Sphinx error markers (``.system-message``, ``.problematic``) and cross-references
  that did not resolve (an unlinked ``.xref`` to a label, document, term or labkit name);
* a formula MathJax could not typeset (``mjx-merror``);
* an image that did not load (``naturalWidth == 0``), and any file of the book itself that
  the page asked for and the server could not give (a broken asset path).

Requests that leave loopback are blocked (the book is meant to work offline) and listed as
notes, not failures. A page that only forwards elsewhere (Jupyter Book's ``index.html``) gets no
screenshot; its target must exist.

``make screenshots`` builds the book and runs this. By hand, set up once, without touching
the project's ``.venv``; Playwright drives a Chromium that is already installed, so nothing is
downloaded besides the Python package::

    apt-get install -y chromium            # Debian's Chromium (or pass --chromium PATH)
    python3 -m venv .venv-screenshots
    .venv-screenshots/bin/pip install playwright

Run, after building the book (``make book``)::

    .venv-screenshots/bin/python book/tools/screenshots.py
    .venv-screenshots/bin/python book/tools/screenshots.py --html /tmp/out/_build/html \\
        --out /tmp/shots --only labs/

It writes ``<out>/<page>.png`` for each page and ``<out>/report.txt``; the exit status is 0
when no page shows an error, 1 when some do (they are listed), 2 when it cannot run.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_HTML = ROOT / "book" / "_build" / "html"
DEFAULT_OUT = ROOT / "book" / "_build" / "screenshots"
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
VIEWPORT = {"width": 1280, "height": 900}  # CSS pixels: a laptop screen, the sidebar shown
IMAGE_WAIT_MS = 10_000  # per page, for every image to load or fail

# Run in the page: what a reader would see as an error. Each entry is (kind, detail).
FIND_ERRORS_JS = """
async (imageWaitMs) => {
  const found = [];
  const text = (e) =>
    (e.innerText || e.textContent || '').trim().replace(/\\s+/g, ' ').slice(0, 120);
  const add = (kind, e) => found.push([kind, text(e) || e.outerHTML.slice(0, 120)]);
  document.querySelectorAll('.output.traceback').forEach(e => add('traceback', e));
  document.querySelectorAll('.cell_output').forEach(e => {
    if (!e.querySelector('.output.traceback') &&
        (e.textContent || '').includes('Traceback (most recent call last)')) add('traceback', e);
  });
  document.querySelectorAll('.output.stderr').forEach(e => add('stderr output', e));
  document.querySelectorAll('.system-message, .problematic')
    .forEach(e => add('sphinx error marker', e));
  // A role's xref carries the role's class (std-ref, py-func ...); the module index's plain
  // "xref" headings are unlinked by design. Unlinked labels always count; Python names only
  // when they are labkit's (types from other packages are unlinked on purpose: no intersphinx).
  document.querySelectorAll('.xref').forEach(e => {
    if (e.closest('a')) return;
    const label = /\\bstd-(ref|numref|doc|term)\\b/.test(e.className);
    const labkit = /\\bpy-\\w+/.test(e.className) && (e.textContent || '').includes('labkit');
    if (label || labkit) add('unresolved reference', e);
  });
  document.querySelectorAll('mjx-merror, .MathJax_Error').forEach(e => add('math error', e));
  // Lazy images load only when scrolled to: ask for all of them now, then wait.
  const images = [...document.images];
  images.forEach(i => { i.loading = 'eager'; });
  await Promise.all(images.map(i => i.complete ? null : new Promise(done => {
    i.addEventListener('load', done, {once: true});
    i.addEventListener('error', done, {once: true});
    setTimeout(done, imageWaitMs);
  })));
  images.filter(i => i.naturalWidth === 0).forEach(i =>
    found.push(['missing image', i.getAttribute('src') || i.outerHTML.slice(0, 120)]));
  return found;
}
"""

# MathJax 3 typesets after load; its startup promise settles when the page's math is done.
# Raced against a timer: page.evaluate itself has no timeout.
WAIT_MATHJAX_JS = """
async (waitMs) => {
  const mj = window.MathJax;
  const typeset = mj && mj.startup && mj.startup.promise ? mj.startup.promise : null;
  if (!typeset) return 'no math';
  const timer = new Promise(done => setTimeout(() => done('timed out'), waitMs));
  return await Promise.race([typeset.then(() => 'typeset'), timer]);
}
"""
# Jupyter Book's index.html only forwards to the root page with a meta refresh.
META_REFRESH = re.compile(
    r'<meta\s+http-equiv=["\']refresh["\']\s+content=["\']\d+;\s*url=([^"\']+)["\']', re.I
)


class CannotRun(Exception):
    """The check could not start (no browser, no Playwright, no pages): exit status 2."""


@dataclass
class PageResult:
    """What one page showed: errors fail the run, notes are reported only."""

    page: str
    errors: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def find_pages(html_dir: Path) -> list[str]:
    """Every HTML page of the built book, as paths relative to ``html_dir``, sorted.

    Folders whose name starts with "_" (``_static``, ``_sources``, ``_images``) hold assets,
    not pages, and are skipped.
    """
    pages = []
    for path in html_dir.rglob("*.html"):
        rel = path.relative_to(html_dir)
        if any(part.startswith("_") for part in rel.parts[:-1]):
            continue
        pages.append(rel.as_posix())
    return sorted(pages)


def redirect_target(page_file: Path) -> str | None:
    """The page a meta-refresh page forwards to (relative URL), or None for a real page."""
    match = META_REFRESH.search(page_file.read_text(errors="replace")[:2000])
    return match.group(1) if match else None


def find_chromium(explicit: str | None) -> str:
    """Path of the Chromium to drive: ``explicit``, else the first candidate on PATH."""
    if explicit:
        if not Path(explicit).is_file():
            raise CannotRun(f"--chromium: no browser at {explicit}")
        return explicit
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise CannotRun(
        "no Chromium found (looked for " + ", ".join(CHROMIUM_CANDIDATES) + "): "
        "apt-get install -y chromium, or pass --chromium PATH"
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass  # one line per request would bury the report


@contextmanager
def serve(html_dir: Path) -> Iterator[str]:
    """Serve ``html_dir`` on 127.0.0.1 (a free port) while the block runs; yield its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def check_page(
    browser_context, base: str, page_name: str, png: Path, timeout_ms: int
) -> PageResult:
    """Open one page, look for errors, save its full-page screenshot to ``png``."""
    result = PageResult(page_name)
    page = browser_context.new_page()
    broken: list[str] = []

    def on_response(response) -> None:
        if response.url.startswith(base) and response.status >= 400:
            broken.append(f"{response.status} {response.url[len(base) :]}")

    def on_failed(request) -> None:
        if request.url.startswith(base):
            broken.append(f"failed {request.url[len(base) :]}")

    page.on("response", on_response)
    page.on("requestfailed", on_failed)
    try:
        page.goto(base + page_name, wait_until="load", timeout=timeout_ms)
        if page.evaluate(WAIT_MATHJAX_JS, timeout_ms) == "timed out":
            result.errors.append(("math error", f"MathJax did not finish in {timeout_ms} ms"))
        for kind, detail in page.evaluate(FIND_ERRORS_JS, IMAGE_WAIT_MS):
            result.errors.append((kind, detail))
        page.wait_for_load_state("networkidle", timeout=timeout_ms)
        png.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(png), full_page=True, timeout=timeout_ms)
    except Exception as exc:  # a page that cannot be opened or shot is itself a failure
        result.errors.append(("page failed", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"))
    finally:
        page.close()
    result.errors.extend(("broken asset", b) for b in broken)
    return result


def run(
    html_dir: Path, out_dir: Path, chromium: str, only: str, timeout_ms: int
) -> list[PageResult]:
    """Screenshot and check every page under ``html_dir`` whose path contains ``only``."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise CannotRun(
            "playwright is not installed: python3 -m venv .venv-screenshots && "
            ".venv-screenshots/bin/pip install playwright (see this script's docstring)"
        ) from None
    pages = [p for p in find_pages(html_dir) if only in p]
    if not pages:
        raise CannotRun(f"no HTML pages under {html_dir} matching {only!r}: build the book first")
    results = []
    external: dict[str, set[str]] = {}
    with serve(html_dir) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium)
        context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)

        def keep_local(route) -> None:
            url = route.request.url
            if url.startswith(base) or url.startswith("data:"):
                route.continue_()
            else:
                external.setdefault(route.request.frame.url[len(base) :], set()).add(url)
                route.abort()

        context.route("**/*", keep_local)
        for i, name in enumerate(pages, 1):
            target = redirect_target(html_dir / name)
            if target is not None:
                # Nothing to see: check where it leads (that page is checked in its own turn).
                result = PageResult(name, notes=[f"redirects to {target}"])
                if not (html_dir / name).parent.joinpath(target.split("#")[0]).is_file():
                    result.errors.append(("broken redirect", target))
            else:
                png = out_dir / Path(name).with_suffix(".png")
                result = check_page(context, base, name, png, timeout_ms)
            status = f"{len(result.errors)} error(s)" if result.errors else "ok"
            print(f"[{i}/{len(pages)}] {name}: {status}", flush=True)
            results.append(result)
        browser.close()
    for result in results:
        result.notes.extend(
            f"external request blocked: {u}" for u in sorted(external.get(result.page, ()))
        )
    return results


def report(results: list[PageResult]) -> str:
    """The text report: failing pages with what they show, then notes, then a summary."""
    lines = []
    failing = [r for r in results if r.errors]
    for r in failing:
        lines.append(f"FAIL {r.page}")
        lines.extend(f"  {kind}: {detail}" for kind, detail in r.errors)
    for r in results:
        lines.extend(f"note {r.page}: {n}" for n in r.notes)
    lines.append(f"{len(results)} pages, {len(failing)} with errors")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--html", type=Path, default=DEFAULT_HTML, help="the built book (default: %(default)s)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where the PNGs go (default: %(default)s)"
    )
    parser.add_argument(
        "--chromium", help="browser executable (default: chromium or Chrome on PATH)"
    )
    parser.add_argument("--only", default="", help="check only pages whose path contains this")
    parser.add_argument("--timeout-ms", type=int, default=60_000, help="per page load and shot")
    args = parser.parse_args(argv)
    if not (args.html / "index.html").is_file():
        print(
            f"--html: {args.html} has no index.html: build the book first (make book)",
            file=sys.stderr,
        )
        return 2
    if args.timeout_ms <= 0:
        print(f"--timeout-ms must be positive, got {args.timeout_ms}", file=sys.stderr)
        return 2
    try:
        results = run(
            args.html.resolve(),
            args.out.resolve(),
            find_chromium(args.chromium),
            args.only,
            args.timeout_ms,
        )
    except CannotRun as exc:
        print(exc, file=sys.stderr)
        return 2
    text = report(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.txt").write_text(text + "\n")
    print(text)
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
