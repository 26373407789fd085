"""Shared by the benchmarks: each owns one ``## ...`` section of RESULTS.md and replaces only it."""
from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(path: Path, title: str, body: str) -> None:
    """Write ``body`` (which starts with the ``title`` heading) in place of the section ``title``
    of ``path``, or append it; every other section is kept as it is."""
    old = path.read_text() if path.exists() else "# kiln benchmark results\n"
    start = old.find(title)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + body
    else:
        nxt = old.find("\n## ", start + len(title))
        rest = "" if nxt < 0 else "\n" + old[nxt + 1:]
        new = old[:start] + body.rstrip("\n") + "\n" + rest
    path.write_text(new)


def publish(target, title: str, body: str) -> None:
    """Print ``body``, then as a benchmark's ``--results`` says: None writes it as RESULTS.md's section ``title``,
    "-" leaves it printed only, anything else is a file to write it to."""
    print(body)
    if target is None:
        replace_section(RESULTS, title, body)
    elif target != "-":
        Path(target).write_text(body)


def cpu_name() -> str:
    """The processor's model name from /proc/cpuinfo (the machine type where that is missing)."""
    import platform

    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def utc_now() -> str:
    """The time of a run, as the results print it."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
