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


_HOME = tempfile.mkdtemp(prefix="kvlab-home-")
os.environ["KVLAB_HOME"] = _HOME
os.environ["KVLAB_PREDICT"] = "plain"


def pytest_unconfigure(config):  # noqa: ARG001 - pytest's hook signature
    shutil.rmtree(_HOME, ignore_errors=True)
