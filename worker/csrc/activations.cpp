// SiLU(gate) * up, the compiled forward's MLP activation (worker/compiled.py): gate_up [T, 2I]
// (gate, then up, as the merged projection writes them) -> [T, I] in its dtype, in float32 as
// Inductor's fused loop computes it (SiLU not rounded before the product).
//
// Inductor's loop takes Sleef's exp and a division: on SmolLM2's bf16 prefill steps (2,048 x
// 1,536 a layer) 39 ms a step of 30 layers, where a plain add of the same halves took 14. Here
// 2^y is exp.h's polynomial on y's fraction scaled by its integer part (within 2 ulp of expf),
// and 1 / (1 + e) a reciprocal estimate refined once (within 1 ulp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "exp.h"

namespace {

template <typename T>
void silu_mul_scalar(const T* g, const T* u, T* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = float(g[i]);
    o[i] = T(x / (1.f + std::exp(-x)) * float(u[i]));
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 k) {
  // rounded to nearest even, a NaN kept a (quiet) NaN: as at::BFloat16(float)
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, k, (__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(r));
#endif
}

// x * sigmoid(x) * up on 16 lanes
inline __m512 silu_mul16(__m512 x, __m512 up) {
  // e^-x = 2^y, y = -x log2(e) = n + f (n an integer, |f| <= 1/2), f in two fmas against log2(e)
  // split in two (one product rounded would put |y| ulp of error into e); x clamped so that no
  // infinity reaches the polynomial: x <= -88 gives e = inf, 1 / (1 + e) = 0 (SiLU -0 where
  // torch's is under 1e-36, NaN at -inf as torch's), x = inf gives inf
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-138.f)), _mm512_set1_ps(138.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(-1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(xc, _mm512_set1_ps(1.925963033500011e-08f),
                                    _mm512_fnmsub_ps(xc, _mm512_set1_ps(1.44269502162933349609375f), n));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_scalef_ps(pow2_frac16(f), n));  // 1 + e^-x
  __m512 r = _mm512_rcp14_ps(d);
  // one Newton step: 1 / d; 0 where d = inf (the step would make it NaN)
  const __mmask16 finite = _mm512_cmp_ps_mask(d, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  r = _mm512_maskz_fmadd_ps(finite, r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r);
  return _mm512_mul_ps(_mm512_mul_ps(x, r), up);
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    store16(o + i, silu_mul16(load16(g + i, k), load16(u + i, k)), k);
  }
}
#endif

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I) {
  // rows split so that a task holds at least 16 K values (a decode step of a few rows: one thread)
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / I), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const T* g = x + r * 2 * I;
#if defined(__AVX512F__)
      silu_mul_row(g, g + I, out + r * I, I);
#else
      silu_mul_scalar(g, g + I, out + r * I, I);
#endif
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [T, 2I]");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16, "silu_mul: float32 or bf16");
  const at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({rows, I}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, I);
  else
    silu_mul_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, I);
  return out;
}

}  // namespace

// declared in worker/native.py (the graph is traced before this library is built)
TORCH_LIBRARY_IMPL(tokenq_native, CPU, m) { m.impl("silu_mul", silu_mul); }
