"""A tiny Llama-style decoder with two forward paths over the same weights.

Why a real model at all? Paged attention is only convincing when it gives *the same
tokens* as plain attention. So the toy model has everything that makes the KV cache
subtle in a real Llama — RoPE at absolute positions (a cached key must have been rotated
for the position it was written at), grouped-query attention (the cache stores only the
KV heads), sliding-window layers (their own KV-cache group, lesson on hybrid models) —
and two ways to run it:

* ``forward_dense``: the whole sequence at once, causal mask, no cache. Obviously right;
  it is the ground truth every paged result is checked against.
* ``forward_paged``: what the :class:`~kvlab.worker.model_runner.ModelRunner` calls. A flat batch of
  new tokens from many requests; each layer writes its keys/values into the paged cache
  (``reshape_and_cache`` through the slot mapping) and reads the whole context back
  through the block table (``unified_attention``).

The weights are random (seeded), so the "text" is gibberish, but deterministic gibberish:
greedy decoding gives a fixed token sequence to compare engines on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvlab.utils.checks import check_int, check_optional_int
from kvlab.worker.tokenizer import ByteTokenizer

__all__ = [
    "TinyLlamaConfig",
    "TinyLlama",
    "PagedAttentionMetadata",
    "PagedKernels",
    "load_kernels",
    "rms_norm",
    "apply_rope",
    "sliding_window_mask",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Shape of the toy model. Defaults are sized so the paged engine stays interactive on a
    2-core CPU running the Triton kernels under the interpreter (see ``kvlab.bench engine``):
    there the cost is per kernel program, i.e. per layer x KV head x sequence, almost
    independent of the widths — hence only 2 layers but a normal-looking head_dim of 32.

    ``sliding_window``/``sliding_window_layers``: the listed layers attend only to the last
    ``sliding_window`` tokens (vLLM semantics: the query at position p sees keys
    p - W + 1 … p). Those layers form a second KV-cache group whose old blocks the manager
    may free, which is the point of the hybrid-model lesson.
    """

    vocab_size: int = ByteTokenizer.vocab_size
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    # Std of the random projections, in units of 1/sqrt(fan_in). >1 makes the residual
    # stream (and so the logits) vary strongly with context, which keeps greedy decoding
    # from collapsing into one repeated token and gives clear top-1 margins.
    init_scale: float = 2.0
    # A random model emits random bytes, mostly non-ASCII: unreadable in block pictures.
    # With this on, compute_logits sets the logit of every token that is not printable
    # ASCII (or newline) to -inf, so generated "text" is readable gibberish. It is part of
    # the model, so dense and paged paths see the same logits.
    output_ascii_only: bool = True
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}): "
                "in grouped-query attention each KV head serves a whole group of query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim = hidden_size / num_heads must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPES))}, got {self.dtype!r}")
        if not isinstance(self.sliding_window_layers, tuple):
            # Coerce lists so the frozen config stays hashable and comparable.
            object.__setattr__(self, "sliding_window_layers", tuple(self.sliding_window_layers))
        w, layers = self.sliding_window, self.sliding_window_layers
        w = check_optional_int("sliding_window", w, 1)
        object.__setattr__(self, "sliding_window", w)
        if (w is None) != (len(layers) == 0):
            raise ValueError(
                "sliding_window and sliding_window_layers go together: set both (the window size and "
                f"which layers use it) or neither; got sliding_window={w!r}, sliding_window_layers={layers!r}"
            )
        layers = tuple(check_int(f"sliding_window_layers[{k}]", i, 0, self.num_layers - 1) for k, i in enumerate(layers))
        if len(set(layers)) != len(layers):
            raise ValueError(f"sliding_window_layers must be distinct layer indices, got {layers!r}")
        object.__setattr__(self, "sliding_window_layers", layers)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer ``layer_idx``, or None for a full-attention layer."""
        return self.sliding_window if layer_idx in self.sliding_window_layers else None


# --------------------------------------------------------------------------- building blocks


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x²) + eps) * weight, over the last dim.

    Computed in float32 whatever the model dtype, as Llama does, so that half-precision
    models do not lose the normalisation to rounding.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[num_tokens, head_dim // 2]`` for the given absolute positions.

    Pair i of a head rotates by angle ``position * theta^(-2i/head_dim)``. Because the angle
    depends only on the absolute position, a key rotated once when it is written to the cache
    stays valid for every later query — this is why a KV cache works with RoPE at all.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate ``x [num_tokens, num_heads, head_dim]`` by its tokens' positions (NeoX layout:
    dimension i is paired with i + head_dim/2, as in Llama's HF/vLLM implementation)."""
    if x.dim() != 3 or positions.shape != (x.shape[0],):
        raise ValueError(
            f"apply_rope wants x [tokens, heads, head_dim] and positions [tokens]; got {tuple(x.shape)} and {tuple(positions.shape)}"
        )
    half = x.shape[-1] // 2
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def sliding_window_mask(num_tokens: int, sliding_window: int | None, device: torch.device | str = "cpu") -> Tensor:
    """Boolean ``[q, k]`` mask, True where query q may attend key k.

    Causal (k <= q) and, with a window W, also k >= q - W + 1: W keys including itself.
    """
    q = torch.arange(num_tokens, device=device)[:, None]
    k = torch.arange(num_tokens, device=device)[None, :]
    mask = k <= q
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


# --------------------------------------------------------------------------- kernels


class PagedKernels(NamedTuple):
    """The two kernels the paged path needs, with the signatures of ``kvlab.kernels``."""

    reshape_and_cache: Callable[..., None]
    unified_attention: Callable[..., Tensor]
    name: str


def load_kernels(backend: str = "triton") -> PagedKernels:
    """Fetch the paged-attention kernels from ``kvlab.kernels``.

    ``"triton"`` is the real thing (compiled on CUDA, interpreted on CPU); ``"reference"``
    is the readable torch version the kernel tests compare against — same interface, so
    swapping them is a one-word change, which is itself a lesson. A kernel that fails to
    import is an error, never a silent switch to the reference: the lesson must run the
    kernel it says it runs.
    """
    if backend not in ("triton", "reference"):
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    if backend == "triton":
        from kvlab.kernels import reshape_and_cache, unified_attention  # picks compiled vs interpreted Triton

        return PagedKernels(reshape_and_cache, unified_attention, "triton")
    from kvlab.kernels.reference import reshape_and_cache_ref, unified_attention_ref

    return PagedKernels(reshape_and_cache_ref, unified_attention_ref, "reference")


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Everything the kernels need for one flat batch, built by the runner on the host.

    Per KV-cache group (group 0: full attention; group 1: sliding-window layers, if any)
    there is one slot mapping and one block table; the sequence boundaries are shared.
    """

    cu_seqlens_q: Tensor  # int32 [num_seqs + 1]: request i's new tokens are rows cu[i]:cu[i+1]
    seq_lens: Tensor  # int32 [num_seqs]: context length after this step (computed + new)
    slot_mappings: tuple[Tensor, ...]  # per group, int64 [num_tokens]: where each new k/v goes
    block_tables: tuple[Tensor, ...]  # per group, int32 [num_seqs, max_blocks], padded with 0
    layer_to_group: tuple[int, ...] = field(default=())  # per layer: which group's tensors it uses


# --------------------------------------------------------------------------- the model


class Attention(nn.Module):
    """GQA attention: num_heads query heads share num_kv_heads key/value heads."""

    def __init__(self, cfg: TinyLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project and rotate: q ``[N, Hq, D]``, k/v ``[N, Hkv, D]``; exactly what gets cached."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return apply_rope(q, positions, self.rope_theta), apply_rope(k, positions, self.rope_theta), v

    def forward_dense(self, x: Tensor, positions: Tensor) -> Tensor:
        q, k, v = self.qkv(x, positions)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = sliding_window_mask(x.shape[0], self.sliding_window, x.device)
        # [heads, tokens, dim] for SDPA; boolean mask: True = may attend.
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=self.scale)
        return self.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1))

    def forward_paged(
        self, x: Tensor, positions: Tensor, kv_cache: Tensor, meta: PagedAttentionMetadata, group: int, kernels: PagedKernels
    ) -> Tensor:
        q, k, v = self.qkv(x, positions)
        key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]  # views into [blocks, 2, bs, Hkv, D]
        # 1) write this step's keys/values into their slots; 2) attend over the whole context,
        # reading the earlier tokens' keys/values back from the blocks the table points to.
        kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mappings[group])
        o = kernels.unified_attention(
            q,
            key_cache,
            value_cache,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables[group],
            self.scale,
            sliding_window=self.sliding_window,
        )
        return self.o_proj(o.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h))."""

    def __init__(self, cfg: TinyLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp = MLP(cfg)

    def _finish(self, h: Tensor, attn_out: Tensor) -> Tensor:
        h = h + attn_out
        return h + self.mlp(rms_norm(h, self.post_attn_norm, self.eps))


class TinyLlama(nn.Module):
    """The toy decoder. ``TinyLlama(config, seed=0)`` always has the same weights."""

    logit_bias: Tensor  # a buffer (register_buffer, below): nn.Module's attribute lookup types it Tensor | Module

    def __init__(self, config: TinyLlamaConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        cfg = TinyLlamaConfig() if config is None else config
        if not isinstance(cfg, TinyLlamaConfig):
            raise TypeError(f"config must be a TinyLlamaConfig, got {type(cfg).__name__}")
        seed = check_int("seed", seed)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        bias = torch.zeros(cfg.vocab_size)
        if cfg.output_ascii_only:
            allowed = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            allowed[0x20:0x7F] = True
            allowed[0x0A] = True
            bias[~allowed] = float("-inf")
        self.register_buffer("logit_bias", bias, persistent=False)
        self._init_weights(seed)
        self.to(cfg.dtype)
        self.requires_grad_(False)  # inference only: no autograd graph, no grad memory
        self.eval()

    def _init_weights(self, seed: int) -> None:
        """Seeded init, independent of torch's global RNG so tests and notebooks agree.

        Embeddings ~ N(0, 1); each Linear ~ N(0, (init_scale / sqrt(fan_in))²). Norm weights
        start at 1, as in a freshly initialised Llama.
        """
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(self.embed_tokens.weight.shape, generator=gen))
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    std = self.config.init_scale / math.sqrt(module.in_features)
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)

    # ----------------------------------------------------------------- shared pieces

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Final norm + LM head (the embedding matrix itself when tied), in float32."""
        h = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float() + self.logit_bias.float()

    def _check_token_ids(self, ids: Tensor, name: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"{name} must be token ids in 0..{self.config.vocab_size - 1}, got values {int(ids.min())}..{int(ids.max())}")

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _decoder_layers(self) -> Iterable[DecoderLayer]:
        """``self.layers``, typed: an nn.ModuleList yields plain Modules to a type checker."""
        return cast("Iterable[DecoderLayer]", self.layers)

    # ----------------------------------------------------------------- dense (ground truth)

    @torch.no_grad()
    def forward_dense(self, token_ids: Sequence[int] | Tensor) -> Tensor:
        """Logits ``[len, vocab]`` (float32) for every position, computed from scratch with a
        causal (and, on window layers, sliding-window) mask. No cache anywhere."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("token_ids must contain at least one token")
        if ids.numel() > self.config.max_position_embeddings:
            raise ValueError(
                f"token_ids has {ids.numel()} tokens; at most max_position_embeddings={self.config.max_position_embeddings} are allowed"
            )
        self._check_token_ids(ids, "token_ids")
        positions = torch.arange(ids.numel(), device=self.device)
        h = self.embed_tokens(ids)
        for layer in self._decoder_layers():
            attn = layer.self_attn.forward_dense(rms_norm(h, layer.input_norm, layer.eps), positions)
            h = layer._finish(h, attn)
        return self.compute_logits(h)

    @torch.no_grad()
    def generate_dense(self, prompt_ids: Sequence[int], max_tokens: int, eos_token_id: int | None = None) -> list[int]:
        """Greedy decoding by re-running ``forward_dense`` on the whole sequence each step.

        Quadratic and slow on purpose: it is the reference the paged engine must match token
        for token. Returns only the generated tokens (stops after ``eos_token_id`` if given).
        """
        max_tokens = check_int("max_tokens", max_tokens, 0)
        seq = [int(t) for t in prompt_ids]
        out: list[int] = []
        for _ in range(max_tokens):
            tok = int(self.forward_dense(seq)[-1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok == eos_token_id:
                break
        return out

    # ----------------------------------------------------------------- paged

    @torch.no_grad()
    def forward_paged(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: Sequence[Tensor],
        meta: PagedAttentionMetadata,
        kernels: PagedKernels,
        layer_hooks: Any = None,
    ) -> Tensor:
        """Hidden states ``[num_tokens, hidden]`` for a flat batch of new tokens.

        ``input_ids``/``positions``: int64 ``[num_tokens]``, requests laid end to end as
        ``meta.cu_seqlens_q`` says. ``kv_caches[l]``: layer l's ``[num_blocks, 2, block_size,
        num_kv_heads, head_dim]`` tensor, updated in place. Call :meth:`compute_logits` on
        the rows you want to sample from. ``layer_hooks``: an object with ``before(i)`` and
        ``after(i, kv_caches[i])``, called around each layer (a KV connector's
        ``wait_for_layer_load`` / ``save_kv_layer``; lessons 12-13).
        """
        cfg = self.config
        if len(kv_caches) != cfg.num_layers:
            raise ValueError(f"kv_caches must hold one tensor per layer ({cfg.num_layers}), got {len(kv_caches)}")
        if len(meta.layer_to_group) != cfg.num_layers:
            raise ValueError(f"meta.layer_to_group must name a group for each of the {cfg.num_layers} layers, got {meta.layer_to_group!r}")
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids and positions must both be [num_tokens]; got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        self._check_token_ids(input_ids, "input_ids")
        h = self.embed_tokens(input_ids)
        for i, (layer, kv, group) in enumerate(zip(self._decoder_layers(), kv_caches, meta.layer_to_group)):
            if layer_hooks is not None:
                layer_hooks.before(i)
            attn = layer.self_attn.forward_paged(rms_norm(h, layer.input_norm, layer.eps), positions, kv, meta, group, kernels)
            if layer_hooks is not None:
                layer_hooks.after(i, kv)
            h = layer._finish(h, attn)
        return h
