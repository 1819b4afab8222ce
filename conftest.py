"""Every pytest run -- tests/ and the notebooks under nbval -- keeps the learner's record out
of anyone's home: ``KVLAB_HOME`` points at a fresh temporary folder (a passed check or a
locked prediction is written there, never to ``~/.kvlab`` or the repository), and
``KVLAB_PREDICT=plain`` makes each "predict, then run" cell print its answer as text, so the
cells marked ``# NBVAL_CHECK_OUTPUT`` check the lessons' claims. Kernels started by nbval or
nbclient inherit both variables. (Set here, at the root, because nbval collects notebooks/
without reading tests/conftest.py.)

The processes the run starts (notebook kernels, servers, xdist workers) also get a scratch
``TMPDIR`` that is removed at the end: nbval stops a kernel without letting it exit
normally, so a lesson's ``TemporaryDirectory`` would otherwise outlive the run in /tmp.
"""

from __future__ import annotations

import os
import shutil
import tempfile


_HOME = tempfile.mkdtemp(prefix="kvlab-home-")
os.environ["KVLAB_HOME"] = _HOME
os.environ["KVLAB_PREDICT"] = "plain"
_SCRATCH = tempfile.mkdtemp(prefix="kvlab-scratch-")  # this process keeps its own temp dir, already chosen
os.environ["TMPDIR"] = _SCRATCH


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test``) a notebook's cells run in order in one kernel, so
    they go to one worker together; every other test is its own unit, handed to whichever
    worker is free. (xdist's own ``--dist loadgroup`` marks cannot do this with pytest 9: the
    worker renames ``item._nodeid``, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class NotebookScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".ipynb") else nodeid

    return NotebookScheduling(config, log)


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    """The tests marked ``slow`` (browser, soak, fresh installs) go first, everything else keeps
    its order: on a few workers the run then ends with a tail of short tests that fills every
    worker, not with one long test running alone while the others have nothing left to do.
    Ahead of them all, the tests marked ``network``: a fresh install waits on PyPI for as long
    as PyPI takes (40 s to 7 min, measured), mostly idle, so its wait overlaps the whole run
    instead of adding to its end."""
    items.sort(key=lambda item: (item.get_closest_marker("network") is None, item.get_closest_marker("slow") is None))


def pytest_unconfigure(config):  # noqa: ARG001 - pytest's hook signature
    shutil.rmtree(_HOME, ignore_errors=True)
    shutil.rmtree(_SCRATCH, ignore_errors=True)
