"""Pick compiled Triton or the Triton interpreter *before* triton is imported.

Why this module exists, and why it must run first
-------------------------------------------------
One kernel source serves two worlds: on a CUDA machine Triton compiles it to GPU code;
on a laptop without a GPU the Triton interpreter runs the very same source on CPU
tensors (with numpy underneath). The switch is the environment variable
``TRITON_INTERPRET``.

When is it read? Verified against triton 3.7.1 (``triton/knobs.py``,
``triton/runtime/jit.py``):

* ``triton.knobs.runtime.interpret`` re-reads the process environment on *every*
  access; there is no cached copy taken at import.
* ``@triton.jit`` consults it at *decoration* time: it returns an
  ``InterpretedFunction`` when it is set and a compiled ``JITFunction`` otherwise.
  Launches do not look at it again.
* But ``import triton`` itself decorates the helpers of ``triton.language``
  (``tl.max``, ``tl.sum``, ``tl.zeros``, ``tl.cdiv``, ...). So the first ``import triton``
  freezes the mode of those helpers. Setting the variable later makes *our* kernels
  interpreted while ``tl.max`` stays a compiled ``JITFunction``, and the first launch
  fails with "Cannot call @triton.jit'd outside of the scope of a kernel".

So the effective deadline is the first ``import triton`` in the process. This module sets
the variable before that import and, if triton was imported earlier by someone else,
checks which mode the ``triton.language`` helpers were built in and refuses a mismatch
with an explanation instead of a baffling error at the first launch.

Policy
------
* CUDA available (``torch.cuda.is_available()``): compiled mode, unless the user set
  ``TRITON_INTERPRET=1`` explicitly (stepping through a kernel with ``print`` on a GPU
  machine is legitimate; the interpreter copies CUDA tensors to the host and back).
* No CUDA: interpreter mode; ``TRITON_INTERPRET`` is forced to ``1`` because compiled
  Triton has no CPU backend.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["INTERPRET", "DEVICE"]


def _env_requests_interpreter() -> bool:
    """True when the user explicitly asked for the interpreter (same parsing as triton)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


_HAS_CUDA: bool = torch.cuda.is_available()

#: Where kernel inputs should live: "cuda" on a GPU machine, otherwise "cpu".
DEVICE: str = "cuda" if _HAS_CUDA else "cpu"

#: True when kernels run under the Triton interpreter (no compilation).
INTERPRET: bool = (not _HAS_CUDA) or _env_requests_interpreter()


def _imported_triton_interprets() -> bool | None:
    """Mode in which an already-imported triton built its ``triton.language`` helpers.

    Returns None when triton has not been imported yet (the mode is still open). The
    probe is the type of ``triton.language.standard.max``: a ``@triton.jit`` function
    decorated during ``import triton``, hence a faithful witness of the mode at that time.
    Reading ``triton.knobs.runtime.interpret`` would be wrong: it reflects the environment
    *now*, not at import.
    """
    if "triton" not in sys.modules:
        return None
    import triton.language.standard as tl_standard  # already imported with triton
    from triton.runtime.jit import JITFunction

    return not isinstance(tl_standard.max, JITFunction)


def _configure() -> None:
    imported_mode = _imported_triton_interprets()
    if imported_mode is not None and imported_mode != INTERPRET:
        if INTERPRET:
            raise RuntimeError(
                "kvlab.kernels must run under the Triton interpreter (no CUDA device is "
                "available, or TRITON_INTERPRET=1 asks for it), but `triton` was already "
                "imported in compiled mode, because TRITON_INTERPRET was not set when it was "
                "first imported. Triton's own "
                "helpers (tl.max, tl.sum, ...) were then built as compiled functions and "
                "cannot be mixed with interpreted kernels. Fix: import kvlab.kernels "
                "before anything that imports triton, or start Python with "
                "TRITON_INTERPRET=1 in the environment (in a notebook: restart the kernel "
                "and import kvlab.kernels first)."
            )
        raise RuntimeError(
            "kvlab.kernels wants compiled Triton (a CUDA device is available), but "
            "`triton` was already imported in interpreter mode (TRITON_INTERPRET=1 at "
            "that time) and TRITON_INTERPRET is not set now. Fix: either keep "
            "TRITON_INTERPRET=1 set to run the kernels interpreted on purpose, or unset it "
            "before the first `import triton` (restart the process)."
        )
    if INTERPRET:
        # Must be set before our own @triton.jit decorations run (kernels are imported
        # right after this module) and before the first `import triton`.
        os.environ["TRITON_INTERPRET"] = "1"


_configure()
