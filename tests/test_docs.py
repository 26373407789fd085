"""The user guide (docs/guide/, mkdocs.yml) against the code it documents.

- Every ``kiln serve`` option and every ``config.json`` key (``ModelConfig``'s fields) is named in
  serving.md, and every option of every ``kiln`` command in its section of cli.md: a new option fails
  here until ``python docs/guide/gen_reference.py`` regenerates the pages.
- Every error class of ``kiln.errors`` (and ``GuardFailed``, ``EvaluationError``) has its section in
  troubleshooting.md, and every extra of pyproject.toml is on the install page.
- Every ``kiln ...`` line of the guide's bash blocks parses with kiln's own parser, every Python block
  compiles, and every ``config.json`` example is accepted by ``ModelConfig``.
- The guide stands alone: no issue numbers, no paths outside the repository.
- ``mkdocs build --strict`` passes (when mkdocs, mkdocs-material and mkdocstrings are installed, as in CI's
  docs venv; skipped otherwise), and the built site renders the generated reference and the API reference.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide"
PAGES = sorted(GUIDE.glob("*.md"))


def page(name: str) -> str:
    return (GUIDE / name).read_text(encoding="utf-8")


def blocks(text: str, lang: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block whose language is ``lang``."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```" + lang + r"\b([^\n]*)\n(.*?)^```", text, re.M | re.S)]


def long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def regenerate() -> str:
    return "run python docs/guide/gen_reference.py to regenerate the guide's reference blocks"


# ---------------------------------------------------------------------------- reference completeness
def test_every_serve_option_is_in_the_serving_page():
    from kiln.server.cli import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    text = page("serving.md")
    missing = [o for o in long_options(parser) if f"`{o}`" not in text]
    assert not missing, f"kiln serve option(s) {missing} are not documented in docs/guide/serving.md: {regenerate()}"


def test_every_config_key_is_in_the_serving_page():
    from kiln.server.repository import ModelConfig

    text = page("serving.md")
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f"**`{f.name}`**" not in text]
    assert not missing, f"config.json key(s) {missing} are not documented in docs/guide/serving.md: {regenerate()}"


def test_every_config_key_has_its_docstring_bullet():
    """The generated list takes each key's text from ModelConfig's docstring: a key without one cannot be
    documented (the generator stops), so a new field needs its bullet."""
    sys.path.insert(0, str(GUIDE))
    try:
        import gen_reference
    finally:
        sys.path.remove(str(GUIDE))
    from kiln.server.repository import ModelConfig

    docs = gen_reference.config_docs()
    assert {f.name for f in dataclasses.fields(ModelConfig)} <= set(docs), \
        "a ModelConfig field has no '- ``name = default``: ...' bullet in the class docstring"


def test_every_command_option_is_in_the_cli_page():
    from kiln.cli import build_parser

    text = page("cli.md")
    sections = dict(re.findall(r"^## kiln (\S+)\n(.*?)(?=^## kiln |\Z)", text, re.M | re.S))
    missing = []
    for name, parser in subparsers(build_parser()).items():
        if name not in sections:
            missing.append(f"kiln {name} (the whole command)")
            continue
        subs = subparsers(parser) or {"": parser}
        for sub_name, sub in subs.items():
            missing += [f"kiln {name} {sub_name} {o}".replace("  ", " ") for o in long_options(sub)
                        if f"`{o}`" not in sections[name]]
    assert not missing, f"not documented in docs/guide/cli.md: {missing}: {regenerate()}"


def test_every_error_class_is_in_troubleshooting():
    import kiln.errors
    from kiln.checks import GuardFailed
    from kiln.ir.evaluator import EvaluationError

    classes = [c for c in vars(kiln.errors).values()
               if isinstance(c, type) and issubclass(c, (kiln.errors.KilnError, Warning))
               and c.__module__ == "kiln.errors"]
    classes += [GuardFailed, EvaluationError]
    assert len(classes) >= 12
    headings = set(re.findall(r"^### (\w+)$", page("troubleshooting.md"), re.M))
    missing = [c.__name__ for c in classes if c.__name__ not in headings]
    assert not missing, f"error classes without a '### Name' section in docs/guide/troubleshooting.md: {missing}"


def test_every_extra_is_on_the_install_page():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    table = page("install.md")
    missing = [e for e in extras if f"| `{e}` |" not in table]
    assert not missing, f"extras {missing} of pyproject.toml are not in docs/guide/install.md's table"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES if f": {p.name}" not in nav]
    assert not missing, f"docs/guide pages missing from mkdocs.yml's nav: {missing}"


# ---------------------------------------------------------------------------- examples that must work
def _command_lines(text: str) -> list[str]:
    lines = []
    for _, body in blocks(text, "bash"):
        joined = re.sub(r" *\\\n\s*", " ", body)
        lines += [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("kiln ")]
    return lines


def test_guide_commands_parse():
    """Each `kiln ...` line of the guide's shell examples is accepted by kiln's own parser: an option renamed
    or removed fails here."""
    from kiln.cli import build_parser

    parser = build_parser()
    bad, count = [], 0
    for p in PAGES:
        for line in _command_lines(p.read_text(encoding="utf-8")):
            argv = shlex.split(line, comments=True)[1:]
            count += 1
            try:
                parser.parse_args(argv)
            except SystemExit as e:  # kiln --version exits 0
                if e.code:
                    bad.append(f"{p.name}: {line}")
    assert count > 30
    assert not bad, "guide commands kiln's parser refuses:\n" + "\n".join(bad)


def test_guide_commands_check_catches_a_wrong_option():
    """The check above can fail: a command with an option kiln does not have is refused."""
    from kiln.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(shlex.split("serve model.kiln --max-batches-of 4"))
    assert _command_lines("```bash\nkiln run m.kiln \\\n    -i x=a.npy   # comment\n```\n") == \
        ["kiln run m.kiln -i x=a.npy   # comment"]


def test_python_examples_compile():
    """Every ```python block is runnable code (signatures are shown in ```py blocks, which this skips)."""
    bad = []
    for p in PAGES:
        for i, (_, body) in enumerate(blocks(p.read_text(encoding="utf-8"), "python")):
            try:
                compile(body, f"{p.name} block {i}", "exec")
            except SyntaxError as e:
                bad.append(f"{p.name} block {i}: {e}")
    assert not bad, "\n".join(bad)


def test_config_examples_are_valid():
    from kiln.server.repository import ModelConfig

    found = 0
    for p in PAGES:
        for info, body in blocks(p.read_text(encoding="utf-8"), "json"):
            if "config.json" in info:
                found += 1
                ModelConfig.from_json(json.loads(body), f"{p.name}: {info.strip()}")
    assert found >= 3


def test_guide_stands_alone():
    """No issue numbers, no shared/ paths, no links that leave the repository."""
    bad = []
    for p in PAGES:
        text = p.read_text(encoding="utf-8")
        for pattern in (r"\bissue \d+", r"\.\./shared|\bshared/", r"\]\(\.\./\.\./\.\."):
            bad += [f"{p.name}: {m.group(0)!r}" for m in re.finditer(pattern, text, re.I)]
    assert not bad, bad


# ---------------------------------------------------------------------------- the site
def _have_mkdocs() -> bool:
    return all(importlib.util.find_spec(m) for m in ("mkdocs", "material", "mkdocstrings_handlers"))


@pytest.mark.skipif(not _have_mkdocs(), reason="mkdocs, mkdocs-material and mkdocstrings are not installed "
                                                "(pip install -e '.[docs]'; CI builds the guide in .venv-docs)")
def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for p in PAGES:
        assert (site / p.with_suffix(".html").name).is_file(), p.name
    # The hook rendered the generated blocks from the code, whatever the committed Markdown holds.
    serving = (site / "serving.html").read_text(encoding="utf-8")
    from kiln.server.cli import add_serve_args
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert all(o in serving for o in long_options(parser))
    # mkdocstrings found the package and rendered the docstrings (roles made plain).
    api = (site / "api.html").read_text(encoding="utf-8")
    assert "dynamic_batch" in api and "LoadLimits" in api and "GuardFailed" in api
    assert ":func:" not in api
    # Offline: no stylesheet or script from another host.
    index = (site / "index.html").read_text(encoding="utf-8")
    assert not re.search(r"<(?:link|script)[^>]+(?:href|src)=\"https?://", index)
