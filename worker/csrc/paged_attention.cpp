// Paged attention on CPU, reading the KV pool in place: decode (one query token per sequence
// against its pages), prefill chunks (further below), and the step's K/V writes (write_kv).
//
// Decode: for each (sequence, kv head) the g query heads that share that kv head are scored
// against the sequence's slots page by page, float32 throughout, so each K/V slot is read
// once, from the pool in place. A work item is one (sequence, kv head), or on AMD's vector
// paths with many sequences a whole sequence, its kv heads page by page (see decode). Work items
// are split between the threads by the number of slots they read, not by count (contexts differ
// by 10x or more). With AVX-512 or AVX2 (float32 and bf16, head sizes 32, 64, 128 and 256, no
// soft-cap) in two passes on vector registers (attend_avx512, attend_avx2: all scores, their
// softmax, then V; in bf16 with AMX the scores are tile products, attend_amx); elsewhere a
// portable loop the compiler vectorises, with an online softmax page by page (attend_one).
// Built and loaded by worker/native.py; worker/attention.py's torch path is the reference all
// are tested against (tests/test_native.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
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

inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(at::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

// The layout of a step's prefill work, shared by the vector paths' prefill kernels: each chunk's
// first row in q and its slots rounded up to the key block bk; where each (chunk, kv head)'s
// transposed keys start in the float32 tiles (ktoff); the work items (chunk, kv head, block of
// bq positions) and the parts the threads take, split by the keys each item reads
// (part p: items [bound[p], bound[p + 1])).
struct PrefillPlan {
  struct Item {
    int64_t c, h, p0, p1;
  };
  std::vector<int64_t> row0, span, ktoff, bound;
  std::vector<Item> items;
};

inline PrefillPlan plan_prefill(const int64_t* starts, const int64_t* lens, int64_t C, int64_t kvh, int64_t D,
                                int64_t window, int64_t bq, int64_t bk) {
  PrefillPlan pl;
  pl.row0.assign(C + 1, 0);
  pl.span.resize(C);
  for (int64_t c = 0; c < C; ++c) {
    pl.row0[c + 1] = pl.row0[c] + lens[c];
    pl.span[c] = (starts[c] + lens[c] + bk - 1) / bk * bk;
  }
  pl.ktoff.assign(C * kvh + 1, 0);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t h = 0; h < kvh; ++h) pl.ktoff[c * kvh + h + 1] = pl.ktoff[c * kvh + h] + D * pl.span[c];
  std::vector<int64_t> cost(1, 0);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t i = 0; i < lens[c]; i += bq) {
        const int64_t p0 = starts[c] + i, p1 = starts[c] + std::min(lens[c], i + bq);
        pl.items.push_back({c, h, p0, p1});
        const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
        cost.push_back(cost.back() + (p1 - lo) + bk);
      }
  const int64_t n_items = pl.items.size();
  const int64_t parts = std::min<int64_t>(n_items, 8 * at::get_num_threads());
  pl.bound.assign(parts + 1, n_items);
  pl.bound[0] = 0;
  for (int64_t p = 1, it = 0; p < parts; ++p) {
    const int64_t target = cost[n_items] * p / parts;
    while (it < n_items && cost[it] < target) ++it;
    pl.bound[p] = it;
  }
  return pl;
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


#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

// The decode kernels fetch pages PFD ahead of the one they read, a row's lines for each row
// read (issued all at once at a page's start, the prefetches held up the loads that needed
// the lines now). SmolLM2's shapes, 64 sequences of 310 tokens, 30 layers, Intel Xeon, 2
// threads: bf16 29.7 -> 25.7 ms, float32 46.7 -> 42.3 ms against one page ahead issued at
// once; a plain read of the same pages runs at 28 GB/s (16.3 ms).
constexpr int PFD = 2;

// Where those prefetches land: L1 on Intel (measured there as above), L2 on AMD. On an AMD EPYC
// (Zen 4, 2 threads, the shapes above at 340 tokens, 519 MB of bf16 pages) into L1 the decode
// kernel took 28-30 ms and 57 ms in float32, into L2 23.7-25.8 and 44-47 (into L3 25.7, past the
// caches 28-32); with the pages L3-hot, 22 against 36 GB/s: the L1 prefetches evicted lines
// still being read.
const bool kPrefetchL2 = [] {
  __builtin_cpu_init();
  return bool(__builtin_cpu_is("amd"));
}();

inline void prefetch_line(const char* p) {
  if (kPrefetchL2)
    _mm_prefetch(p, _MM_HINT_T1);
  else
    _mm_prefetch(p, _MM_HINT_T0);
}

// The head's part of `count` pages from slot p0 on (stopping at hi), all at once: the first
// pages a pass reads, before the pass prefetches a row at a time.
template <typename T>
inline void prefetch_pages(const T* pool, const int64_t* table, int64_t p0, int64_t hi, int64_t count, int64_t ps,
                           int64_t page_stride, int64_t head_off, int64_t D) {
  for (int64_t d = 0; d < count && p0 < hi; p0 += ps, ++d) {
    const char* c = reinterpret_cast<const char*>(pool + table[p0 / ps] * page_stride + head_off);
    for (int64_t x = 0; x < int64_t(ps * D * sizeof(T)); x += 64) prefetch_line(c + x);
  }
}

#endif

#if defined(__AVX512F__)

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

template <typename Op>  // op: _mm512_add_ps (reduce16) or _mm512_max_ps
inline __m512 reduce16_by(const __m512* v, Op op) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) w[i] = op(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i) x[i] = op(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) y[i] = op(_mm512_unpacklo_ps(x[i], x[i + 2]), _mm512_unpackhi_ps(x[i], x[i + 2]));
  const __m512d a = _mm512_castps_pd(y[0]), b = _mm512_castps_pd(y[1]);
  return op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

inline __m512 reduce16(const __m512* v) {
  return reduce16_by(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// exp_neg on 16 lanes (the same polynomial)
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(pow2_frac16(_mm512_sub_ps(y, n)), n);  // p * 2^n, exact (n >= -126: a normal power of two)
}

// Scores of slots [0, len) (len <= 16) of one block for query head q: lane t = q . k_t.
// C = D / 16 chunks a row. qf: the head's query in float32; qb: the same in bf16 pairs.
// pf (or null): the block PFD pages ahead, prefetched a row for each row scored.
template <typename T, int C>
inline __m512 scores16(const float* qf, const uint16_t* qb, const T* k, int64_t len, const char* pf) {
#if defined(__AVX512BF16__)
  constexpr bool pairs = std::is_same_v<T, at::BFloat16>;  // bf16 K: dot products of bf16 pairs
#else
  constexpr bool pairs = false;
#endif
  // the query: C / 2 vectors of 32 bf16 (pairs), else C vectors of 16 floats
  __m512 qv[C];
  for (int c = 0; c < (pairs ? C / 2 : C); ++c)
    qv[c] = pairs ? _mm512_castsi512_ps(_mm512_loadu_si512(qb + 32 * c)) : _mm512_loadu_ps(qf + 16 * c);
  // slot t's 16 lanes, whose sum is q . k_t
  auto slot = [&](int64_t t) {
    const T* kt = k + t * 16 * C;
    if (pf)
      for (int x = 0; x < int(16 * C * sizeof(T)); x += 64) prefetch_line(pf + t * 16 * C * sizeof(T) + x);
    __m512 a = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (pairs) {
      for (int c = 0; c < C / 2; ++c)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_castps_si512(qv[c]), (__m512bh)_mm512_loadu_si512(kt + 32 * c));
      return a;
    }
#endif
    for (int c = 0; c < C; ++c) a = _mm512_fmadd_ps(qv[c], load16(kt + 16 * c), a);
    return a;
  };
  __m512 acc[16];
  // A whole block (nearly every one): its slots known at compile time, acc stays on registers.
  // (With len a run-time bound acc lives on the stack, cleared by a call to memset, a KB a call:
  // 1-2% of a decode step's samples when every block went that way.)
  if (len == 16) {
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[PERM[t]] = slot(t);
    return reduce16(acc);
  }
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) acc[PERM[t]] = slot(t);
  return reduce16(acc);
}

// Pass 2 of the decode kernels: acc (g rows of D) = the weighted sum of the V rows of slots
// [lo, hi), head j's weight for slot lo + t at w[j * js + t * ts] (the softmax's numerators),
// then each row divided by its denominator (l, and the sink's share). With kvh > 1, the g rows
// of each of kvh kv heads (head_stride apart in a page), one page at a time. Each V row is
// converted once for all g heads, the next pages prefetched a row at a time.
template <typename T, int C>
void weigh_values(const T* vp, const int64_t* table, int64_t lo, int64_t hi, int64_t g, int64_t ps,
                  int64_t page_stride, int64_t head_off, const float* w, int64_t js, int64_t ts, const float* sinks,
                  const float* m, const float* l, float* __restrict acc, int64_t kvh = 1, int64_t head_stride = 0) {
  constexpr int D = 16 * C;
  std::fill(acc, acc + kvh * g * D, 0.f);
  for (int64_t p0 = lo - lo % ps; p0 < hi; p0 += ps) {
    const int64_t pa = std::max(p0, lo) - p0, pb = std::min(p0 + ps, hi) - p0;
    const int64_t at = p0 + pa - lo, len = pb - pa;
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t page = table[p0 / ps] * page_stride + head_off + h * head_stride;
      const char* vn = p0 + PFD * ps < hi
                           ? reinterpret_cast<const char*>(vp + table[p0 / ps + PFD] * page_stride + head_off +
                                                           h * head_stride + pa * D)
                           : nullptr;
      const T* vb = vp + page + pa * D;
      // JB heads at a time, their accumulators on registers (JB known at compile time)
      constexpr int JB = 24 / C < 1 ? 1 : 24 / C > 8 ? 8 : 24 / C;
      for (int64_t j0 = 0; j0 < g; j0 += JB) {
        const int64_t jn = std::min<int64_t>(JB, g - j0);
        const float* w0 = w + (h * g + j0) * js + at * ts;
        float* a0 = acc + (h * g + j0) * D;
        __m512 o[JB][C];
        for (int j = 0; j < JB; ++j)
          for (int c = 0; c < C; ++c) o[j][c] = j < jn ? _mm512_loadu_ps(a0 + j * D + 16 * c) : _mm512_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {
          if (vn && j0 == 0)
            for (int x = 0; x < int(D * sizeof(T)); x += 64) prefetch_line(vn + t * D * sizeof(T) + x);
          __m512 v[C];
          for (int c = 0; c < C; ++c) v[c] = load16(vb + t * D + 16 * c);
          for (int j = 0; j < JB; ++j) {
            if (j >= jn) break;
            const __m512 wt = _mm512_set1_ps(w0[j * js + t * ts]);
            for (int c = 0; c < C; ++c) o[j][c] = _mm512_fmadd_ps(wt, v[c], o[j][c]);
          }
        }
        for (int j = 0; j < JB && j < jn; ++j)
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(a0 + j * D + 16 * c, o[j][c]);
      }
    }
  }
  for (int64_t j = 0; j < kvh * g; ++j) {
    const float denom = l[j] + (sinks ? std::exp(sinks[j] - m[j]) : 0.f);
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= inv;
  }
}

// One (sequence, kv head) as attend_one, for head sizes D = 16 * C, no soft-cap: two passes.
// With kvh > 1, kvh kv heads of the sequence (head_stride apart in a page: rows h * g .. h * g +
// g - 1 of qf, acc, m and l are kv head h's), each pass taking every page's heads in turn.
// Pass 1 reads K and writes every slot's scores (g rows of hi - lo floats in pbuf); then the
// softmax of each row, on vectors; pass 2 reads V and sums its rows weighted (weigh_values).
// Each pass is a plain stream over the pages, PFD pages prefetched ahead. Decode attention is
// bound by reading K/V from memory (a SmolLM2 step at 64 sequences reads 0.8 GB in float32): with
// the online softmax's per-block horizontal reductions between the loads, the same kernel read
// scattered pages at 22 GB/s here; two passes, 26 (a plain scattered read tops out near 30).
template <typename T, int C>
void attend_avx512(const float* __restrict qf, const uint16_t* qb, const T* kp, const T* vp, const int64_t* table,
                   int64_t lo, int64_t hi, int64_t g, int64_t ps, int64_t page_stride, int64_t head_off, float fscale,
                   const float* sinks, float* __restrict acc, float* __restrict vf, float* __restrict pbuf,
                   float* __restrict cbuf, float* __restrict m, float* __restrict l, int64_t kvh = 1,
                   int64_t head_stride = 0) {
  constexpr int D = 16 * C;
  const int64_t n = hi - lo;
  // each head's row of scores in pbuf: a block starting at slot a of its page writes 16 lanes,
  // up to 15 past the row's last slot when the first page is entered part way (a window)
  const int64_t stride = ((n + 15) & ~int64_t(15)) + 16;
  const __m512 vscale = _mm512_set1_ps(fscale);
  // pass 1: scores
  for (int64_t h = 0; h < kvh; ++h)
    prefetch_pages(kp, table, lo - lo % ps + ps, hi, PFD - 1, ps, page_stride, head_off + h * head_stride, D);
  for (int64_t p0 = lo - lo % ps; p0 < hi; p0 += ps) {
    const int64_t pa = std::max(p0, lo) - p0, pb = std::min(p0 + ps, hi) - p0;
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t page = table[p0 / ps] * page_stride + head_off + h * head_stride;
      const char* kn = p0 + PFD * ps < hi ? reinterpret_cast<const char*>(kp + table[p0 / ps + PFD] * page_stride +
                                                                           head_off + h * head_stride)
                                          : nullptr;
      for (int64_t a = pa; a < pb; a += 16) {
        const int64_t len = std::min<int64_t>(16, pb - a);
        const T* kb = kp + page + a * D;
        const int64_t at = p0 + a - lo;
        const char* pf = kn ? kn + a * D * sizeof(T) : nullptr;
        for (int64_t j = h * g; j < h * g + g; ++j)
          _mm512_storeu_ps(pbuf + j * stride + at, _mm512_mul_ps(scores16<T, C>(qf + j * D, qb + j * D, kb, len,
                                                                                j > h * g ? nullptr : pf),
                                                                 vscale));
      }
    }
  }
  // V's first pages are fetched while the softmax runs
  for (int64_t h = 0; h < kvh; ++h)
    prefetch_pages(vp, table, lo - lo % ps, hi, PFD, ps, page_stride, head_off + h * head_stride, D);
  // softmax of each head's row (lanes past n masked)
  for (int64_t j = 0; j < kvh * g; ++j) {
    float* r = pbuf + j * stride;
    __m512 mx = _mm512_set1_ps(sinks ? sinks[j] : -std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 valid = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
      mx = _mm512_mask_max_ps(mx, valid, mx, _mm512_loadu_ps(r + t));
    }
    const float M = _mm512_reduce_max_ps(mx);
    const __m512 vm = _mm512_set1_ps(M);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 valid = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(r + t), vm)));
      _mm512_storeu_ps(r + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    m[j] = M;
    l[j] = _mm512_reduce_add_ps(sum);
  }
  weigh_values<T, C>(vp, table, lo, hi, g, ps, page_stride, head_off, pbuf, stride, 1, sinks, m, l, acc, kvh,
                     head_stride);
}
#elif defined(__AVX2__) && defined(__FMA__)

// The AVX2 path (AVX2 + FMA, no AVX-512: AMD Zen 2/3, older Intel): the same decode and prefill
// kernels as the AVX-512 path above, on 8 lanes and 16 vector registers. Decode scores 8 slots
// at a time (a horizontal-add tree sums their 8 accumulators), then the softmax and the
// weighted sum of V on whole vectors; prefill tiles are sized to 16 registers (3 rows x 32 keys
// of scores, 3 rows x 32 columns of output). Lane masks are compares, not mask registers.
// On an AMD EPYC with AVX2 (2 cores), one SmolLM2 layer: decode at 64 sequences (context about
// 330, float32) 1.48 ms against the portable loop's 2.05 (22 against 16 GB/s of K/V); 2,461
// prefill tokens in 8 chunks 18.5 ms against SDPA's 26.6 (60 against 42 GFLOP/s).
// Its prefetches are the AVX-512 path's (PFD pages ahead, a row for each row read; the first
// pages of each pass at its start). On an AMD EPYC (Zen 3) with AVX2, SmolLM2's 30 layers at 64
// sequences of 310 tokens, in one process, interleaved: float32 68-70 -> 54-58 ms, bf16 53 -> 36
// (600 tokens, float32: 130 -> 101) against the next page's lines issued at once at a page's
// start; a plain read of the same pages ran at 19-24 GB/s (37-46 ms), L2 or L1 hints level.

// bf16 or float32 row chunk (8 values) as float32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// lane t of the result is the sum of v[t]'s lanes
inline __m256 reduce8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // v0..v3 (v4..v7): low, then high halves' sums
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// lanes i with lo <= base + i <= hi, as a float mask (all ones / zero)
inline __m256 lanes_between(int64_t base, int64_t lo, int64_t hi) {
  const __m256i key = _mm256_add_epi32(_mm256_set1_epi32(int32_t(base)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(hi + 1)), key),
                                      _mm256_cmpgt_epi32(key, _mm256_set1_epi32(int32_t(lo - 1))));
  return _mm256_castsi256_ps(ok);
}

// exp_neg on 8 lanes (the same polynomial)
inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(_mm256_add_ps(y, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Scores of slots [0, len) (len <= 8) of one block for one query head: lane t = q . k_t (D = 8 * C).
template <typename T, int C>
inline __m256 scores8(const float* qf, const T* k, int64_t len) {
  __m256 acc[8], qv[C];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(qf + 8 * c);  // on registers across the slots (C <= 8)
  for (int64_t t = 0; t < len; ++t) {
    const T* kt = k + t * 8 * C;
    __m256 a = _mm256_mul_ps(qv[0], load8(kt));
    for (int c = 1; c < C; ++c) a = _mm256_fmadd_ps(qv[c], load8(kt + 8 * c), a);
    acc[t] = a;
  }
  return reduce8(acc);
}

// One (sequence, kv head), or kvh heads from head_off on, head_stride apart, page by page (a
// sequence's item: see decode), as attend_avx512: pass 1 every slot's scores, the softmax of
// each head's row, pass 2 the weighted sum of V rows (32 columns at a time: 4 accumulators a
// head keep the register file for the loads). Same signature as attend_avx512 (qb, cbuf unused).
template <typename T, int C>
void attend_avx2(const float* __restrict qf, const uint16_t*, const T* kp, const T* vp, const int64_t* table,
                 int64_t lo, int64_t hi, int64_t g, int64_t ps, int64_t page_stride, int64_t head_off, float fscale,
                 const float* sinks, float* __restrict acc, float* __restrict, float* __restrict pbuf, float* __restrict,
                 float* __restrict m, float* __restrict l, int64_t kvh = 1, int64_t head_stride = 0) {
  constexpr int D = 8 * C;
  const int64_t n = hi - lo;
  const int64_t stride = ((n + 7) & ~int64_t(7)) + 8;  // a block entered part way writes up to 7 lanes past n
  constexpr int64_t RB = D * sizeof(T);  // a row's bytes
  const __m256 vscale = _mm256_set1_ps(fscale);
  // pass 1: scores, the page PFD ahead prefetched a row for each row scored (as attend_avx512)
  for (int64_t h = 0; h < kvh; ++h)
    prefetch_pages(kp, table, lo - lo % ps + ps, hi, PFD - 1, ps, page_stride, head_off + h * head_stride, D);
  for (int64_t p0 = lo - lo % ps; p0 < hi; p0 += ps) {
    const int64_t pa = std::max(p0, lo) - p0, pb = std::min(p0 + ps, hi) - p0;
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t off = head_off + h * head_stride;
      const char* kn =
          p0 + PFD * ps < hi ? reinterpret_cast<const char*>(kp + table[p0 / ps + PFD] * page_stride + off) : nullptr;
      for (int64_t a = pa; a < pb; a += 8) {
        const int64_t len = std::min<int64_t>(8, pb - a);
        if (kn)
          for (int64_t x = 0; x < len * RB; x += 64) prefetch_line(kn + a * RB + x);
        const T* kb = kp + table[p0 / ps] * page_stride + off + a * D;
        const int64_t at = p0 + a - lo;
        for (int64_t j = h * g; j < h * g + g; ++j)
          _mm256_storeu_ps(pbuf + j * stride + at, _mm256_mul_ps(scores8<T, C>(qf + j * D, kb, len), vscale));
      }
    }
  }
  // V's first pages are fetched while the softmax runs
  for (int64_t h = 0; h < kvh; ++h)
    prefetch_pages(vp, table, lo - lo % ps, hi, PFD, ps, page_stride, head_off + h * head_stride, D);
  const __m256 neg = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < kvh * g; ++j) {
    float* r = pbuf + j * stride;
    __m256 mx = _mm256_set1_ps(sinks ? sinks[j] : -std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; t += 8) mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg, _mm256_loadu_ps(r + t), lanes_between(t, 0, n - 1)));
    const float M = hmax8(mx);
    const __m256 vm = _mm256_set1_ps(M);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
      const __m256 e = _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(r + t), vm)), lanes_between(t, 0, n - 1));
      _mm256_storeu_ps(r + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    m[j] = M;
    l[j] = hsum8(sum);
  }
  std::fill(acc, acc + kvh * g * D, 0.f);
  constexpr int CB = C < 4 ? C : 4;  // vectors per column block
  for (int64_t p0 = lo - lo % ps; p0 < hi; p0 += ps) {
    const int64_t pa = std::max(p0, lo) - p0, pb = std::min(p0 + ps, hi) - p0;
    const int64_t at = p0 + pa - lo, len = pb - pa;
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t off = head_off + h * head_stride;
      const char* vn = p0 + PFD * ps < hi
                           ? reinterpret_cast<const char*>(vp + table[p0 / ps + PFD] * page_stride + off + pa * D)
                           : nullptr;
      const T* vb = vp + table[p0 / ps] * page_stride + off + pa * D;
      // up to 3 heads x CB vectors of sums on registers, each V load used by all of them
      for (int64_t j0 = h * g; j0 < h * g + g; j0 += 3) {
        const int64_t jn = std::min<int64_t>(3, h * g + g - j0);
        for (int cb = 0; cb < C; cb += CB) {
          __m256 o[3][CB];
          for (int j = 0; j < 3; ++j)
            for (int c = 0; c < CB; ++c)
              o[j][c] = j < jn ? _mm256_loadu_ps(acc + (j0 + j) * D + 8 * (cb + c)) : _mm256_setzero_ps();
          const bool fetch = vn && j0 == h * g && cb == 0;  // (the first of the page's sweeps)
          for (int64_t t = 0; t < len; ++t) {
            if (fetch)
              for (int64_t x = 0; x < RB; x += 64) prefetch_line(vn + t * RB + x);
            __m256 w[3];
            for (int j = 0; j < 3; ++j) w[j] = _mm256_set1_ps(j < jn ? pbuf[(j0 + j) * stride + at + t] : 0.f);
            for (int c = 0; c < CB; ++c) {
              const __m256 v = load8(vb + t * D + 8 * (cb + c));
              for (int j = 0; j < 3; ++j) o[j][c] = _mm256_fmadd_ps(w[j], v, o[j][c]);
            }
          }
          for (int j = 0; j < jn; ++j)
            for (int c = 0; c < CB; ++c) _mm256_storeu_ps(acc + (j0 + j) * D + 8 * (cb + c), o[j][c]);
        }
      }
    }
  }
  for (int64_t j = 0; j < kvh * g; ++j) {
    const float denom = l[j] + (sinks ? std::exp(sinks[j] - m[j]) : 0.f);
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= inv;
  }
}

// Prefill chunks on AVX2: the AVX-512 prefill's algorithm (see there) with tiles for 16
// registers: keys 32 a block, scores 3 rows x 4 vectors, output 3 rows x 4 vectors (32 columns)
// at a time; keys transposed into D x 32 tiles by a plain loop (no gather).
template <typename T, int D>
void prefill_avx2(const T* q, int64_t qs0, int64_t qs1, int64_t H, const T* kp, const T* vp, const int64_t* tables,
                  const int64_t* offsets, const int64_t* starts, const int64_t* lens, int64_t C, int64_t kvh,
                  int64_t ps, int64_t page_stride, int64_t head_stride, float scale, int64_t window,
                  const float* sinks, T* out) {
  constexpr int BQ = 16, BK = 32, RB = 3, PR = 3, Z = BK / 8;
  const int64_t g = H / kvh;
  const PrefillPlan pl = plan_prefill(starts, lens, C, kvh, D, window, BQ, BK);
  const auto &row0 = pl.row0, &span = pl.span, &ktoff = pl.ktoff, &bound = pl.bound;
  const auto& items = pl.items;
  const int64_t parts = int64_t(bound.size()) - 1;
  std::vector<float> kt(ktoff[C * kvh]);
  at::parallel_for(0, C * kvh, 1, [&](int64_t a, int64_t b) {
    float row[D];
    for (int64_t it = a; it < b; ++it) {
      const int64_t c = it / kvh, h = it % kvh, ctx = starts[c] + lens[c];
      const int64_t* table = tables + offsets[c];
      float* dst = kt.data() + ktoff[it];
      for (int64_t k = 0; k < span[c]; ++k) {
        if (k < ctx)
          to_float(kp + table[k / ps] * page_stride + h * head_stride + (k % ps) * D, row, D);
        else
          std::fill(row, row + D, 0.f);
        float* blk = dst + k / BK * D * BK + k % BK;
        for (int64_t d = 0; d < D; ++d) blk[d * BK] = row[d];
      }
    }
  });
  const float NEG = -std::numeric_limits<float>::infinity();
  const __m256 negv = _mm256_set1_ps(NEG);
  at::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
    const int64_t rmax = (g * BQ + RB - 1) / RB * RB;
    std::vector<float> Q(rmax * D, 0.f), S(rmax * BK), P(g * BQ * BK), O(g * BQ * D), M(g * BQ), L(g * BQ), vf(BK * D);
    for (int64_t ii = bound[pb]; ii < bound[pe]; ++ii) {
      const PrefillPlan::Item it = items[ii];
      const int64_t nq = it.p1 - it.p0, R = g * nq, Rp = (R + RB - 1) / RB * RB;  // row j * nq + i: head j, position p0 + i
      const int64_t ctx = starts[it.c] + lens[it.c];
      const float* Kt = kt.data() + ktoff[it.c * kvh + it.h];
      const int64_t* table = tables + offsets[it.c];
      const int64_t first_row = row0[it.c] + it.p0 - starts[it.c];
      for (int64_t j = 0; j < g; ++j)
        for (int64_t i = 0; i < nq; ++i) {
          float* dst = Q.data() + (j * nq + i) * D;
          const T* src = q + (first_row + i) * qs0 + (it.h * g + j) * qs1;
          for (int64_t d = 0; d < D; ++d) dst[d] = float(src[d]) * scale;
        }
      std::fill(Q.begin() + R * D, Q.begin() + Rp * D, 0.f);
      std::fill(O.begin(), O.begin() + R * D, 0.f);
      for (int64_t r = 0; r < R; ++r) {
        M[r] = sinks ? sinks[it.h * g + r / nq] : NEG;
        L[r] = 0.f;
      }
      const int64_t lo = window > 0 ? std::max<int64_t>(0, it.p0 - window + 1) : 0;
      for (int64_t k0 = lo / BK * BK; k0 < it.p1; k0 += BK) {
        const float* Kb = Kt + k0 * D;  // the block's D x BK tile
        for (int64_t r0 = 0; r0 < Rp; r0 += RB) {
          __m256 acc[RB][Z];
          for (int r = 0; r < RB; ++r)
            for (int z = 0; z < Z; ++z) acc[r][z] = _mm256_setzero_ps();
          const float* qb = Q.data() + r0 * D;
          for (int d = 0; d < D; ++d) {
            __m256 kv[Z];
            for (int z = 0; z < Z; ++z) kv[z] = _mm256_loadu_ps(Kb + d * BK + 8 * z);
            for (int r = 0; r < RB; ++r) {
              const __m256 qv = _mm256_set1_ps(qb[r * D + d]);
              for (int z = 0; z < Z; ++z) acc[r][z] = _mm256_fmadd_ps(qv, kv[z], acc[r][z]);
            }
          }
          for (int r = 0; r < RB; ++r)
            for (int z = 0; z < Z; ++z) _mm256_storeu_ps(S.data() + (r0 + r) * BK + 8 * z, acc[r][z]);
        }
        for (int64_t row = 0; row < R; ++row) {
          const int64_t pos = it.p0 + row % nq, first = window > 0 ? pos - window + 1 : 0;
          __m256 valid[Z];
          __m256 mxv = negv;
          for (int z = 0; z < Z; ++z) {
            valid[z] = lanes_between(k0 + 8 * z, first, pos);
            mxv = _mm256_max_ps(mxv, _mm256_blendv_ps(negv, _mm256_loadu_ps(S.data() + row * BK + 8 * z), valid[z]));
          }
          const float mx = std::max(M[row], hmax8(mxv));
          float* pr = P.data() + row * BK;
          if (mx == NEG) {  // nothing attended yet (a block wholly before the window)
            std::fill(pr, pr + BK, 0.f);
            continue;
          }
          const float corr = std::exp(M[row] - mx);
          const __m256 vmx = _mm256_set1_ps(mx);
          __m256 sum = _mm256_setzero_ps();
          for (int z = 0; z < Z; ++z) {
            const __m256 p = _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(S.data() + row * BK + 8 * z), vmx)), valid[z]);
            sum = _mm256_add_ps(sum, p);
            _mm256_storeu_ps(pr + 8 * z, p);
          }
          L[row] = L[row] * corr + hsum8(sum);
          M[row] = mx;
          if (corr != 1.f) {
            const __m256 vc = _mm256_set1_ps(corr);
            float* o = O.data() + row * D;
            for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * c), vc));
          }
        }
        // the block's V rows (float32), weighted into each row's sums: PR rows x 32 columns at a time
        const int64_t tn = std::min<int64_t>(BK, ctx - k0);
        const float* vrow[BK];
        for (int64_t t = 0; t < tn; ++t) {
          const int64_t k = k0 + t;
          const T* src = vp + table[k / ps] * page_stride + it.h * head_stride + (k % ps) * D;
          if constexpr (std::is_same_v<T, float>) {
            vrow[t] = src;
          } else {
            to_float(src, vf.data() + t * D, D);
            vrow[t] = vf.data() + t * D;
          }
        }
        for (int cb = 0; cb < D; cb += 32) {
          int64_t r0 = 0;
          for (; r0 + PR <= R; r0 += PR) {
            __m256 o[PR][4];
            for (int r = 0; r < PR; ++r)
              for (int c = 0; c < 4; ++c) o[r][c] = _mm256_loadu_ps(O.data() + (r0 + r) * D + cb + 8 * c);
            for (int64_t t = 0; t < tn; ++t) {
              __m256 v[4];
              for (int c = 0; c < 4; ++c) v[c] = _mm256_loadu_ps(vrow[t] + cb + 8 * c);
              for (int r = 0; r < PR; ++r) {
                const __m256 w = _mm256_set1_ps(P[(r0 + r) * BK + t]);
                for (int c = 0; c < 4; ++c) o[r][c] = _mm256_fmadd_ps(w, v[c], o[r][c]);
              }
            }
            for (int r = 0; r < PR; ++r)
              for (int c = 0; c < 4; ++c) _mm256_storeu_ps(O.data() + (r0 + r) * D + cb + 8 * c, o[r][c]);
          }
          for (; r0 < R; ++r0) {
            __m256 o[4];
            for (int c = 0; c < 4; ++c) o[c] = _mm256_loadu_ps(O.data() + r0 * D + cb + 8 * c);
            for (int64_t t = 0; t < tn; ++t) {
              const __m256 w = _mm256_set1_ps(P[r0 * BK + t]);
              for (int c = 0; c < 4; ++c) o[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vrow[t] + cb + 8 * c), o[c]);
            }
            for (int c = 0; c < 4; ++c) _mm256_storeu_ps(O.data() + r0 * D + cb + 8 * c, o[c]);
          }
        }
      }
      for (int64_t row = 0; row < R; ++row) {
        const int64_t j = row / nq, i = row % nq;
        const float denom = L[row] + (sinks ? std::exp(sinks[it.h * g + j] - M[row]) : 0.f);
        const float inv = 1.f / denom;
        float* o = O.data() + row * D;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        store_row(out + ((first_row + i) * H + it.h * g + j) * D, o, D);
      }
    }
  });
}
#endif  // __AVX512F__ / __AVX2__

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
template <int C>
void attend_amx(const uint16_t* qb, const at::BFloat16* kp, const at::BFloat16* vp, const int64_t* table, int64_t lo,
                int64_t hi, int64_t g, int64_t ps, int64_t page_stride, int64_t head_off, float fscale,
                const float* sinks, float* __restrict acc, float* __restrict sc, uint32_t* __restrict qv,
                float* __restrict m, float* __restrict l);
void decode_tiles(int64_t g);
#endif

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const int64_t* tables,
            const int64_t* offsets, const int64_t* ctx, at::Tensor& out, double scale, int64_t window,
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

  auto one = D == 64 ? attend_one<T, 64> : D == 128 ? attend_one<T, 128> : attend_one<T, 0>;

  // the vector path: float32 / bf16, head sizes 32, 64, 128 and 256, no soft-cap
#if defined(__AVX512F__)
  decltype(&attend_avx512<T, 4>) fast = nullptr;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    if (fcap <= 0)
      fast = D == 32 ? attend_avx512<T, 2> : D == 64 ? attend_avx512<T, 4> : D == 128 ? attend_avx512<T, 8>
           : D == 256 ? attend_avx512<T, 16> : nullptr;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  decltype(&attend_avx2<T, 4>) fast = nullptr;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    if (fcap <= 0)
      fast = D == 32 ? attend_avx2<T, 4> : D == 64 ? attend_avx2<T, 8> : D == 128 ? attend_avx2<T, 16>
           : D == 256 ? attend_avx2<T, 32> : nullptr;
  }
#endif

  // bf16 with AMX: the scores as tile products (attend_amx), where pages hold whole tiles
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  decltype(&attend_amx<4>) amx = nullptr;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (fcap <= 0 && ps % 16 == 0 && g <= 16 && amx_ready())
      amx = D == 32 ? attend_amx<2> : D == 64 ? attend_amx<4> : D == 128 ? attend_amx<8> : D == 256 ? attend_amx<16> : nullptr;
  }
#endif

  // Heads a work item takes: on the vector paths, with enough sequences to share between the
  // threads, all of a sequence's kv heads, page by page. A page holds its kv heads' slots one
  // after the other, so the item reads each page whole, and a sequence's pages (allocated in
  // ascending order, worker/cache.py) as one forward stream that the hardware prefetchers
  // follow, rather than one head's part of every page, then the next head's. SmolLM2's 30
  // layers at 64 sequences of about 230 tokens, the engine's own pools and tables, AMD EPYC
  // (Zen 5), 2 threads, ms: float32 24.8 per head on descending pages, 22.8 per head on
  // ascending ones, 19.0 per sequence on ascending ones; bf16 20.7, 18.2 and 13.8; AVX2 on an
  // AMD EPYC (Zen 3), 64 sequences of 230-430 tokens, float32 60-82 per head against 48-55 per
  // sequence, bf16 33-36 against 28-29 (16 sequences of 600: level). Fewer
  // sequences keep an item per head, so that both threads have work. Only where the
  // prefetches land in L2 (AMD): an item's pages ahead are then kvh times the bytes, and on
  // Intel, where they land in L1 (48 KB), that is not measured.
  int64_t hpi = 1;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (fast && kPrefetchL2 && n >= 4 * at::get_num_threads()) hpi = kvh;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if (amx) hpi = 1;
#endif
  const int64_t per_seq = kvh / hpi;  // items a sequence
  // first attended slot of each sequence (the sliding window), and the slots each item reads
  std::vector<int64_t> first(n), cost(n * per_seq + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    first[i] = window > 0 ? std::max<int64_t>(0, ctx[i] - window) : 0;
    for (int64_t h = 0; h < per_seq; ++h)
      cost[i * per_seq + h + 1] = cost[i * per_seq + h] + hpi * (ctx[i] - first[i]) + 8;
  }
  const int64_t items = n * per_seq;
  const int64_t parts = std::min<int64_t>(items, 4 * at::get_num_threads());
  // part p takes the items whose cumulative cost starts in [p, p + 1) * total / parts
  std::vector<int64_t> bound(parts + 1, items);
  bound[0] = 0;
  for (int64_t p = 1, it = 0; p < parts; ++p) {
    const int64_t target = cost[items] * p / parts;
    while (it < items && cost[it] < target) ++it;
    bound[p] = it;
  }

  // per thread: the portable path's page of scores, or the vector path's scores of a whole sequence
  int64_t sbuf = std::max<int64_t>(ps, 16);
  for (int64_t i = 0; i < n; ++i) sbuf = std::max(sbuf, (ctx[i] - first[i] + 31) & ~int64_t(15));
  at::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
    const int64_t rows = hpi * g;  // query heads an item takes
    std::vector<float> qf(rows * D), acc(rows * D), kf(std::max(ps * D, g)), vf(std::max<int64_t>(ps, 16) * D),
        s(rows * sbuf), m(rows), l(rows);
    std::vector<uint16_t> qb(rows * D);
    std::vector<uint32_t> qv(g * D / 2);  // the AMX path's query pairs
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (amx) decode_tiles(g);
#endif
    for (int64_t item = bound[pb]; item < bound[pe]; ++item) {
      const int64_t i = item / per_seq, h = item % per_seq * hpi;
      for (int64_t j = 0; j < rows; ++j) {
        const T* src = qp + i * qs0 + (h * g + j) * qs1;
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = float(src[d * qs2]);
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          for (int64_t d = 0; d < D; ++d) qb[j * D + d] = reinterpret_cast<const uint16_t*>(src)[d * qs2];
        }
      }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
      if (amx) {
        amx(qb.data(), reinterpret_cast<const at::BFloat16*>(kp), reinterpret_cast<const at::BFloat16*>(vp),
            tables + offsets[i], first[i], ctx[i], g, ps, page_stride, h * head_stride, fscale,
            sinks ? sinks + h * g : nullptr, acc.data(), s.data(), qv.data(), m.data(), l.data());
      } else
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      if (fast) {
        fast(qf.data(), qb.data(), kp, vp, tables + offsets[i], first[i], ctx[i], g, ps, page_stride, h * head_stride,
             fscale, sinks ? sinks + h * g : nullptr, acc.data(), vf.data(), s.data(), kf.data(), m.data(), l.data(),
             hpi, head_stride);
      } else
#endif
      one(qf.data(), kp, vp, tables + offsets[i], first[i], ctx[i], g, D, ps, page_stride, h * head_stride, fscale,
          fcap, sinks ? sinks + h * g : nullptr, acc.data(), kf.data(), vf.data(), s.data(), m.data(), l.data());
      T* dst = op + (i * H + h * g) * D;
      for (int64_t x = 0; x < rows * D; ++x) dst[x] = T(acc[x]);
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (amx) _tile_release();
#endif
  });
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------- prefill

// Lanes of the keys b0 .. b0 + 15 that a row at position pos attends: first <= key <= pos.
inline __mmask16 key_lanes(int64_t b0, int64_t first, int64_t pos) {
  __mmask16 vm = 0xFFFF;
  if (b0 + 15 > pos) vm = pos >= b0 ? __mmask16((1u << (pos - b0 + 1)) - 1) : 0;
  if (b0 < first) vm &= first - b0 >= 16 ? 0 : __mmask16(~((1u << (first - b0)) - 1));
  return vm;
}

// Prefill chunks: each chunk's query rows (positions start .. start + len - 1 of its
// sequence) against the sequence's slots 0 .. its own position, read from the pool in place
// (the chunk's own keys and values were written by write_kv before). Causal, with the
// sliding window and sinks; float32 arithmetic for float32 and bf16 pools alike.
//
// Work items are (chunk, kv head, block of BQ positions): the g query heads of each position
// are its rows. Keys are taken BK at a time: their scores for RB rows at once on registers,
// from each chunk's keys transposed once per call into D x BK tiles (so a row's scores for
// BK keys are broadcast-FMAs over D), then an online softmax per row, then the weighted sum of
// the block's V rows for PR rows at once. SDPA on the same chunks ran at 80 GFLOP/s here
// (2 cores); this at about 240.
//
// bf16 with AVX512-BF16 (and no AMX: prefill_amx below): both products as dot products of bf16
// pairs, as prefill_amx takes them: keys transposed as pairs of columns (one pair per 32-bit
// lane), each row's query pairs broadcast, the scale applied to the sums; the probabilities
// rounded to bf16 and paired over keys against the block's V rows paired the same way (their
// sum is not rounded). Half the instructions of the float32 loops: SmolLM2's shapes, 2,052
// tokens in 9 chunks, an AMD EPYC (Zen 4, 2 cores): 2.7-2.9 ms a layer (186-204 GFLOP/s)
// against 4.2-4.4 (122-130) converting to float32.
constexpr int BQ = 16;  // positions per work item
constexpr int BK = 64;  // keys per block
constexpr int RB = 6;   // rows per score tile (RB x BK / 16 accumulators)

template <typename T, int D>
void prefill(const T* q, int64_t qs0, int64_t qs1, int64_t H, const T* kp, const T* vp, const int64_t* tables,
             const int64_t* offsets, const int64_t* starts, const int64_t* lens, int64_t C, int64_t kvh, int64_t ps,
             int64_t page_stride, int64_t head_stride, float scale, int64_t window, const float* sinks, T* out) {
  constexpr int C4 = D / 16;
  constexpr int PR = 16 / C4;  // rows per V tile (PR x C4 = 16 accumulators)
  constexpr int W = D / 2;     // bf16 pairs a row
#if defined(__AVX512BF16__)
  constexpr bool pairs = std::is_same_v<T, at::BFloat16>;  // both products on bf16 pairs
#else
  constexpr bool pairs = false;
#endif
  const int64_t g = H / kvh;
  const PrefillPlan pl = plan_prefill(starts, lens, C, kvh, D, window, BQ, BK);
  const auto &row0 = pl.row0, &span = pl.span, &ktoff = pl.ktoff, &bound = pl.bound;
  const auto& items = pl.items;
  const int64_t parts = int64_t(bound.size()) - 1;
  // Kt per (chunk, kv head), float32, zero past the chunk's last slot: a D x BK tile per block
  // of BK keys (one [D][span] matrix put 2 KB between a block's rows at 512 slots: every row in
  // the same cache sets, and long chunks ran at 95 GFLOP/s instead of 240). With pairs, a W x BK
  // tile of bf16 pairs (in half the room): either way 32-bit words, transposed alike.
  std::vector<float> kt(ktoff[C * kvh]);
  constexpr int64_t words = pairs ? W : D;  // 32-bit words a key's row
  at::parallel_for(0, C * kvh, 1, [&](int64_t a, int64_t b) {
    alignas(64) uint32_t tile[16 * D];  // 16 slots' rows, written out column by column
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(int(words)));
    for (int64_t it = a; it < b; ++it) {
      const int64_t c = it / kvh, h = it % kvh, ctx = starts[c] + lens[c], n = span[c];
      const int64_t* table = tables + offsets[c];
      uint32_t* dst = reinterpret_cast<uint32_t*>(kt.data() + ktoff[it]);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        for (int64_t t = 0; t < 16; ++t) {
          const int64_t k = t0 + t;
          uint32_t* row = tile + t * words;
          if (k >= ctx) {
            std::fill(row, row + words, 0u);
            continue;
          }
          const T* src = kp + table[k / ps] * page_stride + h * head_stride + (k % ps) * D;
          if constexpr (pairs)
            std::memcpy(row, src, D * 2);
          else
            to_float(src, reinterpret_cast<float*>(row), D);
        }
        uint32_t* blk = dst + t0 / BK * words * BK + t0 % BK;
        for (int64_t w = 0; w < words; ++w)
          _mm512_storeu_si512(blk + w * BK, _mm512_i32gather_epi32(idx, tile + w, 4));
      }
    }
  });
  const float NEG = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
    const int64_t rmax = (g * BQ + RB - 1) / RB * RB;
    std::vector<float> Q(rmax * D, 0.f), S(rmax * BK), P(g * BQ * BK), O(g * BQ * D), M(g * BQ), L(g * BQ), vf(BK * D);
    for (int64_t ii = bound[pb]; ii < bound[pe]; ++ii) {
      const PrefillPlan::Item it = items[ii];
      const int64_t nq = it.p1 - it.p0, R = g * nq, Rp = (R + RB - 1) / RB * RB;  // row j * nq + i: head j, position p0 + i
      const int64_t ctx = starts[it.c] + lens[it.c], n = span[it.c];
      const float* Kt = kt.data() + ktoff[it.c * kvh + it.h];
      const int64_t* table = tables + offsets[it.c];
      const int64_t first_row = row0[it.c] + it.p0 - starts[it.c];
      for (int64_t j = 0; j < g; ++j)
        for (int64_t i = 0; i < nq; ++i) {
          float* dst = Q.data() + (j * nq + i) * D;
          const T* src = q + (first_row + i) * qs0 + (it.h * g + j) * qs1;
          if constexpr (pairs)  // the row's bf16 as they are (pairs), the scale applied to the sums
            std::memcpy(dst, src, D * 2);
          else
            for (int64_t d = 0; d < D; ++d) dst[d] = float(src[d]) * scale;
        }
      std::fill(Q.begin() + R * D, Q.begin() + Rp * D, 0.f);
      std::fill(O.begin(), O.begin() + R * D, 0.f);
      for (int64_t r = 0; r < R; ++r) {
        M[r] = sinks ? sinks[it.h * g + r / nq] : NEG;
        L[r] = 0.f;
      }
      const int64_t lo = window > 0 ? std::max<int64_t>(0, it.p0 - window + 1) : 0;
      for (int64_t k0 = lo / BK * BK; k0 < it.p1; k0 += BK) {
        // scores of the block's BK keys for every row, RB rows at a time (rows past R are padding)
        for (int64_t r0 = 0; r0 < Rp; r0 += RB) {
          __m512 acc[RB][BK / 16];
          for (int r = 0; r < RB; ++r)
            for (int z = 0; z < BK / 16; ++z) acc[r][z] = _mm512_setzero_ps();
          const float* qb = Q.data() + r0 * D;
          const float* Kb = Kt + k0 * D;  // the block's D x BK tile
          if constexpr (pairs) {
#if defined(__AVX512BF16__)
            const uint32_t* qp = reinterpret_cast<const uint32_t*>(qb);  // row r's pairs at r * D (a float row's room)
            const uint32_t* Kp = reinterpret_cast<const uint32_t*>(Kt) + k0 * W;  // the block's W x BK pairs
            for (int w = 0; w < W; ++w) {
              __m512bh kv[BK / 16];
              for (int z = 0; z < BK / 16; ++z) kv[z] = (__m512bh)_mm512_loadu_si512(Kp + w * BK + 16 * z);
              for (int r = 0; r < RB; ++r) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32(int(qp[r * D + w]));
                for (int z = 0; z < BK / 16; ++z) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], qv, kv[z]);
              }
            }
            const __m512 vs = _mm512_set1_ps(scale);
            for (int r = 0; r < RB; ++r)
              for (int z = 0; z < BK / 16; ++z) acc[r][z] = _mm512_mul_ps(acc[r][z], vs);
#endif
          } else {
            for (int d = 0; d < D; ++d) {
              __m512 kv[BK / 16];
              for (int z = 0; z < BK / 16; ++z) kv[z] = _mm512_loadu_ps(Kb + d * BK + 16 * z);
              for (int r = 0; r < RB; ++r) {
                const __m512 qv = _mm512_set1_ps(qb[r * D + d]);
                for (int z = 0; z < BK / 16; ++z) acc[r][z] = _mm512_fmadd_ps(qv, kv[z], acc[r][z]);
              }
            }
          }
          for (int r = 0; r < RB; ++r)
            for (int z = 0; z < BK / 16; ++z) _mm512_storeu_ps(S.data() + (r0 + r) * BK + 16 * z, acc[r][z]);
        }
        // online softmax of each row over the keys it attends (first <= key <= its position)
        for (int64_t row = 0; row < R; ++row) {
          const int64_t pos = it.p0 + row % nq, first = window > 0 ? pos - window + 1 : 0;
          __mmask16 valid[BK / 16];
          __m512 mxv = _mm512_set1_ps(NEG);
          for (int z = 0; z < BK / 16; ++z) {
            const int64_t b0 = k0 + 16 * z;
            const __mmask16 vm = key_lanes(b0, first, pos);
            valid[z] = vm;
            mxv = _mm512_mask_max_ps(mxv, vm, mxv, _mm512_loadu_ps(S.data() + row * BK + 16 * z));
          }
          const float mx = std::max(M[row], _mm512_reduce_max_ps(mxv));
          float* pr = P.data() + row * BK;
          if (mx == NEG) {  // nothing attended yet (a block wholly before the window)
            std::fill(pr, pr + BK, 0.f);
            continue;
          }
          const float corr = std::exp(M[row] - mx);
          const __m512 vmx = _mm512_set1_ps(mx);
          __m512 sum = _mm512_setzero_ps();
          for (int z = 0; z < BK / 16; ++z) {
            const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(S.data() + row * BK + 16 * z), vmx));
            const __m512 p = _mm512_maskz_mov_ps(valid[z], e);
            sum = _mm512_add_ps(sum, p);
            _mm512_storeu_ps(pr + 16 * z, p);
          }
          L[row] = L[row] * corr + _mm512_reduce_add_ps(sum);
          M[row] = mx;
          if (corr != 1.f) {
            const __m512 vc = _mm512_set1_ps(corr);
            float* o = O.data() + row * D;
            for (int c = 0; c < C4; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), vc));
          }
        }
        // the block's V rows (float32), weighted into each row's sums, PR rows at a time
        const int64_t tn = std::min<int64_t>(BK, ctx - k0);
        if constexpr (pairs) {
#if defined(__AVX512BF16__)
          // V rows 2u and 2u + 1 as one row of pairs (zero past the last key), the
          // probabilities of those keys as one bf16 pair a row
          const int64_t tu = (tn + 1) / 2;
          uint32_t* vpair = reinterpret_cast<uint32_t*>(vf.data());
          for (int64_t u = 0; u < tu; ++u) {
            const int64_t k = k0 + 2 * u;
            const T* a = vp + table[k / ps] * page_stride + it.h * head_stride + (k % ps) * D;
            const T* b = 2 * u + 1 < tn ? vp + table[(k + 1) / ps] * page_stride + it.h * head_stride + ((k + 1) % ps) * D
                                        : nullptr;
            for (int c = 0; c < C4; ++c) {
              const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + 16 * c)));
              const __m512i hi = b ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + 16 * c))), 16)
                                   : _mm512_setzero_si512();
              _mm512_storeu_si512(vpair + u * D + 16 * c, _mm512_or_si512(lo, hi));
            }
          }
          uint32_t* ppair = reinterpret_cast<uint32_t*>(S.data());  // the scores are spent: W pairs a row
          for (int64_t row = 0; row < R; ++row)
            for (int z = 0; z < BK / 32; ++z) {
              const float* pr = P.data() + row * BK + 32 * z;
              _mm512_storeu_si512(ppair + row * (BK / 2) + 16 * z,
                                  (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(pr + 16), _mm512_loadu_ps(pr)));
            }
          int64_t r0 = 0;
          for (; r0 < R; r0 += PR) {
            const int64_t rn = std::min<int64_t>(PR, R - r0);
            __m512 o[PR][C4];
            for (int r = 0; r < PR; ++r)
              for (int c = 0; c < C4; ++c)
                o[r][c] = r < rn ? _mm512_loadu_ps(O.data() + (r0 + r) * D + 16 * c) : _mm512_setzero_ps();
            for (int64_t u = 0; u < tu; ++u) {
              __m512bh v[C4];
              for (int c = 0; c < C4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vpair + u * D + 16 * c);
              for (int r = 0; r < PR; ++r) {
                if (r >= rn) break;
                const __m512bh w = (__m512bh)_mm512_set1_epi32(int(ppair[(r0 + r) * (BK / 2) + u]));
                for (int c = 0; c < C4; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], w, v[c]);
              }
            }
            for (int r = 0; r < PR && r < rn; ++r)
              for (int c = 0; c < C4; ++c) _mm512_storeu_ps(O.data() + (r0 + r) * D + 16 * c, o[r][c]);
          }
          continue;
#endif
        }
        const float* vrow[BK];
        for (int64_t t = 0; t < tn; ++t) {
          const int64_t k = k0 + t;
          const T* src = vp + table[k / ps] * page_stride + it.h * head_stride + (k % ps) * D;
          if constexpr (std::is_same_v<T, float>) {
            vrow[t] = src;
          } else {
            to_float(src, vf.data() + t * D, D);
            vrow[t] = vf.data() + t * D;
          }
        }
        int64_t r0 = 0;
        for (; r0 + PR <= R; r0 += PR) {
          __m512 o[PR][C4];
          for (int r = 0; r < PR; ++r)
            for (int c = 0; c < C4; ++c) o[r][c] = _mm512_loadu_ps(O.data() + (r0 + r) * D + 16 * c);
          for (int64_t t = 0; t < tn; ++t) {
            __m512 v[C4];
            for (int c = 0; c < C4; ++c) v[c] = _mm512_loadu_ps(vrow[t] + 16 * c);
            for (int r = 0; r < PR; ++r) {
              const __m512 w = _mm512_set1_ps(P[(r0 + r) * BK + t]);
              for (int c = 0; c < C4; ++c) o[r][c] = _mm512_fmadd_ps(w, v[c], o[r][c]);
            }
          }
          for (int r = 0; r < PR; ++r)
            for (int c = 0; c < C4; ++c) _mm512_storeu_ps(O.data() + (r0 + r) * D + 16 * c, o[r][c]);
        }
        for (; r0 < R; ++r0) {
          __m512 o[C4];
          for (int c = 0; c < C4; ++c) o[c] = _mm512_loadu_ps(O.data() + r0 * D + 16 * c);
          for (int64_t t = 0; t < tn; ++t) {
            const __m512 w = _mm512_set1_ps(P[r0 * BK + t]);
            for (int c = 0; c < C4; ++c) o[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vrow[t] + 16 * c), o[c]);
          }
          for (int c = 0; c < C4; ++c) _mm512_storeu_ps(O.data() + r0 * D + 16 * c, o[c]);
        }
      }
      for (int64_t row = 0; row < R; ++row) {
        const int64_t j = row / nq, i = row % nq;
        const float denom = L[row] + (sinks ? std::exp(sinks[it.h * g + j] - M[row]) : 0.f);
        const float inv = 1.f / denom;
        float* o = O.data() + row * D;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        store_row(out + ((first_row + i) * H + it.h * g + j) * D, o, D);
      }
    }
  });
}
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// ---------------------------------------------------------------------------- prefill on AMX

// bf16 prefill on a CPU with AMX: the same work items as prefill() above (16 positions of one kv
// head), with both products as AMX tile products and the softmax left to the vector unit. Row-
// major, as flash attention is written: S = Q K^T (Q's 16 rows x 32 d as the A tile, read as
// they are; keys as B tiles of d pairs x 16 keys), then O += P V (P's 16 rows x 32 keys as the A
// tile; values as B tiles of key pairs x 16 d). Keys come KB = 256 at a time: all their scores
// first (S in L1), then each row's max, its correction of the sums so far and the probabilities
// rounded to bf16 (as torch's flash attention does for bf16; their sum is not), one lane-wise max
// and sum a row and block, then their product with V into O, kept in memory between blocks. Each
// (chunk, kv head)'s keys and values are laid out as those B tiles once per call. So nothing is
// gathered or transposed per item (the transposed layout this replaced, scores as K Q^T and the
// output as V^T P^T, gathered Q's columns and O's rows for every item and head, and stored and
// reloaded O every 32 keys). SmolLM2's shapes (D 64, 9 heads on 3), 30 layers, 2 cores, the
// Intel Xeon with AMX: 4 chunks of 512 tokens 55.7-64.5 ms against 74.6-80.4, one of 2,048
// 199-227 against 254, 16 of 128 24-27 against 36 (medians of 30 calls).
//
// The tiles and the vector unit work at once: an item's (query head, key block) units run one
// after the other, and the tile products of the next unit's scores are issued between the rows
// of this unit's softmax, those of the last unit's P V between the rows of this one's max pass.
// Issued in one run, each product waited on the last (the tiles' latency, and the tile loads
// that must wait for the stores before them), and the vector unit waited on all of them: with
// both products out of that run, 4 chunks of 512 tokens 44-49 ms against 49-59 (the same calls,
// the kernel before this, in turn), one of 2,048 151-174 against 189-200, 16 of 128 18.5-20
// against 19-21 (the softmax bounds those). tests/test_native.py checks it against dense
// attention (head sizes 32-256, windows narrow and wider than a block, sinks, cached prefixes).

// Decode on AMX (bf16): pass 1's scores as tile products. The vector path's dot products and
// the shuffle trees that sum them took most of its time (70% of it with the pages in L2), and
// that time added to the loads' instead of hiding under it. Here a block of 16 slots is one
// tile of keys (16 rows x 32 bf16, read from the page in place) times the g query heads as a
// 32 x g tile of pairs: scores[16 x g], stored slot-major (slot t's g scores side by side, as
// the tile holds them). The softmax runs over that layout on whole vectors (lane L of vector
// v is head (16 v + L) % g), and pass 2 is the vector path's, in float32 (weigh_values).
// Blocks that would cross a page's end (a sliding window's first page entered part way) are
// scored on vectors. Tiles: 0 scores, 1 keys, 2.. the query's D / 32 pair tiles (reloaded
// when they do not fit).
void decode_tiles(int64_t g) {
  TileConfig cfg;  // 16 rows each; the scores' and the query's tiles g words wide
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = t == 1 ? 64 : uint16_t(4 * g);
  _tile_loadconfig(&cfg);
}

template <int C>
void attend_amx(const uint16_t* qb, const at::BFloat16* kp, const at::BFloat16* vp, const int64_t* table, int64_t lo,
                int64_t hi, int64_t g, int64_t ps, int64_t page_stride, int64_t head_off, float fscale,
                const float* sinks, float* __restrict acc, float* __restrict sc, uint32_t* __restrict qv,
                float* __restrict m, float* __restrict l) {
  constexpr int D = 16 * C, NC = D / 32;  // 32-dim chunks: one tile product each
  constexpr bool resident = NC <= 6;        // the query's tiles stay in tiles 2 .. 2 + NC - 1
  const int64_t n = hi - lo;
  // the query heads as pairs: qv[chunk][pair row r][head j] = dims 32 chunk + 2 r, + 1 of head j
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < 16; ++r)
      for (int64_t j = 0; j < g; ++j)
        qv[(c * 16 + r) * g + j] = reinterpret_cast<const uint32_t*>(qb + j * D)[16 * c + r];
  if constexpr (resident) {
    if constexpr (NC > 0) _tile_loadd(2, qv, 4 * g);
    if constexpr (NC > 1) _tile_loadd(3, qv + 16 * g, 4 * g);
    if constexpr (NC > 2) _tile_loadd(4, qv + 32 * g, 4 * g);
    if constexpr (NC > 3) _tile_loadd(5, qv + 48 * g, 4 * g);
    if constexpr (NC > 4) _tile_loadd(6, qv + 64 * g, 4 * g);
    if constexpr (NC > 5) _tile_loadd(7, qv + 80 * g, 4 * g);
  }
  prefetch_pages(kp, table, lo - lo % ps + ps, hi, PFD - 1, ps, page_stride, head_off, D);
  // pass 1: sc[t * g + j] = head j's score of slot lo + t (unscaled)
  for (int64_t p0 = lo - lo % ps; p0 < hi; p0 += ps) {
    const int64_t pa = std::max(p0, lo) - p0, pb = std::min(p0 + ps, hi) - p0;
    const at::BFloat16* page = kp + table[p0 / ps] * page_stride + head_off;
    const char* kn = p0 + PFD * ps < hi
                         ? reinterpret_cast<const char*>(kp + table[p0 / ps + PFD] * page_stride + head_off)
                         : nullptr;
    for (int64_t a = pa; a < pb; a += 16) {
      const at::BFloat16* kb = page + a * D;
      const int64_t at = p0 + a - lo;
      if (kn)
        for (int64_t x = 0; x < 16 * D * 2; x += 64) prefetch_line(kn + a * D * 2 + x);
      if (a + 16 > ps) {  // part way into the page: 16 rows would run past it
        alignas(64) float tmp[16];
        const int64_t len = std::min<int64_t>(16, pb - a);
        for (int64_t j = 0; j < g; ++j) {
          _mm512_store_ps(tmp, scores16<at::BFloat16, C>(nullptr, qb + j * D, kb, len, nullptr));
          for (int64_t t = 0; t < len; ++t) sc[(at + t) * g + j] = tmp[t];
        }
        continue;
      }
      _tile_zero(0);
      for (int c = 0; c < NC; ++c) {
        _tile_loadd(1, kb + 32 * c, D * 2);
        if constexpr (resident) {
          switch (c) {  // tile numbers are immediates
            case 0: _tile_dpbf16ps(0, 1, 2); break;
            case 1: _tile_dpbf16ps(0, 1, 3); break;
            case 2: _tile_dpbf16ps(0, 1, 4); break;
            case 3: _tile_dpbf16ps(0, 1, 5); break;
            case 4: _tile_dpbf16ps(0, 1, 6); break;
            default: _tile_dpbf16ps(0, 1, 7); break;
          }
        } else {
          _tile_loadd(2, qv + c * 16 * g, 4 * g);
          _tile_dpbf16ps(0, 1, 2);
        }
      }
      _tile_stored(0, sc + at * g, 4 * g);  // rows past hi land in the buffer's slack
    }
  }
  // softmax per head over the slot-major scores: P vectors make one period of the heads' pattern
  const int64_t total = n * g, P = g / std::gcd<int64_t>(g, 16);
  const float NEG = -std::numeric_limits<float>::infinity();
  const __m512 vscale = _mm512_set1_ps(fscale);
  __m512 mx[16], vm[16], sum[16];
  alignas(64) float lane[16 * 16];
  for (int64_t k = 0; k < P; ++k) mx[k] = _mm512_set1_ps(NEG), sum[k] = _mm512_setzero_ps();
  for (int64_t v = 0, k = 0; v * 16 < total; ++v, k = k + 1 == P ? 0 : k + 1) {
    const __mmask16 valid = total - v * 16 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (total - v * 16)) - 1);
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc + v * 16), vscale);
    _mm512_storeu_ps(sc + v * 16, x);
    mx[k] = _mm512_mask_max_ps(mx[k], valid, mx[k], x);
  }
  for (int64_t j = 0; j < g; ++j) m[j] = sinks ? sinks[j] : NEG;
  for (int64_t k = 0; k < P; ++k) _mm512_store_ps(lane + 16 * k, mx[k]);
  for (int64_t x = 0; x < 16 * P; ++x) m[x % g] = std::max(m[x % g], lane[x]);
  for (int64_t x = 0; x < 16 * P; ++x) lane[x] = m[x % g];
  for (int64_t k = 0; k < P; ++k) vm[k] = _mm512_load_ps(lane + 16 * k);
  for (int64_t v = 0, k = 0; v * 16 < total; ++v, k = k + 1 == P ? 0 : k + 1) {
    const __mmask16 valid = total - v * 16 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (total - v * 16)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(sc + v * 16), vm[k])));
    _mm512_storeu_ps(sc + v * 16, e);
    sum[k] = _mm512_add_ps(sum[k], e);
  }
  for (int64_t j = 0; j < g; ++j) l[j] = 0.f;
  for (int64_t k = 0; k < P; ++k) _mm512_store_ps(lane + 16 * k, sum[k]);
  for (int64_t x = 0; x < 16 * P; ++x) l[x % g] += lane[x];
  // V's first pages are fetched while the softmax's end runs; then pass 2, weights slot-major
  prefetch_pages(vp, table, lo - lo % ps, hi, PFD, ps, page_stride, head_off, D);
  weigh_values<at::BFloat16, C>(vp, table, lo, hi, g, ps, page_stride, head_off, sc, 1, g, sinks, m, l, acc);
}

constexpr int AQ = 16;   // positions per work item: a tile's rows
constexpr int AK = 32;   // keys per P tile: the K depth of one tile product with V
constexpr int KB = 256;  // keys per softmax block: its scores (16 KB) and probabilities (8 KB) stay in L1

// 2^y for the lanes of k (y finite there; the others may hold anything and come back 0), for the
// probabilities of prefill_amx's softmax, which are rounded to bf16 (8 bits): y's fraction above
// its floor (vreduceps) through a degree-4 polynomial, within 3e-6 of 2^f, scaled by 2^floor(y)
// (vscalefps floors y itself). 6 ops a vector where exp_neg16's rounding, degree-6 polynomial and
// scaling took 10: with the tile products under it, the softmax is what bounds this kernel.
inline __m512 exp2_maskz16(__mmask16 k, __m512 y) {
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // y - floor(y), in [0, 1)
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.013534100726246834f), f, _mm512_set1_ps(0.0520114041864872f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2414429485797882f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69300377368927f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_maskz_scalef_ps(k, p, y);
}

template <int D>
void prefill_amx(const at::BFloat16* q, int64_t qs0, int64_t qs1, int64_t H, const at::BFloat16* kp,
                 const at::BFloat16* vp, const int64_t* tables, const int64_t* offsets, const int64_t* starts,
                 const int64_t* lens, int64_t C, int64_t kvh, int64_t ps, int64_t page_stride, int64_t head_stride,
                 float scale, int64_t window, const float* sinks, at::BFloat16* out) {
  constexpr int W = D / 2;    // words (bf16 pairs) a row
  constexpr int DC = D / 32;  // Q tiles across a row (32 d each)
  constexpr int DT = D / 16;  // O tiles across a row (16 d each)
  const int64_t g = H / kvh;
  const PrefillPlan pl = plan_prefill(starts, lens, C, kvh, D, window, AQ, AK);
  const auto &row0 = pl.row0, &span = pl.span, &ktoff = pl.ktoff, &bound = pl.bound;
  const auto& items = pl.items;
  const int64_t parts = int64_t(bound.size()) - 1;
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Per (chunk, kv head), span * D / 2 words each, zero past the chunk's last slot, both as B
  // tiles: kt [16 keys][DC][16 words of d][16 keys] (K^T in pairs of d), vt [32 keys][DT][16
  // pairs of keys][16 d] (V in pairs of keys). Word offsets: ktoff / 2.
  // (kept per calling thread between calls: a fresh allocation this size is a fresh mmap, whose
  // page faults cost more than the copy)
  thread_local std::vector<uint32_t> kt_buf, vt_buf;
  const size_t words = size_t(ktoff[C * kvh] / 2);
  if (kt_buf.size() < words) kt_buf.resize(words), vt_buf.resize(words);
  uint32_t *const kt = kt_buf.data(), *const vt = vt_buf.data();
  alignas(64) static constexpr int16_t PIDX[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  at::parallel_for(0, C * kvh, 1, [&](int64_t a, int64_t b) {
    alignas(64) uint32_t rows[16 * W];  // 16 keys' rows, as words
    alignas(64) static const uint16_t zeros[D] = {};
    const __m512i gidx = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(W));  // key t's word w at t * W + w
    const __m512i pidx = _mm512_load_si512(PIDX);
    for (int64_t it = a; it < b; ++it) {
      const int64_t c = it / kvh, h = it % kvh, ctx = starts[c] + lens[c], n = span[c];
      const int64_t* table = tables + offsets[c];
      auto slot = [&](const at::BFloat16* pool, int64_t k) {
        return k < ctx ? reinterpret_cast<const uint16_t*>(pool + table[k / ps] * page_stride + h * head_stride + (k % ps) * D)
                       : zeros;
      };
      uint32_t* kd = kt + ktoff[it] / 2;
      uint32_t* vd = vt + ktoff[it] / 2;
      for (int64_t k0 = 0; k0 < n; k0 += 16) {
        for (int t = 0; t < 16; ++t) std::memcpy(rows + t * W, slot(kp, k0 + t), D * 2);
        for (int w = 0; w < W; ++w)  // word w of the 16 keys: row w % 16 of the block's tile w / 16
          _mm512_storeu_si512(kd + (k0 / 16 * DC + w / 16) * 256 + w % 16 * 16,
                             _mm512_i32gather_epi32(gidx, reinterpret_cast<const int*>(rows + w), 4));
      }
      for (int64_t k0 = 0; k0 < n; k0 += AK)
        for (int t = 0; t < 16; ++t) {  // keys k0 + 2t and k0 + 2t + 1: row t of the block's DT tiles
          const uint16_t *r0 = slot(vp, k0 + 2 * t), *r1 = slot(vp, k0 + 2 * t + 1);
          for (int dt = 0; dt < DT; ++dt) {
            const __m512i both = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 16 * dt))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 16 * dt)), 1);
            _mm512_storeu_si512(vd + (k0 / AK * DT + dt) * 256 + t * 16, _mm512_permutexvar_epi16(pidx, both));
          }
        }
    }
  });
  const float NEG = -std::numeric_limits<float>::infinity();
  const __m512 NEGv = _mm512_set1_ps(NEG);
  const float LOG2E = 1.44269504088896341f;
  const __m512 vs = _mm512_set1_ps(scale * LOG2E);
  at::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
    const TileConfig cfg;
    _tile_loadconfig(&cfg);
    std::vector<uint16_t> qbuf(g * AQ * D);  // the item's rows of each of the kv head's query heads
    alignas(64) uint16_t Pb[AQ * KB];
    alignas(64) float Sb[2][AQ * KB], Ob[AQ * D];
    alignas(64) float m[2][AQ], l[2][AQ], corr[AQ];  // m, l: two heads' (one finishing as the next begins)
    for (int64_t ii = bound[pb]; ii < bound[pe]; ++ii) {
      const PrefillPlan::Item it = items[ii];
      const int64_t nq = it.p1 - it.p0;
      const int64_t first_row = row0[it.c] + it.p0 - starts[it.c];
      const uint32_t* Kt = kt + ktoff[it.c * kvh + it.h] / 2;
      const uint32_t* Vt = vt + ktoff[it.c * kvh + it.h] / 2;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, it.p0 - window + 1) : 0;
      const int64_t kfirst = lo / AK * AK, hi = (it.p1 + AK - 1) / AK * AK;  // keys [kfirst, hi) cover every row's
      for (int64_t j = 0; j < g; ++j) {
        uint16_t* Q = qbuf.data() + j * AQ * D;
        for (int64_t i = 0; i < nq; ++i) std::memcpy(Q + i * D, q + (first_row + i) * qs0 + (it.h * g + j) * qs1, D * 2);
        std::memset(Q + nq * D, 0, (AQ - nq) * D * 2);  // padding rows: computed, never written
      }
      // The work of an item as units (a query head, a block of KB keys), one after the other; the
      // next unit's scores are computed while this unit's softmax runs (their tile products
      // spread between its rows), so that the tiles and the vector units work at once.
      const int64_t nb = (hi - kfirst + KB - 1) / KB, U = g * nb;
      auto block = [&](int64_t u) { return kfirst + u % nb * KB; };
      auto passes = [&](int64_t u) { return int((std::min<int64_t>(block(u) + KB, hi) - block(u)) / AK); };
      // S = Q K^T for unit u's keys k .. k + 31 into Sb[u % 2] (tile numbers are immediates: even d
      // chunks' operands in tiles 0, 2, 3, odd ones' in 1, 6, 7, so a chunk's loads need not
      // wait for the last products)
      auto scores = [&](int64_t u, int k) {
        const uint16_t* Q = qbuf.data() + u / nb * AQ * D;
        const uint32_t* b0 = Kt + (block(u) + k) / 16 * DC * 256;
        const uint32_t* b1 = b0 + DC * 256;
        float* S = Sb[u & 1];
        _tile_zero(4);
        _tile_zero(5);
        for (int dc = 0; dc < DC; dc += 2) {
          _tile_loadd(0, Q + dc * 32, D * 2);
          _tile_loadd(2, b0 + dc * 256, 64);
          _tile_loadd(3, b1 + dc * 256, 64);
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 0, 3);
          if (dc + 1 < DC) {
            _tile_loadd(1, Q + (dc + 1) * 32, D * 2);
            _tile_loadd(6, b0 + (dc + 1) * 256, 64);
            _tile_loadd(7, b1 + (dc + 1) * 256, 64);
            _tile_dpbf16ps(4, 1, 6);
            _tile_dpbf16ps(5, 1, 7);
          }
        }
        _tile_stored(4, S + k, KB * 4);
        _tile_stored(5, S + k + 16, KB * 4);
      };
      // O += P V for unit u (its probabilities in Pb), in steps spread over the next unit's max
      // pass: O's four tiles (16 d each) of a group of 64 d in tiles 4-7 (zero at the head's first
      // block, else loaded from Ob), P in tile 0, V in 1-3
      constexpr int G = DT >= 4 ? DT / 4 : 1;
      auto pv_steps = [&](int64_t u) { return G * passes(u); };
      auto pv_step = [&](int64_t u, int st) {
        const int64_t k0 = block(u);
        const int nkk = passes(u), dt = st / nkk * 4, kk = st % nkk, k = kk * AK;
        if (kk == 0) {
          if (k0 == kfirst) {
            _tile_zero(4);
            _tile_zero(5);
            if constexpr (DT >= 4) {
              _tile_zero(6);
              _tile_zero(7);
            }
          } else {
            _tile_loadd(4, Ob + dt * 16, D * 4);
            _tile_loadd(5, Ob + (dt + 1) * 16, D * 4);
            if constexpr (DT >= 4) {
              _tile_loadd(6, Ob + (dt + 2) * 16, D * 4);
              _tile_loadd(7, Ob + (dt + 3) * 16, D * 4);
            }
          }
        }
        const uint32_t* vb = Vt + ((k0 + k) / AK * DT + dt) * 256;
        _tile_loadd(0, Pb + k, KB * 2);
        _tile_loadd(1, vb, 64);
        _tile_loadd(2, vb + 256, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 0, 2);
        if constexpr (DT >= 4) {
          _tile_loadd(3, vb + 512, 64);
          _tile_dpbf16ps(6, 0, 3);
          _tile_loadd(1, vb + 768, 64);
          _tile_dpbf16ps(7, 0, 1);
        }
        if (kk == nkk - 1) {
          _tile_stored(4, Ob + dt * 16, D * 4);
          _tile_stored(5, Ob + (dt + 1) * 16, D * 4);
          if constexpr (DT >= 4) {
            _tile_stored(6, Ob + (dt + 2) * 16, D * 4);
            _tile_stored(7, Ob + (dt + 3) * 16, D * 4);
          }
        }
      };
      // a head's rows of O, normalised, once its last block's products are in Ob
      auto finish = [&](int64_t u) {
        const int64_t head = it.h * g + u / nb;
        const float *mh = m[u / nb & 1], *lh = l[u / nb & 1];
        for (int64_t i = 0; i < nq; ++i) {
          const float denom = lh[i] + (sinks ? std::exp(sinks[head] - mh[i]) : 0.f);
          const __m512 inv = _mm512_set1_ps(1.f / denom);
          uint16_t* o = reinterpret_cast<uint16_t*>(out + ((first_row + i) * H + head) * D);
          for (int d = 0; d < D; d += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(Ob + i * D + d), inv)));
        }
      };
      auto last_block = [&](int64_t u) { return block(u) + KB >= hi; };
      for (int p = 0; p < passes(0); ++p) scores(0, p * AK);
      for (int64_t u = 0; u < U; ++u) {
        const int64_t head = it.h * g + u / nb, k0 = block(u);
        const int64_t k1 = std::min<int64_t>(k0 + KB, hi);
        const int nk = int(k1 - k0);
        const int next = u + 1 < U ? passes(u + 1) : 0;  // the next unit's passes, spread over this one's rows
        const int prev = u > 0 ? pv_steps(u - 1) : 0;   // the last unit's P V steps, over this one's max pass
        const float* S = Sb[u & 1];
        float *mh = m[u / nb & 1], *lh = l[u / nb & 1];
        if (k0 == kfirst) {
          std::fill(mh, mh + AQ, sinks ? sinks[head] : NEG);
          std::fill(lh, lh + AQ, 0.f);
        }
        // the softmax over the block, its 16 rows at once where they can be: each row's masked
        // max as a vector, then the rows' maxima, corrections and sums one vector each (reduce16's
        // shuffle tree instead of a horizontal reduction and a scalar exp a row: the rows are short);
        // the probabilities rounded to bf16, zero where the row does not attend
        __m512 red[AQ];
        int64_t first[AQ], last[AQ];
        for (int i = 0; i < AQ; ++i) {
          const int64_t pos = it.p0 + i;
          first[i] = std::max<int64_t>(k0, window > 0 ? pos - window + 1 : 0);
          last[i] = i < nq ? std::min<int64_t>(k1 - 1, pos) : k0 - 1;  // padding rows attend nothing
          const float* srow = S + i * KB;
          __m512 bm = NEGv;
          for (int64_t v = (first[i] - k0) / 16 * 16; v <= last[i] - k0; v += 16)
            bm = _mm512_mask_max_ps(bm, key_lanes(k0 + v, first[i], last[i]), bm, _mm512_load_ps(srow + v));
          red[PERM[i]] = bm;
          for (int st = i * prev / AQ; st < (i + 1) * prev / AQ; ++st) pv_step(u - 1, st);
        }
        if (u > 0 && last_block(u - 1)) finish(u - 1);
        const __m512 mold = _mm512_load_ps(mh);
        const __m512 mnew = _mm512_max_ps(mold, _mm512_mul_ps(reduce16_by(red, [](__m512 a, __m512 b) {
                                                                return _mm512_max_ps(a, b);
                                                              }), _mm512_set1_ps(scale)));
        // ~0 where nothing was attended before (m = -inf: exp_neg16 clamps, the NaN of -inf - -inf too)
        const __m512 cv = exp_neg16(_mm512_sub_ps(mold, mnew));
        _mm512_store_ps(mh, mnew);
        _mm512_store_ps(corr, cv);
        for (int i = 0; i < AQ; ++i) {
          uint16_t* prow = Pb + i * KB;
          const float* srow = S + i * KB;
          __m512 sum = _mm512_setzero_ps();
          if (first[i] > last[i]) {
            std::memset(prow, 0, nk * 2);
          } else {
            const __m512 vm = _mm512_set1_ps(mh[i] * LOG2E);
            for (int v = 0; v < nk; v += 32) {
              const __mmask16 m0 = key_lanes(k0 + v, first[i], last[i]), m1 = key_lanes(k0 + v + 16, first[i], last[i]);
              if (!(m0 | m1)) {
                _mm512_store_si512(prow + v, _mm512_setzero_si512());
                continue;
              }
              const __m512 e0 = exp2_maskz16(m0, _mm512_fmsub_ps(_mm512_load_ps(srow + v), vs, vm));
              const __m512 e1 = exp2_maskz16(m1, _mm512_fmsub_ps(_mm512_load_ps(srow + v + 16), vs, vm));
              sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
              _mm512_store_si512(prow + v, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
          }
          red[PERM[i]] = sum;
          if (i % 2 && i / 2 < next) scores(u + 1, i / 2 * AK);  // (a block's passes: KB / AK = AQ / 2)
        }
        _mm512_store_ps(lh, _mm512_fmadd_ps(_mm512_load_ps(lh), cv, reduce16(red)));
        if (k0 > kfirst)  // O holds earlier blocks' sums: corrected where a row's max moved
          for (int i = 0; i < nq; ++i)
            if (corr[i] != 1.f)
              for (int d = 0; d < D; d += 16)
                _mm512_store_ps(Ob + i * D + d, _mm512_mul_ps(_mm512_load_ps(Ob + i * D + d), _mm512_set1_ps(corr[i])));
      }
      for (int st = 0; st < pv_steps(U - 1); ++st) pv_step(U - 1, st);
      finish(U - 1);
    }
    _tile_release();
  });
}
#endif  // AMX
#endif  // __AVX512F__


}  // namespace

// q [n, H, D] (any strides); kc, vc [pages, kv_heads, page_size, D] contiguous; tables: the
// sequences' block tables one after the other, offsets [n + 1] where each starts; ctx [n]
// the slots each attends (its own new token included, already written). window <= 0: none;
// softcap <= 0: none; sinks: [H] float32 or an empty tensor. Returns [n, H, D].
// Writes into out [>= n, H, D] (contiguous).
void decode_into(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                 const at::Tensor& offsets, const at::Tensor& ctx, double scale, int64_t window, double softcap,
                 const at::Tensor& sinks, at::Tensor& out) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes(), "kc, vc: contiguous, same shape");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && kc.scalar_type() == vc.scalar_type(), "q, kc, vc: one dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong,
              "tables, offsets, ctx: int64");
  TORCH_CHECK(q.size(1) % kc.size(1) == 0 && q.size(2) == kc.size(3), "q's heads and head size do not fit the pool");
  auto t = tables.contiguous(), o = offsets.contiguous(), c = ctx.contiguous();
  at::Tensor sk;
  const float* sp = nullptr;
  if (sinks.defined() && sinks.numel()) {
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
}

at::Tensor paged_decode(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor tables, at::Tensor offsets,
                        at::Tensor ctx, double scale, int64_t window, double softcap, at::Tensor sinks) {
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  decode_into(q, kc, vc, tables, offsets, ctx, scale, window, softcap, sinks, out);
  return out;
}

// The step's new keys and values into their slots: token t's heads go to (pages[t], offs[t]).
// k, v [T, kv_heads, D] (any strides); kc, vc [pages, kv_heads, page_size, D] contiguous.
// (An advanced-indexing assignment did this at 35 us a layer for 64 decodes and 280 us for a
// 2048-token prefill, its source transposed; here it is one row copy per token and head.)
void write_kv(at::Tensor k, at::Tensor v, at::Tensor kc, at::Tensor vc, at::Tensor pages, at::Tensor offs) {
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

// Whether paged_prefill serves q of this dtype and head size here (else the torch path does). The
// engine asks worker/native.py's prefill_usable, which reads the same rule off the compiler's
// macros before this file is built: change both together (tests/test_native.py checks them).
bool prefill_supported(at::ScalarType dtype, int64_t head_size) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return (dtype == at::kFloat || dtype == at::kBFloat16) &&
         (head_size == 32 || head_size == 64 || head_size == 128 || head_size == 256);
#else
  return false;
#endif
}

// q [T, H, D] (the prefill chunks' rows one after the other, head rows contiguous); kc, vc
// [pages, kv_heads, page_size, D] contiguous, holding every slot of each chunk's sequence up
// to its last position (the chunk's own written already); tables: the chunks' block tables one
// after the other, offsets [C + 1] where each starts; starts [C]: the positions before each
// chunk (its cached prefix); lens [C]. window <= 0: none; sinks: [H] or empty. Returns [T, H, D].
// Writes rows out_row .. out_row + T - 1 of out [.., H, D] (contiguous).

void prefill_into(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                  const at::Tensor& offsets, const at::Tensor& starts, const at::Tensor& lens, double scale,
                  int64_t window, const at::Tensor& sinks, at::Tensor& out, int64_t out_row) {
  TORCH_CHECK(out.is_contiguous() && out.size(0) >= out_row + q.size(0), "paged_prefill: out");
  TORCH_CHECK(prefill_supported(q.scalar_type(), q.size(2)), "paged_prefill: float32 or bf16, head size 32, 64, 128 or 256, AVX-512 or AVX2");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes(), "kc, vc: contiguous, same shape");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && kc.scalar_type() == vc.scalar_type(), "q, kc, vc: one dtype");
  TORCH_CHECK(q.size(1) % kc.size(1) == 0 && q.size(2) == kc.size(3) && q.stride(2) == 1, "q does not fit the pool");
  auto t = tables.contiguous(), o = offsets.contiguous(), st = starts.contiguous(), ln = lens.contiguous();
  TORCH_CHECK(t.scalar_type() == at::kLong && o.scalar_type() == at::kLong && st.scalar_type() == at::kLong &&
              ln.scalar_type() == at::kLong && o.numel() == st.numel() + 1 && ln.numel() == st.numel(),
              "tables, offsets, starts, lens: int64, one chunk each");
  const int64_t C = st.numel(), ps = kc.size(2), P = kc.size(0);
  const int64_t *tp = t.data_ptr<int64_t>(), *op = o.data_ptr<int64_t>(), *sp = st.data_ptr<int64_t>(), *lp = ln.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(sp[c] >= 0 && lp[c] >= 1 && op[c + 1] - op[c] >= (sp[c] + lp[c] + ps - 1) / ps && op[c + 1] <= t.numel(),
                "paged_prefill: a chunk's table does not cover its slots");
    for (int64_t i = op[c]; i < op[c + 1]; ++i) TORCH_CHECK(tp[i] >= 0 && tp[i] < P, "paged_prefill: page out of the pool");
    rows += lp[c];
  }
  TORCH_CHECK(rows == q.size(0), "paged_prefill: q's rows are not the chunks' tokens");
  at::Tensor sk;
  const float* skp = nullptr;
  if (sinks.defined() && sinks.numel()) {
    sk = sinks.to(at::kFloat).contiguous();
    skp = sk.data_ptr<float>();
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && amx_ready()) {  // bf16 with AMX: tile products
    const int64_t H = q.size(1), D = q.size(2), kvh = kc.size(1);
    auto f = D == 32 ? prefill_amx<32> : D == 64 ? prefill_amx<64> : D == 128 ? prefill_amx<128> : prefill_amx<256>;
    f(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), H, kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(),
      tp, op, sp, lp, C, kvh, ps, kc.stride(0), kc.stride(1), float(scale), window, skp,
      out.data_ptr<at::BFloat16>() + out_row * H * D);
    return;
  }
#endif
#if defined(__AVX512F__)
  const int64_t H = q.size(1), D = q.size(2), kvh = kc.size(1);
  const float fs = float(scale);
  if (q.scalar_type() == at::kFloat) {
    auto f = D == 32 ? prefill<float, 32> : D == 64 ? prefill<float, 64> : D == 128 ? prefill<float, 128> : prefill<float, 256>;
    f(q.data_ptr<float>(), q.stride(0), q.stride(1), H, kc.data_ptr<float>(), vc.data_ptr<float>(), tp, op, sp, lp, C,
      kvh, ps, kc.stride(0), kc.stride(1), fs, window, skp, out.data_ptr<float>() + out_row * H * D);
  } else {
    auto f = D == 32    ? prefill<at::BFloat16, 32>
             : D == 64  ? prefill<at::BFloat16, 64>
             : D == 128 ? prefill<at::BFloat16, 128>
                        : prefill<at::BFloat16, 256>;
    f(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), H, kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(),
      tp, op, sp, lp, C, kvh, ps, kc.stride(0), kc.stride(1), fs, window, skp, out.data_ptr<at::BFloat16>() + out_row * H * D);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const int64_t H = q.size(1), D = q.size(2), kvh = kc.size(1);
  const float fs = float(scale);
  if (q.scalar_type() == at::kFloat) {
    auto f = D == 32    ? prefill_avx2<float, 32>
             : D == 64  ? prefill_avx2<float, 64>
             : D == 128 ? prefill_avx2<float, 128>
                        : prefill_avx2<float, 256>;
    f(q.data_ptr<float>(), q.stride(0), q.stride(1), H, kc.data_ptr<float>(), vc.data_ptr<float>(), tp, op, sp, lp, C,
      kvh, ps, kc.stride(0), kc.stride(1), fs, window, skp, out.data_ptr<float>() + out_row * H * D);
  } else {
    auto f = D == 32    ? prefill_avx2<at::BFloat16, 32>
             : D == 64  ? prefill_avx2<at::BFloat16, 64>
             : D == 128 ? prefill_avx2<at::BFloat16, 128>
                        : prefill_avx2<at::BFloat16, 256>;
    f(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), H, kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(),
      tp, op, sp, lp, C, kvh, ps, kc.stride(0), kc.stride(1), fs, window, skp, out.data_ptr<at::BFloat16>() + out_row * H * D);
  }
#endif
}

at::Tensor paged_prefill(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor tables, at::Tensor offsets,
                         at::Tensor starts, at::Tensor lens, double scale, int64_t window, at::Tensor sinks) {
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  prefill_into(q, kc, vc, tables, offsets, starts, lens, scale, window, sinks, out, 0);
  return out;
}

// ---------------------------------------------------------------------------- the compiled graph's op

// tokenq_native::attend(q, k, v, layer): one layer's attention for the step now running
// through the compiled forward (worker/compiled.py), all in C++: the step's K/V written into
// their slots, the decodes and the prefill chunks attended. The step's layout is not an
// argument (nothing per step may become a guard of the graph): the runner sets it for the
// calling thread before the graph runs (set_step) and clears it after. The Python op it
// replaces spent about 100 us a layer in Python, 3 ms of an 18 ms bf16 SmolLM2 decode step
// at a few sequences.
struct Step {
  bool set = false;
  at::Tensor k, v, write_pages, write_offs, dec_tables, dec_offsets, dec_ctx, pre_tables, pre_offsets, pre_starts,
      pre_lens;
  int64_t n_dec = 0;
  std::vector<double> scales;
  std::vector<int64_t> windows;
};
thread_local Step current;

void set_step(at::Tensor k, at::Tensor v, at::Tensor write_pages, at::Tensor write_offs, int64_t n_dec,
              at::Tensor dec_tables, at::Tensor dec_offsets, at::Tensor dec_ctx, at::Tensor pre_tables,
              at::Tensor pre_offsets, at::Tensor pre_starts, at::Tensor pre_lens, at::ArrayRef<double> scales,
              at::IntArrayRef windows) {
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() && k.dim() == 5, "set_step: the cache");
  TORCH_CHECK(int64_t(scales.size()) == k.size(0) && windows.size() == scales.size(), "set_step: one scale, window a layer");
  current = Step{true, k, v, write_pages, write_offs, dec_tables, dec_offsets, dec_ctx, pre_tables, pre_offsets,
                 pre_starts, pre_lens, n_dec, scales.vec(), windows.vec()};
}

void clear_step() { current = Step{}; }

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer) {
  const Step& s = current;
  TORCH_CHECK(s.set, "tokenq_native::attend outside a step (set_step)");
  TORCH_CHECK(layer >= 0 && layer < s.k.size(0), "attend: no layer ", layer);
  const int64_t n = s.write_pages.size(0), T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(T >= n && k.size(0) == T && v.size(0) == T, "attend: fewer rows than the step's tokens");
  auto kc = s.k.select(0, layer), vc = s.v.select(0, layer);
  write_kv(k.narrow(0, 0, n), v.narrow(0, 0, n), kc, vc, s.write_pages, s.write_offs);
  auto out = at::empty({T, H, D}, q.options());
  if (T > n) out.narrow(0, n, T - n).zero_();  // padding rows (see worker/compiled.py)
  const double scale = s.scales[layer];
  const int64_t window = s.windows[layer];
  if (s.n_dec) {
    TORCH_CHECK(s.dec_tables.defined() && s.dec_tables.numel(), "attend: decodes without their tables");
    decode_into(q.narrow(0, 0, s.n_dec), kc, vc, s.dec_tables, s.dec_offsets, s.dec_ctx, scale, window, 0.0,
                at::Tensor(), out);
  }
  if (n > s.n_dec) {
    TORCH_CHECK(s.pre_tables.defined() && s.pre_tables.numel(), "attend: prefill chunks without their tables");
    prefill_into(q.narrow(0, s.n_dec, n - s.n_dec), kc, vc, s.pre_tables, s.pre_offsets, s.pre_starts, s.pre_lens,
                 scale, window, at::Tensor(), out, s.n_dec);
  }
  return out.view({T, H * D});
}

// Registered as torch ops only (no Python module): the build then needs ATen's and the op
// registry's headers, not torch/extension.h (pybind11 and the whole C++ frontend), which took
// most of a cold start's 40 s build. A fragment: ``attend``, the compiled graph's op, is declared
// in worker/native.py (with its shape function), so that the graph is traced while this file
// builds; packed_gemm.cpp and greedy.cpp add their own ops.
TORCH_LIBRARY_FRAGMENT(tokenq_native, m) {
  m.def("paged_decode(Tensor q, Tensor kc, Tensor vc, Tensor tables, Tensor offsets, Tensor ctx, float scale, "
        "int window, float softcap, Tensor sinks) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) kc, Tensor(b!) vc, Tensor pages, Tensor offs) -> ()");
  m.def("paged_prefill(Tensor q, Tensor kc, Tensor vc, Tensor tables, Tensor offsets, Tensor starts, Tensor lens, "
        "float scale, int window, Tensor sinks) -> Tensor");
  m.def("set_step(Tensor k, Tensor v, Tensor write_pages, Tensor write_offs, int n_dec, Tensor dec_tables, "
        "Tensor dec_offsets, Tensor dec_ctx, Tensor pre_tables, Tensor pre_offsets, Tensor pre_starts, Tensor pre_lens, "
        "float[] scales, int[] windows) -> ()", set_step);
  m.def("clear_step() -> ()", clear_step);
}
TORCH_LIBRARY_IMPL(tokenq_native, CPU, m) {
  m.impl("attend", attend);
  m.impl("paged_decode", paged_decode);
  m.impl("write_kv", write_kv);
  m.impl("paged_prefill", paged_prefill);
}
