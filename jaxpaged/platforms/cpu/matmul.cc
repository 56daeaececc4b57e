// y = x @ w for float32 on CPUs, w packed once at load time: an XLA FFI custom call.
//
// Why native code: XLA:CPU's dot repacks the whole weight on every call for many rows and streams it once
// per 5-row strip for few; packed once, the weight is one sequential stream that each step reads exactly
// once, at any row count (docs/design.md, "The native CPU matmul").
//
// Packing: w [K, N] becomes panels [P = ceil(N / 32), K, 32]: panel p holds columns [32p, 32p + 32),
// row k of it the 32 weights that row k of w has there (zero past N). A micro-kernel keeps a tile of
// rows by panel columns in vector registers (12 x 32 with AVX-512) and walks k once.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "native_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Vectors of the hardware's width (GCC splits wider generic vectors into pieces through memory, far
// slower). A micro-tile is kStrip rows by kVecs vectors of columns (a panel is walked in 32 / (kVecs x
// kLanes) passes); its accumulators and one row of the panel's columns fill the registers: with AVX-512
// 12 x 2 + 2 of 32, with AVX2 6 x 2 + 2 of 16 (the usual 6 x 16 tile), else (4-float NEON/SSE) 6 x 4 + 4 of 32.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16, kStrip = 12, kVecs = 2;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8, kStrip = 6, kVecs = 2;
#else
constexpr int64_t kLanes = 4, kStrip = 6, kVecs = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int64_t kPanel = 32;  // columns per panel
constexpr int64_t kTile = kVecs * kLanes;  // columns per pass
static_assert(kPanel % kTile == 0, "a panel is a whole number of passes");

inline Vec load_vec(const float* from) {
  Vec v;
  std::memcpy(&v, from, sizeof(v));
  return v;
}

// c[0:MR, 0:cols] = a[0:MR, :] @ the kTile columns of a panel at `panel` (row stride kPanel), a with row
// stride lda, c with row stride ldc.
template <int64_t MR>
inline void strip(const float* __restrict a, int64_t lda, const float* __restrict panel, int64_t K,
                  float* __restrict c, int64_t ldc, int64_t cols) {
  Vec acc[MR][kVecs];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < kVecs; ++j) acc[i][j] = Vec{};
  for (int64_t k = 0; k < K; ++k) {
    Vec b[kVecs];
    for (int64_t j = 0; j < kVecs; ++j) b[j] = load_vec(panel + k * kPanel + j * kLanes);
    for (int64_t i = 0; i < MR; ++i) {
      const float s = a[i * lda + k];
      for (int64_t j = 0; j < kVecs; ++j) acc[i][j] += s * b[j];
    }
  }
  for (int64_t i = 0; i < MR; ++i) {
    if (cols >= kTile) {
      std::memcpy(c + i * ldc, acc[i], sizeof(acc[i]));
    } else if (cols > 0) {
      float row[kTile];
      std::memcpy(row, acc[i], sizeof(acc[i]));
      std::memcpy(c + i * ldc, row, cols * sizeof(float));
    }
  }
}

template <int64_t MR = kStrip>
inline void strip_any(int64_t rows, const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc,
                      int64_t cols) {
  if constexpr (MR > 0) {
    if (rows == MR) return strip<MR>(a, lda, panel, K, c, ldc, cols);
    return strip_any<MR - 1>(rows, a, lda, panel, K, c, ldc, cols);
  }
}

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // [P, K, 32]
  float* y;        // [M, N]
  int64_t M, K, N, P;
};

// Panels [p0, p1): every strip of rows against each panel while the panel is in cache.
void panels(const Problem& p, int64_t p0, int64_t p1) {
  for (int64_t q = p0; q < p1; ++q) {
    const float* panel = p.w + q * p.K * kPanel;
    const int64_t col = q * kPanel, cols = std::min(kPanel, p.N - col);
    for (int64_t t = 0; t < kPanel && t < cols; t += kTile) {
      for (int64_t r = 0; r < p.M; r += kStrip) {
        strip_any(std::min(kStrip, p.M - r), p.x + r * p.K, p.K, panel + t, p.K, p.y + r * p.N + col + t, p.N,
                  cols - t);
      }
    }
  }
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel || wd[1] != xd[1] || yd[0] != xd[0] ||
      yd[1] > wd[0] * kPanel || yd[1] <= (wd[0] - 1) * kPanel) {
    return ffi::Error::InvalidArgument("packed matmul: x must be [M, K], w [ceil(N / 32), K, 32], y [M, N]");
  }
  const Problem p{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], yd[1], wd[0]};
  // Chunks of panels of ~1 MFLOP or more: enough to spread, few enough that the counter costs nothing.
  const int64_t chunk = std::max<int64_t>(1, (1 << 19) / std::max<int64_t>(1, p.M * p.K * kPanel));
  const int64_t chunks = p.M == 0 ? 0 : (p.P + chunk - 1) / chunk;
  parallel_for(pool, chunks, pool.num_threads(),
               [&](int64_t i) { panels(p, i * chunk, std::min(p.P, (i + 1) * chunk)); });
  return ffi::Error::Success();
}

}  // namespace

// Floats per vector this build was compiled for: the Python side uses the kernel by default only with 16.
extern "C" int JaxpagedPackedMatmulLanes() { return static_cast<int>(kLanes); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [P, K, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
