"""The documentation site (docs/, mkdocs.yml) and the README: built, run and opened as a reader would.

* `mkdocs build --strict` passes (a broken link or anchor between pages is a warning, so a failure).
* Every fenced code block carries a marker on the line before it: `<!-- docs: run -->` (run here) or
  `<!-- docs: illustrative (why) -->` (not run: a GPU, a hub model, your own paths, a long benchmark).
* The `run` blocks (bash, Python) run as written against a real server (tests/support/server.py) that
  serves what the pages name: the bundled model, `my-reranker`, `sentiment`; the documented ports are
  replaced by the server's own.
* Every page of the built site, served on loopback, is opened in headless Chromium (Debian's
  `chromium`): a page without content, a link to a missing page or file, or a missing anchor fails.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest
from support.browser import chromium_command, find_chromium
from support.server import ServerProcess

from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!-- docs: (?P<kind>run|illustrative \(.+\)) -->\s*$")
RUNNERS = {"bash": "bash", "python": "python"}
# The ports the pages use, and what the test server listens on instead (see `served`).
DOC_PORTS = {"50051": "grpc_port", "7997": "rest_port", "9400": "metrics_port"}
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    marker: str  # "run", "illustrative (...)", or "" when none
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the marker on the line before it (if any)."""
    lines = path.read_text().splitlines()
    blocks, number = [], 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if not opening:
            number += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        end = next(
            (i for i in range(number + 1, len(lines)) if lines[i].strip() == fence),
            None,
        )
        assert end is not None, f"{path}:{number + 1}: a code block that never closes"
        previous = MARKER.match(lines[number - 1]) if number else None
        code = "\n".join(line[indent:] for line in lines[number + 1 : end]) + "\n"
        blocks.append(Block(path, number + 1, opening["lang"], previous["kind"] if previous else "", code))
        number = end + 1
    return blocks


ALL_BLOCKS = [block for page in [*PAGES, ROOT / "README.md"] for block in code_blocks(page)]
RUN_BLOCKS = [block for block in ALL_BLOCKS if block.marker == "run"]


def test_every_code_block_is_run_or_marked_illustrative():
    assert PAGES, "docs/ holds no pages"
    unmarked = [block.name for block in ALL_BLOCKS if not block.marker]
    assert not unmarked, f"code blocks without <!-- docs: run --> or <!-- docs: illustrative (why) -->: {unmarked}"
    unrunnable = [f"{block.name} ({block.lang or 'no language'})" for block in RUN_BLOCKS if block.lang not in RUNNERS]
    assert not unrunnable, f"blocks marked run in a language the test cannot run: {unrunnable}"
    assert RUN_BLOCKS, "no block is run: the marker convention is not being followed"


def test_the_readme_stays_an_introduction():
    """What it is, the two commands, one client example, links: the rest belongs on the site's pages."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into docs/"
    assert "docs/index.md" in "\n".join(lines)


def test_a_marker_always_sits_on_a_code_block():
    """A marker whose block moved away would leave a block unrun while the test still passed."""
    for page in [*PAGES, ROOT / "README.md"]:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if MARKER.match(line):
                following = lines[number + 1] if number + 1 < len(lines) else ""
                assert FENCE.match(following), f"{page.relative_to(ROOT)}:{number + 1}: a marker with no block after it"


# ------------------------------------------------------------------ the run blocks, on a real server
@pytest.fixture(scope="module")
def served(tmp_path_factory, reranker_path, classifier_path):
    """The server the pages' examples talk to, REST included."""
    log = tmp_path_factory.mktemp("docs-server") / "server.log"
    server = ServerProcess(
        "--model",
        f"{DEFAULT_MODEL_NAME}={default_model_path()}",
        "--model",
        f"my-reranker={reranker_path}",
        "--model",
        f"sentiment={classifier_path}",
        rest=True,
        log_path=log,
    )
    server.start()
    yield server
    assert server.stop() == 0, server.log_text()


def localized(code: str, server: ServerProcess) -> str:
    """The block with the documented host:port pairs moved to the test server's ports."""
    for port, attribute in DOC_PORTS.items():
        code = re.sub(rf"\b(?:localhost|127\.0\.0\.1):{port}\b", f"127.0.0.1:{getattr(server, attribute)}", code)
    return code


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda block: block.name)
def test_run_blocks_work_as_written(block, served, tmp_path):
    script = tmp_path / ("snippet.sh" if block.lang == "bash" else "snippet.py")
    script.write_text(localized(block.code, served))
    command = ["bash", "-euo", "pipefail", str(script)] if block.lang == "bash" else [sys.executable, str(script)]
    # Loopback calls must not go through a proxy from the environment (curl and httpx both read it).
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{output[-4000:]}"
    if block.lang == "bash":
        assert '"error"' not in done.stdout, f"{block.name}: a REST call answered an error:\n{done.stdout[-4000:]}"
    assert done.stdout.strip(), f"{block.name} printed nothing"


# ------------------------------------------------------------------ the built site
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stderr[-4000:]}"
    return out


def test_the_site_builds_with_every_page(site):
    built = {p.relative_to(site).parent for p in site.rglob("index.html")}
    for page in PAGES:
        name = page.relative_to(ROOT / "docs").with_suffix("")
        want = Path(".") if name == Path("index") else name
        assert want in built, f"{page.relative_to(ROOT)} has no page in the built site"


class _Page(HTMLParser):
    """What a rendered page holds: its ids, its links and sources, and the text of its article."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.article_text: list[str] = []
        self._article_depth = 0

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        if tag == "a" and values.get("name"):
            self.ids.add(values["name"])
        for attribute in ("href", "src"):
            if values.get(attribute) and tag in ("a", "img", "link", "script"):
                self.links.append(values[attribute])
        if tag == "article" or self._article_depth:
            self._article_depth += 1

    def handle_endtag(self, tag):
        if self._article_depth:
            self._article_depth -= 1

    def handle_data(self, data):
        if self._article_depth:
            self.article_text.append(data)


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if not found:
        pytest.skip("no chromium (Debian package chromium; .ci/run installs it)")
    return found


@pytest.fixture(scope="module")
def site_url(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def rendered(chromium: str, url: str, profile: Path) -> _Page:
    """The page's DOM after Chromium has loaded it and run its scripts."""
    done = subprocess.run(
        chromium_command(chromium, profile, "--dump-dom", url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "<html" in done.stdout, f"chromium could not open {url}: {done.stderr[-2000:]}"
    page = _Page()
    page.feed(done.stdout)
    return page


def status(url: str) -> int:
    try:
        with _DIRECT.open(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_every_page_renders_in_chromium_with_working_links(site, site_url, chromium, tmp_path):
    pages = sorted(p.relative_to(site).parent for p in site.rglob("index.html"))
    assert len(pages) == len(PAGES)
    profile = tmp_path / "chromium-profile"  # a profile of its own: nothing of the host's browser
    dom: dict[str, _Page] = {}

    def page_at(url: str) -> _Page:
        if url not in dom:
            dom[url] = rendered(chromium, url, profile)
        return dom[url]

    problems = []
    for relative in pages:
        url = urljoin(site_url, f"{relative.as_posix()}/" if str(relative) != "." else "")
        page = page_at(url)
        words = " ".join("".join(page.article_text).split())
        if len(words) < 200:
            problems.append(f"{url}: an empty page ({len(words)} characters of content)")
        for link in page.links:
            target = urljoin(url, link)
            if urlparse(target).netloc != urlparse(site_url).netloc or urlparse(target).scheme not in ("http", "https"):
                continue  # another site (no network here) or a mailto:/data: link
            address, fragment = urldefrag(target)
            code = status(address)
            if code != 200:
                problems.append(f"{url}: {link} -> HTTP {code}")
            elif fragment and address.endswith("/") and fragment not in page_at(address).ids:
                problems.append(f"{url}: {link} -> no element with id {fragment!r}")
    assert not problems, "\n".join(problems)
