"""The browser tests' one JupyterLab and Chromium per test worker (see test_browser.Lab)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_browser import Lab


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Started by a worker's first browser test, stopped when the worker ends: a second
    server and browser for another test module would cost ~8 s of CPU and find nothing new."""
    server = Lab(tmp_path_factory.mktemp("lab"))
    try:
        yield server
    finally:
        server.close()
