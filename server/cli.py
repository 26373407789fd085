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
- **Connections are guarded** (server/connections.py): header and body read timeouts, a send timeout,
  caps on connections in total and per client that evict the slowest waiting connection first and keep
  a reserve for health checks, a lingering close, and the open-file limit raised to its hard limit at
  start (``resource.setrlimit``), so slow or idle connections cannot lock legitimate clients out. On
  SIGTERM open connections keep being read until the drain ends (each request answered 503 +
  ``Connection: close``), and the listener stops new handshakes before it closes, so a client either
  gets an answer or is refused at connect.
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
    p.add_argument("--grpc-port", type=int, metavar="P",
                   help="port for the V2 protocol over gRPC (Triton's GRPCInferenceService, what tritonclient.grpc "
                        "calls; default 8001, or 0 with --port 0; 0 picks a free one, printed when ready)")
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only (no gRPC endpoint)")
    p.add_argument("--name", help="model name for a single model file (default: the file's stem)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="worker processes per model version (0: threads in the server process; default 1). "
                        "Each worker's BLAS/OpenMP threads default to max(1, (cores - 1) // N), leaving a core "
                        "to the HTTP process; set OMP_NUM_THREADS / OPENBLAS_NUM_THREADS to override")
    p.add_argument("--max-batch-size", type=int, metavar="B",
                   help="largest batch the dynamic batcher forms (0 or 1: no batching; default 32)")
    p.add_argument("--batching", choices=("auto", "force", "off"),
                   help="auto (default): stack requests only for models kiln proves row-independent (each "
                        "output row depends only on its own input row; the others run request by request, "
                        "and the log says why); force: stack any model with a shared symbolic dim 0; "
                        "off: never stack")
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
    p.add_argument("--max-connections", type=int, metavar="N", default=0,
                   help="open connections at most (default 0: the open-file limit, raised to its hard limit at "
                        "start, less a reserve for the process); when full, the connection that has waited "
                        "longest for a request head is closed to make room; the last 32 slots take only "
                        "health checks")
    p.add_argument("--max-connections-per-client", type=int, metavar="N",
                   help="open connections per client address at most (default: a quarter of --max-connections; "
                        "0: no per-client cap, e.g. behind a proxy)")
    p.add_argument("--header-timeout-s", type=float, default=10.0, metavar="S",
                   help="a request head (request line and headers) must arrive within S seconds of the "
                        "connection or of the previous response, else 408 (default 10)")
    p.add_argument("--body-timeout-s", type=float, default=30.0, metavar="S",
                   help="a request body may take S seconds plus 1 s per 32 KiB received, else 408 (default 30)")
    p.add_argument("--keep-alive-s", type=float, default=5.0, metavar="S",
                   help="an idle keep-alive connection is closed after S seconds (default 5)")
    p.add_argument("--allow-client-shm", action="store_true",
                   help="let clients register system shared memory regions (/v2/systemsharedmemory, Triton's "
                        "extension; off by default, as in Triton: a client can then make the server read and "
                        "write /dev/shm objects its user can open). Also KILN_ALLOW_CLIENT_SHM=1")
    p.add_argument("--memory-budget", metavar="BYTES",
                   help="the most buffer memory one run may allocate, e.g. 4GiB: a model needing more fails to "
                        "load, a request needing more gets 413 (default: KILN_MEMORY_BUDGET, else none)")
    p.add_argument("--device", metavar="DEV",
                   help="cpu (default), cuda or cuda:N: run models as CudaPrograms in GPU worker processes, one "
                        "per GPU instance (instance_group kind gpu in config.json: count workers on each listed "
                        "GPU; else --workers on GPU N), batch buckets on with a CUDA graph captured per bucket "
                        "before ready; needs CuPy and a GPU")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"),
                   help="convert models at load (fp16 on a GPU: tensor cores; the CPU computes in float32); "
                        "default: as the files are (config.json key 'precision')")
    p.add_argument("--backend", choices=("kiln", "onnxruntime"),
                   help="execution engine (default kiln; onnxruntime needs pip install 'kiln-compiler[onnx]')")
    ray = p.add_argument_group("Ray Serve (scale-out over a Ray cluster; pip install 'ray[serve]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: replicas of this server behind Ray's HTTP proxy on --host/--port")
    ray.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster (default: start a local one)")
    ray.add_argument("--replicas", type=int, default=1, metavar="N", help="Ray Serve replicas (default 1)")
    ray.add_argument("--autoscale", metavar="MIN:MAX", help="autoscale between MIN and MAX replicas on ongoing requests")
    ray.add_argument("--replica-cpus", type=float, default=1.0, metavar="C", help="CPUs Ray reserves per replica")
    ray.add_argument("--replica-gpus", type=float, default=0.0, metavar="G", help="GPUs per replica (with --device cuda)")
    ray.add_argument("--replica-max-ongoing", type=int, default=128, metavar="N",
                     help="requests Ray Serve sends one replica at a time, into kiln's batcher (default 128; "
                          "Ray's own default, 5, starves a batching replica)")
    ray.add_argument("--ray-proxy", choices=("ray", "haproxy"), default="ray",
                     help="Ray Serve's ingress: its Python HTTP proxy (default) or HAProxy, about 5x the requests/s "
                          "for large tensors (Ray's RAY_SERVE_ENABLE_HA_PROXY; a joined cluster must be started "
                          "with it)")
    ray.add_argument("--ray-ship", action="store_true",
                     help="send the model file to the replicas through Ray's object store (for nodes that do not "
                          "see PATH; default: each replica maps PATH itself)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default warning)")
    p.add_argument("--access-log", action="store_true", help="log every request (off by default: it costs time)")


def _overrides(args: argparse.Namespace) -> dict:
    return {"workers": args.workers, "max_batch_size": args.max_batch_size,
            "max_queue_delay_ms": args.max_queue_delay_ms, "queue_size": args.queue_size,
            "timeout_ms": args.timeout_ms, "backend": args.backend, "batching": args.batching,
            "memory_budget": args.memory_budget, "device": getattr(args, "device", None),
            "precision": getattr(args, "precision", None)}


def _serve_on_ray(args: argparse.Namespace) -> int:
    """``kiln serve PATH --ray``: server/ray_serve.py."""
    from kiln.server.repository import discover
    overrides = {k: v for k, v in _overrides(args).items() if v is not None}
    discover(args.path, name=args.name, overrides=overrides)  # a bad path or config fails now, not in a replica
    if args.replicas < 1:
        raise KilnError(f"--replicas must be at least 1, got {args.replicas}")
    if args.replica_max_ongoing < 1:
        raise KilnError(f"--replica-max-ongoing must be at least 1, got {args.replica_max_ongoing}")
    autoscale = None
    if args.autoscale:
        lo, sep, hi = args.autoscale.partition(":")
        if not sep or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
            raise KilnError(f"--autoscale takes MIN:MAX with 1 <= MIN <= MAX, got {args.autoscale!r}")
        autoscale = (int(lo), int(hi))
    try:
        import ray  # noqa: F401  (imported to say what is missing, before any Ray work)
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise KilnError(f"--ray needs Ray Serve: pip install 'ray[serve]' ({e.name} is missing)") from None
    from kiln.server.ray_serve import serve_on_ray
    serve_on_ray(str(args.path), host=args.host, port=args.port, address=args.ray_address, proxy=args.ray_proxy,
                 name=args.name, overrides=overrides, replicas=args.replicas, autoscale=autoscale,
                 num_cpus=args.replica_cpus, num_gpus=args.replica_gpus, ship=args.ray_ship, max_ongoing_requests=args.replica_max_ongoing)
    return 0


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
    if getattr(args, "ray", False):
        return _serve_on_ray(args)
    if getattr(args, "ray_address", None) or getattr(args, "autoscale", None) or getattr(args, "replicas", 1) != 1 \
            or getattr(args, "ray_ship", False) or getattr(args, "replica_max_ongoing", 128) != 128 \
            or getattr(args, "ray_proxy", "ray") != "ray":
        raise KilnError("--ray-address, --replicas, --autoscale, --replica-max-ongoing, --ray-proxy and --ray-ship "
                        "go with --ray")
    try:
        import uvicorn
        from kiln.server.app import create_app
    except ImportError as e:
        raise KilnError(f"kiln serve needs the server extra: pip install 'kiln-compiler[serve]' ({e.name} is missing)") from None
    from kiln.server.repository import check_cpu_only, discover

    from kiln.server.connections import ConnectionLimits, ConnectionTracker, make_protocol_class, raise_open_file_limit

    if args.max_body_mb <= 0:
        raise KilnError(f"--max-body-mb must be positive, got {args.max_body_mb:g}")
    for flag in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
        value = getattr(args, flag)
        if not 0 < value < 1e6:
            raise KilnError(f"--{flag.replace('_', '-')} must be a positive number of seconds, got {value:g}")
    for flag in ("max_connections", "max_connections_per_client"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise KilnError(f"--{flag.replace('_', '-')} must be 0 or more, got {value}")
    raise_open_file_limit()  # before the limits are derived from it
    limits = ConnectionLimits(header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                              keep_alive_s=args.keep_alive_s, max_connections=args.max_connections,
                              max_connections_per_client=args.max_connections_per_client).resolve()
    entries = discover(args.path, name=args.name, overrides=_overrides(args))
    check_cpu_only(entries)  # a gpu instance_group on the CPU is refused before any port is bound
    from kiln.server.gpu import check_gpus
    check_gpus(entries)  # --device cuda: CuPy and the GPUs named, before any port is bound
    grpc_server = _grpc_server(args)  # before any port is bound: a missing grpcio is one clear error
    sock = bind_socket(args.host, args.port)
    url = _url(sock, args.host)
    failure: list[BaseException] = []
    server: Optional[uvicorn.Server] = None

    def on_ready(state) -> None:
        print(f"kiln serve: ready at {url}", flush=True)
        for e in entries:
            c = e.config
            failed = state.models[e.name][e.version].error
            if failed is not None:  # a GPU model that failed to load (server/app.py ServerState.load)
                print(f"  {e.name} version {e.version}: {e.path} FAILED to load, not ready: {failed}", flush=True)
                continue
            how = f"{c.workers} worker process{'es' if c.workers != 1 else ''}" if c.workers else "threads"
            gpus = getattr(state.models[e.name][e.version].executor, "slots", None)
            if gpus:
                how = f"{len(gpus)} GPU worker process{'es' if len(gpus) != 1 else ''} on GPU(s) {sorted(set(gpus))}"
            decision = getattr(state.models[e.name][e.version].batcher, "decision", None)
            stacks = decision.stacks if decision is not None else c.may_batch
            batching = f"batches up to {c.max_batch_size}" if stacks else "no batching"
            print(f"  {e.name} version {e.version}: {e.path} ({how}, {batching}, backend {c.backend})", flush=True)
            if decision is not None and c.may_batch:
                print(f"    batching: {decision.reason}", flush=True)
            buckets = getattr(state.models[e.name][e.version].executor, "buckets", None)
            if c.uses_buckets and isinstance(buckets, tuple):
                print(f"    batch buckets: {list(buckets) or 'none (runs unbatched)'}, each warmed up", flush=True)
        per_client = limits.max_connections_per_client or "no cap"
        print(f"  connections: at most {limits.max_connections:,} ({per_client} per client, the last "
              f"{limits.health_reserve} for health checks); a request head within {limits.header_timeout_s:g} s, "
              f"a body within {limits.body_timeout_s:g} s + 1 s per {limits.body_min_rate >> 10} KiB", flush=True)
        if grpc_server is not None:
            print(f"  gRPC at {grpc_server.address} (Triton's GRPCInferenceService: tritonclient.grpc)", flush=True)
        print(f"  {url}/v2/models/{entries[0].name}/infer, metrics at {url}/metrics, docs at {url}/docs",
              flush=True)

    def on_load_error(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(entries, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                     on_ready=on_ready, on_load_error=on_load_error,
                     allow_client_shm=True if args.allow_client_shm else None)
    state = app.state.kiln
    if grpc_server is not None:
        grpc_server.state, grpc_server.max_message_bytes = state, int(args.max_body_mb * (1 << 20))
    # Drained: the batchers' drain (started by the signal) is over, or none was started (uvicorn is stopping
    # for another reason, a failed load say), so idle connections need not wait for one.
    tracker = ConnectionTracker(limits, drained=lambda: state._drain_task is None or state._drain_task.done())
    state.connections = tracker  # for /metrics
    protocol_class = make_protocol_class(tracker)
    # uvicorn waits this long for in-flight requests after a signal; each already has its own deadline.
    grace = max(e.config.timeout_ms for e in entries) / 1000.0 + 5.0
    config = uvicorn.Config(app, lifespan="on", log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=grace, server_header=False,
                            http=protocol_class or "auto", timeout_keep_alive=limits.keep_alive_s)
    logging.getLogger("kiln.server").setLevel(args.log_level.upper())
    server = _make_server(config, state, tracker if protocol_class is not None else None, grpc_server, grace)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failure:
        e = failure[0]
        # Chained: `kiln serve` adds a hint for the cause's type (an op kiln's ONNX importer refuses).
        raise KilnError(f"loading models failed: {e if isinstance(e, KilnError) else f'{type(e).__name__}: {e}'}") \
            from e
    if server.signalled:
        print("kiln serve: stopped", file=sys.stderr, flush=True)
    return 0


def _grpc_server(args: argparse.Namespace):
    """The gRPC endpoint (server/grpc_server.py) ``kiln serve`` starts next to HTTP, or None (--no-grpc, or
    grpcio missing while --grpc-port was not asked for: a warning, HTTP only). Default port 8001 (Triton's),
    or 0 when --port is 0, so servers started on free ports never collide on 8001."""
    asked = getattr(args, "grpc_port", None)
    if getattr(args, "no_grpc", False):
        if asked is not None:
            raise KilnError("--grpc-port and --no-grpc contradict each other")
        return None
    port = asked
    if port is None:
        port = 0 if args.port == 0 else 8001
    if not 0 <= port <= 65535:
        raise KilnError(f"--grpc-port must be between 0 and 65535, got {port}")
    try:
        from kiln.server.grpc_server import GrpcServer
    except ImportError as e:
        if asked is not None:
            raise KilnError(f"--grpc-port needs grpcio and tritonclient[grpc]: pip install 'kiln-compiler[serve]' "
                            f"({e.name} is missing)") from None
        print(f"kiln serve: no gRPC endpoint ({e.name} is missing: pip install 'kiln-compiler[serve]'); "
              "serving HTTP only", file=sys.stderr, flush=True)
        return None
    return GrpcServer(None, args.host, port, 0)


def _make_server(config, state, tracker=None, grpc_server=None, grace: float = 30.0):
    """uvicorn.Server, plus: a signal starts draining at once, the listener hands over its accept queue
    before it closes, a graceful stop exits 0, and the gRPC endpoint (if any) starts and stops with it."""
    import asyncio

    import uvicorn

    from kiln.server.connections import accept_pending, stop_handshakes

    class Server(uvicorn.Server):
        signalled = False
        _loop = None

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            if grpc_server is not None:
                await grpc_server.start()  # a KilnError (port taken) ends the serve before anything loads
            await super().serve(sockets=sockets)

        async def shutdown(self, sockets=None) -> None:
            if grpc_server is not None:  # open streams answer what they read, then end (server/grpc_server.py)
                await grpc_server.stop(grace)
            # uvicorn closes the listening socket first, which resets every connection still in the kernel's
            # accept queue: clients that connected (and maybe wrote a request) and get no answer. Instead:
            # stop new handshakes, accept what is queued and serve it like any connection (503 + close while
            # draining), then let uvicorn close the socket, which now refuses only clients that sent nothing.
            if tracker is not None and sockets:
                loop = asyncio.get_running_loop()

                def factory():
                    return config.http_protocol_class(config=config, server_state=self.server_state,
                                                      app_state=self.lifespan.state, _loop=loop)
                pending = []
                for sock in sockets:
                    if stop_handshakes(sock):
                        pending += accept_pending(sock)
                for conn in pending:
                    try:
                        await loop.connect_accepted_socket(factory, conn)
                    except OSError:
                        conn.close()
            await super().shutdown(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutting down; a clean drain is exit 0.
            self._captured_signals.clear()
            self.signalled = True
            if first and self._loop is not None:
                self._loop.call_soon_threadsafe(state.begin_drain)
                if tracker is not None:
                    self._loop.call_soon_threadsafe(tracker.begin_drain)

    return Server(config)
