"""``kiln mobile check|pack|bundle``: the export-time half of kiln's mobile path.

Each step fails on the workstation, with the node and module path, rather than on the device:
``check`` lists what the mobile op set lacks, ``pack`` refuses such a model before writing anything,
and ``bundle`` refuses a file whose manifest its kernels cannot cover. Heavy imports (the IR, the
passes) happen inside the sub-commands, so ``kiln --help`` stays fast.
"""
from __future__ import annotations

import argparse

from kiln.errors import KilnError


def parse_dims(specs) -> dict:
    """``--dim NAME=SIZE`` entries -> {name: size}."""
    dims = {}
    for spec in specs:
        name, sep, size = spec.partition("=")
        if not sep or not name or not size.strip().isdigit() or int(size) < 1:
            raise KilnError(f"bad --dim '{spec}': expected NAME=SIZE with a positive integer SIZE (e.g. batch=1)")
        dims[name] = int(size)
    return dims


def _add_dim_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="fix a symbolic dim (the packed model has static shapes); batch defaults to 1; repeatable")


def add_mobile_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mobile_command", metavar="SUBCOMMAND")
    sub.required = True
    c = sub.add_parser("check", help="list every op/dtype the model uses that the mobile op set lacks "
                                     "(node and module path); exit 1 if any",
                       description="Check that a model can run on kiln's mobile runtime. The model is checked "
                                   "as `kiln mobile pack` would prepare it (static shapes, optimized).")
    c.add_argument("model", help="the .kiln file")
    _add_dim_arg(c)
    c.set_defaults(_mobile=cmd_check)

    k = sub.add_parser("pack", help="optimize ahead of time, plan the memory arena, optionally quantize "
                                    "weights to int8; write a .kiln file the mobile runtime runs as is",
                       description="Pack a model for kiln's mobile runtime: every pass run, static shapes, "
                                   "a static memory plan, and with --quantize int8 per-channel int8 weights.")
    k.add_argument("model", help="the .kiln file")
    k.add_argument("-o", "--output", required=True, help="the packed file (e.g. model.mobile.kiln)")
    k.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="int8: per-output-channel symmetric int8 weights for Conv/Gemm/MatMul (default none)")
    _add_dim_arg(k)
    k.set_defaults(_mobile=cmd_pack)

    b = sub.add_parser("bundle", help="write a single-file Python zipapp with the model and only the runtime "
                                      "pieces and kernels it needs (runs with numpy alone)",
                       description="Bundle a packed model: `python app.pyz --input x.npy -o y.npy`.")
    b.add_argument("model", help="the packed .kiln file (from kiln mobile pack)")
    b.add_argument("-o", "--output", required=True, help="the zipapp to write (e.g. app.pyz)")
    b.set_defaults(_mobile=cmd_bundle)


def cmd_mobile(args: argparse.Namespace) -> int:
    return args._mobile(args)


def cmd_check(args: argparse.Namespace) -> int:
    from kiln.mobile_stub.check import check

    _need_file(args.model)
    problems = check(args.model, parse_dims(args.dim))
    if not problems:
        print(f"ok: every op of {args.model} is in the mobile op set")
        return 0
    print(f"{args.model}: {len(problems)} node(s) use ops the mobile op set lacks:")
    for p in problems:
        print(f"  {p}")
    return 1


def cmd_pack(args: argparse.Namespace) -> int:
    from kiln.mobile_stub.check import check
    from kiln.mobile_stub.pack import pack_file

    _need_file(args.model)
    dims = parse_dims(args.dim)
    problems = check(args.model, dims)  # refuse before writing anything: the file could not run
    if problems:
        raise KilnError(f"{args.model} cannot be packed for the mobile runtime; "
                        f"{len(problems)} node(s) use ops it lacks:\n  " + "\n  ".join(map(str, problems)))
    report = pack_file(args.model, args.output, quantize=None if args.quantize == "none" else args.quantize,
                       dims=dims)
    print(report)
    return 0


def cmd_bundle(args: argparse.Namespace) -> int:
    from kiln.mobile_stub.bundle import bundle

    _need_file(args.model)
    print(bundle(args.model, args.output))
    return 0


def _need_file(path: str) -> None:
    import os

    if not os.path.isfile(path):
        raise KilnError(f"no such file: {path}")
