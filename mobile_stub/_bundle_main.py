"""__main__.py of a kiln mobile bundle (``kiln mobile bundle`` copies this file into the .pyz).

    python app.pyz --input x.npy -o y.npy                   one input, one output
    python app.pyz --input a=a.npy --input b=b.npy -o out.npz   several inputs / outputs (by name)
    python app.pyz --check                                   load the model (op check) and exit

numpy is the only dependency. The model is stored uncompressed (at a 4096-aligned offset, ready for
mapping in place); since the stub runtime maps a file by path, it is streamed to a temporary file,
mapped, and the file unlinked straight away.
"""
import argparse
import os
import shutil
import sys
import tempfile
import zipfile

import numpy as np

from kiln.errors import KilnError
from kiln.mobile_stub import runtime

MODEL_NAME = "model.mobile.kiln"


def _archive() -> str:
    archive = getattr(globals().get("__loader__"), "archive", None)  # zipimport's loader knows the .pyz
    return archive or sys.argv[0]


def load_model():
    """Copy the model out of the archive to a private temporary file and load it from there (the stub
    runtime maps a file by path); the file is unlinked at once, the mapping keeps it alive until exit."""
    with zipfile.ZipFile(_archive()) as z, z.open(MODEL_NAME) as src:
        fd, path = tempfile.mkstemp(suffix=".kiln")
        try:
            with os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            return runtime.load(path)
        finally:
            os.unlink(path)


def read_inputs(specs, names):
    feeds = {}
    for spec in specs:
        name, sep, source = spec.rpartition("=")
        if source.endswith(".npz"):
            with np.load(source, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
            if sep:
                if name not in arrays and len(arrays) != 1:
                    raise KilnError(f"{source} has no array '{name}' (it has {', '.join(arrays)})")
                arrays = {name: arrays.get(name, next(iter(arrays.values())))}
        elif source.endswith(".npy"):
            if not sep:
                if len(names) != 1:
                    raise KilnError(f"the model has {len(names)} inputs ({', '.join(names)}): give each as "
                                    "--input NAME=FILE.npy")
                name = names[0]
            arrays = {name: np.load(source, allow_pickle=False)}
        else:
            raise KilnError(f"bad --input '{spec}': expected FILE.npy, NAME=FILE.npy or FILE.npz")
        for k, a in arrays.items():
            if k not in names:
                raise KilnError(f"the model has no input '{k}' (its inputs: {', '.join(names)})")
            if k in feeds:
                raise KilnError(f"input '{k}' is given twice")
            feeds[k] = a
    missing = [n for n in names if n not in feeds]
    if missing:
        raise KilnError(f"no data for input(s) {', '.join(missing)}: give each with --input NAME=FILE.npy")
    return feeds


def write_outputs(outputs, path):
    if path.endswith(".npy"):
        if len(outputs) != 1:
            raise KilnError(f"the model has {len(outputs)} outputs ({', '.join(outputs)}): use -o FILE.npz")
        np.save(path, next(iter(outputs.values())))
    elif path.endswith(".npz"):
        with zipfile.ZipFile(path, "w") as z:  # by hand: np.savez would reject an output called 'file'
            for name, a in outputs.items():
                with z.open(f"{name}.npy", "w") as f:
                    np.lib.format.write_array(f, np.asarray(a), allow_pickle=False)
    else:
        raise KilnError(f"cannot write {path}: -o takes FILE.npy (one output) or FILE.npz (all outputs)")


def main(argv=None):
    p = argparse.ArgumentParser(prog="app.pyz", description="Run the kiln mobile model bundled in this file.")
    p.add_argument("--input", "-i", action="append", default=[], metavar="SPEC",
                   help="FILE.npy (the only input), NAME=FILE.npy, or FILE.npz (arrays by input name); repeatable")
    p.add_argument("-o", "--output", help="FILE.npy (the only output) or FILE.npz (all outputs, by name); "
                                          "default: print name, dtype, shape per output")
    p.add_argument("--check", action="store_true", help="load the model (checks every op has a kernel) and exit")
    args = p.parse_args(argv)
    try:
        model = load_model()
        input_names = [model.infos[i][0] for i in model.inputs]
        output_names = [model.infos[i][0] for i in model.outputs]
        if args.check:
            stray = sorted(m for m, mod in sys.modules.items()
                           if m.split(".")[0] in ("kiln", "torch", "onnx")
                           and not str(getattr(mod, "__file__", "") or "").startswith(_archive()))
            if stray:
                raise KilnError(f"modules loaded from outside the bundle: {', '.join(stray)}")
            print(f"ok: {MODEL_NAME} loads; inputs {', '.join(input_names)}, outputs {', '.join(output_names)}")
            return 0
        outputs = dict(zip(output_names, model.run(**read_inputs(args.input, input_names))))
        if args.output:
            write_outputs(outputs, args.output)
        else:
            for name, a in outputs.items():
                print(f"{name}: {a.dtype}{list(a.shape)}")
        return 0
    except KilnError as e:
        print(f"app.pyz: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
