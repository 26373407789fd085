"""MkDocs hooks of kiln's guide (mkdocs.yml ``hooks:``).

- The generated blocks (gen_reference.py: every ``kiln`` option, every ``config.json`` key) are rendered
  afresh from the code at every build, so the built site always matches the kiln it was built with, even
  when the Markdown committed in docs/guide/ was not regenerated after a change to an option.
- ``mkdocs`` run as a script puts its own ``bin/`` folder first on ``sys.path``, and the ``kiln`` command
  installed there (a file named ``kiln``) would then be what mkdocstrings' loader finds for the package
  ``kiln``: "kiln.trace could not be found". Such folders are taken off the path before any page is read.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from mkdocs.plugins import event_priority

_GEN = Path(__file__).resolve().parent / "gen_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("kiln_guide_gen_reference", _GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# First of every plugin's on_config: mkdocstrings' Python handler copies sys.path when it is set up.
@event_priority(100)
def on_config(config, **kwargs):
    sys.path[:] = [p for p in sys.path if not (p and os.path.isfile(os.path.join(p, "kiln")))]
    return config


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    gen = _generator()
    for name, (source, make) in gen.BLOCKS.items():
        if page.file.src_uri == source:
            markdown = gen.render(markdown, name, make())
    return markdown
