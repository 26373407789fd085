"""The model repository of ``kiln serve``: what to serve, and how each model is configured.

``kiln serve PATH`` takes either a single model file or a Triton-style repository directory::

    model.kiln                      one model, named after the file stem (or ``--name``), version "1"

    repo/
      resnet/
        config.json                 optional; see ModelConfig
        1/model.kiln
        2/model.onnx                an ONNX file is served through kiln's importer
      bert/
        3/model.kiln

:func:`discover` turns either into a sorted list of :class:`ModelEntry` (one per model version that the
model's version policy selects). It only looks at the file system and parses JSON: loading models is the
executors' job, so a repository with a hundred models is listed in milliseconds and every mistake in
its layout or configuration is reported up front, as a :class:`kiln.KilnError` naming the file, before
any model is loaded or any port is bound.

Layout rules (decided here, documented for users):

- Model names must be usable in a URL path (``/v2/models/{name}/infer``): letters, digits, ``_``, ``.``
  and ``-``, starting with a letter or digit. A file stem that is not (``my model.kiln``) needs ``--name``.
- Version directories are positive integers written without leading zeros (``1``, ``2``, ``10``; not
  ``0``, ``01`` or ``v1``), and are ordered numerically (``2`` < ``10``). Any other directory in a model
  directory is ignored with a logged warning (people keep ``old/`` or ``tmp/`` next to versions);
  hidden entries (``.ipynb_checkpoints``) and plain files are ignored silently.
- A version directory holds ``model.kiln`` or ``model.onnx``; if both are present the compiled
  ``model.kiln`` wins. A version directory with neither is an error, not a silent skip: a half-copied
  model should stop the server from starting rather than quietly serve an older version.
- ``--name`` applies to a single model file only; a repository's model names are its directory names.
- CLI overrides (``--max-batch-size`` ...) apply to every model and win over ``config.json``.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from kiln.errors import KilnError
from kiln.runtime.program import BACKENDS

log = logging.getLogger(__name__)

#: File names accepted inside a version directory, in order of preference.
MODEL_FILES = ("model.kiln", "model.onnx")
#: Suffixes accepted for a single-file PATH.
MODEL_SUFFIXES = (".kiln", ".onnx")
CONFIG_FILE = "config.json"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*\Z")
_VERSION_RE = re.compile(r"[1-9][0-9]*\Z")

VersionPolicy = Union[str, dict]


@dataclass(frozen=True)
class ModelConfig:
    """How one model is served. Every field can be set in ``repo/<model>/config.json`` (same key names)
    and most from the command line, which wins.

    Defaults, and why:

    - ``max_batch_size = 32``: batching is on by default, because a user serving a model with a symbolic
      batch dimension expects concurrent requests to be batched, and it is where a CPU server gets its
      throughput. The batcher only stacks requests for models whose inputs all share a symbolic dim 0
      and (with ``batching = "auto"``) whose graph is proven row-independent; other models run request
      by request whatever this says. 32 rows keeps one batch's latency bounded
      for mid-sized models; raise it for tiny ones. ``0`` turns batching off (``1`` has the same effect).
    - ``max_queue_delay_ms = 0.5``: the longest the batcher holds a request back hoping to fill a batch,
      which it does only while some but not all of the executor's slots are busy (an idle model runs a
      request at once; see server/batcher.py).
      Under load, batches fill from requests that queue while the previous batch computes, with no delay
      at all, so with one worker and one instance (the default) the delay never applies. With several
      workers or instances it keeps a spare slot from taking requests one by one while others run; it
      is kept well under a millisecond because it is added latency at moderate load. Raise it (Triton
      users often use 1-5 ms) when you have many workers and want fuller batches; ``0`` dispatches
      whatever is queued as soon as a slot is free.
    - ``queue_size = 1024``: requests waiting per model version before new ones get 503 + Retry-After.
      Bounded so overload sheds load instead of growing memory and latency without limit.
    - ``timeout_ms = 30000``: a request not answered within this (queue + compute) gets 504. A request may
      ask for less (never more) with its ``timeout_ms`` parameter.
    - ``workers = 1``: runtime worker processes per model version (they map the same file, so weights are
      shared pages). ``0`` runs the model on threads inside the server process.
    - ``instances = 1``: batches run in parallel per worker (threads); kiln's kernels already use
      several cores per batch, so more than 1 mainly helps small models.
    - ``version_policy = {"latest": 1}``: serve only the highest version. Also ``"all"`` and
      ``{"specific": [1, 3]}`` (Triton's policy names; Triton's nested spellings
      ``{"latest": {"num_versions": 2}}``, ``{"all": {}}`` and ``{"specific": {"versions": [1, 3]}}`` are
      accepted too and normalized to the short forms).
    - ``backend = "kiln"``: kiln's CPU runtime; ``"onnxruntime"`` runs the same file in ONNX Runtime.
    - ``batching = "auto"``: whether requests may be stacked into one batch. ``"auto"`` stacks only
      when kiln proves, from the model's graph, that every output row depends only on its own input
      row (kiln/ir/batch_independence.py); otherwise the model runs request by request, and the
      start-up log and ``GET /v2/models/{m}/config`` say which op (and module path) stopped it.
      Why not always: stacking a model that mixes rows (``x - x.mean(0)``, in-batch normalization,
      set-based heads) answers every request wrongly with status 200. ``"force"`` stacks any model
      whose inputs and outputs share a symbolic dim 0, for users who know better than the analysis
      (an op it has no rule for); ``"off"`` never stacks (like ``max_batch_size`` 0).
    - ``memory_budget = None``: the most buffer memory one run (one batch) may allocate, in bytes or a
      string like ``"4GiB"`` (``kiln.load(..., memory_budget=)``); a model whose fixed shapes need
      more fails to load, a request whose shapes need more gets 413. None: the environment variable
      ``KILN_MEMORY_BUDGET``, else no budget. CPU runtime (``backend = "kiln"``) only.
    - ``preferred_batch_size = None``: extra batch-bucket sizes (Triton's key), each an integer in
      1..``max_batch_size``; setting it turns batch buckets on (server/buckets.py).
    - ``buckets = None``: batch buckets -- every batch padded to the next of a few sizes (powers of two up
      to ``max_batch_size``, ``max_batch_size`` itself, and ``preferred_batch_size``), each run once at
      load (warm-up; the model is not ready before). This is what lets a GPU executor capture one CUDA
      graph per bucket; on the CPU runtime it is correct but no faster. ``None``: on when
      ``preferred_batch_size`` is set, else off; ``true``/``false`` force it (``false`` with
      ``preferred_batch_size`` is refused as a contradiction).
    - ``instance_group = None``: Triton's shape, ``[{"kind": "cpu"|"gpu", "count": N, "gpus": [0, 1]}]``
      (``KIND_CPU``/``KIND_GPU`` accepted, ``count`` defaults to 1). CPU groups set ``instances`` to the
      sum of their counts (set one or the other in a file, not both; a CLI ``--instances`` still wins).
      ``gpus`` only with kind ``gpu``: N GPU worker processes per listed GPU (server/gpu.py), only with
      ``device`` cuda; on the CPU ``kiln serve`` refuses a ``gpu`` group at start, naming the model.
    - ``device = "cpu"``: ``"cuda"`` / ``"cuda:N"`` runs the model as a CudaProgram in GPU worker
      processes (server/gpu.py; ``kiln serve --device``); batch buckets are then on unless ``buckets``
      is false.
    - ``precision = None``: ``"fp16"`` or ``"bf16"`` converts the model at load (issue 18:
      ``kiln.load(..., precision=)``: weights cast once, activations in half, the interface unchanged);
      on the CPU runtime such a model computes in float32; bf16 runs on the CPU only. ``kiln serve
      --precision``. Kiln backend only.
    - ``staging_mib = 1024``: the shared-memory arena between the server and its worker processes in
      which batch buckets' input and output buffers live (server/arena.py; batches then cross to workers
      as references, not copies). Virtual size: only the pages used are backed. A buffer that does not fit
      uses ordinary memory and that batch is pickled through the pipe instead. ``0``: no arena.
    """

    max_batch_size: int = 32
    max_queue_delay_ms: float = 0.5
    queue_size: int = 1024
    timeout_ms: float = 30000.0
    workers: int = 1
    instances: int = 1
    version_policy: VersionPolicy = field(default_factory=lambda: {"latest": 1})
    backend: str = "kiln"
    batching: str = "auto"
    memory_budget: Optional[Union[int, str]] = None
    preferred_batch_size: Optional[list] = None
    buckets: Optional[bool] = None
    instance_group: Optional[list] = None
    device: str = "cpu"
    staging_mib: float = 1024.0
    precision: Optional[str] = None

    def __hash__(self) -> int:  # the generated one fails on the dict-valued version_policy
        return hash(json.dumps(self.to_json(), sort_keys=True))

    @property
    def may_batch(self) -> bool:
        """Whether the batcher may stack requests at all (it still checks the model's graph, unless
        ``batching`` is ``"force"``, and that it has a batch dim)."""
        return self.max_batch_size > 1 and self.batching != "off"

    @classmethod
    def from_json(cls, data: Any, source: Union[str, Path] = "config.json",
                  overrides: Optional[Mapping[str, Any]] = None) -> "ModelConfig":
        """Validate a parsed ``config.json`` (``source`` names it in errors) and apply CLI ``overrides``
        on top. Unknown keys, wrong types (``true`` is not an int, ``"4"`` is not a number) and values
        out of range raise :class:`KilnError` naming the key and the file."""
        if not isinstance(data, dict):
            raise KilnError(f"{source}: expected a JSON object at the top level, got {_json_type(data)}")
        config = cls()._updated(data, str(source))
        return config.with_overrides(overrides) if overrides else config

    @classmethod
    def from_file(cls, path: Union[str, Path], overrides: Optional[Mapping[str, Any]] = None) -> "ModelConfig":
        """Read and validate a ``config.json`` file, then apply ``overrides``."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise KilnError(f"{path}: cannot read model config: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise KilnError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        return cls.from_json(data, path, overrides)

    def with_overrides(self, overrides: Optional[Mapping[str, Any]],
                       source: str = "command-line options") -> "ModelConfig":
        """This config with ``overrides`` applied (validated like the file; ``None`` values mean "not
        given", so an argparse namespace's unset options can be passed straight through)."""
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        return self._updated(given, source) if given else self

    def to_json(self) -> dict:
        """The config as a JSON-ready dict (what ``GET /v2/models/{m}/config`` can return)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _updated(self, data: Mapping[str, Any], source: str) -> "ModelConfig":
        known = {f.name for f in fields(self)}
        changes = {}
        for key, value in data.items():
            if key not in known:
                raise KilnError(f"{source}: unknown model config key {key!r}; known keys: {', '.join(sorted(known))}")
            changes[key] = _VALIDATORS[key](value, f"{source}: {key!r}")
        groups = changes.get("instance_group")
        if groups:
            if "instances" in changes:
                raise KilnError(f"{source}: set 'instances' or 'instance_group', not both")
            if all(g["kind"] == "cpu" for g in groups):
                changes["instances"] = sum(g["count"] for g in groups)
        config = replace(self, **changes)
        config._check_buckets(source)
        return config

    def _check_buckets(self, source: str) -> None:
        """The checks that involve several keys (after each file or set of overrides)."""
        preferred = self.preferred_batch_size or []
        over = [p for p in preferred if p > self.max_batch_size]
        if over:
            raise KilnError(f"{source}: preferred_batch_size {preferred} has size(s) {over} above max_batch_size "
                            f"{self.max_batch_size}; each must be at most max_batch_size")
        if preferred and self.buckets is False:
            raise KilnError(f"{source}: preferred_batch_size {preferred} asks for batch buckets but 'buckets' is "
                            "false; drop one of them")
        if self.precision not in (None, "fp32") and self.backend != "kiln":
            raise KilnError(f"{source}: precision {self.precision!r} is kiln's own conversion; backend "
                            f"{self.backend!r} runs the file as it is (convert it first: kiln convert --precision)")

    @property
    def uses_buckets(self) -> bool:
        """Whether the executor runs batches in batch buckets (see ``buckets``)."""
        if self.buckets is not None:
            return bool(self.buckets)
        return bool(self.preferred_batch_size) or self.device != "cpu"

    @property
    def gpu_groups(self) -> list:
        """The instance groups of kind ``gpu``."""
        return [g for g in self.instance_group or [] if g["kind"] == "gpu"]

    def select_versions(self, versions: list[int], model: str = "model") -> list[int]:
        """The versions this config's policy serves out of ``versions`` (ascending)."""
        versions = sorted(versions)
        policy = self.version_policy
        if policy == "all":
            return versions
        if "latest" in policy:
            return versions[-policy["latest"]:]
        missing = [v for v in policy["specific"] if v not in versions]
        if missing:
            raise KilnError(f"model {model!r}: version_policy asks for version(s) {missing} but the repository "
                            f"has {versions}")
        return [v for v in versions if v in policy["specific"]]


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _int(minimum: int):
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # 4.0 from a JSON writer that emits floats
            else:
                raise KilnError(f"{where} must be an integer, got {_json_type(value)} ({value!r})")
        if value < minimum:
            raise KilnError(f"{where} must be >= {minimum}, got {value}")
        return value
    return check


def _number(minimum: float, exclusive: bool = False):
    def check(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KilnError(f"{where} must be a number, got {_json_type(value)} ({value!r})")
        value = float(value)
        if not math.isfinite(value):
            raise KilnError(f"{where} must be finite, got {value}")
        if value < minimum or (exclusive and value == minimum):
            raise KilnError(f"{where} must be {'>' if exclusive else '>='} {minimum:g}, got {value:g}")
        return value
    return check


def _backend(value: Any, where: str) -> str:
    if value not in BACKENDS:
        raise KilnError(f"{where} must be one of {', '.join(map(repr, BACKENDS))}, got {value!r}")
    return value


#: Values of ``batching`` (see ModelConfig).
BATCHING_MODES = ("auto", "force", "off")


def _batching(value: Any, where: str) -> str:
    if value not in BATCHING_MODES:
        raise KilnError(f"{where} must be one of {', '.join(map(repr, BATCHING_MODES))}, got {value!r}")
    return value


def _memory_budget(value: Any, where: str) -> Optional[Union[int, str]]:
    from kiln.runtime.program import parse_bytes

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise KilnError(f"{where} must be a number of bytes or a string such as \"4GiB\", got {value!r}")
    parse_bytes(value, where)  # raises KilnError naming the field
    return value


def _version_policy(value: Any, where: str) -> VersionPolicy:
    """Normalize a version policy to ``"all"``, ``{"latest": N}`` or ``{"specific": [sorted versions]}``."""
    usage = 'use "all", {"latest": N} or {"specific": [versions]}'
    if value == "all" or value == {"all": {}}:
        return "all"
    if not isinstance(value, dict) or len(value) != 1:
        raise KilnError(f"{where} must be one policy: {usage}; got {value!r}")
    (kind, arg), = value.items()
    if kind == "latest":
        if isinstance(arg, dict) and set(arg) == {"num_versions"}:
            arg = arg["num_versions"]
        return {"latest": _int(1)(arg, f"{where} latest count")}
    if kind == "specific":
        if isinstance(arg, dict) and set(arg) == {"versions"}:
            arg = arg["versions"]
        if not isinstance(arg, list) or not arg:
            raise KilnError(f"{where} specific must be a non-empty list of versions, got {arg!r}")
        versions = [_int(1)(v if not (isinstance(v, str) and _VERSION_RE.match(v)) else int(v),
                            f"{where} specific version") for v in arg]
        return {"specific": sorted(set(versions))}
    raise KilnError(f"{where}: unknown policy {kind!r}; {usage}")


def _preferred_batch_size(value: Any, where: str) -> Optional[list]:
    if value is None:
        return None
    if isinstance(value, bool) or isinstance(value, int):
        value = [value]  # Triton's config takes a list; a lone number is what people type
    if not isinstance(value, list):
        raise KilnError(f"{where} must be a list of integers, got {_json_type(value)} ({value!r})")
    sizes = [_int(1)(v, f"{where} entry") for v in value]
    return sorted(set(sizes)) or None


def _buckets(value: Any, where: str) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        raise KilnError(f"{where} must be true, false or null, got {_json_type(value)} ({value!r})")
    return value


_KINDS = {"cpu": "cpu", "gpu": "gpu", "KIND_CPU": "cpu", "KIND_GPU": "gpu"}
_GROUP_KEYS = ("kind", "count", "gpus")


def _instance_group(value: Any, where: str) -> Optional[list]:
    """Normalize Triton's instance_group to ``[{"kind": "cpu"|"gpu", "count": N[, "gpus": [...]]}]``."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise KilnError(f"{where} must be a non-empty list of groups like {{\"kind\": \"gpu\", \"count\": 1, "
                        f"\"gpus\": [0]}}, got {value!r}")
    groups = []
    for i, g in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(g, dict):
            raise KilnError(f"{at} must be an object, got {_json_type(g)} ({g!r})")
        unknown = sorted(set(g) - set(_GROUP_KEYS))
        if unknown:
            raise KilnError(f"{at}: unknown key(s) {unknown}; known keys: {', '.join(_GROUP_KEYS)}")
        if "kind" not in g:
            raise KilnError(f"{at} needs a 'kind': \"cpu\" or \"gpu\"")
        kind = _KINDS.get(g["kind"]) if isinstance(g["kind"], str) else None
        if kind is None:
            raise KilnError(f"{at} 'kind' must be \"cpu\" or \"gpu\" (or KIND_CPU / KIND_GPU), got {g['kind']!r}")
        group = {"kind": kind, "count": _int(1)(g.get("count", 1), f"{at} 'count'")}
        if "gpus" in g:
            if kind != "gpu":
                raise KilnError(f"{at}: 'gpus' only applies to kind \"gpu\", this group is {kind!r}")
            gpus = g["gpus"]
            if not isinstance(gpus, list) or not gpus:
                raise KilnError(f"{at} 'gpus' must be a non-empty list of GPU indices, got {gpus!r}")
            ids = [_int(0)(d, f"{at} 'gpus' entry") for d in gpus]
            if len(set(ids)) != len(ids):
                raise KilnError(f"{at} 'gpus' lists a GPU twice: {ids}")
            group["gpus"] = ids
        groups.append(group)
    return groups


def _precision(value: Any, where: str) -> Optional[str]:
    if value is None:
        return None
    if value not in ("fp32", "fp16", "bf16"):
        raise KilnError(f"{where} must be \"fp32\", \"fp16\" or \"bf16\", got {value!r}")
    return value


def _device(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise KilnError(f"{where} must be \"cpu\", \"cuda\" or \"cuda:N\", got {_json_type(value)}")
    d = value.strip().lower()
    if d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit()):
        return d
    raise KilnError(f"{where} must be \"cpu\", \"cuda\" or \"cuda:N\", got {value!r}")


_VALIDATORS = {
    "max_batch_size": _int(0),
    "max_queue_delay_ms": _number(0.0),
    "queue_size": _int(1),
    "timeout_ms": _number(0.0, exclusive=True),
    "workers": _int(0),
    "instances": _int(1),
    "version_policy": _version_policy,
    "backend": _backend,
    "batching": _batching,
    "memory_budget": _memory_budget,
    "preferred_batch_size": _preferred_batch_size,
    "buckets": _buckets,
    "instance_group": _instance_group,
    "device": _device,
    "staging_mib": _number(0.0),
    "precision": _precision,
}


def check_cpu_only(entries: list) -> None:
    """Refuse models whose config asks for GPU instances but which are served on the CPU (no ``--device
    cuda``, no ``"device": "cuda"``). A KilnError naming each such model. Models on ``cuda`` pass
    (server/gpu.py's ``check_gpus`` checks their GPUs)."""
    gpu = [e for e in entries if e.config.gpu_groups and e.config.device == "cpu"]
    if gpu:
        names = ", ".join(f"{e.name} (version {e.version})" for e in gpu)
        raise KilnError(f"model(s) {names}: instance_group asks for kind \"gpu\", but they are served on the "
                        "CPU only; serve with kiln serve --device cuda, or use kind \"cpu\"")


@dataclass(frozen=True)
class ModelEntry:
    """One servable model version: its public name and version, the model file, and its config."""

    name: str
    version: str
    path: Path
    config: ModelConfig

    @property
    def format(self) -> str:
        """``"kiln"`` or ``"onnx"`` (from the file suffix); ``kiln.load`` handles both."""
        return self.path.suffix.lstrip(".")


def discover(path: Union[str, Path], *, name: Optional[str] = None,
             overrides: Optional[Mapping[str, Any]] = None) -> list[ModelEntry]:
    """List what ``kiln serve PATH`` serves: a single ``.kiln``/``.onnx`` file, or a repository directory
    (see the module docstring). Entries are sorted by model name, then numerically by version.
    Raises :class:`KilnError` for anything wrong, naming the path."""
    path = Path(path)
    overrides = dict(overrides or {})
    # Validate overrides once, up front, so a bad CLI value is reported as such even for an empty repo.
    ModelConfig().with_overrides(overrides)
    if not path.exists():
        raise KilnError(f"{path}: no such file or directory")
    if path.is_file():
        return [_single_file(path, name, overrides)]
    if not path.is_dir():
        raise KilnError(f"{path}: not a model file or a repository directory")
    if name is not None:
        raise KilnError(f"--name applies to a single model file, but {path} is a repository directory: "
                        "its model names are its sub-directory names")
    return _repository(path, overrides)


def _single_file(path: Path, name: Optional[str], overrides: Mapping[str, Any]) -> ModelEntry:
    if path.suffix not in MODEL_SUFFIXES:
        raise KilnError(f"{path}: expected a {' or '.join(MODEL_SUFFIXES)} model file or a repository directory")
    model = name if name is not None else path.stem
    if not _NAME_RE.match(model):
        hint = "" if name is not None else " (pass --name to choose another)"
        raise KilnError(f"invalid model name {model!r}{hint}: use letters, digits, '_', '.' and '-', "
                        "starting with a letter or digit")
    config = ModelConfig().with_overrides(overrides)
    return ModelEntry(model, "1", path, config)


def _repository(repo: Path, overrides: Mapping[str, Any]) -> list[ModelEntry]:
    if any((repo / f).is_file() for f in MODEL_FILES):
        raise KilnError(f"{repo} looks like a version directory (it holds a model file); pass the repository "
                        f"directory, laid out as repo/<model>/<version>/model.kiln, or the model file itself")
    children = sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith("."))
    if children and all(_VERSION_RE.match(p.name) for p in children) and \
            any((p / f).is_file() for p in children for f in MODEL_FILES):
        raise KilnError(f"{repo} looks like a model directory (its sub-directories are versions); pass its "
                        f"parent, the repository laid out as repo/<model>/<version>/model.kiln")
    entries: list[ModelEntry] = []
    for model_dir in children:
        entries.extend(_model(model_dir, overrides))
    if not entries:
        raise KilnError(f"{repo}: empty model repository; expected repo/<model>/<version>/model.kiln")
    return entries


def _model(model_dir: Path, overrides: Mapping[str, Any]) -> list[ModelEntry]:
    model = model_dir.name
    if not _NAME_RE.match(model):
        raise KilnError(f"{model_dir}: invalid model name {model!r}: use letters, digits, '_', '.' and '-', "
                        "starting with a letter or digit")
    config_path = model_dir / CONFIG_FILE
    if config_path.exists():
        config = ModelConfig.from_file(config_path, overrides)
    else:
        config = ModelConfig().with_overrides(overrides)
    versions: dict[int, Path] = {}
    for child in sorted(model_dir.iterdir()):
        if child.name.startswith(".") or not child.is_dir():
            continue
        if not _VERSION_RE.match(child.name):
            log.warning("%s: ignoring directory %r: version directories are positive integers "
                        "without leading zeros", model_dir, child.name)
            continue
        versions[int(child.name)] = child
    if not versions:
        raise KilnError(f"{model_dir}: model {model!r} has no version directories; expected "
                        f"{model_dir}/1/model.kiln")
    entries = []
    for version in config.select_versions(list(versions), model):
        version_dir = versions[version]
        file = next((version_dir / f for f in MODEL_FILES if (version_dir / f).is_file()), None)
        if file is None:
            raise KilnError(f"{version_dir}: no model file; expected {' or '.join(MODEL_FILES)} in it")
        entries.append(ModelEntry(model, str(version), file, config))
    return entries
