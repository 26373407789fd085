"""``kiln deploy kserve PATH -o DIR``: what it takes to run a kiln model on KServe (issue 19).

KServe runs model servers on Kubernetes: a ``ServingRuntime`` (or cluster-wide ``ClusterServingRuntime``)
names a container that speaks a protocol and the model formats it serves; an ``InferenceService`` asks for a
model (a format and a ``storageUri``) and KServe picks a runtime, downloads the model to ``/mnt/models`` in
the pod and routes V2 requests to it. kiln serve already speaks the V2 protocol KServe's ``v2`` runtimes
speak (the same routes, health probes and tritonclient compatibility), so the deployment is configuration:

- ``model-repository/``: the model laid out as a kiln (Triton-style) repository, ``<name>/1/model.kiln`` plus
  its ``config.json`` (or a copy of the repository given): upload it to the storage the ``storageUri``
  names; KServe copies it to ``/mnt/models`` and the container runs ``kiln serve /mnt/models``;
- ``servingruntime.yaml``: a ``ClusterServingRuntime`` (``--namespaced``: a ``ServingRuntime``) named
  ``kiln`` for the formats ``kiln`` and ``onnx``, protocol ``v2``, HTTP on 8080, liveness and readiness
  probes on ``/v2/health/live`` and ``/v2/health/ready`` (ready only once every model is loaded and warmed
  up), a non-root user, and with ``--gpu`` one ``nvidia.com/gpu`` and ``kiln serve --device cuda``;
- ``inferenceservice.yaml``: an ``InferenceService`` for this model (format ``kiln``, protocol v2, the
  runtime above, the ``--storage-uri``);
- ``Dockerfile.cpu`` / ``Dockerfile.cuda``: the container (Python 3.11, kiln with the ``serve`` extra; the
  CUDA one on an NVIDIA CUDA runtime base with CuPy), a non-root user, ``EXPOSE 8080``, a HEALTHCHECK on
  ``/v2/health/live``, ``ENTRYPOINT ["kiln"]``;
- ``README.md``: the steps (build and push the image, upload the repository, ``kubectl apply``).

Manifests are YAML written here (a small emitter: block mappings and sequences, every scalar quoted as JSON,
which YAML reads as is), so writing them needs no YAML package. They are checked in the tests against
KServe's own Python models (the ``kserve`` SDK: every field survives a round trip through them) and the
container's command is run as a plain process (Docker is not available on kiln's build machines).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from kiln.errors import KilnError
from kiln.version import __version__

PORT = 8080
MODEL_DIR = "/mnt/models"
FILES = ("servingruntime.yaml", "inferenceservice.yaml", "Dockerfile.cpu", "Dockerfile.cuda", "README.md",
         "model-repository")
_DNS = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")


# ------------------------------------------------------------------------------------------------ YAML

def to_yaml(obj: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists and scalars (scalars as JSON: valid YAML, no quoting rules to get wrong)."""
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return pad + "{}\n"
        out = []
        for k, v in obj.items():
            key = json.dumps(str(k)) if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-/]*", str(k)) else str(k)
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{key}:\n{to_yaml(v, indent + 2)}")
            else:
                out.append(f"{pad}{key}: {_scalar(v)}\n")
        return "".join(out)
    if isinstance(obj, list):
        if not obj:
            return pad + "[]\n"
        out = []
        for v in obj:
            if isinstance(v, (dict, list)) and v:
                inner = to_yaml(v, indent + 2)
                out.append(f"{pad}- {inner[indent + 2:]}")
            else:
                out.append(f"{pad}- {_scalar(v)}\n")
        return "".join(out)
    return pad + _scalar(obj) + "\n"


def _scalar(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return json.dumps(v)


# ------------------------------------------------------------------------------------------ manifests

def serving_runtime(*, image: str, gpu: bool, namespaced: bool, namespace: Optional[str] = None) -> dict:
    """The (Cluster)ServingRuntime for kiln serve."""
    args = ["serve", MODEL_DIR, "--host", "0.0.0.0", "--port", str(PORT)] + (["--device", "cuda"] if gpu else [])
    probe = {"httpGet": {"path": "/v2/health/live", "port": PORT}, "periodSeconds": 10, "failureThreshold": 3}
    ready = {"httpGet": {"path": "/v2/health/ready", "port": PORT}, "periodSeconds": 5, "failureThreshold": 3}
    limits = {"cpu": "2", "memory": "4Gi"}
    if gpu:
        limits["nvidia.com/gpu"] = "1"
    container = {
        "name": "kserve-container",
        "image": image,
        "args": args,
        "ports": [{"containerPort": PORT, "name": "http1", "protocol": "TCP"}],
        "livenessProbe": probe,
        "readinessProbe": ready,
        "startupProbe": {"httpGet": {"path": "/v2/health/live", "port": PORT}, "periodSeconds": 2,
                         "failureThreshold": 60},
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": limits},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }
    metadata: dict = {"name": "kiln-gpu" if gpu else "kiln"}
    if namespaced and namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime" if namespaced else "ClusterServingRuntime",
        "metadata": metadata,
        "spec": {
            "annotations": {"prometheus.kserve.io/port": str(PORT), "prometheus.kserve.io/path": "/metrics"},
            "supportedModelFormats": [{"name": "kiln", "version": "1", "autoSelect": True, "priority": 1},
                                      {"name": "onnx", "version": "1", "autoSelect": False}],
            "protocolVersions": ["v2"],
            "multiModel": False,
            "containers": [container],
        },
    }


def inference_service(*, name: str, storage_uri: str, runtime: str, gpu: bool, namespace: Optional[str] = None) -> dict:
    metadata: dict = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    model: dict = {"modelFormat": {"name": "kiln"}, "protocolVersion": "v2", "runtime": runtime,
                   "storageUri": storage_uri}
    if gpu:
        model["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": metadata,
            "spec": {"predictor": {"model": model}}}


_DOCKER_CPU = """# kiln serve on the CPU (written by `kiln deploy kserve`). Build: docker build -f Dockerfile.cpu -t {image} .
FROM python:3.11-slim
# kiln's wheel (README step 1 puts it in wheels/): the distribution kiln-compiler, built from the source checkout.
COPY wheels/ /wheels/
RUN pip install --no-cache-dir "$(ls /wheels/kiln_compiler-*.whl)[serve]" \\
 && useradd --uid 1000 --create-home kiln
USER 1000
ENV OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
EXPOSE {port}
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \\
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:{port}/v2/health/live').status != 200)"
ENTRYPOINT ["kiln"]
CMD ["serve", "{model_dir}", "--host", "0.0.0.0", "--port", "{port}"]
"""

_DOCKER_CUDA = """# kiln serve on an NVIDIA GPU (written by `kiln deploy kserve`). Build: docker build -f Dockerfile.cuda -t {image} .
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu22.04
COPY wheels/ /wheels/
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3-pip \\
 && rm -rf /var/lib/apt/lists/* \\
 && python3.11 -m pip install --no-cache-dir "$(ls /wheels/kiln_compiler-*.whl)[serve,gpu]" \\
 && useradd --uid 1000 --create-home kiln
USER 1000
ENV PYTHONUNBUFFERED=1
EXPOSE {port}
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \\
  CMD python3.11 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:{port}/v2/health/live').status != 200)"
ENTRYPOINT ["python3.11", "-m", "kiln"]
CMD ["serve", "{model_dir}", "--host", "0.0.0.0", "--port", "{port}", "--device", "cuda"]
"""

_README = """# Deploying `{name}` on KServe

Written by `kiln deploy kserve` (kiln {version}). Docker and a Kubernetes cluster are not available
where kiln is built and tested: the manifests are checked against KServe's own Python models and the
container's command is run as a plain process there; build, push and apply are yours.

1. Build kiln's wheel into `wheels/`, then build and push the image{gpu_note}:

       pip wheel --no-deps -w wheels/ /path/to/kiln      # kiln's source checkout
       docker build -f {dockerfile} -t {image} .
       docker push {image}

2. Upload `model-repository/` to the storage `{storage_uri}` names (KServe copies it to `/mnt/models` in the
   pod, and the container runs `kiln serve /mnt/models`), e.g. `aws s3 cp --recursive model-repository
   s3://...` or copy it into the PVC.

3. Install the runtime once per cluster, then the service:

       kubectl apply -f servingruntime.yaml
       kubectl apply -f inferenceservice.yaml

4. Call it with any V2 client (tritonclient works unchanged): model `{name}`, e.g.
   `POST /v2/models/{name}/infer` on the service's URL (`kubectl get inferenceservice {name}`).

The runtime's readiness probe is `/v2/health/ready` (ready once every model is loaded and warmed up), its
liveness probe `/v2/health/live`; Prometheus metrics are on `/metrics` (port {port}).
"""


def ray_config(path: str, *, replicas: int = 1, autoscale: Optional[str] = None, num_cpus: float = 1.0,
               num_gpus: float = 0.0, host: str = "0.0.0.0", port: int = 8000, max_ongoing_requests: int = 128) -> dict:
    """A Ray Serve deploy config (``serve deploy``) for kiln's app over ``path``."""
    args: dict = {"path": path, "num_cpus": num_cpus, "num_gpus": num_gpus,
                  "max_ongoing_requests": max_ongoing_requests}
    if autoscale:
        args["autoscale"] = autoscale
    else:
        args["replicas"] = replicas
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
            "applications": [{"name": "kiln", "route_prefix": "/",
                              "import_path": "kiln.server.ray_serve:build_app", "args": args}]}


def deploy_ray(path, output, *, replicas: int = 1, autoscale: Optional[str] = None, num_cpus: float = 1.0,
               num_gpus: float = 0.0, host: str = "0.0.0.0", port: int = 8000, force: bool = False,
               max_ongoing_requests: int = 128) -> str:
    """Write the Serve config of :func:`ray_config` to ``output``; returns a summary."""
    from kiln.server.repository import discover
    src, out = Path(path).resolve(), Path(output)
    discover(src)
    if replicas < 1:
        raise KilnError(f"--replicas must be at least 1, got {replicas}")
    if max_ongoing_requests < 1:
        raise KilnError(f"--replica-max-ongoing must be at least 1, got {max_ongoing_requests}")
    if autoscale is not None:
        lo, sep, hi = autoscale.partition(":")
        if not sep or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
            raise KilnError(f"--autoscale takes MIN:MAX with 1 <= MIN <= MAX, got {autoscale!r}")
    if out.exists() and not force:
        raise KilnError(f"{out} exists; give --force to overwrite")
    config = ray_config(str(src), replicas=replicas, autoscale=autoscale, num_cpus=num_cpus, num_gpus=num_gpus,
                        host=host, port=port, max_ongoing_requests=max_ongoing_requests)
    out.write_text("# Ray Serve config for kiln (written by `kiln deploy ray`): serve deploy " + out.name + "\n"
                   f"# {src} must be readable at this path on every node (shared storage).\n"
                   "# Large tensors: start the cluster with RAY_SERVE_ENABLE_HA_PROXY=1 (HAProxy ingress,\n"
                   "# about 5x the requests/s of Ray's Python proxy for ResNet-50 inputs: bench/RESULTS.md).\n"
                   + to_yaml(config))
    return f"wrote {out}: Ray Serve application 'kiln' over {src}; run: serve deploy {out}"


def _service_name(name: str) -> str:
    """``name`` as a Kubernetes name (lowercase, '_' as '-'), or a KilnError saying what a DNS label allows."""
    dns = name.lower().replace("_", "-")
    if not _DNS.match(dns) or len(dns) > 63:
        raise KilnError(f"{name!r} is not a valid InferenceService name (a DNS label: lowercase letters, digits and "
                        "'-', at most 63 characters); give --name")
    return dns


# ------------------------------------------------------------------------------------------------ CLI

def add_deploy_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="target", metavar="TARGET")
    k = sub.add_parser("kserve", help="write a KServe ServingRuntime, an InferenceService, Dockerfiles and the "
                                      "model repository to upload",
                       description="Write what it takes to run PATH on KServe (V2 protocol): "
                                   + ", ".join(FILES) + ".")
    k.add_argument("path", metavar="PATH", help="a .kiln/.onnx file or a kiln model repository directory")
    k.add_argument("-o", "--output", required=True, metavar="DIR", help="the directory to write (created)")
    k.add_argument("--name", help="the InferenceService and model name (default: the file stem; a DNS label)")
    k.add_argument("--storage-uri", metavar="URI",
                   help="where model-repository/ will be uploaded (s3://, gs://, pvc://...; default "
                        "pvc://kiln-models/NAME)")
    k.add_argument("--image", help="the container image (default kiln-serve:VERSION, with -cuda for --gpu)")
    k.add_argument("--gpu", action="store_true", help="one NVIDIA GPU per replica: kiln serve --device cuda")
    k.add_argument("--namespaced", action="store_true",
                   help="a namespaced ServingRuntime (default: a ClusterServingRuntime)")
    k.add_argument("--namespace", help="the namespace of the InferenceService (and of a --namespaced runtime)")
    k.add_argument("--precision", choices=("fp32", "fp16", "bf16"),
                   help="the model's config.json 'precision' (converted at load in the pod)")
    k.add_argument("--force", action="store_true", help="overwrite DIR's files")
    r = sub.add_parser("ray", help="write a Ray Serve config file for `serve deploy` (kiln's app as replicas)",
                       description="Write a Ray Serve config (serve deploy FILE) that runs PATH as replicas of "
                                   "kiln's V2 app (kiln.server.ray_serve:build_app). PATH is written as an "
                                   "absolute path: it must be readable at that path on every node (shared storage).")
    r.add_argument("path", metavar="PATH", help="a .kiln/.onnx file or a kiln model repository directory")
    r.add_argument("-o", "--output", required=True, metavar="FILE", help="the config to write (serve.yaml)")
    r.add_argument("--replicas", type=int, default=1, metavar="N", help="Ray Serve replicas (default 1)")
    r.add_argument("--autoscale", metavar="MIN:MAX", help="autoscale between MIN and MAX replicas instead")
    r.add_argument("--replica-cpus", type=float, default=1.0, metavar="C",
                   help="CPUs Ray reserves per replica (default 1)")
    r.add_argument("--replica-gpus", type=float, default=0.0, metavar="G",
                   help="GPUs per replica, e.g. 1, or 0.5 for two replicas on one GPU (default 0)")
    r.add_argument("--replica-max-ongoing", type=int, default=128, metavar="N",
                   help="requests Ray Serve sends one replica at a time (default 128; Ray's 5 starves kiln's batcher)")
    r.add_argument("--host", default="0.0.0.0", help="Ray Serve's HTTP proxy host (default 0.0.0.0)")
    r.add_argument("--port", type=int, default=8000, help="Ray Serve's HTTP proxy port (default 8000)")
    r.add_argument("--force", action="store_true", help="overwrite FILE")


def cmd_deploy(args: argparse.Namespace) -> int:
    target = getattr(args, "target", None)
    if target == "ray":
        print(deploy_ray(args.path, args.output, replicas=args.replicas, autoscale=args.autoscale,
                         num_cpus=args.replica_cpus, num_gpus=args.replica_gpus, host=args.host, port=args.port,
                         force=args.force, max_ongoing_requests=args.replica_max_ongoing))
        return 0
    if target != "kserve":
        raise KilnError("choose a target: kiln deploy kserve PATH -o DIR, or kiln deploy ray PATH -o serve.yaml")
    print(deploy_kserve(args.path, args.output, name=args.name, storage_uri=args.storage_uri, image=args.image,
                        gpu=args.gpu, namespaced=args.namespaced, namespace=args.namespace,
                        precision=args.precision, force=args.force))
    return 0


def deploy_kserve(path, output, *, name: Optional[str] = None, storage_uri: Optional[str] = None,
                  image: Optional[str] = None, gpu: bool = False, namespaced: bool = False,
                  namespace: Optional[str] = None, precision: Optional[str] = None, force: bool = False) -> str:
    """Write the KServe deployment of ``path`` into ``output`` (module docstring); returns a summary."""
    from kiln.server.repository import discover
    src, out = Path(path), Path(output)
    if name is not None:
        name = _service_name(name)
    entries = discover(src, name=name if src.is_file() else None)  # validates the model (or repository)
    if name is None:
        name = _service_name(entries[0].name if src.is_file() else src.resolve().name)
    if namespace is not None and not _DNS.match(namespace):
        raise KilnError(f"--namespace {namespace!r} is not a valid Kubernetes namespace")
    existing = [f for f in FILES if (out / f).exists()]
    if existing and not force:
        raise KilnError(f"{out} already has {', '.join(existing)}; give --force to overwrite")
    out.mkdir(parents=True, exist_ok=True)
    repo = out / "model-repository"
    if repo.exists():
        shutil.rmtree(repo)
    if src.is_file():
        version_dir = repo / name / "1"
        version_dir.mkdir(parents=True)
        shutil.copyfile(src, version_dir / f"model{src.suffix.lower()}")
        config: dict = {"max_batch_size": entries[0].config.max_batch_size}
        if gpu:
            config["device"] = "cuda"
        if precision and precision != "fp32":
            config["precision"] = precision
        (repo / name / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    else:
        shutil.copytree(src, repo)
    discover(repo)  # what the pod will serve, checked here
    image = image or f"kiln-serve:{__version__}{'-cuda' if gpu else ''}"
    storage_uri = storage_uri or f"pvc://kiln-models/{name}"
    runtime = serving_runtime(image=image, gpu=gpu, namespaced=namespaced, namespace=namespace)
    isvc = inference_service(name=name, storage_uri=storage_uri, runtime=runtime["metadata"]["name"], gpu=gpu,
                             namespace=namespace)
    (out / "servingruntime.yaml").write_text(to_yaml(runtime))
    (out / "inferenceservice.yaml").write_text(to_yaml(isvc))
    fields = {"port": PORT, "model_dir": MODEL_DIR}
    (out / "Dockerfile.cpu").write_text(_DOCKER_CPU.format(image=f"kiln-serve:{__version__}", **fields))
    (out / "Dockerfile.cuda").write_text(_DOCKER_CUDA.format(image=f"kiln-serve:{__version__}-cuda", **fields))
    (out / "README.md").write_text(_README.format(
        name=name, version=__version__, image=image, storage_uri=storage_uri, port=PORT,
        dockerfile="Dockerfile.cuda" if gpu else "Dockerfile.cpu",
        gpu_note=" (the CUDA variant: one NVIDIA GPU per replica)" if gpu else ""))
    served = ", ".join(sorted({e.name for e in discover(repo)}))
    return (f"wrote {out}: {runtime['kind']} '{runtime['metadata']['name']}', InferenceService '{name}' "
            f"(storageUri {storage_uri}), Dockerfile.cpu, Dockerfile.cuda, README.md, model-repository/ "
            f"({served}); next: see {out / 'README.md'}")

