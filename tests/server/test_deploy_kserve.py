"""``kiln deploy kserve`` (server/deploy.py, issue 19): the files it writes, the manifests checked against
KServe's own Python models (the ``kserve`` SDK; CI runs this module in a venv that has it), and the container's
command (the ServingRuntime's args) run as a plain process on the model repository it wrote."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

yaml = pytest.importorskip("yaml")

from kiln.cli import main  # noqa: E402
from kiln.server.deploy import FILES, deploy_kserve, to_yaml  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_yaml_emitter_round_trips_through_a_yaml_parser():
    doc = {"a": 1, "b": "two: with colon", "c": [1, "x", {"d": True, "e": None, "f": []}], "g": {},
           "weird key": "'quotes' and \"double\"", "h": [[1, 2], {"i": {"j": "-"}}], "k": "yes", "l": "0123"}
    assert yaml.safe_load(to_yaml(doc)) == doc  # "yes" and "0123" stay strings: scalars are quoted


@pytest.mark.parametrize("gpu", [False, True])
def test_writes_the_runtime_the_service_the_images_and_the_repository(tmp_path, gpu, capsys):
    out = tmp_path / "dep"
    args = ["deploy", "kserve", str(MLP), "-o", str(out), "--name", "Mlp_Model", "--storage-uri", "s3://b/m",
            "--namespace", "ml"] + (["--gpu", "--precision", "fp16"] if gpu else [])
    assert main(args) == 0
    assert "InferenceService 'mlp-model'" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    rt, isvc = _load(out / "servingruntime.yaml"), _load(out / "inferenceservice.yaml")
    assert rt["kind"] == "ClusterServingRuntime" and rt["spec"]["protocolVersions"] == ["v2"]
    assert [f["name"] for f in rt["spec"]["supportedModelFormats"]] == ["kiln", "onnx"]
    (c,) = rt["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["securityContext"]["runAsNonRoot"] is True
    assert ("--device" in c["args"]) == gpu and ("nvidia.com/gpu" in c["resources"]["limits"]) == gpu
    model = isvc["spec"]["predictor"]["model"]
    assert isvc["metadata"] == {"name": "mlp-model", "namespace": "ml"}
    assert model["storageUri"] == "s3://b/m" and model["runtime"] == rt["metadata"]["name"]
    config = json.loads((out / "model-repository" / "mlp-model" / "config.json").read_text())
    assert config.get("device") == ("cuda" if gpu else None) and config.get("precision") == ("fp16" if gpu else None)
    assert (out / "model-repository" / "mlp-model" / "1" / "model.kiln").read_bytes() == MLP.read_bytes()
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (out / name).read_text()
        for needle in ("USER 1000", "EXPOSE 8080", "HEALTHCHECK", "/v2/health/live", "/mnt/models", "wheels/"):
            assert needle in text, (name, needle)
    assert "kubectl apply -f servingruntime.yaml" in (out / "README.md").read_text()


def test_refusals(tmp_path, capsys):
    out = tmp_path / "d"
    deploy_kserve(MLP, out, name="m")
    with pytest.raises(Exception, match="already has"):
        deploy_kserve(MLP, out, name="m")
    deploy_kserve(MLP, out, name="m", force=True)
    for kwargs, message in [({"name": "bad name!"}, "not a valid InferenceService name"),
                            ({"name": "m", "namespace": "Bad_NS"}, "not a valid Kubernetes namespace")]:
        with pytest.raises(Exception, match=message):
            deploy_kserve(MLP, tmp_path / "x", **kwargs)
    assert main(["deploy", "kserve", str(tmp_path / "missing.kiln"), "-o", str(tmp_path / "y")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_a_repository_is_copied_as_it_is(tmp_path):
    repo = tmp_path / "repo"
    (repo / "alpha" / "3").mkdir(parents=True)
    (repo / "alpha" / "3" / "model.kiln").write_bytes(MLP.read_bytes())
    deploy_kserve(repo, tmp_path / "out")
    assert (tmp_path / "out" / "model-repository" / "alpha" / "3" / "model.kiln").exists()
    assert _load(tmp_path / "out" / "inferenceservice.yaml")["metadata"]["name"] == "repo"


def test_the_containers_command_serves_the_repository_it_wrote(tmp_path):
    """The ServingRuntime's args, run here as a plain process on the written repository (with the host and
    port of this machine), answer V2 requests: the health probes and an inference equal to Program.run."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    import kiln
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_serve_process import Served
    out = tmp_path / "dep"
    deploy_kserve(MLP, out, name="mlp")
    (c,) = _load(out / "servingruntime.yaml")["spec"]["containers"]
    args = list(c["args"])
    assert args[:2] == ["serve", "/mnt/models"]
    args[1] = str(out / "model-repository")
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = "0"
    server = Served(args[1:] if args[0] == "serve" else args)
    try:
        assert httpx.get(server.url + c["livenessProbe"]["httpGet"]["path"]).status_code == 200
        assert httpx.get(server.url + c["readinessProbe"]["httpGet"]["path"]).status_code == 200
        x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
        body = {"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}
        r = httpx.post(server.url + "/v2/models/mlp/infer", json=body)
        assert r.status_code == 200, r.text
        got = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
        for name, want in kiln.load(MLP).run({"x": x}).items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)
    finally:
        assert server.stop() == 0, "".join(server.output)


# ----------------------------------------------------------------------- against KServe's own models

@pytest.mark.parametrize("gpu, namespaced", [(False, False), (True, True)])
def test_manifests_survive_kserves_models(tmp_path, gpu, namespaced):
    """Every field of the manifests is one KServe's Python models (generated from its CRDs' OpenAPI) know, at
    every depth, and each object builds (the models' setters refuse a missing required field):
    V1alpha1(Cluster)ServingRuntime and V1beta1InferenceService, with the Kubernetes models they nest."""
    import re

    kserve = pytest.importorskip("kserve")
    k8s = pytest.importorskip("kubernetes.client")
    out = tmp_path / "dep"
    deploy_kserve(MLP, out, name="mlp", gpu=gpu, namespaced=namespaced, namespace="ml" if namespaced else None)

    def model_class(name):
        cls = getattr(kserve.models, name, None) or getattr(k8s.models, name, None)
        assert cls is not None, f"no KServe or Kubernetes model {name}"
        return cls

    def build(doc, type_name, where):
        m = re.fullmatch(r"(?:list|List)\[(.*)\]", type_name)
        if m:
            assert isinstance(doc, list), where
            return [build(v, m.group(1), f"{where}[{i}]") for i, v in enumerate(doc)]
        m = re.fullmatch(r"dict\(str, (.*)\)|Dict\[str, (.*)\]", type_name)
        if m:
            assert isinstance(doc, dict), where
            return {k: build(v, m.group(1) or m.group(2), f"{where}.{k}") for k, v in doc.items()}
        if type_name in ("str", "int", "float", "bool", "object", "datetime", "date"):
            return doc
        cls = model_class(type_name)
        assert isinstance(doc, dict), where
        fields = {v: k for k, v in cls.attribute_map.items()}
        kwargs = {}
        for key, value in doc.items():
            assert key in fields, f"{where}: {type_name} has no field {key!r}"
            kwargs[fields[key]] = build(value, cls.openapi_types[fields[key]], f"{where}.{key}")
        return cls(**kwargs)

    for file, model in [("servingruntime.yaml",
                         "V1alpha1ServingRuntime" if namespaced else "V1alpha1ClusterServingRuntime"),
                        ("inferenceservice.yaml", "V1beta1InferenceService")]:
        obj = build(_load(out / file), model, file)
        assert type(obj).__name__ == model and model.endswith(obj.kind)
    # The check can fail: a misspelled field, at any depth, is caught.
    bad = _load(out / "inferenceservice.yaml")
    bad["spec"]["predictor"]["model"]["storageURI"] = bad["spec"]["predictor"]["model"].pop("storageUri")
    with pytest.raises(AssertionError, match="has no field 'storageURI'"):
        build(bad, "V1beta1InferenceService", "bad")


def test_the_dockerfiles_install_the_wheel_this_project_builds(tmp_path):
    """The Dockerfiles pick kiln's wheel out of wheels/ by a glob: it must match the file name pip gives this
    project's wheel (the distribution is kiln-compiler: kiln_compiler-VERSION-py3-none-any.whl)."""
    import fnmatch
    import re
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    wheel = f"{re.sub(r'[-_.]+', '_', meta['name']).lower()}-{meta['version']}-py3-none-any.whl"
    out = tmp_path / "d"
    deploy_kserve(MLP, out, name="m")
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        (glob,) = re.findall(r"/wheels/(\S+?\.whl)", (out / name).read_text())
        assert fnmatch.fnmatch(wheel, glob), (name, glob, wheel)
