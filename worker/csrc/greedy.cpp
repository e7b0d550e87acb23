// Greedy picks: the index of each row's largest logit, for worker/sampler.py.
//
// torch's max(dim) on a SmolLM2 decode step's logits (64 x 49152 bf16) took about 2 ms on the
// Intel machine (AVX-512, 2 cores), 3-4% of the step; the logits are 6 MB that the LM head has
// just written, so two vector passes over each row (its largest value, then the first place
// it occurs) run at cache speed. The answer is torch's: the first of equal maxima, and a row
// holding a NaN answers its first NaN (torch's max propagates NaN).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float value(const T* x, int64_t i) {
  return float(x[i]);
}

// the first NaN's index, else the first index of the largest value: one scalar pass
template <typename T>
int64_t argmax_scalar(const T* x, int64_t n) {
  int64_t best = 0;
  float m = value(x, 0);
  for (int64_t i = 0; i < n; ++i) {
    const float v = value(x, i);
    if (std::isnan(v)) return i;
    if (v > m) m = v, best = i;
  }
  return best;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 k) { return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 k) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
  // masked-off lanes: -inf (0xFF80 as bf16)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_mask_blend_epi32(k, _mm512_set1_epi32(0xFF80), w), 16));
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = load16(x + i, k);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  if (nan) return argmax_scalar(x, n);
  const float M = _mm512_reduce_max_ps(mx);
  const __m512 vm = _mm512_set1_ps(M);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __mmask16 eq = _mm512_mask_cmp_ps_mask(k, load16(x + i, k), vm, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
  return 0;  // every value -inf: the first
}
#else
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  return argmax_scalar(x, n);
}
#endif

// Whether this build's rows run on vectors (else torch's max is as fast: the caller keeps it).
bool argmax_supported(c10::ScalarType dtype) {
#if defined(__AVX512F__)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  return false;
#endif
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits [rows, vocab]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "argmax_rows: float32 or bfloat16, not ", logits.scalar_type());
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      if (x.scalar_type() == at::kFloat)
        o[r] = argmax_row(x.data_ptr<float>() + r * n, n);
      else
        o[r] = argmax_row(x.data_ptr<at::BFloat16>() + r * n, n);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------- screened picks

// The greedy picks of a float32 LM head from its bf16 approximation (worker/screened_head.py):
// approx [S, V] is bf16(h) times bf16(W)^T, the products summed in float32 and each sum rounded
// to bf16. Each entry is within
//     eps_j = c1 * |h| * |w_j| + 2^-8 * |approx_j|
// of the exact product h . w_j, where c1 = 1.01 * 2^-8 + d * 2^-23:
//   - rounding h_i and w_ij to bf16 (2^-9 each, relative) moves each product by at most
//     (2^-8 + 2^-18) |h_i w_ij|; the product of two bf16 values is exact in float32;
//   - summing d of them in float32, in any order, adds at most d 2^-24 sum |h_i w_ij|, and
//     sum |h_i w_ij| <= |h| |w_j| (Cauchy-Schwarz);
//   - rounding the sum to bf16 moves it by at most 2^-9 of itself;
// each term taken twice over but the first (1.01: the norms' own rounding), and an absolute
// 1e-30 for the denormals that bf16 dot products flush. So only a j whose upper bound
// approx_j + eps_j reaches the row's largest lower bound can hold the largest exact product
// (or the largest float32 GEMM output, which is within d 2^-24 |h| |w_j| of it). Those few (a
// mean of 2-14 a row on the bench's models) are computed again in float32 from h and W, in
// ascending j, and the largest is the pick: the first of equal maxima, as argmax_rows. A row
// whose h or approximations are not finite is computed whole (its first NaN, as argmax_rows).
namespace screen {

inline float dot(const float* a, const float* b, int64_t d) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < d) {
    const __mmask16 k = __mmask16((1u << (d - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
#endif
}

// argmax_scalar over the row's exact products, all V of them
int64_t whole_row(const float* h, const float* w, int64_t V, int64_t d) {
  int64_t best = 0;
  float m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) {
    const float v = dot(h, w + j * d, d);
    if (std::isnan(v)) return j;
    if (v > m || j == 0) m = v, best = j;
  }
  return best;
}

constexpr float kSlack = 1e-30f;
constexpr float kOut = 1.f / 256;  // 2^-8: twice the bf16 rounding of the sum

int64_t pick(const at::BFloat16* A, const float* h, const float* w, const float* wn, int64_t V, int64_t d) {
  double hh = 0;
  for (int64_t i = 0; i < d; ++i) hh += double(h[i]) * h[i];
  const double a = (1.01 / 256 + double(d) / (1 << 23)) * std::sqrt(hh);
  if (!std::isfinite(a)) return whole_row(h, w, V, d);
  const float af = float(a) * (1 + 1e-6f);
  float lo = -INFINITY;
#if defined(__AVX512F__)
  const __m512 va = _mm512_set1_ps(af), vout = _mm512_set1_ps(kOut), vslack = _mm512_set1_ps(kSlack);
  auto band = [&](int64_t j, __mmask16 k, __m512& x) {  // x = approx, returns eps (lanes outside k: 0)
    x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, A + j)), 16));
    const __m512 e = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(k, wn + j), _mm512_fmadd_ps(vout, _mm512_abs_ps(x), vslack));
    return e;
  };
  __m512 vlo = _mm512_set1_ps(-INFINITY);
  __mmask16 bad = 0;
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 k = V - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - j)) - 1);
    __m512 x;
    const __m512 e = band(j, k, x);
    bad |= _mm512_mask_cmp_ps_mask(k, _mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_NEQ_UQ);  // inf or NaN
    vlo = _mm512_mask_max_ps(vlo, k, vlo, _mm512_sub_ps(x, e));
  }
  if (bad) return whole_row(h, w, V, d);
  lo = _mm512_reduce_max_ps(vlo);
  const __m512 vl = _mm512_set1_ps(lo);
  int64_t best = -1;
  float m = -INFINITY;
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 k = V - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - j)) - 1);
    __m512 x;
    const __m512 e = band(j, k, x);
    for (__mmask16 c = _mm512_mask_cmp_ps_mask(k, _mm512_add_ps(x, e), vl, _CMP_GE_OQ); c; c &= c - 1) {
      const int64_t t = j + __builtin_ctz(c);
      const float v = dot(h, w + t * d, d);
      if (std::isnan(v)) return whole_row(h, w, V, d);
      if (best < 0 || v > m) m = v, best = t;
    }
  }
  return best;
#else
  auto eps = [&](int64_t j, float x) { return af * wn[j] + kOut * std::fabs(x) + kSlack; };
  for (int64_t j = 0; j < V; ++j) {
    const float x = float(A[j]);
    if (!std::isfinite(x)) return whole_row(h, w, V, d);
    lo = std::max(lo, x - eps(j, x));
  }
  int64_t best = -1;
  float m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) {
    const float x = float(A[j]);
    if (x + eps(j, x) < lo) continue;
    const float v = dot(h, w + j * d, d);
    if (std::isnan(v)) return whole_row(h, w, V, d);
    if (best < 0 || v > m) m = v, best = j;
  }
  return best;
#endif
}

}  // namespace screen

// approx [S, V] bf16, h [S, d] float32, w [V, d] float32, wn [V] float32 (|w_j|; c1 allows for its rounding) -> [S]
at::Tensor screened_argmax(const at::Tensor& approx, const at::Tensor& h, const at::Tensor& w, const at::Tensor& wn) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kBFloat16, "screened_argmax: approx [S, V] bf16");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.size(0) == approx.size(0),
              "screened_argmax: h [S, d] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) == approx.size(1) && w.size(1) == h.size(1),
              "screened_argmax: w [V, d] float32");
  TORCH_CHECK(wn.dim() == 1 && wn.scalar_type() == at::kFloat && wn.size(0) == w.size(0), "screened_argmax: wn [V]");
  TORCH_CHECK(approx.size(1) > 0, "screened_argmax: an empty vocabulary");
  const auto A = approx.contiguous(), hc = h.contiguous(), wc = w.contiguous(), nc = wn.contiguous();
  const int64_t S = A.size(0), V = A.size(1), d = hc.size(1);
  auto out = at::empty({S}, hc.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      o[r] = screen::pick(A.data_ptr<at::BFloat16>() + r * V, hc.data_ptr<float>() + r * d, wc.data_ptr<float>(),
                          nc.data_ptr<float>(), V, d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenq_native, m) {
  m.def("argmax_supported(ScalarType dtype) -> bool", argmax_supported);
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("screened_argmax(Tensor approx, Tensor h, Tensor w, Tensor wn) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenq_native, CPU, m) {
  m.impl("argmax_rows", argmax_rows);
  m.impl("screened_argmax", screened_argmax);
}
