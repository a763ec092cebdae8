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


def _write_atomic(path: Path, text: str) -> None:
    # A reader (CI upload, a browser refresh) never sees a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        _write_atomic(path, text)
        paths[kind] = path
    return paths
