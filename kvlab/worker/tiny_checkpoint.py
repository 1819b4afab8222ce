"""Write a tiny Hugging Face checkpoint to disk: random weights, a real BPE tokenizer.

Tests and lesson 15 need a checkpoint without a download. :func:`write_tiny_checkpoint`
writes one in exactly the format a Hub model has — ``config.json``, ``model.safetensors``
(or shards with ``model.safetensors.index.json``), ``tokenizer.json`` (a byte-level BPE
trained here on a few sentences, its alphabet printable ASCII), ``tokenizer_config.json`` with a ChatML chat template,
``generation_config.json`` — so it travels the same loading path as a real model. The
weights are seeded random numbers: the text it writes is word salad, but the same word
salad on every machine, which is what a checked lesson needs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from kvlab.utils.checks import check_int
from kvlab.worker.hf_config import DTYPES, SUPPORTED_ARCHITECTURES

__all__ = ["write_tiny_checkpoint", "TINY_CORPUS", "CHATML_TEMPLATE"]

TINY_CORPUS = (
    "The KV cache keeps the keys and values of every token the model has read.",
    "A block holds the keys and values of sixteen tokens, and a block table lists the blocks of a request.",
    "When two prompts share a prefix, the second one reads the first one's blocks from the cache.",
    "You are a helpful assistant. Answer in one short sentence.",
    "What is a block? How many tokens fit in the pool? Why does the cache evict old blocks?",
    "Thank you! Tell me more about prefix caching, please.",
    "The scheduler decides which requests run; the model runner computes their tokens.",
    # Every character the tiny vocabulary knows, apart so that they form no merges of their own.
    " ".join("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"()[]{}<>/\\|-_+=*&%$#@^~`") + "\n\t",
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _train_tokenizer(vocab_size: int):  # noqa: ANN202
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The alphabet is the corpus's characters only (printable ASCII, newline, tab), not all 256 bytes: a model
    # with random weights then writes readable word salad, never half of a UTF-8 character.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(_SPECIALS), show_progress=False)
    tok.train_from_iterator(list(TINY_CORPUS), trainer=trainer)
    return tok


def _tensors(cfg: dict[str, Any], family: str, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded random weights with Hugging Face names. Projections ~ N(0, (2/sqrt(fan_in))²):
    large enough that the logits depend strongly on the context (clear greedy margins)."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) * (2.0 / in_f**0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=gen)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = lin(hq * d, h)
        t[p + "self_attn.k_proj.weight"] = lin(hkv * d, h)
        t[p + "self_attn.v_proj.weight"] = lin(hkv * d, h)
        t[p + "self_attn.o_proj.weight"] = lin(h, hq * d)
        if family == "qwen2":
            for name, n in (("q", hq * d), ("k", hkv * d), ("v", hkv * d)):
                t[p + f"self_attn.{name}_proj.bias"] = 0.5 * torch.randn(n, generator=gen)
        if family == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(d)
            t[p + "self_attn.k_norm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "mlp.gate_proj.weight"] = lin(inter, h)
        t[p + "mlp.up_proj.weight"] = lin(inter, h)
        t[p + "mlp.down_proj.weight"] = lin(h, inter)
    t["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = lin(v, h)
    return {k: x.to(dtype).contiguous() for k, x in t.items()}


def write_tiny_checkpoint(
    directory: str | os.PathLike,
    *,
    architecture: str = "Qwen2ForCausalLM",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    sliding_window: int | None = None,
    max_window_layers: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    num_shards: int = 1,
    dtype: str = "float32",
    tokenizer_vocab_size: int = 400,
    seed: int = 0,
) -> Path:
    """Write a tiny checkpoint into ``directory`` (created if needed); return its path.

    ``sliding_window``: Mistral slides on every layer; Qwen2/Qwen3 on the layers from
    ``max_window_layers`` on (default: half of them), as their configs say. ``num_shards`` > 1
    splits the tensors over several files with an index, like large Hub checkpoints.
    """
    from safetensors.torch import save_file

    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(SUPPORTED_ARCHITECTURES)}, got {architecture!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    num_shards = check_int("num_shards", num_shards, 1)
    family = SUPPORTED_ARCHITECTURES[architecture]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(check_int("tokenizer_vocab_size", tokenizer_vocab_size, 300))
    tok.save(str(out / "tokenizer.json"))
    eos_id, bos_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": family,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if family == "mistral":
        cfg["sliding_window"] = sliding_window
    elif family in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = sliding_window is not None
        cfg["sliding_window"] = sliding_window
        cfg["max_window_layers"] = num_layers // 2 if max_window_layers is None else max_window_layers
    elif sliding_window is not None:
        raise ValueError(f"sliding_window: {architecture} has no sliding-window layers")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id, bos_id]}, indent=2) + "\n", encoding="utf-8")
    tensors = _tensors(cfg, family, torch.Generator().manual_seed(seed), DTYPES[dtype])
    meta = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return out
    names = list(tensors)
    weight_map = {}
    for s in range(num_shards):
        part = names[s::num_shards]
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n", encoding="utf-8"
    )
    return out
