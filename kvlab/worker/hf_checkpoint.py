"""Load a Hugging Face decoder checkpoint from a directory (or the Hub) into :class:`HFCausalLM`.

A checkpoint directory holds ``config.json`` (the shapes), one or more ``*.safetensors``
files (the tensors; several shards come with ``model.safetensors.index.json``, which says
which file holds which tensor), ``tokenizer.json`` and usually ``tokenizer_config.json``
(special tokens, chat template). Loading is checked before anything big happens: every
tensor the config implies must be there with exactly the shape the config implies (the
error names the tensor and both shapes), and nothing unknown may be left over. Only then are
the tensors read, converted to the dtype the device runs, and assigned to a model built
without initialising its weights.

vLLM: ``vllm/model_executor/model_loader/`` (``default_loader.py``, ``weight_utils.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import kvlab.kernels  # noqa: F401, I001  (first: it sets TRITON_INTERPRET; building on the meta device imports triton)
import torch

from kvlab.worker.hf_config import DTYPES, HFModelConfig
from kvlab.worker.hf_model import HFCausalLM, hf_to_kvlab_name, kvlab_to_hf_name
from kvlab.worker.hf_tokenizer import HFTokenizer

__all__ = ["Checkpoint", "load_checkpoint", "resolve_checkpoint_dir", "check_dtype", "read_config"]

_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the model (weights on ``device``), its tokenizer, where it came from."""

    model: HFCausalLM
    tokenizer: HFTokenizer
    directory: Path

    @property
    def config(self) -> HFModelConfig:
        return self.model.config


def resolve_checkpoint_dir(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local directory as is; a Hub model id (``"Qwen/Qwen3-0.6B"``) downloaded with
    ``huggingface_hub`` (config, safetensors and tokenizer files only)."""
    if not isinstance(path_or_id, (str, os.PathLike)):
        raise TypeError(f"path_or_id must be a directory or a Hub model id (str), got {type(path_or_id).__name__}")
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    text = os.fspath(path_or_id)
    looks_like_id = (
        not p.is_absolute()
        and not text.startswith((".", "~"))
        and text.count("/") <= 1
        and not p.exists()
        and text.strip() == text
        and text != ""
    )
    if not looks_like_id:
        raise FileNotFoundError(f"path_or_id: {text!r} is not a checkpoint directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"path_or_id: {text!r} is not a local directory, and huggingface_hub is not installed "
            "to download it as a model id (pip install huggingface_hub, or pass a directory)"
        ) from None
    return Path(snapshot_download(text, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))


def read_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {directory}: no config.json (a Hugging Face checkpoint directory holds "
            "config.json, *.safetensors and tokenizer.json)"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def check_dtype(dtype: str | torch.dtype | None, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """The dtype the model runs in. ``None``: float32 on CPU; on CUDA the checkpoint's own
    (bfloat16 falls back to float16 on GPUs without bfloat16). The CPU runs float32 only:
    kvlab's CPU path is for checking and learning, and half-precision matmuls on a CPU are
    slow emulations whose rounding differs from the GPU's."""
    names = {v: k for k, v in DTYPES.items()}
    if isinstance(dtype, torch.dtype):
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = names[dtype]
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None (automatic), got {dtype!r}")
    if device.type == "cpu":
        if dtype not in (None, "float32"):
            raise ValueError(
                f"dtype={dtype!r} cannot run on device 'cpu': kvlab runs float32 there "
                "(dtype='float32' or None); half precision needs a CUDA device"
            )
        return torch.float32
    if device.type != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    want = dtype or (checkpoint_dtype if checkpoint_dtype in DTYPES else "float32")
    if want == "bfloat16" and not torch.cuda.is_bf16_supported():
        if dtype == "bfloat16":
            raise ValueError(f"dtype='bfloat16' cannot run on {torch.cuda.get_device_name(device)}; use 'float16' or 'float32'")
        want = "float16"
    return DTYPES[want]


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (from the index, or by opening each file)."""
    from safetensors import safe_open

    index = directory / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = {name: directory / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise FileNotFoundError(f"checkpoint {directory}: {_INDEX} names the shard {f.name!r}, which is missing")
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        other = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" (found {other[:3]}: kvlab reads safetensors only)" if other else ""
        raise FileNotFoundError(f"checkpoint {directory}: no *.safetensors file{hint}")
    files = {}
    for f in shards:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                files[name] = f
    return files


def _shape(file: Path, name: str) -> tuple[int, ...]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as sf:
        if name not in sf.keys():
            raise ValueError(f"checkpoint {file.parent}: {file.name} does not hold {name!r}, which {_INDEX} places there")
        return tuple(sf.get_slice(name).get_shape())


def load_checkpoint(
    path_or_id: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    revision: str | None = None,
) -> Checkpoint:
    """Read, check and load a checkpoint. ``device=None``: CUDA when present, else the CPU."""
    directory = resolve_checkpoint_dir(path_or_id, revision)
    raw = read_config(directory)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu'")
    probe = HFModelConfig.from_dict(raw, dtype=torch.float32, where=str(directory / "config.json"))
    cfg = HFModelConfig.from_dict(raw, dtype=check_dtype(dtype, dev, probe.checkpoint_dtype), where=str(directory / "config.json"))
    tokenizer = HFTokenizer(directory, eos_token_ids=cfg.eos_token_ids, bos_token_id=cfg.bos_token_id)
    files = _weight_files(directory)

    with torch.device("meta"):
        model = HFCausalLM(cfg)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    source: dict[str, str] = {}  # kvlab name -> checkpoint name
    unexpected = []
    for hf_name in files:
        name = hf_to_kvlab_name(hf_name)
        if name is None:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding matrix is the LM head (some checkpoints store a copy)
        if name not in expected:
            unexpected.append(hf_name)
        else:
            source[name] = hf_name
    if unexpected:
        raise ValueError(
            f"checkpoint {directory}: {len(unexpected)} tensor(s) that a {cfg.architecture} with this "
            f"config.json does not have, e.g. {sorted(unexpected)[:3]}"
        )
    missing = [n for n in expected if n not in source]
    if missing:
        hf_names = [kvlab_to_hf_name(n) for n in missing]
        tied = " (config.json says tie_word_embeddings=false)" if "lm_head.weight" in missing else ""
        raise ValueError(
            f"checkpoint {directory}: tensor {hf_names[0]!r} is missing{tied}"
            + (f", and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    for name in expected:  # in the model's order: the first layer's first tensor is named first
        hf_name = source[name]
        got = _shape(files[hf_name], hf_name)
        if got != expected[name]:
            raise ValueError(
                f"checkpoint {directory}: tensor {hf_name!r} in {files[hf_name].name} has shape "
                f"{list(got)}, but config.json implies {list(expected[name])}"
            )

    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, hf_name in source.items():
        by_file.setdefault(files[hf_name], []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in names:
                state[name] = sf.get_tensor(source[name]).to(device=dev, dtype=cfg.dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    return Checkpoint(model=model, tokenizer=tokenizer, directory=directory)
