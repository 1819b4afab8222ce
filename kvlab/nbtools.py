"""Execute notebooks in place for committing: outputs kept, widget state dropped, timed.

``python -m kvlab.nbtools notebooks/03_prefix_caching.ipynb …`` runs each notebook top to
bottom in a fresh kernel (as nbval will in CI) and saves it with its outputs -- the cells
marked ``# NBVAL_CHECK_OUTPUT`` are then the lesson's claims that CI compares -- but without
the ipywidgets/plotly widget state, which would add megabytes of plotly.js per file.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path, timeout: int = 300) -> float:
    nb = nbformat.read(path, as_version=4)
    t = time.perf_counter()
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        store_widget_state=False,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    elapsed = time.perf_counter() - t
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m kvlab.nbtools NOTEBOOK.ipynb [...]", file=sys.stderr)
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
