// Paged decode attention on CPU: one query token per sequence against its KV pages.
//
// For each (sequence, kv head) the g query heads that share that kv head are scored
// against the sequence's slots page by page, with an online softmax (running max and
// denominator, float32 throughout), so each K/V slot is read once, from the pool in place,
// and converted to float32 in a small per-page buffer. Work items are split between the
// threads by the number of slots they read, not by count (contexts differ by 10x or more).
// Built and loaded by worker/native.py; worker/attention.py's torch path is the reference
// it is tested against (tests/test_native.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

  at::parallel_for(0, parts, 1, [&](int64_t pb, int64_t pe) {
    std::vector<float> qf(g * D), acc(g * D), kf(ps * D), vf(ps * D), s(g * ps), m(g), l(g);
    for (int64_t item = bound[pb]; item < bound[pe]; ++item) {
      const int64_t i = item / kvh, h = item % kvh;
      for (int64_t j = 0; j < g; ++j) {
        const T* src = qp + i * qs0 + (h * g + j) * qs1;
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = float(src[d * qs2]);
      }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
