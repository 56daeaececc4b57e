// y = x @ w for float32 activations on CPUs, w packed once at load time: XLA FFI custom calls.
//
// Why native code: XLA:CPU's dot repacks the whole weight on every call for many rows and streams it once
// per 5-row strip for few; packed once, the weight is one sequential stream that each step reads exactly
// once, at any row count (docs/design.md, "The native CPU matmul").
//
// Packing: w [K, N] becomes panels [P = ceil(N / 32), K, 32]: panel p holds columns [32p, 32p + 32),
// row k of it the 32 weights that row k of w has there (zero past N). A micro-kernel keeps a tile of
// rows by panel columns in vector registers (12 x 32 with AVX-512) and walks k once.
//
// 8-bit weights (int8, or fp8 e4m3fn) use the same panels of 1-byte elements and a float32 scale per
// column: y = (x @ q) * scale. Each panel row is decoded into float32 registers as it streams by (the
// dequantize fused into the matmul), so a step reads a quarter of float32's bytes.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

// kLanes 8-bit weights -> floats. GCC's generic vectors convert bytes one by one through memory, so with
// AVX2 or AVX-512 these are the instructions themselves (sign-extend, then convert), else a plain loop.
#if defined(__AVX512F__)
inline Vec int8_vec(const int8_t* from) {
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)))));
}
// e4m3fn bits -> value x 2^-8: the bits shifted into a float16's place are that float16 (subnormals too,
// which the hardware's float16 conversion keeps exact), so decoding is 3 integer ops and one conversion.
inline Vec e4m3_vec(const uint8_t* from) {
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from))), 7);
  return Vec(_mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<int16_t>(0xBF80)))));
}
#elif defined(__AVX2__) && defined(__F16C__)
inline Vec int8_vec(const int8_t* from) {
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(from)))));
}
inline Vec e4m3_vec(const uint8_t* from) {
  const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(from))), 7);
  return Vec(_mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(static_cast<int16_t>(0xBF80)))));
}
#else
inline Vec int8_vec(const int8_t* from) {
  Vec v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = from[l];
  return v;
}
// The same value x 2^-8 from float32 bits: the exponent rebiased 7 -> 127 - 8, subnormals m x 2^-17.
inline Vec e4m3_vec(const uint8_t* from) {
  Vec v;
  for (int64_t l = 0; l < kLanes; ++l) {
    const int32_t bits = static_cast<int8_t>(from[l]), mag = bits & 0x7F, normal = (mag << 20) + (112 << 23);
    float value = mag * 0x1p-17f;
    if (mag >= 8) std::memcpy(&value, &normal, sizeof(value));
    v[l] = bits < 0 ? -value : value;
  }
  return v;
}
#endif

// How a panel's elements become floats. Scaled types multiply each column's sums by its scale times kUnit
// (what the decoded values must be multiplied by to be the weights); float32 takes no scale.
struct F32Weights {
  using T = float;
  static constexpr bool kScaled = false;
  static Vec load(const T* from) { return load_vec(from); }
};
struct Int8Weights {
  using T = int8_t;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = 1.0f;
  static Vec load(const T* from) { return int8_vec(from); }
};
struct E4M3Weights {
  using T = uint8_t;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = 256.0f;
  static Vec load(const T* from) { return e4m3_vec(from); }
};

// c[0:MR, 0:cols] = a[0:MR, :] @ the kTile columns of a panel at `panel` (row stride kPanel), times their
// scales where W has them; a with row stride lda, c with row stride ldc.
template <typename W, int64_t MR>
inline void strip(const float* __restrict a, int64_t lda, const typename W::T* __restrict panel, int64_t K,
                  const float* __restrict scale, float* __restrict c, int64_t ldc, int64_t cols) {
  Vec acc[MR][kVecs];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < kVecs; ++j) acc[i][j] = Vec{};
  for (int64_t k = 0; k < K; ++k) {
    Vec b[kVecs];
    for (int64_t j = 0; j < kVecs; ++j) b[j] = W::load(panel + k * kPanel + j * kLanes);
    for (int64_t i = 0; i < MR; ++i) {
      const float s = a[i * lda + k];
      for (int64_t j = 0; j < kVecs; ++j) acc[i][j] += s * b[j];
    }
  }
  if constexpr (W::kScaled) {
    float s[kTile] = {};  // the scales of these columns (the last panel's tail may be short)
    std::memcpy(s, scale, std::min(cols, kTile) * sizeof(float));
    for (int64_t j = 0; j < kVecs; ++j) {
      const Vec sj = load_vec(s + j * kLanes) * W::kUnit;
      for (int64_t i = 0; i < MR; ++i) acc[i][j] *= sj;
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

template <typename W, int64_t MR = kStrip>
inline void strip_any(int64_t rows, const float* a, int64_t lda, const typename W::T* panel, int64_t K,
                      const float* scale, float* c, int64_t ldc, int64_t cols) {
  if constexpr (MR > 0) {
    if (rows == MR) return strip<W, MR>(a, lda, panel, K, scale, c, ldc, cols);
    return strip_any<W, MR - 1>(rows, a, lda, panel, K, scale, c, ldc, cols);
  }
}

template <typename W>
struct Problem {
  const float* x;             // [M, K]
  const typename W::T* w;     // [P, K, 32]
  const float* scale;         // [N] where W is scaled, else null
  float* y;                   // [M, N]
  int64_t M, K, N, P;
};

// A scaled type's panel decoded to floats beforehand: read as float32, still to be scaled.
template <typename W>
struct Decoded {
  using T = float;
  static constexpr bool kScaled = true;
  static constexpr float kUnit = W::kUnit;
  static Vec load(const T* from) { return load_vec(from); }
};

// Every strip of rows against one panel (W: how its elements read), columns [col, col + cols).
template <typename W, typename Q>
void panel_strips(const Problem<Q>& p, const typename W::T* panel, int64_t col, int64_t cols) {
  for (int64_t t = 0; t < kPanel && t < cols; t += kTile) {
    const float* scale = W::kScaled ? p.scale + col + t : nullptr;
    for (int64_t r = 0; r < p.M; r += kStrip) {
      strip_any<W>(std::min(kStrip, p.M - r), p.x + r * p.K, p.K, panel + t, p.K, scale, p.y + r * p.N + col + t,
                   p.N, cols - t);
    }
  }
}

// Panels [p0, p1): every strip of rows against each panel while the panel is in cache. An 8-bit panel that
// several strips read is decoded to floats once first, instead of by every strip.
template <typename W>
void panels(const Problem<W>& p, int64_t p0, int64_t p1) {
  for (int64_t q = p0; q < p1; ++q) {
    const typename W::T* panel = p.w + q * p.K * kPanel;
    const int64_t col = q * kPanel, cols = std::min(kPanel, p.N - col);
    if constexpr (W::kScaled) {
      if (p.M > kStrip) {
        thread_local std::vector<float> decoded;
        decoded.resize(p.K * kPanel);
        for (int64_t i = 0; i < p.K * kPanel; i += kLanes) {
          const Vec v = W::load(panel + i);
          std::memcpy(decoded.data() + i, &v, sizeof(v));
        }
        panel_strips<Decoded<W>>(p, decoded.data(), col, cols);
        continue;
      }
    }
    panel_strips<W>(p, panel, col, cols);
  }
}

template <typename W>
void run(ffi::ThreadPool& pool, const Problem<W>& p) {
  // Chunks of panels of ~1 MFLOP or more: enough to spread, few enough that the counter costs nothing.
  const int64_t chunk = std::max<int64_t>(1, (1 << 19) / std::max<int64_t>(1, p.M * p.K * kPanel));
  const int64_t chunks = p.M == 0 ? 0 : (p.P + chunk - 1) / chunk;
  parallel_for(pool, chunks, pool.num_threads(),
               [&](int64_t i) { panels(p, i * chunk, std::min(p.P, (i + 1) * chunk)); });
}

// Whether x [M, K], panels [P, K, 32] and y [M, N] fit together.
bool shapes_fit(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, ffi::Span<const int64_t> yd) {
  return xd.size() == 2 && wd.size() == 3 && yd.size() == 2 && wd[2] == kPanel && wd[1] == xd[1] &&
         yd[0] == xd[0] && yd[1] <= wd[0] * kPanel && yd[1] > (wd[0] - 1) * kPanel;
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (!shapes_fit(xd, wd, yd)) {
    return ffi::Error::InvalidArgument("packed matmul: x must be [M, K], w [ceil(N / 32), K, 32], y [M, N]");
  }
  run(pool, Problem<F32Weights>{x.typed_data(), w.typed_data(), nullptr, y->typed_data(), xd[0], xd[1], yd[1],
                                wd[0]});
  return ffi::Error::Success();
}

ffi::Error PackedScaledMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                                  ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions(), sd = scale.dimensions();
  if (!shapes_fit(xd, wd, yd) || sd.size() != 1 || sd[0] != yd[1]) {
    return ffi::Error::InvalidArgument(
        "packed scaled matmul: x must be [M, K], w [ceil(N / 32), K, 32], scale [N], y [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = yd[1], P = wd[0];
  if (w.element_type() == ffi::DataType::S8) {
    run(pool, Problem<Int8Weights>{x.typed_data(), w.reinterpret_data<int8_t>(), scale.typed_data(),
                                   y->typed_data(), M, K, N, P});
  } else if (w.element_type() == ffi::DataType::F8E4M3FN) {
    run(pool, Problem<E4M3Weights>{x.typed_data(), w.reinterpret_data<uint8_t>(), scale.typed_data(),
                                   y->typed_data(), M, K, N, P});
  } else {
    return ffi::Error::InvalidArgument("packed scaled matmul: w must be int8 or float8_e4m3fn");
  }
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPackedScaledMatmul, PackedScaledMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [P, K, 32] int8 or float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
