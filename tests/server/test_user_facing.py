"""What a new user of ``kiln serve`` meets first (issue 23): ``curl -d`` requests and the ``/docs`` page.

- ``curl -d '{"inputs": ...}'`` sends ``Content-Type: application/x-www-form-urlencoded`` unless told
  otherwise, and some clients send ``text/plain`` or nothing: a body that parses as JSON is read as JSON
  under those; one that does not is a 415 naming the Content-Type to send. The binary tensor extension stays
  keyed on its Inference-Header-Content-Length header.
- ``/docs`` (Swagger UI) and ``/redoc`` load their scripts from this server (the fastapi-offline package's
  files), never from a CDN; without that package they say how to install it.

Through the real app: FastAPI's TestClient, a real uvicorn server for real ``curl``, and a real headless
Chromium (driven by playwright, launched with the system's ``chromium``) with every request that leaves the
server aborted, so the page is shown to work offline. Those two skip when curl / playwright or chromium is
missing.
"""
from __future__ import annotations

import importlib.machinery
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

import kiln  # noqa: E402
from kiln.server import app as app_module  # noqa: E402
from kiln.server.app import create_app  # noqa: E402
from kiln.server.repository import ModelConfig, ModelEntry  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
X = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
BODY = json.dumps({"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32", "data": X.ravel().tolist()}]})
INFER = "/v2/models/mlp/infer"


def _app():
    return create_app([ModelEntry("mlp", "1", MLP, ModelConfig(workers=0, max_batch_size=8))])


def _wait_ready(get) -> None:
    deadline = time.monotonic() + 30
    while get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline, "the app did not become ready"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def client():
    with TestClient(_app()) as c:
        _wait_ready(c.get)
        yield c


@pytest.fixture(scope="module")
def want():
    return kiln.load(MLP).run({"x": X})


def _check_outputs(r, want) -> None:
    assert r.status_code == 200, r.text
    got = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)


# ------------------------------------------------------------------------------------- content types
@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain",
                                          "text/plain; charset=utf-8", "application/json", "text/json",
                                          "application/vnd.kiln+json"])
def test_a_json_body_is_read_as_json_under_any_type_that_may_carry_it(client, want, content_type):
    request = client.build_request("POST", INFER, content=BODY.encode(),
                                   headers={} if content_type is None else {"Content-Type": content_type})
    if content_type is None:  # really no Content-Type on the wire
        assert "content-type" not in request.headers
    _check_outputs(client.send(request), want)


@pytest.mark.parametrize("content_type,curl", [("application/x-www-form-urlencoded", True), ("text/plain", False)])
def test_a_body_that_is_not_json_under_a_lenient_type_is_415_naming_what_to_send(client, content_type, curl):
    r = client.post(INFER, content=b"x=0.5&y=1", headers={"Content-Type": content_type})
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert f"content type is '{content_type}'" in error
    assert "Content-Type: application/json" in error and "Inference-Header-Content-Length" in error
    assert ("curl -d" in error) is curl
    assert "malformed JSON" in error  # and the parser's own words


@pytest.mark.parametrize("content_type", ["application/xml", "multipart/form-data; boundary=x", "image/png"])
def test_other_types_are_415_saying_which_type_to_send(client, content_type):
    r = client.post(INFER, content=BODY.encode(), headers={"Content-Type": content_type})
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error.startswith(f"unsupported content type '{content_type.split(';')[0]}'")
    assert "Content-Type: application/json" in error and "application/octet-stream" in error


@pytest.mark.parametrize("content_type", [None, "application/json"])
def test_malformed_json_sent_as_json_stays_400(client, content_type):
    r = client.post(INFER, content=b'{"inputs": [', headers={"Content-Type": content_type} if content_type else {})
    assert r.status_code == 400 and r.json()["error"].startswith("malformed JSON in request")


@pytest.mark.parametrize("content_type", ["application/octet-stream", "application/x-www-form-urlencoded", None])
def test_the_binary_extension_is_keyed_on_its_header_not_the_type(client, want, content_type):
    """``curl --data-binary @req.bin -H 'Inference-Header-Content-Length: N'`` without a type works too."""
    head = json.dumps({"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32",
                                   "parameters": {"binary_data_size": X.nbytes}}]}).encode()
    headers = {"Inference-Header-Content-Length": str(len(head))}
    if content_type:
        headers["Content-Type"] = content_type
    _check_outputs(client.post(INFER, content=head + X.tobytes(), headers=headers), want)


def test_a_binary_body_without_its_header_says_to_send_the_header(client):
    r = client.post(INFER, content=b"\x00\x01binary", headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 400, r.text
    assert "without an Inference-Header-Content-Length header is read as JSON" in r.json()["error"]


# ----------------------------------------------------------------------------------------------- /docs
_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}


def _referenced_urls(page: str) -> list[str]:
    """Every URL an HTML docs page loads: src/href/spec-url attributes and Swagger UI's ``url: '...'``."""
    pattern = r"""(?:src|href|spec-url)=["']([^"']+)["']|\burl:\s*['"]([^'"]+)['"]"""
    return [a or b for a, b in re.findall(pattern, page)]


@pytest.mark.parametrize("page,expected", [
    ("/docs", {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/docs/assets/favicon.png",
               "/openapi.json"}),
    ("/redoc", {"/docs/assets/redoc.standalone.js", "/docs/assets/favicon.png", "/openapi.json"}),
])
def test_docs_pages_load_only_local_files_and_each_is_served(client, page, expected):
    pytest.importorskip("fastapi_offline")
    r = client.get(page, headers={"Accept": "text/html"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?:|//cdn|googleapis", r.text), r.text  # nothing from elsewhere
    urls = set(_referenced_urls(r.text))
    assert urls == expected
    for url in urls:
        asset = client.get(url)
        assert asset.status_code == 200, (url, asset.text[:200])
        assert len(asset.content) > 100, url
        assert asset.headers["content-type"].startswith(_TYPES[Path(url).suffix]), (url, asset.headers)
    assert "SwaggerUIBundle" in client.get("/docs/assets/swagger-ui-bundle.js").text
    assert client.get("/openapi.json").json()["paths"][
        "/v2/models/{model_name}/infer"]["post"]["requestBody"]["content"]


def test_docs_urls_keep_a_proxy_prefix():
    pytest.importorskip("fastapi_offline")
    with TestClient(_app(), root_path="/kiln") as c:
        page = c.get("/docs").text
    assert set(_referenced_urls(page)) == {"/kiln/docs/assets/swagger-ui-bundle.js",
                                           "/kiln/docs/assets/swagger-ui.css", "/kiln/docs/assets/favicon.png",
                                           "/kiln/openapi.json"}


def test_an_unknown_asset_is_404_listing_the_assets(client):
    r = client.get("/docs/assets/../../etc/passwd")
    assert r.status_code == 404
    r = client.get("/docs/assets/jquery.js")
    assert r.status_code == 404 and "swagger-ui-bundle.js" in r.json()["error"]


def test_without_the_assets_package_the_pages_say_how_to_install_it(monkeypatch):
    monkeypatch.setattr(app_module, "docs_assets_dir", lambda: None)
    with TestClient(_app()) as c:
        for page, name in (("/docs", "Swagger UI"), ("/redoc", "ReDoc")):
            r = c.get(page, headers={"Accept": "text/html,application/xhtml+xml"})  # a browser
            assert r.status_code == 501 and r.headers["content-type"].startswith("text/html")
            assert f"the {name} page needs the fastapi-offline package" in r.text
            assert "pip install &#x27;kiln-compiler[serve]&#x27;" in r.text
            assert not re.search(r"https?:|<script|<link", r.text)  # no CDN fallback, nothing loaded
            r = c.get(page)  # a script: {"error"} as every other error
            assert r.status_code == 501 and "pip install 'kiln-compiler[serve]'" in r.json()["error"]
        r = c.get("/docs/assets/swagger-ui.css")
        assert r.status_code == 404 and "fastapi-offline" in r.json()["error"]
        assert c.get("/openapi.json").status_code == 200


def test_docs_assets_dir_needs_every_file(monkeypatch, tmp_path):
    package = tmp_path / "fastapi_offline"
    (package / "static").mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("fastapi_offline", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(app_module.importlib.util, "find_spec", lambda name: spec)
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        (package / "static" / name).write_text("x")
    assert app_module.docs_assets_dir() is None  # favicon.png missing
    (package / "static" / "favicon.png").write_bytes(b"x")
    assert app_module.docs_assets_dir() == package / "static"
    monkeypatch.setattr(app_module.importlib.util, "find_spec", lambda name: None)
    assert app_module.docs_assets_dir() is None


# -------------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def live_url():
    """The app under a real uvicorn on 127.0.0.1 (a thread of this process)."""
    uvicorn = pytest.importorskip("uvicorn")
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        _wait_ready(lambda path: httpx.get(url + path))
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _curl(*args: str) -> tuple[int, dict]:
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    body, _, code = out.rpartition("\n")
    return int(code), json.loads(body)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_real_curl_d(live_url, want, tmp_path):
    """The exact commands of the issue: ``curl -d`` with a JSON body (inline and ``@file``) and no -H."""
    code, body = _curl("-d", BODY, f"{live_url}{INFER}")
    assert code == 200, body
    assert [o["name"] for o in body["outputs"]] == list(want)
    np.testing.assert_array_equal(np.array(body["outputs"][0]["data"], np.float32).reshape(2, 4),
                                  want[body["outputs"][0]["name"]])
    request = tmp_path / "request.json"
    request.write_text(json.dumps(json.loads(BODY), indent=2))  # newlines: curl -d @file strips them
    code, body = _curl("-d", f"@{request}", f"{live_url}{INFER}")
    assert code == 200, body
    code, body = _curl("-d", "x=0.5", f"{live_url}{INFER}")
    assert code == 415 and "curl -d" in body["error"] and "Content-Type: application/json" in body["error"]


def test_docs_work_offline_in_a_real_browser(live_url):
    """Swagger UI and ReDoc render every operation in headless Chromium while every request that leaves the
    server is aborted; Swagger UI makes none at all and logs no console error."""
    pytest.importorskip("fastapi_offline")
    playwright = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            outside, errors = [], []
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(live_url + "/")
                       else (outside.append((route.request.resource_type, route.request.url)), route.abort()))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(live_url + "/docs")
            page.wait_for_selector(".opblock-summary-path", timeout=30_000)
            paths = set(page.locator(".opblock-summary-path").all_inner_texts())
            assert {"/v2/models/{model_name}/infer", "/v2/health/ready", "/metrics"} <= {s.strip() for s in paths}
            assert page.title() == "kiln serve - Swagger UI"
            assert outside == [] and errors == [], (outside, errors)

            page.goto(live_url + "/redoc")
            page.wait_for_selector("[data-section-id]", timeout=30_000)
            assert page.title() == "kiln serve - ReDoc"
            assert page.get_by_text("Run inference").count() >= 2  # both infer routes, rendered from the spec
            # ReDoc's sidebar credit shows Redocly's logo from their CDN when it can, and hides it otherwise:
            # an image, never a script, style or font.
            assert all(kind == "image" for kind, _ in outside), outside
        finally:
            browser.close()
