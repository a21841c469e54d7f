"""A GGUF's quantized tensors served quantized (`--quantization gguf`): packed 4-bit in memory and
multiplied by torch's dequantizing int4 kernel, not dequantized to float32 at load.

Every type kept packed is a sum of parts of the one form torch's CPU int4 kernel computes
(aten::_weight_int4pack_mm_for_cpu): per group of 32 weights along a row, w = scale * (q - 8) + zero
with q in 0..15. llama.cpp's types map onto it exactly (the scales only rounded to the compute dtype):
- Q4_0 (w = d (q - 8)): scale d, zero 0;
- Q4_1 (w = d q + m): scale d, zero m + 8 d;
- Q4_K (per 32 of a 256-block, w = d sc q - dmin m): scale d sc, zero 8 d sc - dmin m;
- Q8_0 (w = d q, q in -128..127): q = 16 hi + lo, two parts: hi + 8 with scale 16 d, zero 0, and
  lo with scale d, zero 8 d (a byte a weight, as the file's).
Other types (F32, F16, Q5_*, Q6_K ...) are dequantized as without quantization.

The kernel computes each row of x alone (a row's result does not depend on the other rows of the
step: tests/test_quantized.py), so these projections do not make a request's tokens depend on its
batch (in bfloat16 the decode workspace's attention still does: docs/models.md).
"""

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # weights per scale along a row: every type here has groups of 32
PACKED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


@dataclass
class Int4Part:
    """One part of a weight [N, K]: q [N, K] in 0..15 (uint8), scale and zero [N, K / 32] (float32)."""
    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray

    def dequantized(self) -> np.ndarray:
        rows, columns = self.q.shape
        grouped = self.q.reshape(rows, -1, GROUP).astype(np.float32) - 8
        grouped = grouped * self.scale[..., None] + self.zero[..., None]
        return grouped.reshape(rows, columns)


@dataclass
class QuantizedTensor:
    """A GGUF tensor kept quantized: the sum of its parts (one; two for Q8_0), [N, K] each.
    `rows` also keeps Q8_0's bytes and scales whole, for the embedding's lookup of a few rows."""
    type_name: str
    parts: list[Int4Part]
    rows: tuple[np.ndarray, np.ndarray] | None = None  # Q8_0: int8 q [N, K], d [N, K / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts[0].q.shape

    def dequantized(self) -> np.ndarray:
        return sum(part.dequantized() for part in self.parts)


def _halves(d: np.ndarray) -> np.ndarray:
    return d.view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles are the first 16, the high the last."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack(type_name: str, data: np.ndarray, rows: int, columns: int) -> QuantizedTensor:
    """The raw blocks of a GGUF tensor [rows, columns] (gguf's tensor.data) as int4 parts."""
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    groups = columns // GROUP
    if type_name == "Q4_0":  # 18 bytes: d, 16 bytes of nibbles
        blocks = blocks.reshape(rows, groups, 18)
        d = _halves(blocks[..., 0:2].copy())
        q = _nibbles(blocks[..., 2:18]).reshape(rows, columns)
        return QuantizedTensor(type_name, [Int4Part(q, d, np.zeros_like(d))])
    if type_name == "Q4_1":  # 20 bytes: d, m, 16 bytes of nibbles
        blocks = blocks.reshape(rows, groups, 20)
        d, m = _halves(blocks[..., 0:2].copy()), _halves(blocks[..., 2:4].copy())
        q = _nibbles(blocks[..., 4:20]).reshape(rows, columns)
        return QuantizedTensor(type_name, [Int4Part(q, d, m + 8 * d)])
    if type_name == "Q4_K":  # 144 bytes per 256: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
        from gguf.quants import Q4_K

        blocks = blocks.reshape(rows * (columns // 256), 144)
        d, dmin = _halves(blocks[:, 0:2].copy()), _halves(blocks[:, 2:4].copy())
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [blocks, 8] each
        scale = d[:, None] * sc.astype(np.float32)
        zero = 8 * scale - dmin[:, None] * mins.astype(np.float32)
        qs = blocks[:, 16:144].reshape(-1, 4, 32)  # each 32 bytes: sub-blocks 2j (low), 2j + 1 (high)
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(rows, columns)
        return QuantizedTensor(type_name, [Int4Part(q, scale.reshape(rows, groups), zero.reshape(rows, groups))])
    if type_name == "Q8_0":  # 34 bytes: d, 32 signed bytes
        blocks = blocks.reshape(rows, groups, 34)
        d = _halves(blocks[..., 0:2].copy())
        q8 = blocks[..., 2:34].copy().view(np.int8)  # [rows, groups, 32]
        high = q8 >> 4  # (arithmetic: -8..7)
        low = (q8 - high * 16).astype(np.uint8)
        parts = [Int4Part((high + 8).astype(np.uint8).reshape(rows, columns), 16 * d, np.zeros_like(d)),
                 Int4Part(low.reshape(rows, columns), d, 8 * d)]
        return QuantizedTensor(type_name, parts, rows=(q8.reshape(rows, columns), d))
    raise ValueError(f"tensor type {type_name} is not kept quantized; kept: {', '.join(PACKED_TYPES)}")


def concatenated(tensors: list[QuantizedTensor]) -> QuantizedTensor | None:
    """Several tensors' rows as one (Q, K and V; gate and up) where each has the same parts' form
    (all of one part, or all Q8_0); None where they do not."""
    counts = {len(tensor.parts) for tensor in tensors}
    if len(counts) != 1:
        return None
    parts = [Int4Part(np.concatenate([tensor.parts[index].q for tensor in tensors]),
                      np.concatenate([tensor.parts[index].scale for tensor in tensors]),
                      np.concatenate([tensor.parts[index].zero for tensor in tensors]))
             for index in range(counts.pop())]
    return QuantizedTensor("+".join(sorted({tensor.type_name for tensor in tensors})), parts)


def rows_permuted(tensor: QuantizedTensor, permute) -> QuantizedTensor:
    """The same tensor with its rows reordered by `permute` (an [N, ...] array -> [N, ...] function)."""
    parts = [Int4Part(permute(part.q), permute(part.scale), permute(part.zero)) for part in tensor.parts]
    rows = None if tensor.rows is None else (permute(tensor.rows[0]), permute(tensor.rows[1]))
    return QuantizedTensor(tensor.type_name, parts, rows)


class PackedLinear:
    """A projection's weight [N, K] packed for the int4 kernel: x [T, K] -> x @ W.T [T, N]."""

    def __init__(self, tensor: QuantizedTensor, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cpu":
            raise ValueError("--quantization gguf runs on the CPU only for now")
        self.out_features, self.in_features = tensor.shape
        self.dtype = dtype
        self.parts = []
        for part in tensor.parts:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(part.q.astype(np.int32)), 1)
            scales_and_zeros = torch.from_numpy(np.stack([part.scale, part.zero], axis=-1).transpose(1, 0, 2).copy())
            self.parts.append((packed, scales_and_zeros.to(dtype)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        result = None
        for packed, scales_and_zeros in self.parts:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)
            result = out if result is None else result + out
        return result

    @property
    def nbytes(self) -> int:
        return sum(packed.nbytes + scales.nbytes for packed, scales in self.parts)


class QuantizedEmbedding:
    """The token embedding's rows looked up from a kept-quantized table (its dequantized rows only)."""

    def __init__(self, tensor: QuantizedTensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        if tensor.rows is not None:  # Q8_0: bytes and scales
            self.q = torch.from_numpy(tensor.rows[0])
            self.scale = torch.from_numpy(tensor.rows[1])
            self.zero = None
        else:  # one int4 part: q - 8 as int8
            [part] = tensor.parts
            self.q = torch.from_numpy(part.q.astype(np.int8) - 8)
            self.scale, self.zero = torch.from_numpy(part.scale), torch.from_numpy(part.zero)

    def index_select(self, dim: int, token_ids: torch.Tensor) -> torch.Tensor:
        q = self.q.index_select(0, token_ids).float()
        rows = q.view(q.shape[0], -1, GROUP) * self.scale.index_select(0, token_ids)[..., None]
        if self.zero is not None:
            rows = rows + self.zero.index_select(0, token_ids)[..., None]
        return rows.view(q.shape[0], -1).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in (self.q, self.scale, self.zero) if tensor is not None)
