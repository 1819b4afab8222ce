"""A Llama / Mistral / Qwen2 / Qwen3 decoder with a checkpoint's shapes, on kvlab's two paths.

:class:`HFCausalLM` is a :class:`~kvlab.worker.model.TinyLlama` whose layers take their
shapes from a checkpoint's config instead of the toy defaults. It keeps the toy model's
two forward paths unchanged — ``forward_dense`` (the whole sequence, a causal mask, no
cache: the ground truth) and ``forward_paged`` (each layer writes its K/V through the slot
mapping and reads the context back through the block table) — so the model runner, the
scheduler and the block tables treat it exactly like the toy model. What differs between
the families lives in one method, :meth:`HFAttention.qkv`: projection biases (Qwen2), a
per-head RMSNorm of q and k (Qwen3), RoPE with a scaled frequency table (Llama 3 and
others). Keys leave ``qkv`` already rotated; that is what the paged cache stores.

The modules are built without initialising weights (on PyTorch's ``meta`` device) and then
take the checkpoint's tensors (:mod:`kvlab.worker.hf_checkpoint`): a 500M-parameter model is
not first filled with random numbers it would throw away.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvlab.worker.hf_config import HFModelConfig, rope_inv_freq
from kvlab.worker.model import MLP, Attention, DecoderLayer, TinyLlama, rms_norm

__all__ = ["HFCausalLM", "HFAttention", "hf_to_kvlab_name", "kvlab_to_hf_name"]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the NeoX / Hugging Face layout: dimension i pairs with i + head_dim/2."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class HFAttention(Attention):
    """Grouped-query attention with the checkpoint's options. ``forward_dense`` and
    ``forward_paged`` are the toy model's (they call :meth:`qkv`)."""

    def __init__(self, cfg: HFModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)  # Attention.__init__ would build the toy model's shapes
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.eps = cfg.rms_norm_eps
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias and cfg.family != "qwen2")
        self.q_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        # A plain attribute, not a buffer: it stays float64 on the host whatever the weights do.
        self.inv_freq = rope_inv_freq(cfg)

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: normalise each head before rotating it
            assert self.k_norm is not None  # q_norm and k_norm are made together (cfg.qk_norm)
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        angles = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v


class HFMLP(MLP):
    """SwiGLU with the checkpoint's widths (``forward`` is the toy model's)."""

    def __init__(self, cfg: HFModelConfig) -> None:
        nn.Module.__init__(self)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)


class HFDecoderLayer(DecoderLayer):
    """Pre-norm block, as the toy model's (``_finish`` is shared)."""

    def __init__(self, cfg: HFModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.eps = cfg.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.self_attn = HFAttention(cfg, layer_idx)
        self.post_attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp = HFMLP(cfg)


class HFCausalLM(TinyLlama):
    """A checkpoint's decoder. Build it with :func:`kvlab.worker.hf_checkpoint.load_checkpoint`
    (or ``kvlab.load_model``); constructed directly it has uninitialised (meta) weights."""

    config: HFModelConfig

    def __init__(self, config: HFModelConfig) -> None:
        nn.Module.__init__(self)  # TinyLlama.__init__ would draw random weights
        if not isinstance(config, HFModelConfig):
            raise TypeError(f"config must be an HFModelConfig, got {type(config).__name__}")
        cfg = config
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HFDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Final norm + LM head (the embedding matrix when tied), in float32. No logit bias:
        a real model's vocabulary is all text."""
        h = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


_RENAMES = (
    (".input_layernorm.weight", ".input_norm"),
    (".post_attention_layernorm.weight", ".post_attn_norm"),
    (".self_attn.q_norm.weight", ".self_attn.q_norm"),
    (".self_attn.k_norm.weight", ".self_attn.k_norm"),
)


def hf_to_kvlab_name(name: str) -> str | None:
    """The parameter of :class:`HFCausalLM` that a Hugging Face tensor name loads into
    (None for tensors kvlab does not use, e.g. a stored ``rotary_emb.inv_freq``)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name.startswith("model."):
        name = name[len("model.") :]
    for old, new in _RENAMES:
        if name.endswith(old):
            return name[: -len(old)] + new
    if name == "norm.weight":
        return "norm"
    return name


def kvlab_to_hf_name(name: str) -> str:
    """The Hugging Face name of a parameter of :class:`HFCausalLM` (inverse of :func:`hf_to_kvlab_name`)."""
    if name.startswith("lm_head."):
        return name
    if name == "norm":
        return "model.norm.weight"
    for old, new in _RENAMES:
        if name.endswith(new):
            return "model." + name[: -len(new)] + old
    return "model." + name
