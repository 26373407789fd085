"""Write the guide's reference sections from the code, so they cannot drift from it.

    python docs/guide/gen_reference.py          rewrite the generated blocks in place
    python docs/guide/gen_reference.py --check  exit 1 (naming the pages) when a block is out of date

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->`` in a
page; the prose around it is written by hand. The blocks:

- ``cli`` (cli.md): every ``kiln`` command and sub-command with every option and its help, read from the
  argparse parser ``kiln`` itself builds (``kiln.cli.build_parser``).
- ``serve-options`` (serving.md): ``kiln serve``'s options, grouped as ``kiln serve --help`` groups them.
- ``config-fields`` (serving.md): every ``config.json`` key, from the fields of
  ``kiln.server.repository.ModelConfig`` (their defaults) and its docstring (one bullet per field, which
  says what the key does and why the default), with the ``kiln serve`` option that overrides it.

tests/test_docs.py checks that every option and key is named on its page, whatever the wording.
Needs only kiln's core install (argparse and numpy): no torch, no server extra.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parent
BEGIN = "<!-- generated: {} -->"
END = "<!-- end generated: {} -->"
# "(issue 18: ...)" in a docstring is history for the code's readers; the guide says the what.
_ISSUE_ALONE = re.compile(r"\s*\(issue \d+\)")
_ISSUE_LEAD = re.compile(r"\bissue \d+[:;] ?")


def _clean(text: str) -> str:
    """Docstring/help text as Markdown: one line, issue numbers dropped, RST roles made plain."""
    text = " ".join(text.split())
    text = _ISSUE_LEAD.sub("", _ISSUE_ALONE.sub("", text))
    text = re.sub(r":(?:func|class|mod|meth|attr):`~?([^`]+)`", r"`\1`", text)
    # Outside code spans, <model> would be an HTML tag to Markdown.
    parts = re.split(r"(`+[^`]+`+)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in parts)


def _option_label(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (f"{{{','.join(action.choices)}}}" if action.choices else action.dest.upper())
    return f"{names} `{'[' + metavar + ']' if action.nargs == '?' else metavar}`"


def _help(action: argparse.Action) -> str:
    text = _clean(action.help or "")
    if action.help and "%(default)" in action.help:
        text = text.replace("%(default)s", str(action.default))
    if action.choices and not any(str(c) in text for c in action.choices):
        text += f" (one of {', '.join(f'`{c}`' for c in action.choices)})"
    text = text.strip()
    shown = action.default is not None and action.default is not False and action.default != [] \
        and action.default != argparse.SUPPRESS
    if shown and "default" not in text.lower():
        text += ("" if not text or text.endswith(".") else ".") + f" Default: `{action.default}`."
    return text.strip()


def _options(parser: argparse.ArgumentParser, heading: str = "####") -> list[str]:
    """The parser's arguments as Markdown lists, one per argparse group (positionals first)."""
    lines: list[str] = []
    for group in parser._action_groups:  # argparse keeps no public list of its groups
        actions = [a for a in group._group_actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if not actions:
            continue
        title = {"positional arguments": "Arguments", "options": "Options",
                 "optional arguments": "Options"}.get(group.title, group.title)
        lines += [f"{heading} {title}", ""]
        for a in actions:
            label = _option_label(a) if a.option_strings else f"`{a.metavar or a.dest}`"
            lines.append(f"- {label}: {_help(a)}")
        lines.append("")
    return lines


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def cli_block() -> list[str]:
    from kiln.cli import COMMANDS, build_parser

    lines: list[str] = []
    for name, parser in _subparsers(build_parser()).items():
        summary = _clean(COMMANDS[name][0])
        lines += [f"## kiln {name}", "", summary[:1].upper() + summary[1:] + ".", "",
                  "```text", _usage(parser), "```", ""]
        subs = _subparsers(parser)
        lines += _options(parser, "###") if not subs else []
        for sub_name, sub in subs.items():
            lines += [f"### kiln {name} {sub_name}", "", _clean(sub.description or ""), "",
                      "```text", _usage(sub), "```", ""]
            lines += _options(sub, "####")
        if parser.epilog:
            lines += [_clean(parser.epilog), ""]
    return lines


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def serve_options_block() -> list[str]:
    from kiln.server.cli import add_serve_args

    parser = argparse.ArgumentParser(prog="kiln serve")
    add_serve_args(parser)
    return _options(parser, "###")


def config_docs() -> dict[str, tuple[str, str]]:
    """{field: (default as written in the docstring, what it does)} from ModelConfig's docstring bullets."""
    from kiln.server.repository import ModelConfig

    doc = ModelConfig.__doc__ or ""
    bullets = re.split(r"\n\s*- (?=``\w+ = )", doc.split("Defaults, and why:", 1)[-1])
    out = {}
    for b in bullets[1:]:
        m = re.match(r"``(\w+) = (.+?)``:\s*(.*)", b, re.S)
        if m:
            out[m.group(1)] = (m.group(2), _clean(m.group(3)))
    return out


def config_overrides() -> dict[str, str]:
    """{config key: the kiln serve option that overrides it}, from the server CLI's own mapping."""
    from kiln.server.cli import _overrides, add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    keys = _overrides(parser.parse_args(["model.kiln"]))
    by_dest = {a.dest: a.option_strings[-1] for a in parser._actions if a.option_strings}
    return {k: by_dest[k] for k in keys if k in by_dest}


def config_fields_block() -> list[str]:
    from kiln.server.repository import ModelConfig

    docs, flags = config_docs(), config_overrides()
    lines = []
    for f in dataclasses.fields(ModelConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        written, text = docs.get(f.name, (None, ""))
        if not text:
            raise SystemExit(f"ModelConfig's docstring has no '- ``{f.name} = ...``:' bullet: write one")
        shown = written if written is not None else repr(default)
        flag = f" Command line: `{flags[f.name]}`." if f.name in flags else ""
        lines.append(f"- **`{f.name}`** (default `{shown}`): {text}{flag}")
    return lines + [""]


BLOCKS = {"cli": ("cli.md", cli_block), "serve-options": ("serving.md", serve_options_block),
          "config-fields": ("serving.md", config_fields_block)}


def render(text: str, name: str, body: list[str]) -> str:
    begin, end = BEGIN.format(name), END.format(name)
    if begin not in text or end not in text:
        raise SystemExit(f"the page has no '{begin}' ... '{end}' markers for block {name!r}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + "\n\n" + "\n".join(body).rstrip() + "\n\n" + end + tail


def main(argv: list[str]) -> int:
    check = "--check" in argv
    pages: dict[str, str] = {}
    for name, (page, make) in BLOCKS.items():
        text = pages.get(page) or (GUIDE / page).read_text(encoding="utf-8")
        pages[page] = render(text, name, make())
    stale = [p for p, t in pages.items() if (GUIDE / p).read_text(encoding="utf-8") != t]
    if check:
        for p in stale:
            print(f"docs/guide/{p} is out of date: run python docs/guide/gen_reference.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        (GUIDE / p).write_text(pages[p], encoding="utf-8")
        print(f"wrote docs/guide/{p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
