"""Write every report format for one run into a folder, from one validated dict."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .html import render_html
from .junit import render_junit
from .markdown import render_markdown
from .model import validate_report

FILENAMES = {
    "json": "report.json",
    "markdown": "report.md",
    "html": "report.html",
    "junit": "junit.xml",
}


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; restored at once
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


def write_reports(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Validate `report`, then write report.json, report.md, report.html and junit.xml.

    Everything is rendered before anything is written, so an invalid report or a renderer
    error leaves the folder as it was. Returns {"json"|"markdown"|"html"|"junit": path}.
    """
    validate_report(report)
    texts = {
        "json": json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n",
        "markdown": render_markdown(report),
        "html": render_html(report),
        "junit": render_junit(report),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind, text in texts.items():
        path = out / FILENAMES[kind]
        write_text(path, text)
        paths[kind] = path
    return paths
