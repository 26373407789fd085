"""A griffe extension (mkdocs.yml, mkdocstrings' ``extensions``) that makes kiln's docstrings read well as
Markdown in the API reference.

kiln's docstrings are written for readers of the code: Sphinx roles (``:func:`kiln.trace```) and, here and
there, the issue a behaviour came from ("(issue 16)"). mkdocstrings renders docstrings as Markdown, where a
role shows as ``:func:`` followed by code, and an issue number means nothing to a user. This turns roles
into code spans and drops the issue references; the code's docstrings stay as they are.
"""
from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`~?([^`]+)`")
_ISSUE_ALONE = re.compile(r" ?\(issue \d+\)")
_ISSUE_LEAD = re.compile(r"\bissue \d+[:;] ?")


def clean(text: str) -> str:
    return _ISSUE_LEAD.sub("", _ISSUE_ALONE.sub("", _ROLE.sub(r"`\1`", text)))


class RestRoles(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = clean(obj.docstring.value)
