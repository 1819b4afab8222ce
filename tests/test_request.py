"""Request: fields as given, token bookkeeping, block-hash growth, lifecycle."""

from __future__ import annotations

import pytest

from kvlab import (
    KVCacheManager,
    MultiModalFeature,
    Request,
    RequestStatus,
    get_hash_fn_by_name,
    hash_block_tokens,
)

from kvlab.core.kv_cache_utils import get_request_block_hasher


def test_fields_are_kept_as_given():
    img = MultiModalFeature(identifier="img-a", offset=2, length=3)
    r = Request(
        "r0",
        [5, 6, 7, 8, 9],
        max_tokens=4,
        eos_token_id=2,
        cache_salt="s",
        lora_name="l",
        priority=-3,
        arrival_time=12.5,
        mm_features=[img],
    )
    assert (r.request_id, r.prompt_token_ids, r.max_tokens, r.eos_token_id) == ("r0", [5, 6, 7, 8, 9], 4, 2)
    assert (r.cache_salt, r.lora_name, r.priority, r.arrival_time) == ("s", "l", -3, 12.5)
    assert r.mm_features == [img] and img.modality == "image"
    assert r.status == RequestStatus.WAITING and not r.is_finished()
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens, r.num_computed_tokens) == (5, 5, 0, 0)
    assert r.num_preemptions == 0 and r.block_hashes == []


def test_defaults_and_arrival_order():
    a, b, c = (Request(f"r{i}", [1]) for i in range(3))
    assert (a.max_tokens, a.eos_token_id, a.cache_salt, a.lora_name, a.priority, a.mm_features) == (16, None, None, None, 0, [])
    assert a.arrival_time < b.arrival_time < c.arrival_time  # strictly increasing: no FCFS ties


def test_prompt_is_copied_and_int_like_tokens_become_ints():
    class Tok(int):
        pass

    src = [1, Tok(2), 3]
    r = Request("r", src)
    src.append(4)
    assert r.prompt_token_ids == [1, 2, 3] and all(type(t) is int for t in r.all_token_ids)
    assert Request("t", (9, 8)).prompt_token_ids == [9, 8]  # any sequence


def test_append_output_tokens():
    r = Request("r", [1, 2, 3])
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    assert r.output_token_ids == [4, 5, 6] and r.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert r.prompt_token_ids == [1, 2, 3] and r.num_tokens == 6 and r.num_output_tokens == 3
    with pytest.raises(TypeError, match=r"token_ids\[1\]"):
        r.append_output_token_ids([7, "x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"token_ids\[0\]=2147483648 is out of range.*int32"):
        r.append_output_token_ids([2**31])
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6]  # nothing appended by a rejected call


def test_block_hashes_grow_exactly_when_a_block_fills():
    fn = get_hash_fn_by_name("sha256")
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("r", [1, 2, 3, 4, 5, 6])
    mgr.get_computed_blocks(r)  # binds the manager's hasher
    h0 = hash_block_tokens(fn, None, [1, 2, 3, 4])
    assert r.block_hashes == [h0]
    r.append_output_token_ids(7)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(8)
    assert r.block_hashes == [h0, hash_block_tokens(fn, h0, [5, 6, 7, 8])]
    r.append_output_token_ids([9, 10, 11, 12, 13, 14, 15, 16, 17])  # two more blocks, and one token
    assert len(r.block_hashes) == 4
    assert r.block_hashes[3] == hash_block_tokens(fn, r.block_hashes[2], [13, 14, 15, 16])


def test_status_is_finished():
    assert [s for s in RequestStatus if RequestStatus.is_finished(s)] == [
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
    ]
    r = Request("r", [1])
    r.status = RequestStatus.PREEMPTED
    assert not r.is_finished()
    r.status = RequestStatus.FINISHED_ABORTED
    assert r.is_finished()


def test_negative_token_ids_are_vllms_placeholders():
    """Token ids are int32, as in vLLM's input_ids: -1 (vLLM's placeholder for a token not
    sampled yet) and other negatives are accepted, packed in two's complement, and hash apart
    from every real id; 2**31 and beyond are refused."""
    fn = get_hash_fn_by_name("sha256")
    r = Request("r", [5, -1, -2, 2**31 - 1], block_hasher=get_request_block_hasher(2, fn))
    assert bytes(r.token_bytes) == bytes.fromhex("05000000fffffffffeffffffffffff7f")
    assert r.block_hashes == [hash_block_tokens(fn, None, [5, -1]), hash_block_tokens(fn, r.block_hashes[0], [-2, 2**31 - 1])]
    assert hash_block_tokens(fn, None, [5, -1]) != hash_block_tokens(fn, None, [5, 0])
    r.append_output_token_ids(-(2**31))
    assert r.all_token_ids[-1] == -(2**31) and bytes(r.token_bytes)[-4:] == b"\x00\x00\x00\x80"
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]=2147483648 is out of range.*\(token ids are int32\)"):
        Request("x", [2**31])


def test_an_engine_refuses_a_negative_prompt_id_and_queues_nothing():
    """Placeholders reach no model: LLMEngine.add_request / generate refuse a negative prompt
    id (it would index the embedding table from its end), naming the position."""
    from kvlab import build_engine

    eng = build_engine(num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[2\]=-1 is out of range; an engine runs prompts of real token ids"):
        eng.add_request(Request("neg", [1, 2, -1]))
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]=-2 is out of range"):
        eng.generate([[3, 4], [-2]])
    assert not eng.scheduler.requests and not eng.metrics  # nothing queued
    assert [len(out) for out in eng.generate([[3, 4]], max_tokens=2)] == [2]


def test_an_engine_refuses_a_negative_sampled_id_naming_it_and_undoes_the_step():
    """A model samples from its vocabulary: an executor that hands back a negative id is
    refused, with the request and position named, and the step is undone."""
    import numpy as np

    from kvlab import build_engine
    from kvlab.executor.simulated import SimulatedExecutor

    class Negative(SimulatedExecutor):
        def execute_model(self, so):
            out = super().execute_model(so)
            return {rid: np.array([7, -3]) for rid in out} if so.step == 2 else out

    eng = build_engine(num_blocks=8, block_size=4, executor=Negative(vocab_size=50))
    eng.add_request(Request("x", [1, 2, 3, 4, 5], max_tokens=4))
    eng.step()
    before = (eng.scheduler.step_count, eng.scheduler.requests["x"].num_computed_tokens, list(eng.scheduler.requests["x"].output_token_ids))
    with pytest.raises(ValueError, match=r"Negative.execute_model sampled token id -3 for 'x' \(sampled_token_ids\['x'\]\[1\]\)"):
        eng.step()
    x = eng.scheduler.requests["x"]
    assert (eng.scheduler.step_count, x.num_computed_tokens, list(x.output_token_ids)) == before
