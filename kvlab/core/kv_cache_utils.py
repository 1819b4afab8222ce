"""Blocks, the free queue and block hashing: the pieces every KV-cache manager shares
(lessons 02-04, 06, 07).

vLLM: ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``, ``FreeKVCacheBlockQueue``,
``NONE_HASH``, ``hash_block_tokens``, ``generate_block_hash_extra_keys``,
``get_request_block_hasher``, ``BlockHashListWithBlockSize``). The hash functions themselves
(``sha256``, ``xxhash``, ``get_hash_fn_by_name``) live in ``kvlab.utils.hashing`` as in
``vllm/utils/hashing.py``.

A block's hash is ``hash_fn((parent_hash or NONE_HASH, tuple(token_ids), extra_keys))``.
Because the parent's hash is an input, one hash names the *whole prefix* up to and
including this block, not just its own tokens: the same tokens after a different
beginning get a different key. Extra keys carry what token ids alone cannot, each tagged
with its kind (vLLM >= 0.31): the LoRA adapter (every block), the multimodal items
overlapping the block, the tenant's ``cache_salt`` (first block only -- the chain carries it
to every later block) and, for prompts given as embeddings, a digest of the block's rows.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import struct
from math import gcd, lcm
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvlab.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs, iter_layer_specs
from kvlab.utils.checks import check_int
from kvlab.utils.hashing import (
    _FORMATS,
    BlockHash,
    MAX_TOKEN_ID,
    MIN_TOKEN_ID,
    TOKEN_ID_WHY,
    HashFn,
    _block_format,
    _sha256,
    sha256,
    sha256_cbor,
)
from kvlab.utils.math_utils import cdiv

if TYPE_CHECKING:
    from kvlab.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from kvlab.kv_cache_interface import KVCacheSpec

logger = logging.getLogger("kvlab.kv_cache")


# --- the map key: a block hash with its KV-cache group id ----------------------------------
#
# One hash can name blocks in several groups (a hybrid model caches the same prefix once per
# group), so the prefix-cache map is keyed by hash + group. vLLM's trick, kept here: the key
# is ONE bytes object, the hash followed by the group id as 4 big-endian bytes -- no tuple to
# build, hash and keep alive per cached block -- and a block stores only that key; its plain
# hash is a slice of it, taken only when someone asks (lesson 03).
BlockHashWithGroupId = bytes
_GROUP_ID_BYTES = 4


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The map key of ``block_hash`` in group ``group_id``."""
    return block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big")


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return key[:-_GROUP_ID_BYTES]


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")


@dataclass(frozen=True, slots=True)
class KVCacheBlockCopy:
    """One page the runner copies before a forward pass (vLLM 0.33): a hit that ended inside
    block ``src_block_id`` continues in its private copy ``dst_block_id``."""

    src_block_id: int
    dst_block_id: int


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical KV block: ``block_size`` token slots in every layer of its group."""

    block_id: int
    ref_cnt: int = 0
    # Hash of the full prefix ending with this block + its group id, the prefix-cache map's
    # key (None: not cached / partial block). The only hash a block stores.
    cache_key: BlockHashWithGroupId | None = field(default=None, repr=False)
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    is_null: bool = False
    # The prefix length ``cache_key`` stands for (vLLM 0.33's ``block_hash_num_tokens``). Kept
    # when the key goes (``reset_hash``) and read only while there is one: a reset undone by
    # kvlab's transactions gets its keys back from the old map, and their lengths stay here.
    _hash_num_tokens: int | None = field(default=None, repr=False, init=False)

    @property
    def block_hash(self) -> BlockHash | None:
        """Hash of the full prefix ending with this block (None: not cached), without the
        group id -- the value in ``request.block_hashes``."""
        key = self.cache_key
        return None if key is None else key[:-_GROUP_ID_BYTES]

    @property
    def group_id(self) -> int | None:
        """The KV-cache group the block is cached for (None: not cached)."""
        key = self.cache_key
        return None if key is None else get_group_id(key)

    @property
    def block_hash_num_tokens(self) -> int | None:
        """The prefix length the block's key stands for: (i + 1) x block size for the block at
        index i of a table, fewer for a partial entry that ends inside it (a fuller key then
        replaces it); None without a key (vLLM 0.33's name)."""
        return None if self.cache_key is None else self._hash_num_tokens

    def set_block_hash(self, block_hash: BlockHashWithGroupId, num_tokens: int | None = None) -> None:
        """Give an uncached block its key (hash + group id) and the prefix length it stands
        for (vLLM 0.33's name; the pool's ``cache_*`` methods do this and insert the map
        entry). A block that has a key already is refused: its old entry would dangle."""
        if self.cache_key is not None:
            raise ValueError(f"block {self.block_id} already has a cache key; reset_hash() it (and drop its map entry) first")
        self.cache_key = block_hash
        self._hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self.cache_key = None  # (the length is read only with a key: see _hash_num_tokens)

    def __repr__(self) -> str:
        h = self.cache_key.hex()[:8] if self.cache_key else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h}{', null' if self.is_null else ''})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    Why not a ``deque``: a prefix hit must pull a block out of the *middle* of the queue
    (``touch``), in O(1), without allocating Python objects. Two sentinel blocks (ids -1)
    remove every empty-list special case. Head = evicted next, tail = evicted last.

    kvlab's engine undoes a call that raised or was interrupted (``kvlab.core.transaction``
    runs this queue as its journaled subclass meanwhile); nothing here knows about it.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            # vLLM's words and types: an empty queue is a ValueError, a count that disagrees
            # with the links an AssertionError.
            assert self.num_free_blocks == 0, f"num_free_blocks ({self.num_free_blocks}) is out of sync with the free list."
            raise ValueError("No free blocks available")
        nxt = first.next_free_block
        if nxt is None:  # a block outside the list was linked in: the caller's bug
            raise RuntimeError("Invalid block found in popleft() which doesn't have a valid next_free_block")
        self.fake_free_list_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_free_list_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        out: list[KVCacheBlock] = []
        cur = self.fake_free_list_head.next_free_block
        for _ in range(n):
            out.append(cur)  # type: ignore[arg-type]  # a queued block's links are never None: the sentinels bound the list
            nxt = cur.next_free_block  # type: ignore[union-attr]  # as above
            cur.prev_free_block = cur.next_free_block = None  # type: ignore[union-attr]  # as above
            cur = nxt
        self.fake_free_list_head.next_free_block = cur
        cur.prev_free_block = self.fake_free_list_head  # type: ignore[union-attr]  # as above
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of block {block.block_id}, which is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None, "prev_free_block of fake_free_list_tail should always exist"
        for b in blocks:
            b.prev_free_block = last
            last.next_free_block = b
            last = b
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head, in the given order (``blocks[0]`` is popped first)."""
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        prev = self.fake_free_list_head
        for b in blocks:
            b.prev_free_block = prev
            prev.next_free_block = b
            prev = b
        prev.next_free_block = first
        first.prev_free_block = prev  # type: ignore[union-attr]  # as above
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in eviction order, head (evicted next) first."""
        out = []
        cur = self.fake_free_list_head.next_free_block
        while cur is not None and cur is not self.fake_free_list_tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


# --- NONE_HASH: the "parent" of every first block -----------------------------------------
#
# vLLM >= 0.29 (the rule kvlab follows): NONE_HASH = hash_fn(seed), where the seed is
# PYTHONHASHSEED when set, else the fixed string "vllm-none-hash" for the cryptographic
# hashes (sha256, sha256_cbor). So two processes -- two engines, or an engine and a router
# that reads its KV events -- compute the same hash for the same prefix without any
# configuration. That is safe because SHA-256's collision resistance does not depend on a
# secret root; ``cache_salt`` is the tool for keeping tenants apart (lesson 06). The
# non-cryptographic hashes (xxhash, xxhash_cbor, kvlab's weak16) keep a random per-process
# seed: with a public root an attacker could precompute colliding blocks offline.
#
# vLLM <= 0.28 drew NONE_HASH at random (os.urandom(32)) unless PYTHONHASHSEED was set, for
# every hash function; ``init_none_hash(random_root=True)`` brings that rule back (lesson 06
# runs both).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
NONE_HASH: BlockHash = b""
_none_hash_fn: HashFn = sha256
_random_root = False
_roots: dict[HashFn, BlockHash] = {}
_seeds: dict[HashFn, str | None] = {}  # the seed each root came from (None: a random root)


def _is_crypto(hash_fn: HashFn) -> bool:
    return hash_fn is sha256 or hash_fn is sha256_cbor


def resolve_none_hash_seed(hash_fn: HashFn) -> str:
    """The seed NONE_HASH is derived from (vLLM >= 0.29): PYTHONHASHSEED if set, else the
    fixed default for cryptographic hashes, else fresh random bytes (as hex)."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    return DEFAULT_NONE_HASH_SEED if _is_crypto(hash_fn) else os.urandom(32).hex()


def none_hash_for(hash_fn: HashFn) -> BlockHash:
    """The root of every chain hashed with ``hash_fn`` -- what vLLM's NONE_HASH would be in
    an engine configured with that hash function (so ``sha256_cbor`` chains match vLLM's
    bytes). Fixed for the process once derived; ``init_none_hash`` starts over."""
    root = _roots.get(hash_fn)
    if root is None:
        if _random_root and "PYTHONHASHSEED" not in os.environ:
            root = NONE_HASH or os.urandom(32)  # vLLM <= 0.28: one random root for every function
            _seeds[hash_fn] = None
        else:
            seed = resolve_none_hash_seed(hash_fn)
            root = hash_fn(seed)
            _seeds[hash_fn] = seed
        _roots[hash_fn] = root
    return root


def get_none_hash_seed() -> str | None:
    """The seed the current ``NONE_HASH`` was derived from (vLLM 0.33: a peer that shares
    blocks across engines advertises it): PYTHONHASHSEED, the fixed default, or the random
    hex seed drawn for a non-cryptographic hash; None for a random root (``random_root``)."""
    none_hash_for(_none_hash_fn)
    return _seeds.get(_none_hash_fn)


def init_none_hash(hash_fn: HashFn = sha256, *, random_root: bool = False) -> BlockHash:
    """(Re)derive the chain roots and return the one for ``hash_fn`` (also ``NONE_HASH``).

    ``random_root=True`` applies vLLM <= 0.28's rule: a random 32-byte root unless
    PYTHONHASHSEED is set. Hashes already stored on requests keep their old root.
    """
    global NONE_HASH, _none_hash_fn, _random_root
    if not isinstance(random_root, bool):
        raise TypeError(f"random_root must be a bool, got {type(random_root).__name__}")
    _roots.clear()
    _seeds.clear()
    _random_root = random_root
    _none_hash_fn = hash_fn
    NONE_HASH = b""
    NONE_HASH = none_hash_for(hash_fn)
    return NONE_HASH


init_none_hash()


def check_lookahead_tokens(value: object) -> int:
    """``num_hash_lookahead_tokens`` as an int >= 0. A bool is read as 0 or 1, as Python
    and vLLM read it (vLLM's own tests pass a flag here: True, one lookahead token); other
    kvlab arguments refuse bools."""
    if isinstance(value, bool):
        return int(value)
    return check_int("num_hash_lookahead_tokens", value, 0)


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block, chained to its parent: ``hash_fn((parent, tokens, extra))``.

    Token ids must be int32 ints (numpy's too); a bad one raises a ``TypeError`` /
    ``ValueError`` that names its position."""
    if not callable(hash_fn):
        raise TypeError(f"hash_fn must be a hash function (see get_hash_fn_by_name), got {type(hash_fn).__name__}")
    if not parent_block_hash:
        parent_block_hash = NONE_HASH if hash_fn is _none_hash_fn else none_hash_for(hash_fn)
    if hash_fn is sha256 and extra_keys is None and type(parent_block_hash) is bytes:
        # The default, inlined: the same bytes as sha256((parent, tuple(tokens), None)),
        # without building the tuple or making a second call (see `kvlab.bench core`).
        f = _FORMATS.get((len(parent_block_hash), len(curr_block_token_ids))) or _block_format(
            len(parent_block_hash), len(curr_block_token_ids)
        )
        try:
            return _sha256(f.pack(f.header, parent_block_hash, *curr_block_token_ids)).digest()
        except struct.error:  # a bad token: say which (the check costs nothing on the hot path)
            _check_block_tokens(curr_block_token_ids)
            raise
    if not isinstance(parent_block_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"parent_block_hash must be None or bytes, got {type(parent_block_hash).__name__}")
    if extra_keys is not None and not isinstance(extra_keys, tuple):
        raise TypeError(f"extra_keys must be None or a tuple, got {type(extra_keys).__name__}")
    tokens = _check_block_tokens(curr_block_token_ids)
    return hash_fn((parent_block_hash, tokens, extra_keys))


def _check_block_tokens(token_ids: Sequence[int]) -> tuple[int, ...]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"curr_block_token_ids must be a sequence of token ids, got {type(token_ids).__name__}")
    out = []
    for i, t in enumerate(token_ids):
        if type(t) is not int or not MIN_TOKEN_ID <= t <= MAX_TOKEN_ID:
            t = check_int(f"curr_block_token_ids[{i}]", t, MIN_TOKEN_ID, MAX_TOKEN_ID, why=TOKEN_ID_WHY)
        out.append(t)
    return tuple(out)


def _gen_mm_extra_hash_keys(request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int) -> tuple[list[Any], int]:
    """``("mm", identifier, offset - start)`` for each item overlapping ``[start, end)``,
    walking the (offset-sorted) items from ``start_mm_idx``; returns the keys and the index
    the next block resumes from."""
    keys: list[Any] = []
    features = request.mm_features
    if not features:
        return keys, start_mm_idx
    last = features[-1]
    if last.offset + last.length <= start_token_idx:
        return keys, start_mm_idx  # every item ends before this block (decode, late prefill)
    if start_mm_idx < 0:
        start_mm_idx += len(features)  # -1: the last item (vLLM <= 0.30's resume rule)
    i = start_mm_idx
    while i < len(features):
        f = features[i]
        if end_token_idx <= f.offset:
            break  # the block ends before this item
        if start_token_idx >= f.offset + f.length:
            i += 1  # the block is past this item
            continue
        keys.append(("mm", f.identifier, f.offset - start_token_idx))
        if end_token_idx >= f.offset + f.length:
            i += 1  # the item ends inside the block: the next item may start in it too
        else:
            break  # the item runs past the block
    return keys, i


def tensor_data(rows: Any) -> bytes:
    """The raw bytes of some embedding rows, as vLLM's ``tensor_data`` (``vllm/v1/utils.py``)
    gives them to SHA-256 -- a block's ``prompt_embeds`` key is the digest of these bytes.

    numpy arrays and CPU torch tensors (of a numpy dtype) give their memory as is; nested
    lists of numbers are read as float32, which is what ``numpy.asarray(rows, float32)``
    would hold. The core never imports numpy or torch: it only calls methods of the object.
    """
    if hasattr(rows, "tobytes"):
        return rows.tobytes()
    if hasattr(rows, "detach") and hasattr(rows, "numpy"):
        return rows.detach().cpu().contiguous().numpy().tobytes()
    flat = [float(x) for row in rows for x in row]
    return struct.pack(f"<{len(flat)}f", *flat)


def _gen_prompt_embeds_extra_hash_keys(request: Any, start_token_idx: int, end_token_idx: int) -> list[Any]:
    """A request given as embeddings instead of token ids (vLLM's ``prompt_embeds``) has
    placeholder token ids, so the ids cannot tell two prompts apart: the SHA-256 of each
    block's embedding rows goes into its key (computed once per block range)."""
    embeds = request.prompt_embeds
    if embeds is None:
        return []
    cache = request._prompt_embeds_per_block_hashes
    rng = (start_token_idx, end_token_idx)
    digest = cache.get(rng)
    if digest is None:
        digest = cache[rng] = hashlib.sha256(tensor_data(embeds[start_token_idx:end_token_idx])).digest()
    return [("prompt_embeds", digest)]


def generate_block_hash_extra_keys(request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int = 0) -> tuple[Any, ...] | None:
    """Extra keys for the block covering tokens ``[start, end)``, in vLLM's order and, as in
    vLLM >= 0.31, each tagged with what it is (so a LoRA name can never be mistaken for a
    salt):

    * ``("lora", lora_name, lora_path)`` -- every block, since the adapter changes every K and V;
    * ``("mm", identifier, offset - start)`` -- each multimodal item overlapping the block (the
      image, and where in the block its placeholder begins);
    * ``("cache_salt", salt)`` -- the first block only (the chain carries it further);
    * ``("prompt_embeds", digest)`` -- the block's embedding rows, for embedding prompts.

    None (not an empty tuple) when there is nothing to add.
    """
    return generate_block_hash_extra_keys_and_next_mm(request, start_token_idx, end_token_idx, start_mm_idx)[0]


def generate_block_hash_extra_keys_and_next_mm(
    request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int = 0
) -> tuple[tuple[Any, ...] | None, int]:
    """``generate_block_hash_extra_keys`` plus the multimodal index the next block resumes
    from (vLLM's ``generate_block_hash_extra_keys`` returns both)."""
    mm_keys, next_mm = _gen_mm_extra_hash_keys(request, start_token_idx, end_token_idx, start_mm_idx)
    keys: list[Any] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name, request.lora_path))
    keys += mm_keys
    if start_token_idx == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    keys += _gen_prompt_embeds_extra_hash_keys(request, start_token_idx, end_token_idx)
    return (tuple(keys) if keys else None), next_mm


#: The hasher's default extra keys (bound here: vLLM's own tests, run on kvlab, rebind the
#: public name to the pair-returning form).
_DEFAULT_EXTRA_KEYS_FN = generate_block_hash_extra_keys


def first_mm_index_in_window(features: Sequence[Any], start: int, end: int) -> int:
    """Index of the first item that ends after ``start`` (vLLM's ``get_mm_features_in_window``
    lower bound): where a hasher resuming at token ``start`` begins its walk."""
    return bisect.bisect_left(features, start + 1, key=lambda f: f.offset + f.length)


ExtraKeysFn = Callable[[Any, int, int], "tuple[Any, ...] | None"]


class RequestBlockHasher:
    """Computes the hashes of a request's *new* full blocks, chained to the ones it has
    (vLLM: the function ``get_request_block_hasher`` returns; lesson 03).

    A request calls it whenever tokens arrive, so ``request.block_hashes`` always holds one
    hash per full block and a prefix lookup only reads it. ``hash_fn`` is the algorithm;
    ``extra_keys_fn(request, start, end)`` gives the extra keys of the block covering tokens
    ``[start, end)`` (default :func:`generate_block_hash_extra_keys`: LoRA, images, salt) --
    the seam through which the ``extra_keys`` exercise runs a learner's function in the
    engine. Two hashers agree on every hash when ``block_size`` and ``hash_fn`` agree and
    the extra keys follow vLLM's rule.

    ``num_hash_lookahead_tokens`` (L, vLLM 0.33, multi-module MTP drafters): each hash also
    covers the L tokens after its block, because the drafter's KV at the block's last
    position was computed from them; a block's hash therefore appears only once those L
    tokens exist. The hashed tokens stay the block's; the extra keys become ``(E, *the L
    tokens)`` with ``E`` the extra keys of the block and its lookahead together.

    Why it is fast: with kvlab's ``sha256`` the bytes of a block are header + parent + the
    tokens as int32. The header (tag, parent length, token count) is the same for every
    block with a 32-byte parent, so its SHA-256 state is computed once and copied per
    block; the tokens come pre-packed from ``request.token_bytes`` (packed once, as they
    arrive), so each block costs one slice, one copy of the state, one update and one
    digest -- the very bytes ``hash_block_tokens`` would hash, so the hashes are identical.
    """

    __slots__ = (
        "block_size",
        "hash_fn",
        "extra_keys_fn",
        "mm_resume",
        "num_hash_lookahead_tokens",
        "_default_extra_keys",
        "_sha256_after_header",
    )

    def __init__(
        self,
        block_size: int,
        hash_fn: HashFn,
        extra_keys_fn: ExtraKeysFn | None = None,
        mm_resume: str = "window",
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        if mm_resume not in ("window", "last"):
            raise ValueError(f"mm_resume must be 'window' or 'last', got {mm_resume!r}")
        self.num_hash_lookahead_tokens = check_lookahead_tokens(num_hash_lookahead_tokens)
        self.block_size = block_size
        self.mm_resume = mm_resume
        self.hash_fn = hash_fn
        self._default_extra_keys = extra_keys_fn is None
        self.extra_keys_fn: ExtraKeysFn = _DEFAULT_EXTRA_KEYS_FN if extra_keys_fn is None else extra_keys_fn
        self._sha256_after_header = _sha256(_block_format(32, block_size).header) if hash_fn is sha256 else None

    def __call__(self, request: Any) -> list[BlockHash]:
        if self.num_hash_lookahead_tokens:
            return self._lookahead_hashes(request)
        bs = self.block_size
        hashes = request.block_hashes
        start = len(hashes) * bs
        num_tokens = request.num_tokens
        new: list[BlockHash] = []
        if start + bs > num_tokens:
            return new  # most decode steps: no block filled
        parent = self._parent(hashes)
        # Without LoRA or images, only a salted first block has extra keys (vLLM's rule):
        # skip the call for every other block -- unless a custom extra_keys_fn must see all.
        simple = self._default_extra_keys and request.lora_name is None and not request.mm_features and request.prompt_embeds is None
        # vLLM <= 0.30 resumed the walk over the images at the LAST one when a call continues
        # a request (``mm_resume="last"``); vLLM >= 0.31 -- and the default -- every image
        # overlapping the block counts, which is what a walk from the first item gives.
        mm_idx = -1 if self.mm_resume == "last" and start > 0 and request.mm_features else None
        after_header = self._sha256_after_header
        salt = request.cache_salt
        extra_keys_fn, hash_fn = self.extra_keys_fn, self.hash_fn
        packed = request.token_bytes
        all_ids = request.all_token_ids
        while start + bs <= num_tokens:
            if simple and after_header is not None and (start or salt is None) and len(parent) == 32 and num_tokens - start >= 2 * bs:
                break  # several blocks, none with extra keys: the sha256 loop below does them all
            end = start + bs
            if simple and (start or salt is None):
                extra = None
            elif mm_idx is not None:
                extra, mm_idx = generate_block_hash_extra_keys_and_next_mm(request, start, end, mm_idx)
            else:
                extra = extra_keys_fn(request, start, end)
            if after_header is not None and extra is None and len(parent) == 32:
                h = after_header.copy()
                h.update(parent + packed[4 * start : 4 * end])
                parent = h.digest()
            else:
                # hash_block_tokens without its checks: a request's token ids were checked
                # (int32) when they arrived, and the parent is a digest.
                parent = hash_fn((parent, tuple(all_ids[start:end]), extra))
            new.append(parent)
            start = end
        else:
            return new
        # One copy of the tokens still to hash into immutable bytes: slicing bytes is the
        # cheapest way to hand SHA-256 a block (cheaper than bytearray or memoryview slices).
        packed = bytes(memoryview(packed)[4 * start : 4 * (num_tokens - num_tokens % bs)])
        copy, append, nbytes = after_header.copy, new.append, 4 * bs
        for a in range(0, len(packed), nbytes):
            h = copy()
            h.update(parent + packed[a : a + nbytes])
            parent = h.digest()
            append(parent)
        return new

    def _parent(self, hashes: Sequence[BlockHash]) -> BlockHash:
        """The hash the next block chains to: the last one, or the hash function's NONE_HASH."""
        return hashes[-1] if hashes else (NONE_HASH if self.hash_fn is _none_hash_fn else none_hash_for(self.hash_fn))

    def _lookahead_hashes(self, request: Any) -> list[BlockHash]:
        """The hashes with lookahead: block ``[start, end)`` is hashed once token
        ``end + L - 1`` exists, with extra keys ``(E, *tokens[end:end + L])`` where ``E`` are
        the extra keys of ``[start, end + L)`` (vLLM 0.33's
        ``generate_lookahead_block_hash_extra_keys``: an image that only reaches into the
        lookahead counts too). One path for every request: the drafters that need it are
        rare, and each hash already costs a tuple of tokens."""
        bs, la = self.block_size, self.num_hash_lookahead_tokens
        hashes = request.block_hashes
        start = len(hashes) * bs
        num_tokens = request.num_tokens - la
        new: list[BlockHash] = []
        if start + bs > num_tokens:
            return new
        parent = self._parent(hashes)
        all_ids, extra_keys_fn, hash_fn = request.all_token_ids, self.extra_keys_fn, self.hash_fn
        while start + bs <= num_tokens:
            end = start + bs
            extra = (extra_keys_fn(request, start, end + la), *all_ids[end : end + la])
            parent = hash_fn((parent, tuple(all_ids[start:end]), extra))
            new.append(parent)
            start = end
        return new

    def __repr__(self) -> str:
        extra = "" if self._default_extra_keys else f", extra_keys_fn={getattr(self.extra_keys_fn, '__name__', self.extra_keys_fn)!s}"
        extra += "" if self.mm_resume == "window" else f", mm_resume={self.mm_resume!r}"
        extra += f", num_hash_lookahead_tokens={self.num_hash_lookahead_tokens}" if self.num_hash_lookahead_tokens else ""
        return f"RequestBlockHasher(block_size={self.block_size}, hash_fn={getattr(self.hash_fn, '__name__', self.hash_fn)!s}{extra})"


def get_request_block_hasher(
    block_size: int,
    hash_fn: HashFn,
    num_hash_lookahead_tokens: int = 0,
    *,
    extra_keys_fn: ExtraKeysFn | None = None,
    mm_resume: str = "window",
) -> RequestBlockHasher:
    """The hasher of a request's new full blocks (vLLM's name); see :class:`RequestBlockHasher`.

    ``block_size`` is the HASH block size: with groups of several block sizes, the GCD of
    them; a group with larger blocks reads the hash at the end of each of its blocks.
    ``mm_resume``: ``"window"`` (vLLM >= 0.31) or ``"last"`` (vLLM <= 0.30), lesson 06.
    ``num_hash_lookahead_tokens``: tokens after each block its hash also covers (vLLM 0.33,
    whose third argument it is; kvlab's ``extra_keys_fn`` and ``mm_resume`` go by keyword)."""
    return RequestBlockHasher(block_size, hash_fn, extra_keys_fn, mm_resume, num_hash_lookahead_tokens)


# --- groups with different block sizes ------------------------------------------------------
class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """A request's hashes seen at a larger block size (vLLM's class of the same name).

    Hashes are computed every ``hash_block_size`` tokens and each one is chained over the
    whole prefix before it, so the LAST ``hash_block_size`` hash inside a block of
    ``target_block_size`` tokens already names that block's whole prefix: it *is* the
    block's hash (vLLM >= 0.24; older vLLM concatenated the small hashes instead). With 16
    and 32: small hashes ``A B C D`` for tokens 0-15, 16-31, 32-47, 48-63 give the 32-token
    blocks the hashes ``B`` and ``D``.
    """

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int, target_block_size: int) -> None:
        if target_block_size % hash_block_size:
            raise ValueError(f"target_block_size {target_block_size} is not a multiple of hash_block_size {hash_block_size}")
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"block {idx} out of range ({len(self)} blocks)")
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]

    def __iter__(self) -> Iterator[BlockHash]:
        for i in range(len(self)):
            yield self.block_hashes[(i + 1) * self.scale_factor - 1]


def eagle_proof_margin(block_size: int, hash_block_size: int, fine_grained_lookup: bool) -> int:
    """How far past a candidate hit an EAGLE group matches before it drops the last unit
    again (vLLM 0.33's name): one hash block where the group can end a hit inside a block
    (partial hits), else one whole block."""
    return hash_block_size if fine_grained_lookup and block_size > hash_block_size else block_size


def resolve_block_hashes(
    block_hashes: Sequence[BlockHash],
    hash_block_size: int,
    block_size: int,
    *,
    supports_fine_grained_hash_lookup: bool = False,
    alignment_tokens: int | None = None,
) -> Sequence[BlockHash]:
    """The request's hashes at ``block_size``: the list itself when the sizes agree -- or,
    for a manager that can end a hit inside a block (``supports_fine_grained_hash_lookup``)
    when hits land on a finer ``alignment_tokens`` (vLLM 0.33's partial hits), the raw list,
    which it scans at the hash block's granularity."""
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        if block_hashes.scale_factor != block_size // hash_block_size:
            raise AssertionError(
                f"block_hashes is already a view at {block_hashes.scale_factor} hash blocks per block, not {block_size // hash_block_size}"
            )
        return block_hashes
    if (
        supports_fine_grained_hash_lookup
        and alignment_tokens is not None
        and alignment_tokens < block_size
        and block_size % alignment_tokens == 0
    ):
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


def resolve_dcp_kv_block_size(spec: Any, dcp_world_size: int) -> int:
    """Tokens one block of ``spec`` covers under decode context parallelism (vLLM 0.33): a
    sharded group's block holds ``block_size`` tokens on each of the ``dcp_world_size``
    ranks, so ``block_size * dcp_world_size`` in all; a replicated one, ``block_size``. (A
    wrapper of layers is sharded as its layers are.)"""
    return spec.block_size * (dcp_world_size if getattr(spec, "dcp_sharded", False) else 1)


def resolve_dcp_kv_cache_spec(spec: Any, dcp_world_size: int) -> Any:
    """``spec`` with the block size the cache manager sees under DCP (the same spec when that
    does not change it): tables, hashes and hits are counted in these logical blocks."""
    block_size = resolve_dcp_kv_block_size(spec, dcp_world_size)
    if block_size == spec.block_size:
        return spec
    if isinstance(spec, UniformTypeKVCacheSpecs):  # its layers' blocks grow with it
        layers = {k: replace(s, block_size=block_size) for k, s in spec.kv_cache_specs.items()}
        return replace(spec, block_size=block_size, kv_cache_specs=layers)
    return replace(spec, block_size=block_size)


def resolve_block_sizes_of_specs(
    specs: Sequence[KVCacheSpec], enable_caching: bool, prefix_match_unit: int | None = None, dcp_world_size: int = 1
) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) of groups of ``specs``, vLLM 0.33's rule.

    The scheduler block size is the LCM of the groups' block sizes: every chunk of a Mamba
    prefill and, unless partial hits are on, every hit length is a multiple of it. Hashes
    are computed every ``prefix_match_unit`` tokens if given, else every GCD of the block
    sizes, so each group's block ends on a hash boundary -- unless caching is off, or a
    Mamba group is not in ``align`` mode: then hashing is at the scheduler block size.
    With one group, hits land on its blocks: any other ``prefix_match_unit`` is refused.
    ``specs``: with their block sizes as the manager sees them under ``dcp_world_size``."""
    sizes = [s.block_size for s in specs]
    if len(sizes) == 1:
        bs = sizes[0]
        if prefix_match_unit not in (None, bs) and enable_caching:
            raise ValueError(
                f"Invalid prefix_match_unit={prefix_match_unit}; with a single KV cache group, prefix-cache hits land "
                f"on the block size ({bs}). Unset it or set it to {bs}."
            )
        return bs, bs  # type: ignore[return-value]  # the manager fills in every spec's block size before it calls this
    scheduler_block_size = lcm(*sizes)  # type: ignore[arg-type]  # as above
    if not enable_caching or any(isinstance(s, MambaSpec) and s.mamba_cache_mode != "align" for s in specs):
        return scheduler_block_size, scheduler_block_size
    hashing = [s.block_size for s in specs if s.prefix_cacheable] or sizes
    hash_block_size = prefix_match_unit if prefix_match_unit is not None else gcd(*hashing)  # type: ignore[arg-type]  # as above
    if any(bs % hash_block_size for bs in hashing):  # type: ignore[operator]  # as above
        raise ValueError(
            f"Invalid prefix_match_unit={hash_block_size}; prefix-cacheable KV cache group block sizes must be divisible "
            f"by prefix_match_unit. Got group block sizes={sizes}, prefix-cacheable={hashing}."
        )
    # A group that compresses k tokens into one state (DeepSeek-V4) can only resume at a
    # multiple of k: every hit length must be one.
    per_state = [getattr(s, "tokens_per_state", 1) for s in specs if s.prefix_cacheable]  # Mamba has none
    alignments = sorted({k for k in per_state if isinstance(k, int) and k > 1})
    hit_alignment = hash_block_size if partial_hash_hits_enabled(specs, hash_block_size, dcp_world_size) else scheduler_block_size
    if any(hit_alignment % a for a in alignments):
        raise ValueError(
            f"Invalid prefix_match_unit={hash_block_size}; prefix-cache boundaries must align with each spec's "
            f"per-state compression. Got alignments={alignments}."
        )
    return scheduler_block_size, hash_block_size


def resolve_kv_cache_block_sizes(kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) for an engine config (vLLM 0.33's call, in
    ``vllm/v1/core/kv_cache_utils.py``): the rule of :func:`resolve_block_sizes_of_specs`
    over the config's groups, their blocks as decode context parallelism makes them.

    A model of one group takes the engine's ``cache_config.block_size`` (times the DCP size
    when the group is sharded), not its spec's. Hashes matter when prefix caching or a KV
    connector is on: with neither, both sizes are the scheduler block size."""
    cache_config = vllm_config.cache_config
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    groups = list(kv_cache_config.kv_cache_groups)
    hashed = bool(cache_config.enable_prefix_caching) or vllm_config.kv_transfer_config is not None
    if len(groups) <= 1:
        if groups and not getattr(groups[0].kv_cache_spec, "dcp_sharded", False):
            dcp = 1
        bs = cache_config.block_size * dcp
        unit = cache_config.prefix_match_unit
        if groups and hashed and unit not in (None, bs):
            raise ValueError(
                f"Invalid prefix_match_unit={unit}; with a single KV cache group, prefix-cache hits land "
                f"on the block size ({bs}). Unset it or set it to {bs}."
            )
        return bs, bs
    specs = [resolve_dcp_kv_cache_spec(g.kv_cache_spec, dcp) for g in groups]
    return resolve_block_sizes_of_specs(specs, hashed, cache_config.prefix_match_unit, dcp)


#: spec class -> the class of manager that runs a group of that spec (vLLM 0.33's
#: ``spec_manager_map``, its ``KVCacheSpecRegistry``). The managers are defined above this
#: module, so ``single_type_kv_cache_manager`` fills it when it is imported -- and
#: ``kvlab.core`` imports that module first thing, so it is filled before anything reads it.
MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {}


def get_manager_class(kv_cache_spec: Any) -> type[SingleTypeKVCacheManager]:
    """The manager class for ``kv_cache_spec``: its own class's, else the nearest base's
    (a subclass of a spec is run as that spec, as in vLLM's registry)."""
    for t in type(kv_cache_spec).__mro__:
        if t in MANAGER_FOR_SPEC:
            return MANAGER_FOR_SPEC[t]
    raise ValueError(
        f"no KV cache manager runs a {type(kv_cache_spec).__name__}; known specs: {sorted(t.__name__ for t in MANAGER_FOR_SPEC)}"
    )


def partial_hash_hits_enabled(
    kv_cache_groups: Sequence[Any],
    hash_block_size: int,
    dcp_world_size: int = 1,
    manager_classes: Sequence[Any] | None = None,
) -> bool:
    """Whether hits may end *inside* a block (vLLM 0.33's fine-grained partial hits): only
    with a Mamba group in ``align`` mode whose blocks are larger than the hash block -- its
    blocks hold hundreds of tokens on a real hybrid (lesson 07b), and without this a hit
    would lose up to a whole block. Under decode context parallelism a Mamba block equal to
    the hash block will do: the full-attention block is the one that grew
    (``dcp_world_size`` times).

    With ``manager_classes`` (one per group), every other prefix-cacheable group must also
    be able to end a hit inside its blocks (``supports_fine_grained_hash_lookup``: full
    attention, Mamba) or have blocks of the hash size; else hits stay on whole blocks.
    ``kv_cache_groups``: the groups (vLLM's call) or their specs (the coordinator's)."""
    specs = [getattr(g, "kv_cache_spec", g) for g in kv_cache_groups]
    if not any(
        isinstance(s, MambaSpec)
        and s.mamba_cache_mode == "align"
        and (s.block_size > hash_block_size or (dcp_world_size > 1 and s.block_size == hash_block_size))  # type: ignore[operator]  # every spec has its block size
        for spec in specs
        for s in iter_layer_specs(spec)
    ):
        return False
    if manager_classes is None:
        return True
    unsupported = sorted(
        {
            cls.__name__
            for s, cls in zip(specs, manager_classes)
            if s.prefix_cacheable and not cls.supports_fine_grained_hash_lookup and s.block_size != hash_block_size
        }
    )
    if unsupported:
        logger.warning(
            "Disabling fine-grained prefix-cache hits because these KV cache managers require block-aligned lookups: %s.",
            ", ".join(unsupported),
        )
        return False
    return True


def resolve_cache_hit_alignment_tokens(kv_cache_config: Any, vllm_config: Any, scheduler_block_size: int, hash_block_size: int) -> int:
    """The token granularity prefix-cache hits land on, worked out from the configuration
    alone (vLLM 0.33): the hash block with fine-grained partial hits, else the scheduler
    block -- the alignment the coordinator gives its managers. The engine hands it to the
    workers, which place Mamba checkpoints there, so the two must agree.

    ``vllm_config`` is read for ``cache_config.enable_prefix_caching`` and
    ``parallel_config.decode_context_parallel_size`` only."""
    groups = kv_cache_config.kv_cache_groups
    if not vllm_config.cache_config.enable_prefix_caching or len(groups) <= 1:
        return scheduler_block_size
    classes = [get_manager_class(g.kv_cache_spec) for g in groups]
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    specs = [resolve_dcp_kv_cache_spec(g.kv_cache_spec, dcp) for g in groups]  # the blocks the managers see
    return hash_block_size if partial_hash_hits_enabled(specs, hash_block_size, dcp, classes) else scheduler_block_size


def null_head_len(blocks: Sequence[KVCacheBlock]) -> int:
    """How many null blocks lead the table (a window's skipped prefix; vLLM 0.33)."""
    i = 0
    while i < len(blocks) and blocks[i].is_null:
        i += 1
    return i


def trim_null_head(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    """The table without its leading null blocks (a window's skipped prefix)."""
    i = null_head_len(blocks)
    return blocks[i:] if i else blocks


def generate_scheduler_kv_cache_config(kv_cache_configs: Sequence[Any]) -> Any:
    """The config the scheduler's ``KVCacheManager`` is built from, out of the workers' ones
    (vLLM 0.33): they agree on everything but layer names, so the first is copied, and a
    :class:`~kvlab.kv_cache_interface.UniformTypeKVCacheSpecs` group becomes its first layer's
    spec -- the manager needs the group's kind, not each layer's shape."""
    if not kv_cache_configs:
        raise ValueError("kv_cache_configs must hold one config per worker, got none")
    first = kv_cache_configs[0]
    for i, cfg in enumerate(kv_cache_configs[1:], 1):
        if cfg.num_blocks != first.num_blocks or cfg.hisparse_host_num_blocks != first.hisparse_host_num_blocks:
            raise AssertionError(
                f"kv_cache_configs[{i}] has {cfg.num_blocks} blocks, kv_cache_configs[0] {first.num_blocks}: workers must agree"
            )
    return replace(first, kv_cache_groups=[replace(g) for g in scheduler_kv_cache_groups(first.kv_cache_groups)])


def get_max_concurrency_for_kv_cache_config(vllm_config: Any, kv_cache_config: Any) -> float:
    """How many requests of ``max_model_len`` tokens the pool holds at once (vLLM 0.33; the
    "Maximum concurrency for N tokens per request: X.XXx" line of its start-up log).

    Each group charges a request whole blocks -- its spec's worst case
    (``max_memory_usage_bytes``) over its page -- and every GPU group draws its block ids from
    the one pool, so a request costs the *sum* over groups: a full-attention group
    ``max_model_len / block_size`` blocks, a window group only its window's. HiSparse's
    host-resident group draws from the host pool instead; the smaller of the two quotients
    wins. The answer is a fraction: 1.5 means one request of ``max_model_len`` tokens and
    half of another."""
    gpu_blocks = 0
    host_blocks = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        blocks = cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
        if getattr(group, "host_resident", False):
            host_blocks += blocks
        else:
            gpu_blocks += blocks
    limits = [kv_cache_config.num_blocks / gpu_blocks]
    if host_blocks:
        host_pool = kv_cache_config.hisparse_host_num_blocks
        if host_pool is None:
            raise ValueError("kv_cache_config has a host-resident group but no hisparse_host_num_blocks: the host pool's size is unknown")
        limits.append(host_pool / host_blocks)
    return min(limits)


def get_kv_cache_capacity(vllm_config: Any, kv_cache_config: Any) -> tuple[int, float]:
    """The pool's capacity in tokens and its maximum concurrency (vLLM 0.33's start-up log:
    "GPU KV cache size: N tokens"): the tokens are the concurrency times ``max_model_len``,
    so a hybrid model's window groups, which charge a request little, count in full."""
    max_concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)
    return int(max_concurrency * vllm_config.model_config.max_model_len), max_concurrency


def scheduler_kv_cache_groups(kv_cache_groups: Sequence[Any]) -> list[Any]:
    """The groups as the block manager sees them: a ``UniformTypeKVCacheSpecs`` group becomes
    its first layer's spec (the same groups otherwise, not copied)."""
    return [
        replace(g, kv_cache_spec=g.kv_cache_spec.first_spec) if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) else g
        for g in kv_cache_groups
    ]


def unify_kv_cache_spec_page_size(specs: Sequence[Any]) -> list[Any]:
    """Give every group the same page size, the way vLLM plans a hybrid model's pool.

    One pool of pages serves every group, so a page must hold one block of any group. The
    largest page wins; a group with a smaller page gets a proportionally larger
    ``block_size`` (its layers store fewer bytes per token, so more tokens fit the page); a
    Mamba group, whose page is one state whatever the block size, is padded instead. A page
    that does not divide the largest one is padded if it is plain attention and refused
    otherwise -- as in vLLM (``unify_kv_cache_spec_page_size``)."""
    from kvlab.kv_cache_interface import AttentionSpec, MambaSpec, MLAAttentionSpec

    specs = list(specs)
    for i, s in enumerate(specs):
        if s.block_size is None:
            raise ValueError(f"specs[{i}].block_size is None: give every spec a block size before unifying")
    sizes = [s.page_size_bytes for s in specs]
    target = max(sizes)
    out = []
    for i, (s, size) in enumerate(zip(specs, sizes)):
        if size == target:
            out.append(s)
        elif isinstance(s, MambaSpec):
            out.append(replace(s, page_size_padded=target))
        elif target % size == 0:
            out.append(s.with_block_size(s.block_size * (target // size)))
        elif isinstance(s, AttentionSpec) and not isinstance(s, MLAAttentionSpec):
            raise ValueError(
                f"specs[{i}]: page of {size} bytes does not divide the largest page ({target} bytes); "
                "vLLM pads such a page, kvlab asks you to pick sizes that divide"
            )
        else:
            raise ValueError(f"specs[{i}]: page of {size} bytes does not divide the largest page ({target} bytes) and cannot be padded")
    return out


# --- how hashes and extra keys appear in vLLM's KV cache events (lesson 08) -------------------
# tag -> length of a tagged key (an untagged multimodal key is a 2-tuple (identifier, offset)).
_EXTRA_KEY_TAGS = {"lora": 3, "mm": 3, "cache_salt": 2, "prompt_embeds": 2}


def _untag(key: Any) -> Any:
    if type(key) is tuple and len(key) >= 2 and _EXTRA_KEY_TAGS.get(key[0]) == len(key):
        return key[1:] if key[0] == "mm" else key[1]
    return key


def maybe_convert_block_hash(block_hash: BlockHash, use_int: bool = True) -> bytes | int:
    """A block hash as vLLM publishes it: by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)
    the low 64 bits of the big-endian digest as an int, else the digest itself."""
    if not use_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def to_event_extra_keys(extra_keys: Sequence[tuple[Any, ...] | None]) -> list[tuple[Any, ...] | None] | None:
    """Per-block extra keys as events carry them: one entry per stored block, untagged.

    vLLM >= 0.31 tags each key inside the hash (``("lora", name, path)``, ``("mm", id,
    offset)``, ``("cache_salt", salt)``) but still publishes the older untagged shapes (the
    LoRA name, ``(id, offset)``, the salt) so existing consumers keep working. Untagged keys
    pass through unchanged. None when there are no blocks at all.
    """
    if not extra_keys:
        return None
    out: list[tuple[Any, ...] | None] = []
    for keys in extra_keys:
        if keys is None:
            out.append(None)
            continue
        out.append(tuple(_untag(k) for k in keys))
    return out
