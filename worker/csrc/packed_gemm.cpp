// Linears through weights packed once, for the compiled forward (worker/compiled.py): float32
// through AVX-512 or AVX2 vector panels at a decode step's rows and, past them, MKL's packed
// SGEMM (Intel; AMD without AVX-512) or oneDNN's (AMD with AVX-512), bfloat16
// at decode row counts through AMX tile products, or where there is no AMX through AVX512-BF16
// dot products (gemm_panels, below; on Intel only a decode step's fewest rows, more through a
// float32 copy: bf16_half_rate, below), and where there is neither, widened to float32 for the
// float32 kernels (widens, below).
//
// float32. Inductor packs a frozen float32 linear for oneDNN when the token dimension is
// dynamic (it uses MKL's packed SGEMM only for a fixed row count). At the row counts of decode
// steps MKL's packed kernel is the faster one on two cores (SmolLM2's shapes, 2 threads,
// GFLOP/s, MKL against oneDNN: 64 rows 255-285 against 191-236, 16 rows 170-266 against
// 142-184, 1 row 2-4x; level from 256 rows on). torch ships MKL inside libtorch_cpu and
// exports its CBLAS packing API; the symbols are looked up when the library loads, so a torch
// built without MKL (another architecture) loads these ops and uses oneDNN's alone.
//
// float32 without AVX-512 on AMD (an AVX2 EPYC): MKL's packed kernels lost to oneDNN's there at
// decode rows (decode steps at 64 / 16 / 1 sequences 220 / 114 / 63 ms against 193 / 76 / 39),
// and oneDNN's to AVX2 vector panels (gemm_panels, below: kPanelRowsAvx2); past a decode step's
// rows (prefill chunks) MKL's is the faster one (a layer's four linears, 2 threads, MKL's time
// over oneDNN's: small 1.10 at 64 rows, 1.00 at 192, 0.94 at 256, 0.88 at 1,024 and 2,048;
// SmolLM2 1.05, 1.00, 0.97, 0.92, 0.91), so those rows go to MKL's copy of the weight.
//
// bfloat16 (AMX). A decode step's linears read every weight for a few rows each: they are
// bound by how fast the weights stream in, and oneDNN's kernels (brg_matmul on AMX) leave that
// stream idle while the tiles compute (small's twelve layers, 151 MB, 2 cores: 7.1-7.7 ms at 1
// row, 9.0-9.3 at 32, 11.3-12.2 at 64, where a plain read of the same bytes takes 6.3).
// gemm_tiles keeps it busy: the weight is stored in the order the kernel reads it, B
// tiles of 16 key pairs x 16 columns, and each thread prefetches its stream 32 KB ahead into
// L2, spread over every pass of a block, while the tiles multiply: 5.5-6.3 ms at 1 row, 6.0-6.7
// at 32, 8.7-9.8 at 64. Past kTileRows rows (prefill chunks, compute-bound) oneDNN's kernel is
// the faster one again (level at 192 rows): those rows go to oneDNN's packed copy of the same
// weight. Both sum the products in float32 and round once to bf16; they differ only in the
// order of the sums (99.99% of outputs equal).
//
// A packed matrix must not move (MKL's note on cblas_sgemm_pack), so it never becomes a graph
// constant that Inductor could copy: it lives here, named by an integer handle that the graph
// carries, and is freed by gemm_release when the compiled decoder that packed it goes away.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <unordered_map>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define TOKENQ_PANELS 1  // float32 vector panels: AVX-512, or AVX2 with FMA (below)
#endif

#include "amx.h"

namespace {

// CBLAS's constants, as in mkl_cblas.h (not shipped with torch)
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

using PackGetSize = size_t (*)(int identifier, int m, int n, int k);
using Pack = void (*)(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src, int ld,
                      float* dest);
using Compute = void (*)(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);

struct Mkl {
  PackGetSize get_size = nullptr;
  Pack pack = nullptr;
  Compute compute = nullptr;
  Mkl() {
    get_size = reinterpret_cast<PackGetSize>(dlsym(RTLD_DEFAULT, "cblas_sgemm_pack_get_size"));
    pack = reinterpret_cast<Pack>(dlsym(RTLD_DEFAULT, "cblas_sgemm_pack"));
    compute = reinterpret_cast<Compute>(dlsym(RTLD_DEFAULT, "cblas_sgemm_compute"));
  }
  bool ok() const { return get_size && pack && compute; }
};

const Mkl& mkl() {
  static const Mkl m;
  return m;
}

struct Packed {
  enum class Kernel { onednn, mkl, tiles, panels, widened };
  int64_t n, k;
  at::ScalarType dtype;            // what the kernels multiply: float32 for a widened bf16 weight
  at::ScalarType io;               // what x and y are (dtype, or bf16 widened: see widens)
  Kernel kernel = Kernel::onednn;  // rows up to kernel_rows(kernel, dtype)
  at::Tensor buffer;               // the weight as `kernel` reads it (MKL's packed B, AMX tiles, panels)
  Kernel past = Kernel::onednn;    // rows past them (all when kernel is oneDNN's; none for MKL's)
  at::Tensor past_buffer;          // the weight as `past` reads it: oneDNN's or MKL's packed copy
  std::shared_ptr<const Packed> wide;  // Kernel::widened's: the weight widened to float32, packed as float32's
};

std::mutex registry_lock;
std::unordered_map<int64_t, Packed> registry;
int64_t next_handle = 1;

Packed lookup(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_lock);
  auto it = registry.find(handle);
  TORCH_CHECK(it != registry.end(), "gemm_packed: no packed weight ", handle);
  return it->second;
}

int64_t keep(Packed p) {
  std::lock_guard<std::mutex> g(registry_lock);
  const int64_t handle = next_handle++;
  registry.emplace(handle, std::move(p));
  return handle;
}

// The row count MKL is told at packing time: the packed B it returns serves any row count (a
// test checks 1 to 2048 rows against F.linear); 64 is a decode step's. oneDNN takes it as a hint.
constexpr int kPackRows = 64;

// ---------------------------------------------------------------------------- packed copies on huge pages

// A decode step streams every packed weight once, in order (SmolLM2 in float32: 430 MB a
// step). On 4 KiB pages that stream takes a TLB miss every 4 KiB, and the prefetches that run
// ahead of it cross a page every 32 lines. So the packed copies are carved, one after the other,
// from chunks aligned to 2 MiB and advised as huge pages (MADV_HUGEPAGE: where Linux grants
// them on request, its common default; it refuses the advice where it has none, and the chunks
// stay on 4 KiB pages). SmolLM2's 30 layers on the 480 MiB Intel Xeon, 2 threads, weights
// cold, ms, 4 KiB against huge pages, two rounds alternated: float32 1 row 21.6, 21.0 against
// 15.9, 17.6, 16 rows 30.9, 30.9 against 24.3, 26.3; bf16 (tiles) 1 row 11.1, 11.1 against 9.2,
// 10.0, 16 rows 12.2, 12.2 against 10.1, 11.3; at 64 rows less. A chunk is freed with the last
// copy carved from it.
constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kChunk = size_t(64) << 20;  // (virtual: what is never written is never resident)

at::Tensor empty_on_huge_pages(int64_t numel, const at::TensorOptions& options) {
  static std::mutex lock;
  static std::weak_ptr<char> current;  // the chunk being carved, while any copy in it lives
  static size_t used = 0, size = 0;
  const size_t bytes = (size_t(numel) * options.dtype().itemsize() + 4095) & ~size_t(4095);
  std::lock_guard<std::mutex> g(lock);
  std::shared_ptr<char> chunk = current.lock();
  if (!chunk || used + bytes > size) {
    size = std::max(kChunk, (bytes + kHugePage - 1) / kHugePage * kHugePage);
    char* mem = static_cast<char*>(std::aligned_alloc(kHugePage, size));
    TORCH_CHECK(mem != nullptr, "gemm_pack: out of memory (", size, " bytes)");
    madvise(mem, size, MADV_HUGEPAGE);
    chunk = std::shared_ptr<char>(mem, std::free);
    current = chunk;
    used = 0;
  }
  char* p = chunk.get() + used;
  used += bytes;
  return at::from_blob(p, {numel}, [chunk](void*) {}, options);
}

// ---------------------------------------------------------------------------- float32: MKL

at::Tensor pack_mkl(const at::Tensor& w) {
  const int n = int(w.size(0)), k = int(w.size(1));
  const size_t bytes = mkl().get_size(kBMatrix, kPackRows, n, k);
  // The size MKL asks for is about twice the weight plus a few MB; only what it writes (about
  // the weight's size) becomes resident. Not on huge pages: its writes are spread over the
  // buffer, and on 2 MiB pages all of it became resident (its rows are a prefill's wherever
  // the panels serve).
  auto buffer = at::empty({int64_t(bytes / sizeof(float)) + 16}, w.options());
  mkl().pack(kRowMajor, kBMatrix, kTrans, kPackRows, n, k, 1.0f, w.data_ptr<float>(), k, buffer.data_ptr<float>());
  return buffer;
}

void gemm_mkl(const Packed& p, const at::Tensor& packed, const at::Tensor& x, at::Tensor& y) {
  mkl().compute(kRowMajor, kNoTrans, kPacked, int(x.size(0)), int(p.n), int(p.k), x.data_ptr<float>(), int(p.k),
                packed.data_ptr<float>(), int(p.k), 0.0f, y.data_ptr<float>(), int(p.n));
}

// ---------------------------------------------------------------------------- bfloat16: oneDNN

// torch's own oneDNN ops (what Inductor calls for a packed linear), boxed: their C++ types are
// not part of torch's public headers
at::Tensor call(const c10::OperatorHandle& op, std::vector<c10::IValue> stack) {
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Whether this torch has oneDNN's linear ops (its CPU builds do)
bool onednn_ok() {
  static const bool ok = [] {
    auto& d = c10::Dispatcher::singleton();
    return d.findSchema({"mkldnn::_reorder_linear_weight", ""}).has_value() &&
           d.findSchema({"mkldnn::_linear_pointwise", ""}).has_value();
  }();
  return ok;
}

at::Tensor pack_onednn(const at::Tensor& w) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  return call(op, {w, c10::IValue(int64_t(kPackRows))});
}

at::Tensor gemm_onednn(const at::Tensor& packed, const at::Tensor& x) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  // the constant arguments made once, and the stack kept by the thread: no allocation a call
  static const c10::IValue attr{std::string("none")}, scalars{c10::List<std::optional<at::Scalar>>()};
  static thread_local std::vector<c10::IValue> stack;
  stack.assign({x, packed, c10::IValue(), attr, scalars, c10::IValue()});
  op.callBoxed(&stack);
  at::Tensor y = std::move(stack[0]).toTensor();
  stack.clear();
  return y;
}

// ---------------------------------------------------------------------------- bfloat16: AMX tiles

// Rows up to this many take the tile kernel (small's shapes, ms for the twelve layers, tiles
// against oneDNN: 96 rows 12.0 / 15.4, 128 rows 14.5 / 18.0, 192 rows 19.8 / 20.3, 256 rows
// 26.3 / 22.7).
constexpr int64_t kTileRows = 128;
// How far ahead of its reads each thread prefetches its weight stream (4, 16, 32 and 64 KB
// measured: 32 and 64 level, 4 KB a third of the gain).
constexpr int64_t kPrefetch = 32 * 1024;

bool tiles_fit(int64_t n, int64_t k) { return n % 32 == 0 && k % 32 == 0; }

#if defined(TOKENQ_AMX)
// w [N, K] -> [N / 32][K / 32][2][16][16][2]: for each block of 32 columns and 32 keys, two B
// tiles (columns 0-15, 16-31), each 16 key pairs x 16 columns x the pair; a block's tiles
// follow each other in the order the kernel reads them.
at::Tensor pack_tiles(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  auto out = empty_on_huge_pages(N * K, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t nb = 0; nb < N / 32; ++nb)
    for (int64_t kb = 0; kb < K / 32; ++kb)
      for (int64_t t = 0; t < 2; ++t)
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t c = 0; c < 16; ++c)
            for (int64_t p = 0; p < 2; ++p) *d++ = s[(nb * 32 + t * 16 + c) * K + kb * 32 + 2 * r + p];
  return out;
}

// The tiles of a pass over `rows` rows (1-32): C 0-1 and A 4 hold the first 16, C 2-3 and A 5
// the rest (unconfigured where there are none); B 6-7 are whole.
TileConfig pass_tiles(int64_t rows) {
  TileConfig cfg;
  const auto r0 = uint8_t(std::min<int64_t>(16, rows)), r1 = uint8_t(std::max<int64_t>(0, rows - 16));
  for (int t : {0, 1, 4}) cfg.rows[t] = r0;
  for (int t : {2, 3, 5}) {
    cfg.rows[t] = r1;
    if (!r1) cfg.colsb[t] = 0;
  }
  return cfg;
}

// y [M, N] = x [M, K] w^T, M <= kTileRows. Each thread takes a run of 32-column blocks; a
// block is computed 32 rows at a time as four tiles: 2 row tiles of x (A, read in place) times
// the block's 2 B tiles, summed over K. A last pass of fewer rows runs on tiles configured
// that short (copying those rows into a zero-padded buffer cost 9-20 us a call).
void gemm_tiles(const Packed& p, const at::Tensor& x, at::Tensor& y) {
  const int64_t M = x.size(0), K = p.k, N = p.n, KB = K / 32, NB = N / 32, block = KB * 2048;
  const int64_t passes = (M + 31) / 32, whole = M / 32;  // passes, and those of 32 rows
  const uint16_t* A = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const char* B = reinterpret_cast<const char*>(p.buffer.data_ptr());
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    const TileConfig full = pass_tiles(32), last = pass_tiles(M - whole * 32);
    const TileConfig* loaded = nullptr;
    alignas(64) float c[32 * 32];
    // the stream is read once per pass: the prefetches of a block's bytes are spread over all
    // its passes, so the loads run under every pass's products
    const int64_t step = 2048 / passes;
    const char* ahead = B + b0 * block + kPrefetch;
    const char* end = B + b1 * block;
    for (int64_t nb = b0; nb < b1; ++nb) {
      const char* Bn = B + nb * block;
      for (int64_t pass = 0; pass < passes; ++pass) {
        const TileConfig* cfg = pass < whole ? &full : &last;
        if (cfg != loaded) _tile_loadconfig(loaded = cfg);
        const int64_t m0 = pass * 32, rows = std::min<int64_t>(32, M - m0);
        const bool two = rows > 16;
        const uint16_t* A0 = A + m0 * K;
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t kb = 0; kb < KB; ++kb) {
          for (int64_t l = 0; l < step; l += 64, ahead += 64)
            if (ahead < end) _mm_prefetch(ahead, _MM_HINT_T1);
          const char* bt = Bn + kb * 2048;
          _tile_loadd(4, A0 + kb * 32, K * 2);
          _tile_loadd(6, bt, 64);
          _tile_loadd(7, bt + 1024, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, A0 + 16 * K + kb * 32, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c, 128);
        _tile_stored(1, c + 16, 128);
        if (two) {
          _tile_stored(2, c + 16 * 32, 128);
          _tile_stored(3, c + 16 * 32 + 16, 128);
        }
        for (int64_t r = 0; r < rows; ++r) {  // round to bf16 (nearest even), 32 columns a row
          const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(c + r * 32 + 16), _mm512_load_ps(c + r * 32));
          _mm512_storeu_si512(Y + (m0 + r) * N + nb * 32, reinterpret_cast<__m512i>(v));
        }
      }
    }
    _tile_release();
  });
}
#endif

// ---------------------------------------------------------------------------- vector panels (AVX-512, AVX2)

// The same idea without AMX (AMD EPYC, Zen 4): oneDNN's kernels (avx512_core_bf16, avx512_core)
// stream a decode step's weights in without overlapping that with their products, so each
// linear takes about the sum of its read and its arithmetic (SmolLM2's gate/up in bf16, 3.5 MB:
// 16 rows 215 us, where the read alone takes 110 and the products 127). gemm_panels stores the
// weight as the kernel reads it, 32-column panels of 128 bytes a step (bf16: a pair of keys, one
// pair per 32-bit lane of two vectors; float32: one key), multiplies 12 rows at a time (24
// accumulators; bf16 VDPBF16PS, each row's key pair broadcast against the panel's two vectors;
// float32 FMAs of each row's key) and prefetches the weight stream 32 KB ahead into L2, spread
// over the panel's passes. bf16 takes it wherever there is AVX512-BF16 and no AMX; float32
// wherever there is AVX-512, for its fewest rows: past kPanelRowsF32 on AMD oneDNN's kernel, on
// Intel past kPanelRowsMkl MKL's packed SGEMM, which does not overlap the weights' stream with
// its products either, and is level with them from 128 rows on (Intel Xeon, 480 MiB L3, 2
// threads, ms for SmolLM2's 30 layers, panels against MKL: 1 row 14.2 / 15.6, 8 rows 16.2 /
// 23.0, 12 rows 19.7 / 26.5; since the passes take the keys a block at a time (kBlockSteps,
// below) 32 rows 31.9 / 41.6, 48 rows 41.4 / 51.2, 64 rows 53.4 / 57.7, 96 rows 75.2 / 86.7, 128
// rows 104 / 106, 192 rows 149 / 150; small's 12 layers: 32 rows 22.2 / 29.3, 64 rows 36.5 /
// 40.2).
#if defined(TOKENQ_PANELS)
// Rows up to this many take gemm_panels (2 threads, ms for SmolLM2's 30 layers' linears, panels
// against oneDNN; bf16: 1 row 7.7 / 11.8, 16 rows 10.3 / 14.7, 32 rows 18.3 / 23.0, 64 rows 34.3 /
// 39.5, 128 rows 66.9 / 69.2, 256 rows 135 / 133 (small's layers: 32 rows 13.7 / 14.4, 64 rows
// 25.2 / 25.1, 128 rows 49.1 / 47.3); float32: 1 row 14.0 / 18.8, 16 rows 21.2 / 24.8, 32 rows
// 35.9 / 40.1, 64 rows 69.3 / 70.1, 128 rows 133 / 130 (small's: 16 rows 15.0 / 15.7, 32 rows
// 25.8 / 25.9, 64 rows 50.4 / 46.9)).
constexpr int64_t kPanelRows = 64, kPanelRowsF32 = 32, kPanelRowsMkl = 128;
// AMD Zen 5 (family 1Ah), whose FMA units are 512 bits wide (Zen 4 splits a 512-bit FMA in two
// halves): there the panels stay ahead of oneDNN's kernels further, to 128 rows in both dtypes
// (2 threads, ms for SmolLM2's 30 layers' linears, panels against oneDNN; float32: 48 rows
// 25.4 / 30.1, 64 rows 33.2 / 37.6, 96 rows 45.6 / 49.6, 128 rows 60.5 / 62.8, 256 rows 116 / 117;
// bf16: 64 rows 16.9 / 20.5, 96 rows 22.6 / 26.9, 128 rows 30.4 / 33.3; small's twelve layers
// level from 64 rows on, within 2% to 128 in both dtypes).
constexpr int64_t kPanelRowsZen5 = 128;
// bf16 where its products run at half float32's rate (bf16_half_rate, below): the rows the bf16
// panels keep; more go to the weight's float32 copy
constexpr int64_t kPanelRowsHalfRate = 12;
// AVX2 without AVX-512 (an AMD EPYC, Zen 3: 2 threads, ms for SmolLM2's 30 layers' linears,
// panels against oneDNN's packed kernels, best of 7 alternated): 1 row 18.9 / 23.8, 4 rows 19.4 /
// 30.5, 16 rows 35.5 / 47.9, 32 rows 57.2 / 68.0, 64 rows 112 / 125, 128 rows 176 / 204, 192 rows
// 295 / 288, 256 rows 474 / 402. Past it MKL's packed SGEMM, which is ahead of oneDNN's there
// (MKL's time over oneDNN's, SmolLM2's layer: 0.97 at 256 rows, 0.91 at 2,048).
constexpr int64_t kPanelRowsAvx2 = 192;
// Rows a pass, at most: 2 x 12 accumulators + 2 weight vectors + 1 broadcast. The rows are spread
// evenly over the passes (13 rows as 7 + 6, not 12 + 1): a pass of one to three rows has too few
// accumulators to hide the products' latency, and cost as much as a full one. AMD EPYC, 2 threads,
// small's twelve layers, ms, even against 12 + rest: bf16 13 rows 5.8-6.0 / 7.2-7.6, 25 rows
// 10.7 / 12.2, 37 rows 15.3 / 16.7, 61 rows 24.1 / 25.5; float32 13 rows 12.1 / 15.7, 25 rows
// 20.3 / 28.2; 16 and 24 rows level. Each row's sums are the same either way.
#if defined(__AVX512F__)
constexpr int kRowsPass = 12;
constexpr int kSlices = 1;  // a pass takes the panel's 32 columns: two vectors
#else
// AVX2 has 16 vector registers of 8 floats: a pass takes 16 of the panel's 32 columns (two
// vectors, a slice) for at most 6 rows: 2 x 6 accumulators + 2 weight vectors + 1 broadcast.
constexpr int kRowsPass = 6;
constexpr int kSlices = 2;
#endif
// float32, where a panel takes more than one pass: the passes go over the panel's keys a block
// of this many at a time (16 KB of the panel, read again from L1 by each pass rather than from
// L2), each pass keeping its float32 sums between blocks. Every row's sums are the same, in the
// same order. Intel Xeon, 2 threads, ms for SmolLM2's 30 layers, blocks of 128 keys against
// whole panels: 16 rows 25.5 / 29.4, 24 rows 28.4 / 32.4, 32 rows 31.9 / 41.6, 64 rows 53.4 /
// 65.6 (blocks of 64 keys: 53.5, 256: 52.6); small's 12 layers: 16 rows 17.5 / 22.0, 24 rows
// 19.3 / 24.7. bf16 (AMD's AVX512-BF16, not measured blocked) keeps whole panels.
constexpr int64_t kBlockSteps = 128;

// w [N, K] -> [N / 32][K / E][32][E]: E = 2 keys a lane (bf16) or 1 (float32)
template <typename T, int E>
at::Tensor pack_panels(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  auto out = empty_on_huge_pages(N * K, w.options());
  const T* s = reinterpret_cast<const T*>(w.data_ptr());
  T* d = reinterpret_cast<T*>(out.data_ptr());
  for (int64_t nb = 0; nb < N / 32; ++nb)
    for (int64_t p = 0; p < K / E; ++p)
      for (int64_t c = 0; c < 32; ++c)
        for (int64_t e = 0; e < E; ++e) *d++ = s[(nb * 32 + c) * K + E * p + e];
  return out;
}

// The prefetch stream: a panel's 512 bytes for every 4 steps of each of its `passes` passes,
// a line whenever passes x 64 bytes are owed. (It owed 512 / passes bytes, rounded down, before:
// at pass counts that do not divide 512 it fell 0.2-1.6% behind the reads a panel, and on a
// 64 MB stream a thread, an LM head's, past its 32 KB lead: 25 rows of SmolLM2's head took 10.7
// ms against 24 rows' 6.7, 7.3 since.)
struct Stream {
  const char* ahead;
  const char* end;
  int64_t passes, owed = 0;
  void advance() {
    for (owed += 512; owed >= 64 * passes; owed -= 64 * passes, ahead += 64)
      if (ahead < end) _mm_prefetch(ahead, _MM_HINT_T1);
  }
};

// R rows of one panel: steps [p0, p1) of 128 bytes of weight, each row's step a 32-bit word of
// A (a bf16 key pair, or a float32 key) at A[r * S + step]; y's rows N elements apart. The sums
// start from zero at the first block of steps, else from acc (R x 32 floats), and go to y at
// the last, else back to acc.
#if defined(__AVX512F__)
template <bool BF16, int R>
void pass_panel(const uint32_t* A, int64_t S, int64_t p0, int64_t p1, const char* B, void* Y, int64_t N, Stream& st,
                float* acc) {
  __m512 c0[R], c1[R];
  if (p0 == 0) {
#pragma GCC unroll 16  // (left a loop, GCC turned it into two calls to memset of the arrays, every pass)
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      c0[r] = _mm512_loadu_ps(acc + r * 32);
      c1[r] = _mm512_loadu_ps(acc + r * 32 + 16);
    }
  }
  for (int64_t p = p0; p < p1; ++p) {
    if ((p & 3) == 0) st.advance();
    const __m512i b0 = _mm512_loadu_si512(B + p * 128), b1 = _mm512_loadu_si512(B + p * 128 + 64);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(int(A[r * S + p]));
      if constexpr (BF16) {
#if defined(__AVX512BF16__)
        c0[r] = _mm512_dpbf16_ps(c0[r], (__m512bh)a, (__m512bh)b0);
        c1[r] = _mm512_dpbf16_ps(c1[r], (__m512bh)a, (__m512bh)b1);
#endif
      } else {
        c0[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b0), c0[r]);
        c1[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b1), c1[r]);
      }
    }
  }
  if (p1 < S) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + r * 32, c0[r]);
      _mm512_storeu_ps(acc + r * 32 + 16, c1[r]);
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (BF16) {  // round to bf16 (nearest even), 32 columns a row
#if defined(__AVX512BF16__)
      _mm512_storeu_si512(static_cast<uint16_t*>(Y) + r * N, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(c1[r], c0[r])));
#endif
    } else {
      _mm512_storeu_ps(static_cast<float*>(Y) + r * N, c0[r]);
      _mm512_storeu_ps(static_cast<float*>(Y) + r * N + 16, c1[r]);
    }
  }
}

#else
// AVX2: R rows of one slice of a panel, 16 columns: B points at the slice's 64 bytes of the
// panel's first step (its steps are 128 bytes apart); acc holds R x 16 floats.
template <bool BF16, int R>
void pass_panel(const uint32_t* A, int64_t S, int64_t p0, int64_t p1, const char* B, void* Y, int64_t N, Stream& st,
                float* acc) {
  static_assert(!BF16, "bf16 panels take AVX512-BF16");
  __m256 c0[R], c1[R];
  if (p0 == 0) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      c0[r] = _mm256_loadu_ps(acc + r * 16);
      c1[r] = _mm256_loadu_ps(acc + r * 16 + 8);
    }
  }
  for (int64_t p = p0; p < p1; ++p) {
    if ((p & 3) == 0) st.advance();
    const float* b = reinterpret_cast<const float*>(B + p * 128);
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(reinterpret_cast<const float*>(A + r * S + p));
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
  if (p1 < S) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * 16, c0[r]);
      _mm256_storeu_ps(acc + r * 16 + 8, c1[r]);
    }
    return;
  }
#pragma GCC unroll 8  // (left a loop, the arrays lived on the stack: every step stored its 12 sums)
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(static_cast<float*>(Y) + r * N, c0[r]);
    _mm256_storeu_ps(static_cast<float*>(Y) + r * N + 8, c1[r]);
  }
}
#endif

using PassFn = void (*)(const uint32_t*, int64_t, int64_t, int64_t, const char*, void*, int64_t, Stream&, float*);
template <bool BF16, int... R>
constexpr std::array<PassFn, sizeof...(R)> pass_table(std::integer_sequence<int, R...>) {
  return {pass_panel<BF16, R + 1>...};
}
// kPasses<BF16>[r - 1]: a pass of r rows
template <bool BF16>
constexpr auto kPasses = pass_table<BF16>(std::make_integer_sequence<int, kRowsPass>());

// y [M, N] = x [M, K] w^T, M <= packed_rows(p): each thread a run of 32-column panels, each panel
// in the fewest passes of at most kRowsPass rows, the rows spread evenly over them (on AVX2 each
// slice of the panel its own passes).
void gemm_panels(const Packed& p, const at::Tensor& x, at::Tensor& y) {
  const bool bf16 = p.dtype == at::kBFloat16;
  const int64_t M = x.size(0), N = p.n, S = bf16 ? p.k / 2 : p.k, NB = N / 32, panel = S * 128;
  const int64_t passes = (M + kRowsPass - 1) / kRowsPass, size = y.element_size();
  const int64_t per = (M + passes - 1) / passes;  // rows a pass (the last may have fewer)
  const uint32_t* A = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const char* B = reinterpret_cast<const char*>(p.buffer.data_ptr());
  char* Y = reinterpret_cast<char*>(y.data_ptr());
#if defined(__AVX512F__)
  const auto& table = bf16 ? kPasses<true> : kPasses<false>;
#else
  const auto& table = kPasses<false>;  // (bf16 panels are AVX512-BF16's: panels_usable)
#endif
  const int64_t passes_panel = kSlices * passes;  // over each panel's steps
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    // a panel's bytes are prefetched over all its passes (512 bytes of weight every 4 steps)
    Stream st{B + b0 * panel + kPrefetch, B + b1 * panel, passes_panel};
    const int64_t block = bf16 || passes_panel == 1 ? S : kBlockSteps;  // steps of a block of keys
    // each pass's sums between blocks of keys: kept by the thread, not allocated every call
    static thread_local std::vector<float> acc;
    if (acc.size() < size_t(passes_panel * kRowsPass * 32)) acc.resize(passes_panel * kRowsPass * 32);
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t k0 = 0; k0 < S; k0 += block)
        for (int64_t slice = 0; slice < kSlices; ++slice)
          for (int64_t m0 = 0, pass = 0; m0 < M; m0 += per, ++pass) {
            const int64_t rows = std::min<int64_t>(per, M - m0);
            table[rows - 1](A + m0 * S, S, k0, std::min(S, k0 + block), B + nb * panel + slice * 128 / kSlices,
                            Y + (m0 * N + nb * 32 + slice * 32 / kSlices) * size, N, st,
                            acc.data() + (slice * passes + pass) * kRowsPass * 32);
          }
  });
}
#endif

bool tiles_usable() {
#if defined(TOKENQ_AMX)
  return amx_ready();
#else
  return false;
#endif
}

bool panels_usable(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(TOKENQ_PANELS)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

using Kernel = Packed::Kernel;

// (on every ISA: f32_mkl asks it on AVX2 machines too)
bool amd() {
  static const bool is = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_is("amd"));
  }();
  return is;
}

bool f32_mkl() { return mkl().ok() && !amd(); }  // Intel's float32 rows past the panels' go to MKL

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

// float32 rows past the panels' go to MKL's packed SGEMM on Intel, and on AMD without AVX-512
// (an AVX2 EPYC: kPanelRowsAvx2); on AMD with AVX-512 to oneDNN's
bool f32_past_mkl() { return f32_mkl() || (mkl().ok() && !kAvx512); }

bool zen5() {
  static const bool is = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!amd() || !__get_cpuid(1, &a, &b, &c, &d)) return false;
    return ((a >> 8) & 0xF) + ((a >> 20) & 0xFF) >= 0x1A;  // base family + extended family
  }();
  return is;
}

// An Intel CPU with AVX512-BF16 but no AMX (measured on an Emerald Rapids Xeon whose host does
// not expose AMX: family 6 model 207, 2 cores): there VDPBF16PS multiplies at half the float32
// FMAs' rate. 2 threads, GFLOP/s, SmolLM2's four shapes at 2,048 rows: bf16 159 (oneDNN's 162)
// against float32's 280 (MKL); ms for the 30 layers, bf16 panels against float32 panels on the
// same weights: 1 row 10.5 / 19.9, 8 rows 15.5 / 22.0, 12 rows 21.6 / 24.3, 16 rows 25.7 / 23.3,
// 32 rows 48.0 / 39.1, 64 rows 97.5 / 60.6. So the bf16 panels keep a decode step's fewest
// rows, where reading half the bytes wins, and more rows go to a float32 copy of the weight
// (its own panels, then MKL's), x widened and y rounded back as where bf16 widens (below).
bool bf16_half_rate() { return !amd() && !tiles_usable() && panels_usable(at::kBFloat16) && f32_mkl(); }

// The kernel of the rows past `kernel`'s
Kernel past_for(Kernel kernel, at::ScalarType dtype) {
  if (dtype == at::kBFloat16 && bf16_half_rate()) return Kernel::widened;
  return kernel == Kernel::panels && dtype == at::kFloat && f32_past_mkl() ? Kernel::mkl : Kernel::onednn;
}

// The kernel a weight of this dtype is packed for here: bf16 on AMX tiles, else on panels;
// float32 on panels (AVX-512 or AVX2), else MKL's on Intel and oneDNN's on AMD. A float32 shape
// the panels cannot take goes to MKL's on Intel, oneDNN's on AMD (whose decode rows MKL's
// kernels serve slowly without AVX-512: kPanelRowsAvx2); a bf16 one to the kernel of the rows
// past the panels'.
Kernel kernel_for(at::ScalarType dtype, int64_t n, int64_t k) {
  if (dtype == at::kBFloat16 && tiles_usable()) return tiles_fit(n, k) ? Kernel::tiles : Kernel::onednn;
  if (panels_usable(dtype) && n % 32 == 0 && k % 2 == 0) return Kernel::panels;
  if (dtype == at::kBFloat16 && panels_usable(dtype)) return past_for(Kernel::panels, dtype);
  return dtype == at::kFloat && f32_mkl() ? Kernel::mkl : Kernel::onednn;
}

// The most rows a step sends to the packed kernel (more go to the copy of `past_for`'s kernel)
int64_t kernel_rows(Kernel kernel, at::ScalarType dtype) {
  switch (kernel) {
    case Kernel::mkl: return std::numeric_limits<int64_t>::max();
    case Kernel::tiles: return kTileRows;
    case Kernel::onednn: return -1;
#if !defined(__AVX512F__) && defined(TOKENQ_PANELS)
    case Kernel::panels: return kPanelRowsAvx2;
#elif defined(TOKENQ_PANELS)
    case Kernel::panels:
      if (zen5()) return kPanelRowsZen5;
      if (dtype == at::kBFloat16 && bf16_half_rate()) return kPanelRowsHalfRate;
      return dtype == at::kBFloat16 ? kPanelRows : f32_mkl() ? kPanelRowsMkl : kPanelRowsF32;
#endif
    default: return -1;
  }
}

// Where the rows past the panels' go to oneDNN (AMD with AVX-512): oneDNN's kernels split a
// weight's columns between the threads in blocks of 64, and at a decode step's rows a weight
// whose blocks do not divide evenly among them leaves a thread idle for a block's time (SmolLM2's
// 576 and 960 columns: 9 and 15 blocks on 2 threads). An AMD EPYC (Zen 4), 2 threads, 576 keys,
// 64 rows, us a weight (30 of them, cold), oneDNN's: 512 columns 226, 576 273, 640 271, 704 312,
// 768 308, 960 409, 1,024 403 (each odd count of blocks as slow as the even count after it); the
// panels': 198, 222, 253, 272, 295, 368, 397. At 96 rows float32 576 columns 351 against the
// panels' 340, 960 569 / 552; at 128 level; bf16 at 96 rows 173 / 159 and 304 / 261, at 128 233 /
// 214 and 380 / 351. So such a weight keeps the panels to this many rows. SmolLM2's 30 layers at
// 64 rows, float32: 77.5-82.6 ms -> 71-74 (its gate/up, 48 blocks, stays oneDNN's: 35.4 against
// the panels' 36.2-38.1); its decode steps at 64 sequences, float32, the rule on and off in
// turn in one engine: 2.7% faster (4.4 ms of 161-175, over four runs).
constexpr int64_t kPanelRowsUneven = 128;

// The most rows a step sends to p's packed kernel: kernel_rows, or where the rows past them go
// to oneDNN and its column blocks would split unevenly among the threads, kPanelRowsUneven
int64_t packed_rows(const Packed& p) {
  const int64_t rows = kernel_rows(p.kernel, p.dtype);
  if (p.kernel == Kernel::panels && p.past == Kernel::onednn && (p.n + 63) / 64 % at::get_num_threads() != 0)
    return std::max(rows, kPanelRowsUneven);
  return rows;
}

}  // namespace

bool gemm_supported(at::ScalarType dtype) {
  if (dtype == at::kFloat) return panels_usable(dtype) || mkl().ok() || onednn_ok();
  return dtype == at::kBFloat16 && (tiles_usable() || panels_usable(dtype) || gemm_supported(at::kFloat));
}

// Whether bf16 GEMMs run at about twice float32's rate here: on AMX tiles, or on AVX512-BF16 dot
// products but where those run at half rate (bf16_half_rate). worker/screened_head.py asks it.
bool bf16_double_rate() { return tiles_usable() || (panels_usable(at::kBFloat16) && !bf16_half_rate()); }

// bf16 on a CPU with no bf16 products (neither AMX nor AVX512-BF16: an Intel Ice Lake, an AVX2
// CPU): the weight is widened to float32 once, at packing, and multiplied by the float32
// kernels; x is widened and y rounded back to bf16 each call. oneDNN emulates bf16 there, at a
// fifth of float32's rate (2 Ice Lake cores, its packed 1024x2048x2048: 66 GFLOP/s against
// 320). Widening is exact, so the result is the float32 sum of the same products, rounded once,
// as oneDNN's is: the two differ only in the order of the sums.
bool widens(at::ScalarType dtype) { return dtype == at::kBFloat16 && !tiles_usable() && !panels_usable(dtype); }

// Which kernel serves linears in dtype here (the engine's log line)
std::string gemm_kernel(at::ScalarType dtype) {
  if (!gemm_supported(dtype)) return "none";
  if (widens(dtype)) return "bf16 widened to float32: " + gemm_kernel(at::kFloat);  // native.WIDENED
  const Kernel kernel = kernel_for(dtype, 32, 32), past = past_for(kernel, dtype);
  const std::string rows = std::to_string(kernel_rows(kernel, dtype)) + " rows";
  const std::string past_rows = past == Kernel::widened
                                    ? " (past " + rows + " widened to float32: " + gemm_kernel(at::kFloat) + ")"
                                : past == Kernel::mkl ? " (MKL's packed SGEMM past " + rows + ")"
                                : kernel == Kernel::panels && kernel_rows(kernel, dtype) < kPanelRowsUneven
                                    ? " (oneDNN past " + rows + ", " + std::to_string(kPanelRowsUneven) +
                                          " for a weight it would split unevenly)"
                                    : " (oneDNN past " + rows + ")";
  switch (kernel) {
    case Kernel::mkl: return "MKL's packed SGEMM";
    case Kernel::onednn: return past == Kernel::mkl ? "oneDNN" + past_rows : "oneDNN";
    case Kernel::tiles: return "AMX tiles" + past_rows;
    case Kernel::panels:
      return std::string(dtype == at::kBFloat16 ? "AVX512-BF16" : kAvx512 ? "AVX-512" : "AVX2") + " vectors" + past_rows;
    default: return "oneDNN";
  }
}

// w [N, K] -> its packed copies for the kernels that serve it here (widen: as float32)
Packed pack(const at::Tensor& w, bool widen) {
  auto wc = widen ? w.to(at::kFloat).contiguous() : w.contiguous();
  Packed p{};
  p.n = wc.size(0), p.k = wc.size(1), p.dtype = wc.scalar_type(), p.io = w.scalar_type();
  p.kernel = kernel_for(p.dtype, p.n, p.k);
  p.past = past_for(p.kernel, p.dtype);
  if (p.kernel == Kernel::widened || p.past == Kernel::widened)
    p.wide = std::make_shared<const Packed>(pack(w, true));
  else if (p.kernel != Kernel::mkl)
    p.past_buffer = p.past == Kernel::mkl ? pack_mkl(wc) : pack_onednn(wc);
  switch (p.kernel) {
    case Kernel::mkl: p.buffer = pack_mkl(wc); break;
    case Kernel::onednn: if (p.past != Kernel::onednn) p.buffer = pack_onednn(wc); break;
#if defined(TOKENQ_AMX)
    case Kernel::tiles: p.buffer = pack_tiles(wc); break;
#endif
#if defined(TOKENQ_PANELS)
    case Kernel::panels:
      p.buffer = p.dtype == at::kBFloat16 ? pack_panels<uint16_t, 2>(wc) : pack_panels<float, 1>(wc);
      break;
#endif
    default: break;
  }
  return p;
}

// w [N, K] (float32 or bf16) -> a handle to its packed copies
int64_t gemm_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "gemm_pack: a 2-D CPU weight");
  TORCH_CHECK(gemm_supported(w.scalar_type()), "gemm_pack: no packed kernel for ", w.scalar_type(), " here");
  return keep(pack(w, widens(w.scalar_type())));
}

void gemm_release(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_lock);
  registry.erase(handle);
}

// x [M, K] -> x @ w.T [M, N] through p's kernel for M rows
at::Tensor multiply(const Packed& p, const at::Tensor& x) {
  const int64_t m = x.size(0);
  const bool past = m > packed_rows(p);
  const Kernel kernel = past ? p.past : p.kernel;
  if (kernel == Kernel::widened) return multiply(*p.wide, x);
  const at::Tensor& buffer = past ? p.past_buffer : p.buffer;  // the copy `kernel` reads
  const auto xc = x.to(p.dtype).contiguous();                  // widened (bf16 -> float32), else x itself
  if (kernel == Kernel::onednn) return gemm_onednn(buffer, xc).to(p.io);
  auto y = at::empty({m, p.n}, xc.options());
  if (m == 0) return y.to(p.io);
  switch (kernel) {
    case Kernel::mkl: gemm_mkl(p, buffer, xc, y); break;
#if defined(TOKENQ_AMX)
    case Kernel::tiles: gemm_tiles(p, xc, y); break;
#endif
#if defined(TOKENQ_PANELS)
    case Kernel::panels: gemm_panels(p, xc, y); break;
#endif
    default: break;
  }
  return y.to(p.io);  // rounded to bf16 (nearest even) where widened
}

at::Tensor gemm_packed(const at::Tensor& x, int64_t handle) {
  const Packed p = lookup(handle);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == p.k && x.scalar_type() == p.io, "gemm_packed: x must be [M, ", p.k, "] ",
              p.io);
  return multiply(p, x);
}

at::Tensor gemm_packed_meta(const at::Tensor& x, int64_t handle) {
  return at::empty_symint({x.sym_size(0), c10::SymInt(lookup(handle).n)}, x.options());
}

TORCH_LIBRARY_FRAGMENT(tokenq_native, m) {
  m.def("gemm_supported(ScalarType dtype) -> bool", gemm_supported);
  m.def("gemm_kernel(ScalarType dtype) -> str", gemm_kernel);
  m.def("bf16_double_rate() -> bool", bf16_double_rate);
  m.def("gemm_pack(Tensor w) -> int", gemm_pack);
  m.def("gemm_release(int handle) -> ()", gemm_release);
  m.def("gemm_packed(Tensor x, int handle) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenq_native, CPU, m) { m.impl("gemm_packed", gemm_packed); }
TORCH_LIBRARY_IMPL(tokenq_native, Meta, m) { m.impl("gemm_packed", gemm_packed_meta); }
