"""Mutation tests: every checker accepts correct code (written two ways) and rejects the
classic wrong answers with a message about the right idea."""

from __future__ import annotations


import pytest

from kvlab.core import kv_cache_utils
from kvlab.core.kv_cache_utils import KVCacheBlock
from kvlab.exercises import EXERCISES, check

# --- correct implementations, written differently from kvlab's own ------------------------------


def hash_ok(hash_fn, parent, token_ids, extra_keys):
    return hash_fn((parent if parent else kv_cache_utils.NONE_HASH, tuple(token_ids), extra_keys))


def extra_ok(request, start, end):
    keys = [("lora", request.lora_name, request.lora_path)] if request.lora_name else []
    keys += [("mm", f.identifier, f.offset - start) for f in request.mm_features if f.offset < end and f.offset + f.length > start]
    if start == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    return tuple(keys) or None


def _lora(r):
    return ("lora", r.lora_name, r.lora_path)


def _imgs(r, s, e, absolute=False):
    return tuple(
        ("mm", f.identifier, f.offset if absolute else f.offset - s) for f in r.mm_features if f.offset < e and f.offset + f.length > s
    )


class QueueOk:
    """Dict-based ordered set: O(1) remove without links (an alternative correct design)."""

    def __init__(self, blocks):
        self._d = dict.fromkeys(blocks)

    @property
    def num_free_blocks(self):
        return len(self._d)

    def popleft(self):
        b = next(iter(self._d))
        del self._d[b]
        return b

    def remove(self, block):
        del self._d[block]

    def append(self, block):
        self._d[block] = None

    def get_all_free_blocks(self):
        return list(self._d)


def longest_ok(block_hashes, num_tokens, block_size, cached):
    n = 0
    for h in block_hashes[: (num_tokens - 1) // block_size]:
        if h not in cached:
            break
        n += 1
    return n


def free_order_ok(blocks):
    return blocks[::-1]


def victim_ok(running, policy):
    if policy == "fcfs":
        return running[len(running) - 1]
    return sorted(running, key=lambda r: (r.priority, r.arrival_time))[-1]


def touch_ok(pool, blocks):
    for b in blocks:
        if not b.is_null and b.ref_cnt == 0:
            pool.free_block_queue.remove(b)
        b.ref_cnt += 1


def evict_ok(pool, block):
    key = block.cache_key
    if key is None:
        return False
    pool.cached_block_hash_to_block.pop(key, block.block_id)
    block.reset_hash()
    return True


def sw_ok(block_hashes, max_length, block_size, sliding_window, cached):
    need = -(-(sliding_window - 1) // block_size)
    hits = [h in cached for h in block_hashes[: max_length // block_size]]
    for end in range(len(hits), 0, -1):  # longest candidate first
        start = max(0, end - need)
        if all(hits[start:end]) and (end - start >= need or start == 0):
            return end
    return 0


def capacity_ok(num_tokens, block_size, num_held_blocks, hit_ref_cnts):
    new = -(-num_tokens // block_size) - num_held_blocks - len(hit_ref_cnts)
    return max(new, 0) + hit_ref_cnts.count(0)


def kv_ok(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return num_layers * num_kv_heads * head_dim * dtype_bytes * 2


def group_hash_ok(block_hashes, hash_block_size, block_size, i):
    """Counts tokens instead of blocks: the block ends at token (i + 1) * block_size."""
    return block_hashes[(i + 1) * block_size // hash_block_size - 1]


def unified_ok(specs):
    """Through the specs' own page sizes, and a ratio of pages."""
    from kvlab.kv_cache_interface import MambaSpec

    pages = [s.page_size_bytes for s in specs]
    return [s.block_size if isinstance(s, MambaSpec) else s.block_size * (max(pages) // p) for s, p in zip(specs, pages)]


def _unified_wrong(**kw):
    from kvlab.exercises.checks_hybrid import _unify

    return lambda specs: _unify(specs, **kw)


MASK64 = (1 << 64) - 1


def keys_ok(hash_fn, none_hash, token_ids, block_size, first_extra):
    keys, parent = [], none_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_fn((parent, tuple(token_ids[start : start + block_size]), None if start else first_extra))
        keys.append(int.from_bytes(parent[-8:], "big"))
    return keys


def copies_ok(copies, event):
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        copies.clear()
    for h in getattr(event, "block_hashes", []):
        n = copies.get(h, 0) + (1 if kind == "BlockStored" else -1)
        if n > 0:
            copies[h] = n
        else:
            copies.pop(h, None)


def gaps_ok(last_seq, seq):
    return range(last_seq + 1, seq) if last_seq is not None and seq > last_seq + 1 else range(0)


def tiers_ok(block_hashes, num_computed_tokens, num_tokens, block_size, in_cpu, in_storage):
    """Walks indices with a while loop and asks the tiers through a table of checks."""
    media, i, last = [], num_computed_tokens // block_size, (num_tokens - 1) // block_size
    while i < min(last, len(block_hashes)):
        found = [name for name, has in (("CPU", in_cpu), ("STORAGE", in_storage)) if has(block_hashes[i])]
        if not found:
            break
        media.append(found[0])
        i += 1
    return media


def _tiers_wrong(**kw):
    from kvlab.exercises.checks_beyond_pool import _tier_reference

    def fn(block_hashes, num_computed_tokens, num_tokens, block_size, in_cpu, in_storage):
        cpu = {h for h in block_hashes if in_cpu(h)}
        disk = {h for h in block_hashes if in_storage(h)}
        return _tier_reference(
            block_hashes,
            num_computed_tokens,
            num_tokens,
            block_size,
            cpu,
            disk,
            end=num_tokens // block_size if kw.get("last") else None,
            start=0 if kw.get("from0") else None,
            skip_miss=kw.get("skip", False),
            disk_first=kw.get("disk_first", False),
        )

    return fn


def tiers_cpu_only(block_hashes, num_computed_tokens, num_tokens, block_size, in_cpu, in_storage):
    return tiers_ok(block_hashes, num_computed_tokens, num_tokens, block_size, in_cpu, lambda h: False)


def matched_ok(saved_tokens, num_prompt_tokens, num_computed_tokens):
    n = saved_tokens if saved_tokens < num_prompt_tokens else num_prompt_tokens - 1
    return n - num_computed_tokens if n > num_computed_tokens else 0


def slots_ok(block_ids, start, end, block_size):
    out = []
    for p in range(start, end):
        block, offset = divmod(p, block_size)
        out.append(block_ids[block] * block_size + offset)
    return out


def enc_ok(items, num_computed_tokens, num_new_tokens, is_cached, fits):
    """Filters the window first, then walks it."""
    end = num_computed_tokens + num_new_tokens
    window = [i for i, (_, off, n) in enumerate(items) if off < end and off + n > num_computed_tokens]
    picked, names = [], set()
    for i in window:
        name, off, _ = items[i]
        if name in names or is_cached(i):
            continue
        if fits(i):
            picked.append(i)
            names.add(name)
            continue
        return picked, max(0, off - num_computed_tokens)
    return picked, num_new_tokens


def _enc_wrong(**kw):
    def fn(items, num_computed_tokens, num_new_tokens, is_cached, fits):
        out, seen = [], set()
        end = num_computed_tokens + num_new_tokens
        for i, (name, off, n) in enumerate(items):
            if off >= end and not kw.get("no_stop"):
                break
            if off + n <= num_computed_tokens or (kw.get("only_starting") and off < num_computed_tokens):
                continue
            if name in seen or (not kw.get("ignore_cache") and is_cached(i)):
                continue
            if not fits(i):
                if not kw.get("no_cut"):
                    num_new_tokens = 0 if kw.get("zero") or num_computed_tokens >= off else min(num_new_tokens, off - num_computed_tokens)
                break
            seen.add(name)
            out.append(i)
        return out, num_new_tokens

    return fn


def scan_ok(keys, lookup):
    answers = []
    for key in keys:  # another shape: collect the answers up to the first miss, then decide
        answers.append(lookup(key))
        if answers[-1] == "MISS":
            answers.pop()
            break
    return None if {"HIT_PENDING", "RETRY"} & set(answers) else len(answers)


def _scan_wrong(stop_at_wait=False, load_pending=False, retry_is_miss=False, past_miss=False, zero=False):
    def fn(keys, lookup):
        hits, wait = 0, False
        for key in keys:
            a = lookup(key)
            if a == "MISS" or (retry_is_miss and a == "RETRY"):
                if past_miss:
                    continue
                break
            if a == "HIT" or (load_pending and a == "HIT_PENDING"):
                hits += 1
                continue
            wait = True
            if stop_at_wait:
                break
        return (0 if zero else None) if wait else hits

    return fn


CORRECT = {
    "tier_hits": tiers_ok,
    "promotion_scan": scan_ok,
    "num_matched_tokens": matched_ok,
    "token_slots": slots_ok,
    "encoder_inputs": enc_ok,
    "hash_chain": hash_ok,
    "extra_keys": extra_ok,
    "free_queue": QueueOk,
    "longest_hit": longest_ok,
    "free_order": free_order_ok,
    "preempt_victim": victim_ok,
    "touch": touch_ok,
    "stale_hash": evict_ok,
    "sliding_window_hit": sw_ok,
    "allocate_capacity": capacity_ok,
    "kv_bytes": kv_ok,
    "group_block_hash": group_hash_ok,
    "unified_block_sizes": unified_ok,
    "router_block_keys": keys_ok,
    "index_copies": copies_ok,
    "stream_gaps": gaps_ok,
}

# --- the classic wrong answers ------------------------------------------------------------------


class QueueList(QueueOk):
    """Correct order, but remove() searches a list: O(n)."""

    def __init__(self, blocks):
        self._l = list(blocks)

    @property
    def num_free_blocks(self):
        return len(self._l)

    def popleft(self):
        return self._l.pop(0)

    def remove(self, block):
        self._l.remove(block)

    def append(self, block):
        self._l.append(block)

    def get_all_free_blocks(self):
        return list(self._l)


class QueueLIFO(QueueOk):
    def popleft(self):
        b = list(self._d)[-1]
        del self._d[b]
        return b


def _sw_full_rule(block_hashes, max_length, block_size, sliding_window, cached):
    return longest_ok(block_hashes, max_length + 1, block_size, cached)


def _evict_no_pop(pool, block):
    if block.cache_key is None:
        return False
    block.reset_hash()
    return True


def _evict_no_reset(pool, block):
    """Drops the map entry but forgets block.reset_hash()."""
    if block.cache_key is None:
        return False
    pool.cached_block_hash_to_block.pop(block.cache_key, block.block_id)
    return True


def _sw_floor(block_hashes, max_length, block_size, sliding_window, cached):
    """max(1, W // block_size) blocks: right whenever W is a multiple of the block size."""
    need = max(1, sliding_window // block_size)
    hits = [h in cached for h in block_hashes[: max_length // block_size]]
    for end in range(len(hits), 0, -1):
        start = max(0, end - need)
        if all(hits[start:end]) and (end - start >= need or start == 0):
            return end
    return 0


def _touch_no_remove(pool, blocks):
    for b in blocks:
        b.ref_cnt += 1


def _touch_always_remove(pool, blocks):
    for b in blocks:
        if not b.is_null:
            pool.free_block_queue.remove(b)
            b.ref_cnt += 1


def _evict_all_dups(pool, block):
    if block.cache_key is None:
        return False
    pool.cached_block_hash_to_block._cache.pop(block.cache_key, None)
    block.reset_hash()
    return True


def _keys(hash_fn, root, toks, bs, extra, *, chain=True, salt="first", conv=lambda d: int.from_bytes(d[-8:], "big"), partial=False):
    out, parent = [], root
    n = len(toks) // bs + (1 if partial and len(toks) % bs else 0)
    for b in range(n):
        e = extra if (salt == "every" or (salt == "first" and b == 0)) else None
        d = hash_fn(((parent if chain else root), tuple(toks[b * bs : (b + 1) * bs]), e))
        parent = d
        out.append(conv(d))
    return out


def _copies_set(copies, ev):
    kind = type(ev).__name__
    if kind == "AllBlocksCleared":
        copies.clear()
    for h in getattr(ev, "block_hashes", []):
        if kind == "BlockStored":
            copies[h] = 1
        else:
            copies.pop(h, None)


def _copies_remove_all(copies, ev):
    kind = type(ev).__name__
    if kind == "AllBlocksCleared":
        copies.clear()
    for h in getattr(ev, "block_hashes", []):
        if kind == "BlockStored":
            copies[h] = copies.get(h, 0) + 1
        else:
            copies.pop(h, None)


def _copies_no_clear(copies, ev):
    if type(ev).__name__ != "AllBlocksCleared":
        copies_ok(copies, ev)


def _copies_keyerror(copies, ev):
    kind = type(ev).__name__
    if kind == "AllBlocksCleared":
        copies.clear()
    for h in getattr(ev, "block_hashes", []):
        if kind == "BlockStored":
            copies[h] = copies.get(h, 0) + 1
        else:
            copies[h] -= 1
            if copies[h] == 0:
                del copies[h]


def _copies_keep_zero(copies, ev):
    kind = type(ev).__name__
    if kind == "AllBlocksCleared":
        copies.clear()
    for h in getattr(ev, "block_hashes", []):
        if kind == "BlockStored":
            copies[h] = copies.get(h, 0) + 1
        elif h in copies:
            copies[h] -= 1


WRONG = {
    "hash_chain": {
        "unchained (ignores parent)": lambda f, p, t, x: f((kv_cache_utils.NONE_HASH, tuple(t), x)),
        "None as first parent": lambda f, p, t, x: f((p, tuple(t), x)),
        "tokens as a list": lambda f, p, t, x: f((p or kv_cache_utils.NONE_HASH, list(t), x)),
        "ignores extra keys": lambda f, p, t, x: f((p or kv_cache_utils.NONE_HASH, tuple(t), None)),
        "only the tokens": lambda f, p, t, x: f(tuple(t)),
    },
    "extra_keys": {
        "salt on every block": lambda r, s, e: (
            ((_lora(r),) if r.lora_name else ()) + _imgs(r, s, e) + ((("cache_salt", r.cache_salt),) if r.cache_salt else ())
        )
        or None,
        "empty tuple instead of None": lambda r, s, e: extra_ok(r, s, e) or (),
        "absolute image offset": lambda r, s, e: (
            ((_lora(r),) if r.lora_name else ())
            + _imgs(r, s, e, absolute=True)
            + ((("cache_salt", r.cache_salt),) if r.cache_salt and s == 0 else ())
        )
        or None,
        "lora only in the first block": lambda r, s, e: (
            ((_lora(r),) if r.lora_name and s == 0 else ())
            + _imgs(r, s, e)
            + ((("cache_salt", r.cache_salt),) if r.cache_salt and s == 0 else ())
        )
        or None,
        "salt first": lambda r, s, e: (
            ((("cache_salt", r.cache_salt),) if r.cache_salt and s == 0 else ()) + ((_lora(r),) if r.lora_name else ()) + _imgs(r, s, e)
        )
        or None,
        "untagged (vLLM < 0.31)": lambda r, s, e: tuple(k[1:] if k[0] == "mm" else k[1] for k in (extra_ok(r, s, e) or ())) or None,
    },
    "free_queue": {"O(n) list remove": QueueList, "pops the newest (LIFO)": QueueLIFO},
    "longest_hit": {
        "hit covers the last token": lambda h, n, bs, c: longest_ok(h, n + 1, bs, c),
        "counts every cached block (no stop at first miss)": lambda h, n, bs, c: sum(1 for x in h[: (n - 1) // bs] if x in c),
        "counts partial blocks": lambda h, n, bs, c: longest_ok(h, n + bs - 1, bs, c),
    },
    "free_order": {"forward order": lambda b: list(b), "sorted by id": lambda b: sorted(b, key=lambda x: x.block_id)},
    "preempt_victim": {
        "preempts the oldest": lambda r, p: r[0],
        "priority: most important": lambda r, p: r[-1] if p == "fcfs" else min(r, key=lambda x: (x.priority, x.arrival_time)),
        "priority: ignores arrival": lambda r, p: r[-1] if p == "fcfs" else max(r, key=lambda x: x.priority),
    },
    "touch": {
        "evicting a referenced block (no remove)": _touch_no_remove,
        "removes a shared block too": _touch_always_remove,
        "removes but never counts": lambda pool, blocks: [
            pool.free_block_queue.remove(b) for b in blocks if b.ref_cnt == 0 and not b.is_null
        ],
    },
    "stale_hash": {
        "stale map entry": _evict_no_pop,
        "drops duplicates too": _evict_all_dups,
        "does nothing": lambda pool, b: False,
        "forgets reset_hash()": _evict_no_reset,
    },
    "sliding_window_hit": {
        "full-attention rule": _sw_full_rule,
        "cdiv(W) instead of cdiv(W-1)": lambda h, m, bs, w, c: sw_ok(h, m, bs, w + 1, c),
        "W // block_size blocks": _sw_floor,
    },
    "allocate_capacity": {
        "ignores evictable hits": lambda n, bs, held, refs: max(0, -(-n // bs) - held - len(refs)),
        "off by one (floor)": lambda n, bs, held, refs: max(0, n // bs - held - len(refs)) + refs.count(0),
    },
    "kv_bytes": {"forgets K and V": lambda l, h, d, b: l * h * d * b, "forgets layers": lambda l, h, d, b: 2 * h * d * b},
    "group_block_hash": {
        "first small hash of the block": lambda h, hb, b, i: h[i * (b // hb)],
        "concatenation (vLLM < 0.24)": lambda h, hb, b, i: b"".join(h[i * (b // hb) : (i + 1) * (b // hb)]),
        "index not scaled": lambda h, hb, b, i: h[i],
        "off by one": lambda h, hb, b, i: h[min((i + 1) * (b // hb), len(h) - 1)],
    },
    "unified_block_sizes": {
        "MLA counted twice (K and V)": _unified_wrong(mla_doubled=True),
        "forgets the KV heads": _unified_wrong(no_heads=True),
        "shrinks the big pages": _unified_wrong(shrink=True),
        "grows the Mamba block": _unified_wrong(grow_mamba=True),
        "leaves every block size alone": lambda specs: [s.block_size for s in specs],
    },
    "router_block_keys": {
        "ignores the hash chain": lambda f, r, t, bs, x: _keys(f, r, t, bs, x, chain=False),
        "ignores the salt": lambda f, r, t, bs, x: _keys(f, r, t, bs, x, salt="none"),
        "salt in every block": lambda f, r, t, bs, x: _keys(f, r, t, bs, x, salt="every"),
        "high 64 bits": lambda f, r, t, bs, x: _keys(f, r, t, bs, x, conv=lambda d: int.from_bytes(d[:8], "big")),
        "digests, not ints": lambda f, r, t, bs, x: _keys(f, r, t, bs, x, conv=lambda d: d),
        "None as the root": lambda f, r, t, bs, x: _keys(f, None, t, bs, x),
        "keys a partial block": lambda f, r, t, bs, x: _keys(f, r, t, bs, x, partial=True),
    },
    "index_copies": {
        "a set, not counts": _copies_set,
        "one removal drops every copy": _copies_remove_all,
        "ignores AllBlocksCleared": _copies_no_clear,
        "KeyError on an unknown removal": _copies_keyerror,
        "keeps zero counts": _copies_keep_zero,
    },
    "tier_hits": {
        "includes the last token's block": _tiers_wrong(last=True),
        "starts at block 0 (ignores the local hit)": _tiers_wrong(from0=True),
        "skips a miss and goes on": _tiers_wrong(skip=True),
        "asks the disk first": _tiers_wrong(disk_first=True),
        "never asks the disk": tiers_cpu_only,
    },
    "promotion_scan": {
        "stops at the first pending block": _scan_wrong(stop_at_wait=True),
        "loads a pending block": _scan_wrong(load_pending=True),
        "takes RETRY for a miss": _scan_wrong(retry_is_miss=True),
        "asks past a miss": _scan_wrong(past_miss=True),
        "0 instead of None": _scan_wrong(zero=True),
    },
    "num_matched_tokens": {
        "ignores the local hit": lambda saved, prompt, hit: min(saved, prompt - 1),
        "takes the last token too": lambda saved, prompt, hit: max(0, min(saved, prompt) - hit),
        "negative when the hit is longer": lambda saved, prompt, hit: min(saved, prompt - 1) - hit,
    },
    "token_slots": {
        "forgets × block_size": lambda ids, a, b, bs: [ids[p // bs] + p % bs for p in range(a, b)],
        "indexes the table from the range start": lambda ids, a, b, bs: [ids[(p - a) // bs] * bs + p % bs for p in range(a, b)],
        "includes end": lambda ids, a, b, bs: [ids[p // bs] * bs + p % bs for p in range(a, b + 1) if p // bs < len(ids)],
    },
    "encoder_inputs": {
        "never cuts the chunk": _enc_wrong(no_cut=True),
        "cuts the chunk to 0": _enc_wrong(zero=True),
        "encodes a cached image again": _enc_wrong(ignore_cache=True),
        "forgets the image a prefix hit ends in": _enc_wrong(only_starting=True),
        "encodes images beyond the chunk": _enc_wrong(no_stop=True),
    },
    "stream_gaps": {
        "forgets the gap": lambda last, seq: range(0),
        "off by one (asks for last_seq again)": lambda last, seq: range(last, seq) if last is not None and seq > last + 1 else range(0),
        "off by one (asks for seq too)": lambda last, seq: range(last + 1, seq + 1) if last is not None and seq > last + 1 else range(0),
    },
}


def test_every_exercise_has_mutations_and_an_alternative():
    # the kernel exercises: tests/test_exercises_kernels.py; the capstone and the bug hunt: tests/test_capstone.py
    core = set(EXERCISES) - {"slot_mapping", "paged_attention_kernel", "block_manager", "bug_hunt", "bug_fix"}
    assert core <= set(CORRECT) and core <= set(WRONG)


@pytest.mark.parametrize("eid", sorted(CORRECT))
def test_checker_accepts_alternative_correct_code(eid):
    res = check(eid, CORRECT[eid])
    assert res, str(res)


@pytest.mark.parametrize("eid,name", [(e, n) for e, ws in sorted(WRONG.items()) for n in ws])
def test_checker_rejects_classic_wrong_answer(eid, name):
    res = check(eid, WRONG[eid][name])
    assert not res, f"{eid}: the wrong answer {name!r} passed"
    assert not res.not_implemented
    assert res.message and ("expected" in str(res) or "idea" in str(res) or "O(1)" in str(res)), str(res)


@pytest.mark.parametrize("eid", sorted(CORRECT))
def test_not_implemented_is_reported_cleanly(eid):
    def stub(*a, **k):
        raise NotImplementedError("fill me in")

    class Stub:
        def __init__(self, *a):
            raise NotImplementedError

    res = check(eid, Stub if eid == "free_queue" else stub)
    assert not res and res.not_implemented
    assert "not implemented yet" in str(res) and "Traceback" not in str(res)


def test_learner_exception_is_summarised_not_a_traceback_wall():
    def buggy(hash_fn, parent, tokens, extra):
        return hash_fn((parent, tokens[99], extra))

    res = check("hash_chain", buggy)
    assert not res and "IndexError" in res.message and "Traceback" not in str(res)


def test_specific_teaching_messages():
    assert "NONE_HASH" in check("hash_chain", WRONG["hash_chain"]["None as first parent"]).idea
    assert "unchained" in check("hash_chain", WRONG["hash_chain"]["unchained (ignores parent)"]).idea
    assert "FIRST block" in check("extra_keys", WRONG["extra_keys"]["salt on every block"]).idea
    assert "tag each key" in check("extra_keys", WRONG["extra_keys"]["untagged (vLLM < 0.31)"]).idea
    assert "OLDEST" in check("preempt_victim", WRONG["preempt_victim"]["preempts the oldest"]).idea
    assert "first miss" in check("longest_hit", WRONG["longest_hit"]["counts every cached block (no stop at first miss)"]).idea
    assert "O(1)" in check("free_queue", QueueList).message
    assert "×2" in check("kv_bytes", WRONG["kv_bytes"]["forgets K and V"]).idea
    assert "wrong context" in check("stale_hash", _evict_no_pop).idea
    assert "FIRST slice" in check("group_block_hash", WRONG["group_block_hash"]["first small hash of the block"]).idea
    assert "before 0.24" in check("group_block_hash", WRONG["group_block_hash"]["concatenation (vLLM < 0.24)"]).idea
    assert "scale the index" in check("group_block_hash", WRONG["group_block_hash"]["index not scaled"]).idea
    assert "ONE latent" in check("unified_block_sizes", WRONG["unified_block_sizes"]["MLA counted twice (K and V)"]).idea
    assert "num_kv_heads" in check("unified_block_sizes", WRONG["unified_block_sizes"]["forgets the KV heads"]).idea
    assert "LARGEST page" in check("unified_block_sizes", WRONG["unified_block_sizes"]["shrinks the big pages"]).idea
    assert "Mamba page" in check("unified_block_sizes", WRONG["unified_block_sizes"]["grows the Mamba block"]).idea
    w = WRONG["router_block_keys"]
    assert "unchained" in check("router_block_keys", w["ignores the hash chain"]).idea
    assert "salt" in check("router_block_keys", w["ignores the salt"]).idea
    assert "FIRST block" in check("router_block_keys", w["salt in every block"]).idea
    assert "LOW 64 bits" in check("router_block_keys", w["high 64 bits"]).idea
    assert "NONE_HASH" in check("router_block_keys", w["None as the root"]).idea
    assert "FULL blocks" in check("router_block_keys", w["keys a partial block"]).idea
    w = WRONG["index_copies"]
    assert "stored twice has two copies" in check("index_copies", w["a set, not counts"]).idea
    assert "count copies, not membership" in check("index_copies", w["one removal drops every copy"]).idea
    assert "AllBlocksCleared" in check("index_copies", w["ignores AllBlocksCleared"]).idea
    assert "never saw" in check("index_copies", w["KeyError on an unknown removal"]).idea
    assert "reaches 0" in check("index_copies", w["keeps zero counts"]).idea
    w = WRONG["stream_gaps"]
    assert "forgot the gap" in check("stream_gaps", w["forgets the gap"]).idea
    assert "last_seq itself" in check("stream_gaps", w["off by one (asks for last_seq again)"]).idea
    assert "seq itself" in check("stream_gaps", w["off by one (asks for seq too)"]).idea


def test_beyond_pool_teaching_messages():
    w = WRONG["promotion_scan"]
    assert "start the promotions" in check("promotion_scan", w["stops at the first pending block"]).idea
    assert "nobody has written" in check("promotion_scan", w["loads a pending block"]).idea
    assert "not answered yet" in check("promotion_scan", w["takes RETRY for a miss"]).idea
    assert "ends the chain" in check("promotion_scan", w["asks past a miss"]).idea
    assert "ask me again" in check("promotion_scan", w["0 instead of None"]).idea
    w = WRONG["tier_hits"]
    assert "last token" in check("tier_hits", w["includes the last token's block"]).idea
    assert "after the local hit" in check("tier_hits", w["starts at block 0 (ignores the local hit)"]).idea
    assert "chain" in check("tier_hits", w["skips a miss and goes on"]).idea
    assert "CPU tier first" in check("tier_hits", w["asks the disk first"]).idea
    assert "storage tier" in check("tier_hits", w["never asks the disk"]).idea
    w = WRONG["num_matched_tokens"]
    assert "BEYOND the local hit" in check("num_matched_tokens", w["ignores the local hit"]).idea
    assert "last token" in check("num_matched_tokens", w["takes the last token too"]).idea
    assert "clamp at 0" in check("num_matched_tokens", w["negative when the hit is longer"]).idea
    w = WRONG["token_slots"]
    assert "multiply the block id" in check("token_slots", w["forgets × block_size"]).idea
    assert "position in the request" in check("token_slots", w["indexes the table from the range start"]).idea
    assert "half open" in check("token_slots", w["includes end"]).idea
    w = WRONG["encoder_inputs"]
    assert "right before it" in check("encoder_inputs", w["never cuts the chunk"]).idea
    assert "not at 0" in check("encoder_inputs", w["cuts the chunk to 0"]).idea
    assert "shared by hash" in check("encoder_inputs", w["encodes a cached image again"]).idea
    assert "starts inside an image" in check("encoder_inputs", w["forgets the image a prefix hit ends in"]).idea
    assert "overlapping the chunk" in check("encoder_inputs", w["encodes images beyond the chunk"]).idea


def test_the_engine_run_catches_what_the_cases_miss():
    """A learner function that passes every case but misbehaves in a situation only the
    engine reaches is still refused (the engine part of each checker is not decoration)."""

    def tiers_small_only(block_hashes, num_computed_tokens, num_tokens, block_size, in_cpu, in_storage):
        media = tiers_ok(block_hashes, num_computed_tokens, num_tokens, block_size, in_cpu, in_storage)
        return media[:2] if media == ["STORAGE"] * 3 else media  # B2's three disk blocks: only two

    res = check("tier_hits", tiers_small_only)
    assert not res and "in the engine" in res.message and "first difference" in res.details


def test_checker_gaps_closed_with_precise_messages():
    """Issue 15's gaps: W not a multiple of the block size; reset_hash() forgotten; the touch
    message names the block."""
    sw = check("sliding_window_hit", _sw_floor)
    assert sw.case == "W = 24, not a multiple of the block size" and "W // block_size = 1 rounds down" in sw.idea
    stale = check("stale_hash", _evict_no_reset)
    assert stale.message == "block 2 left the map but still carries its hash" and "reset_hash()" in stale.idea
    assert "Return whether" not in str(stale)  # the old, misleading last hint
    t = check("touch", _touch_no_remove)
    assert t.message == "after your touch, block 1 is held (ref_cnt 1) but still on the free queue", str(t)
    assert t.got == "free queue [5, 4, 6, 7, 8, 9, 10, 3, 2, 1] (head first)"
    t = check("touch", WRONG["touch"]["removes but never counts"])
    assert t.message == "after your touch, block 1 has ref_cnt 1" and "ref_cnt 2" in t.expected
    t = check("touch", _touch_always_remove)
    assert t.message.startswith("your touch took block 1 off the free queue, but it was not there: ref_cnt 1")


def test_unknown_exercise_id():
    with pytest.raises(ValueError, match="unknown exercise_id"):
        check("nope", None)


def test_free_queue_blocks_are_real_blocks():
    q = QueueOk([KVCacheBlock(i) for i in range(3)])
    assert q.popleft().block_id == 0


# --- the seams: each checker runs the learner's code inside the real core ------------------------
def _called_from_core() -> bool:
    import inspect

    return any("/kvlab/core/" in f.filename.replace("\\", "/") for f in inspect.stack()[2:])


@pytest.mark.parametrize("eid", ["extra_keys", "free_order", "touch", "stale_hash", "allocate_capacity", "free_queue", "group_block_hash"])
def test_checker_runs_the_learner_code_inside_the_core(eid):
    """No monkeypatching: the learner's function reaches the engine through a seam of the
    core (a pool/manager subclass, the request's block hasher), and is called from there."""
    inside: list[bool] = []
    ok = CORRECT[eid]
    if eid == "free_queue":

        class Spy(ok):
            def __init__(self, blocks):
                inside.append(_called_from_core())
                super().__init__(blocks)

        learner = Spy
    else:

        def learner(*args):
            inside.append(_called_from_core())
            return ok(*args)

    assert check(eid, learner)
    assert any(inside), "the learner code never ran inside the core"
    from kvlab.core.block_pool import BlockPool
    from kvlab.core.single_type_kv_cache_manager import FullAttentionManager

    # nothing of the core was patched along the way
    assert BlockPool.touch.__module__ == "kvlab.core.block_pool" and BlockPool.free_queue_cls is kv_cache_utils.FreeKVCacheBlockQueue
    assert FullAttentionManager.get_num_blocks_to_allocate.__module__ == "kvlab.core.single_type_kv_cache_manager"
    assert kv_cache_utils.generate_block_hash_extra_keys.__module__ == "kvlab.core.kv_cache_utils"


@pytest.mark.parametrize(
    "eid,where",
    [
        ("tier_hits", "/kvlab/distributed/kv_transfer/"),
        ("num_matched_tokens", "/kvlab/distributed/kv_transfer/"),
        ("token_slots", "/kvlab/distributed/kv_transfer/"),
        ("encoder_inputs", "/kvlab/core/sched/"),
    ],
)
def test_beyond_pool_checkers_run_the_learner_code_inside_the_engine(eid, where):
    import inspect

    inside: list[bool] = []
    ok = CORRECT[eid]

    def learner(*args):
        inside.append(any(where in f.filename.replace("\\", "/") for f in inspect.stack()[1:]))
        return ok(*args)

    assert check(eid, learner)
    assert any(inside), f"the learner code never ran inside {where}"
