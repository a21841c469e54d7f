"""A GGUF's quantized tensors served quantized (`--quantization gguf`): packed in memory and
multiplied by a dequantizing kernel, not dequantized to float32 at load. Two kernels: the project's
own (cpu_kernels.cpp; NativeForm: Q4_0, Q4_1 and Q8_0 held as the file holds them, its bytes) where
cpu_kernels.chosen_kernel() takes it (AVX2 hosts), else torch's int4 kernel, in the form below.

Every type kept packed is a sum of parts of the one form torch's CPU int4 kernel computes
(aten::_weight_int4pack_mm_for_cpu): per group of 32 weights along a row, w = scale * (q - 8) + zero
with q in 0..15. llama.cpp's types map onto it (the 4-bit values exactly; the scales and zeros rounded
to float32, a K type's zero folding its two terms into one, then to the compute dtype):
- Q4_0 (w = d (q - 8)): scale d, zero 0;
- Q4_1 (w = d q + m): scale d, zero m + 8 d;
- Q4_K (per 32 of a 256-block, w = d sc q - dmin m): scale d sc, zero 8 d sc - dmin m;
- Q8_0 (w = d q, q in -128..127): q = 16 hi + lo, two parts: hi + 8 with scale 16 d, zero 0, and
  lo with scale d, zero 8 d (a byte a weight, as the file's);
- Q5_0, Q5_1, Q5_K (q in 0..31: its fifth bit hi, and lo): two parts, hi + 8 with scale 16 d (Q5_K:
  16 d sc), zero 0; lo with Q4_0's (zero -8 d, for w = d (q - 16)), Q4_1's or Q4_K's scale and zero.
Other types (F32, F16, Q6_K, whose 16-weight groups the kernel's 32 do not hold ...) are dequantized
as without quantization. Each tensor also keeps the file's own formula (FileValues: w = scale q +
offset on the file's integer q, computed as llama.cpp and gguf compute it), for the embedding's
lookup and any dequantizing: those values are the file's bit for bit.

Both kernels compute each row of x alone (a row's result does not depend on the other rows of the
step: tests/test_quantized.py), so these projections do not make a request's tokens depend on its
batch (in bfloat16 the decode workspace's attention still does: docs/models.md).
"""

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.worker import cpu_kernels

log = logging.getLogger(__name__)

GROUP = 32  # weights per scale along a row: every type here has groups of 32
PACKED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K")


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
class FileValues:
    """The file's formula, per group of 32: w = scale q + offset (float32, as gguf and llama.cpp
    compute it: one rounding), q the file's integer: the one part's q, or 16 hi + lo of two parts,
    less `bias` (Q4_0: q - 8; Q8_0: its signed byte; Q5_0: q - 16)."""
    scale: np.ndarray  # [N, K / 32] float32: d, or d sc
    offset: np.ndarray | None  # [N, K / 32] float32: m, or -dmin m; None: 0
    bias: int


def file_integers(parts: list, bias: int) -> "np.ndarray | torch.Tensor":
    """The file's q [..., K] from the parts' values (numpy or torch, as given, 0..15 each)."""
    high = parts[0].astype(np.int16) if isinstance(parts[0], np.ndarray) else parts[0].short()
    combined = high if len(parts) == 1 else 16 * high + parts[1]
    return combined - bias


@dataclass
class QuantizedTensor:
    """A GGUF tensor kept quantized: the sum of its parts (one; two for Q8_0 and Q5_*), [N, K] each,
    and the file's own formula for its values (None for fused projections: the kernel's only)."""
    type_name: str
    parts: list[Int4Part]
    values: FileValues | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts[0].q.shape

    def dequantized(self) -> np.ndarray:
        """The file's values exactly (FileValues), else the parts' sum (rounded as the kernel's)."""
        if self.values is None:
            return sum(part.dequantized() for part in self.parts)
        rows, columns = self.shape
        q = file_integers([part.q for part in self.parts], self.values.bias).astype(np.float32).reshape(rows, -1, GROUP)
        grouped = q * self.values.scale[..., None]
        if self.values.offset is not None:
            grouped = grouped + self.values.offset[..., None]
        return grouped.reshape(rows, columns)


def _halves(d: np.ndarray) -> np.ndarray:
    return d.view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles are the first 16, the high the last."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes -> [..., 32] values 0 or 1: value i is bit i of the little-endian uint32."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _fifth_bit(high: np.ndarray, scale: np.ndarray) -> Int4Part:
    """The part 16 scale hi of a 5-bit q = 16 hi + lo (hi 0 or 1, kept as hi + 8)."""
    return Int4Part((high + 8).astype(np.uint8), 16 * scale, np.zeros_like(scale))


def _k_block(blocks: np.ndarray, rows: int, columns: int, nibbles_at: int) -> tuple[np.ndarray, ...]:
    """A K type's 256-blocks [rows * columns / 256, size]: per group of 32 its scale d sc and its
    minimum dmin m [rows, columns / 32], and the low nibbles [rows, columns] (128 bytes from
    nibbles_at, each 32 bytes sub-blocks 2j (low) and 2j + 1 (high))."""
    from gguf.quants import Q4_K

    d, dmin = _halves(blocks[:, 0:2].copy()), _halves(blocks[:, 2:4].copy())
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [blocks, 8] each
    scale = (d[:, None] * sc.astype(np.float32)).reshape(rows, columns // GROUP)
    minimum = (dmin[:, None] * mins.astype(np.float32)).reshape(rows, columns // GROUP)
    qs = blocks[:, nibbles_at:nibbles_at + 128].reshape(-1, 4, 32)
    return scale, minimum, np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(rows, columns)


def unpack(type_name: str, data: np.ndarray, rows: int, columns: int) -> QuantizedTensor:
    """The raw blocks of a GGUF tensor [rows, columns] (gguf's tensor.data) as int4 parts."""
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    groups = columns // GROUP
    if type_name == "Q4_0":  # 18 bytes: d, 16 bytes of nibbles
        blocks = blocks.reshape(rows, groups, 18)
        d = _halves(blocks[..., 0:2].copy())
        q = _nibbles(blocks[..., 2:18]).reshape(rows, columns)
        return QuantizedTensor(type_name, [Int4Part(q, d, np.zeros_like(d))], FileValues(d, None, 8))
    if type_name == "Q4_1":  # 20 bytes: d, m, 16 bytes of nibbles
        blocks = blocks.reshape(rows, groups, 20)
        d, m = _halves(blocks[..., 0:2].copy()), _halves(blocks[..., 2:4].copy())
        q = _nibbles(blocks[..., 4:20]).reshape(rows, columns)
        return QuantizedTensor(type_name, [Int4Part(q, d, m + 8 * d)], FileValues(d, m, 0))
    if type_name == "Q4_K":  # 144 bytes per 256: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
        scale, minimum, q = _k_block(blocks.reshape(rows * (columns // 256), 144), rows, columns, 16)
        return QuantizedTensor(type_name, [Int4Part(q, scale, 8 * scale - minimum)], FileValues(scale, -minimum, 0))
    if type_name == "Q8_0":  # 34 bytes: d, 32 signed bytes
        blocks = blocks.reshape(rows, groups, 34)
        d = _halves(blocks[..., 0:2].copy())
        q8 = blocks[..., 2:34].copy().view(np.int8)  # [rows, groups, 32]
        high = q8 >> 4  # (arithmetic: -8..7)
        low = (q8 - high * 16).astype(np.uint8)
        parts = [Int4Part((high + 8).astype(np.uint8).reshape(rows, columns), 16 * d, np.zeros_like(d)),
                 Int4Part(low.reshape(rows, columns), d, 8 * d)]
        return QuantizedTensor(type_name, parts, FileValues(d, None, 128))
    if type_name in ("Q5_0", "Q5_1"):  # 22 / 24 bytes: d (, m), 4 bytes of fifth bits, 16 of nibbles
        at = 2 if type_name == "Q5_0" else 4
        blocks = blocks.reshape(rows, groups, at + 20)
        d = _halves(blocks[..., 0:2].copy())
        high = _bits(blocks[..., at:at + 4]).reshape(rows, columns)
        low = _nibbles(blocks[..., at + 4:at + 20]).reshape(rows, columns)
        m = None if type_name == "Q5_0" else _halves(blocks[..., 2:4].copy())
        values = FileValues(d, None, 128 + 16) if m is None else FileValues(d, m, 128)
        return QuantizedTensor(type_name, [_fifth_bit(high, d), Int4Part(low, d, -8 * d if m is None else m + 8 * d)],
                               values)
    if type_name == "Q5_K":  # 176 bytes per 256: d, dmin, 12 bytes of scales and mins, 32 of fifth bits, 128 of nibbles
        blocks = blocks.reshape(rows * (columns // 256), 176)
        scale, minimum, low = _k_block(blocks, rows, columns, 48)
        qh = blocks[:, 16:48]  # sub-block s's fifth bits: bit s of these 32 bytes
        high = np.stack([(qh >> bit) & 1 for bit in range(8)], axis=1).reshape(rows, columns)
        return QuantizedTensor(type_name, [_fifth_bit(high, scale), Int4Part(low, scale, 8 * scale - minimum)],
                               FileValues(scale, -minimum, 128))
    raise ValueError(f"tensor type {type_name} is not kept quantized; kept: {', '.join(PACKED_TYPES)}")


def concatenated(tensors: list[QuantizedTensor]) -> QuantizedTensor | None:
    """Several tensors' rows as one (Q, K and V; gate and up) where each has the same parts' form
    (all of one part, or all of two: Q8_0 and Q5_*); None where they do not. The file's formula goes
    with them where it is one form for all (one bias, offsets in all or none)."""
    counts = {len(tensor.parts) for tensor in tensors}
    if len(counts) != 1:
        return None
    parts = [Int4Part(np.concatenate([tensor.parts[index].q for tensor in tensors]),
                      np.concatenate([tensor.parts[index].scale for tensor in tensors]),
                      np.concatenate([tensor.parts[index].zero for tensor in tensors]))
             for index in range(counts.pop())]
    values = None
    if (all(tensor.values is not None for tensor in tensors)
            and len({(tensor.values.bias, tensor.values.offset is None) for tensor in tensors}) == 1):
        offsets = None if tensors[0].values.offset is None else np.concatenate([t.values.offset for t in tensors])
        values = FileValues(np.concatenate([tensor.values.scale for tensor in tensors]), offsets,
                            tensors[0].values.bias)
    return QuantizedTensor("+".join(sorted({tensor.type_name for tensor in tensors})), parts, values)


def rows_permuted(tensor: QuantizedTensor, permute) -> QuantizedTensor:
    """The same tensor with its rows reordered by `permute` (an [N, ...] array -> [N, ...] function)."""
    parts = [Int4Part(permute(part.q), permute(part.scale), permute(part.zero)) for part in tensor.parts]
    values = tensor.values and FileValues(permute(tensor.values.scale), None if tensor.values.offset is None
                                          else permute(tensor.values.offset), tensor.values.bias)
    return QuantizedTensor(tensor.type_name, parts, values)


@dataclass
class NativeForm:
    """A weight as cpu_kernels.cpp multiplies it, its bytes the file's: the file's integers, 4-bit
    (two a byte, q[j] and q[j + 16] of a group in byte j, as llama.cpp's blocks) or signed bytes,
    and per group of 32 the file's float16 scale and offset: w = scale (q - bias) + offset."""
    q: torch.Tensor  # [N, K / 2] uint8 (nibbles: Q4_0, Q4_1) or [N, K] int8 (bytes: Q8_0)
    scales: torch.Tensor  # [N, K / 32] float16
    offsets: torch.Tensor | None  # [N, K / 32] float16 (Q4_1's m); None: 0
    bias: int  # the file's integer is q less this (Q4_0's 8; else 0)

    @classmethod
    def of(cls, tensor: QuantizedTensor) -> "NativeForm | None":
        """Q4_0 and Q4_1 as nibbles, Q8_0 as bytes, their d and m the file's float16; None for a type
        or a fused mix of types whose values these forms do not hold as the file does."""
        values = tensor.values
        if values is None:
            return None
        rows, columns = tensor.shape

        def narrow(array: np.ndarray) -> torch.Tensor | None:
            held = array.astype(np.float16)
            return torch.from_numpy(held) if np.array_equal(held.astype(np.float32), array) else None

        scales = narrow(values.scale)  # (None for the K types' d sc)
        offsets = None if values.offset is None else narrow(values.offset)
        if scales is None or (values.offset is not None and offsets is None):
            return None
        if len(tensor.parts) == 1 and values.bias in (0, 8):  # Q4_0 (bias 8), Q4_1 (bias 0)
            grouped = tensor.parts[0].q.reshape(rows, columns // GROUP, GROUP)
            nibbles = (grouped[..., :GROUP // 2] | (grouped[..., GROUP // 2:] << 4)).reshape(rows, columns // 2)
            return cls(torch.from_numpy(np.ascontiguousarray(nibbles)), scales, offsets, values.bias)
        if len(tensor.parts) == 2 and values.bias == 128 and offsets is None:  # Q8_0: w = d q
            q = file_integers([part.q for part in tensor.parts], values.bias).astype(np.int8)
            return cls(torch.from_numpy(q), scales, None, 0)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.q.dtype == torch.int8:
            return cpu_kernels.byte_mm(x, self.q, self.scales)
        return cpu_kernels.nibble_mm(x, self.q, self.scales, self.offsets, self.bias)

    def file_integers(self, ids: torch.Tensor) -> torch.Tensor:
        """The file's integer q of rows `ids` [T]: [T, K] int16."""
        rows = self.q.index_select(0, ids)
        if self.q.dtype == torch.int8:
            return rows.short()
        grouped = rows.view(len(ids), -1, GROUP // 2)
        return torch.cat([grouped & 0x0F, grouped >> 4], dim=-1).view(len(ids), -1).short() - self.bias

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + (0 if self.offsets is None else self.offsets.nbytes)


class PackedLinear:
    """A projection's weight [N, K] kept packed: x [T, K] -> x @ W.T [T, N], by the project's own
    kernel (`native`: cpu_kernels.py says where) where it holds the weight's type, else by torch's
    int4 kernel (`parts`: packed for it)."""

    def __init__(self, tensor: QuantizedTensor, device: torch.device, dtype: torch.dtype,
                 kernel: str | None = None) -> None:
        if device.type != "cpu":
            raise ValueError("--quantization gguf runs on the CPU only for now")
        self.out_features, self.in_features = tensor.shape
        self.dtype = dtype
        self.native = NativeForm.of(tensor) if (kernel or cpu_kernels.chosen_kernel()) == "native" else None
        self.parts = []
        for part in tensor.parts if self.native is None else ():
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(part.q.astype(np.int32)), 1)
            scales_and_zeros = torch.from_numpy(np.stack([part.scale, part.zero], axis=-1).transpose(1, 0, 2).copy())
            self.parts.append((packed, scales_and_zeros.to(dtype)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:  # (float32 in and out: its arithmetic)
            return self.native(x.float().contiguous()).to(self.dtype)
        x = x.to(self.dtype)
        result = None
        for packed, scales_and_zeros in self.parts:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)
            result = out if result is None else result + out
        return result

    @property
    def nbytes(self) -> int:
        if self.native is not None:
            return self.native.nbytes
        return sum(packed.nbytes + scales.nbytes for packed, scales in self.parts)


class Nibbles:
    """A table's parts' 4-bit values [N, K] each, two a byte, and the rows of them a lookup asks for.
    The bytes are the int4 kernel's own packed weights where the table is also the lm head (held once,
    as llama.cpp holds a tied table), in the layout torch packs them (KERNEL_LAYOUTS; found by decoding
    the whole table at load, so a torch that packs otherwise costs memory, never a wrong row); else a
    copy of their own, in the form ("pairs", 2): rows 2j and 2j + 1 in the K bytes of pair j."""

    # torch's CPU int4 packing (aten/src/ATen/native/cpu/int4mm_kernel.cpp weight_to_int4pack_kernel):
    # rows in blocks of B, a block's bytes k by k, B / 2 bytes a k; "halves": row o of a block in byte
    # o % (B / 2) of its k, the low nibble for the block's first half (AVX-512: B 64; AVX2: B 32);
    # "pairs": rows 2j and 2j + 1 in byte j (no vectors: B 32; NEON: B 16; any block shorter than B).
    KERNEL_LAYOUTS = (("halves", 64), ("halves", 32), ("pairs", 32), ("pairs", 16), ("pairs", 64))
    CHECKED_VALUES = 1 << 22  # values decoded at a time when checking a layout (an int64 index each)

    def __init__(self, data: list[torch.Tensor], rows: int, columns: int, layout: tuple[str, int], own: bool) -> None:
        """Where each row starts, its bytes' stride and its nibble, worked out once (7 bytes a row)."""
        self.data, self.columns, self.layout, self.own = data, columns, layout, own
        form, block = layout
        ids = torch.arange(rows)
        whole = rows // block * block  # rows in whole blocks; the rest are the last, short block
        in_tail = ids >= whole
        offset = torch.where(in_tail, ids - whole, ids % block)  # the row within its block
        width = torch.where(in_tail, rows - whole, block) // 2  # bytes per k in the row's block
        halves = ~in_tail if form == "halves" else torch.zeros_like(in_tail)
        width = width.clamp(min=1)  # (a 1-row last block: "pairs" at byte 0, its nibble the low one)
        start = (ids - offset) * (columns // 2) + torch.where(halves, offset % width, offset // 2)
        self.start = start.int() if rows * columns // 2 < 2 ** 31 else start
        self.shift = (4 * torch.where(halves, offset // width, offset % 2)).to(torch.uint8)
        self.width = None if whole == rows else width.short()  # (one stride for all: no short block)
        self.steps = torch.arange(columns) * (block // 2)

    @classmethod
    def of(cls, parts: list[np.ndarray], packed: list[torch.Tensor] | None = None) -> "Nibbles":
        """The parts' q [N, K] in 0..15, held as `packed` (the kernel's bytes of the same q) where one
        of the layouts decodes all of them to q, else as a copy of their own."""
        rows, columns = parts[0].shape
        if packed is not None and all(held.dtype == torch.uint8 and held.numel() * 2 == rows * columns
                                      for held in packed):
            chunk = max(1, cls.CHECKED_VALUES // columns)
            for layout in cls.KERNEL_LAYOUTS:
                held = cls([part.reshape(-1) for part in packed], rows, columns, layout, own=False)
                if all(all(torch.equal(got, torch.from_numpy(q[first:first + chunk]))
                           for got, q in zip(held.lookup(torch.arange(first, min(first + chunk, rows))), parts))
                       for first in range(0, rows, chunk)):
                    return held
            log.warning("event=tied_table_copied rows=%d columns=%d reason=int4_layout_unknown (torch %s packs "
                        "in none of %s: the table's 4-bit values are held a second time)", rows, columns,
                        torch.__version__, cls.KERNEL_LAYOUTS)
        own = []
        for q in parts:
            even = np.concatenate([q, np.zeros((rows % 2, columns), q.dtype)])  # (an odd last row paired with 0s)
            paired = np.ascontiguousarray(even[0::2] | (even[1::2] << 4)).astype(np.uint8)
            own.append(torch.from_numpy(paired).reshape(-1))
        return cls(own, rows + rows % 2, columns, ("pairs", 2), own=True)

    def lookup(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Each part's rows `ids` [T] of q: [T, K] uint8."""
        steps = self.steps if self.width is None else torch.arange(self.columns) * self.width[ids][:, None]
        index = (self.start[ids][:, None] + steps).view(-1)
        shift = self.shift[ids][:, None]
        return [(data.index_select(0, index).view(len(ids), -1) >> shift) & 0x0F for data in self.data]

    @property
    def nbytes(self) -> int:  # (the kernel's bytes are counted as the lm head's)
        tables = sum(table.nbytes for table in (self.start, self.shift, self.width) if table is not None)
        return tables + (sum(data.nbytes for data in self.data) if self.own else 0)


def _narrowest(values: np.ndarray) -> torch.Tensor:
    """float32 values as float16 where that holds them exactly (a GGUF's d and m are float16)."""
    narrow = values.astype(np.float16)
    return torch.from_numpy(narrow if np.array_equal(narrow.astype(np.float32), values) else values)


class QuantizedEmbedding:
    """The token embedding's rows looked up from a kept-quantized table, dequantized on lookup by the
    file's own formula (FileValues: the file's values bit for bit): the parts' 4-bit values (Nibbles:
    the tied lm head's packed bytes, where it is one, so a tied table is held once) and the file's
    scales and offsets, as narrow as they are exact (Q8_0: its d, float16, as the file's)."""

    def __init__(self, tensor: QuantizedTensor, dtype: torch.dtype, lm_head: "PackedLinear | None" = None) -> None:
        if tensor.values is None:
            raise ValueError(f"a {tensor.type_name} table has no file values to look its rows up by")
        self.dtype, self.bias = dtype, tensor.values.bias  # (not the float32 arrays: narrowed below)
        # the tied lm head's own kernel form holds the file's integers as they are: looked up there
        self.native = None if lm_head is None else lm_head.native
        self.nibbles = None if self.native is not None else Nibbles.of(
            [part.q for part in tensor.parts], None if lm_head is None else [packed for packed, _ in lm_head.parts])
        self.scale = _narrowest(tensor.values.scale)
        self.offset = None if tensor.values.offset is None else _narrowest(tensor.values.offset)

    @property
    def shares_lm_head(self) -> bool:
        """Whether its 4-bit values or bytes are the lm head's (the table held once)."""
        return self.native is not None or not self.nibbles.own

    def index_select(self, dim: int, token_ids: torch.Tensor) -> torch.Tensor:
        q = (self.native.file_integers(token_ids) if self.native is not None
             else file_integers(self.nibbles.lookup(token_ids), self.bias)).float()  # (small integers: exact)
        rows = q.view(len(token_ids), -1, GROUP) * self.scale.index_select(0, token_ids).float()[..., None]
        if self.offset is not None:
            rows = rows + self.offset.index_select(0, token_ids).float()[..., None]
        return rows.view(len(token_ids), -1).to(self.dtype)

    @property
    def nbytes(self) -> int:  # (shared bytes are counted as the lm head's)
        own = 0 if self.nibbles is None else self.nibbles.nbytes
        return own + self.scale.nbytes + (0 if self.offset is None else self.offset.nbytes)
