"""The server's attack suite (issue 16), kept in the repository: reusable by the tests and runnable long.

Three attacks, each against a real ``kiln serve`` process on 127.0.0.1 and each reporting what must hold:

- ``matrix``: the bad-input matrix, ~150 requests (malformed HTTP, malformed JSON, wrong types, huge,
  negative and NaN parameters, wrong shapes and datatypes, binary-data header mismatches, oversize and
  compressed bodies, unknown models and versions, bad content types and methods), plus control requests
  whose answers are checked against ``Program.run``. Holds: every bad request gets a 4xx with a JSON
  ``{"error": str}`` body (a model that fails at run time: a JSON 500 naming the node), never a plain-text
  answer, never a wrong 200; the server keeps serving; its memory stays bounded.
- ``slow``: thousands of slow connections (half a request head trickled a byte every 2 s, a body
  trickled likewise, or nothing at all) from many source addresses (127.0.x.y), re-opened as the server
  closes them, while probes make real inference requests on fresh connections. Holds: every probe is
  answered 200, promptly; the server's descriptors stay under its limit.
- ``kill-worker``: every worker process SIGKILLed while clients send batched requests back to back.
  Holds: each request is answered, 200 equal to ``Program.run`` on that request alone, or a JSON 500
  naming the dead worker (or 503 while its replacement starts); none lost, no wrong 200; then the
  replacement serves.
- ``sigterm``: runs under load (clients on keep-alive connections sending requests back to back), a
  SIGTERM in the middle. Holds: every request that reached the server is answered (200, or 503 once the
  drain began); the others were refused at connect; exit status 0.

Commands (the long versions; the tests in tests/server/test_attacks.py run short ones)::

    python -m kiln.server.attacks matrix
    python -m kiln.server.attacks slow --connections 20000 --hold-s 60
    python -m kiln.server.attacks sigterm --runs 10
    python -m kiln.server.attacks kill-worker --runs 5

Each prints one JSON line of results last (for bench/RESULTS.md). No torch; models are built here.
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

KILN = [sys.executable, "-m", "kiln"]


# ---------------------------------------------------------------------------------------------- models
def make_repository(root: Path) -> Path:
    """A model repository: ``mlp`` (float32[batch,16] -> logits/probs... here y), ``bf16`` (a bfloat16
    output), ``raiser`` (a Reshape that fails at run time on a shape the request gives), ``ints``."""
    from kiln.ir import Graph
    from kiln.serializer import save as save_file

    def save(g, name: str, config: Optional[dict] = None) -> None:
        path = root / name / "1" / "model.kiln"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(g, path)
        if config is not None:
            (root / name / "config.json").write_text(json.dumps(config))

    rng = np.random.default_rng(0)
    g = Graph("mlp")
    h = g.add_input("x", "float32", ("batch", 16))
    h = g.op("Relu", g.op("Gemm", h, g.add_initializer("w0", rng.standard_normal((8, 16)).astype(np.float32)),
                          g.add_initializer("b0", rng.standard_normal(8).astype(np.float32)), transB=1))
    g.outputs = [g.op("Gemm", h, g.add_initializer("w1", rng.standard_normal((3, 8)).astype(np.float32)),
                      g.add_initializer("b1", np.zeros(3, np.float32)), transB=1, name="y")]
    save(g, "mlp")
    g = Graph("bf16")
    x = g.add_input("x", "float32", ("batch", 4))
    g.outputs = [g.op("Cast", x, to=16, name="y")]  # 16: bfloat16
    save(g, "bf16")
    g = Graph("raiser")
    x = g.add_input("x", "float32", ("batch", 4))
    s = g.add_input("s", "int64", (2,))
    g.outputs = [g.op("Reshape", x, s, name="y")]
    save(g, "raiser", {"max_batch_size": 0})
    g = Graph("ints")
    x = g.add_input("x", "int32", (2, 2))
    g.outputs = [g.op("Mul", x, g.add_initializer("k", np.array(3, np.int32)), name="y")]
    save(g, "ints")
    return root


# ---------------------------------------------------------------------------------------------- server
class ServeProcess:
    """A ``kiln serve`` process on 127.0.0.1 (a free port); ``nofile`` sets its RLIMIT_NOFILE (soft and
    hard) before it starts, as a container's limit would."""

    def __init__(self, args: list[str], *, nofile: Optional[int] = None, ready_timeout: float = 120.0,
                 env: Optional[dict] = None, nice: int = 0):
        def limit() -> None:  # runs in the child before exec
            if nofile is not None:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
            if nice:
                try:
                    os.nice(nice)
                except OSError:  # a negative nice needs privileges: run at the default priority
                    pass

        self.proc = subprocess.Popen(KILN + ["serve", *args, "--host", "127.0.0.1", "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"),
                                     preexec_fn=limit if nofile is not None or nice else None)
        self.output: list[str] = []
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        m = self.wait_for(r"ready at (http://127\.0\.0\.1:(\d+))", ready_timeout)
        self.url, self.port = m.group(1), int(m.group(2))
        self.wait_for(r"docs at", 10)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{''.join(self.output)}")
            if line is None:
                raise AssertionError(f"kiln serve exited ({self.proc.wait()}):\n{''.join(self.output)}")
            m = re.search(pattern, line)
            if m:
                return m

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def metric(self, series: str) -> float:
        status, _, body = request("127.0.0.1", self.port, "GET", "/metrics")
        m = re.search("^" + re.escape(series) + r" (\S+)$", body.decode(), re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"kiln serve did not exit {timeout} s after SIGTERM:\n{''.join(self.output)}")


# ---------------------------------------------------------------------------------------------- raw HTTP
def request(host: str, port: int, method: str, path: str, body: bytes = b"", headers: Optional[dict] = None,
            *, raw: Optional[bytes] = None, timeout: float = 30.0, source: Optional[str] = None):
    """One request on a fresh connection (``Connection: close``), or the bytes ``raw`` as they are.
    Returns ``(status, headers, body)``; status 0 when the connection closed without a response."""
    if raw is None:
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
        hdrs = {"Content-Length": str(len(body))} if (body or method in ("POST", "PUT")) else {}
        hdrs.update(headers or {})
        lines += [f"{k}: {v}" for k, v in hdrs.items() if v is not None]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    with socket.create_connection((host, port), timeout=timeout,
                                  source_address=(source, 0) if source else None) as s:
        try:
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed: read what it sent
        chunks = []
        try:
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return parse_response(b"".join(chunks))


def parse_response(data: bytes):
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return 0, {}, data
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return 0, {}, data
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    elif "content-length" in headers:
        body = body[:int(headers["content-length"])]
    return status, headers, body


# ---------------------------------------------------------------------------------------------- matrix
@dataclass
class Case:
    name: str
    method: str = "POST"
    path: str = "/v2/models/mlp/infer"
    body: bytes = b""
    headers: dict = field(default_factory=dict)
    raw: Optional[bytes] = None
    expect: tuple = (400,)  # acceptable statuses
    says: str = ""  # a substring of the error message, when it matters


def _inp(shape, data=None, datatype="FP32", name="x", **extra):
    item = {"name": name, "shape": shape, "datatype": datatype}
    if data is not None:
        item["data"] = data
    item.update(extra)
    return item


def _req(*inputs, **extra) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def bad_input_cases(max_body: int = 1 << 20) -> list[Case]:
    """The bad-input matrix against the repository of :func:`make_repository` served with
    ``--max-body-mb`` = ``max_body`` / 2**20."""
    x16 = [0.5] * 16
    good = _inp([1, 16], x16)
    cases: list[Case] = []
    add = cases.append
    # -- malformed JSON
    for i, body in enumerate([b"{", b"[", b"nul", b'{"inputs": [}', b"\xff\xfe{}", b'{"inputs": [1,]}', b"{'a': 1}",
                              b"[" * 100_000 + b"]" * 100_000, b'{"inputs": "\xed\xa0\x80"}', b"\x00" * 64,
                              b'{"inputs": []} trailing', b"\xef\xbb\xbf" + _req(good), b"   ", b"1e999999"]):
        add(Case(f"malformed json {i}", body=body))
    add(Case("empty body", body=b""))
    # -- wrong types at the top
    for i, body in enumerate([b"[]", b"1", b'"x"', b"null", b"true", b'{"inputs": {}}', b'{"inputs": null}',
                              b'{"inputs": 1}', b'{"id": 5, "inputs": []}', b'{"parameters": [], "inputs": []}',
                              b'{"outputs": {}, "inputs": []}', b'{"outputs": [1], "inputs": []}',
                              b'{"inputs": [1]}', b'{"inputs": [[]]}', b'{"inputs": [null]}']):
        add(Case(f"wrong type {i}", body=body))
    add(Case("no inputs", body=b"{}"))
    # -- parameters: huge, negative, NaN, wrong types
    big = 10 ** 400
    for name, params in [("timeout_ms 1e400 digits", '{"timeout_ms": 1' + "0" * 400 + "}"),
                         ("timeout_ms -1", '{"timeout_ms": -1}'), ("timeout_ms 0", '{"timeout_ms": 0}'),
                         ("timeout_ms NaN", '{"timeout_ms": NaN}'), ("timeout_ms Infinity", '{"timeout_ms": Infinity}'),
                         ("timeout_ms -Infinity", '{"timeout_ms": -Infinity}'),
                         ("timeout_ms 1e308*10", '{"timeout_ms": 1e309}'), ("timeout_ms string", '{"timeout_ms": "5"}'),
                         ("timeout_ms bool", '{"timeout_ms": true}'), ("timeout_ms list", '{"timeout_ms": [1]}'),
                         ("timeout_ms 2**60", '{"timeout_ms": %d}' % 2 ** 60),
                         ("timeout -1", '{"timeout": -1}'), ("timeout 2**64", '{"timeout": %d}' % 2 ** 64),
                         ("timeout huge", '{"timeout": %d}' % big), ("timeout float", '{"timeout": 1.5}'),
                         ("timeout NaN", '{"timeout": NaN}'), ("timeout string", '{"timeout": "1"}'),
                         ("binary_data_output string", '{"binary_data_output": "yes"}'),
                         ("binary_data_output 1", '{"binary_data_output": 1}'),
                         ("binary_data_output null-ish", '{"binary_data_output": []}')]:
        add(Case(f"parameter {name}", body=b'{"parameters": ' + params.encode() + b', "inputs": '
                 + json.dumps([good]).encode() + b"}"))
    for name, params in [("binary_data string", {"binary_data": "x"}), ("binary_data 1", {"binary_data": 1}),
                         ("classification", {"classification": 2}), ("shared memory", {"shared_memory_region": "r"})]:
        add(Case(f"output parameter {name}", body=_req(good, outputs=[{"name": "y", "parameters": params}])))
    add(Case("unknown output", body=_req(good, outputs=[{"name": "nope"}])))
    add(Case("output twice", body=_req(good, outputs=[{"name": "y"}, {"name": "y"}])))
    add(Case("output without name", body=_req(good, outputs=[{"parameters": {}}])))
    # -- inputs: names, shapes, datatypes, data
    bad_inputs = [
        ("no name", {"shape": [1, 16], "datatype": "FP32", "data": x16}),
        ("empty name", _inp([1, 16], x16, name="")), ("name number", _inp([1, 16], x16, name=5)),
        ("unknown input", _inp([1, 16], x16, name="z")), ("no shape", {"name": "x", "datatype": "FP32", "data": x16}),
        ("shape string", _inp("1,16", x16)), ("shape negative", _inp([-1, 16], x16)),
        ("shape float", _inp([1.0, 16], x16)), ("shape bool", _inp([True, 16], x16)),
        ("shape nested", _inp([[1], 16], x16)), ("shape huge", _inp([2 ** 62, 16], x16)),
        ("shape 1e400-digit dim", _inp([big, 16], x16)), ("shape rank 40", _inp([1] * 40, [0.5])),
        ("shape zero-size huge", _inp([0, 2 ** 62], [])), ("wrong rank", _inp([16], x16)),
        ("wrong width", _inp([1, 15], [0.5] * 15)), ("too few values", _inp([1, 16], [0.5] * 15)),
        ("too many values", _inp([1, 16], [0.5] * 17)), ("ragged", _inp([2, 16], [x16, [0.5] * 15])),
        ("nested wrong", _inp([2, 16], [[0.5] * 2] * 16)), ("data scalar", _inp([1, 16], 0.5)),
        ("data string", _inp([1, 16], ["a"] * 16)), ("data null", _inp([1, 16], [None] * 16)),
        ("data bool", _inp([1, 16], [True] * 16)), ("data object", _inp([1, 16], [{}] * 16)),
        ("data overflow fp32", _inp([1, 16], [1e39] * 16)), ("data 1e400-digit int", _inp([1, 16], [big] * 16)),
        ("no data", _inp([1, 16])), ("datatype unknown", _inp([1, 16], x16, "FLOAT")),
        ("datatype lowercase", _inp([1, 16], x16, "fp32")), ("datatype BYTES", _inp([1, 16], ["a"] * 16, "BYTES")),
        ("datatype number", _inp([1, 16], x16, 3)), ("wrong datatype INT32", _inp([1, 16], [1] * 16, "INT32")),
        ("wrong datatype FP64", _inp([1, 16], x16, "FP64")), ("wrong datatype BF16", _inp([1, 16], x16, "BF16")),
        ("input parameters list", _inp([1, 16], x16, parameters=[])),
        ("input shared memory", _inp([1, 16], x16, parameters={"shared_memory_region": "r"})),
    ]
    for name, item in bad_inputs:
        add(Case(f"input {name}", body=_req(item), expect=(400, 413)))
    add(Case("input twice", body=_req(good, good)))
    add(Case("1000 unknown inputs", body=_req(*[_inp([1], [0.0], name=f"i{i}") for i in range(1000)])))
    add(Case("ints out of range", path="/v2/models/ints/infer", body=_req(_inp([2, 2], [2 ** 31] * 4, "INT32"))))
    add(Case("ints float data", path="/v2/models/ints/infer", body=_req(_inp([2, 2], [1.5] * 4, "INT32"))))
    add(Case("ints 1.0 data", path="/v2/models/ints/infer", body=_req(_inp([2, 2], [1.0] * 4, "INT32"))))
    add(Case("ints NaN", path="/v2/models/ints/infer", body=b'{"inputs": [{"name": "x", "shape": [2, 2], '
                                                           b'"datatype": "INT32", "data": [NaN, 1, 2, 3]}]}'))
    add(Case("batch too large", body=_req(_inp([100_000, 16], [0.5] * 1_600_000)), expect=(400, 413)))
    # -- binary data extension
    xb = np.full((1, 16), 0.5, np.float32).tobytes()

    def binary(header: dict, data: bytes = xb, length=None) -> tuple[bytes, dict]:
        h = json.dumps(header).encode()
        return h + data, {"Inference-Header-Content-Length": str(len(h) if length is None else length),
                          "Content-Type": "application/octet-stream"}
    bin_x = lambda size: {"inputs": [_inp([1, 16], parameters={"binary_data_size": size})]}  # noqa: E731
    for name, (body, hdrs) in [
        ("size too small", binary(bin_x(60))), ("size too large", binary(bin_x(68))),
        ("size negative", binary(bin_x(-1))), ("size string", binary(bin_x("64"))),
        ("size float", binary(bin_x(64.0))), ("size huge", binary(bin_x(2 ** 70))),
        ("extra bytes", binary(bin_x(64), xb + b"\0\0\0\0")), ("missing bytes", binary(bin_x(64), xb[:32])),
        ("both data and size", binary({"inputs": [_inp([1, 16], x16, parameters={"binary_data_size": 64})]})),
        ("header length zero", binary(bin_x(64), length=0)), ("header length negative", binary(bin_x(64), length=-5)),
        ("header length past body", binary(bin_x(64), length=10 ** 6)), ("header length text", binary(bin_x(64), length="abc")),
        ("header length 5000 digits", binary(bin_x(64), length="9" * 5000)),
        ("header length inside json", binary(bin_x(64), length=10)),
        ("size without header", (json.dumps(bin_x(64)).encode() + xb, {})),
        ("bool bytes not 0/1", binary({"inputs": [_inp([2, 2], datatype="BOOL", parameters={"binary_data_size": 4})]},
                                      b"\x00\x01\x02\x01")),
    ]:
        add(Case(f"binary {name}", path="/v2/models/ints/infer" if "bool" in name else "/v2/models/mlp/infer",
                 body=body, headers=hdrs))
    # -- size
    add(Case("declared over limit", headers={"Content-Length": str(max_body + 1)}, raw=None, body=b"",
             expect=(413,)))
    add(Case("body over limit", body=b" " * (max_body + 1024), expect=(413,)))
    add(Case("gzip bomb", body=gzip.compress(b" " * (max_body * 4)), headers={"Content-Encoding": "gzip"},
             expect=(413,)))
    add(Case("gzip corrupt", body=b"\x1f\x8b\x08\x00garbage", headers={"Content-Encoding": "gzip"}))
    add(Case("gzip truncated", body=gzip.compress(_req(good))[:-12], headers={"Content-Encoding": "gzip"}))
    add(Case("deflate corrupt", body=b"nope", headers={"Content-Encoding": "deflate"}))
    add(Case("encoding br", body=_req(good), headers={"Content-Encoding": "br"}, expect=(415,)))
    add(Case("encoding unknown", body=_req(good), headers={"Content-Encoding": "x-kiln"}, expect=(415,)))
    add(Case("content-length text", raw=b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n"))
    add(Case("content-length negative", raw=b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: a\r\nContent-Length: -5\r\n\r\n"))
    add(Case("content-length twice", raw=b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n"
                                         b"Content-Length: 3\r\n\r\n{}"))
    add(Case("content-length and chunked", raw=b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n"
                                               b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"))
    add(Case("bad chunk size", raw=b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   b"zz\r\n{}\r\n0\r\n\r\n"))
    # -- content types
    for ctype, status in [("text/plain", 415), ("multipart/form-data; boundary=x", 415),
                          ("application/x-www-form-urlencoded", 415), ("application/xml", 415),
                          ("application/json; charset=utf-16", None), ("image/png", 415)]:
        body = _req(good) if status else "".join(json.dumps({"inputs": [good]})).encode("utf-16")
        if ctype in ("text/plain", "application/x-www-form-urlencoded"):  # a JSON body is read as JSON under
            body = b"inputs=x&data=0.5"  # these (curl -d's default, server/app.py): refused when it is not
        add(Case(f"content type {ctype}", body=body, headers={"Content-Type": ctype}, expect=(status or 400,)))
    # -- unknown models, versions, routes, methods
    for path in ["/v2/models/nope/infer", "/v2/models/mlp/versions/2/infer", "/v2/models/mlp/versions/abc/infer",
                 "/v2/models/mlp/versions/-1/infer", "/v2/models/mlp/versions/1e9/infer",
                 "/v2/models/" + "a" * 4000 + "/infer", "/v2/models/%00/infer", "/v2/models/%ff%fe/infer",
                 "/v2/models/ml%2Fp/infer", "/v2/models/../models/mlp/infer2", "/v2/nope", "/nope"]:
        add(Case(f"path {path[:40]}", path=path, body=_req(good), expect=(404,)))
    for path in ["/v2/models/nope", "/v2/models/nope/ready", "/v2/models/mlp/versions/9", "/v2/models/mlp/versions/9/ready"]:
        add(Case(f"GET {path}", method="GET", path=path, expect=(404,)))
    add(Case("GET infer", method="GET", expect=(405,)))
    add(Case("PUT infer", method="PUT", body=_req(good), expect=(405,)))
    add(Case("DELETE model", method="DELETE", path="/v2/models/mlp", expect=(405,)))
    add(Case("POST health", method="POST", path="/v2/health/ready", expect=(405,)))
    # -- malformed HTTP
    for i, raw in enumerate([b"GARBAGE\r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
                             b"GET / HTTP/1.1\r\nX: \x00\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 64,
                             b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
                             b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 5000 + b"\r\n"]):
        add(Case(f"malformed http {i}", raw=raw, expect=(400, 404, 405, 431)))
    # -- a model that fails at run time (the node's error, as JSON 500) and a bfloat16 output (200 below)
    add(Case("model raises at run time", path="/v2/models/raiser/infer",
             body=_req(_inp([2, 4], [1.0] * 8), _inp([2], [3, 3], "INT64", name="s")), expect=(500,), says="Reshape"))
    return cases


def check_answer(case: Case, status: int, headers: dict, body: bytes) -> Optional[str]:
    """Why the answer to ``case`` breaks the rules, or None."""
    if status not in case.expect:
        return f"status {status}, expected {case.expect}: {body[:200]!r}"
    if not headers.get("content-type", "").startswith("application/json"):
        return f"status {status} with content-type {headers.get('content-type')!r}: {body[:200]!r}"
    try:
        doc = json.loads(body)
    except ValueError:
        return f"status {status} with a body that is not JSON: {body[:200]!r}"
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), str) or not doc["error"]:
        return f"status {status} without an 'error' string: {body[:200]!r}"
    if case.says and case.says not in doc["error"]:
        return f"error {doc['error']!r} does not say {case.says!r}"
    return None


def control_requests(port: int) -> list[str]:
    """Valid requests whose answers are checked against Program.run (no wrong 200): JSON and binary, the
    bfloat16 model both ways. Returns the problems found."""
    import ml_dtypes
    problems = []
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    want = x.astype(ml_dtypes.bfloat16)
    status, headers, body = request("127.0.0.1", port, "POST", "/v2/models/bf16/infer", _req(_inp([3, 4], x.ravel().tolist())))
    if status != 200:
        problems.append(f"bf16 JSON: {status} {body[:200]!r}")
    else:
        out = json.loads(body)["outputs"][0]
        got = np.array(out["data"], dtype=ml_dtypes.bfloat16).reshape(out["shape"])
        if out["datatype"] != "BF16" or not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
            problems.append(f"bf16 JSON answered {out}")
    h = json.dumps({"inputs": [_inp([3, 4], parameters={"binary_data_size": x.nbytes})],
                    "parameters": {"binary_data_output": True}}).encode()
    status, headers, body = request("127.0.0.1", port, "POST", "/v2/models/bf16/infer", h + x.tobytes(),
                                    {"Inference-Header-Content-Length": str(len(h))})
    if status != 200:
        problems.append(f"bf16 binary: {status} {body[:200]!r}")
    else:
        n = int(headers["inference-header-content-length"])
        got = np.frombuffer(body[n:], dtype=ml_dtypes.bfloat16).reshape(3, 4)
        if not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
            problems.append("bf16 binary output differs")
    ints = np.array([[1, -2], [3, 4]], np.int32)
    status, _, body = request("127.0.0.1", port, "POST", "/v2/models/ints/infer",
                              _req(_inp([2, 2], ints.ravel().tolist(), "INT32")))
    if status != 200 or json.loads(body)["outputs"][0]["data"] != (ints * 3).ravel().tolist():
        problems.append(f"ints: {status} {body[:200]!r}")
    return problems


def run_matrix(server: ServeProcess, max_body: int) -> dict:
    """Every case of the matrix, then the controls, then a valid request: what broke, and counts."""
    cases = bad_input_cases(max_body)
    rss0 = server.rss_mb()
    failures, statuses = [], {}
    started = time.monotonic()
    for case in cases:
        try:
            status, headers, body = request("127.0.0.1", server.port, case.method, case.path, case.body,
                                            case.headers, raw=case.raw, timeout=60)
        except OSError as e:
            failures.append(f"{case.name}: {type(e).__name__}: {e}")
            continue
        statuses[status] = statuses.get(status, 0) + 1
        why = check_answer(case, status, headers, body)
        if why:
            failures.append(f"{case.name}: {why}")
    failures += [f"control: {p}" for p in control_requests(server.port)]
    plain_500 = sum(n for s, n in statuses.items() if s >= 500) - sum(1 for c in cases if 500 in c.expect)
    return {"cases": len(cases), "failures": failures, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "unexpected_5xx": plain_500, "seconds": round(time.monotonic() - started, 1),
            "rss_mb_before": round(rss0, 1), "rss_mb_after": round(server.rss_mb(), 1),
            "server_alive": server.proc.poll() is None}


# ---------------------------------------------------------------------------------------------- slow
_MODES = ("header", "body", "idle")


def _slow_worker(port: int, count: int, sources: list[str], mode: str, hold_s: float, interval_s: float,
                 report) -> None:
    """Keep ``count`` slow connections open to 127.0.0.1:port for ``hold_s`` seconds, opening a new one
    whenever the server closes or answers one; calls ``report(dict)`` every second. One asyncio Protocol
    and one timer per connection (no task per byte), so one process holds ~10,000 on little CPU."""
    import asyncio

    stats = {"open": 0, "opened": 0, "closed_by_server": 0, "connect_errors": 0, "peak_open": 0}
    transports: set = set()

    class Slow(asyncio.Protocol):
        def __init__(self, kind: str, done: "asyncio.Future"):
            self.kind, self.done, self.sent, self.handle, self.transport = kind, done, 0, None, None

        def connection_made(self, transport) -> None:
            self.transport = transport
            transports.add(transport)
            if self.kind == "header":
                transport.write(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: a\r\nX-Slow: ")
            elif self.kind == "body":
                transport.write(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: a\r\nContent-Length: 1000000\r\n\r\n")
            if self.kind != "idle":
                self.handle = loop.call_later(interval_s, self.trickle)

        def trickle(self) -> None:
            if not self.transport.is_closing():
                try:
                    self.transport.write(b"a" if self.kind == "header" else b"[")
                except RuntimeError:  # closed under us (uvloop says so with a RuntimeError)
                    return
                self.handle = loop.call_later(interval_s, self.trickle)

        def data_received(self, data: bytes) -> None:
            self.transport.abort()  # the server answered (408, 503...): start over

        def connection_lost(self, exc) -> None:
            transports.discard(self.transport)
            if self.handle is not None:
                self.handle.cancel()
            if not self.done.done():
                self.done.set_result(None)

    async def one(i: int, deadline: float) -> None:
        kind = _MODES[i % 3] if mode == "mixed" else mode
        src = sources[i % len(sources)]
        while time.monotonic() < deadline:
            done = loop.create_future()
            try:
                await asyncio.wait_for(loop.create_connection(lambda: Slow(kind, done), "127.0.0.1", port,
                                                              local_addr=(src, 0)), 10)
            except (OSError, asyncio.TimeoutError, RuntimeError):
                stats["connect_errors"] += 1
                await asyncio.sleep(0.5)
                continue
            stats["open"] += 1
            stats["opened"] += 1
            stats["peak_open"] = max(stats["peak_open"], stats["open"])
            try:
                await asyncio.wait_for(asyncio.shield(done), max(0.0, deadline - time.monotonic()))
                stats["closed_by_server"] += 1
            except asyncio.TimeoutError:
                pass
            finally:
                stats["open"] -= 1

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + hold_s
        tasks = []
        for i in range(count):  # open at ~2,000/s, as an attacker would, not all in one burst
            tasks.append(asyncio.ensure_future(one(i, deadline)))
            if i % 200 == 199:
                await asyncio.sleep(0.1)

        async def reporter():
            while time.monotonic() < deadline:
                report(dict(stats))
                await asyncio.sleep(1.0)
        rep = asyncio.ensure_future(reporter())
        await asyncio.gather(*tasks, return_exceptions=True)
        rep.cancel()
        for t in list(transports):
            t.abort()
        report(dict(stats, done=True))

    loop = None
    try:
        import uvloop
        uvloop.run(main())
    except ImportError:  # pragma: no cover
        asyncio.run(main())


def _raise_nofile(nice: int = 0) -> None:
    if nice:
        os.nice(nice)
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def _probe(port: int, body: bytes, timeout: float) -> tuple[bool, float, str]:
    started = time.monotonic()
    try:
        status, _, answer = request("127.0.0.1", port, "POST", "/v2/models/mlp/infer", body, timeout=timeout)
    except OSError as e:
        return False, time.monotonic() - started, f"{type(e).__name__}: {e}"
    ok = status == 200 and "outputs" in json.loads(answer or b"{}")
    return ok, time.monotonic() - started, "" if ok else f"{status} {answer[:120]!r}"


def slow_attack(server: ServeProcess, connections: int, *, mode: str = "mixed", sources: int = 64,
                hold_s: float = 30.0, interval_s: float = 2.0, processes: int = 0, probe_every_s: float = 0.2,
                probe_timeout_s: float = 10.0, attacker_nice: int = 0) -> dict:
    """``connections`` slow connections from ``sources`` addresses 127.0.1.x (spread over ``processes``
    attacker processes, default one per 8,000), and probes every ``probe_every_s`` on fresh connections
    from 127.0.0.1 for ``hold_s`` seconds. Returns the probes' outcomes and the server's state."""
    sources_list = [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(max(1, sources))]
    processes = processes or max(1, -(-connections // 8000))
    share = [connections // processes + (1 if i < connections % processes else 0) for i in range(processes)]
    cmd = [sys.executable, "-m", "kiln.server.attacks", "_slow-worker", "--port", str(server.port), "--mode", mode,
           "--hold-s", str(hold_s), "--interval-s", str(interval_s), "--sources", ",".join(sources_list)]
    workers = [subprocess.Popen(cmd + ["--connections", str(n)], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: _raise_nofile(attacker_nice)) for n in share if n]
    latest: dict[int, dict] = {}

    def read(i, p):
        for line in p.stdout:
            try:
                latest[i] = json.loads(line)
            except ValueError:
                pass
    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(workers)]
    for t in readers:
        t.start()
    body = _req(_inp([1, 16], [0.5] * 16))
    probes, fails, latencies, peak_open, peak_fds, peak_rss = 0, [], [], 0, 0, 0.0
    started = time.monotonic()
    warm = min(hold_s / 3, connections / 2000 + 2)  # let the attack build up (~2,000 connections/s) first
    while time.monotonic() - started < hold_s:
        ok, seconds, why = _probe(server.port, body, probe_timeout_s)
        if time.monotonic() - started >= warm:
            probes += 1
            latencies.append(seconds)
            if not ok:
                fails.append(why)
        peak_open = max(peak_open, sum(s.get("open", 0) for s in latest.values()))
        try:
            peak_fds = max(peak_fds, server.open_fds())
            peak_rss = max(peak_rss, server.rss_mb())
        except OSError:
            pass
        time.sleep(probe_every_s)
    for p in workers:
        p.wait(hold_s + 60)
    for t in readers:
        t.join(5)
    health = request("127.0.0.1", server.port, "GET", "/v2/health/ready")[0]
    lat = sorted(latencies) or [0.0]
    totals = {k: sum(s.get(k, 0) for s in latest.values()) for k in ("opened", "closed_by_server", "connect_errors", "peak_open")}
    return {"connections": connections, "mode": mode, "sources": len(sources_list), "hold_s": hold_s,
            "attacker_open_peak": max(peak_open, totals["peak_open"]), "attacker_opened": totals["opened"],
            "attacker_closed_by_server": totals["closed_by_server"], "attacker_connect_errors": totals["connect_errors"],
            "probes": probes, "probe_failures": len(fails), "probe_failure_samples": fails[:5],
            "probe_p50_s": round(lat[len(lat) // 2], 4), "probe_p99_s": round(lat[int(len(lat) * 0.99)], 4),
            "probe_max_s": round(lat[-1], 4), "server_fds_peak": peak_fds, "server_rss_mb_peak": round(peak_rss, 1),
            "server_ready_after": health, "server_alive": server.proc.poll() is None}


# ---------------------------------------------------------------------------------------------- sigterm
def sigterm_run(model_args: list[str], *, clients: int = 16, before_s: float = 1.5, timeout_s: float = 60.0,
                body: Optional[bytes] = None, path: str = "/v2/models/mlp/infer") -> dict:
    """One run: a server, ``clients`` threads sending requests back to back, half on a keep-alive connection
    (reconnecting when the server closes it), half on a fresh connection each (so connections are always
    arriving in the listener's accept queue), SIGTERM after ``before_s``. Every request is
    classified: ``ok`` (200), ``unavailable`` (503), ``refused`` (the connection was refused: nothing
    sent), ``lost`` (sent, and the connection ended without a response), ``other`` (any other status)."""
    server = ServeProcess(model_args)
    body = body or _req(_inp([1, 16], [0.5] * 16))
    counts = {"ok": 0, "unavailable": 0, "refused": 0, "lost": 0, "other": 0, "after_signal": 0}
    lost_samples: list[str] = []
    lock = threading.Lock()
    signalled = threading.Event()
    stop = threading.Event()

    def client(fresh: bool) -> None:
        conn = None
        while not stop.is_set():
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
                try:
                    conn.connect()
                except OSError:  # refused (or reset during the handshake): nothing was sent
                    with lock:
                        counts["refused"] += 1
                    conn = None
                    if signalled.is_set():
                        return  # the server is gone for new connections: this client is done
                    time.sleep(0.01)
                    continue
            after = signalled.is_set()
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
            except (http.client.HTTPException, OSError) as e:
                with lock:
                    counts["lost"] += 1
                    if len(lost_samples) < 5:
                        lost_samples.append(f"{type(e).__name__}: {e}")
                conn.close()
                conn = None
                continue
            with lock:
                key = "ok" if r.status == 200 else "unavailable" if r.status == 503 else "other"
                counts[key] += 1
                counts["after_signal"] += after
            if r.will_close or fresh:
                conn.close()
                conn = None

    threads = [threading.Thread(target=client, args=(i % 2 == 1,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(before_s)
    signalled.set()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code = server.proc.wait()
    stop.set()
    for t in threads:
        t.join(timeout_s)
    output = "".join(server.output)
    return {**counts, "exit": code, "lost_samples": lost_samples, "traceback": "Traceback" in output}


def sigterm_runs(runs: int, clients: int = 16, before_s: float = 1.5) -> dict:
    root = make_repository(Path(tempfile.mkdtemp(prefix="kiln-attacks-")))
    totals = {"runs": runs, "ok": 0, "unavailable": 0, "refused": 0, "lost": 0, "other": 0, "after_signal": 0,
              "nonzero_exits": 0, "tracebacks": 0, "lost_samples": []}
    for i in range(runs):
        r = sigterm_run([str(root / "mlp" / "1" / "model.kiln"), "--name", "mlp", "--workers", "1"],
                        clients=clients, before_s=before_s)
        for k in ("ok", "unavailable", "refused", "lost", "other", "after_signal"):
            totals[k] += r[k]
        totals["nonzero_exits"] += r["exit"] != 0
        totals["tracebacks"] += r["traceback"]
        totals["lost_samples"] += r["lost_samples"]
        print(f"run {i + 1}/{runs}: " + json.dumps({k: r[k] for k in r if k != "lost_samples"}), flush=True)
    return totals


# ---------------------------------------------------------------------------------------------- worker kill
def worker_pids(pid: int) -> list[int]:
    """The worker processes of a server: its children, less multiprocessing's resource tracker."""
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the thread exited
            continue
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"resource_tracker" not in cmdline:
                pids.append(int(child))
    return pids


def kill_worker_run(model: Path, *, clients: int = 8, duration_s: float = 4.0, kill_at_s: float = 1.5,
                    workers: int = 1) -> dict:
    """``clients`` threads send distinct random 1-3 row requests back to back (so they are batched) for
    ``duration_s``; at ``kill_at_s`` every worker process gets SIGKILL. Every request is classified: ``ok``
    (200 and equal to Program.run on that request alone), ``wrong`` (a 200 that is not), ``worker_died``
    (500 JSON naming the dead worker), ``unavailable`` (503 JSON while the replacement starts), ``lost``
    (no response), ``other``. Then the server must serve again."""
    from kiln.runtime import load
    program = load(model)
    server = ServeProcess([str(model), "--name", "mlp", "--workers", str(workers), "--max-batch-size", "32",
                           "--log-level", "critical"])
    counts = {"ok": 0, "wrong": 0, "worker_died": 0, "unavailable": 0, "lost": 0, "other": 0}
    samples: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        while time.monotonic() < deadline:
            x = rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32)
            try:
                conn.request("POST", "/v2/models/mlp/infer", _req(_inp(list(x.shape), x.ravel().tolist())),
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                body = r.read()
            except (http.client.HTTPException, OSError) as e:
                key, why = "lost", f"{type(e).__name__}: {e}"
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            else:
                why = ""
                if r.status == 200:
                    out = json.loads(body)["outputs"][0]
                    got = np.array(out["data"], np.float32).reshape(out["shape"])
                    want = program.run({"x": x})["y"]
                    # Up to rounding (a row inside a batch, fewer BLAS threads in the worker; an output near 0
                    # from cancelling terms of ~10 was seen 2e-6 off): an absolute floor scaled by the
                    # output's magnitude. A request answered with another's rows is off by ~1-10.
                    ok = got.shape == want.shape and np.allclose(
                        got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max())))
                    key, why = ("ok", "") if ok else (
                        "wrong", f"wrong answer for {x.shape}: got {got.ravel()[:6].tolist()}, "
                                 f"want {want.ravel()[:6].tolist()}, shape {list(got.shape)}")
                else:
                    error = json.loads(body).get("error", "") if body.startswith(b"{") else ""
                    key = ("worker_died" if r.status == 500 and "died" in error else
                           "unavailable" if r.status == 503 and error else "other")
                    why = f"{r.status} {body[:120]!r}"
            with lock:
                counts[key] += 1
                if key in ("wrong", "lost", "other") and len(samples) < 5:
                    samples.append(why)
        conn.close()

    try:
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        time.sleep(kill_at_s)
        killed = worker_pids(server.pid)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(duration_s + 60)
        recovered = None
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:  # the replacement worker serves again
            status, _, body = request("127.0.0.1", server.port, "POST", "/v2/models/mlp/infer",
                                      _req(_inp([1, 16], [0.5] * 16)))
            if status == 200:
                recovered = round(time.monotonic() - give_up + 60, 2)
                break
            time.sleep(0.2)
    finally:
        code = server.stop()
    return {**counts, "killed": len(killed), "recovered_after_s": recovered, "samples": samples, "exit": code,
            "traceback": "Traceback" in "".join(server.output)}


# ---------------------------------------------------------------------------------------------- command
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.server.attacks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("matrix", help="the bad-input matrix against a fresh server")
    m.add_argument("--max-body-mb", type=float, default=1.0)
    s = sub.add_parser("slow", help="slow connections with probes")
    s.add_argument("--connections", type=int, default=20_000)
    s.add_argument("--mode", choices=("mixed",) + _MODES, default="mixed")
    s.add_argument("--sources", type=int, default=64, help="source addresses 127.0.x.y the attack comes from")
    s.add_argument("--hold-s", type=float, default=60.0)
    s.add_argument("--nofile", type=int, help="the server's RLIMIT_NOFILE (default: inherited, raised to hard)")
    s.add_argument("--serve-arg", action="append", default=[], help="an extra kiln serve argument (repeatable)")
    s.add_argument("--server-nice", type=int, default=0,
                   help="the server's nice value (a negative one needs root): on a small shared box the attack "
                        "processes compete with the server for CPU, which a remote attacker does not")
    s.add_argument("--attacker-nice", type=int, default=0, help="the attack processes' nice value")
    t = sub.add_parser("sigterm", help="SIGTERM under load, several runs")
    t.add_argument("--runs", type=int, default=10)
    t.add_argument("--clients", type=int, default=16)
    k = sub.add_parser("kill-worker", help="SIGKILL the worker processes under batched load, several runs")
    k.add_argument("--runs", type=int, default=5)
    k.add_argument("--workers", type=int, default=1)
    w = sub.add_parser("_slow-worker")  # an attacker process of `slow`
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--connections", type=int, required=True)
    w.add_argument("--mode", default="mixed")
    w.add_argument("--hold-s", type=float, required=True)
    w.add_argument("--interval-s", type=float, default=2.0)
    w.add_argument("--sources", required=True)
    args = p.parse_args(argv)

    if args.cmd == "_slow-worker":
        _raise_nofile()
        _slow_worker(args.port, args.connections, args.sources.split(","), args.mode, args.hold_s, args.interval_s,
                     lambda d: print(json.dumps(d), flush=True))
        return 0
    if args.cmd == "sigterm":
        result = sigterm_runs(args.runs, args.clients)
        print(json.dumps(result))
        return 0 if result["lost"] == 0 and result["nonzero_exits"] == 0 else 1
    root = make_repository(Path(tempfile.mkdtemp(prefix="kiln-attacks-")))
    if args.cmd == "kill-worker":
        totals: dict = {"runs": args.runs, "samples": []}
        for i in range(args.runs):
            r = kill_worker_run(root / "mlp" / "1" / "model.kiln", workers=args.workers)
            print(f"run {i + 1}/{args.runs}: " + json.dumps({k: v for k, v in r.items() if k != "samples"}), flush=True)
            for key, value in r.items():
                if key == "samples":
                    totals["samples"] += value
                elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "recovered_after_s":
                    totals[key] = totals.get(key, 0) + value
            totals["not_recovered"] = totals.get("not_recovered", 0) + (r["recovered_after_s"] is None)
        print(json.dumps(totals))
        bad = totals.get("wrong", 0) + totals.get("lost", 0) + totals.get("other", 0) + totals["not_recovered"]
        return 0 if bad == 0 else 1
    if args.cmd == "matrix":
        server = ServeProcess([str(root), "--workers", "0", "--max-body-mb", str(args.max_body_mb), "--log-level", "critical"])
        try:
            result = run_matrix(server, int(args.max_body_mb * (1 << 20)))
        finally:
            result_exit = server.stop()
        result["exit"] = result_exit
        for f in result["failures"]:
            print("FAIL", f)
        print(json.dumps(result))
        return 0 if not result["failures"] and result["exit"] == 0 else 1
    server = ServeProcess([str(root / "mlp" / "1" / "model.kiln"), "--name", "mlp", "--log-level", "critical",
                           *args.serve_arg], nofile=args.nofile, nice=args.server_nice)
    try:
        result = slow_attack(server, args.connections, mode=args.mode, sources=args.sources, hold_s=args.hold_s,
                             attacker_nice=args.attacker_nice)
        result["server_nice"], result["attacker_nice"] = args.server_nice, args.attacker_nice
        result["server_nofile"] = args.nofile or "inherited"
        result["server_metrics"] = {k: server.metric(f'kiln_connections_total{{event="{k}"}}')
                                    for k in ("accepted", "refused", "evicted", "header_timeouts", "body_timeouts")}
    finally:
        result_exit = server.stop()
    result["exit"] = result_exit
    print(json.dumps(result))
    return 0 if result["probe_failures"] == 0 and result["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
