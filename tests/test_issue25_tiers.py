"""Issue 25: what an undo, a learner's file or a learner's function could still get wrong
beyond the pool -- the CPU tier's bytes after an undone step, the progress file, the bug-hunt
checker, and the disk tier's folder.

1. An undone step restores the CPU tier's books, not the bytes the worker copied into its
   slots: an entry whose slot the undone step gave to another block must be a miss, never
   a hit that reads the other block's KV (the real tiny model: the answer would change).
2-3. A progress file nested deeper than JSON can read, or with a lone surrogate that UTF-8
   cannot write back, is moved aside with a warning; the check still passes and records.
4. ``check("bug_hunt", fn)`` with an ``fn`` that raises says "your code raised ...".
5. The disk tier neither writes nor reads through a symlink, reads only regular files and
   never more bytes than a block file holds: a bad file is a miss, not a hang.
"""

from __future__ import annotations

import json
import os
import threading
import tracemalloc
from typing import Any

import pytest
import torch

from kvlab import Request
from kvlab.config.kv_transfer import KVTransferConfig
from kvlab.engine.llm_engine import LLMEngine, build_engine
from kvlab.kv_offload.base import LookupResult, make_offload_key
from kvlab.kv_offload.tiering.fs.io import TierFileError, read_block_file, write_block_file
from kvlab.kv_offload.tiering.fs.staged import StagedFileSystemTier
from kvlab.eventlog.events import OffloadEvicted


# --- 1. an undone step and the CPU tier's bytes -------------------------------------------------------
A = list(b"Paged KV!")  # 9 tokens: two full blocks of 4, offloaded to the CPU tier
B = list(b"0123456789")  # 10 tokens: two full blocks, stored in the same two CPU slots (A's go)
WANT_A = [102, 41, 81]  # the tiny model's greedy answer to A (generate_dense, and the engine without offload)


class Interrupt(KeyboardInterrupt):
    """Jupyter's "interrupt kernel", recognisable."""


def _tiny_engine(storage_path: str | None, offload: bool = True) -> LLMEngine:
    """The real model runner, a 3-block GPU pool (B takes A's cached blocks), a 2-slot CPU
    tier (B's two blocks evict A's two), and optionally a disk tier behind it."""
    from kvlab.worker.model import TinyLlama, TinyLlamaConfig
    from kvlab.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), seed=0)
    extra: dict[str, Any] = dict(num_cpu_blocks=2)
    if storage_path is not None:
        extra.update(storage_path=storage_path, num_storage_blocks=8)
    cfg = KVTransferConfig("OffloadingConnector", kv_connector_extra_config=extra) if offload else None
    return build_engine(
        num_blocks=4, block_size=4, executor=ModelRunner(model, num_blocks=4, block_size=4, device="cpu"), kv_transfer_config=cfg
    )


def _ask_a_again(eng: LLMEngine) -> list[int]:
    eng.add_request(Request("a2", A, max_tokens=3))
    eng.run()
    return eng.finished["a2"].output_token_ids


def _undo_b_then_ask_a_again(eng: LLMEngine, fault_at: str | int) -> tuple[bool, list[int]]:
    """A to completion; B's step interrupted at the event ``fault_at`` (a kind, or the
    n-th event of the step); B aborted; A asked again. Returns (the step was undone, A's answer)."""
    assert eng.generate([A], max_tokens=3) == [WANT_A]
    eng.add_request(Request("b", B, max_tokens=1))
    seen = [0]

    def boom(e: Any) -> None:
        seen[0] += 1
        if e.kind == fault_at or seen[0] == fault_at:
            raise Interrupt(f"interrupted at {e.kind}")

    eng.events.subscribe(boom)
    undone = False
    try:
        eng.step()
    except Interrupt:
        undone = True
    eng.events.unsubscribe(boom)
    eng.abort_request("b")
    got = _ask_a_again(eng)
    eng.scheduler.check_invariants()
    eng.scheduler.connector.scheduler.check_invariants()
    return undone, got


def test_an_undone_step_never_serves_the_cpu_slots_it_overwrote():
    """The issue's repro: interrupted at ``step_finished``, B's KV is in slots 0 and 1 while
    the restored books say A is there. A asked again must compute, not load B's KV."""
    plain = _tiny_engine(None, offload=False)
    assert plain.generate([A], max_tokens=3) == [WANT_A]  # no offload at all
    eng = _tiny_engine(None)
    cpu = eng.scheduler.connector.scheduler.manager.primary
    assert eng.generate([A], max_tokens=3) == [WANT_A]
    books = cpu.entries()
    assert [slot for _, slot in books] == [1, 0]  # A's two blocks, its tail first in line
    eng.add_request(Request("b", B, max_tokens=1))

    def boom(e: Any) -> None:
        if e.kind == "step_finished":
            raise Interrupt("at step_finished")

    eng.events.subscribe(boom)
    with pytest.raises(Interrupt):
        eng.step()
    eng.events.unsubscribe(boom)
    assert cpu.entries() == books  # the exact undo of the books (not of the bytes: B's KV is in slots 0 and 1)
    eng.abort_request("b")
    assert _ask_a_again(eng) == WANT_A
    assert eng.metrics["a2"].num_cached_tokens == 0
    assert eng.scheduler.connector.scheduler.num_hit_tokens == {"CPU": 0}
    dropped = [(e.medium, e.chunk_ids, e.reason) for e in eng.events if isinstance(e, OffloadEvicted) and e.reason != "lru"]
    # A's lookup stops at its first block; its second goes when A offers it again (and is stored afresh)
    assert dropped == [
        ("CPU", [0], "slot overwritten by a step that was undone"),
        ("CPU", [1], "slot overwritten by a step that was undone"),
    ]
    assert sorted(slot for _, slot in cpu.entries()) == [0, 1] and {k for k, _ in cpu.entries()} == {k for k, _ in books}


@pytest.mark.parametrize("tiers", ["cpu", "cpu+disk"])
def test_an_interrupt_at_every_event_of_the_overwriting_step_keeps_the_answer(tiers, tmp_path):
    """Every point of B's step, with and without a disk tier behind the CPU: A's answer
    stays the model's. With a disk tier A's blocks come back from their files (promoted
    through the CPU tier), which the undone step never touched."""
    ref = _tiny_engine(str(tmp_path / "ref") if tiers == "cpu+disk" else None)
    ref.generate([A], max_tokens=3)
    ref.add_request(Request("b", B, max_tokens=1))
    before = len(ref.events)
    ref.step()
    num_events = len(ref.events) - before
    assert num_events >= 14
    undone = 0
    for k in range(1, num_events + 1):
        eng = _tiny_engine(str(tmp_path / f"run{k}") if tiers == "cpu+disk" else None)
        was_undone, got = _undo_b_then_ask_a_again(eng, k)
        undone += was_undone
        assert got == WANT_A, f"interrupted at event {k} of B's step: A answered {got}"
    assert undone == num_events  # every event is inside the step: each interrupt undid it
    TRIED[tiers] = (num_events, undone)


TRIED: dict[str, tuple[int, int]] = {}


def teardown_module() -> None:
    for name, (tried, undone) in TRIED.items():
        print(f"[issue25] tiers {name}: {tried} interrupt points in the overwriting step, {undone} undone; A's answer kept at each")


# --- 2-3. a progress file that reads but cannot be walked or written back ---------------------------
@pytest.fixture
def kvhome(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


NESTED = '{"version": 1, "passed": {}, "predictions": [{"uid": "x", "v": ' + "[" * 100_000 + "]" * 100_000 + "}]}"
SURROGATE = '{"version": 1, "passed": {"\\ud800": {"count": 1}}, "predictions": []}'


@pytest.mark.parametrize(
    "text, why",
    [
        (NESTED, "nested deeper than JSON can read or write"),
        (SURROGATE, "it cannot be written back as UTF-8: '\\ud800' is a lone surrogate"),
    ],
    ids=["deeply-nested", "lone-surrogate"],
)
def test_a_progress_file_that_cannot_be_walked_or_written_back_is_moved_aside(kvhome, text, why):
    from kvlab.exercises import check
    from kvlab.learner.store import store

    path = kvhome / "progress.json"
    path.write_text(text, encoding="utf-8")
    with pytest.warns(UserWarning) as warned:
        assert check("free_order", lambda blocks: blocks[::-1])
    bad = path.with_name(next(p.name for p in kvhome.glob("progress.json.bad-*")))
    assert [str(w.message) for w in warned] == [
        f"kvlab's progress file {path} was not valid ({why}); it was moved to {bad} and a new one started"
    ]
    assert bad.read_text(encoding="utf-8") == text  # never lost
    assert list(store().passed()) == ["free_order"] and json.loads(path.read_text())["version"] == 1


# --- 4. the bug hunt's answers function raises ---------------------------------------------------------
def test_bug_hunt_says_your_code_raised_when_the_answers_function_does(kvhome):
    from kvlab.exercises import check

    def answers():
        return {1: "stale_hash", 2: "full_hit_crash", 3: {}["x"]}

    res = check("bug_hunt", answers)
    assert not res
    assert res.message.startswith("your code raised")
    line = answers.__code__.co_firstlineno + 1
    assert res.message.endswith(
        f'KeyError: \'x\' (line {line}: return {{1: "stale_hash", 2: "full_hit_crash", 3: {{}}["x"]}}) '
        "— while calling your answers function"
    )
    assert "engine stopped" not in res.message and res.idea == "fix the error first; the message names the line"


# --- 5. the disk tier's folder: links, FIFOs, devices, oversized files --------------------------------
KEY = make_offload_key(b"a".ljust(32, b"."))


def test_a_symlink_planted_at_the_temporary_name_is_refused_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    path = str(tmp_path / "tier" / "ab" / "x.bin")
    os.makedirs(os.path.dirname(path))
    os.symlink(outside, path + ".tmp")
    with pytest.raises(TierFileError) as e:
        write_block_file(path, KEY, b"0123456789")
    assert e.value.reason == f"{path}.tmp exists and is not a regular file (a symlink?); refusing to write through it"
    assert outside.read_text() == "keep me" and not os.path.exists(path)
    # A stale regular .tmp (a write that died half way) is simply replaced.
    os.remove(path + ".tmp")
    with open(path + ".tmp", "wb") as f:
        f.write(b"half a fi")
    assert write_block_file(path, KEY, b"0123456789") == 8 + 2 + len(KEY) + 8 + 32 + 10
    assert read_block_file(path, KEY, 10) == b"0123456789" and not os.path.lexists(path + ".tmp")


def test_a_symlinked_tier_subfolder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.makedirs(tmp_path / "tier")
    os.symlink(elsewhere, tmp_path / "tier" / "ab")
    path = str(tmp_path / "tier" / "ab" / "x.bin")
    with pytest.raises(TierFileError, match=r"its folder .*/tier/ab is a symlink; refusing to write through it"):
        write_block_file(path, KEY, b"0123456789")
    assert os.listdir(elsewhere) == []


def test_a_link_to_a_good_file_or_to_dev_zero_is_not_read(tmp_path):
    good = str(tmp_path / "good.bin")
    write_block_file(good, KEY, b"0123456789")
    for target in (good, "/dev/zero"):
        link = str(tmp_path / "link.bin")
        os.symlink(target, link)
        with pytest.raises(TierFileError) as e:
            read_block_file(link, KEY, 10)
        assert e.value.reason == "is a symlink, not a regular file"
        os.remove(link)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
def test_a_fifo_in_place_of_a_tier_file_is_refused_without_waiting(tmp_path):
    """A writer thread stands by so that a blocking open would return and read its junk
    (instead of hanging the test): the tier must not read it, but refuse the FIFO itself."""
    path = str(tmp_path / "x.bin")
    os.mkfifo(path)

    def writer() -> None:
        try:
            with open(path, "wb") as f:  # returns once a reader opened the FIFO
                f.write(b"not a block file")
        except BrokenPipeError:
            pass  # the reader refused and closed first

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        with pytest.raises(TierFileError) as e:
            read_block_file(path, KEY, 10)
        assert e.value.reason == "is not a regular file (a FIFO)"
    finally:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # releases the writer if no reader ever came
        t.join()
        os.close(fd)
    assert not t.is_alive()


def test_an_oversized_tier_file_is_refused_without_reading_it(tmp_path):
    path = str(tmp_path / "x.bin")
    write_block_file(path, KEY, b"0123456789")
    with open(path, "r+b") as f:
        f.truncate(256 << 20)  # sparse: 256 MiB on paper, none on disk
    tracemalloc.start()
    try:
        with pytest.raises(TierFileError) as e:
            read_block_file(path, KEY, 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    header = 8 + 2 + len(KEY) + 8 + 32
    assert e.value.reason == f"holds {(256 << 20) - header} payload bytes, expected 10 (truncated or from another model)"
    assert peak < 1 << 20  # at most one block file's bytes were read, not 256 MiB


@pytest.mark.parametrize("kind", ["symlink to /dev/zero", "fifo", "directory"])
def test_a_tier_file_that_is_not_a_regular_file_is_a_miss_at_lookup(tmp_path, kind):
    tier = StagedFileSystemTier(4, str(tmp_path / "tier"))
    out = tier.prepare_store([KEY])
    tier.complete_store(out.keys_to_store)
    path = tier.path_of(KEY)
    os.makedirs(os.path.dirname(path))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.symlink("/dev/zero", path)
    tier.take_events()
    assert tier.lookup(KEY) is LookupResult.MISS and KEY not in tier
    (ev,) = tier.take_events()
    assert (ev.medium, ev.removed, ev.reason) == ("STORAGE", True, f"not a regular file: {path}")


def test_a_link_planted_at_the_progress_files_temporary_name_is_not_written_through(tmp_path, monkeypatch) -> None:
    """The progress store writes a temporary file and renames it: a symbolic link planted at
    that name (or at the lock's) must not make it write to the link's target."""
    import os

    from kvlab.learner.store import store

    monkeypatch.setenv("KVLAB_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "home" / f".progress.json.{os.getpid()}.tmp").symlink_to(victim)
    st = store()
    st.record_pass("kv_bytes")
    assert victim.read_text() == "keep me"
    assert "kv_bytes" in json.loads((tmp_path / "home" / "progress.json").read_text())["passed"]
