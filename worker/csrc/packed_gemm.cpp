// float32 linears through MKL's packed SGEMM, for the compiled forward (worker/compiled.py).
//
// Inductor packs a frozen float32 linear for oneDNN when the token dimension is dynamic (it
// uses MKL's packed SGEMM only for a fixed row count). At the row counts of decode steps MKL's
// packed kernel is the faster one on two cores (SmolLM2's shapes, 2 threads, GFLOP/s, MKL
// against oneDNN: 64 rows 255-285 against 191-236, 16 rows 170-266 against 142-184, 1 row
// 2-4x; level from 256 rows on). torch ships MKL inside libtorch_cpu and exports its CBLAS
// packing API; the symbols are looked up when the library loads, so a torch built without
// MKL (another architecture) loads these ops and sgemm_supported() says false.
//
// A packed matrix must not move (MKL's note on cblas_sgemm_pack), so it never becomes a graph
// constant that Inductor could copy: it lives here, named by an integer handle that the graph
// carries, and is freed by sgemm_release when the compiled decoder that packed it goes away.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <mutex>
#include <unordered_map>

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
  int64_t n, k;
  at::Tensor buffer;  // MKL's packed B (the weight, transposed), never moved
};

std::mutex registry_lock;
std::unordered_map<int64_t, Packed> registry;
int64_t next_handle = 1;

Packed lookup(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_lock);
  auto it = registry.find(handle);
  TORCH_CHECK(it != registry.end(), "sgemm_packed: no packed weight ", handle);
  return it->second;
}

// The row count MKL is told at packing time: the packed B it returns serves any row count (a
// test checks 1 to 2048 rows against F.linear); 64 is a decode step's.
constexpr int kPackRows = 64;

}  // namespace

bool sgemm_supported() { return mkl().ok(); }

// w [N, K] float32 -> a handle to its packed copy
int64_t sgemm_pack(const at::Tensor& w) {
  TORCH_CHECK(mkl().ok(), "sgemm_pack: this torch has no MKL");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "sgemm_pack: a 2-D float32 CPU weight");
  auto wc = w.contiguous();
  const int n = int(wc.size(0)), k = int(wc.size(1));
  const size_t bytes = mkl().get_size(kBMatrix, kPackRows, n, k);
  // The size MKL asks for is about twice the weight plus a few MB; only what it writes (about
  // the weight's size) becomes resident.
  auto buffer = at::empty({int64_t(bytes / sizeof(float)) + 16}, wc.options());
  mkl().pack(kRowMajor, kBMatrix, kTrans, kPackRows, n, k, 1.0f, wc.data_ptr<float>(), k, buffer.data_ptr<float>());
  std::lock_guard<std::mutex> g(registry_lock);
  const int64_t handle = next_handle++;
  registry.emplace(handle, Packed{n, k, buffer});
  return handle;
}

void sgemm_release(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_lock);
  registry.erase(handle);
}

// x [M, K] float32 -> x @ w.T [M, N]
at::Tensor sgemm_packed(const at::Tensor& x, int64_t handle) {
  const Packed p = lookup(handle);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == p.k && x.scalar_type() == at::kFloat, "sgemm_packed: x must be [M, ", p.k,
              "] float32");
  auto xc = x.contiguous();
  const int64_t m = xc.size(0);
  auto y = at::empty({m, p.n}, xc.options());
  if (m == 0) return y;
  mkl().compute(kRowMajor, kNoTrans, kPacked, int(m), int(p.n), int(p.k), xc.data_ptr<float>(), int(p.k),
                p.buffer.data_ptr<float>(), int(p.k), 0.0f, y.data_ptr<float>(), int(p.n));
  return y;
}

at::Tensor sgemm_packed_meta(const at::Tensor& x, int64_t handle) {
  return at::empty_symint({x.sym_size(0), c10::SymInt(lookup(handle).n)}, x.options());
}

TORCH_LIBRARY_FRAGMENT(tokenq_native, m) {
  m.def("sgemm_supported() -> bool", sgemm_supported);
  m.def("sgemm_pack(Tensor w) -> int", sgemm_pack);
  m.def("sgemm_release(int handle) -> ()", sgemm_release);
  m.def("sgemm_packed(Tensor x, int handle) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenq_native, CPU, m) { m.impl("sgemm_packed", sgemm_packed); }
TORCH_LIBRARY_IMPL(tokenq_native, Meta, m) { m.impl("sgemm_packed", sgemm_packed_meta); }
