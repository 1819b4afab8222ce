"""Every pytest run -- tests/ and the notebooks under nbval -- keeps the learner's record out
of anyone's home: ``KVLAB_HOME`` points at a fresh temporary folder (a passed check or a
locked prediction is written there, never to ``~/.kvlab`` or the repository), and
``KVLAB_PREDICT=plain`` makes each "predict, then run" cell print its answer as text, so the
cells marked ``# NBVAL_CHECK_OUTPUT`` check the lessons' claims. Kernels started by nbval or
nbclient inherit both variables. (Set here, at the root, because nbval collects notebooks/
without reading tests/conftest.py.)
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_HOME = tempfile.mkdtemp(prefix="kvlab-home-")
os.environ["KVLAB_HOME"] = _HOME
os.environ["KVLAB_PREDICT"] = "plain"


def pytest_unconfigure(config):  # noqa: ARG001 - pytest's hook signature
    shutil.rmtree(_HOME, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    """`make test` runs pytest on two workers (pytest-xdist). The browser tests stay together
    on one worker, in order (``--dist loadgroup``): one JupyterLab and one Chromium serve them
    all, and two of each would only fight over two cores. Everything else is spread over both
    workers. (The notebooks run with ``--dist loadfile``: a notebook's cells share a kernel.)"""
    for item in items:
        if item.path.parent.name == "browser":
            item.add_marker(pytest.mark.xdist_group("browser"))
