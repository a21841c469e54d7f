// Projections over a GGUF's weights kept packed (`--quantization gguf`), for x86 CPUs with AVX2, FMA
// and F16C, where torch's int4 kernel is slow (services/worker/cpu_kernels.py builds and loads this):
// x [T, K] float32 times W.T, W [N, K] held as llama.cpp holds it, 32 weights a group with a float16
// scale (and offset), w = scale (q - zero point) + offset; q 4-bit (Q4_0, Q4_1) or a signed byte (Q8_0). The
// weights are decoded to float32 in registers and multiplied in float32: x @ W.T of the file's values
// up to float32 rounding, not llama.cpp's int8 products of a quantized x.
// Each output is summed in one fixed order whatever the rows of x or the threads (the threads split
// W's rows, never a sum), so a row's result does not depend on the other rows of its step.
#include <algorithm>

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
  at::Tensor sums = shifted ? group_sums(x) : at::Tensor();
  const float* xs = x.data_ptr<float>();
  const float* ss = shifted ? sums.data_ptr<float>() : nullptr;
  const uint8_t* qs = q.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* of = has_offsets ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr;
  return run(x, N, [&](int64_t n, int64_t t, int rows, float* out) {
    const float* xt = xs + t * K;
    const float* st = ss ? ss + t * groups : nullptr;
    const uint8_t* qn = qs + n * (K / 2);
    const uint16_t* sn = sc + n * groups;
    const uint16_t* on = of ? of + n * groups : nullptr;
    if (shifted) {
      switch (rows) {
        case 4: nibble_row<4, true>(xt, K, st, qn, sn, on, zero, out, N); break;
        case 3: nibble_row<3, true>(xt, K, st, qn, sn, on, zero, out, N); break;
        case 2: nibble_row<2, true>(xt, K, st, qn, sn, on, zero, out, N); break;
        default: nibble_row<1, true>(xt, K, st, qn, sn, on, zero, out, N);
      }
    } else {
      switch (rows) {
        case 4: nibble_row<4, false>(xt, K, st, qn, sn, on, zero, out, N); break;
        case 3: nibble_row<3, false>(xt, K, st, qn, sn, on, zero, out, N); break;
        case 2: nibble_row<2, false>(xt, K, st, qn, sn, on, zero, out, N); break;
        default: nibble_row<1, false>(xt, K, st, qn, sn, on, zero, out, N);
      }
    }
  });
}

at::Tensor byte_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check(x, q, scales, x.size(1));
  TORCH_CHECK(q.scalar_type() == at::kChar, "q: int8");
  const int64_t K = x.size(1), N = q.size(0), groups = K / GROUP;
  const float* xs = x.data_ptr<float>();
  const int8_t* qs = q.data_ptr<int8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  return run(x, N, [&](int64_t n, int64_t t, int rows, float* out) {
    switch (rows) {
      case 4: byte_row<4>(xs + t * K, K, qs + n * K, sc + n * groups, out, N); break;
      case 3: byte_row<3>(xs + t * K, K, qs + n * K, sc + n * groups, out, N); break;
      case 2: byte_row<2>(xs + t * K, K, qs + n * K, sc + n * groups, out, N); break;
      default: byte_row<1>(xs + t * K, K, qs + n * K, sc + n * groups, out, N);
    }
  });
}

}  // namespace

TORCH_LIBRARY(iterserve_cpu, m) {
  m.def("nibble_mm(Tensor x, Tensor q, Tensor scales, Tensor? offsets, int zero_point) -> Tensor");
  m.def("byte_mm(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve_cpu, CPU, m) {
  m.impl("nibble_mm", &nibble_mm);
  m.impl("byte_mm", &byte_mm);
}
