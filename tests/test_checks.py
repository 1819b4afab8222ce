"""kvlab.utils.checks: one meaning of "an int" at every public door (numpy ints welcome,
bools refused), messages that name the argument and the allowed range."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab import KVCacheManager, MultiModalFeature, Request, Scheduler, SlidingWindowSpec
from kvlab.executor.simulated import SimulatedExecutor
from kvlab.utils.checks import check_int, check_number, check_optional_int
from kvlab.workloads.memory_sim import simulate
from kvlab.workloads.traces import from_lengths, sharegpt_like


@pytest.mark.parametrize("value", [3, np.int64(3), np.uint8(3), np.int32(3)])
def test_integers_of_any_kind_come_back_as_plain_int(value):
    got = check_int("n", value, 1, 5)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 3.0, np.float64(3.0), "3", None, [3]])
def test_non_integers_and_bools_are_type_errors(value):
    with pytest.raises(TypeError, match=r"^n must be an int >= 1, got "):
        check_int("n", value, 1)


@pytest.mark.parametrize(
    "lo, hi, value, allowed",
    [
        (1, None, 0, "an int >= 1"),
        (0, 4, 5, "an int in 0..4"),
        (None, 4, 5, "an int <= 4"),
    ],
)
def test_out_of_range_names_argument_value_and_range(lo, hi, value, allowed):
    with pytest.raises(ValueError) as e:
        check_int("block_size", value, lo, hi, why=" (tokens per block)")
    assert str(e.value) == f"block_size={value} is out of range; block_size must be {allowed} (tokens per block)"


def test_optional_int_and_number():
    assert check_optional_int("w", None, 1) is None and check_optional_int("w", np.int16(7), 1) == 7
    with pytest.raises(ValueError, match=r"w must be None or an int >= 1"):
        check_optional_int("w", 0, 1)
    with pytest.raises(TypeError, match=r"w must be None or an int >= 1, got float"):
        check_optional_int("w", 1.5, 1)
    assert check_number("t", np.float32(0.5), 0) == 0.5 and check_number("t", 0, 0) == 0.0
    for bad, exc in ((True, TypeError), ("1", TypeError), (float("nan"), ValueError), (float("inf"), ValueError), (-1, ValueError)):
        with pytest.raises(exc, match="t"):
            check_number("t", bad, 0)
    with pytest.raises(ValueError, match=r"t must be a finite number > 0"):
        check_number("t", 0, 0, strict=True)


def test_public_doors_accept_numpy_ints_and_store_plain_ints():
    mgr = KVCacheManager(num_blocks=np.int64(11), block_size=np.int32(4), max_model_len=np.int64(64))
    assert type(mgr.num_blocks) is int and type(mgr.block_size) is int and type(mgr.max_model_len) is int
    sched = Scheduler(
        mgr,
        max_num_batched_tokens=np.int64(32),
        max_num_seqs=np.int64(4),
        long_prefill_token_threshold=np.int64(0),
        max_model_len=np.int64(64),
    )
    assert type(sched.max_num_scheduled_tokens) is int and type(sched.max_num_running_reqs) is int
    prompt = list(np.arange(9, dtype=np.int64))
    r = Request(
        "r",
        prompt,
        max_tokens=np.int64(3),
        eos_token_id=np.int64(5),
        priority=np.int8(1),
        mm_features=[MultiModalFeature("img", np.int64(2), np.int64(3))],
    )
    assert all(type(t) is int for t in r.prompt_token_ids) and type(r.max_tokens) is int
    assert type(r.mm_features[0].offset) is int and type(r.eos_token_id) is int
    # the hashes of numpy tokens equal those of the same plain ints
    twin = Request("t", list(range(9)), mm_features=[MultiModalFeature("img", 2, 3)])
    mgr.get_computed_blocks(r), mgr.get_computed_blocks(twin)
    assert r.block_hashes == twin.block_hashes and len(r.block_hashes) == 2
    new = mgr.allocate_slots(r, np.int64(9), np.int64(0), None, np.int64(0))
    assert new.get_block_ids() == ([1, 2, 3],)
    r.append_output_token_ids(np.int64(7))
    assert r.output_token_ids == [7] and type(r.output_token_ids[0]) is int
    assert SlidingWindowSpec(sliding_window=np.int64(8)).sliding_window == 8
    assert SimulatedExecutor(vocab_size=np.int64(50)).vocab_size == 50


@pytest.mark.parametrize(
    "call, exc, needle",
    [
        (lambda: KVCacheManager(num_blocks=11, block_size=np.float64(4)), TypeError, "block_size must be an int >= 1"),
        (lambda: KVCacheManager(num_blocks=np.bool_(True)), TypeError, "num_blocks"),
        (lambda: Request("r", [1], priority=1.0), TypeError, "priority must be an int"),
        (lambda: Request("r", [1], arrival_time=float("nan")), ValueError, "arrival_time"),
        (lambda: Request("r", [1], eos_token_id=-1), ValueError, "eos_token_id=-1 is out of range; eos_token_id must be None or"),
        (lambda: SimulatedExecutor(eos_every=-1), ValueError, "eos_every"),
        (
            lambda: simulate(from_lengths([(2, 2)]), np.int64(100), "paged", block_size=np.int64(4), step_seconds=-1),
            ValueError,
            "step_seconds",
        ),
        (lambda: sharegpt_like(np.int64(0), 1), ValueError, "n=0 is out of range"),
    ],
)
def test_door_errors_name_the_argument(call, exc, needle):
    with pytest.raises(exc, match=needle):
        call()
