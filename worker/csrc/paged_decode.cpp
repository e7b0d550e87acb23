// Paged decode attention on CPU: one query token per sequence against its KV pages.
//
// For each (sequence, kv head) the g query heads that share that kv head are scored
// against the sequence's slots page by page, with an online softmax (running max and
// denominator, float32 throughout), so each K/V slot is read once, from the pool in place,
// and converted to float32 in a small per-page buffer. Work items are split between the
// threads by the number of slots they read, not by count (contexts differ by 10x or more).
// With AVX-512 (float32 and bf16, head sizes 64 and 128, no soft-cap) the slots are scored
// 16 at a time on vector registers (attend_avx512); elsewhere a portable loop the compiler
// vectorises (attend_one). Built and loaded by worker/native.py; worker/attention.py's torch
// path is the reference both are tested against (tests/test_native.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for x <= 0 (a score minus its running max), to about 1 ulp: 2^(x log2 e) split
// into 2^n (the exponent bits) times 2^f, f in [-0.5, 0.5], by Cephes' exp2f polynomial.
// Written so the compiler vectorises it; std::exp is a scalar call and was half the kernel.
inline float exp_neg(float x) {
  x = x < -87.f ? -87.f : x;  // keeps 2^n a normal float; exp(-87) is 1e-38, nothing next to the max's 1
  const float y = x * 1.44269504088896341f;
  const float n = __builtin_floorf(y + 0.5f);
  const float f = y - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  union { int32_t i; float f; } scale;
  scale.i = (int32_t(n) + 127) << 23;
  return p * scale.f;
}

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = uint32_t(s[i]) << 16;
}

inline void to_float(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// One (sequence, kv head): its g query heads (qf, float32) against the slots [lo, hi) of its
// pages; writes the g output rows (unnormalised sums in acc, then divided). DC is the head size
// when known at compile time (64, 128: the loops over it unroll and acc stays in registers),
// else 0 and D is read at run time.
template <typename T, int DC>
void attend_one(const float* __restrict qf, const T* kp, const T* vp, const int64_t* table, int64_t lo, int64_t hi,
                int64_t g, int64_t D_, int64_t ps, int64_t page_stride, int64_t head_off, float fscale, float fcap,
                const float* sinks, float* __restrict acc, float* __restrict kf, float* __restrict vf,
                float* __restrict s, float* __restrict m, float* __restrict l) {
  const int64_t D = DC ? DC : D_;
  for (int64_t j = 0; j < g; ++j) {
    m[j] = sinks ? sinks[j] : -std::numeric_limits<float>::infinity();
    l[j] = 0.f;
  }
  std::fill(acc, acc + g * D, 0.f);
  for (int64_t p0 = lo - lo % ps; p0 < hi; p0 += ps) {
    const int64_t a = std::max(p0, lo) - p0, b = std::min(p0 + ps, hi) - p0, len = b - a;  // slots [a, b) of the page
    const int64_t base = table[p0 / ps] * page_stride + head_off + a * D;
    if (p0 + ps < hi) {  // the next page's rows, fetched while this one is computed (pages lie anywhere)
      const int64_t next = table[p0 / ps + 1] * page_stride + head_off;
      const char* kn = reinterpret_cast<const char*>(kp + next);
      const char* vn = reinterpret_cast<const char*>(vp + next);
      for (int64_t x = 0; x < int64_t(ps * D * sizeof(T)); x += 64) {
        __builtin_prefetch(kn + x);
        __builtin_prefetch(vn + x);
      }
    }
    to_float(kp + base, kf, len * D);
    to_float(vp + base, vf, len * D);
    for (int64_t t = 0; t < len; ++t) {  // the slot's key row is read once for the g heads
      const float* __restrict kt = kf + t * D;
      for (int64_t j = 0; j < g; ++j) {
        const float* __restrict qj = qf + j * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qj[d] * kt[d];
        s[j * ps + t] = dot;
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      float* __restrict sj = s + j * ps;
      float mx = m[j];
      if (fcap > 0) {
        for (int64_t t = 0; t < len; ++t) sj[t] = std::tanh(sj[t] * fscale / fcap) * fcap;
      } else {
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sj[t] *= fscale;
      }
      for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sj[t]);
      const float corr = std::exp(m[j] - mx);  // 0 on the first page (m = -inf) unless a sink set m
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < len; ++t) {
        sj[t] = exp_neg(sj[t] - mx);
        sum += sj[t];
      }
      l[j] = l[j] * corr + sum;
      m[j] = mx;
      float* __restrict aj = acc + j * D;
      float reg[DC ? DC : 1];  // the row's sums, kept in registers across the page's slots
      float* __restrict r = DC ? reg : aj;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) r[d] = aj[d] * corr;
      for (int64_t t = 0; t < len; ++t) {
        const float w = sj[t];
        const float* __restrict vt = vf + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) r[d] += w * vt[d];
      }
      if (DC) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) aj[d] = r[d];
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const float denom = l[j] + (sinks ? std::exp(sinks[j] - m[j]) : 0.f);
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= inv;
  }
}


#if defined(__AVX512F__)
#include <immintrin.h>

// The AVX-512 path: slots are scored 16 at a time. Each slot's dot product is a few FMAs
// into its own accumulator (bf16 K with AVX512-BF16: dot products of bf16 pairs straight
// from the pool, no conversion), the 16 accumulators are summed across their lanes
// together by a shuffle tree (2 shuffles a slot instead of a horizontal sum each), and the
// softmax and the weighted sum of V run on whole vectors of slots.

// bf16 or float32 row chunk c (16 values) as float32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// Lane k of the result is the sum of the lanes of v[PERM[k]] (PERM is its own inverse: store
// slot t's accumulator at v[PERM[t]] and lane t holds slot t's sum).
constexpr int PERM[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[i], x[i + 2]), _mm512_unpackhi_ps(x[i], x[i + 2]));
  const __m512d a = _mm512_castps_pd(y[0]), b = _mm512_castps_pd(y[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

// exp_neg on 16 lanes (the same polynomial)
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Scores of slots [0, len) (len <= 16) of one block for query head q: lane t = q . k_t.
// C = D / 16 chunks a row. qf: the head's query in float32; qb: the same in bf16 pairs.
template <typename T, int C>
inline __m512 scores16(const float* qf, const uint16_t* qb, const T* k, int64_t len) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    // 32 bf16 a chunk pair: C / 2 dot-product steps a slot
    __m512bh qv[C / 2];
    for (int c = 0; c < C / 2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qb + 32 * c);
    for (int64_t t = 0; t < len; ++t) {
      const T* kt = k + t * 16 * C;
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < C / 2; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(kt + 32 * c));
      acc[PERM[t]] = a;
    }
    return reduce16(acc);
  }
#endif
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qf + 16 * c);
  for (int64_t t = 0; t < len; ++t) {
    const T* kt = k + t * 16 * C;
    __m512 a = _mm512_mul_ps(qv[0], load16(kt));
    for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], load16(kt + 16 * c), a);
    acc[PERM[t]] = a;
  }
  return reduce16(acc);
}

// One (sequence, kv head) as attend_one, for head sizes D = 16 * C, no soft-cap.
template <typename T, int C>
void attend_avx512(const float* __restrict qf, const uint16_t* qb, const T* kp, const T* vp, const int64_t* table,
                   int64_t lo, int64_t hi, int64_t g, int64_t ps, int64_t page_stride, int64_t head_off, float fscale,
                   const float* sinks, float* __restrict acc, float* __restrict vf, float* __restrict pbuf,
                   float* __restrict cbuf, float* __restrict m, float* __restrict l) {
  constexpr int D = 16 * C;
  for (int64_t j = 0; j < g; ++j) {
    m[j] = sinks ? sinks[j] : -std::numeric_limits<float>::infinity();
    l[j] = 0.f;
  }
  std::fill(acc, acc + g * D, 0.f);
  const __m512 vscale = _mm512_set1_ps(fscale);
  for (int64_t p0 = lo - lo % ps; p0 < hi; p0 += ps) {
    const int64_t pa = std::max(p0, lo) - p0, pb = std::min(p0 + ps, hi) - p0;  // slots [pa, pb) of the page
    const int64_t page = table[p0 / ps] * page_stride + head_off;
    if (p0 + ps < hi) {  // the next page's rows, fetched while this one is computed (pages lie anywhere;
      // measured: fetching two or three pages ahead is no faster)
      const int64_t next = table[p0 / ps + 1] * page_stride + head_off;
      const char* kn = reinterpret_cast<const char*>(kp + next);
      const char* vn = reinterpret_cast<const char*>(vp + next);
      for (int64_t x = 0; x < int64_t(ps * D * sizeof(T)); x += 64) {
        _mm_prefetch(kn + x, _MM_HINT_T0);
        _mm_prefetch(vn + x, _MM_HINT_T0);
      }
    }
    for (int64_t a = pa; a < pb; a += 16) {
      const int64_t len = std::min<int64_t>(16, pb - a);
      const __mmask16 valid = __mmask16((1u << len) - 1);
      const T* kb = kp + page + a * D;
      const T* vb = vp + page + a * D;
      // scores and softmax of the block for each of the g heads: weights in pbuf[j * 16 + t]
      for (int64_t j = 0; j < g; ++j) {
        __m512 s = _mm512_mul_ps(scores16<T, C>(qf + j * D, qb + j * D, kb, len), vscale);
        s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s);
        const float mx = std::max(m[j], _mm512_reduce_max_ps(s));
        const float corr = std::exp(m[j] - mx);  // 0 on the first block (m = -inf) unless a sink set m
        const __m512 p = _mm512_maskz_mov_ps(valid, exp_neg16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
        l[j] = l[j] * corr + _mm512_reduce_add_ps(p);
        m[j] = mx;
        _mm512_storeu_ps(pbuf + j * 16, p);
        cbuf[j] = corr;
      }
      // the weighted sum of V rows: each row converted once, into registers, for all g heads
      // when their sums fit in registers (g * C <= 24), else head by head
      if (g * C <= 24) {
        __m512 o[24];
        for (int64_t j = 0; j < g; ++j) {
          const __m512 vc = _mm512_set1_ps(cbuf[j]);
          for (int c = 0; c < C; ++c) o[j * C + c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + 16 * c), vc);
        }
        for (int64_t t = 0; t < len; ++t) {
          __m512 v[C];
          for (int c = 0; c < C; ++c) v[c] = load16(vb + t * D + 16 * c);
          for (int64_t j = 0; j < g; ++j) {
            const __m512 w = _mm512_set1_ps(pbuf[j * 16 + t]);
            for (int c = 0; c < C; ++c) o[j * C + c] = _mm512_fmadd_ps(w, v[c], o[j * C + c]);
          }
        }
        for (int64_t j = 0; j < g; ++j)
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * D + 16 * c, o[j * C + c]);
      } else {
        const float* vrows;  // the block's V rows in float32, once for the g heads
        if constexpr (std::is_same_v<T, float>) {
          vrows = vb;
        } else {
          for (int64_t t = 0; t < len; ++t)
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(vf + t * D + 16 * c, load16(vb + t * D + 16 * c));
          vrows = vf;
        }
        for (int64_t j = 0; j < g; ++j) {
          __m512 o[C];
          const __m512 vc = _mm512_set1_ps(cbuf[j]);
          for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + 16 * c), vc);
          for (int64_t t = 0; t < len; ++t) {
            const __m512 w = _mm512_set1_ps(pbuf[j * 16 + t]);
            for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vrows + t * D + 16 * c), o[c]);
          }
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * D + 16 * c, o[c]);
        }
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const float denom = l[j] + (sinks ? std::exp(sinks[j] - m[j]) : 0.f);
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= inv;
  }
}
#endif  // __AVX512F__

template <typename T>
void decode(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const int64_t* tables,
            const int64_t* offsets, const int64_t* ctx, torch::Tensor& out, double scale, int64_t window,
            double softcap, const float* sinks) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t kvh = kc.size(1), ps = kc.size(2), g = H / kvh;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t page_stride = kc.stride(0), head_stride = kc.stride(1);  // the same for vc (checked by the caller)
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float fscale = float(scale), fcap = float(softcap);

  // first attended slot of each sequence (the sliding window), and the slots it reads
  std::vector<int64_t> first(n), cost(n * kvh + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    first[i] = window > 0 ? std::max<int64_t>(0, ctx[i] - window) : 0;
    for (int64_t h = 0; h < kvh; ++h) cost[i * kvh + h + 1] = cost[i * kvh + h] + (ctx[i] - first[i]) + 8;
  }
  const int64_t items = n * kvh;
  const int64_t parts = std::min<int64_t>(items, 4 * at::get_num_threads());
  // part p takes the items whose cumulative cost starts in [p, p + 1) * total / parts
  std::vector<int64_t> bound(parts + 1, items);
  bound[0] = 0;
  for (int64_t p = 1, it = 0; p < parts; ++p) {
    const int64_t target = cost[items] * p / parts;
    while (it < items && cost[it] < target) ++it;
    bound[p] = it;
  }
  auto one = D == 64 ? attend_one<T, 64> : D == 128 ? attend_one<T, 128> : attend_one<T, 0>;

#if defined(__AVX512F__)
  // the vector path: float32 / bf16, head sizes 64 and 128, no soft-cap
  decltype(&attend_avx512<T, 4>) fast = nullptr;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    if (fcap <= 0) fast = D == 64 ? attend_avx512<T, 4> : D == 128 ? attend_avx512<T, 8> : nullptr;
  }
#endif

  at::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
    std::vector<float> qf(g * D), acc(g * D), kf(std::max(ps * D, g)), vf(std::max<int64_t>(ps, 16) * D), s(g * std::max<int64_t>(ps, 16)),
        m(g), l(g);
    std::vector<uint16_t> qb(g * D);
    for (int64_t item = bound[pb]; item < bound[pe]; ++item) {
      const int64_t i = item / kvh, h = item % kvh;
      for (int64_t j = 0; j < g; ++j) {
        const T* src = qp + i * qs0 + (h * g + j) * qs1;
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = float(src[d * qs2]);
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          for (int64_t d = 0; d < D; ++d) qb[j * D + d] = reinterpret_cast<const uint16_t*>(src)[d * qs2];
        }
      }
#if defined(__AVX512F__)
      if (fast) {
        fast(qf.data(), qb.data(), kp, vp, tables + offsets[i], first[i], ctx[i], g, ps, page_stride, h * head_stride,
             fscale, sinks ? sinks + h * g : nullptr, acc.data(), vf.data(), s.data(), kf.data(), m.data(), l.data());
      } else
#endif
      one(qf.data(), kp, vp, tables + offsets[i], first[i], ctx[i], g, D, ps, page_stride, h * head_stride, fscale,
          fcap, sinks ? sinks + h * g : nullptr, acc.data(), kf.data(), vf.data(), s.data(), m.data(), l.data());
      T* dst = op + (i * H + h * g) * D;
      for (int64_t x = 0; x < g * D; ++x) dst[x] = T(acc[x]);
    }
  });
}

}  // namespace

// q [n, H, D] (any strides); kc, vc [pages, kv_heads, page_size, D] contiguous; tables: the
// sequences' block tables one after the other, offsets [n + 1] where each starts; ctx [n]
// the slots each attends (its own new token included, already written). window <= 0: none;
// softcap <= 0: none; sinks: [H] float32 or an empty tensor. Returns [n, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                           torch::Tensor offsets, torch::Tensor ctx, double scale, int64_t window, double softcap,
                           torch::Tensor sinks) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes(), "kc, vc: contiguous, same shape");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && kc.scalar_type() == vc.scalar_type(), "q, kc, vc: one dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong,
              "tables, offsets, ctx: int64");
  TORCH_CHECK(q.size(1) % kc.size(1) == 0 && q.size(2) == kc.size(3), "q's heads and head size do not fit the pool");
  auto t = tables.contiguous(), o = offsets.contiguous(), c = ctx.contiguous();
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  torch::Tensor sk;
  const float* sp = nullptr;
  if (sinks.numel()) {
    sk = sinks.to(at::kFloat).contiguous();
    sp = sk.data_ptr<float>();
  }
  const int64_t *tp = t.data_ptr<int64_t>(), *opp = o.data_ptr<int64_t>(), *cp = c.data_ptr<int64_t>();
  switch (q.scalar_type()) {
    case at::kFloat: decode<float>(q, kc, vc, tp, opp, cp, out, scale, window, softcap, sp); break;
    case at::kBFloat16: decode<at::BFloat16>(q, kc, vc, tp, opp, cp, out, scale, window, softcap, sp); break;
    case at::kHalf: decode<at::Half>(q, kc, vc, tp, opp, cp, out, scale, window, softcap, sp); break;
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

// The step's new keys and values into their slots: token t's heads go to (pages[t], offs[t]).
// k, v [T, kv_heads, D] (any strides); kc, vc [pages, kv_heads, page_size, D] contiguous.
// (An advanced-indexing assignment did this at 35 us a layer for 64 decodes and 280 us for a
// 2048-token prefill, its source transposed; here it is one row copy per token and head.)
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor pages,
              torch::Tensor offs) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes(), "kc, vc: contiguous, same shape");
  TORCH_CHECK(k.scalar_type() == kc.scalar_type() && v.scalar_type() == kc.scalar_type(), "k, v, kc, vc: one dtype");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == kc.size(1) && k.size(2) == kc.size(3), "k, v do not fit the pool");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k, v: head rows contiguous");
  auto pg = pages.contiguous(), of = offs.contiguous();
  TORCH_CHECK(pg.scalar_type() == at::kLong && of.scalar_type() == at::kLong && pg.numel() == k.size(0) &&
              of.numel() == k.size(0), "pages, offs: int64, one per token");
  const int64_t T = k.size(0), kvh = k.size(1), D = k.size(2), P = kc.size(0), ps = kc.size(2);
  const int64_t *pp = pg.data_ptr<int64_t>(), *op = of.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < P && op[t] >= 0 && op[t] < ps, "write_kv: slot out of the pool");
  const int64_t row = D * kc.element_size();
  const int64_t ks0 = k.stride(0) * k.element_size(), ks1 = k.stride(1) * k.element_size();
  const int64_t vs0 = v.stride(0) * v.element_size(), vs1 = v.stride(1) * v.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kcp = static_cast<char*>(kc.data_ptr());
  char* vcp = static_cast<char*>(vc.data_ptr());
  at::parallel_for(0, T, 256, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t)
      for (int64_t h = 0; h < kvh; ++h) {
        const int64_t dst = ((pp[t] * kvh + h) * ps + op[t]) * row;
        std::memcpy(kcp + dst, kp + t * ks0 + h * ks1, row);
        std::memcpy(vcp + dst, vp + t * vs0 + h * vs1, row);
      }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("write_kv", &write_kv, "the step's keys and values into their slots (CPU)");
}
