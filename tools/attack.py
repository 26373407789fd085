"""The attack suite (issue 16) behind one command: every hostile-input generator and fuzzer kiln keeps,
each asserting what must hold (a kiln error or a correct answer, in bounded time and memory; on the
server a 4xx with a JSON body, nothing lost, no wrong 200). The tests run short versions of each
(tests/serializer/test_fuzz.py, test_attack_files.py, test_onnx_attacks.py, test_onnx_fuzz.py,
tests/mobile/test_untrusted.py, tests/server/test_attacks.py); this runs the long ones.

    python -m kiln.tools.attack list
    python -m kiln.tools.attack kiln-fuzz --iterations 200000 --seed 1     # mutated .kiln files
    python -m kiln.tools.attack kiln-files DIR [--scale issue]             # hand-made malicious .kiln files
    python -m kiln.tools.attack onnx-files DIR                             # crafted ONNX files
    python -m kiln.tools.attack onnx-fuzz --iterations 20000               # mutated ONNX models
    python -m kiln.tools.attack mobile-fuzz --iterations 50000             # mutated packed mobile files
    python -m kiln.tools.attack server matrix|slow|sigterm|kill-worker ... # the HTTP server

Everything after the attack's name goes to that attack's own command line (``... kiln-fuzz --help``).
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional

# name -> (module whose main(argv) runs it, what it attacks)
ATTACKS = {
    "kiln-fuzz": ("kiln.tools.fuzz", "the .kiln loader, with mutated files (checksums recomputed)"),
    "kiln-files": ("kiln.serializer.attack_files", "the .kiln loader, with hand-made malicious files"),
    "onnx-files": ("kiln.serializer.onnx_attacks", "the ONNX importer, with crafted files"),
    "onnx-fuzz": ("kiln.serializer.onnx_fuzz", "the ONNX importer, with mutated models"),
    "mobile-fuzz": ("kiln.tools.mobile_fuzz", "kiln mobile bundle and the stub runtime, with mutated packed files"),
    "server": ("kiln.server.attacks", "the HTTP server: bad-input matrix, slow connections, SIGTERM, worker kills"),
}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__.split("\n\n")[0].replace("\n", " "))
        for name, (module, what) in ATTACKS.items():
            print(f"  {name:12s} {what} (python -m {module})")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in ATTACKS:
        print(f"kiln.tools.attack: unknown attack '{name}'; choose one of {', '.join(ATTACKS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(ATTACKS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
