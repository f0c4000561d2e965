"""Issue 44: browser SDKs call the REST API from a page of an allowed origin. openai-node sends
`x-stainless-*` headers and cohere-ts `x-fern-*` ones; the CORS preflight answered a fixed
Allow-Headers list, so a browser refused the call before it was made. A real page in headless
Chromium does the fetch() those SDKs do, through the real Envoy to the real server."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from support.browser import chromium_command, find_chromium
from support.server import ServerProcess

from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME

KEY = "browser-key"
# What the SDKs add to every call (their names; the values are theirs in spirit).
SDK_HEADERS = {
    "authorization": f"Bearer {KEY}",
    "content-type": "application/json",
    "x-stainless-lang": "js",
    "x-stainless-os": "Linux",
    "x-stainless-package-version": "4.104.0",
    "x-stainless-retry-count": "0",
    "x-fern-language": "JavaScript",
    "x-fern-sdk-name": "cohere-ai",
    "x-fern-sdk-version": "7.17.1",
}
PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>sdk page</title></head><body><script>
const report = (result) => fetch("/result", {method: "POST", body: JSON.stringify(result)});
fetch(API + "/v1/embeddings", {method: "POST", headers: HEADERS, body: JSON.stringify(BODY)})
  .then(async (response) => report({
    status: response.status, body: await response.json(), requestId: response.headers.get("x-request-id"),
    serverTiming: response.headers.get("server-timing")}))
  .catch((error) => report({error: String(error)}));
</script></body></html>"""


class _Page:
    """A page origin on its own loopback port: GET / is the SDK page, POST /result its report."""

    def __init__(self):
        self.html = b""
        self.result: dict | None = None
        self.reported = threading.Event()
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("content-type", "text/html; charset=utf-8")
                self.send_header("content-length", str(len(page.html)))
                self.end_headers()
                self.wfile.write(page.html)

            def do_POST(self):
                page.result = json.loads(self.rfile.read(int(self.headers["content-length"])))
                self.send_response(204)
                self.end_headers()
                page.reported.set()

            def log_message(self, *args):  # the test's output is its assertions
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def visit(self, api_url: str, tmp: Path, timeout: float = 120) -> dict:
        """Load the page in a fresh headless Chromium; its report once the fetch settled."""
        script = (
            f"const API = {json.dumps(api_url)}; const HEADERS = {json.dumps(SDK_HEADERS)};"
            f" const BODY = {json.dumps({'model': DEFAULT_MODEL_NAME, 'input': ['a page embeds this']})};"
        )
        self.html = PAGE.replace("<script>", "<script>" + script, 1).encode()
        self.result = None
        self.reported.clear()
        profile = tmp / f"profile-{self.server.server_address[1]}"
        log = tmp / f"chromium-{self.server.server_address[1]}.log"
        with log.open("wb") as out:
            browser = subprocess.Popen(
                chromium_command(_chromium(), profile, self.origin + "/"),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            assert self.reported.wait(timeout), f"the page never reported: {log.read_text()[-3000:]}"
        finally:
            browser.terminate()
            browser.wait(timeout=30)
        assert self.result is not None
        return self.result

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _chromium() -> str:
    path = find_chromium()
    if not path:
        pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
    return path


@pytest.fixture(scope="module")
def pages():
    allowed, other = _Page(), _Page()
    yield allowed, other
    allowed.close()
    other.close()


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory, pages):
    allowed, _ = pages
    log = tmp_path_factory.mktemp("browser") / "server.log"
    args = ("--cpu-threads", "1", "--api-key", KEY, "--cors-allow-origin", allowed.origin)
    with ServerProcess(*args, rest=True, log_path=log) as server:
        yield server


def test_sdk_headers_pass_the_preflight_of_an_allowed_origin(cors_server, pages, tmp_path, minilm_path):
    """The page of the allowed origin gets its embedding, as sentence-transformers computes it, and
    reads the exposed x-request-id and Server-Timing; the page of another origin is refused by the browser (no CORS
    headers for it), its call never made."""
    from sentence_transformers import SentenceTransformer

    allowed, other = pages
    result = allowed.visit(cors_server.rest_url, tmp_path)
    assert result.get("status") == 200, result
    want = SentenceTransformer(minilm_path, device="cpu").encode(["a page embeds this"])
    np.testing.assert_allclose(result["body"]["data"][0]["embedding"], want[0], atol=1e-5)
    assert result["requestId"]
    assert "compute;dur=" in result["serverTiming"], result
    refused = other.visit(cors_server.rest_url, tmp_path)
    assert "error" in refused and "Failed to fetch" in refused["error"], refused
