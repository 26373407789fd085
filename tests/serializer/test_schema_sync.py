"""The committed generated code matches serializer/schema/kiln.fbs (regenerated here with flatc)."""
import filecmp
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "serializer" / "schema"
GENERATED = ROOT / "serializer" / "fb"


def test_layout_matches_schema(tmp_path):
    """The verifier's layout table is generated from kiln.fbs (no flatc needed)."""
    out = tmp_path / "layout.py"
    subprocess.run(["python3", str(SCHEMA / "fbs_layout.py"), str(SCHEMA / "kiln.fbs"), str(out)], check=True)
    assert out.read_text() == (GENERATED / "layout.py").read_text(), \
        "serializer/fb/layout.py is stale: run serializer/schema/generate.sh"


@pytest.mark.skipif(shutil.which("flatc") is None, reason="flatc not installed (apt-get install flatbuffers-compiler)")
def test_generated_code_matches_schema(tmp_path):
    subprocess.run(["bash", str(SCHEMA / "generate.sh"), str(tmp_path / "fb")], check=True)
    cmp = filecmp.dircmp(tmp_path / "fb", GENERATED, ignore=["__pycache__"])
    assert (cmp.left_only, cmp.right_only, cmp.diff_files) == ([], [], []), \
        "serializer/fb is stale: run serializer/schema/generate.sh and commit the result"
