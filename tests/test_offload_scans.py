"""vLLM 0.33's two scans over a tier's answers, on kvlab's offloading scheduler half:
``_maximal_prefix_lookup`` (full attention: an unbroken prefix) and ``_sliding_window_lookup``
(a window group: the last run of window-many chunks). The expected values were first
produced by vLLM 0.33's own methods on the same answer sequences."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvlab.core.single_type_kv_cache_manager import FullAttentionManager
from kvlab.distributed.kv_events import BlockStored
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventGroupSpec, OffloadingEventsTracker
from kvlab.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig, OffloadingConnectorScheduler
from kvlab.kv_cache_interface import FullAttentionSpec
from kvlab.kv_offload.base import LookupResult, OffloadingKVEventsConfig, ReqContext, make_offload_key
from kvlab.kv_offload.cpu.manager import CPUOffloadingManager
from kvlab.kv_offload.tiering.staged import StagedTieringManager

H, P, R, M = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS


class Scripted:
    """A tier that answers from a script, one answer per key, and records what it was asked."""

    def __init__(self, answers: list[LookupResult]) -> None:
        self.answers, self.asked = answers, []  # type: list[LookupResult], list[int]

    def lookup(self, key: int, req_context: Any) -> LookupResult:
        self.asked.append(key)
        return self.answers[key]


def _group() -> GroupOffloadConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    return GroupOffloadConfig(0, 4, 4, 1, OffloadingEventGroupSpec("full_attention", None), None, spec, FullAttentionManager)


def _tracker() -> OffloadingEventsTracker:
    return OffloadingEventsTracker(OffloadingKVEventsConfig(True, True), {0: OffloadingEventGroupSpec("full_attention", None)},
                                   use_int_block_hashes=False)  # fmt: skip


def _half(manager: Any, tracker: Any = None) -> Any:
    return SimpleNamespace(manager=manager, _events_tracker=tracker or SimpleNamespace(record_lookup=lambda *a: None))


@pytest.mark.parametrize(
    ("answers", "want", "asked"),
    [
        ([H, H, H], 3, 3),
        ([H, M, H], 1, 2),  # the first miss ends the scan: nothing after it is asked
        ([M, H], 0, 1),
        ([H, P, H], None, 3),  # a chunk still being written: wait, but keep asking
        ([P, H, M, H], None, 3),
        ([H, R, H, M], None, 4),  # a tier still looking
        ([], 0, 0),
    ],
)
def test_the_maximal_prefix_scan(answers: list[LookupResult], want: int | None, asked: int) -> None:
    tier = Scripted(answers)
    got = OffloadingConnectorScheduler._maximal_prefix_lookup(_half(tier), range(len(answers)), ReqContext("r"), None, _group(), 0)
    assert (got, tier.asked) == (want, list(range(asked)))


@pytest.mark.parametrize(
    ("answers", "window", "initial", "want", "asked"),
    [
        ([M, H, H, M, H], 2, None, 3, 4),  # from the end: the run at keys 1-2 is the last full window
        ([H, M, M], 2, None, 1, 3),  # no full window: the hits at the very start
        ([M, H], 2, None, 0, 2),
        ([H, H, H, H], 2, None, 4, 2),
        ([M, H, H], 2, 3, 0, 3),  # a partial last chunk needs a longer first run ...
        ([M, H, H], 2, None, 3, 2),  # ... without it the same keys make a window
        ([H, H, P], 2, None, None, 2),  # the run found holds a chunk still being written
        ([H, H, M, P], 2, None, 2, 4),  # a miss rules out the pending chunk to its right
        ([H, H, R], 2, None, None, 3),  # a tier still looking: ask again
    ],
)
def test_the_sliding_window_scan(answers: list[LookupResult], window: int, initial: int | None, want: int | None, asked: int) -> None:
    tier = Scripted(answers)
    got = OffloadingConnectorScheduler._sliding_window_lookup(_half(tier), list(range(len(answers))), window, ReqContext("r"), initial)
    assert (got, tier.asked) == (want, list(range(len(answers) - 1, len(answers) - 1 - asked, -1)))


def test_a_chunk_found_while_being_written_keeps_its_payload_for_the_later_event() -> None:
    tracker, ctx = _tracker(), ReqContext("r")
    hashes = [bytes([i + 1]) * 32 for i in range(3)]
    req = SimpleNamespace(request_id="r", block_hashes=hashes, all_token_ids=list(range(100, 112)), lora_request=None)
    keys = [make_offload_key(h, 0) for h in hashes]
    cpu = CPUOffloadingManager(num_chunks=4, enable_events=True)
    cpu.prepare_store(keys[:2], ctx)
    cpu.complete_store(keys[:1], ctx)
    list(cpu.take_events())  # the store of key 0, published by nobody here
    half = _half(cpu, tracker)
    assert OffloadingConnectorScheduler._maximal_prefix_lookup(half, keys, ctx, req, _group(), 0) is None  # key 1 pending
    cpu.complete_store(keys[1:2], ctx)
    [stored] = tracker.take_events(cpu.take_events())
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == ([hashes[1]], hashes[0], [104, 105, 106, 107])
    assert OffloadingConnectorScheduler._maximal_prefix_lookup(half, keys, ctx, req, _group(), 0) == 2


def test_kvlab_in_step_tiers_answer_hit_or_miss() -> None:
    ctx = ReqContext("r")
    keys = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(3)]
    tiers = StagedTieringManager(CPUOffloadingManager(num_chunks=4))
    plan = tiers.prepare_store(keys[:2], ctx)
    assert plan is not None
    assert [tiers.lookup(k, ctx) for k in keys] == [M, M, M]  # not readable before the copy completes
    tiers.complete_store(plan, True, req_context=ctx)
    assert [tiers.lookup(k, ctx) for k in keys] == [H, H, M]
    assert OffloadingConnectorScheduler._maximal_prefix_lookup(_half(tiers), keys, ctx, None, _group(), 0) == 2
