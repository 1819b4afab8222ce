"""A Hugging Face checkpoint through kvlab's paged cache (``kvlab.load_model``).

No download: each test writes a tiny checkpoint in exactly the Hub's format (safetensors,
a BPE ``tokenizer.json`` trained on a few sentences, config.json, a chat template) and
loads it through the public path. Whatever the engine does with memory -- prefix hits,
preemption, chunked prefill, sliding-window groups -- the greedy tokens must equal the dense
forward of the same weights; and the dense forward itself must equal an independent
forward written from Hugging Face's formulas on the raw tensors.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvlab
from kvlab import load_model
from kvlab.worker.hf_runner import CheckpointModelRunner
from kvlab.worker.tiny_checkpoint import write_tiny_checkpoint

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]

# name -> write_tiny_checkpoint options: several shapes, each family's own feature.
CHECKPOINTS = {
    # tied embeddings, Llama 3 RoPE scaling, GQA 4:2
    "llama": dict(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # q/k/v biases; layers 1 and 2 slide a 6-token window, layer 0 is full attention
    "qwen2_window": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=48,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2,
        sliding_window=6,
        max_window_layers=1,
        intermediate_size=96,
    ),
    # q/k norm, head_dim 32 != hidden/heads (16), one KV head, linear RoPE scaling
    "qwen3": dict(
        architecture="Qwen3ForCausalLM",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # every layer slides (one KV-cache group), 3 shards with an index, stored in bfloat16, dynamic NTK RoPE
    "mistral_sharded": dict(
        architecture="MistralForCausalLM",
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        sliding_window=8,
        num_shards=3,
        dtype="bfloat16",
        intermediate_size=64,
        rope_scaling={"type": "dynamic", "factor": 2.0},
    ),
}
SYSTEM = "You are a helpful assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {name: write_tiny_checkpoint(root / name, seed=i, **opts) for i, (name, opts) in enumerate(CHECKPOINTS.items())}


@pytest.fixture(scope="module")
def models(ckpt_dirs: dict[str, Path]) -> dict[str, kvlab.LoadedModel]:
    return {name: load_model(d) for name, d in ckpt_dirs.items()}


def chat(m: kvlab.LoadedModel, *questions: str) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": q} for q in questions]
    return m.tokenizer.encode_chat(msgs)


# ---------------------------------------------------------------------------------- loading


def test_each_family_loads_with_its_shapes_and_groups(models: dict[str, kvlab.LoadedModel]) -> None:
    got = {
        name: (
            m.config.architecture,
            m.config.num_layers,
            m.config.num_heads,
            m.config.num_kv_heads,
            m.config.head_dim,
            [getattr(g, "sliding_window", None) for g in m.kv_cache_groups()],
            m.config.sliding_window_layers,
            m.model.lm_head is None,
            m.config.dtype,
        )
        for name, m in models.items()
    }
    assert got == {
        "llama": ("LlamaForCausalLM", 2, 4, 2, 16, [None], (), True, torch.float32),
        "qwen2_window": ("Qwen2ForCausalLM", 3, 6, 2, 8, [None, 6], (1, 2), False, torch.float32),
        "qwen3": ("Qwen3ForCausalLM", 2, 4, 1, 32, [None], (), False, torch.float32),
        "mistral_sharded": ("MistralForCausalLM", 3, 4, 4, 8, [8], (0, 1, 2), False, torch.float32),
    }
    q2 = models["qwen2_window"].model.layers[0].self_attn
    assert q2.q_proj.bias is not None and q2.o_proj.bias is None and q2.q_norm is None
    assert models["qwen3"].model.layers[1].self_attn.k_norm.shape == (32,)
    # bytes per token: 2 (K and V) x layers x KV heads x head_dim x 4 bytes (float32)
    assert {n: m.kv_bytes_per_token for n, m in models.items()} == {
        "llama": 2 * 2 * 2 * 16 * 4,
        "qwen2_window": 2 * 3 * 2 * 8 * 4,
        "qwen3": 2 * 2 * 1 * 32 * 4,
        "mistral_sharded": 2 * 3 * 4 * 8 * 4,
    }
    assert models["llama"].blocks_per_gib(16) == 2**30 // (512 * 16)


def test_the_weights_are_the_files_tensors(ckpt_dirs: dict[str, Path], models: dict[str, kvlab.LoadedModel]) -> None:
    from safetensors.torch import load_file

    d = ckpt_dirs["mistral_sharded"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    raw = load_file(str(d / index["weight_map"]["model.layers.2.self_attn.k_proj.weight"]))
    assert raw["model.layers.2.self_attn.k_proj.weight"].dtype == torch.bfloat16
    loaded = models["mistral_sharded"].model.layers[2].self_attn.k_proj.weight
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded, raw["model.layers.2.self_attn.k_proj.weight"].float())


def test_the_tokenizer_and_chat_template_are_the_checkpoints(models: dict[str, kvlab.LoadedModel]) -> None:
    tok = models["qwen3"].tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block?"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is a block?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode_chat(msgs)
    assert ids[0] == tok._tok.token_to_id("<|im_start|>") and tok.decode(ids) == "system\nBe brief.\nuser\nWhat is a block?\nassistant\n"
    assert tok.decode(tok.encode("The KV cache keeps the keys.")) == "The KV cache keeps the keys."
    assert tok.token_to_text(tok.encode(" the")[0]) == "\u2423the"
    assert tok.eos_token_id == tok._tok.token_to_id("<|im_end|>")
    assert tok.stop_token_ids == [tok.eos_token_id, tok._tok.token_to_id("<|endoftext|>")]


def test_a_hub_id_is_downloaded_with_huggingface_hub(ckpt_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None):  # noqa: ANN001, ANN202
        asked.append((repo_id, revision, sorted(allow_patterns)))
        return str(ckpt_dirs["qwen3"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    m = load_model("someone/tiny-qwen3", revision="main")
    assert asked == [("someone/tiny-qwen3", "main", ["*.jinja", "*.json", "*.safetensors", "tokenizer*"])]
    assert m.directory == ckpt_dirs["qwen3"] and m.config.architecture == "Qwen3ForCausalLM"
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if it were not installed
    with pytest.raises(FileNotFoundError, match="'someone/tiny-qwen3' is not a local directory, and huggingface_hub is not installed"):
        load_model("someone/tiny-qwen3")


def test_without_a_chat_template_the_plain_format_is_used(ckpt_dirs, tmp_path: Path) -> None:
    d = _copy(ckpt_dirs["llama"], tmp_path / "no_template")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_model(d).tokenizer
    assert tok.chat_template is None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == "system: Be brief.\nuser: Hi\nassistant:"
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with str 'role' and 'content'"):
        tok.apply_chat_template([msgs[0], {"role": "user"}])


# ---------------------------------------------------------------------------------- dense == HF formulas


def _hf_reference_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    """Logits written from Hugging Face's modelling code (rotate_half RoPE in float32, repeat_kv,
    eager softmax attention with a causal / sliding mask) on the raw tensors: independent of
    kvlab's model classes."""
    from safetensors.torch import load_file

    cfg = json.loads((directory / "config.json").read_text())
    w: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        w.update({k: v.float() for k, v in load_file(str(f)).items()})
    fam, n = cfg["model_type"], len(ids)
    hq, hkv, d, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    base, scaling = cfg["rope_theta"], cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "dynamic":  # vLLM's fixed base for max_position_embeddings x factor
        f = scaling["factor"]
        base = base * (f * f - (f - 1)) ** (d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    if kind == "linear":
        inv = inv / scaling["factor"]
    if kind == "llama3":
        f, lo, hi, old = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv = torch.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled)
    freqs = torch.arange(n).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]  # [1, n, d]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)

    window = cfg.get("sliding_window") if fam == "mistral" or cfg.get("use_sliding_window") else None
    h = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])

        def proj(name: str, x: torch.Tensor = x, p: str = p) -> torch.Tensor:
            out = x @ w[p + f"self_attn.{name}_proj.weight"].T
            return out + w[p + f"self_attn.{name}_proj.bias"] if p + f"self_attn.{name}_proj.bias" in w else out

        q = proj("q").view(n, hq, d).transpose(0, 1)
        k = proj("k").view(n, hkv, d).transpose(0, 1)
        v = proj("v").view(n, hkv, d).transpose(0, 1)
        if fam == "qwen3":
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
        scores = q @ k.transpose(1, 2) / math.sqrt(d)
        qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
        slides = window is not None and (fam == "mistral" or i >= cfg["max_window_layers"])
        allowed = (ki <= qi) & ((ki > qi - window) if slides else True)
        attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
        h = h + attn.transpose(0, 1).reshape(n, hq * d) @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(h, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_dense_forward_equals_hugging_faces_formulas(name: str, ckpt_dirs, models) -> None:
    m = models[name]
    ids = chat(m, "What is a block? How many tokens fit in the pool?")  # longer than every window
    assert len(ids) > 4 * 8  # several times the longest window: the window masks matter
    ours = m.model.forward_dense(ids)
    ref = _hf_reference_logits(ckpt_dirs[name], ids)
    assert ours.shape == ref.shape == (len(ids), m.config.vocab_size)
    assert torch.allclose(ours, ref, atol=2e-3, rtol=1e-4), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_logits_match_transformers_when_it_is_installed(ckpt_dirs, models) -> None:
    transformers = pytest.importorskip("transformers")
    for name in ("llama", "qwen2_window", "qwen3"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt_dirs[name]), torch_dtype=torch.float32, attn_implementation="eager")
        ids = chat(models[name], "What is a block?")
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0].float()
        assert torch.allclose(models[name].model.forward_dense(ids), theirs, atol=2e-3, rtol=1e-4), name


# ---------------------------------------------------------------------------------- paged == dense


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_paged_greedy_tokens_equal_the_dense_ones_with_a_prefix_hit(name: str, models) -> None:
    m = models[name]
    prompts = [chat(m, "What is a block?"), chat(m, "Why does the cache evict old blocks?")]
    dense = [m.model.generate_dense(p, 8) for p in prompts]
    eng = m.build_engine(num_blocks=64, block_size=4, max_num_batched_tokens=32)
    assert eng.generate(prompts, max_tokens=8) == dense
    # The rendered system turn and "<|im_start|>user\n" are shared: 26 tokens, 6 whole blocks of 4, all hit. The
    # window group (6 tokens) needs only the 2 blocks before the hit's end, and has them.
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert shared == 26
    assert {r: x.num_cached_tokens for r, x in eng.metrics.items()} == {"gen-1": 0, "gen-2": 24}
    assert isinstance(eng.executor, CheckpointModelRunner) and eng.executor.kernels.name == "reference"


def test_a_hit_after_the_first_request_finished_and_chunked_prefill(models) -> None:
    m = models["qwen2_window"]
    first = chat(m, "What is a block?")
    second = first + m.tokenizer.encode("A block holds sixteen tokens.<|im_end|>\n", add_special_tokens=False)
    eng = m.build_engine(num_blocks=48, block_size=4, max_num_batched_tokens=12)
    assert eng.generate([first], max_tokens=6) == [m.model.generate_dense(first, 6)]
    assert eng.generate([second], max_tokens=6) == [m.model.generate_dense(second, 6)]
    # 38 prompt tokens: 9 whole blocks of 4 hit (the 10th also held gen-1's first two outputs, which the second
    # prompt does not repeat), in both groups.
    assert (len(first), len(second), eng.metrics["gen-2"].num_cached_tokens) == (38, 46, 36)


@pytest.mark.parametrize(
    ("name", "caching", "num_blocks", "resume_hit", "computed"),
    [
        # 36-token prompts sharing 26 tokens (3 whole blocks of 8). With caching, 8 usable blocks hold 5 + 2; at step 6
        # (position 40) both need a 6th block, one is free: gen-2 is preempted, and on its return all 5 of its blocks
        # are still cached (40 of its 41 tokens hit), so no token is computed twice: 36 + 11 + 12 + 11 = 70, as
        # without preemption.
        ("llama", True, 9, 40, 70),
        # Without caching, 10 usable blocks hold 5 + 5; gen-2 is preempted at step 6 and recomputes its prompt and its
        # 5 outputs: gen-1 36 + 11, gen-2 36 + 4 before and 41 + 6 after = 134.
        ("qwen3", False, 11, 0, 134),
    ],
)
def test_paged_greedy_tokens_equal_the_dense_ones_under_preemption(name, caching, num_blocks, resume_hit, computed, models) -> None:
    m = models[name]
    prompts = [chat(m, "Why?"), chat(m, "How?")]
    assert [len(p) for p in prompts] == [36, 36]
    eng = m.build_engine(num_blocks=num_blocks, block_size=8, enable_caching=caching)
    out = eng.generate(prompts, max_tokens=12)
    assert out == [m.model.generate_dense(p, 12) for p in prompts]
    assert [(e.step, e.request_id) for e in eng.events if e.kind == "request_preempted"] == [(6, "gen-2")]
    lookups = [(e.step, e.num_hit_tokens) for e in eng.events if e.kind == "prefix_lookup" and e.request_id == "gen-2"]
    assert lookups[:2] == ([(1, 24), (7, resume_hit)] if caching else [])  # no cache, no lookup
    assert eng.executor.num_tokens_computed == computed


def test_an_engine_on_a_loaded_model_records_events_for_the_player(models) -> None:
    m = models["llama"]
    eng = m.build_engine(num_blocks=32, block_size=4)
    ids = chat(m, "Hi")
    eng.generate([ids], max_tokens=2)
    kinds = {e.kind for e in eng.events}
    assert {"blocks_allocated", "attention_batch"} <= kinds
    batch = next(e for e in eng.events if e.kind == "attention_batch")
    # A fresh pool hands out blocks 1, 2, 3, ...: one per 4 prompt tokens, in one full-attention group.
    assert batch.block_tables == [[list(range(1, -(-len(ids) // 4) + 1))]] and batch.sliding_windows == [None]
    assert batch.slot_mappings == [list(range(4, 4 + len(ids)))]  # slot = block id x 4 + offset, from block 1


def test_the_runner_refuses_groups_the_model_does_not_have(models) -> None:
    m = models["mistral_sharded"]
    full = kvlab.FullAttentionSpec()
    with pytest.raises(ValueError, match=r"need exactly \(8,\)"):
        CheckpointModelRunner(m.model, 16, 4, kv_cache_groups=[full, kvlab.SlidingWindowSpec(sliding_window=8)])
    with pytest.raises(TypeError, match="HFCausalLM"):
        CheckpointModelRunner(object(), 16, 4)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- clear errors


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_files_are_named(ckpt_dirs, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="path_or_id: '/no/such/dir' is not a checkpoint directory"):
        load_model("/no/such/dir")
    d = _copy(ckpt_dirs["llama"], tmp_path / "no_config")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(d)
    d = _copy(ckpt_dirs["llama"], tmp_path / "no_tokenizer")
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_model(d)
    d = _copy(ckpt_dirs["llama"], tmp_path / "no_weights")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors file \(found \['pytorch_model.bin'\]"):
        load_model(d)
    d = _copy(ckpt_dirs["mistral_sharded"], tmp_path / "lost_shard")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="names the shard 'model-00002-of-00003.safetensors', which is missing"):
        load_model(d)


def test_an_unsupported_architecture_is_named_with_the_supported_ones(ckpt_dirs, tmp_path: Path) -> None:
    d = _copy(ckpt_dirs["llama"], tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(
        ValueError,
        match=r"architecture 'GPT2LMHeadModel' is not supported; supported architectures: "
        r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        load_model(d)
    (d / "config.json").write_text(json.dumps(dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported; supported: default, linear, dynamic, llama3"):
        load_model(d)


def test_a_config_that_does_not_fit_the_weights_names_the_tensor_and_both_shapes(ckpt_dirs, tmp_path: Path) -> None:
    d = _copy(ckpt_dirs["qwen2_window"], tmp_path / "wider")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=100)))
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.0.mlp.(gate|up)_proj.weight' in model.safetensors has "
        r"shape \[96, 48\], but config.json implies \[100, 48\]",
    ):
        load_model(d)
    (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=4)))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.3.input_layernorm.weight' is missing, and 11 more"):
        load_model(d)
    (d / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))  # then lm_head is ignored
    assert load_model(d).model.lm_head is None
    d = _copy(ckpt_dirs["llama"], tmp_path / "untied")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    with pytest.raises(ValueError, match=r"tensor 'lm_head.weight' is missing \(config.json says tie_word_embeddings=false\)"):
        load_model(d)


def test_a_dtype_the_device_cannot_run_is_refused(ckpt_dirs) -> None:
    with pytest.raises(ValueError, match=r"dtype='float16' cannot run on device 'cpu': kvlab runs float32 there"):
        load_model(ckpt_dirs["llama"], dtype="float16", device="cpu")
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\] or None"):
        load_model(ckpt_dirs["llama"], dtype="float8", device="cpu")
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda', got 'mps'"):
        load_model(ckpt_dirs["llama"], device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' but no CUDA device is available"):
            load_model(ckpt_dirs["llama"], device="cuda")


def test_importing_kvlab_stays_cheap() -> None:
    code = (
        "import sys, kvlab; assert 'load_model' in kvlab.__all__ and 'LoadedModel' in kvlab.__all__;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors', 'tokenizers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------------------------- a real model (make gpu-check)


@pytest.mark.gpu
@pytest.mark.skipif(
    not os.environ.get("KVLAB_MODEL") or not torch.cuda.is_available(),
    reason="needs KVLAB_MODEL=<checkpoint dir or Hub id> and a CUDA device",
)
def test_a_real_model_on_the_gpu_gives_the_dense_tokens_through_the_paged_cache() -> None:
    m = load_model(os.environ["KVLAB_MODEL"], dtype="float32")
    eng = m.build_engine(num_blocks=256, block_size=16)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]
    ids = m.tokenizer.encode_chat(msgs)
    out = eng.generate([ids, ids], max_tokens=16)
    assert out[0] == out[1] == m.model.generate_dense(ids, 16)
    assert eng.metrics["gen-2"].num_cached_tokens == (len(ids) - 1) // 16 * 16
    print(repr(m), "->", repr(m.tokenizer.decode(out[0])))
