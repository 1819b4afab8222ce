"""Checkers: group_block_hash and unified_block_sizes (lesson 07b, hybrid models)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.core import kv_cache_utils
from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.exercises.registry import call, register
from kvlab.exercises.result import CheckResult, failed, passed
from kvlab.kv_cache_interface import (
    DTYPE_SIZES,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvlab.request import Request


def _short(h: Any) -> str:
    return h.decode() if isinstance(h, bytes) and h.isascii() else repr(h)


# --- group_block_hash -----------------------------------------------------------------------
@register(
    "group_block_hash",
    "The hash of a larger block",
    "group_block_hash(block_hashes, hash_block_size, block_size, i) -> bytes",
    "07b_pages_mamba_and_mla",
    [
        "Hashes come every hash_block_size tokens; block i of the group covers tokens [i * block_size, (i + 1) * block_size).",
        "Each small hash is chained over everything before it: the one that ends where block i ends names the whole prefix up to there.",
        "That is the small hash number (i + 1) * (block_size // hash_block_size) - 1.",
    ],
    notebook="ex_hybrid",
)
def check_group_block_hash(fn: Any) -> CheckResult:
    eid = "group_block_hash"
    small = [f"h{j}".encode() for j in range(12)]  # h0 covers tokens 0-15, h1 16-31, ...
    cases = [
        ("block 1 of a 48-token group, hashes every 16", 16, 48, 1, b"h5"),
        ("block 0 of a 32-token group, hashes every 16", 16, 32, 0, b"h1"),
        ("same block size as the hashes", 16, 16, 2, b"h2"),
        ("block 2 of a 64-token group, hashes every 16", 16, 64, 2, b"h11"),
    ]
    for name, hbs, bs, i, want in cases:
        got = call(fn, list(small), hbs, bs, i, where=f"the case '{name}'")
        if got == want:
            continue
        k = bs // hbs
        idea = "take the small hash that ends where the block ends: index (i + 1) * k - 1, k = block_size // hash_block_size"
        if got == small[i * k] and k > 1:
            idea = "that is the hash of the block's FIRST slice only; the LAST small hash chains over the whole block (and all before it)"
        elif got == b"".join(small[i * k : (i + 1) * k]):
            idea = "concatenating the small hashes was vLLM's rule before 0.24; since then the last one IS the block's hash -- it already chains over the whole prefix"
        elif got == small[i] and k > 1:
            idea = "i counts blocks of block_size tokens but hashes come every hash_block_size tokens: scale the index by k = block_size // hash_block_size"
        elif (i + 1) * k < len(small) and got == small[(i + 1) * k]:
            idea = "off by one: the block ends at small hash (i + 1) * k - 1; (i + 1) * k already belongs to the next block"
        return failed(
            eid,
            f"wrong hash: {name}",
            case=name,
            inputs=f"block_hashes=[h0 .. h11], hash_block_size={hbs}, block_size={bs}, i={i}",
            expected=_short(want),
            got=_short(got),
            idea=idea,
        )
    # In the engine: the pool and the managers read a larger group's hashes through your
    # function (the pool's block_hash_view_cls seam).
    reference = _mixed_block_size_story(BlockPool)

    class LearnerView(kv_cache_utils.BlockHashListWithBlockSize):
        __slots__ = ("hash_block_size", "target")

        def __init__(self, block_hashes: Sequence[bytes], hash_block_size: int, target_block_size: int) -> None:
            super().__init__(block_hashes, hash_block_size, target_block_size)
            self.hash_block_size, self.target = hash_block_size, target_block_size

        def __getitem__(self, idx: Any) -> Any:
            if isinstance(idx, slice):
                return [self[j] for j in range(*idx.indices(len(self)))]
            if idx < 0:
                idx += len(self)
            if not 0 <= idx < len(self):
                raise IndexError(idx)
            return call(
                fn, list(self.block_hashes), self.hash_block_size, self.target, idx, where="reading a group's block hash inside the engine"
            )

        def __iter__(self) -> Any:
            return (self[j] for j in range(len(self)))

    learner_pool = type("LearnerBlockPool", (BlockPool,), {"block_hash_view_cls": LearnerView})
    got_story = _mixed_block_size_story(learner_pool)
    if got_story != reference:
        return failed(
            eid,
            "in the engine: a second request does not get the hit vLLM gives it",
            expected=repr(reference),
            got=repr(got_story),
            idea="the pool caches a 12-token block under the hash your function returns; the lookup must find the same one",
        )
    return passed(eid, "every case matches vLLM >= 0.24; in the engine a 12-token group caches and hits exactly as vLLM's does.")


def _mixed_block_size_story(block_pool_cls: type[BlockPool]) -> tuple:
    """Full attention (4-token blocks) beside a window of 40 tokens (12-token blocks):
    a 24-token prompt, freed, then the same prompt + 1 token."""
    mgr = KVCacheManager(
        num_blocks=40,
        block_size=4,
        block_pool_cls=block_pool_cls,
        kv_cache_groups=[FullAttentionSpec(block_size=4), SlidingWindowSpec(sliding_window=40, block_size=12)],
    )
    a = Request("a", list(range(100, 124)))
    hits, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 24 - n, n, hits)
    cached = tuple(b.block_id for b in mgr.block_pool.blocks if b.block_hash is not None)
    mgr.free(a)
    b = Request("b", list(range(100, 124)) + [5])
    hits, n = mgr.get_computed_blocks(b)
    return cached, n, hits.get_block_ids()


# --- unified_block_sizes ----------------------------------------------------------------------
def _and(pages: Sequence[int]) -> str:
    """'65,536 and 32,768' / '8,192, 40,960 and 4,096'."""
    words = [f"{p:,}" for p in pages]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _bytes_per_token(spec: Any, *, mla_doubled: bool = False, no_heads: bool = False) -> int:
    v = spec.head_size if spec.head_size_v is None else spec.head_size_v
    if mla_doubled and isinstance(spec, MLAAttentionSpec):
        v = spec.head_size
    heads = 1 if no_heads else spec.num_kv_heads
    return heads * (spec.head_size + v) * DTYPE_SIZES[spec.dtype_name]


def _unify(
    specs: Sequence[Any],
    *,
    mla_doubled: bool = False,
    no_heads: bool = False,
    shrink: bool = False,
    grow_mamba: bool = False,
    mamba_left_out: bool = False,
) -> list[int | None]:
    pages = [
        s.page_size_bytes if isinstance(s, MambaSpec) else s.block_size * _bytes_per_token(s, mla_doubled=mla_doubled, no_heads=no_heads)
        for s in specs
    ]
    target = min(pages) if shrink else max(pages)
    if mamba_left_out:
        target = max(p for s, p in zip(specs, pages) if not isinstance(s, MambaSpec))
    out: list[int | None] = []
    for s, p in zip(specs, pages):
        if isinstance(s, MambaSpec) and not grow_mamba:
            out.append(s.block_size)
        elif shrink:
            out.append(max(1, s.block_size * target // p))
        else:
            out.append(s.block_size * target // p)
    return out


UNIFY_CASES: list[tuple[str, list[KVCacheSpec]]] = [
    (
        "full attention (8 KV heads) + a window with 4",
        [
            FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128),
            SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, sliding_window=4096),
        ],
    ),
    (
        "MLA beside full attention with 2 KV heads of 64",
        [MLAAttentionSpec(block_size=16), FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=72)],
    ),
    (
        "full attention + a Mamba state",
        [
            FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128),
            MambaSpec(block_size=16, shapes=((4, 1024), (16, 64, 16)), dtypes=("bfloat16", "bfloat16")),
        ],
    ),
    (
        "three groups, fp8 window",
        [
            FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128),
            SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, sliding_window=512, dtype="fp8"),
            MLAAttentionSpec(block_size=16, head_size=512),
        ],
    ),
    (
        "a Mamba state larger than the attention pages",
        [
            SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, sliding_window=1024),
            FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64),
            MambaSpec(block_size=16, shapes=((4, 1024), (16, 64, 16)), dtypes=("bfloat16", "bfloat16")),
        ],
    ),
]


@register(
    "unified_block_sizes",
    "One page size for every group",
    "unified_block_sizes(specs) -> list[int]",
    "07b_pages_mamba_and_mla",
    [
        "A page is one block of one layer: block_size × bytes per token.",
        "Bytes per token of an attention layer: num_kv_heads × (head_size + head_size_v) × bytes per element; head_size_v None means = head_size.",
        "MLA caches ONE latent per token: head_size_v is 0, and it has one KV head.",
        "The largest page wins; a smaller page grows its block size by the ratio. A Mamba page is its state whatever the block size: it keeps its block size (and is padded).",
    ],
    notebook="ex_hybrid",
)
def check_unified_block_sizes(fn: Any) -> CheckResult:
    eid = "unified_block_sizes"
    for name, specs in UNIFY_CASES:
        want = [s.block_size for s in kv_cache_utils.unify_kv_cache_spec_page_size(specs)]
        got = call(fn, list(specs), where=f"the case '{name}'")
        if isinstance(got, tuple):
            got = list(got)
        if got == want:
            continue
        idea = "pages: block_size × bytes per token; the largest page wins and the others grow their block size by the ratio"
        pages = [s.page_size_bytes for s in specs]
        if got == [s.block_size for s in specs]:
            idea = (
                f"you returned the block sizes unchanged, but the pages differ ({_and(pages)} bytes): one pool serves every "
                "group, so each smaller page must grow its block size until its page matches the largest"
            )
            if got == _unify(specs, no_heads=True):
                idea += " -- and if you did compare pages: every KV head stores its own key and value, multiply by num_kv_heads"
        elif got == _unify(specs, mla_doubled=True):
            idea = "MLA stores ONE latent vector per token, no separate value: do not count it twice (head_size_v is 0)"
        elif got == _unify(specs, no_heads=True):
            idea = "every KV head stores its own key and value: multiply by num_kv_heads"
        elif got == _unify(specs, shrink=True):
            idea = "pages must all fit the LARGEST page: grow the smaller pages' block sizes, never shrink the big ones"
        elif got == _unify(specs, grow_mamba=True):
            idea = "a Mamba page holds one state whatever its block size: keep its block size (vLLM pads the page instead)"
        elif any(isinstance(s, MambaSpec) for s in specs) and got == _unify(specs, mamba_left_out=True):
            mamba = max(p for s, p in zip(specs, pages) if isinstance(s, MambaSpec))
            idea = (
                f"the Mamba page is a page too: here the Mamba state ({mamba:,} bytes) is the largest page, so the attention "
                "groups grow their block sizes until their pages match it (vLLM takes the max over every group's page)"
            )
        described = ", ".join(f"{type(s).__name__}(block_size={s.block_size})" for s in specs)
        return failed(eid, f"wrong block sizes: {name}", case=name, inputs=described, expected=repr(want), got=repr(got), idea=idea)
    # In the engine: the manager built with your block sizes hashes at their GCD and hits on their LCM.
    specs = [s.with_block_size(b) for s, b in zip(UNIFY_CASES[0][1], call(fn, list(UNIFY_CASES[0][1]), where="the engine run"))]
    mgr = KVCacheManager(num_blocks=40, block_size=16, kv_cache_groups=specs)
    if len({s.page_size_bytes for s in mgr.kv_cache_groups}) != 1:
        return failed(eid, "in the engine: the groups' pages differ", got=repr([s.page_size_bytes for s in mgr.kv_cache_groups]))
    return passed(
        eid,
        f"every case matches vLLM's page-size rule; in the engine the groups share {mgr.kv_cache_groups[0].page_size_bytes:,}-byte pages, "
        f"hashes every {mgr.hash_block_size} tokens and hits on multiples of {mgr.scheduler_block_size}.",
    )
