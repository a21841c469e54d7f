"""Llama in plain torch, with Orca's selective batching; Mistral and Qwen2/Qwen3 as named differences.

Every op but attention runs once on the step's tokens flattened to [T, H] (T = sum of the
requests' token counts, prefill chunks and decode tokens mixed); attention is handed to
services/worker/attention.py, which splits it per request against each one's paged KV.
Shapes: T tokens, H hidden, Hq query heads, Hkv KV heads, D head dim, V vocabulary.

The families differ in three places only (shared/model_file.py ARCHITECTURES): Qwen2's biases on
Q/K/V, Qwen3's per-head RMS norm of Q and K, and the rotary frequencies' scaling (Llama 3.1).
"""

import math
import re

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.attention import AttentionBatch, attend
from services.worker.cpu_kernels import cpuinfo as _cpuinfo  # (a module name tests replace it by)
from services.worker.kv_cache import PagedKVCache
from services.worker.quantized import PackedLinear, QuantizedEmbedding, QuantizedTensor, concatenated
from shared.model_file import ModelConfig


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]: Q, K, V projections fused into one matmul
    out: torch.Tensor  # [H, Hq D]
    ffn_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 F, H]: SwiGLU gate and up fused
    down: torch.Tensor  # [H, F]
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2 Hkv) D]: Qwen2
    q_norm: torch.Tensor | None = None  # [D]: Qwen3
    k_norm: torch.Tensor | None = None  # [D]: Qwen3


# On CPU, a projection of at most this many rows (decode steps, small prefill chunks) runs as
# (W @ x.T).T where that is faster: BLAS then streams the weight once for all rows, where x @ W.T
# runs one pass per row for 2-3 rows and a slow small-M GEMM above. Which is faster depends on the
# host's BLAS (benchmarks/projections.py, whole decode steps of SmolLM2-135M on 2 cores): on an AMD
# EPYC (AVX2) the skinny form ran steps of 2-48 requests 1.2-1.8x faster, 1 row unchanged; on an
# Intel Xeon (AVX-512, AMX), where MKL takes its own small-M kernels, float32 x @ W.T was faster at
# every row count (the skinny form 0.47x at 2 rows, 0.74x at 4, 0.91x at 16: a 4-row step cost 2.3x
# a 1-row one, 1.8x without it), while bfloat16's skinny form stayed 1.07-1.22x faster for 2-16 rows.
# Long prefill chunks keep x @ W.T, faster everywhere. The choice depends on the host and the row
# count only, so every worker of a host computes a step alike.
SKINNY_ROWS = 64



def _intel_cpu() -> bool:
    return "GenuineIntel" in _cpuinfo()


def _amd_avx512() -> bool:
    """An AMD CPU of family 25 (Zen 3 and 4) or 26 (Zen 5) whose torch runs its AVX-512 kernels: the
    classes measured below (Zen 3 has no AVX-512: torch runs its AVX2 kernels there)."""
    family = re.search(r"^cpu family\s*:\s*(\d+)", _cpuinfo(), re.MULTILINE)
    return ("AuthenticAMD" in _cpuinfo() and family is not None and family.group(1) in ("25", "26")
            and torch.backends.cpu.get_cpu_capability() == "AVX512")


SKINNY_FLOAT32 = not _intel_cpu()  # float32 projections take the skinny form (not on Intel's MKL)
# On an AMD EPYC with AVX-512 (Zen 4, family 25, and Zen 5, family 26, each with AVX512-BF16;
# benchmarks/results/projections_amd_avx512.md) a one-row float32 projection streams its weight at
# half the rate a two-row one does, whichever form (all of SmolLM2-135M's projections, cold: Zen 4
# 1 row 46 ms, the row twice 24 ms, 2 rows 18 ms; Zen 5 33, 16 and 15 ms): there it runs as two
# rows, the row copied (a broadcast second row, stride 0, takes a slower path still: 86 and 57 ms).
# Its row is then exactly that row's in a two-row projection.
AMD_AVX512 = _amd_avx512()
PAD_ONE_ROW_FLOAT32 = AMD_AVX512
# There too bfloat16's x @ W.T beats the skinny form at 1-8 rows (Zen 4: 1 row 26 ms against 38
# padded and 27 skinny, 4 rows 28 against 33, a tie at 16-32; Zen 5: 17 against 26 padded and 17
# skinny, 2-16 rows 16-21 against 24-26): bfloat16 keeps x @ W.T on those classes.
# (float16, not measured there, keeps the skinny form as everywhere.)
SKINNY_BFLOAT16 = not AMD_AVX512
# A one-row bfloat16 projection runs as two rows (the row twice) where torch runs native bfloat16
# kernels (AVX-512 dispatch on a CPU with AVX512-BF16 or AMX): oneDNN's one-row path is slower than
# its two-row one there (SmolLM2-135M's lm head 1.92 ms against 1.27, a decode step 30.1 ms against
# 25.3 for two requests); without them (AVX2, as on the AMD hosts, or torch held to AVX2 kernels) a
# second row costs as much as the first, and the one-row path is kept.
PAD_ONE_ROW_BFLOAT16 = (any(flag in _cpuinfo().split() for flag in ("avx512_bf16", "amx_bf16"))
                        and torch.backends.cpu.get_cpu_capability() == "AVX512")


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x @ weight.T for x [T, in], weight [out, in] (a tensor, or a PackedLinear: kept quantized):
    [T, out], contiguous."""
    if isinstance(weight, PackedLinear):
        return weight(x)
    if (x.shape[0] <= SKINNY_ROWS and x.device.type == "cpu"
            and (SKINNY_FLOAT32 if weight.dtype == torch.float32
                 else SKINNY_BFLOAT16 if weight.dtype == torch.bfloat16 else True)):
        if x.shape[0] == 1 and PAD_ONE_ROW_BFLOAT16 and weight.dtype == torch.bfloat16:
            return (weight @ x.expand(2, -1).T)[:, :1].T.contiguous()
        if x.shape[0] == 1 and PAD_ONE_ROW_FLOAT32 and weight.dtype == torch.float32:
            return (weight @ x.repeat(2, 1).T)[:, :1].T.contiguous()
        return (weight @ x.T).T.contiguous()
    return x @ weight.T


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


# The non-attention ops of a layer, on all the step's tokens flattened to [T, H]: each is one
# function of tensors (the same for every layer), so `--compile` compiles each once, with the
# token count dynamic, and every layer reuses the compiled code.


def attention_inputs(x: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor | None,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
    """[T, H] -> q [T, Hq, D], k and v [T, Hkv, D], rotary applied to q and k."""
    h = rms_norm(x, norm, eps)
    projected = linear(h, qkv)
    if qkv_bias is not None:
        projected = projected + qkv_bias
    q, k, v = projected.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = q.view(-1, n_heads, head_dim)
    k = k.view(-1, n_kv_heads, head_dim)
    v = v.view(-1, n_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def attention_output_and_ffn(x: torch.Tensor, attended: torch.Tensor, out: torch.Tensor, norm: torch.Tensor,
                             gate_up: torch.Tensor, down: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual stream after the attention's output projection and the SwiGLU feed-forward."""
    x = x + linear(attended, out)
    gate, up = linear(rms_norm(x, norm, eps), gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, down)


def final_logits(x: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    return linear(rms_norm(x, norm, eps), lm_head).float()


def inverse_frequencies(config: ModelConfig, frequency_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The rotary embedding's [D / 2] inverse frequencies (float64), scaled as the config says.

    "llama3" is Llama 3.1's scaling, as transformers computes it: wavelengths longer than the
    original context / low_freq_factor are divided by the factor, shorter than original context /
    high_freq_factor kept, and the band between interpolated. A GGUF carries the same result as
    per-frequency divisors (llama.cpp's rope_freqs.weight), passed as frequency_factors.
    """
    dim = config.head_dim
    inverse = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if frequency_factors is not None:
        inverse = inverse / frequency_factors.to(torch.float64)
    if config.rope_scaling == "linear":
        inverse = inverse / config.rope_factor
    elif config.rope_scaling == "llama3":
        factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        original = config.rope_original_context
        wavelength = 2 * math.pi / inverse
        scaled = torch.where(wavelength > original / low, inverse / factor, inverse)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        inverse = torch.where(medium, smoothed, scaled)
    return inverse


def compiled(function):
    """torch.compile with a dynamic token count: one compiled graph serves every step size (the
    projections' row threshold, SKINNY_ROWS, splits it in two). Float arguments (the norms'
    epsilon) are compiled in as constants: left dynamic, each call would first build a tensor of
    them (three ops per call, 183 of a 30-layer decode step's 1021 counted)."""
    torch._dynamo.config.specialize_float = True  # (process-wide: the worker compiles nothing else)
    return torch.compile(function, dynamic=True)


class Llama:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 compile: bool = False):
        self.config, self.device, self.dtype = config, device, dtype
        self.compiled = compile
        self.attention_inputs = compiled(attention_inputs) if compile else attention_inputs
        self.attention_output_and_ffn = compiled(attention_output_and_ffn) if compile else attention_output_and_ffn
        self.final_logits = compiled(final_logits) if compile else final_logits

        def tensor(name: str) -> torch.Tensor:
            weight = weights[name]
            if isinstance(weight, QuantizedTensor):  # (one of fused projections that are not all kept quantized)
                weight = torch.from_numpy(weight.dequantized())
            return weight.to(device=device, dtype=dtype)

        def optional(name: str, present: bool) -> torch.Tensor | None:
            return tensor(name) if present else None

        def projection(*names: str):
            """The rows of these weights as one projection: packed where each is kept quantized
            (`--quantization gguf`) in a form that concatenates, else a tensor of the dtype."""
            found = [weights[name] for name in names]
            if len(found) == 1 and not isinstance(found[0], QuantizedTensor):
                return tensor(names[0])
            if all(isinstance(weight, QuantizedTensor) for weight in found):
                joined = found[0] if len(found) == 1 else concatenated(found)
                if joined is not None:
                    return PackedLinear(joined, device, dtype)
            return torch.cat([tensor(name) for name in names]).contiguous()

        embedding = weights["token_embd.weight"]
        tied = "output.weight" not in weights
        if isinstance(embedding, QuantizedTensor):  # (tied: its rows looked up from the lm head's packed bytes)
            self.lm_head = projection("token_embd.weight" if tied else "output.weight")
            self.embedding = QuantizedEmbedding(embedding, dtype, self.lm_head if tied else None)
        else:
            self.embedding = tensor("token_embd.weight")  # [V, H]
            self.lm_head = self.embedding if tied else projection("output.weight")
        self.final_norm = tensor("output_norm.weight")
        self.layers = [
            LayerWeights(
                attn_norm=tensor(f"blk.{i}.attn_norm.weight"),
                qkv=projection(*(f"blk.{i}.attn_{part}.weight" for part in "qkv")),
                out=projection(f"blk.{i}.attn_output.weight"),
                ffn_norm=tensor(f"blk.{i}.ffn_norm.weight"),
                gate_up=projection(f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"),
                down=projection(f"blk.{i}.ffn_down.weight"),
                qkv_bias=(torch.cat([tensor(f"blk.{i}.attn_{part}.bias") for part in "qkv"])
                          if config.qkv_bias else None),
                q_norm=optional(f"blk.{i}.attn_q_norm.weight", config.qk_norm),
                k_norm=optional(f"blk.{i}.attn_k_norm.weight", config.qk_norm),
            )
            for i in range(config.n_layers)
        ]
        factors = weights["rope_freqs.weight"] if "rope_freqs.weight" in weights else None
        angles = torch.outer(torch.arange(config.context_length, dtype=torch.float64),
                             inverse_frequencies(config, factors))
        angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout
        self.rope_cos = angles.cos().to(device=device, dtype=dtype)  # [context, D]
        self.rope_sin = angles.sin().to(device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: AttentionBatch,
        kv_cache: PagedKVCache,
        logit_rows: torch.Tensor,  # [B]: the rows whose next token is wanted
    ) -> torch.Tensor:  # [B, V] float32
        x = self.run_layers(self.embedding.index_select(0, token_ids), positions, batch, kv_cache)  # [T, H]
        return self.final_logits(x.index_select(0, logit_rows), self.final_norm, self.lm_head, self.config.rms_norm_eps)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                   kv_cache: PagedKVCache) -> torch.Tensor:
        """Every layer over the step's hidden states [T, H]."""
        config = self.config
        eps = config.rms_norm_eps
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer_index, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(x, layer.attn_norm, layer.qkv, layer.qkv_bias, layer.q_norm, layer.k_norm,
                                            cos, sin, config.n_heads, config.n_kv_heads, config.head_dim, eps)
            kv_cache.write(layer_index, batch.slot_mapping, k, v)
            attended = attend(q, k, v, kv_cache.layer_keys[layer_index], kv_cache.layer_values[layer_index], batch,
                              layer_index)  # [T, Hq D]
            x = self.attention_output_and_ffn(x, attended, layer.out, layer.ffn_norm, layer.gate_up, layer.down, eps)
        return x
