"""What a file given to ``kiln export`` in place of ``MODULE:ATTR`` is, and what to do instead.

People hand ``kiln export`` the file they have: ``model.pt``. That may be a TorchScript archive
(``torch.jit.save``), a state_dict or a training checkpoint (``torch.save(model.state_dict())``), a
whole pickled module (``torch.save(model)``), an ONNX or .kiln file, or the model's .py file without
the name in it. None of them is something kiln can trace (kiln traces an eager ``nn.Module`` built
from its Python code), so each gets a message saying what the file is and the commands that get from
it to a .kiln file.

Nothing here runs code from the file: zip listings, ``pickletools`` (which decodes opcodes without
executing them), ``torch.load(weights_only=True)`` (tensors and plain containers only) and ``ast``.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import pickletools
import re
import shlex
import zipfile
from collections.abc import Mapping
from typing import Optional, Sequence

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of torch.save's pre-1.6 (non-zip) format
_LIST_MAX = 6


def describe(path: str, command: Sequence[str]) -> Optional[str]:
    """Why the file ``path`` is not a ``MODULE:ATTR`` and what to run instead, or None when it is not a
    file. ``command`` is the rest of the user's ``kiln export`` arguments (inputs, outputs), repeated in
    the commands suggested."""
    if not os.path.isfile(path):
        return None
    rest = " ".join(shlex.quote(a) for a in command)
    lower = path.lower()
    if lower.endswith(".py"):
        return _python_file(path)
    if lower.endswith(".onnx"):
        return (f"{path} is an ONNX file: kiln export starts from PyTorch code. Compile it with "
                f"kiln convert {shlex.quote(path)} {shlex.quote(_stem(path) + '.kiln')} (kiln run, bench and serve "
                "also take the .onnx file as it is)")
    from kiln.serializer.format import MAGIC

    if lower.endswith(".kiln") or _head(path, len(MAGIC)) == MAGIC:
        return f"{path} is already a .kiln file: kiln run, kiln bench, kiln serve and kiln inspect take it"
    if lower.endswith(".safetensors"):
        return _state_dict(path, None, None, rest)
    names: list = []
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
                pkl = next((n for n in names if n.endswith("data.pkl") and n.count("/") <= 1), None)
                top = _pickle_globals(z.open(pkl))[:1] if pkl else []
        except (zipfile.BadZipFile, OSError):  # damaged: said below as not recognized
            names, pkl = [], None
    if names:
        if any("/code/" in n or n.startswith("code/") or n.endswith("constants.pkl") for n in names):
            return _torchscript(path, _script_class(top[0]) if top else None, rest)
        if pkl:
            return _torch_save(path, rest, zip_format=True)
    elif _is_legacy_torch_save(path):
        return _torch_save(path, rest, zip_format=False)
    return (f"{path} is neither a Python file nor a model file kiln recognizes (TorchScript, torch.save, ONNX): "
            "give MODULE:ATTR, a .py file or dotted module name and the name in it of an nn.Module instance, "
            "class or factory function, e.g. 'models.py:Net'")


# ---------------------------------------------------------------------------- kinds of file
def _python_file(path: str) -> str:
    classes, functions = _module_names(path)
    found = "; ".join(x for x in (
        f"nn.Module classes there: {_few(classes)}" if classes else "",
        f"functions callable without arguments: {_few(functions)}" if functions else "") if x)
    example = f"{path}:{(classes or functions or ['Net'])[0]}"
    return (f"{path} names the file but not the model in it: give MODULE:ATTR, e.g. '{example}' (ATTR: an "
            "nn.Module instance, an nn.Module class built with no arguments, or a function returning a module)"
            + (f". {found}" if found else ""))


def _torchscript(path: str, cls: Optional[str], rest: str) -> str:
    made = f" of {cls}" if cls else ""
    module, _, name = (cls or "").rpartition(".")
    target = f"{module.replace('.', '/')}.py:{name}" if module and name else "MODEL.py:CLASS"
    onnx = _stem(path) + ".onnx"
    dynamo = ", dynamo=False" if _export_has_dynamo() else ""  # TorchScript goes through the TorchScript exporter
    example, names = _example_args(rest)
    named = f", input_names={json.dumps(names)}" if names else ""  # else TorchScript's names: 'x.1'
    script = (f"import torch; m = torch.jit.load({_q(path)}).eval(); "
              f"torch.onnx.export(m, ({example}), {_q(onnx)}{named}{dynamo})")
    return (f"{path} is a TorchScript archive (torch.jit.save){made}: kiln traces eager PyTorch modules from their "
            "Python code and does not read TorchScript. Either\n"
            f"  - export from the model's code, if you have it: kiln export {target} {rest}\n"
            f"    (its weights: m.load_state_dict(torch.jit.load({_q(path)}).state_dict()) in a factory function)\n"
            "  - or go through ONNX:\n"
            f"      python -c {shlex.quote(script)}\n"
            f"      kiln convert {shlex.quote(onnx)} {shlex.quote(_stem(path) + '.kiln')}   "
            f"(or kiln run {shlex.quote(onnx)} as it is)")


def _torch_save(path: str, rest: str, zip_format: bool) -> str:
    """A torch.save file: a state_dict, a checkpoint holding one, or a pickled object (a whole module)."""
    import torch

    try:
        kw = {"mmap": True} if zip_format and "mmap" in inspect.signature(torch.load).parameters else {}
        obj = torch.load(path, map_location="cpu", weights_only=True, **kw)
    except Exception:  # noqa: BLE001 - the file holds Python objects besides tensors: read what they are
        with open(path, "rb") as f:
            if zip_format:
                with zipfile.ZipFile(f) as z:
                    pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
                    found = _pickle_globals(z.open(pkl))
            else:
                found = _pickle_globals(f, skip=3)
        return _pickled_object(path, found, rest)
    if _is_state_dict(obj):
        return _state_dict(path, obj, None, rest)
    if isinstance(obj, Mapping):
        key = _state_dict_key(obj)
        if key is not None:
            return _state_dict(path, obj[key], key, rest)
        return (f"{path} holds a dict ({_few([repr(k) for k in obj])}) without a state_dict in it: kiln needs the "
                "model's code. Point MODULE:ATTR at the model's class, or at a function that builds the model "
                "and loads its weights")
    return (f"{path} holds a {type(obj).__name__}, not a model: kiln needs the model's code. Point MODULE:ATTR at "
            "the model's class, or at a function that builds the model and loads its weights")


def _state_dict(path: str, sd: Optional[Mapping], key: Optional[str], rest: str) -> str:
    """A state_dict ``sd`` (None: a .safetensors file, read with safetensors' own loader)."""
    what = f"a checkpoint with a state_dict under {key!r}" if key else "a state_dict"
    index = f"[{key!r}]" if key else ""
    load = f"torch.load({_q(path)}, map_location=\"cpu\", weights_only=True){index}"
    if sd is None:
        what, load = "safetensors weights", f"safetensors.torch.load_file({_q(path)})"
    tensors = f" ({len(sd)} tensors: {_few(list(sd))})" if sd is not None else ""
    return (f"{path} holds {what}{tensors}: weights without the code that uses "
            "them. Point MODULE:ATTR at the model's class and load the weights in a factory function, e.g. in "
            "export_model.py:\n\n"
            f"    import {'safetensors.torch' if sd is None else 'torch'}\n"
            "    from mymodels import Net  # the model's code\n\n"
            "    def model():\n"
            "        m = Net()\n"
            f"        m.load_state_dict({load})\n"
            "        return m.eval()\n\n"
            f"then: kiln export export_model.py:model {rest}")


def _pickled_object(path: str, found: list, rest: str) -> str:
    top = found[0] if found else None
    containers = ("collections.OrderedDict", "builtins.dict", "__builtin__.dict")
    classes = [c for c in dict.fromkeys(found) if not c.startswith(("torch.", "collections.", "builtins."))
               and c not in containers]
    if top is None or top in containers:
        what = "a checkpoint holding Python objects besides tensors" + (f" ({_few(classes)})" if classes else "")
        return (f"{path} is {what}: kiln loads models from code, not from pickles (unpickling runs arbitrary code). "
                "Point MODULE:ATTR at the model's class, or at a function that builds the model and loads its "
                "weights from this file")
    module = top.rpartition(".")[0]
    where = (f": run it where `import {module}` works" if module and module != "__main__" else
             f": the file was saved from a script, so define {top.rpartition('.')[2]} in export_model.py too")
    return (f"{path} is a pickled {top} module (torch.save(model)): kiln loads models from code, not from pickles "
            "(unpickling runs arbitrary code). If you trust the file, export a factory function that loads it, "
            "e.g. in export_model.py:\n\n"
            "    import torch\n\n"
            "    def model():\n"
            f"        return torch.load({_q(path)}, map_location=\"cpu\", weights_only=False).eval()\n\n"
            f"then: kiln export export_model.py:model {rest}\n"
            f"(unpickling needs the class {top}{where})")


# ---------------------------------------------------------------------------- helpers
def _pickle_globals(stream, skip: int = 0) -> list:
    """The classes and functions a pickle refers to, in order ('module.Name'), decoded by pickletools
    without running anything; ``skip`` pickles first (the legacy format's magic, version and sys info)."""
    names, strings = [], []
    try:
        for _ in range(skip):
            for _ in pickletools.genops(stream):
                pass
        for op, arg, _ in pickletools.genops(stream):
            if op.name == "GLOBAL":
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str) and "UNICODE" in op.name:
                strings.append(arg)
    except Exception:  # noqa: BLE001 - a damaged pickle: what was read so far
        pass
    return names


def _script_class(name: str) -> str:
    """``__torch__.net.___torch_mangle_1.Net`` -> ``net.Net``: the class TorchScript compiled."""
    parts = [p for p in name.split(".") if p != "__torch__" and not re.fullmatch(r"___torch_mangle_\d+", p)]
    return ".".join(parts)


def _is_legacy_torch_save(path: str) -> bool:
    with open(path, "rb") as f:
        if f.read(1) != b"\x80":
            return False
        f.seek(0)
        try:
            return any(arg == _LEGACY_MAGIC for _, arg, _ in pickletools.genops(f))
        except Exception:  # noqa: BLE001 - not a pickle
            return False


def _is_state_dict(obj) -> bool:
    import torch

    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _state_dict_key(obj: Mapping) -> Optional[str]:
    """The key of a checkpoint dict that holds the model's state_dict ('model_state_dict', 'state_dict',
    'model', ...): a tensor dict, preferring keys that name the model over the optimizer's."""
    keys = [k for k in obj if isinstance(k, str) and _is_state_dict(obj[k])]
    keys.sort(key=lambda k: (not ("model" in k.lower() or k.lower() in ("state_dict", "net", "weights")),
                             "optim" in k.lower()))
    return keys[0] if keys else None


def _module_names(path: str) -> tuple[list, list]:
    """The nn.Module subclasses (by base names) and the top-level functions callable without arguments
    defined in the Python file ``path``, read with ast (the file is not run)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return [], []
    modules: set = set()
    classes, functions = [], []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
            if any(b.endswith("Module") or b in modules for b in bases):
                modules.add(node.name)
                classes.append(node.name)
        elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            a = node.args
            required = len(a.posonlyargs) + len(a.args) - len(a.defaults) + sum(d is None for d in a.kw_defaults)
            if required == 0:
                functions.append(node.name)
    return classes, functions


def _example_args(rest: str) -> tuple[str, list]:
    """(``torch.randn(1, 3, 224, 224),``, input names) for the --input specs in ``rest`` (ints as zeros of
    their dtype): the arguments of the suggested torch.onnx.export."""
    args, names = [], []
    words = shlex.split(rest)
    for i, w in enumerate(words):
        spec = w.partition("=")[2] if w.startswith("--input=") else words[i + 1] if w == "--input" and \
            i + 1 < len(words) else None
        if not spec:
            continue
        parts = spec.split(":")
        shape = ", ".join(d for d in parts[1].lower().split("x") if d) if len(parts) > 1 else ""
        dtype = parts[2] if len(parts) > 2 else "float32"
        names.append(parts[0])
        args.append(f"torch.randn({shape})" if dtype == "float32"
                    else f"torch.zeros({shape}{', ' if shape else ''}dtype=torch.{dtype})")
    return (", ".join(args) + "," if args else "torch.randn(1, 3, 224, 224),"), names


def _export_has_dynamo() -> bool:
    import torch

    return "dynamo" in inspect.signature(torch.onnx.export).parameters


def _few(items: Sequence) -> str:
    items = list(items)
    more = len(items) - _LIST_MAX
    return ", ".join(str(x) for x in items[:_LIST_MAX]) + (f", ... {more} more" if more > 0 else "")


def _q(text: str) -> str:
    """A Python string literal in double quotes (the suggested shell commands quote with single ones)."""
    return json.dumps(text)


def _stem(path: str) -> str:
    return os.path.splitext(path)[0]


def _head(path: str, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)

