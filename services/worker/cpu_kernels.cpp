// Projections over a GGUF's weights kept packed (`--quantization gguf`), for x86 CPUs with AVX2, FMA
// and F16C, where torch's int4 kernel is slow (services/worker/cpu_kernels.py builds and loads this),
// and a form of them for AVX-512, taken where the CPU has it (vector_bits):
// x [T, K] float32 times W.T, W [N, K] held as llama.cpp holds it, 32 weights a group with a float16
// scale (and offset), w = scale (q - zero point) + offset; q 4-bit (Q4_0, Q4_1) or a signed byte (Q8_0). The
// weights are decoded to float32 in registers and multiplied in float32: x @ W.T of the file's values
// up to float32 rounding, not llama.cpp's int8 products of a quantized x.
// Each output is summed in one fixed order whatever the rows of x or the threads (the threads split
// W's rows, never a sum), so a row's result does not depend on the other rows of its step.
#include <algorithm>
#include <type_traits>

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t ROWS_OF_W = 16;  // rows of W a thread takes at a time
constexpr int ROWS_AT_ONCE = 4;  // rows of x that share one decoding of a weight group (registers: 4 q + 4 sums)

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm256_castps256_ps128(v), high = _mm256_extractf128_ps(v, 1);
  __m128 sum = _mm_add_ps(low, high);
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

inline float half(uint16_t bits) { return _cvtsh_ss(bits); }

constexpr int64_t MOST_GROUPS = 2048;  // K up to 65536: a row's scales converted at once, on the stack

// A row's float16 values [groups] as float32 (8 at a time; exact).
inline void widen(const uint16_t* halves, int64_t groups, float* out) {
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + g))));
  for (; g < groups; ++g) out[g] = half(halves[g]);
}

// sum_g a[g] b[g], in one fixed order (8 lanes, then the rest).
inline float dot(const float* a, const float* b, int64_t count) {
  __m256 sum = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= count; g += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), sum);
  float total = horizontal_sum(sum);
  for (; g < count; ++g) total = total + a[g] * b[g];
  return total;
}

// 8 bytes as float32 (signed or not: exact).
template <bool SIGNED>
inline __m256 floats(__m128i bytes) {
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

// A group's 32 q (its first 16 and last 16 bytes) times each of R rows of x (`stride` apart), scaled,
// added to the rows' sums: in one order for every row (two chains of 16, then the scale).
template <int R, bool SIGNED>
inline void accumulate(__m128i first, __m128i second, float scale_value, const float* x, int64_t stride,
                       __m256* total) {
  const __m256 q0 = floats<SIGNED>(first), q1 = floats<SIGNED>(_mm_srli_si128(first, 8));
  const __m256 q2 = floats<SIGNED>(second), q3 = floats<SIGNED>(_mm_srli_si128(second, 8));
  const __m256 scale = _mm256_set1_ps(scale_value);
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * stride;
    __m256 a = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));
    __m256 b = _mm256_mul_ps(q1, _mm256_loadu_ps(xr + 8));
    a = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xr + 16), a);
    b = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24), b);
    total[r] = _mm256_fmadd_ps(_mm256_add_ps(a, b), scale, total[r]);
  }
}

// One weight row against `rows` rows of x: 4-bit q, byte j of a group holding q[j] (low nibble) and q[j + 16].
// SHIFTED: w = scale (q - zero_point) + offset, the offset term summed apart (offsets null: 0).
template <int R, bool SHIFTED>
void nibble_row(const float* x, int64_t K, const float* x_sums, const uint8_t* q, const uint16_t* scales,
                const uint16_t* offsets, float zero_point, float* out, int64_t N) {
  const int64_t groups = K / GROUP;
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  float scale_values[MOST_GROUPS], offset_values[MOST_GROUPS];
  widen(scales, groups, scale_values);
  if (SHIFTED) {
    if (offsets) widen(offsets, groups, offset_values);
    for (int64_t g = 0; g < groups; ++g)
      offset_values[g] = (offsets ? offset_values[g] : 0.0f) - zero_point * scale_values[g];
  }
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i first = _mm_and_si128(bytes, low_mask);
    const __m128i second = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
    accumulate<R, false>(first, second, scale_values[g], x + g * GROUP, K, total);
  }
  for (int r = 0; r < R; ++r)
    out[r * N] = horizontal_sum(total[r]) + (SHIFTED ? dot(offset_values, x_sums + r * groups, groups) : 0.0f);
}

// One weight row of signed bytes (Q8_0: w = scale * q).
template <int R>
void byte_row(const float* x, int64_t K, const int8_t* q, const uint16_t* scales, float* out, int64_t N) {
  const int64_t groups = K / GROUP;
  float scale_values[MOST_GROUPS];
  widen(scales, groups, scale_values);
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * GROUP));
    const __m128i first = _mm256_castsi256_si128(bytes), second = _mm256_extracti128_si256(bytes, 1);
    accumulate<R, true>(first, second, scale_values[g], x + g * GROUP, K, total);
  }
  for (int r = 0; r < R; ++r) out[r * N] = horizontal_sum(total[r]);
}

// The same products with AVX-512 (where the CPU has it: vector_bits says which form runs). A group's 16
// possible 4-bit values are a table of 16 floats, w = scale (q - zero point) + offset computed once per
// group for all 16 (the file's formula: a float16 scale times an integer of 4 or 8 bits is exact in
// float32, and the offset's sum rounds once, as gguf's does), and each weight is looked up by its
// nibble (vpermps takes an index's low 4 bits): W's values exactly as the float32 dequantized
// weights, summed with x in four chains a row (even and odd groups, first and last 16).
#define WIDE __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))

template <int R>
WIDE inline void accumulate_wide(__m512 first, __m512 second, const float* x, int64_t stride, __m512 (&total)[R][2]) {
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * stride;
    total[r][0] = _mm512_fmadd_ps(first, _mm512_loadu_ps(xr), total[r][0]);
    total[r][1] = _mm512_fmadd_ps(second, _mm512_loadu_ps(xr + 16), total[r][1]);
  }
}

// A group's 32 weights of 4-bit q, as float32: w = table[q].
WIDE inline void nibble_weights(const uint8_t* q, __m512 table, __m512& first, __m512& second) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  first = _mm512_permutexvar_ps(bytes, table);  // (the low nibble: q[j])
  second = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);  // (the high: q[j + 16])
}

// A group's 32 weights of signed bytes, as float32: w = scale q.
WIDE inline void byte_weights(const int8_t* q, __m512 scale, __m512& first, __m512& second) {
  first = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))),
                        scale);
  second = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), scale);
}

// Groups in pairs (even into `even`, odd into `odd`: named, so the sums stay in registers), then the
// row's sums: the same order whatever R.
template <int R, typename Weights>
WIDE inline void row_wide(const float* x, int64_t K, Weights weights, float* out, int64_t N) {
  const int64_t groups = K / GROUP;
  __m512 even[R][2], odd[R][2];
  for (int r = 0; r < R; ++r) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();
  __m512 first, second;
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    weights(g, first, second);
    accumulate_wide<R>(first, second, x + g * GROUP, K, even);
    weights(g + 1, first, second);
    accumulate_wide<R>(first, second, x + (g + 1) * GROUP, K, odd);
  }
  if (g < groups) {
    weights(g, first, second);
    accumulate_wide<R>(first, second, x + g * GROUP, K, even);
  }
  for (int r = 0; r < R; ++r)
    out[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(even[r][0], even[r][1]),
                                                    _mm512_add_ps(odd[r][0], odd[r][1])));
}

template <int R>
WIDE void nibble_row_wide(const float* x, int64_t K, const uint8_t* q, const uint16_t* scales,
                          const uint16_t* offsets, float zero_point, float* out, int64_t N) {
  const int64_t groups = K / GROUP;
  float scale_values[MOST_GROUPS], offset_values[MOST_GROUPS];
  widen(scales, groups, scale_values);
  if (offsets) widen(offsets, groups, offset_values);
  const __m512 levels = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_ps(zero_point));  // (exact)
  row_wide<R>(x, K, [&](int64_t g, __m512& first, __m512& second) WIDE {
    __m512 table = _mm512_mul_ps(levels, _mm512_set1_ps(scale_values[g]));
    if (offsets) table = _mm512_add_ps(table, _mm512_set1_ps(offset_values[g]));
    nibble_weights(q + g * 16, table, first, second);
  }, out, N);
}

template <int R>
WIDE void byte_row_wide(const float* x, int64_t K, const int8_t* q, const uint16_t* scales, float* out, int64_t N) {
  float scale_values[MOST_GROUPS];
  widen(scales, K / GROUP, scale_values);
  row_wide<R>(x, K, [&](int64_t g, __m512& first, __m512& second) WIDE {
    byte_weights(q + g * GROUP, _mm512_set1_ps(scale_values[g]), first, second);
  }, out, N);
}

// Which form runs: 512 where the CPU has AVX-512 (F and BW), else 256 (AVX2); one per process, so a
// row's sums keep one order whatever its step.
int64_t widest_bits() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 512 : 256; }
int64_t bits_in_use = widest_bits();

int64_t vector_bits(int64_t requested) {
  TORCH_CHECK(requested == 0 || requested == 256 || (requested == 512 && widest_bits() == 512),
              "vector_bits: 0 (ask), 256, or 512 where the CPU has AVX-512");
  if (requested) bits_in_use = requested;
  return bits_in_use;
}

// Each group's sum of x (the offsets' factor), in one fixed order.
at::Tensor group_sums(const at::Tensor& x) {
  const int64_t T = x.size(0), K = x.size(1), groups = K / GROUP;
  at::Tensor sums = at::empty({T, groups}, x.options());
  const float* xs = x.data_ptr<float>();
  float* out = sums.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = xs + t * K + g * GROUP;
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                                       _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
      out[t * groups + g] = horizontal_sum(sum);
    }
  return sums;
}

void check(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t bytes_per_row) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [T, K] float32, contiguous");
  TORCH_CHECK(x.size(1) % GROUP == 0 && x.size(1) / GROUP <= MOST_GROUPS, "K: a multiple of 32, at most 65536");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == bytes_per_row && q.is_contiguous(), "q: [N, bytes of a row]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == q.size(0) &&
              scales.size(1) == x.size(1) / GROUP, "scales: [N, K / 32] float16");
}

// f(std::integral_constant<int, R>) for R = rows (1 to ROWS_AT_ONCE): a block's row count as a template argument.
template <typename F>
inline void by_rows(int rows, F&& f) {
  switch (rows) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

template <typename RowFn>
at::Tensor run(const at::Tensor& x, int64_t N, RowFn row) {
  const int64_t T = x.size(0);
  at::Tensor out = at::empty({T, N}, x.options());
  float* o = out.data_ptr<float>();
  // The threads take W's rows, 16 at a time (their bytes stay in L1), each block of four rows of x
  // going past all 16 before the next block (a block of x stays in L1 too: a prefill's x is read
  // once per 16 rows of W, not once per row).
  at::parallel_for(0, N, ROWS_OF_W, [&](int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end; first += ROWS_OF_W) {
      const int64_t last = std::min(end, first + ROWS_OF_W);
      for (int64_t t = 0; t < T; t += ROWS_AT_ONCE) {
        const int rows = static_cast<int>(std::min<int64_t>(ROWS_AT_ONCE, T - t));
        for (int64_t n = first; n < last; ++n) row(n, t, rows, o + t * N + n);
      }
    }
  });
  return out;
}

at::Tensor nibble_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& offsets, int64_t zero_point) {
  check(x, q, scales, x.size(1) / 2);
  TORCH_CHECK(q.scalar_type() == at::kByte, "q: uint8");
  const int64_t K = x.size(1), N = q.size(0), groups = K / GROUP;
  const bool has_offsets = offsets.has_value() && offsets->defined();
  if (has_offsets)
    TORCH_CHECK(offsets->scalar_type() == at::kHalf && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "offsets: as scales");
  const bool shifted = has_offsets || zero_point != 0;
  const float zero = static_cast<float>(zero_point);
  const bool wide = bits_in_use == 512;  // (read once: the form of this whole call)
  at::Tensor sums = shifted && !wide ? group_sums(x) : at::Tensor();  // (the AVX2 form's offsets term)
  const float* xs = x.data_ptr<float>();
  const float* ss = sums.defined() ? sums.data_ptr<float>() : nullptr;
  const uint8_t* qs = q.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* of = has_offsets ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr;
  return run(x, N, [&](int64_t n, int64_t t, int rows, float* out) {
    const float* xt = xs + t * K;
    const float* st = ss ? ss + t * groups : nullptr;
    const uint8_t* qn = qs + n * (K / 2);
    const uint16_t* sn = sc + n * groups;
    const uint16_t* on = of ? of + n * groups : nullptr;
    by_rows(rows, [&](auto r) {
      constexpr int R = decltype(r)::value;
      if (wide) nibble_row_wide<R>(xt, K, qn, sn, on, zero, out, N);
      else if (shifted) nibble_row<R, true>(xt, K, st, qn, sn, on, zero, out, N);
      else nibble_row<R, false>(xt, K, st, qn, sn, on, zero, out, N);
    });
  });
}

at::Tensor byte_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check(x, q, scales, x.size(1));
  TORCH_CHECK(q.scalar_type() == at::kChar, "q: int8");
  const int64_t K = x.size(1), N = q.size(0), groups = K / GROUP;
  const float* xs = x.data_ptr<float>();
  const int8_t* qs = q.data_ptr<int8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const bool wide = bits_in_use == 512;
  return run(x, N, [&](int64_t n, int64_t t, int rows, float* out) {
    by_rows(rows, [&](auto r) {
      constexpr int R = decltype(r)::value;
      if (wide) byte_row_wide<R>(xs + t * K, K, qs + n * K, sc + n * groups, out, N);
      else byte_row<R>(xs + t * K, K, qs + n * K, sc + n * groups, out, N);
    });
  });
}

}  // namespace

TORCH_LIBRARY(iterserve_cpu, m) {
  m.def("nibble_mm(Tensor x, Tensor q, Tensor scales, Tensor? offsets, int zero_point) -> Tensor");
  m.def("byte_mm(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("vector_bits(int requested) -> int", &vector_bits);  // (no tensors: one kernel for every backend)
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) {
  m.impl("nibble_mm", &nibble_mm);
  m.impl("byte_mm", &byte_mm);
}
