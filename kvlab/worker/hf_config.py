"""A Hugging Face ``config.json`` read into the shape kvlab's model runner understands.

The runner needs a handful of numbers to lay out the paged cache — layers, KV heads, head
size, dtype, and which layers attend through a sliding window (those layers form their own
KV-cache group, lesson 07). :class:`HFModelConfig` is a :class:`TinyLlamaConfig` with the
extra knobs of the supported families, so a loaded checkpoint plugs into
:class:`~kvlab.worker.model_runner.ModelRunner` exactly where the toy model does:

* Llama (``LlamaForCausalLM``): RoPE with its scaling variants, grouped-query attention;
* Mistral (``MistralForCausalLM``): Llama plus a sliding window on every layer (when set);
* Qwen2 (``Qwen2ForCausalLM``): biases on the q/k/v projections; sliding windows on the
  layers from ``max_window_layers`` on, when ``use_sliding_window`` is true;
* Qwen3 (``Qwen3ForCausalLM``): an RMSNorm over each head of q and k (``q_norm``/``k_norm``)
  before RoPE, and an explicit ``head_dim``.

vLLM: ``vllm/transformers_utils/config.py`` and the model classes in
``vllm/model_executor/models/`` (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``mistral``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.utils.checks import check_int, check_optional_int
from kvlab.worker.model import TinyLlamaConfig

__all__ = ["HFModelConfig", "SUPPORTED_ARCHITECTURES", "ROPE_TYPES", "DTYPES", "rope_inv_freq"]

#: Architecture name in ``config.json`` -> model family.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
#: ``rope_scaling.rope_type`` values kvlab implements.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
#: dtype names accepted from ``config.json`` (``torch_dtype``/``dtype``) and from the caller.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class HFModelConfig(TinyLlamaConfig):
    """The toy model's config plus what a real checkpoint adds.

    ``head_dim`` is a field here (Qwen3 and Mistral give it explicitly; it need not be
    ``hidden_size / num_heads``); 0 means "derive it". ``rope_scaling`` is the checkpoint's
    dict as sorted ``(key, value)`` pairs, so the frozen config stays hashable.
    """

    head_dim: int = 0  # shadows TinyLlamaConfig.head_dim (a property there)
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    checkpoint_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    output_ascii_only: bool = False

    def __post_init__(self) -> None:  # the parent's checks, minus "hidden_size % num_heads"
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            object.__setattr__(self, name, check_int(f"config.{name}", getattr(self, name), 1))
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"config.json: hidden_size ({self.hidden_size}) is not divisible by "
                    f"num_attention_heads ({self.num_heads}) and no head_dim is given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        object.__setattr__(self, "head_dim", check_int("config.head_dim", self.head_dim, 2))
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"config.json: rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config.json: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported(self.architecture))
        object.__setattr__(self, "sliding_window_layers", tuple(self.sliding_window_layers))
        w = check_optional_int("config.sliding_window", self.sliding_window, 1)
        object.__setattr__(self, "sliding_window", w)
        layers = self.sliding_window_layers
        if (w is None) != (len(layers) == 0):
            raise ValueError(f"sliding_window={w!r} and sliding_window_layers={layers!r} must be set together")
        for i in layers:
            check_int("sliding_window_layers[]", i, 0, self.num_layers - 1)
        rope_inv_freq(self)  # refuses an unsupported rope_type now, not at the first forward

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rope_type(self) -> str:
        d = dict(self.rope_scaling)
        return str(d.get("rope_type", d.get("type", "default")))

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across every layer: 2 x layers x KV heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], *, dtype: torch.dtype, where: str = "config.json") -> HFModelConfig:
        """Read a parsed ``config.json``; ``dtype`` is the dtype the model will run in."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch is None:  # some configs name only the model_type
            arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}.get(
                cfg.get("model_type", ""), f"model_type={cfg.get('model_type')!r}"
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{where}: " + _unsupported(arch))
        family = SUPPORTED_ARCHITECTURES[arch]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act must be 'silu' (SwiGLU MLP) for {arch}, got {act!r}")

        def need(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"{where}: the key {key!r} is missing (needed for {arch})")
            return cfg[key]

        rope = dict(cfg.get("rope_parameters") or {})  # newer transformers keep theta in here
        theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        scaling = dict(cfg.get("rope_scaling") or rope)
        if scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = {}
        num_layers = need("num_hidden_layers")
        window, window_layers = _sliding_layers(cfg, family, num_layers, where)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=num_layers,
            num_heads=need("num_attention_heads"),
            num_kv_heads=cfg.get("num_key_value_heads") or need("num_attention_heads"),
            intermediate_size=need("intermediate_size"),
            head_dim=cfg.get("head_dim") or 0,
            rope_theta=float(theta),
            rope_scaling=tuple(sorted((str(k), _freeze(v)) for k, v in scaling.items())),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v projections always carry a bias (its config has no switch for it).
            attention_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=window,
            sliding_window_layers=window_layers,
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=cfg.get("bos_token_id"),
            dtype=dtype,
        )


def _unsupported(arch: object) -> str:
    return f"architecture {arch!r} is not supported; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _sliding_layers(cfg: Mapping[str, Any], family: str, num_layers: int, where: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, layers that use it), following Hugging Face's rules for each family.

    ``layer_types`` (newer configs) names each layer ``"full_attention"`` or
    ``"sliding_attention"``. Without it: Mistral slides on every layer when
    ``sliding_window`` is set; Qwen2/Qwen3 slide only with ``use_sliding_window``, on layers
    ``max_window_layers`` and up. Llama has no sliding window.
    """
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if family == "llama" and "layer_types" not in cfg:
        window = None
    if window is None:
        return None, ()
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
        bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if bad:
            raise ValueError(f"{where}: layer_types {bad} not supported; allowed: 'full_attention', 'sliding_attention'")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif family == "mistral":
        layers = tuple(range(num_layers))
    else:
        start = cfg.get("max_window_layers", num_layers)
        layers = tuple(range(start, num_layers))
    return (int(window), layers) if layers else (None, ())


def rope_inv_freq(cfg: HFModelConfig) -> torch.Tensor:
    """Rotation frequencies (float64, ``[head_dim / 2]``) with the checkpoint's RoPE scaling.

    * ``default``: ``theta ** (-2i / head_dim)``;
    * ``linear``: every frequency divided by ``factor`` (positions stretched);
    * ``dynamic`` (NTK-aware): a larger base, fixed for the longest context
      ``max_position_embeddings x factor``, as vLLM computes it. (Hugging Face rescales the
      base with the current sequence length, which a KV cache cannot follow: keys cached
      under one base would be read under another.)
    * ``llama3``: long wavelengths divided by ``factor``, short ones kept, a smooth blend
      between ``low_freq_factor`` and ``high_freq_factor``.
    """
    d = dict(cfg.rope_scaling)
    kind = cfg.rope_type
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json: rope_scaling rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    dim, base = cfg.head_dim, cfg.rope_theta
    factor = float(d.get("factor", 1.0))
    if kind != "default" and not factor > 0:
        raise ValueError(f"config.json: rope_scaling.factor must be > 0, got {d.get('factor')!r}")
    if kind == "dynamic":
        max_pos = cfg.max_position_embeddings
        max_len = max_pos * factor
        base = base * ((factor * max_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if kind == "linear":
        inv = inv / factor
    elif kind == "llama3":
        try:
            low, high = float(d["low_freq_factor"]), float(d["high_freq_factor"])
            old_len = float(d["original_max_position_embeddings"])
        except KeyError as e:
            raise ValueError(f"config.json: rope_scaling of type 'llama3' needs {e.args[0]!r}") from None
        if not high > low:
            raise ValueError(f"config.json: rope_scaling needs high_freq_factor > low_freq_factor, got {high} and {low}")
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = torch.where(medium, blended, scaled)
    return inv
