"""`make lab`'s working copies, its JupyterLab defaults, and the shared install script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from kvlab import workspace

REPO = Path(__file__).resolve().parents[1]


def _nb(*cells: tuple[str, str, list]) -> dict:
    return {
        "cells": [
            {
                "cell_type": t,
                "metadata": {"execution": {"x": 1}} if t == "code" else {},
                "source": s,
                **({"outputs": o, "execution_count": 3} if t == "code" else {}),
            }
            for t, s, o in cells
        ],
        "metadata": {"widgets": {"state": "big"}, "kernelspec": {"name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


@pytest.fixture
def fake_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for sub in ("notebooks", "exercises", "solutions"):
        (repo / sub).mkdir(parents=True)
    out = [{"output_type": "stream", "name": "stdout", "text": "42\n"}]
    (repo / "notebooks" / "00_a.ipynb").write_text(
        json.dumps(_nb(("markdown", "# A", []), ("code", "# NBVAL_CHECK_OUTPUT\nprint(42)", out)))
    )
    (repo / "notebooks" / "README.md").write_text("course map\n")
    (repo / "exercises" / "ex_a.ipynb").write_text(json.dumps(_nb(("code", "x = 1", out))))
    (repo / "solutions" / "ex_a.ipynb").write_text(json.dumps(_nb(("code", "x = 'answer'", []))))
    return repo


def test_prepare_copies_lessons_and_exercises_with_outputs_cleared(fake_repo: Path):
    made = workspace.prepare(fake_repo, "work")
    dest = fake_repo / "work"
    assert sorted(p.relative_to(dest).as_posix() for p in made) == ["exercises/ex_a.ipynb", "notebooks/00_a.ipynb", "notebooks/README.md"]
    assert not (dest / "solutions").exists()  # the answers stay out of the learner's folder
    nb = json.loads((dest / "notebooks" / "00_a.ipynb").read_text())
    code = nb["cells"][1]
    assert code["outputs"] == [] and code["execution_count"] is None and "execution" not in code["metadata"]
    assert code["source"] == "print(42)" and nb["cells"][0]["source"] == "# A"  # CI's marker is gone
    assert "widgets" not in nb["metadata"] and nb["metadata"]["kernelspec"] == {"name": "python3"}
    # the originals keep their outputs
    assert json.loads((fake_repo / "notebooks" / "00_a.ipynb").read_text())["cells"][1]["outputs"]


def test_prepare_never_overwrites_and_adds_new_lessons(fake_repo: Path):
    workspace.prepare(fake_repo, "work")
    mine = fake_repo / "work" / "notebooks" / "00_a.ipynb"
    mine.write_text("my edits")
    assert workspace.prepare(fake_repo, "work") == []
    assert mine.read_text() == "my edits"
    (fake_repo / "notebooks" / "01_b.ipynb").write_text(json.dumps(_nb(("code", "1", []))))
    assert workspace.prepare(fake_repo, "work") == [fake_repo / "work" / "notebooks" / "01_b.ipynb"]
    assert mine.read_text() == "my edits"


def test_reset_moves_the_old_folder_aside(fake_repo: Path):
    workspace.prepare(fake_repo, "work")
    (fake_repo / "work" / "notebooks" / "00_a.ipynb").write_text("my edits")
    backup = workspace.reset(fake_repo, "work")
    assert backup is not None and backup.name.startswith("work-backup-")
    assert (backup / "notebooks" / "00_a.ipynb").read_text() == "my edits"
    fresh = json.loads((fake_repo / "work" / "notebooks" / "00_a.ipynb").read_text())
    assert fresh["cells"][1]["outputs"] == []
    assert workspace.reset(fake_repo, "other") is None  # nothing to move aside


@pytest.mark.parametrize("bad", ["notebooks", "exercises", "solutions", "", None, 3])
def test_dest_must_not_be_an_original_folder(fake_repo: Path, bad):
    before = (fake_repo / "notebooks" / "00_a.ipynb").read_text()
    with pytest.raises(ValueError, match="dest"):
        workspace.prepare(fake_repo, bad)
    assert (fake_repo / "notebooks" / "00_a.ipynb").read_text() == before


def test_prepare_names_a_missing_source_folder(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="no notebooks/ folder"):
        workspace.prepare(tmp_path, "work")


def test_the_real_course_copies_cleanly(tmp_path: Path):
    made = workspace.prepare(REPO, tmp_path / "work")
    lessons = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in made if p.parent.name == "notebooks" and p.suffix == ".ipynb") == lessons
    for p in made:
        if p.suffix == ".ipynb":
            nb = json.loads(p.read_text())
            assert all(c.get("outputs", []) == [] for c in nb["cells"]), p
    assert (tmp_path / "work" / workspace.FIRST_LESSON).is_file()


def test_lab_settings_merge_and_reject_garbage(tmp_path: Path):
    path = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps(
            {
                "@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"},
                "@jupyterlab/apputils-extension:notification": {"doNotDisturbMode": True},
            }
        )
    )
    assert workspace.write_lab_settings(tmp_path) == path
    got = json.loads(path.read_text())
    assert got["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    assert got["@jupyterlab/apputils-extension:notification"] == {"doNotDisturbMode": True, "fetchNews": "false", "checkForUpdates": False}
    path.write_text("{not json")
    with pytest.raises(ValueError, match="overrides.json is not valid JSON"):
        workspace.write_lab_settings(tmp_path)
    assert path.read_text() == "{not json"


def _make_n_lab(tmp_path: Path, uid: str) -> str:
    """`make -n lab` with `id -u` answering ``uid`` (the recipe, not run)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (fake / "id").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    r = subprocess.run(["make", "-n", "-o", "install", "lab"], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lab_allows_root_only_for_root(tmp_path: Path):
    as_root, as_user = _make_n_lab(tmp_path, "0"), _make_n_lab(tmp_path, "1000")
    assert "jupyter lab --allow-root" in as_root
    assert "--allow-root" not in as_user and "jupyter lab" in as_user
    for out in (as_root, as_user):
        assert "kvlab.workspace prepare --dest my-kvlab" in out
        assert "--ServerApp.root_dir=my-kvlab" in out and "--LabApp.default_url=/lab/tree/notebooks/00_start_here.ipynb" in out


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.skipif(not Path("/opt/wheels").is_dir(), reason="the CPU torch wheel is not on this disk")
def test_binder_install_steps_work_in_a_fresh_venv(tmp_path: Path):
    """binder/postBuild's steps (scripts/install.sh, then the workspace) in a brand-new venv.

    Binder itself takes torch from PyTorch's CPU index; here the same wheel comes from
    /opt/wheels. The repository is copied so the editable install cannot touch the
    checkout under test."""
    src = tmp_path / "kvlab"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "my-kvlab*", "test-artifacts", "*.egg-info", "build"))
    venv.create(tmp_path / "venv", with_pip=True)
    py = tmp_path / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{py.parent}:{env['PATH']}"
    env.pop("TORCH_INDEX_URL", None)
    # pip byte-compiles every module it installs (torch's thousands: 20 s of CPU here), an
    # optimisation Binder's image keeps; the steps under test are the same without it.
    env["PIP_COMPILE"] = "0"
    post = (src / "binder" / "postBuild").read_text()
    assert "scripts/install.sh python lab" in post and "kvlab.workspace prepare" in post
    subprocess.run(["scripts/install.sh", str(py), "lab"], cwd=src, env=env, check=True, timeout=1200)
    subprocess.run([str(py), "-m", "kvlab.workspace", "prepare"], cwd=src, env=env, check=True, timeout=120)
    subprocess.run([str(py), "-m", "kvlab.workspace", "settings"], cwd=src, env=env, check=True, timeout=120)
    r = subprocess.run(
        [str(py), "-c", "import torch, kvlab, kvlab.viz, kvlab.kernels; print(torch.__version__, kvlab.kernels.INTERPRET)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert r.stdout.split() == ["2.13.0+cpu", "True"]
    assert (src / "my-kvlab" / workspace.FIRST_LESSON).is_file()
    assert (
        json.loads((tmp_path / "venv" / "share" / "jupyter" / "lab" / "settings" / "overrides.json").read_text())[
            "@jupyterlab/apputils-extension:notification"
        ]["fetchNews"]
        == "false"
    )
