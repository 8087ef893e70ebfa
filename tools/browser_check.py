"""Open every page of the built site in headless Chromium and check what a reader would see.

Serves _build/site/_build/html on 127.0.0.1 (a free port, in a thread), drives Debian's
/usr/bin/chromium through /usr/bin/chromedriver with selenium, and fails a page when
- it is missing (not HTTP 200),
- it shows a Python traceback (the text "Traceback (most recent call last)", or an error output),
- an <img> did not load (naturalWidth == 0), or
- its chapter promises a picture (its notebook calls savefig or refers to images/) and shows
  none, or
- a code block (a cell's code, its output, or code in the prose) scrolls sideways at the 1280-pixel
  window (the hidden end of a line is usually the comment that explains it), or a 100-character
  line would not fit in a code cell.
Saves a screenshot of each page in screenshots/ (ignored by git), prints one line per page and
a closing 'N passed, N failed' line; exits non-zero when a page failed or no page was checked.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_site import SITE_HTML  # noqa: E402
from nbtools import (ROOT, book_notebooks, book_view, promises_picture,  # noqa: E402
                     read_nb)

CHROMIUM, CHROMEDRIVER = '/usr/bin/chromium', '/usr/bin/chromedriver'
FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync',
         '--disable-dev-shm-usage', '--window-size=1280,1000']
SHOTS = ROOT / 'screenshots'

# Images of the page's content (not the theme's logo), forced to load now rather than lazily.
_IMAGES_JS = """
const imgs = Array.from(document.querySelectorAll('img'))
  .filter(i => !i.closest('.navbar-brand, .logo, .bd-header, .bd-sidebar-primary'));
imgs.forEach(i => { i.loading = 'eager'; });
return imgs.map(i => ({src: i.getAttribute('src') || '', complete: i.complete,
                      width: i.naturalWidth}));
"""
# The page's code blocks (cells' code and outputs, code in the prose): how many, the longest line
# of each that scrolls sideways, and whether a 100-character line fits in a cell's code box (a
# copy of the first one, measured and removed), the width the book's code is written to.
_CODE_BLOCKS_JS = """
const pres = Array.from(document.querySelectorAll('.bd-article pre'));
const longest = p => p.textContent.split('\\n').reduce((a, b) => b.length > a.length ? b : a, '');
const wide = pres.filter(p => p.scrollWidth > p.clientWidth + 1).map(longest);
const cell = document.querySelector('.bd-article div.cell_input pre');
let fits = null;
if (cell) {
  const probe = cell.cloneNode(false);
  probe.textContent = 'x'.repeat(100);
  cell.parentNode.appendChild(probe);
  fits = probe.scrollWidth <= probe.clientWidth + 1;
  probe.remove();
}
return {count: pres.length, wide: wide, fits100: fits};
"""
_TRACEBACK_JS = ("return document.querySelectorAll("
                 "'.output.traceback, .output.error, div.traceback').length")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """A browser dropping a connection it no longer needs is not worth a traceback."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve `folder` on 127.0.0.1 at a free port in a daemon thread; the server and its URL."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = _Server(('127.0.0.1', 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f'http://127.0.0.1:{server.server_address[1]}'


def browser(profile: str):
    """Headless Debian Chromium driven by Debian's chromedriver (no driver download)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS + [f'--user-data-dir={profile}']:
        opts.add_argument(f)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    return driver


def http_status(url: str) -> int:
    """The HTTP status of `url` (404 and friends included)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def check_page(driver, base: str, nb_path: Path) -> tuple[list[str], str]:
    """Problems on one page (empty when it passes) and a short description of what it showed."""
    url = f'{base}/nbs/{nb_path.stem}.html'
    status = http_status(url)
    if status != 200:
        return [f'page missing (HTTP {status})'], ''
    driver.get(url)
    deadline = time.time() + 20
    while True:  # wait until every image has finished loading (or failed to)
        imgs = driver.execute_script(_IMAGES_JS)
        if all(i['complete'] for i in imgs) or time.time() > deadline:
            break
        time.sleep(0.2)
    problems = []
    text = driver.find_element('tag name', 'body').text
    if 'Traceback (most recent call last)' in text or driver.execute_script(_TRACEBACK_JS):
        problems.append('shows a Python traceback')
    nb = read_nb(nb_path)
    errors = [o.get('ename') for c in nb['cells'] for o in c.get('outputs', [])
              if o.get('output_type') == 'error']
    if errors:
        problems.append(f'a saved output is an error ({", ".join(map(str, errors))})')
    broken = [i['src'] for i in imgs if i['width'] == 0]
    if broken:
        problems.append(f'{len(broken)} image(s) did not load: {", ".join(broken[:5])}')
    shown = sum(1 for i in imgs if i['width'] > 0)
    if promises_picture(nb) and shown == 0:
        problems.append('the chapter draws a picture (savefig or images/) but the page shows none')
    code = driver.execute_script(_CODE_BLOCKS_JS)
    if code['wide']:
        problems.append(f"{len(code['wide'])} code block(s) scroll sideways, "
                        f"the first at: {code['wide'][0][:60]!r}…")
    if code['fits100'] is False:
        problems.append('a 100-character line does not fit in a code cell at 1280 pixels')
    shown_cells = book_view(nb)['cells']    # what the reader sees: hidden cells dropped
    has_code = any(c['cell_type'] == 'code' and c['source'].strip() for c in shown_cells)
    if has_code and code['fits100'] is None:
        problems.append('its notebook has code but the page shows no code cell')
    if len(text.strip()) < 20:
        problems.append('the page is (nearly) empty')
    height = driver.execute_script('return document.documentElement.scrollHeight')
    driver.set_window_size(1280, max(800, min(int(height), 12000)))
    SHOTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(SHOTS / f'{nb_path.stem}.png'))
    driver.set_window_size(1280, 1000)
    return problems, f'{shown} image(s)'


def main(argv=None) -> int:
    """Check every page of the book; non-zero when one fails or none was checked."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--site', type=Path, default=SITE_HTML, help='the built HTML folder')
    args = ap.parse_args(argv)
    for exe, pkg in ((CHROMIUM, 'chromium'), (CHROMEDRIVER, 'chromium-driver')):
        if not Path(exe).exists():
            print(f'{exe} is missing: `apt-get install {pkg}` (or `make debian-packages`)',
                  file=sys.stderr)
            return 1
    if not (args.site / 'nbs' / 'index.html').exists():
        print(f'no site in {args.site}: run `make site` first', file=sys.stderr)
        return 1
    pages = book_notebooks()
    server, base = serve(args.site)
    profile = tempfile.mkdtemp(prefix='petite-chromium-')
    passed = failed = 0
    try:
        driver = browser(profile)
        try:
            for nb in pages:
                t0 = time.time()
                try:
                    problems, what = check_page(driver, base, nb)
                # a page that hangs or crashes the renderer is a failure, not a crash
                except Exception as e:
                    why = f'could not be checked: {type(e).__name__}: {e}'.splitlines()[0]
                    problems, what = [why], ''
                took = f'{time.time() - t0:.1f}s'
                if problems:
                    failed += 1
                    print(f'FAIL nbs/{nb.stem}.html ({took}): ' + '; '.join(problems), flush=True)
                else:
                    passed += 1
                    print(f'ok   nbs/{nb.stem}.html ({what}, {took})', flush=True)
        finally:
            driver.quit()
    finally:
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    if passed + failed == 0:
        print('no page was checked: that is a failure')
    print(f'screenshots in {SHOTS.relative_to(ROOT)}/')
    print(f'{passed} passed, {failed} failed')
    return 1 if failed or not passed else 0


if __name__ == '__main__':
    sys.exit(main())
