"""Which vLLM kvlab follows, and what changed across vLLM versions in what the lessons teach.

One source for the README's table and lesson 00's. Every row was read in the release files
themselves (the PyPI wheels / sdist of each version: ``vllm/v1/core/block_pool.py``,
``kv_cache_utils.py``, ``vllm/config/*.py``, ``vllm/distributed/kv_events.py``), and each has a
switch in kvlab that brings the older rule back, so a lesson can run both side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_RELEASE = "0.33.0"
VLLM_COMMIT = "4ba787ec9"  # short id recorded in the release's vllm/_version.py
VLLM_RELEASE_DATE = "2026-11-02"


@dataclass(frozen=True, slots=True)
class BehaviourChange:
    behaviour: str
    before: str
    changed_in: str
    now: str
    lesson: str
    switch: str  # how to run the older rule in kvlab (Markdown)


BEHAVIOUR_CHANGES: tuple[BehaviourChange, ...] = (
    BehaviourChange(
        "free order of blocks without a hash",
        "every freed block appended to the free-queue tail (0.23 already sent to the head the uncached blocks that left a sliding window or local-attention chunk, and those a sliding-window group freed)",
        "0.24.0 (PR #42656)",
        "unhashed blocks prepended to the head (reused first), hashed ones appended",
        "04b",
        "`KVCacheManager(..., prepend_uncached_blocks=False)`",
    ),
    BehaviourChange(
        "admission of a waiting request",
        "admitted when its first chunk fits",
        "0.19.0 (PR #37307, scheduler_reserve_full_isl=True)",
        "admitted only if the whole prompt (minus prefix hits) fits",
        "05b",
        "`Scheduler(..., scheduler_reserve_full_isl=False)`",
    ),
    BehaviourChange(
        "default prefix-cache hash",
        "Python's builtin hash (64-bit ints)",
        "0.10.2",
        "sha256 (pickle + SHA-256, 32 bytes); sha256_cbor for cross-language consumers",
        "06",
        '`hash_algo="sha256_cbor"` gives vLLM\'s bytes; no builtin-hash option',
    ),
    BehaviourChange(
        "NONE_HASH, the root of every hash chain",
        "random per process unless PYTHONHASHSEED is set",
        "0.29.0",
        'hash_fn(PYTHONHASHSEED or "vllm-none-hash"): the same in every process (random only for xxhash and xxhash_cbor)',
        "06",
        "`init_none_hash(random_root=True)`",
    ),
    BehaviourChange(
        "images in the key of a block finished by generated tokens",
        "the hasher resumed at the last image only: an earlier image overlapping the block was left out",
        "0.31.0",
        "every image overlapping the block (the walk resumes at the first one)",
        "06",
        '`get_request_block_hasher(..., mm_resume="last")`',
    ),
    BehaviourChange(
        "KV cache events on the wire",
        "each event a tagged positional array",
        "0.24.0 (PR #42892)",
        'each event a tagged map {"type": ..., field: value}, None-valued optional fields left out',
        "08b",
        "`kv_events.encode_batch(batch, array_like=True)`",
    ),
    BehaviourChange(
        "replay socket's answer (a subscriber that missed batches)",
        "each replayed batch sent as [seq, payload]",
        "0.26.0",
        "[topic, seq, payload], like the live stream; the end marker is [empty, 0xff x 8, empty]",
        "10",
        "`ZmqEventPublisher(..., replay_topic_frame=False)`; `Subscriber` reads both",
    ),
)


def version_table() -> str:
    """The table as Markdown (README and lesson 00)."""
    rows = [
        "| behaviour | older vLLM | changed in | vLLM now | lesson | older rule in kvlab |",
        "|---|---|---|---|---|---|",
    ]
    for c in BEHAVIOUR_CHANGES:
        rows.append(f"| {c.behaviour} | {c.before} | {c.changed_in} | {c.now} | {c.lesson} | {c.switch} |")
    return "\n".join(rows)
