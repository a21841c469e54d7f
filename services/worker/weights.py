"""The model's weights for services/worker/model.py, under llama.cpp's tensor names.

A GGUF is dequantized to float32 once and cached as safetensors for fast starts. llama.cpp's
converter permutes the rows of Q and K (Llama, Mistral) so that its rotary kernel can rotate
interleaved pairs; the model here uses the rotate-half form of Hugging Face, so the permutation
is undone once, at conversion time.

A checkpoint directory's safetensors are memory-mapped and read one tensor at a time as the
model asks for it (CheckpointWeights), each converted to the serving dtype and device at once,
so at most one tensor exists twice at a time: no second full copy of the weights.
"""

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shared.model_file import ARCHITECTURES, ModelConfig, ModelFileError, ModelMetadata

log = logging.getLogger("iterserve.worker")

WEIGHTS_FILE = "weights.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Hugging Face names -> llama.cpp's (the names services/worker/model.py reads).
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
LAYER_PATTERN = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str) -> str | None:
    """The llama.cpp name of a checkpoint tensor; None for tensors the model does not use
    (rotary caches some checkpoints store)."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    match = LAYER_PATTERN.fullmatch(hf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"blk.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
    return None


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """A checkpoint directory's tensors under llama.cpp's names, read from the memory-mapped
    safetensors shard that holds each when asked for (one or many shards, with or without
    model.safetensors.index.json)."""

    def __init__(self, directory: Path) -> None:
        index = directory / INDEX_FILE
        if index.is_file():
            shard_of = json.loads(index.read_text())["weight_map"]
        else:
            shard_of = {}
            for shard in sorted(directory.glob("*.safetensors")):
                with safe_open(str(shard), framework="pt") as handle:
                    shard_of |= dict.fromkeys(handle.keys(), shard.name)
        self._location = {name: (directory / shard, hf_name)
                          for hf_name, shard in shard_of.items() if (name := gguf_name(hf_name)) is not None}
        self._handles: dict[Path, object] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        path, hf_name = self._location[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(hf_name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._location)

    def __len__(self) -> int:
        return len(self._location)


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (heads x half x 2 back to heads x 2 x half)."""
    rows, columns = weight.shape
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, columns).swapaxes(1, 2).reshape(rows, columns)


def convert_gguf(path: str, config: ModelConfig, keep_packed: tuple[str, ...] = ()) -> dict:
    """Dequantize every tensor to float32, names as in the GGUF, Q/K rows un-permuted where the
    converter permuted them; the 2-D tensors of a type in keep_packed (`--quantization gguf`:
    services/worker/quantized.py PACKED_TYPES) instead kept as they are in the file, unpacked to
    int4 parts (QuantizedTensor), their rows un-permuted alike."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from services.worker.quantized import rows_permuted, unpack

    permuted = ARCHITECTURES[config.architecture].gguf_rotary_permuted
    tensors: dict = {}
    for tensor in GGUFReader(path).tensors:
        shape = [int(dim) for dim in reversed(tensor.shape)]
        heads = (config.n_heads if tensor.name.endswith("attn_q.weight") else
                 config.n_kv_heads if tensor.name.endswith("attn_k.weight") else 0)
        if tensor.tensor_type.name in keep_packed and len(shape) == 2:
            quantized = unpack(tensor.tensor_type.name, tensor.data, *shape)
            if permuted and heads:
                quantized = rows_permuted(quantized, lambda rows: unpermute_rotary_rows(rows, heads).copy())
            tensors[tensor.name] = quantized
            continue
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if permuted and heads:
            array = unpermute_rotary_rows(array, heads)
        tensors[tensor.name] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
    return tensors


def load_weights(metadata: ModelMetadata, quantization: str = "none") -> Mapping[str, torch.Tensor]:
    """The model's weights: a checkpoint's, mapped; a GGUF's, from the cache or converted and cached
    (with quantization "gguf", read from the file each start, its quantized tensors kept so)."""
    if quantization == "gguf":
        if metadata.format != "gguf":
            raise ModelFileError(f"{metadata.path}: --quantization gguf needs a GGUF model file")
        from services.worker.quantized import PACKED_TYPES

        return convert_gguf(metadata.path, metadata.config, keep_packed=PACKED_TYPES)
    if metadata.format == "hf":
        weights = CheckpointWeights(Path(metadata.path))
        missing = [name for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight")
                   if name not in weights]
        if missing:
            raise ModelFileError(f"{metadata.path}: the safetensors lack {', '.join(missing)}")
        return weights
    cached = Path(metadata.cache_dir) / WEIGHTS_FILE
    if cached.is_file():
        return load_file(str(cached))
    log.info("event=convert_weights gguf=%s (first start; cached afterwards)", metadata.path)
    tensors = convert_gguf(metadata.path, metadata.config)
    partial = cached.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(partial))
    partial.replace(cached)  # atomic: workers starting together never read half a file
    return tensors
