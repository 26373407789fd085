"""``kiln serve PATH``: serve a .kiln file or a model repository over the V2 inference protocol.

The server runs uvicorn programmatically (``uvicorn.Server(config).serve(sockets=[...])``) rather than
through ``uvicorn.run``, for three reasons:

- **We bind the socket ourselves** before anything else starts, so "port in use" (or a host that is not
  an address of this machine) is one clear error line and exit 1, not a traceback from inside uvicorn;
  ``--port 0`` picks a free port, and the printed URL names the real one.
- **Shutdown is graceful and ends with exit 0.** On SIGTERM or SIGINT readiness turns false at once and
  every batcher starts draining (queued and running requests finish, new ones get 503); uvicorn stops
  accepting connections and waits for in-flight responses; the app's lifespan then closes the executors
  (worker processes exit). uvicorn's own handler re-raises the signal after a graceful stop, which would
  make the exit status -15 or 130; a clean drain is a success, so we exit 0. A second Ctrl-C forces
  an immediate stop (uvicorn's behaviour).
- **Worker threads leave a core to HTTP.** Each worker process's BLAS/OpenMP thread count defaults to
  ``max(1, (cores - 1) // workers)`` unless the environment sets ``OMP_NUM_THREADS``,
  ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` or ``VECLIB_MAXIMUM_THREADS`` (see server/workers.py):
  BLAS threads spinning on every core starve the process that parses and batches the requests.
- **Nagle is off on every connection** (``TCP_NODELAY``, see :func:`bind_socket`), whatever the event loop.
- **"Ready" is printed when it is true**: models load after the socket is bound (``/v2/health/live``
  answers meanwhile), and the URL and the served models are printed once every model has loaded. A
  model that fails to load stops the server with its error and exit 1.
"""
from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
from typing import Optional

from kiln.errors import KilnError

DEFAULT_PORT = 8000


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a .kiln/.onnx model file, or a repository laid out as "
                                "repo/<model>/<version>/model.kiln with optional repo/<model>/config.json")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 listens on every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--name", help="model name for a single model file (default: the file's stem)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="worker processes per model version (0: threads in the server process; default 1). "
                        "Each worker's BLAS/OpenMP threads default to max(1, (cores - 1) // N), leaving a core "
                        "to the HTTP process; set OMP_NUM_THREADS / OPENBLAS_NUM_THREADS to override")
    p.add_argument("--max-batch-size", type=int, metavar="B",
                   help="largest batch the dynamic batcher forms (0 or 1: no batching; default 32)")
    p.add_argument("--max-queue-delay-ms", type=float, metavar="D",
                   help="longest a request waits for a batch to fill, only while some but not all of the "
                        "model's slots (workers x instances) are busy; an idle model runs a request at once "
                        "(default 0.5)")
    p.add_argument("--queue-size", type=int, metavar="Q",
                   help="queued requests per model version before 503 + Retry-After (default 1024)")
    p.add_argument("--timeout-ms", type=float, metavar="T",
                   help="default request deadline, 504 after it (default 30000; a request may ask for less)")
    p.add_argument("--max-body-mb", type=float, default=64.0, metavar="M",
                   help="largest request body in MiB, 413 above it (default 64)")
    p.add_argument("--backend", choices=("kiln", "onnxruntime"),
                   help="execution engine (default kiln; onnxruntime needs pip install kiln[onnx])")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default warning)")
    p.add_argument("--access-log", action="store_true", help="log every request (off by default: it costs time)")


def _overrides(args: argparse.Namespace) -> dict:
    return {"workers": args.workers, "max_batch_size": args.max_batch_size,
            "max_queue_delay_ms": args.max_queue_delay_ms, "queue_size": args.queue_size,
            "timeout_ms": args.timeout_ms, "backend": args.backend}


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), or a KilnError that says why not."""
    if not 0 <= port <= 65535:
        raise KilnError(f"--port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise KilnError(f"cannot listen on host '{host}': {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    # The proto from getaddrinfo (IPPROTO_TCP), not 0: asyncio's event loop turns Nagle's algorithm off
    # (TCP_NODELAY) on accepted connections only when the listening socket says IPPROTO_TCP. With proto 0
    # and without uvloop, a keep-alive response written in two parts (headers, body) waited ~40 ms for
    # the client's delayed ACK. TCP_NODELAY is also set on the listener, which Linux copies to every
    # accepted connection, so the setting does not depend on the event loop at all.
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise KilnError(f"port {port} on {host} is already in use (is another server running? "
                            f"pick another with --port)") from None
        if e.errno == errno.EACCES:
            raise KilnError(f"permission denied listening on {host}:{port} "
                            "(ports below 1024 need privileges)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise KilnError(f"cannot listen on {host}: it is not an address of this machine") from None
        raise KilnError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def _url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
        from kiln.server.app import create_app
    except ImportError as e:
        raise KilnError(f"kiln serve needs the server extra: pip install 'kiln[serve]' ({e.name} is missing)") from None
    from kiln.server.repository import discover

    if args.max_body_mb <= 0:
        raise KilnError(f"--max-body-mb must be positive, got {args.max_body_mb:g}")
    entries = discover(args.path, name=args.name, overrides=_overrides(args))
    sock = bind_socket(args.host, args.port)
    url = _url(sock, args.host)
    failure: list[BaseException] = []
    server: Optional[uvicorn.Server] = None

    def on_ready(state) -> None:
        print(f"kiln serve: ready at {url}", flush=True)
        for e in entries:
            c = e.config
            how = f"{c.workers} worker process{'es' if c.workers != 1 else ''}" if c.workers else "threads"
            batching = f"batches up to {c.max_batch_size}" if c.batching else "no batching"
            print(f"  {e.name} version {e.version}: {e.path} ({how}, {batching}, backend {c.backend})", flush=True)
        print(f"  {url}/v2/models/{entries[0].name}/infer, metrics at {url}/metrics, docs at {url}/docs",
              flush=True)

    def on_load_error(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(entries, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                     on_ready=on_ready, on_load_error=on_load_error)
    state = app.state.kiln
    # uvicorn waits this long for in-flight requests after a signal; each already has its own deadline.
    grace = max(e.config.timeout_ms for e in entries) / 1000.0 + 5.0
    config = uvicorn.Config(app, lifespan="on", log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=grace, server_header=False)
    logging.getLogger("kiln.server").setLevel(args.log_level.upper())
    server = _make_server(config, state)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failure:
        e = failure[0]
        raise KilnError(f"loading models failed: {e if isinstance(e, KilnError) else f'{type(e).__name__}: {e}'}")
    if server.signalled:
        print("kiln serve: stopped", file=sys.stderr, flush=True)
    return 0


def _make_server(config, state):
    """uvicorn.Server, plus: a signal starts draining at once, and a graceful stop exits 0."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        signalled = False
        _loop = None

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutting down; a clean drain is exit 0.
            self._captured_signals.clear()
            self.signalled = True
            if first and self._loop is not None:
                self._loop.call_soon_threadsafe(state.begin_drain)

    return Server(config)
