"""GGUF -> float tensors for services/worker/model.py, cached as safetensors for fast starts.

llama.cpp's converter permutes the rows of Q and K so that its rotary kernel can rotate
interleaved pairs; the model here uses the rotate-half form of Hugging Face, so the
permutation is undone once, at conversion time.
"""

import logging
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from shared.model_file import ModelConfig, ModelMetadata

log = logging.getLogger("iterserve.worker")

WEIGHTS_FILE = "weights.safetensors"


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (heads x half x 2 back to heads x 2 x half)."""
    rows, columns = weight.shape
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, columns).swapaxes(1, 2).reshape(rows, columns)


def convert_gguf(path: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32, names as in the GGUF, Q/K rows un-permuted."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors: dict[str, torch.Tensor] = {}
    for tensor in GGUFReader(path).tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape([int(dim) for dim in reversed(tensor.shape)])
        if tensor.name.endswith("attn_q.weight"):
            array = unpermute_rotary_rows(array, config.n_heads)
        elif tensor.name.endswith("attn_k.weight"):
            array = unpermute_rotary_rows(array, config.n_kv_heads)
        tensors[tensor.name] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
    return tensors


def load_weights(metadata: ModelMetadata) -> dict[str, torch.Tensor]:
    """The model's float32 weights: from the cache, or converted from the GGUF and cached."""
    cached = Path(metadata.cache_dir) / WEIGHTS_FILE
    if cached.is_file():
        return load_file(str(cached))
    log.info("event=convert_weights gguf=%s (first start; cached afterwards)", metadata.gguf_path)
    tensors = convert_gguf(metadata.gguf_path, metadata.config)
    partial = cached.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(partial))
    partial.replace(cached)  # atomic: workers starting together never read half a file
    return tensors
