"""The learner's working copies of the course: what ``make lab`` opens.

The notebooks in ``notebooks/`` and ``exercises/`` are stored *with* their outputs: CI
replays them (nbval) and anyone can read them online. But a learner who opened those very
files would find every "predict, then run" answer already printed below the question, and
their edits would fight ``git pull``. So ``make lab`` opens copies instead:

* ``prepare(repo, dest)`` copies each lesson and exercise notebook into ``dest`` (the same
  sub-folders, so the links between lessons and exercises keep working) with every output
  and execution count cleared. A copy that already exists is never touched: the learner's
  work survives every ``make lab``; lessons added later (a ``git pull``) are copied in.
* ``reset(repo, dest)`` starts over: the old folder is *moved* aside (nothing a learner
  wrote is deleted) and fresh copies are made.
* ``write_lab_settings(prefix)`` sets JupyterLab's defaults for the environment at
  ``prefix``: no news pop-up, no update check -- nothing covers the first lesson.

``python -m kvlab.workspace prepare|reset|settings [--dest my-kvlab]`` is what the Makefile
and the Binder configuration run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DEST = "my-kvlab"
SOURCES = ("notebooks", "exercises")  # never solutions/: those are the answers
FIRST_LESSON = "notebooks/00_start_here.ipynb"
# JupyterLab reads <prefix>/share/jupyter/lab/settings/overrides.json as the defaults of
# every user of that environment; a user's own settings still win.
LAB_OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def cleared(nb: dict) -> dict:
    """The notebook with every output, execution count and stored widget state removed."""
    out = json.loads(json.dumps(nb))
    for cell in out.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
            cell["source"] = _without_test_markers(cell.get("source", ""))
        cell.get("metadata", {}).pop("execution", None)
    out.get("metadata", {}).pop("widgets", None)
    return out


def _without_test_markers(source: str | list[str]) -> str:
    """Drop CI's ``# NBVAL_...`` marker lines: they mean nothing to a learner."""
    text = "".join(source) if isinstance(source, list) else source
    return "".join(line for line in text.splitlines(keepends=True) if not line.strip().startswith("# NBVAL_"))


def _sources(repo: Path) -> list[tuple[Path, Path]]:
    """(source file, path relative to the working folder), lessons first."""
    files = []
    for sub in SOURCES:
        folder = repo / sub
        if not folder.is_dir():
            raise FileNotFoundError(f"repo: no {sub}/ folder under {repo} (is this a kvlab checkout?)")
        files += [(p, p.relative_to(repo)) for p in sorted(folder.glob("*.ipynb"))]
        readme = folder / "README.md"
        if readme.is_file():
            files.append((readme, readme.relative_to(repo)))
    return files


def prepare(repo: Path = REPO, dest: Path | str = DEFAULT_DEST) -> list[Path]:
    """Create the working copies that do not exist yet; return the ones created.

    ``dest`` is relative to ``repo`` unless absolute. Existing files are never
    overwritten. Each copy is written to a temporary name and renamed, so an interrupted
    run leaves either a complete notebook or none.
    """
    repo = Path(repo)
    dest = _dest(repo, dest)
    created = []
    for src, rel in _sources(repo):
        target = dest / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".ipynb":
            text = json.dumps(cleared(json.loads(src.read_text(encoding="utf-8"))), indent=1, ensure_ascii=False) + "\n"
        else:
            text = src.read_text(encoding="utf-8")
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
        created.append(target)
    return created


def reset(repo: Path = REPO, dest: Path | str = DEFAULT_DEST) -> Path | None:
    """Move the working folder aside (to ``<dest>-backup-<time>``) and prepare it anew.

    Returns where the old folder went (None if there was none)."""
    repo = Path(repo)
    dest = _dest(repo, dest)
    backup = None
    if dest.exists():
        backup = dest.with_name(f"{dest.name}-backup-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while backup.exists():
            n += 1
            backup = backup.with_name(f"{dest.name}-backup-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        shutil.move(str(dest), str(backup))
    prepare(repo, dest)
    return backup


def write_lab_settings(prefix: Path | str = sys.prefix) -> Path:
    """Merge kvlab's JupyterLab defaults into ``<prefix>/share/jupyter/lab/settings/overrides.json``."""
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    current = {}
    if path.is_file():
        try:
            current = json.loads(path.read_text(encoding="utf-8") or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); fix or delete it") from None
        if not isinstance(current, dict):
            raise ValueError(f"{path} must hold a JSON object, found {type(current).__name__}")
    for plugin, values in LAB_OVERRIDES.items():
        current.setdefault(plugin, {}).update(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2) + "\n", encoding="utf-8")
    return path


def _dest(repo: Path, dest: Path | str) -> Path:
    if not isinstance(dest, (str, Path)) or not str(dest).strip():
        raise ValueError(f"dest must be a folder path, got {dest!r}")
    dest = Path(dest)
    dest = dest if dest.is_absolute() else repo / dest
    for sub in SOURCES + ("solutions",):
        if dest.resolve() == (repo / sub).resolve():
            raise ValueError(f"dest must not be the repository's own {sub}/ folder (its originals would be cleared)")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab.workspace", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("prepare", "reset", "settings"))
    ap.add_argument("--dest", default=DEFAULT_DEST, help=f"working folder, relative to the repository (default {DEFAULT_DEST})")
    ap.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    repo = Path(args.repo)
    if args.action == "prepare":
        made = prepare(repo, args.dest)
        where = _dest(repo, args.dest)
        print(f"kvlab: {len(made)} new working cop{'y' if len(made) == 1 else 'ies'} in {where} (existing ones kept)")
    elif args.action == "reset":
        old = reset(repo, args.dest)
        print(f"kvlab: fresh working copies in {_dest(repo, args.dest)}" + (f"; your old ones are in {old}" if old else ""))
    else:
        print(f"kvlab: JupyterLab defaults written to {write_lab_settings()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
