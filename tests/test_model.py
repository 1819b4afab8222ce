"""The toy model and the byte tokenizer: shapes, determinism, hand-checked building blocks,
and a dense forward whose sliding-window layers match an explicit masked computation."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.worker.model import (
    TinyLlama,
    TinyLlamaConfig,
    apply_rope,
    rms_norm,
    rope_cos_sin,
    sliding_window_mask,
)
from kvlab.worker.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, ByteTokenizer

# Tiny ops: one thread is much faster than two fighting over 2 shared cores.
torch.set_num_threads(1)

SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
PROMPT = list(b"The KV cache keeps yesterday's keys.")


@pytest.fixture(scope="module")
def default_model() -> TinyLlama:
    return TinyLlama(seed=0)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials() -> None:
    tok = ByteTokenizer()
    text = "héllo\twörld\n"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == BOS_TOKEN_ID and all(0 <= i < 256 for i in ids[1:])
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([*ids, EOS_TOKEN_ID], skip_special_tokens=False) == "<bos>" + text + "<eos>"
    assert tok.vocab_size == 259


def test_token_to_text_is_printable() -> None:
    tok = ByteTokenizer()
    assert tok.token_to_text(ord(" ")) == "\u2423"
    assert tok.token_to_text(ord("\n")) == "\\n"
    assert tok.token_to_text(ord("a")) == "a"
    assert tok.token_to_text(0x07) == "\\x07"
    assert tok.token_to_text(0xC3) == "\\xc3"  # half of a multi-byte character
    assert tok.token_to_text(EOS_TOKEN_ID) == "<eos>"
    assert all(s.isprintable() and s for s in tok.tokens_to_texts(range(tok.vocab_size)))


@pytest.mark.parametrize("bad", [-1, 259, 10_000])
def test_tokenizer_rejects_bad_ids(bad: int) -> None:
    with pytest.raises(ValueError, match="0..258"):
        ByteTokenizer().token_to_text(bad)
    with pytest.raises(ValueError, match="out of range"):
        ByteTokenizer().decode([65, bad])


def test_tokenizer_rejects_wrong_types() -> None:
    with pytest.raises(TypeError):
        ByteTokenizer().encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ByteTokenizer().decode([1.5])  # type: ignore[list-item]


# ----------------------------------------------------------------------------- building blocks


def test_rms_norm_by_hand() -> None:
    x = torch.tensor([[3.0, 4.0]])
    rms = math.sqrt((9 + 16) / 2)
    out = rms_norm(x, torch.tensor([1.0, 2.0]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[3 / rms, 2 * 4 / rms]]))


def test_rope_by_hand() -> None:
    # head_dim 4: pair 0 = dims (0, 2) turns by p * 1, pair 1 = dims (1, 3) by p / 100.
    x = torch.eye(4)[:2].reshape(2, 1, 4)  # token 0: e0, token 1: e1
    positions = torch.tensor([1, 3])
    out = apply_rope(x, positions, theta=10_000.0)
    torch.testing.assert_close(out[0, 0], torch.tensor([math.cos(1), 0.0, math.sin(1), 0.0]))
    torch.testing.assert_close(out[1, 0], torch.tensor([0.0, math.cos(0.03), 0.0, math.sin(0.03)]))
    # Position 0 is the identity.
    torch.testing.assert_close(apply_rope(x, torch.tensor([0, 0]), 10_000.0), x)
    cos, sin = rope_cos_sin(torch.tensor([2]), 4, 10_000.0)
    torch.testing.assert_close(cos, torch.tensor([[math.cos(2), math.cos(0.02)]]))


def test_rope_scores_depend_only_on_relative_position() -> None:
    """Why RoPE and a KV cache get along: q(p)·k(p') is a function of p - p' only."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 32, generator=gen), torch.randn(1, 1, 32, generator=gen)

    def score(pq: int, pk: int) -> torch.Tensor:
        return (apply_rope(q, torch.tensor([pq]), 1e4) * apply_rope(k, torch.tensor([pk]), 1e4)).sum()

    torch.testing.assert_close(score(7, 3), score(107, 103), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(7, 3), score(7, 5))


def test_sliding_window_mask() -> None:
    m = sliding_window_mask(5, 2)
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)
    assert torch.equal(sliding_window_mask(4, None), torch.ones(4, 4, dtype=torch.bool).tril())


# ----------------------------------------------------------------------------- the model


def test_shapes_and_dtype(default_model: TinyLlama) -> None:
    cfg = default_model.config
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (128, 4, 2, 32)
    assert len(default_model.layers) == cfg.num_layers == 2
    logits = default_model.forward_dense(PROMPT)
    assert logits.shape == (len(PROMPT), cfg.vocab_size) and logits.dtype == torch.float32


def test_seeded_determinism() -> None:
    a, b, c = TinyLlama(SMALL, seed=3), TinyLlama(SMALL, seed=3), TinyLlama(SMALL, seed=4)
    assert torch.equal(a.forward_dense(PROMPT), b.forward_dense(PROMPT))
    assert not torch.equal(a.forward_dense(PROMPT), c.forward_dense(PROMPT))
    # Independent of torch's global RNG.
    torch.manual_seed(123)
    assert torch.equal(TinyLlama(SMALL, seed=3).forward_dense(PROMPT), a.forward_dense(PROMPT))


def test_causality(default_model: TinyLlama) -> None:
    """Changing a later token never changes earlier logits."""
    full = default_model.forward_dense(PROMPT)
    changed = default_model.forward_dense(PROMPT[:-3] + [ord("!")] * 3)
    torch.testing.assert_close(full[:-3], changed[:-3])


def test_tied_embeddings_share_the_matrix() -> None:
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, num_layers=1, intermediate_size=64, tie_word_embeddings=True))
    assert model.lm_head is None
    assert model.forward_dense(PROMPT).shape == (len(PROMPT), 259)


def _manual_layer(model: TinyLlama, layer_idx: int, h: torch.Tensor) -> torch.Tensor:
    """One decoder layer written out with Python loops over queries and allowed keys."""
    cfg = model.config
    layer = model.layers[layer_idx]
    attn = layer.self_attn
    n = h.shape[0]
    pos = torch.arange(n)
    x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
    q, k, v = attn.qkv(x, pos)
    window = cfg.layer_sliding_window(layer_idx)
    group = cfg.num_heads // cfg.num_kv_heads
    out = torch.zeros(n, cfg.num_heads, cfg.head_dim)
    for p in range(n):
        lo = 0 if window is None else max(0, p - window + 1)
        for head in range(cfg.num_heads):
            kv_head = head // group
            scores = torch.stack([q[p, head] @ k[j, kv_head] for j in range(lo, p + 1)]) / math.sqrt(cfg.head_dim)
            probs = torch.softmax(scores, dim=0)
            out[p, head] = sum(probs[i] * v[lo + i, kv_head] for i in range(len(probs)))
    h = h + attn.o_proj(out.reshape(n, -1))
    return h + layer.mlp(rms_norm(h, layer.post_attn_norm, cfg.rms_norm_eps))


def test_dense_forward_with_sliding_window_matches_manual_masking() -> None:
    cfg = TinyLlamaConfig(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, sliding_window=3, sliding_window_layers=(1,)
    )
    model = TinyLlama(cfg, seed=5)
    ids = PROMPT[:10]
    h = model.embed_tokens(torch.tensor(ids))
    for i in range(cfg.num_layers):
        h = _manual_layer(model, i, h)
    manual = model.compute_logits(h)
    torch.testing.assert_close(model.forward_dense(ids), manual, rtol=1e-4, atol=1e-4)
    # The window really matters: without it, layer 1 sees more and the logits change.
    no_window = TinyLlama(TinyLlamaConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64), seed=5)
    assert not torch.allclose(no_window.forward_dense(ids)[5:], manual[5:], atol=1e-3)


def test_greedy_output_is_not_degenerate(default_model: TinyLlama) -> None:
    """Random weights often collapse into 'aaaa…'; the init scale is chosen so they do not."""
    for prompt in (PROMPT, list(b"a"), list(b"1 2 3 4 5 6 7 8")):
        out = default_model.generate_dense(prompt, 32)
        assert len(out) == 32
        assert len(set(out)) >= 8, out
        tail = out[16:]
        assert tail != tail[:2] * 8 and tail != tail[:1] * 16, out  # no period-1/2 loop
        # output_ascii_only: every generated byte is printable ASCII or a newline.
        assert all(t == 10 or 32 <= t < 127 for t in out)


def test_generate_dense_stops_at_eos(default_model: TinyLlama) -> None:
    out = default_model.generate_dense(PROMPT, 8)
    stopped = default_model.generate_dense(PROMPT, 8, eos_token_id=out[2])
    assert stopped == out[: out.index(out[2]) + 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(hidden_size=130), "divisible by num_heads"),
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(hidden_size=12, num_heads=4, num_kv_heads=2), "even"),
        (dict(sliding_window=0, sliding_window_layers=(0,)), "sliding_window must be"),
        (dict(sliding_window=16), "go together"),
        (dict(sliding_window_layers=(1,)), "go together"),
        (dict(sliding_window=16, sliding_window_layers=(2,)), "0..1"),
        (dict(sliding_window=16, sliding_window_layers=(1, 1)), "distinct"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(dtype=torch.int32), "dtype"),
    ],
)
def test_bad_config_raises(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TinyLlamaConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=True), "num_layers"),
        (dict(hidden_size=128.0), "hidden_size"),
        (dict(sliding_window=16.5, sliding_window_layers=(0,)), "sliding_window"),
    ],
)
def test_bad_config_types_raise_type_error(kwargs: dict, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        TinyLlamaConfig(**kwargs)


def test_bad_inputs_raise(default_model: TinyLlama) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        default_model.forward_dense([])
    with pytest.raises(ValueError, match="0..258"):
        default_model.forward_dense([1, 300])
    with pytest.raises(ValueError, match="max_tokens"):
        default_model.generate_dense(PROMPT, -1)
    with pytest.raises(TypeError, match="TinyLlamaConfig"):
        TinyLlama({"hidden_size": 64})  # type: ignore[arg-type]


def test_list_of_window_layers_is_coerced_to_tuple() -> None:
    cfg = TinyLlamaConfig(num_layers=3, sliding_window=8, sliding_window_layers=[0, 2])  # type: ignore[arg-type]
    assert cfg.sliding_window_layers == (0, 2)
    assert cfg.layer_sliding_window(2) == 8 and cfg.layer_sliding_window(1) is None
    hash(cfg)


def test_load_kernels_never_falls_back_to_the_reference_silently(monkeypatch) -> None:
    from kvlab.worker.model import load_kernels
    import kvlab.kernels as kernels_pkg

    assert load_kernels("triton").name == "triton" and load_kernels("reference").name == "reference"
    monkeypatch.delattr(kernels_pkg, "unified_attention")  # a kernel module that failed to export
    with pytest.raises(ImportError, match="unified_attention"):
        load_kernels("triton")
    with pytest.raises(ValueError, match="backend"):
        load_kernels("cuda")
