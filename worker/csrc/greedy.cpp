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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenq_native, m) {
  m.def("argmax_supported(ScalarType dtype) -> bool", argmax_supported);
  m.def("argmax_rows(Tensor logits) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenq_native, CPU, m) { m.impl("argmax_rows", argmax_rows); }
