"""Shared test settings: Hypothesis profiles, and one fixture for the core tests.

Profiles (choose with ``HYPOTHESIS_PROFILE=name``; ``ci`` is the default):

* ``ci``       -- deterministic (derandomize), no example database written to disk, no
                  deadline (2 shared CPU cores: timings are noise). 40 examples of up to
                  200 steps per state machine; tests/test_core_properties.py has three
                  machines, about 17,000 rule steps in all (>= 10,000 required).
* ``dev``      -- the same sizes with fresh random seeds on every run.
* ``thorough`` -- bug hunting: 1,000 examples per machine, random seeds.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=40, stateful_step_count=200, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=40, stateful_step_count=200, **_COMMON)
settings.register_profile("thorough", max_examples=1000, stateful_step_count=200, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def common_prefix() -> list[int]:
    """Three full 16-token blocks: 0 x16, 1 x16, 2 x16 (the prompt start of vLLM's scenarios)."""
    return [i for i in range(3) for _ in range(16)]


# Two shared cores: torch's intra-op threads only fight each other (and Triton's
# interpreter) for them -- a tiny dense forward took 290 ms with 2 threads vs 3 ms with 1.
try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


# The browser tests' own notebook (tests/browser/player_demo.ipynb) is opened by them in
# JupyterLab; it is not a lesson for nbval to run when `make test` passes --nbval-lax.
collect_ignore_glob = ["browser/*.ipynb"]
