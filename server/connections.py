"""Connection-level defences of ``kiln serve``: read timeouts, connection caps, lingering close, drain.

The V2 routes (server/app.py) check every request; this module protects the server *before* there is a
request to check, at the level of TCP connections, where uvicorn alone leaves it open (issue 16):

- a client that sends half a header and waits kept its connection (and a file descriptor) forever, and
  one that trickled a body a byte every 2 s kept it as long as it liked: ~20,400 such connections (the
  open-file limit) and the server accepted nothing more, legitimate clients included;
- on SIGTERM uvicorn closed idle keep-alive connections at once, so a request written on one just then
  met a TCP reset instead of the promised 503, and it closed the listening socket, resetting the
  connections still in the kernel's accept queue.

What is here, and why this way (see docs/NOTES.md, "Server hardening (issue 16)"):

- :class:`GuardedHttpToolsProtocol` subclasses uvicorn's httptools protocol (the one ``uvicorn[standard]``
  runs), because the defences need the connection's life before a request exists, which ASGI middleware
  never sees and uvicorn's settings do not bound: ``timeout_keep_alive`` only starts after a response,
  ``limit_concurrency`` answers 503 to a *parsed* request when too many connections are open (so slow
  connections that never finish a header are never counted against anything, and once they fill the
  limit every legitimate request gets 503), and h11's size limit needs the slower h11 parser.
- **Header timeout** (``header_timeout_s``, default 10): from the connection's start, or from the end of
  the previous response, the whole request head must arrive within it, however it is trickled. A client
  that sent part of a head gets ``408`` + ``{"error": ...}``; one that sent nothing is closed silently
  (an idle keep-alive connection first meets uvicorn's ``timeout_keep_alive``, 5 s). A head over
  ``max_header_bytes`` (64 KiB) gets ``431``.
- **Body timeout with a minimum rate** (``body_timeout_s`` 30, ``body_min_rate`` 32 KiB/s): the body may
  take ``body_timeout_s`` plus one second per ``body_min_rate`` bytes received, so a large upload on a
  slow link is fine and a trickle is cut (``408``). Time when the server itself stopped reading (flow
  control) does not count.
- **Send timeout** (``send_timeout_s`` 30): a client that stops reading its response (the transport's
  buffer stays above its high-water mark) is disconnected, so a slow reader cannot pin a response.
- **Connection caps**: at most ``max_connections`` connections (default: the open-file limit less a
  reserve of descriptors for the process itself) and ``max_connections_per_client`` per peer address
  (default a quarter of that; 0 = no per-client cap). When a cap is reached, a new connection first
  **evicts** another: the one that has waited longest for its first request head (a connection that
  has not completed a single request: a slowloris, an idle pre-connect), else the keep-alive connection
  idle longest (at least ``evict_after_s``, 2 s), else the one sending a body slowest, if below
  ``body_min_rate`` averaged since its body began (after its first second), so slow connections can never lock legitimate clients
  out; only when none is evictable is it refused (503, closed). Oldest first protects a new connection:
  it is evicted only after every connection older than it, by which time a real client has sent its
  request. The last ``health_reserve`` slots (32) take only health
  and metrics requests (``/v2/health/*``, ``/v2/models/*/ready``, ``/metrics``), so an orchestrator's
  probe is answered when every other slot is busy with real work.
- **Lingering close**: a response sent with ``Connection: close`` (an early 413/503, a 408) is followed
  by a half-close and ``linger_s`` (2 s) of reading and discarding, so a client still sending its body
  reads the response instead of a TCP reset (closing a socket with unread data sends RST).
- **Drain on SIGTERM**: open connections stay open and are read until the drain ends: every request
  that arrives is answered (503 ``server is shutting down`` from the app) with ``Connection: close``;
  idle connections are closed once the batchers have drained *and* ``drain_linger_s`` (1 s) has passed
  since the signal, long enough for a client between two requests to send its next one and read its
  503. The listening socket first gets a drop-all socket filter (Linux), so no new handshake completes,
  then everything already in the accept queue is accepted and served the same way, then it is closed:
  a client either connects and gets an answer, or is refused at connect (it sent nothing).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

log = logging.getLogger("kiln.server")

#: Descriptors kept back from ``max_connections`` for the process itself: worker pipes, model files,
#: logs, the listener, threads' needs. ``max(_FD_RESERVE_MIN, limit // 16)``.
_FD_RESERVE_MIN = 128
#: The largest inference body read straight into one buffer (GuardedHttpToolsProtocol._open_sink).
BODY_SINK_MAX = 16 << 20
_HEALTH_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})
_MODEL_READY = re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/ready$")


#: Where the body sink puts the binary tensor data: on a multiple of this many bytes (0: wherever np.empty does;
#: KILN_SINK_ALIGN, for A/B measurements).
SINK_ALIGN = int(os.environ.get("KILN_SINK_ALIGN", "64") or 0)


def aligned_sink(length: int, header: int = 0, align: Optional[int] = None) -> memoryview:
    """A ``length``-byte buffer placed so that byte ``header`` (where the binary tensor data starts, after the
    JSON header of ``Inference-Header-Content-Length`` bytes) is ``align``-byte aligned: the tensors decoded
    from it are aligned views, not copies (numpy copies a misaligned float32 view before use; for a 602 KB
    ResNet-50 input that was a second copy of every byte)."""
    align = SINK_ALIGN if align is None else align
    if align <= 0:
        return memoryview(np.empty(length, np.uint8))
    raw = np.empty(length + align, np.uint8)
    skip = (-(raw.ctypes.data + max(0, min(header, length)))) % align
    return memoryview(raw[skip:skip + length])


@dataclass
class ConnectionLimits:
    """The connection-level limits; every one is documented in the module docstring and the README."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    body_min_rate: int = 32 << 10  # bytes/s
    send_timeout_s: float = 30.0
    keep_alive_s: float = 5.0  # uvicorn's timeout_keep_alive
    max_header_bytes: int = 64 << 10
    max_connections: int = 0  # 0: from the open-file limit (see resolve)
    max_connections_per_client: Optional[int] = None  # None: max_connections // 4; 0: no cap
    health_reserve: int = 32
    evict_after_s: float = 2.0
    linger_s: float = 2.0
    drain_linger_s: float = 1.0

    def resolve(self, nofile: Optional[int] = None) -> "ConnectionLimits":
        """A copy with the automatic values filled in from the open-file limit ``nofile`` (default: the
        process's soft RLIMIT_NOFILE); an explicit ``max_connections`` above what the descriptors allow is
        lowered to it, with a warning."""
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s", "keep_alive_s", "linger_s"):
            if not getattr(self, name) > 0:
                from kiln.errors import KilnError
                raise KilnError(f"{name} must be positive, got {getattr(self, name)}")
        if nofile is None:
            nofile = open_file_limit()
        fit = max(16, nofile - max(_FD_RESERVE_MIN, nofile // 16)) if nofile else 1 << 20
        total = self.max_connections or fit
        if total > fit:
            log.warning("max_connections %d is more than the open-file limit (%d) allows; using %d",
                        total, nofile, fit)
            total = fit
        per_client = total // 4 if self.max_connections_per_client is None else self.max_connections_per_client
        reserve = min(self.health_reserve, max(1, total // 8)) if total > 1 else 0  # never every slot
        return ConnectionLimits(**{**self.__dict__, "max_connections": total,
                                   "max_connections_per_client": per_client, "health_reserve": reserve})


def open_file_limit() -> int:
    """The soft RLIMIT_NOFILE (0 where there is none to read)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; returns (before, after)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if sys.platform == "darwin":  # pragma: no cover - macOS refuses more than OPEN_MAX per process
        target = min(target, 10240)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:  # a container may forbid it: keep the soft limit
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return soft, soft
    return soft, target


@dataclass
class ConnectionStats:
    """Counts of what the guards did (also in /metrics as kiln_connections_*)."""

    accepted: int = 0
    refused: int = 0
    evicted: int = 0
    header_timeouts: int = 0
    body_timeouts: int = 0
    send_timeouts: int = 0
    too_large_heads: int = 0
    reserve_only: int = 0


class ConnectionTracker:
    """The server-wide state the connections share: counts per peer, the connections waiting for a
    request head (oldest first, the eviction order), and the drain."""

    def __init__(self, limits: ConnectionLimits, drained: Optional[Callable[[], bool]] = None):
        self.limits = limits
        self.drained = drained or (lambda: True)
        self.conns: set = set()
        self.per_client: dict[str, int] = {}
        self.waiting: "OrderedDict[Any, None]" = OrderedDict()  # every connection waiting for a head
        self.fresh: "OrderedDict[Any, None]" = OrderedDict()  # those that never completed a request
        self.idle: "OrderedDict[Any, None]" = OrderedDict()  # keep-alive ones between requests
        self.reading: "OrderedDict[Any, None]" = OrderedDict()  # those whose request body is arriving
        self.waiting_by_client: dict[str, "OrderedDict[Any, None]"] = {}
        self.stats = ConnectionStats()
        self.draining = False
        self.drain_done = False
        self._drain_started = 0.0
        self._drain_task: Optional[asyncio.Task] = None

    # ---------------------------------------------------------------- admission
    def admit(self, proto) -> str:
        """``"ok"``, ``"reserve"`` (health checks only) or ``"refuse"`` for a new connection."""
        limits, now, peer = self.limits, time.monotonic(), proto.peer
        cap = limits.max_connections_per_client
        if cap and self.per_client.get(peer, 0) >= cap:
            mine = self.waiting_by_client.get(peer)
            if not (mine and self._evict_oldest(mine, now)):
                self.stats.refused += 1
                return "refuse"
        mode = "ok"
        if len(self.conns) >= limits.max_connections - limits.health_reserve:
            if not (self._evict_oldest(self.fresh, now) or self._evict_oldest(self.idle, now)
                    or self._evict_slow_body(now)):
                if len(self.conns) >= limits.max_connections:
                    self.stats.refused += 1
                    return "refuse"
                mode = "reserve"
                self.stats.reserve_only += 1
        self.conns.add(proto)
        self.per_client[peer] = self.per_client.get(peer, 0) + 1
        self.stats.accepted += 1
        return mode

    def _evict_oldest(self, waiting: "OrderedDict[Any, None]", now: float) -> bool:
        """Evict the oldest of ``waiting`` that may be: one that never completed a request, or one idle
        for ``evict_after_s``. Looks at the 8 oldest at most (the order is by waiting time)."""
        for i, proto in enumerate(waiting):
            if i == 8:
                return False
            if proto.requests_done and now - proto.waiting_since < self.limits.evict_after_s:
                continue
            self.stats.evicted += 1
            proto.evict()
            return True
        return False

    def _evict_slow_body(self, now: float) -> bool:
        """Evict the oldest of the 8 oldest body readers whose body arrives below ``body_min_rate``."""
        rate = self.limits.body_min_rate
        for i, proto in enumerate(self.reading):
            if i == 8:
                return False
            elapsed = now - proto.body_started
            if elapsed >= 1.0 and proto.body_bytes < elapsed * rate:
                self.stats.evicted += 1
                proto.evict()
                return True
        return False

    def release(self, proto) -> None:
        if proto in self.conns:
            self.conns.discard(proto)
            n = self.per_client.get(proto.peer, 1) - 1
            if n > 0:
                self.per_client[proto.peer] = n
            else:
                self.per_client.pop(proto.peer, None)
        self.stop_waiting(proto)
        self.reading.pop(proto, None)

    def start_waiting(self, proto) -> None:
        self.waiting[proto] = None
        (self.idle if proto.requests_done else self.fresh)[proto] = None
        self.waiting_by_client.setdefault(proto.peer, OrderedDict())[proto] = None

    def stop_waiting(self, proto) -> None:
        if self.waiting.pop(proto, 0) is None:
            self.fresh.pop(proto, None)
            self.idle.pop(proto, None)
            mine = self.waiting_by_client.get(proto.peer)
            if mine is not None:
                mine.pop(proto, None)
                if not mine:
                    del self.waiting_by_client[proto.peer]

    def render_metrics(self) -> str:
        """Prometheus text for /metrics: open connections and what the guards did."""
        lines = ["# HELP kiln_connections_open HTTP connections open now",
                 "# TYPE kiln_connections_open gauge", f"kiln_connections_open {len(self.conns)}",
                 "# HELP kiln_connections_max the connection cap (max_connections)",
                 "# TYPE kiln_connections_max gauge", f"kiln_connections_max {self.limits.max_connections}",
                 "# HELP kiln_connections_total connections by what became of them",
                 "# TYPE kiln_connections_total counter"]
        for name, value in self.stats.__dict__.items():
            lines.append(f'kiln_connections_total{{event="{name}"}} {value}')
        return "\n".join(lines) + "\n"

    # ---------------------------------------------------------------- drain
    def begin_drain(self) -> None:
        """SIGTERM: from now on every response closes its connection; idle connections are closed once
        the app has drained and ``drain_linger_s`` has passed. Idempotent; call on the event loop."""
        if self.draining:
            return
        self.draining = True
        self._drain_started = time.monotonic()
        self._drain_task = asyncio.get_running_loop().create_task(self._close_idle_when_drained())

    async def _close_idle_when_drained(self) -> None:
        deadline = self._drain_started + self.limits.drain_linger_s
        while time.monotonic() < deadline or not self.drained():
            await asyncio.sleep(0.02)
        self.drain_done = True
        for proto in list(self.waiting):
            proto.close_if_idle()


# ------------------------------------------------------------------------------------------ responses
def _raw_response(status: int, reason: str, message: str, extra: bytes = b"") -> bytes:
    import json
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n").encode() + extra + b"\r\n" + body


async def _reserve_only_app(scope, receive, send) -> None:
    import json
    body = json.dumps({"error": "the server is at its connection limit; this connection may only make "
                                "health checks (retry later)"}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _is_health(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and (path in _HEALTH_PATHS or bool(_MODEL_READY.match(path)))


class _CycleTransport:
    """The transport a request/response cycle sees: ``close()`` becomes a lingering close."""

    __slots__ = ("_transport", "_proto")

    def __init__(self, transport, proto):
        self._transport, self._proto = transport, proto

    def write(self, data) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._proto.linger_close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


# ------------------------------------------------------------------------------------------ protocol
def make_protocol_class(tracker: ConnectionTracker):
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) bound to ``tracker``; None when
    httptools is missing (uvicorn then runs h11, without these guards; ``kiln-compiler[serve]`` installs it)."""
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
        log.warning("httptools is not installed: the connection guards (timeouts, caps) are off")
        return None

    limits = tracker.limits

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with the guards of this module (see its docstring)."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.peer = self.client[0] if self.client else ""
            self.phase = "waiting"  # waiting (for a request head) | active | lingering | closed
            self.requests_done = 0
            self.waiting_since = time.monotonic()
            self._head_bytes = 0
            self.body_bytes = 0
            self.body_started = 0.0
            self._message_done = True
            self._timer: Optional[asyncio.TimerHandle] = None
            self._send_timer: Optional[asyncio.TimerHandle] = None
            verdict = tracker.admit(self)
            if verdict == "refuse":
                self.phase = "closed"
                transport.write(_raw_response(503, "Service Unavailable",
                                              "too many connections (this client's or the server's); retry later",
                                              b"retry-after: 1\r\n"))
                transport.close()
                return
            self.reserve_only = verdict == "reserve"
            self._wait()

        # -------------------------------------------------------- states
        def _wait(self) -> None:
            self.phase = "waiting"
            self.waiting_since = time.monotonic()
            self._head_bytes = 0
            tracker.start_waiting(self)
            self._arm(limits.header_timeout_s, self._header_timeout)

        def _arm(self, delay: float, callback) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(delay, callback)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def connection_lost(self, exc) -> None:
            self.phase = "closed"
            self._disarm()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None
            tracker.release(self)
            super().connection_lost(exc)

        # -------------------------------------------------------- reading
        def data_received(self, data: bytes) -> None:
            if self.phase != "waiting" and self.phase != "active":
                return  # lingering: read and dropped; closed: nothing more
            was_waiting = self.phase == "waiting"
            super().data_received(data)
            if self.phase == "waiting" and was_waiting and not self.transport.is_closing():
                self._head_bytes += len(data)  # no head completed in this chunk: it is all head
                if self._head_bytes > limits.max_header_bytes:
                    tracker.stats.too_large_heads += 1
                    self._refuse_now(431, "Request Header Fields Too Large",
                                     f"the request head is over {limits.max_header_bytes:,} bytes")
            elif self.phase == "active" and not self._message_done and self._timer is None:
                self._arm(limits.body_timeout_s, self._body_timeout)
                tracker.reading[self] = None

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._message_done = False

        def on_headers_complete(self) -> None:
            tracker.stop_waiting(self)
            self._disarm()
            self.phase = "active"
            self.body_bytes = 0
            self.body_started = time.monotonic()
            reserve = False
            if self.reserve_only:
                try:
                    path = httptools.parse_url(self.url).path.decode("latin-1")
                    method = self.parser.get_method().decode("latin-1")
                except Exception:  # noqa: BLE001 - an unparsable URL is not a health check
                    path = method = ""
                reserve = not _is_health(method, path)
            if reserve:
                app, self.app = self.app, _reserve_only_app
            try:
                super().on_headers_complete()
            finally:
                if reserve:
                    self.app = app
            if self.cycle is not None and self.cycle.scope is self.scope:
                self.cycle.transport = _CycleTransport(self.transport, self)
                if tracker.draining or reserve:
                    self.cycle.keep_alive = False
                if not reserve:
                    self._open_sink()

        def on_body(self, body: bytes) -> None:
            self.body_bytes += len(body)
            cycle = self.cycle
            sink = getattr(cycle, "kiln_sink", None)  # on the cycle, not here: pipelined requests each have one
            if sink is not None and not cycle.response_complete:
                end = cycle.kiln_pos + len(body)
                if end <= len(sink):
                    sink[cycle.kiln_pos:end] = body
                cycle.kiln_pos = end
                return
            super().on_body(body)

        def _open_sink(self) -> None:
            """An inference POST with a declared length: its body goes straight into one buffer of that
            length (:data:`BODY_SINK_MAX` at most) instead of uvicorn's path, which appends every chunk to a
            bytearray, pauses the socket each 64 KiB until the app asks for more, and hands the app a bytes
            copy per chunk (which the app then joins: four copies of each body byte in user space, now one).
            The app's ``receive()`` then returns the whole body as one memoryview, once it is complete.
            Pages are committed only as bytes arrive (the buffer is ``np.empty``)."""
            cycle, scope = self.cycle, self.scope
            if cycle is None or cycle.scope is not scope or scope.get("method") != "POST":
                return
            path = scope.get("path", "")
            if not (path.startswith("/v2/models/") and path.endswith("/infer")):
                return
            length, header = None, 0
            for name, value in scope.get("headers", ()):
                if name == b"content-length":
                    try:
                        length = int(value)
                    except ValueError:
                        return
                elif name == b"inference-header-content-length":
                    try:
                        header = int(value)
                    except ValueError:
                        header = 0  # the app refuses it with a 400
                elif name in (b"content-encoding", b"transfer-encoding", b"expect"):
                    return  # compressed, chunked or 100-continue: uvicorn's own path
            if length is None or not 0 < length <= BODY_SINK_MAX:
                return
            cycle.kiln_sink = aligned_sink(length, header)
            cycle.kiln_pos = 0
            delegate = cycle.receive
            delivered = False

            async def receive():
                nonlocal delivered
                if delivered:
                    return await delegate()
                while not cycle.disconnected and not cycle.response_complete and cycle.more_body:
                    cycle.flow.resume_reading()
                    await cycle.message_event.wait()
                    cycle.message_event.clear()
                if cycle.disconnected or cycle.response_complete:
                    return {"type": "http.disconnect"}
                delivered = True
                sink, pos = cycle.kiln_sink, cycle.kiln_pos
                cycle.kiln_sink = None
                return {"type": "http.request", "body": sink[:pos] if pos <= len(sink) else sink,
                        "more_body": False, "kiln.declared": length, "kiln.received": pos}

            cycle.receive = receive

        def on_message_complete(self) -> None:
            self._message_done = True
            tracker.reading.pop(self, None)
            if self.phase == "active":
                self._disarm()
            super().on_message_complete()
            # The response went out before the body was all read (an early 413, 404...): the connection
            # waits for its next request now.
            if (self.phase == "active" and self.cycle is not None and self.cycle.response_complete
                    and not self.pipeline and not self.transport.is_closing()):
                self._wait()

        def on_response_complete(self) -> None:
            if self.phase != "active":  # lingering or closed: no keep-alive, no pipelined request
                self.server_state.total_requests += 1
                return
            self.requests_done += 1
            pipelined = bool(self.pipeline)  # uvicorn starts the next pipelined request in the call below
            super().on_response_complete()
            if not self.transport.is_closing() and not pipelined and self._message_done:
                self._wait()

        # -------------------------------------------------------- timeouts
        def _header_timeout(self) -> None:
            self._timer = None
            if self.phase != "waiting" or self.transport.is_closing():
                return
            tracker.stop_waiting(self)
            if self._head_bytes:
                tracker.stats.header_timeouts += 1
                self._refuse_now(408, "Request Timeout",
                                 f"the request head did not arrive within {limits.header_timeout_s:g} s")
            else:
                self.phase = "closed"
                self.transport.close()

        def _body_timeout(self) -> None:
            self._timer = None
            if self.phase != "active" or self._message_done or self.transport.is_closing():
                return
            now = time.monotonic()
            allowed = self.body_started + limits.body_timeout_s + self.body_bytes / limits.body_min_rate
            if now < allowed:
                self._arm(allowed - now, self._body_timeout)
                return
            if self.flow.read_paused:  # the server is not reading: not the client's fault
                self.body_started += 1.0
                self._arm(1.0, self._body_timeout)
                return
            tracker.stats.body_timeouts += 1
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                cycle.disconnected = True  # the app's receive() now returns http.disconnect
                cycle.message_event.set()
                self._refuse_now(408, "Request Timeout",
                                 f"the request body arrived slower than {limits.body_min_rate:,} bytes/s "
                                 f"after the first {limits.body_timeout_s:g} s")
            else:
                self.phase = "closed"
                self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(limits.send_timeout_s, self._send_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _send_timeout(self) -> None:
            self._send_timer = None
            tracker.stats.send_timeouts += 1
            self.phase = "closed"
            self.transport.abort()

        # -------------------------------------------------------- closing
        def _refuse_now(self, status: int, reason: str, message: str) -> None:
            """Answer ``status`` (JSON) before any request is handed to the app, and close lingering."""
            tracker.stop_waiting(self)
            self.transport.write(_raw_response(status, reason, message))
            self.linger_close()

        def send_400_response(self, msg: str) -> None:  # a request httptools cannot parse
            self._refuse_now(400, "Bad Request", f"invalid HTTP request: {msg}")

        def linger_close(self) -> None:
            """Half-close after what was written, read and drop what the client still sends for up to
            ``linger_s`` (or until it closes), then close: the client reads our response, not a reset."""
            if self.phase in ("lingering", "closed") or self.transport.is_closing():
                return
            self.phase = "lingering"
            tracker.stop_waiting(self)
            tracker.reading.pop(self, None)
            self._disarm()
            self.flow.resume_reading()
            try:
                self.transport.write_eof()
            except (NotImplementedError, OSError, RuntimeError):  # cannot half-close: close outright
                self.transport.close()
                return
            self._arm(limits.linger_s, self.transport.close)

        def eof_received(self):
            if self.phase == "lingering":
                self.transport.close()
            return super().eof_received()

        def evict(self) -> None:
            """Closed to make room for a new connection (see ConnectionTracker.admit)."""
            tracker.release(self)  # its slot is needed now, not when the close completes
            cycle = self.cycle
            if self.phase == "active" and cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's receive() returns http.disconnect
                cycle.message_event.set()
            self.phase = "closed"
            self._disarm()
            self.transport.close()

        def close_if_idle(self) -> None:
            """The drain has ended: close this connection unless a request head is arriving."""
            if self.phase == "waiting" and not self._head_bytes and not self.transport.is_closing():
                tracker.stop_waiting(self)
                self.phase = "closed"
                self._disarm()
                self.transport.close()

        def shutdown(self) -> None:
            """uvicorn's graceful shutdown: the running request's response closes the connection; an
            idle connection stays open (and read) until the drain ends (see ConnectionTracker)."""
            tracker.begin_drain()
            if self.phase == "active" and self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
            elif self.phase == "waiting" and tracker.drain_done:
                self.close_if_idle()

    return GuardedHttpToolsProtocol


# ------------------------------------------------------------------------------------------ listener
_SO_ATTACH_FILTER = 26


def stop_handshakes(sock: socket.socket) -> bool:
    """Attach a drop-all classic BPF filter to a listening socket (Linux): no new connection completes its
    handshake (clients' SYNs go unanswered and, once the socket closes, are refused), while connections
    already in the accept queue can still be accepted. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    program = (SockFilter * 1)(SockFilter(0x06, 0, 0, 0))  # BPF_RET | BPF_K, 0: keep 0 bytes (drop)
    fprog = SockFprog(1, ctypes.cast(program, ctypes.POINTER(SockFilter)))
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, bytes(fprog))
    except OSError as e:
        log.warning("could not stop new connections on the listening socket: %s", e)
        return False
    return True


def accept_pending(sock: socket.socket) -> list[socket.socket]:
    """Every connection already in the accept queue of a (non-blocking) listening socket."""
    accepted = []
    while True:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            return accepted
        except OSError as e:  # EMFILE and the like: leave the rest to be refused
            log.warning("accepting queued connections at shutdown stopped: %s", e)
            return accepted
        conn.setblocking(False)
        accepted.append(conn)
