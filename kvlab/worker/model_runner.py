"""The model runner: vLLM's GPU model runner in miniature, and the engine's real executor.

The scheduler and KV-cache manager only *decide*: which requests run, how many tokens
each, which physical blocks hold them. The runner turns one decision — a
:class:`~kvlab.core.sched.output.SchedulerOutput` — into kernel inputs and runs the model:

1. keep per-request state across steps (tokens, block table row per KV-cache group),
   updated from the deltas the scheduler sends (lesson: "the block table is append-only");
2. flatten the batch: input ids, absolute positions, ``cu_seqlens_q``, ``seq_lens``;
3. translate positions into cache slots, ``block_id * block_size + offset``, through each
   group's table (the slot mapping) and pad the tables into one int32 tensor;
4. run the model (each layer: ``reshape_and_cache`` then ``unified_attention``);
5. sample one token for each request whose known tokens are now all computed — a request
   in the middle of a chunked prefill gets nothing this step.

Everything fed to the kernels is recorded in :attr:`ModelRunner.last_batch` (the
visualisation's "kernel view"), and :attr:`ModelRunner.num_tokens_computed` counts the
tokens that went through the model, which is how a lesson *shows* that a prefix-cache hit
skipped work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from kvlab.core.kv_cache_utils import KVCacheBlockCopy
from kvlab.core.sched.output import NewRequestData, SchedulerOutput
from kvlab.eventlog.events import AttentionBatch, EventLog
from kvlab.kv_cache_interface import KVCacheConfig
from kvlab.utils.checks import check_int, check_number
from kvlab.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin, kv_caches_by_layer, requests_with_invalid_blocks
from kvlab.worker.model import (
    PagedAttentionMetadata,
    PagedKernels,
    TinyLlama,
    load_kernels,
)
from kvlab.utils.math_utils import cdiv

__all__ = ["ModelRunner", "CachedRequestState", "BatchRecord", "NULL_BLOCK_ID"]

#: Block 0 is the pool's null block: a placeholder in a sliding-window table for blocks
#: that left the window. It never holds anyone's tokens, so no kernel may read it.
NULL_BLOCK_ID = 0


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers about a running request between steps (vLLM:
    ``CachedRequestState`` in the GPU model runner's input batch)."""

    req_id: str
    token_ids: list[int]  # every token known: prompt + outputs (including the ones we sampled)
    block_ids: list[list[int]]  # one append-only row per KV-cache group
    num_computed_tokens: int  # tokens whose KV is in the cache after the last step

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class BatchRecord:
    """Exactly what one step fed the kernels, as plain lists (for pictures and tests)."""

    step: int
    req_ids: list[str]  # batch order: row i of the block tables, segment i of the tokens
    num_scheduled_tokens: list[int]
    input_ids: list[int]
    positions: list[int]
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    slot_mappings: list[list[int]]  # per KV-cache group, one slot per new token
    block_tables: list[list[list[int]]]  # per group: [num_seqs][max_blocks], padded with 0
    logits_indices: list[int]  # row of each request's last scheduled token
    sampled: dict[str, int] = field(default_factory=dict)  # only requests that completed
    logits: Tensor | None = field(default=None, repr=False)  # float32 [num_seqs, vocab] at logits_indices

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def _interpreting() -> bool:
    """Do the Triton kernels run under the interpreter (no GPU)?"""
    from kvlab.kernels import INTERPRET

    return INTERPRET


def _spec_window(spec: object) -> int | None:
    """Sliding window of a KV-cache group spec (duck-typed: FullAttentionSpec has none)."""
    return getattr(spec, "sliding_window", None)


class ModelRunner(KVConnectorModelRunnerMixin):
    """Holds the paged KV cache of every layer and executes SchedulerOutputs on the model.

    ``kv_cache_groups``: one spec per KV-cache group, in the KV-cache manager's order
    (anything with a ``sliding_window`` attribute; full attention has none or None). A
    layer uses the group whose window equals its own. ``None`` derives the groups from the
    model: ``[full]``, plus ``[window]`` when it has sliding-window layers. All groups
    draw from ONE pool of ``num_blocks`` blocks, so block id b means physical block b in
    every layer's tensor; a layer reads it through its own group's table.

    ``num_blocks`` and ``block_size`` are best left out (the lessons do): the ``LLMEngine``
    built with the runner then hands it the KV-cache manager's ``kv_cache_config`` (block
    count, groups, block size: :meth:`initialize_kv_cache`), as vLLM's engine core sizes its
    workers, so the pool is sized in one place. Given by hand, they must match the manager's.

    ``device=None`` follows the kernels: ``kvlab.kernels.DEVICE`` ("cuda" when a GPU is
    present, else "cpu") for the Triton backend, "cpu" for the reference one.

    ``temperature=0`` samples greedily (what the tests compare); above 0 it samples from
    softmax(logits / temperature) with one generator seeded by ``seed``.

    ``kv_connector``: the worker half of a KV connector (lessons 12-13): it loads external
    KV into the paged caches before the forward pass and saves computed KV after it
    (``register_kv_connector`` attaches one later). The tiny model has no vision encoder:
    multimodal items' encoder cache runs with the simulated executor (lesson 14).
    """

    #: It writes K/V into the blocks (see ``Executor.writes_kv_cache``).
    writes_kv_cache = True

    def __init__(
        self,
        model: TinyLlama,
        num_blocks: int | None = None,
        block_size: int | None = None,
        kv_cache_groups: Sequence[object] | None = None,
        device: str | torch.device | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        backend: str = "triton",
        keep_history: bool = False,
        event_log: EventLog | None = None,
        trace_reads: bool | None = None,
        kv_connector: object = None,
    ) -> None:
        if not isinstance(model, TinyLlama):
            raise TypeError(f"model must be a TinyLlama, got {type(model).__name__}")
        if (num_blocks is None) != (block_size is None):
            raise ValueError(
                "num_blocks and block_size go together: give both, or neither -- then the LLMEngine "
                "built with this runner sizes its cache from the KV-cache manager (initialize_kv_cache)"
            )
        if num_blocks is None and kv_cache_groups is not None:
            raise ValueError(
                "kv_cache_groups come with num_blocks and block_size; without them the engine's kv_cache_config brings the groups"
            )
        windows: tuple[int | None, ...] = ()
        size = 0
        if num_blocks is not None:
            num_blocks = check_int("num_blocks", num_blocks, 2, why=" (block 0 is the null block)")
            size = check_int("block_size", block_size, 1)
        temperature = check_number("temperature", temperature, 0, why=" (0 = greedy)")
        seed = check_int("seed", seed)
        self.kernels: PagedKernels = load_kernels(backend)
        if device is None:
            device = "cpu"
            if self.kernels.name == "triton":
                from kvlab.kernels import DEVICE

                device = DEVICE
        self.device = torch.device(device)
        self.model = model
        if num_blocks is not None:
            windows = self._resolve_groups(kv_cache_groups, size)
        self.temperature = float(temperature)
        # The paged caches: allocated by _allocate, now or when the engine calls initialize_kv_cache.
        self.num_blocks = 0
        self.block_size = 0
        self.group_windows: tuple[int | None, ...] = ()
        self.layer_to_group: tuple[int, ...] = ()
        self.kv_caches: list[Tensor] = []
        self.kv_cache_bytes = 0
        self.read_layers: list[int] = []
        self.requests: dict[str, CachedRequestState] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.last_batch: BatchRecord | None = None
        self.keep_history = keep_history
        self.history: list[BatchRecord] = []
        # The kernel view of the visualisation reads what the kernels were given from here.
        self.event_log = event_log
        # Observe the attention kernel's real loads (one layer per group) and put them in
        # the AttentionBatch event: only possible under the Triton interpreter.
        interpret = self.kernels.name == "triton" and _interpreting()
        if trace_reads is None:
            trace_reads = interpret and event_log is not None
        elif not isinstance(trace_reads, bool):
            raise TypeError(f"trace_reads must be a bool or None (automatic), got {type(trace_reads).__name__}")
        elif trace_reads and not interpret:
            raise ValueError(
                "trace_reads=True needs the Triton backend under the interpreter (no CUDA); "
                "on a GPU, kvlab.kernels.trace.probe_reads_nan observes the reads instead"
            )
        self.trace_reads = trace_reads
        model.to(self.device)  # only after every check passed
        if num_blocks is not None:
            self._allocate(num_blocks, size, windows)
        if kv_connector is not None:  # not allocated yet: initialize_kv_cache shows it the caches
            self.register_kv_connector(kv_connector, self.kv_caches if self.kv_cache_allocated else None)

    @property
    def kv_cache_allocated(self) -> bool:
        """Whether the paged caches exist (given ``num_blocks``/``block_size``, or after
        :meth:`initialize_kv_cache`)."""
        return bool(self.kv_caches)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the paged caches from the engine's plan: its block count and its groups'
        specs (vLLM 0.33: ``GPUModelRunner.initialize_kv_cache``, reached from the engine
        core through ``initialize_from_config``). Why the runner waits for it: the pool's
        size is decided once, where the KV-cache manager is built, and the worker follows --
        a runner sized by hand could disagree with the manager's block ids. A KV connector
        attached before gets the caches now (vLLM registers them here too). All or nothing:
        a bad config raises and leaves the runner without a cache."""
        if self.kv_cache_allocated:
            raise RuntimeError(
                f"this runner's KV cache is already allocated ({self.num_blocks} blocks of {self.block_size} tokens); "
                "a runner serves one engine: build a new ModelRunner"
            )
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise TypeError(
                f"kv_cache_config must be a KVCacheConfig (KVCacheManager.kv_cache_config), got {type(kv_cache_config).__name__}"
            )
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        if not specs:
            raise ValueError("kv_cache_config.kv_cache_groups is empty: the runner needs at least the full-attention group")
        num_blocks = check_int("kv_cache_config.num_blocks", kv_cache_config.num_blocks, 2, why=" (block 0 is the null block)")
        block_size = check_int("kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size", specs[0].block_size, 1)
        windows = self._resolve_groups(specs, block_size)
        self._allocate(num_blocks, block_size, windows)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(kv_caches_by_layer(self.kv_caches))

    def _allocate(self, num_blocks: int, block_size: int, windows: tuple[int | None, ...]) -> None:
        cfg = self.model.config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group_windows = windows
        self.layer_to_group = tuple(windows.index(cfg.layer_sliding_window(i)) for i in range(cfg.num_layers))
        # One tensor per layer, [num_blocks, 2 (k|v), block_size, kv_heads, head_dim]: a block's
        # keys and values sit next to each other, as in vLLM 0.33's FlashAttention layout (there
        # one byte buffer serves every layer, each viewing it as [num_blocks, kv_heads,
        # block_size, 2 * head_dim]; lesson 02); the kernels get the strided views kv[:, 0] and kv[:, 1].
        self.kv_caches = [
            torch.zeros(num_blocks, 2, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, device=self.device)
            for _ in range(cfg.num_layers)
        ]
        # Memory of the cache, for the lessons' "how many tokens fit" arithmetic.
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for t in self.kv_caches)
        # Per group, the first layer that uses it: the one whose loads are traced.
        self.read_layers = [self.layer_to_group.index(g) if g in self.layer_to_group else -1 for g in range(len(windows))]

    def _resolve_groups(self, kv_cache_groups: Sequence[object] | None, block_size: int) -> tuple[int | None, ...]:
        cfg = self.model.config
        if kv_cache_groups is None:
            return (None,) if cfg.sliding_window is None else (None, cfg.sliding_window)
        groups = list(kv_cache_groups)
        for g in groups:
            # The tiny model has only K/V attention layers: full and sliding-window groups. The
            # other kinds (MLA's latent, chunked local attention, Mamba states) are modelled by
            # the KV-cache manager and run in the simulated engine only.
            kind = getattr(g, "type_name", "full")
            if kind not in ("full", "sliding_window"):
                raise ValueError(
                    f"kv_cache_groups: the model runner runs full-attention and sliding-window groups only, got "
                    f"{type(g).__name__}; use the simulated executor (build_engine's default) for that kind"
                )
        windows = tuple(_spec_window(g) for g in groups)
        for g in groups:
            bs = getattr(g, "block_size", None)
            if bs is not None and bs != block_size:
                raise ValueError(
                    f"kv_cache_groups: a group has block_size={bs}, but the runner's block_size is {block_size}; all groups must share it"
                )
        if not groups or windows[0] is not None:
            raise ValueError(f"kv_cache_groups must start with the full-attention group; got windows {windows!r}")
        if len(set(windows)) != len(windows):
            raise ValueError(f"kv_cache_groups: each attention kind may appear once; got windows {windows!r}")
        needed = {cfg.layer_sliding_window(i) for i in range(cfg.num_layers)}
        if set(windows) != needed | {None}:
            raise ValueError(
                f"kv_cache_groups {windows!r} (sliding windows; None = full) do not match the model, whose layers "
                f"need {sorted(needed, key=lambda w: -1 if w is None else w)!r}"
            )
        return windows

    # ------------------------------------------------------------------ public API

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def block_table(self, req_id: str) -> tuple[list[int], ...]:
        """The runner's copy of a request's block table, one row per group."""
        return tuple(list(row) for row in self.requests[req_id].block_ids)

    @torch.no_grad()
    def _check_block_ids_to_zero(self, ids: list[int] | None) -> list[int]:
        if not ids:
            return []
        for b in ids:
            self._check_block_id("new_block_ids_to_zero:", b)
        return ids

    def _check_block_id(self, what: str, b: object) -> int:
        if type(b) is not int or not 1 <= b < self.num_blocks:
            raise ValueError(f"{what} {b!r} is not a block id of this cache (1..{self.num_blocks - 1})")
        return b

    def _check_block_copies(self, copies: list[KVCacheBlockCopy] | None) -> list[tuple[int, int]]:
        if not copies:
            return []
        pairs: list[tuple[int, int]] = []
        for c in copies:
            src = self._check_block_id("kv_cache_block_copies: src_block_id", getattr(c, "src_block_id", None))
            dst = self._check_block_id("kv_cache_block_copies: dst_block_id", getattr(c, "dst_block_id", None))
            if src == dst:
                raise ValueError(f"kv_cache_block_copies: block {src} is copied onto itself")
            pairs.append((src, dst))
        return pairs

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """vLLM 0.33's copy-on-write: each destination page becomes its source page, in every
        layer, before the forward pass writes the rest of it."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for kv in self.kv_caches:
            kv[dst] = kv[src]

    def _zero_block_ids(self, ids: list[int]) -> None:
        """vLLM 0.33's zeroing: every layer's pages of these blocks become 0 before this step
        writes into them, so bytes another group left behind cannot decode as NaN or Inf."""
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        for kv in self.kv_caches:
            kv.index_fill_(0, index, 0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        """Run one step. Returns ``{req_id: [sampled token]}`` for every request whose known
        tokens are all computed after this step; partial prefill chunks get no entry.

        All inputs are validated before any state changes, so a bad SchedulerOutput raises
        a ``ValueError`` and leaves the runner as it was.
        """
        if not self.kv_cache_allocated:
            raise RuntimeError(
                "this runner has no KV cache yet: build an LLMEngine with it (the engine gives it the "
                "KV-cache manager's kv_cache_config), or call initialize_kv_cache(manager.kv_cache_config)"
            )
        so = scheduler_output
        staged, order = self._stage(so)
        zero = self._check_block_ids_to_zero(so.new_block_ids_to_zero)
        copies = self._check_block_copies(so.kv_cache_block_copies)
        self.requests = staged
        self.num_steps += 1
        if zero:
            self._zero_block_ids(zero)
        if copies:
            self._copy_blocks(copies)
        # A KV connector loads external KV now; a request whose computed prefix holds a
        # block that failed to load sits this step out (the scheduler cuts its computed
        # tokens back to the failed block, and it recomputes from there next step).
        invalid = self._kv_connector_start(so)
        skipped: set[str] = set()
        if invalid:
            skipped = requests_with_invalid_blocks(
                ((st.req_id, st.block_ids[0], st.num_computed_tokens) for st, _ in order), invalid, self.block_size
            )
            order = [(st, n) for st, n in order if st.req_id not in skipped]
        if not order:
            self.last_batch = None
            self._kv_connector_finish(so, invalid, skipped)
            return {}
        batch, meta, input_ids, positions = self._prepare_inputs(so.step, order)
        kernels, reads = self.kernels, None
        if self.trace_reads:
            kernels, reads = self._tracing_kernels(len(order))
        hooks = self._kv_layer_hooks(so, meta)
        hidden = self.model.forward_paged(input_ids, positions, self.kv_caches, meta, kernels, layer_hooks=hooks)
        logits = self.model.compute_logits(hidden[torch.tensor(batch.logits_indices, device=self.device)])
        batch.logits = logits.cpu()
        sampled: dict[str, list[int]] = {}
        for row, (state, n) in enumerate(order):
            state.num_computed_tokens += n
            if state.num_computed_tokens == state.num_tokens:
                tok = self._sample(logits[row])
                state.token_ids.append(tok)
                sampled[state.req_id] = [tok]
                batch.sampled[state.req_id] = tok
        self.num_tokens_computed += batch.num_tokens
        self._kv_connector_finish(so, invalid, skipped)
        self.last_batch = batch
        if self.keep_history:
            self.history.append(batch)
        if self.event_log is not None:
            self.event_log.emit(
                AttentionBatch(
                    req_ids=list(batch.req_ids),
                    query_lens=list(batch.num_scheduled_tokens),
                    seq_lens=list(batch.seq_lens),
                    block_tables=[[list(r) for r in g] for g in batch.block_tables],
                    slot_mappings=[list(g) for g in batch.slot_mappings],
                    block_size=self.block_size,
                    sliding_windows=list(self.group_windows),
                    kernel_reads=reads,
                    read_layers=list(self.read_layers) if reads is not None else [],
                )
            )
        return sampled

    def _tracing_kernels(self, num_seqs: int) -> tuple[PagedKernels, list[list[list[int]]]]:
        """The kernels with ``unified_attention`` traced for the first layer of each group.

        Layers call ``unified_attention`` in layer order, once each; the wrapper counts the
        calls to know which layer is calling. The traced call runs the very same kernel
        (the interpreter only reports its loads), so the step's result is unchanged.
        """
        from kvlab.kernels.trace import traced_unified_attention

        reads: list[list[list[int]]] = [[[] for _ in range(num_seqs)] for _ in range(self.num_groups)]
        traced = {layer: g for g, layer in enumerate(self.read_layers) if layer >= 0}
        plain = self.kernels.unified_attention
        calls = [0]

        def unified_attention(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            layer = calls[0]
            calls[0] += 1
            if layer not in traced:
                return plain(*args, **kwargs)
            out, got = traced_unified_attention(*args, **kwargs)
            reads[traced[layer]] = got
            return out

        return self.kernels._replace(unified_attention=unified_attention), reads

    # ------------------------------------------------------------------ steps of a step

    def _stage(self, so: SchedulerOutput) -> tuple[dict[str, CachedRequestState], list[tuple[CachedRequestState, int]]]:
        """Validate ``so`` and build the request states after it, without touching ``self``.

        Cached requests get fresh copies of their state, so a failure halfway leaves the
        runner's own state untouched.
        """
        if not isinstance(so, SchedulerOutput):
            raise TypeError(f"scheduler_output must be a SchedulerOutput, got {type(so).__name__}")
        dropped = set(so.finished_req_ids) | set(so.preempted_req_ids)
        staged = {rid: st for rid, st in self.requests.items() if rid not in dropped}
        order: list[tuple[CachedRequestState, int]] = []
        seen: set[str] = set()

        def check_scheduled(req_id: str, new_token_ids: list[int]) -> int:
            if req_id in seen:
                raise ValueError(f"request {req_id!r} is scheduled twice in step {so.step}")
            seen.add(req_id)
            if req_id in dropped:
                raise ValueError(f"request {req_id!r} is scheduled in step {so.step} but also listed as finished/preempted")
            n = so.num_scheduled_tokens.get(req_id)
            if n is None or n != len(new_token_ids) or n < 1:
                raise ValueError(
                    f"request {req_id!r}: num_scheduled_tokens={n!r} must be >= 1 and equal len(new_token_ids)={len(new_token_ids)}"
                )
            return n

        for new in so.scheduled_new_reqs:
            n = check_scheduled(new.req_id, new.new_token_ids)
            state = self._state_from_new(new)
            self._check_tokens(state, new.num_computed_tokens, new.new_token_ids, so.step)
            staged[new.req_id] = state
            order.append((state, n))

        cached = so.scheduled_cached_reqs
        cols = (cached.new_block_ids, cached.num_computed_tokens, cached.new_token_ids)
        if any(len(c) != cached.num_reqs for c in cols):
            raise ValueError(
                "scheduled_cached_reqs: req_ids, new_block_ids, num_computed_tokens and new_token_ids must have the same length"
            )
        for req_id, new_blocks, num_computed, new_tokens in zip(cached.req_ids, *cols):
            n = check_scheduled(req_id, new_tokens)
            old = staged.get(req_id)
            if old is None:
                raise ValueError(
                    f"scheduled_cached_reqs: request {req_id!r} is unknown to the runner (never sent "
                    "as new, or dropped as finished/preempted); resumed requests must come as "
                    "NewRequestData"
                )
            rows = [list(r) for r in old.block_ids]
            if new_blocks is not None:
                self._check_groups(new_blocks, f"request {req_id!r}: new_block_ids")
                for row, extra in zip(rows, new_blocks):
                    row.extend(int(b) for b in extra)
            state = replace(old, token_ids=list(old.token_ids), block_ids=rows)
            self._check_tokens(state, num_computed, new_tokens, so.step)
            staged[req_id] = state
            order.append((state, n))

        if seen != set(so.num_scheduled_tokens):
            unknown = sorted(set(so.num_scheduled_tokens) - seen)
            raise ValueError(f"num_scheduled_tokens names requests that are not scheduled: {unknown!r}")
        total = sum(n for _, n in order)
        if total != so.total_num_scheduled_tokens:
            raise ValueError(f"total_num_scheduled_tokens={so.total_num_scheduled_tokens} but the scheduled requests add up to {total}")
        for state, n in order:
            self._check_block_table(state, n)
        return staged, order

    def _check_groups(self, block_ids: object, what: str) -> None:
        if not isinstance(block_ids, (tuple, list)) or len(block_ids) != self.num_groups:
            raise ValueError(f"{what} must hold one list per KV-cache group ({self.num_groups}), got {block_ids!r}")

    def _state_from_new(self, new: NewRequestData) -> CachedRequestState:
        self._check_groups(new.block_ids, f"request {new.req_id!r}: block_ids")
        return CachedRequestState(
            req_id=new.req_id,
            token_ids=[int(t) for t in new.all_token_ids],
            block_ids=[[int(b) for b in row] for row in new.block_ids],
            num_computed_tokens=new.num_computed_tokens,
        )

    def _check_tokens(self, state: CachedRequestState, num_computed: int, new_tokens: list[int], step: int) -> None:
        """Merge the step's ``new_token_ids`` into the known tokens, checking they agree.

        Positions ``num_computed …`` may overlap tokens the runner already knows (the one it
        sampled last step, or a resumed request's outputs) — those must match — and may
        extend past them.
        """
        rid = state.req_id
        if type(num_computed) is not int or not 0 <= num_computed <= state.num_tokens:
            raise ValueError(
                f"request {rid!r}: num_computed_tokens={num_computed!r} must be an int in "
                f"0..{state.num_tokens} (the tokens the runner knows) in step {step}"
            )
        vocab = self.model.config.vocab_size
        for i, tok in enumerate(new_tokens):
            if not 0 <= tok < vocab:
                raise ValueError(f"request {rid!r}: token id {tok} out of range 0..{vocab - 1}")
            pos = num_computed + i
            if pos < state.num_tokens:
                if state.token_ids[pos] != tok:
                    raise ValueError(
                        f"request {rid!r}: new_token_ids says token {tok} at position {pos}, but the "
                        f"request holds {state.token_ids[pos]} there (step {step})"
                    )
            else:
                state.token_ids.append(int(tok))
        state.num_computed_tokens = num_computed

    def _check_block_table(self, state: CachedRequestState, n: int) -> None:
        """Every block the kernels will touch exists and is not the null block."""
        bs = self.block_size
        seq_len = state.num_computed_tokens + n
        num_needed = cdiv(seq_len, bs)
        for g, (row, window) in enumerate(zip(state.block_ids, self.group_windows)):
            where = f"request {state.req_id!r}, group {g}"
            if len(row) < num_needed:
                raise ValueError(f"{where}: block table has {len(row)} blocks, but {seq_len} tokens need {num_needed} blocks of {bs}")
            bad = [b for b in row if not 0 <= b < self.num_blocks]
            if bad:
                raise ValueError(f"{where}: block ids {bad} out of range 0..{self.num_blocks - 1}")
            # The first key any query of this step may read: 0 for full attention, the
            # window start of the first new token for a sliding-window group.
            first_key = 0 if window is None else max(0, state.num_computed_tokens - window + 1)
            for idx in range(first_key // bs, num_needed):
                if row[idx] == NULL_BLOCK_ID:
                    raise ValueError(
                        f"{where}: table entry {idx} is the null block {NULL_BLOCK_ID}, but tokens "
                        f"{idx * bs}..{idx * bs + bs - 1} are read or written this step"
                    )

    def _prepare_inputs(
        self, step: int, order: list[tuple[CachedRequestState, int]]
    ) -> tuple[BatchRecord, PagedAttentionMetadata, Tensor, Tensor]:
        """Flatten the batch into the kernels' inputs (host lists first, then tensors)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        for state, n in order:
            start = state.num_computed_tokens
            input_ids += state.token_ids[start : start + n]
            positions += range(start, start + n)
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            for g, row in enumerate(state.block_ids):
                slots[g] += [row[p // bs] * bs + p % bs for p in range(start, start + n)]
        width = max(len(row) for state, _ in order for row in state.block_ids)
        tables = [[row + [0] * (width - len(row)) for row in (state.block_ids[g] for state, _ in order)] for g in range(self.num_groups)]
        dev = self.device
        meta = PagedAttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mappings=tuple(torch.tensor(s, dtype=torch.int64, device=dev) for s in slots),
            block_tables=tuple(torch.tensor(t, dtype=torch.int32, device=dev) for t in tables),
            layer_to_group=self.layer_to_group,
        )
        batch = BatchRecord(
            step=step,
            req_ids=[s.req_id for s, _ in order],
            num_scheduled_tokens=[n for _, n in order],
            input_ids=input_ids,
            positions=positions,
            cu_seqlens_q=cu,
            seq_lens=seq_lens,
            slot_mappings=slots,
            block_tables=tables,
            logits_indices=[c - 1 for c in cu[1:]],
        )
        return (batch, meta, torch.tensor(input_ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev))

    def _sample(self, logits: Tensor) -> int:
        if self.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
