"""Run a notebook in a fresh kernel for a test (nbclient), started again once if the kernel
dies before it runs anything.

Why the second start: jupyter_client chooses a kernel's five TCP ports by binding each and
letting it go, and the kernel binds them a moment later. In that moment another process on
the machine -- a test binding a loopback port, another worker's kernel -- can take one, and
the kernel then exits at start-up ("Kernel died before replying to kernel_info"). Nothing of
the notebook has run at that point, so starting again is the same test, not a retry of a
failure of kvlab's.
"""

from __future__ import annotations

from typing import Any

import nbformat
from nbclient import NotebookClient

_DIED_AT_START = "Kernel died before replying to kernel_info"


def execute(nb: nbformat.NotebookNode, **kwargs: Any) -> nbformat.NotebookNode:
    """``NotebookClient(nb, **kwargs).execute()``, with one more start if the kernel died at start-up."""
    for attempt in (1, 2):
        try:
            return NotebookClient(nb, **kwargs).execute()
        except RuntimeError as e:
            if attempt == 2 or _DIED_AT_START not in str(e):
                raise
    raise AssertionError("unreachable")  # pragma: no cover
