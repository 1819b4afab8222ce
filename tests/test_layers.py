"""The layer contracts (import-linter, configured in pyproject.toml) hold, and they can fail.

``make test`` runs ``lint-imports`` before pytest; here the same check runs on the tree, and
again on a copy of the tree with one planted violation per contract -- each contract must
report itself broken, so a contract that silently checks nothing (a typo in a module name,
a package the analysis cannot see) fails this test.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = pathlib.Path(sys.executable).with_name("lint-imports")

CONTRACTS = {
    # contract name (as printed) -> (file to plant into, the planted line)
    "The core imports no torch, Triton, plotly, ipywidgets or ZeroMQ, and nothing above it": ("kvlab/core/block_pool.py", "import torch"),
    "kernels/ (kvlab.kernels) imports nothing of kvlab": ("kernels/reference.py", "from kvlab.core.block_pool import BlockPool"),
    "Views import the data layer and plotting libraries only: no engine, scheduler, runner, executor or scenarios": (
        "kvlab/viz/pool.py",
        "from kvlab.engine.llm_engine import LLMEngine",
    ),
    "The data layer (kvlab.timeline) imports no view, nothing of the engine, and no socket": (
        "kvlab/timeline/snapshot.py",
        "import kvlab.viz.style",
    ),
    # A core module importing the kernels through their installed name: invisible to the
    # analysis as kvlab.kernels, seen as an import of the kvlab package itself.
    "The core, the data layer and the views never import the kvlab package facade": (
        "kvlab/core/kv_cache_utils.py",
        "from kvlab.kernels import reshape_and_cache",
    ),
    "The learner's predictions and record import nothing of the engine, the exercises or the views": (
        "kvlab/learner/store.py",
        "import kvlab.exercises",
    ),
    "No import cycle between sibling modules or packages, at any depth": ("kvlab/engine/llm_engine.py", "import kvlab.show"),
    "The offload tiers' scheduler-side books import no torch and no worker code": (
        "kvlab/kv_offload/tiering/manager.py",
        "import kvlab.kv_offload.cpu.gpu_worker",
    ),
    "The event log (kvlab.eventlog) imports neither the core nor the data layer that replays it": (
        "kvlab/eventlog/events.py",
        "from kvlab.timeline.state import ReplayState",
    ),
    "The taught free queue, hash map and block pool know nothing of kvlab.core.transaction": (
        "kvlab/core/block_pool.py",
        "from kvlab.core.transaction import checkpoint_pool",
    ),
}
# The core must not reach beyond the pool either: a second planted line for its contract.
CORE_BEYOND_POOL = ("kvlab/core/sched/scheduler.py", "from kvlab.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole")


def lint(cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(cwd), COLUMNS="200")
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> pathlib.Path:
    dst = tmp_path_factory.mktemp("tree")
    for name in ("kvlab", "kernels"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_lint_imports_passes_on_the_tree() -> None:
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out.stdout


def test_the_copy_is_what_gets_analysed(copy: pathlib.Path) -> None:
    out = lint(copy)
    assert out.returncode == 0 and str(copy) not in str(ROOT), out.stdout


@pytest.mark.parametrize("name", list(CONTRACTS))
def test_a_planted_violation_breaks_its_contract(copy: pathlib.Path, name: str) -> None:
    path, line = CONTRACTS[name]
    target = copy / path
    original = target.read_text()
    target.write_text(original + f"\n{line}  # planted by tests/test_layers.py\n")
    try:
        out = lint(copy)
    finally:
        target.write_text(original)
    text = " ".join(out.stdout.split())  # long names wrap in the report
    assert out.returncode != 0 and f"{name} BROKEN" in text, out.stdout


def test_the_core_may_not_import_a_connector(copy: pathlib.Path) -> None:
    path, line = CORE_BEYOND_POOL
    target = copy / path
    original = target.read_text()
    target.write_text(original + f"\n{line}  # planted by tests/test_layers.py\n")
    try:
        out = lint(copy)
    finally:
        target.write_text(original)
    text = " ".join(out.stdout.split())
    core = next(n for n in CONTRACTS if n.startswith("The core imports no torch"))
    assert out.returncode != 0 and f"{core} BROKEN" in text, out.stdout


def test_importing_a_view_loads_no_engine_scheduler_or_plotly() -> None:
    code = (
        "import sys, kvlab.viz.pool, kvlab.viz.timeline;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'plotly', 'ipywidgets')"
        " or m.startswith(('kvlab.engine', 'kvlab.core', 'kvlab.scenarios', 'kvlab.worker', 'kvlab.executor')));"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_public_api_is_importable_from_the_top_level() -> None:
    import kvlab

    for name in kvlab.__all__:
        assert getattr(kvlab, name) is not None, name
    from kvlab import EventLog, LLMEngine, Snapshot, Timeline, build_engine, replay, show

    assert callable(show) and show.show is kvlab.show.show
    assert {LLMEngine.__module__, EventLog.__module__, Snapshot.__module__, Timeline.__module__} == {
        "kvlab.engine.llm_engine",
        "kvlab.eventlog.events",
        "kvlab.timeline.snapshot",
        "kvlab.timeline.timeline",
    }
    assert callable(build_engine) and callable(replay)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvlab.nope  # noqa: B018


RUFF = pathlib.Path(sys.executable).with_name("ruff")


def test_ruff_passes_on_the_tree_and_catches_a_planted_mistake(tmp_path: pathlib.Path) -> None:
    """`make test` runs `ruff check` with pyproject.toml's settings: the tree passes, and the
    mistakes the lint is there for (an unused import, an undefined name) fail it."""
    out = subprocess.run(
        [str(RUFF), "check", "--no-cache", "kvlab", "kernels", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    planted = tmp_path / "kvlab" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    out = subprocess.run(
        [str(RUFF), "check", "--no-cache", "--output-format", "concise", "kvlab"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    assert [line.split(" ", 2)[1] for line in out.stdout.splitlines() if line.startswith("kvlab/")] == ["F401", "F821"], out.stdout


def test_ruff_format_passes_on_the_tree_and_catches_an_unformatted_file(tmp_path: pathlib.Path) -> None:
    """`make test` runs `ruff format --check`: the tree is formatted, and a file that is not
    (here: single quotes, a cramped call) fails the check and is named."""
    out = subprocess.run(
        [str(RUFF), "format", "--check", "--no-cache", "kvlab", "kernels", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    planted = tmp_path / "kvlab" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("def f( x ):\n    return {'a':x}\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    out = subprocess.run([str(RUFF), "format", "--check", "--no-cache", "kvlab"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "kvlab/planted.py" in out.stdout, out.stdout + out.stderr


MYPY = pathlib.Path(sys.executable).with_name("mypy")


@pytest.mark.slow  # a cold mypy run over the tree takes ~30 s (warm: a second)
def test_mypy_passes_on_the_tree_and_catches_a_planted_type_error(tmp_path: pathlib.Path) -> None:
    """`make test` checks the types here: `mypy` with pyproject.toml's settings (which name the files): the tree
    type-checks, and a type error planted in a copy of a module fails the check and is named."""
    out = subprocess.run([str(MYPY)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("kvlab", "kernels"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    if (ROOT / ".mypy_cache").is_dir():  # the run above left it: only the planted module is checked again
        shutil.copytree(ROOT / ".mypy_cache", tmp_path / ".mypy_cache")
    target = tmp_path / "kvlab" / "bench" / "memory.py"  # imported by nothing but the bench's entry point
    original = target.read_text()
    target.write_text(original + '\n\ndef _planted() -> int:\n    return "not an int"  # planted by tests/test_layers.py\n')
    line = len(original.splitlines()) + 4
    out = subprocess.run([str(MYPY)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"kvlab/bench/memory.py:{line}: error: Incompatible return value type" in out.stdout, out.stdout
