"""kiln on a real local Ray cluster (issue 19): a head and two worker nodes started as separate processes with
``ray start`` (different resources), Ray Serve replicas of kiln's V2 app spread over them, and the cluster's
failure modes: 2,000 distinct requests all equal to ``Program.run``; a replica killed under load (its requests
answered or refused with a 5xx, never wrong, never lost; Serve replaces it); autoscaling from 1 replica up under
load and back down; a rolling update to a new model version with zero failed requests.

Needs ``ray[serve]`` (CI runs it in the Ray venv). Everything listens on 127.0.0.1; each test is bounded in
time. The cluster is one per module (starting three nodes costs about 20 s on a 2-core machine).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

# Ray >= 2.59 authenticates a cluster's RPCs with a token: every node and this driver share one, set before
# Ray is imported (its C++ client reads the environment then). Another module that imported Ray first (and
# started a local instance in this process) would be left with mismatched settings, so this module runs in a
# pytest process of its own (.ci/run does so).
if "ray" in sys.modules and os.environ.get("RAY_AUTH_MODE") != "token":
    pytest.skip("the cluster tests need a pytest process of their own: Ray was imported before their auth "
                "settings (run tests/server/test_ray_cluster.py alone)", allow_module_level=True)
_TOKEN = os.environ.setdefault("RAY_AUTH_TOKEN", os.urandom(16).hex())
os.environ.setdefault("RAY_AUTH_MODE", "token")

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

import kiln  # noqa: E402
from kiln.server.ray_serve import deployment  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args, timeout=120):
    # Stated, not inherited: a local ray.init earlier in this process (another module's) may have changed them.
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=_TOKEN)
    r = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"ray {' '.join(args)}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head (2 CPUs, resource head) and two workers (1 CPU each; resources node_a, node_b), each its own
    ``ray start`` process tree; a driver connected to it; Serve's proxy on a loopback port."""
    if shutil.which(RAY) is None and not Path(RAY).exists():
        pytest.skip("the ray command is not installed beside this Python")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    _ray("start", "--head", "--port", str(port), "--num-cpus", "2", "--resources", '{"head": 1}',
         "--include-dashboard", "false", *common)
    try:
        for name in ("node_a", "node_b"):
            _ray("start", "--address", address, "--num-cpus", "1", "--resources", f'{{"{name}": 1}}', *common)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=_TOKEN)
        ray.init(address=address, log_to_driver=False)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < 3:
            assert time.monotonic() < deadline, ray.nodes()
            time.sleep(0.5)
        http = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http})
        yield f"http://127.0.0.1:{http}"
    finally:
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001 - the cluster goes anyway
            pass
        ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def _requests(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(n)]


def _infer(client: "httpx.Client", url: str, x: np.ndarray):
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = client.post(url + "/v2/models/mlp/infer", json=body)
    if r.status_code != 200:
        return r.status_code, None
    return 200, {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}


def _hammer(url: str, xs: list, threads: int = 12, stop: threading.Event = None):
    """Send every input once (or, with ``stop``, keep cycling through them until it is set); returns a list
    of (index, status, outputs) with one entry per request sent."""
    results, lock = [], threading.Lock()
    counter = iter(range(10**9))

    def worker():
        with httpx.Client(timeout=60) as c:
            while True:
                k = next(counter)
                if stop is None and k >= len(xs):
                    return
                if stop is not None and stop.is_set():
                    return
                i = k % len(xs)
                try:
                    status, out = _infer(c, url, xs[i])
                except httpx.HTTPError as e:  # a connection refused or cut: recorded, never dropped
                    status, out = f"{type(e).__name__}", None
                with lock:
                    results.append((i, status, out))
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


@contextlib.contextmanager
def _under_load(url: str, xs: list, threads: int):
    """Clients cycling through ``xs`` while the block runs; the list it yields holds every request's
    (index, status, outputs) once the block has ended (the clients stop and are joined even if it raises)."""
    stop = threading.Event()
    results: list = []
    load = threading.Thread(target=lambda: results.extend(_hammer(url, xs, threads=threads, stop=stop)))
    load.start()
    try:
        yield results
    finally:
        stop.set()
        load.join(timeout=120)


def _replicas(app: str = "kiln") -> dict:
    st = serve.status().applications.get(app)
    if st is None:
        return {}
    (dep,) = st.deployments.values()
    return dict(dep.replica_states)


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {_replicas()}"
        time.sleep(0.5)


def _replica_actors(app: str = "kiln") -> list:
    """Handles of this application's live replica actors (named actors in Serve's namespace; no dashboard
    needed, unlike the state API)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == "serve" and "SERVE_REPLICA" in a["name"] and app in a["name"]]
    handles = []
    for n in names:
        try:
            handles.append(ray.get_actor(n, namespace="serve"))
        except ValueError:  # gone meanwhile
            pass
    return handles


def _replica_nodes(app: str = "kiln") -> set:
    """The node ids that host this application's replica actors (each asked where it runs)."""
    return set(ray.get([h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                        for h in _replica_actors(app)], timeout=30))


def test_2000_distinct_requests_over_replicas_on_three_nodes(cluster):
    serve.run(deployment(str(MLP), name="mlp", replicas=3, num_cpus=0.25, overrides={"workers": 0}),
              name="kiln", route_prefix="/")
    _wait(lambda: _replicas().get("RUNNING") == 3, 90, "3 running replicas")
    nodes = _replica_nodes()
    assert len(nodes) >= 2, f"replicas on {len(nodes)} node(s): Ray placed them all on one"
    program = kiln.load(MLP)
    xs = _requests(2000, 11)
    results = _hammer(cluster, xs, threads=16)
    assert len(results) == 2000 and sorted(i for i, _, _ in results) == list(range(2000))  # none lost
    assert all(status == 200 for _, status, _ in results), {s for _, s, _ in results}
    for i, _, got in results:
        for name, want in program.run({"x": xs[i]}).items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)
    serve.delete("kiln")


def test_a_replica_killed_under_load_loses_no_request_and_is_replaced(cluster):
    serve.run(deployment(str(MLP), name="mlp", replicas=2, num_cpus=0.25, overrides={"workers": 0}),
              name="kiln", route_prefix="/")
    _wait(lambda: _replicas().get("RUNNING") == 2, 90, "2 running replicas")
    program = kiln.load(MLP)
    xs = _requests(64, 12)
    want = [next(iter(program.run({"x": x}).values())) for x in xs]
    with _under_load(cluster, xs, threads=8) as results:
        time.sleep(3)
        victims = _replica_actors()
        assert len(victims) == 2, "replica actors not found"
        ray.kill(victims[0], no_restart=True)
        time.sleep(6)
    assert len(results) > 100
    wrong = 0
    for i, status, got in results:
        if status == 200:
            wrong += not np.allclose(next(iter(got.values())), want[i], rtol=1e-5, atol=1e-6)
        else:  # refused, not wrong: a 5xx or a cut connection, counted
            assert status in (500, 502, 503, 504) or isinstance(status, str), status
    assert wrong == 0
    failed = sum(1 for _, s, _ in results if s != 200)
    print(f"replica killed under load: {len(results)} requests, {failed} refused, 0 wrong")
    assert failed <= len(results) // 10, f"{failed} of {len(results)} refused"  # only the killed replica's in-flight ones
    _wait(lambda: _replicas().get("RUNNING") == 2, 90, "Serve to replace the killed replica")
    serve.delete("kiln")


def test_autoscaling_goes_up_under_load_and_back_down(cluster):
    fast = {"target_ongoing_requests": 1, "upscale_delay_s": 1, "downscale_delay_s": 3, "metrics_interval_s": 0.5,
            "look_back_period_s": 2}
    serve.run(deployment(str(MLP), name="mlp", autoscale=(1, 3), num_cpus=0.25, overrides={"workers": 0},
                         autoscaling=fast), name="kiln", route_prefix="/")
    _wait(lambda: _replicas().get("RUNNING") == 1, 90, "1 running replica")
    xs = _requests(64, 13)
    seen = {"max": 1}
    with _under_load(cluster, xs, threads=12):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and seen["max"] < 2:
            seen["max"] = max(seen["max"], _replicas().get("RUNNING", 0))
            time.sleep(0.5)
    print(f"autoscaling: up to {seen['max']} replicas under load")
    assert seen["max"] >= 2, f"never scaled up: {_replicas()}"
    _wait(lambda: _replicas().get("RUNNING") == 1 and len(_replicas()) == 1, 90, "scaling back down to 1")
    serve.delete("kiln")


def test_a_rolling_update_to_a_new_version_fails_no_request(cluster, tmp_path):
    # Version 2: the same model with other weights (every output differs), so each answer says which served it.
    g = kiln.load_graph(MLP)
    for v in g.initializers.values():
        if v.const.dtype == np.float32 and v.const.ndim == 2:
            v.const = (v.const * 0.5).astype(np.float32)
    v2 = kiln.save(g, tmp_path / "mlp_v2.kiln")
    serve.run(deployment(str(MLP), name="mlp", replicas=2, num_cpus=0.25, overrides={"workers": 0}),
              name="kiln", route_prefix="/")
    _wait(lambda: _replicas().get("RUNNING") == 2, 90, "2 running replicas")
    xs = _requests(64, 14)
    old, new = kiln.load(MLP), kiln.load(v2)

    def first(p, x):
        return next(iter(p.run({"x": x}).values()))
    want_old, want_new = [first(old, x) for x in xs], [first(new, x) for x in xs]
    with _under_load(cluster, xs, threads=8) as results:
        time.sleep(2)
        # serve.run returns once the new version's replicas run; Serve replaces the old ones one by one,
        # draining each (graceful_shutdown_timeout_s), while the load goes on
        serve.run(deployment(str(v2), name="mlp", replicas=2, num_cpus=0.25, overrides={"workers": 0}),
                  name="kiln", route_prefix="/")
        _wait(lambda: _replicas() == {"RUNNING": 2}, 90, "the update to finish")
        time.sleep(3)  # requests after the update: only version 2 answers
    assert all(s == 200 for _, s, _ in results), {s for _, s, _ in results if s != 200}  # zero failed
    served = []
    for i, _, got in results:
        y = next(iter(got.values()))
        is_old = np.allclose(y, want_old[i], rtol=1e-5, atol=1e-6)
        is_new = np.allclose(y, want_new[i], rtol=1e-5, atol=1e-6)
        assert is_old or is_new, "an answer from neither version"
        served.append("new" if is_new else "old")
    print(f"rolling update: {len(results)} requests, 0 failed, {served.count('old')} by v1, {served.count('new')} by v2")
    assert "old" in served and served[-20:] == ["new"] * 20, served[-30:]
    serve.delete("kiln")


def test_a_shipped_model_reaches_replicas_through_the_object_store(cluster, tmp_path):
    """ship=True: the file's bytes go through Ray's object store once; a replica started after the file is gone
    from the path (a node that never saw it) still loads and answers."""
    import shutil as sh
    path = tmp_path / "only_here.kiln"
    sh.copy(MLP, path)
    serve.run(deployment(str(path), name="mlp", replicas=1, num_cpus=0.25, overrides={"workers": 0}, ship=True),
              name="kiln", route_prefix="/")
    _wait(lambda: _replicas().get("RUNNING") == 1, 90, "1 running replica")
    path.unlink()  # from now on no node sees the path
    (victim,) = _replica_actors()
    ray.kill(victim, no_restart=True)  # Serve starts a new replica: it can only get the model from the store
    time.sleep(2)
    _wait(lambda: _replicas() == {"RUNNING": 1}, 90, "the replacement replica")
    program = kiln.load(MLP)
    xs = _requests(20, 15)
    results = _hammer(cluster, xs, threads=4)
    assert all(s == 200 for _, s, _ in results), {s for _, s, _ in results}
    for i, _, got in results:
        np.testing.assert_allclose(next(iter(got.values())), next(iter(program.run({"x": xs[i]}).values())),
                                   rtol=1e-5, atol=1e-6)
    serve.delete("kiln")


def test_ship_refuses_a_repository(cluster, tmp_path):
    from kiln.errors import KilnError
    with pytest.raises(KilnError, match="is not a file"):
        deployment(str(tmp_path), ship=True)
