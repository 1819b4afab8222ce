"""Integer helpers every layer sizes blocks with (vLLM 0.33: ``vllm/utils/math_utils.py``).

One copy, so "how many blocks hold n tokens" is computed the same way by the pool, the
spec, the offload config and the lessons.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, without going through a float (exact for any size)."""
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= x``."""
    return cdiv(x, multiple) * multiple
