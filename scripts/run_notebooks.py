#!/usr/bin/env python3
"""Execute notebooks in place for committing: outputs kept, widget state dropped, timed.

A maintainer's tool, not part of the package: ``.venv/bin/python scripts/run_notebooks.py
notebooks/03_prefix_caching.ipynb …`` runs each notebook top to
bottom in a fresh kernel (as nbval will in CI) and saves it with its outputs -- the cells
marked ``# NBVAL_CHECK_OUTPUT`` are then the lesson's claims that CI compares -- but without
the ipywidgets/plotly widget state, which would add megabytes of plotly.js per file.
Each "predict, then run" answer is printed as plain text (``KVLAB_PREDICT=plain``) and the
learner's record goes to a temporary ``KVLAB_HOME``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path, timeout: int = 300) -> float:
    """Run one notebook as CI will: answers printed as text (no prediction widget), and the
    learner's record in a throw-away folder (the stored notebook shows nobody's progress)."""
    nb = nbformat.read(path, as_version=4)
    t = time.perf_counter()
    saved = {k: os.environ.get(k) for k in ("KVLAB_HOME", "KVLAB_PREDICT")}
    with tempfile.TemporaryDirectory(prefix="kvlab-home-") as home:
        os.environ.update(KVLAB_HOME=home, KVLAB_PREDICT="plain")  # the kernel inherits both
        try:
            NotebookClient(
                nb,
                timeout=timeout,
                kernel_name="python3",
                store_widget_state=False,
                resources={"metadata": {"path": str(path.parent)}},
            ).execute()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    elapsed = time.perf_counter() - t
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python scripts/run_notebooks.py NOTEBOOK.ipynb [...]", file=sys.stderr)
        return 2
    rows = []
    for p in paths:
        secs = execute(p)
        size = p.stat().st_size / 1024
        rows.append((p.name, secs, size))
        print(f"{p.name:<40} {secs:6.1f} s  {size:7.0f} KiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
