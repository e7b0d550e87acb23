// 2^f for |f| <= 1/2 on 16 lanes, within 2 ulp of float32's: the polynomial the exps here share
// (paged_attention.cpp's softmaxes, activations.cpp's SiLU), each scaling it by 2^n itself.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

inline __m512 pow2_frac16(__m512 f) {
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}
#endif
