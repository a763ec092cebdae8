"""Write every report format for one run into a folder, from one validated dict."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .html import render_html
from .junit import render_junit
from .markdown import render_markdown
from .model import ValidatedReport, validate_report

FILENAMES = {
    "json": "report.json",
    "markdown": "report.md",
    "html": "report.html",
    "junit": "junit.xml",
}


def _umask() -> int:
    """The process umask. Linux reports it in /proc/self/status; elsewhere it is read by
    setting it (os.umask has no getter), which for an instant leaves it 0 for other threads."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)  # restored at once
    os.umask(mask)
    return mask


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically, with the mode an ordinary `open(path, "w")` would give
    (0o666 less the umask: 0644 under umask 022), so a CI artifact server, a web server or a
    colleague can read it.

    A reader (CI upload, a browser refresh) never sees a half-written file: the text goes to a
    temporary file in the same folder, which then replaces `path`. `mkstemp` creates that file
    0600; its mode is set before the rename, so the file never appears with the wrong mode.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


RENDERERS = {
    "json": lambda r: json.dumps(r, indent=2, ensure_ascii=False, allow_nan=False) + "\n",
    "markdown": render_markdown,
    "html": render_html,
    "junit": render_junit,
}


def write_reports(report: Mapping[str, Any], out_dir: str | Path,
                  formats: Iterable[str] | None = None) -> dict[str, Path]:
    """Validate `report` (once), then write report.json, report.md, report.html and junit.xml,
    or only the `formats` named (keys of FILENAMES; json is always written: every other format
    and every tool that reads reports is made from it).

    Everything is rendered before anything is written, so an invalid report or a renderer
    error leaves the folder as it was. Returns {"json"|"markdown"|"html"|"junit": path}.
    """
    validate_report(report)
    report = ValidatedReport(report)
    wanted = set(FILENAMES) if formats is None else {"json", *formats}
    unknown = sorted(wanted - set(FILENAMES))
    if unknown:
        raise ValueError(f"unknown report formats {unknown}; known: {', '.join(FILENAMES)}")
    texts = {kind: render(report) for kind, render in RENDERERS.items() if kind in wanted}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind, text in texts.items():
        path = out / FILENAMES[kind]
        write_text(path, text)
        paths[kind] = path
    return paths
