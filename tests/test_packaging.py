"""The wheel carries every package, with ``kernels/`` installed as ``kvlab.kernels``.

The package list in pyproject.toml is explicit (setuptools cannot *find* a folder that
is renamed on install), so a new subpackage that is not listed would work in the editable
install used by `make test` and be missing from a wheel. This test builds the wheel.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvlab").rglob("__init__.py")}
    on_disk.add("kvlab.kernels")
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"


def test_wheel_installs_kernels_as_kvlab_kernels(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in [
        "kvlab/kernels/__init__.py",
        "kvlab/kernels/attention.py",
        "kvlab/kernels/cache_ops.py",
        "kvlab/viz/player.py",
        "kvlab/viz/static/replay.js",  # package data: the Player's browser renderer
        "kvlab/exercises/checks_kernels.py",
        "kvlab/exercises/kernel_harness.py",
        "kvlab/core/block_pool.py",
        "kvlab/core/sched/scheduler.py",
    ]:
        assert f in names, f"{f} missing from the wheel"
    assert not any(n.startswith("kernels/") for n in names), "kernels/ must install as kvlab/kernels/"


def test_every_phony_make_target_has_a_recipe():
    """A target declared .PHONY but without a recipe (as `test-fast` once was) does nothing."""
    import re

    text = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()
    for target in phony:
        rule = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)*)", text, re.M)
        assert rule, f"make target {target!r} is declared but has no rule"
        assert rule.group(2) or rule.group(1).strip(), f"make target {target!r} has neither a recipe nor prerequisites"
    assert 'pytest -m "not slow and not notebook"' in text
