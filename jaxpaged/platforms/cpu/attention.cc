// Paged attention for CPUs: an XLA FFI custom call.
//
// Why native code: XLA:CPU materialises every gather of context blocks, so the pure-JAX path moves each
// K/V byte several times; here each sequence's blocks are read once, straight from the cache
// (docs/design.md, "The native CPU kernel").
//
// Each row sees its sequence's positions cached before this step, read from the cache, then this
// step's own keys (k_new / v_new, not yet written to the cache) up to its own position: one online
// softmax over both, normalised here. Rows outside every sequence (padding) come out 0.
//
// Layout (pallas_kernels/metadata.py): cache[L, 2, num_blocks, H_kv, block_size, D], float32, or
// uint16 holding bfloat16 / float16 bits (kv_storage_dtype), or 8 bits (int8, or fp8 e4m3fn as uint8 bits)
// with scales[L, 2, num_blocks, H_kv, block_size] float32, one per token and head (pallas_kernels/kv_quant.py):
// value = stored * scale. q is float32 [T, H_kv * G, D], k_new and v_new float32 [T, H_kv, D], out float32
// [T, H, D].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "native_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Storage : int64_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3, kFp8 = 4 };

inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &word, sizeof(out));
  return out;
}

inline float f16_to_float(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}

// e4m3fn's 256 bit patterns as floats: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m / 8 * 2^-6); S.1111.111 is NaN (never stored: quantize_kv clips).
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int bits = 0; bits < 256; ++bits) {
      const int e = (bits >> 3) & 15, m = bits & 7;
      float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
      value[bits] = bits & 128 ? -v : v;
    }
  }
};

struct Problem {
  const float* q;            // [T, H, D]
  const float* k_new;        // [T, H_kv, D] this step's keys
  const float* v_new;        // [T, H_kv, D]
  const void* cache;         // [L, 2, NB, H_kv, bs, D]
  const float* scales;       // [L, 2, NB, H_kv, bs] for an 8-bit cache
  const int32_t* tables;     // [S, W]
  const int32_t* seq_lens;   // [S]
  const int32_t* starts;     // [S + 1]
  const float* slopes;       // [H]
  const float* sinks;        // [H] each head's sink logit (GPT-OSS), or null: none
  const int32_t* key_ends;   // [T] the last position each row sees among this step's keys, or null: its own
  float* out;                // [T, H, D]
  int64_t num_tokens, num_seqs, width, num_blocks, num_kv_heads, group, block_size, head_dim, layer;
  int64_t storage, window;   // window 0: none
  int64_t chunk;             // chunked local attention: a query at pos sees [pos / chunk * chunk, pos]; 0: none
  float scale, soft_cap;     // soft_cap 0: none
  bool alibi;
};

// Vectors of the build's width: 16 floats with AVX-512, 8 with AVX2, else 4 (GCC splits wider generic
// vectors into pieces through memory, several times slower).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load_vec(const float* from) {
  Vec v;
  std::memcpy(&v, from, sizeof(v));
  return v;
}

typedef int32_t IntVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp for x <= 0, lane by lane (Cephes' polynomial, ~1 ulp); exactly 0 below -87, so -inf (a
// masked score) gives 0.
inline Vec exp_nonpositive(Vec x) {
  const IntVec dead = x < -87.0f;
  x = dead ? Vec{} - 87.0f : x;
  const Vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const Vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Vec y = Vec{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const IntVec scale = (__builtin_convertvector(n, IntVec) + 127) << 23;
  return reinterpret_cast<Vec>(reinterpret_cast<IntVec>(y * reinterpret_cast<Vec>(scale)) & ~dead);
}

inline float max_lanes(Vec v) {
  float m = v[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

inline float sum_lanes(Vec v) {
#if defined(__AVX512F__)
  typedef float Half __attribute__((vector_size(32)));
  typedef float Quarter __attribute__((vector_size(16)));
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
#else
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
#endif
}

// Asks for row c of a tile that is `ahead` (the same KV head's tile in the sequence's next block), so
// that the next block arrives while this one is worked on: the hardware prefetcher cannot guess where
// blocks lie, and asking for a whole block at once overflows the misses in flight, so the requests are
// spread over the keys of the current tile. Into L2, not L1 (locality hint 1): L1 holds few misses in
// flight. The vector paths inline the same loop with a compile-time bound (a call there was slower).
template <int64_t kRowBytes>
inline void prefetch_row(const char* ahead, int64_t c, int64_t row_bytes) {
  if (ahead == nullptr) return;
  const int64_t bytes = kRowBytes > 0 ? kRowBytes : row_bytes;
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(ahead + c * bytes + i, 0, 1);
}

// Lane c of the result: the sum of p[c]'s lanes, c < kLanes. Rounds of pairing halves reduce all kLanes
// dot products together, far fewer dependent operations than reducing each on its own.
inline Vec sum_lanes_each(const Vec* p) {
#if defined(__AVX512F__)
  Vec x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif defined(__AVX__)
  Vec x[4], y[2];
  for (int i = 0; i < 4; ++i)
    x[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
  Vec x[2];
  for (int i = 0; i < 2; ++i)
    x[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 4, 5) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 6, 7);
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6) + __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7);
#endif
}

// scores[c] = scale * q . k[c] for the n keys of a [bs, D] tile; with kD fixed, scores[n, padded) are
// written too (as 0).
template <int64_t kD, int64_t kElem>
inline void block_scores(const float* __restrict q, const float* __restrict k, int64_t n, int64_t D, float scale,
                         float* __restrict scores, const char* ahead, int64_t row_bytes) {
  if constexpr (kD > 0 && kD % kLanes == 0) {
    constexpr int64_t nv = kD / kLanes;
    Vec qv[nv];
    for (int64_t j = 0; j < nv; ++j) qv[j] = load_vec(q + j * kLanes);
    for (int64_t c0 = 0; c0 < n; c0 += kLanes) {
      Vec part[kLanes];
      for (int64_t c = c0; c < c0 + kLanes; ++c) {
        if (c >= n) {
          part[c - c0] = Vec{};
          continue;
        }
        if (ahead) for (int64_t j = 0; j < kD * kElem; j += 64) __builtin_prefetch(ahead + c * kD * kElem + j, 0, 1);
        Vec acc = qv[0] * load_vec(k + c * kD);
        for (int64_t j = 1; j < nv; ++j) acc += qv[j] * load_vec(k + c * kD + j * kLanes);
        part[c - c0] = acc;
      }
      const Vec s = sum_lanes_each(part) * scale;
      std::memcpy(scores + c0, &s, sizeof(s));
    }
  } else {
    for (int64_t c = 0; c < n; ++c) {
      prefetch_row<kD * kElem>(ahead, c, row_bytes);
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q[d] * k[c * D + d];
      scores[c] = dot * scale;
    }
  }
}

// acc = acc * correction + sum_c w[c] * v[c] over the n values of a [bs, D] tile.
template <int64_t kD, int64_t kElem>
inline void block_values(const float* __restrict w, const float* __restrict v, int64_t n, int64_t D, float correction,
                         float* __restrict acc, const char* ahead, int64_t row_bytes) {
  if constexpr (kD > 0 && kD % kLanes == 0) {
    constexpr int64_t nv = kD / kLanes;
    Vec a[nv];
    for (int64_t j = 0; j < nv; ++j) a[j] = load_vec(acc + j * kLanes) * correction;
    for (int64_t c = 0; c < n; ++c) {
      if (ahead) for (int64_t j = 0; j < kD * kElem; j += 64) __builtin_prefetch(ahead + c * kD * kElem + j, 0, 1);
      const Vec wc = Vec{} + w[c];
      for (int64_t j = 0; j < nv; ++j) a[j] += wc * load_vec(v + c * kD + j * kLanes);
    }
    std::memcpy(acc, a, sizeof(a));
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
    for (int64_t c = 0; c < n; ++c) {
      prefetch_row<kD * kElem>(ahead, c, row_bytes);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += w[c] * v[c * D + d];
    }
  }
}

// Folds the first n keys of one K/V tile, at absolute positions key0, key0 + 1, ..., into one query
// vector's running softmax (peak m, denominator l, numerator a): the query of head h in the row at
// absolute position pos. next_k / next_v: tiles to prefetch while this one is worked on (or null).
template <int64_t kD, int64_t kElem>
inline void fold_tile(const Problem& p, const float* __restrict q, const float* __restrict k, const float* __restrict v,
                      int64_t n, int64_t key0, int64_t pos, int64_t h, float* __restrict sr, float& m, float& l,
                      float* __restrict a, const char* next_k, const char* next_v) {
  const int64_t D = kD > 0 ? kD : p.head_dim, row_bytes = D * kElem;
  const int64_t padded = (p.block_size + kLanes - 1) / kLanes * kLanes;  // scores per tile, in whole vectors
  const float neg_inf = -std::numeric_limits<float>::infinity();
  block_scores<kD, kElem>(q, k, n, D, p.scale, sr, next_k, row_bytes);
  if (p.soft_cap > 0.0f || p.alibi || p.window > 0 || p.chunk > 0) {
    for (int64_t c = 0; c < n; ++c) {
      const int64_t key = key0 + c;
      float score = sr[c];
      if (p.soft_cap > 0.0f) score = p.soft_cap * std::tanh(score / p.soft_cap);
      if (p.alibi) score += p.slopes[h] * static_cast<float>(key - pos);
      if (p.window > 0 && key <= pos - p.window) score = neg_inf;
      if (p.chunk > 0 && key < pos / p.chunk * p.chunk) score = neg_inf;
      sr[c] = score;
    }
  }
  for (int64_t c = n; c < padded; ++c) sr[c] = neg_inf;
  Vec peaks = load_vec(sr);
  for (int64_t c = kLanes; c < padded; c += kLanes) {
    const Vec x = load_vec(sr + c);
    peaks = x > peaks ? x : peaks;
  }
  const float block_peak = max_lanes(peaks);
  if (block_peak == neg_inf) return;  // nothing visible in this tile
  const float new_peak = std::max(m, block_peak);
  const float correction = m == neg_inf ? 0.0f : std::exp(m - new_peak);
  Vec sums = Vec{};
  for (int64_t c = 0; c < padded; c += kLanes) {
    const Vec w = exp_nonpositive(load_vec(sr + c) - new_peak);
    std::memcpy(sr + c, &w, sizeof(w));
    sums += w;
  }
  block_values<kD, kElem>(sr, v, n, D, correction, a, next_v, row_bytes);
  l = l * correction + sum_lanes(sums);
  m = new_peak;
}

// The first position a query at pos (>= 0) sees: its sliding window's or its chunk's first, else 0.
inline int64_t first_visible(const Problem& p, int64_t pos) {
  int64_t lowest = 0;
  if (p.window > 0) lowest = std::max<int64_t>(lowest, pos + 1 - p.window);
  if (p.chunk > 0) lowest = std::max<int64_t>(lowest, pos / p.chunk * p.chunk);
  return lowest;
}

// Rows [row0, row0 + rows) of sequence `seq`, every query head: each row sees the positions
// [0, cached) from the cache (less any outside its sliding window or chunk), then this step's keys of its
// sequence up to its own. Cached blocks are read once, all KV heads together. kD > 0 fixes the head
// dim at compile time.
template <int64_t kD, int64_t kElem, typename Tile>
void attend(const Problem& p, int64_t seq, int64_t row0, int64_t rows, int64_t cached, Tile tile,
            std::vector<float>& scratch) {
  const int64_t D = kD > 0 ? kD : p.head_dim, G = p.group, bs = p.block_size, H_kv = p.num_kv_heads;
  const int64_t H = H_kv * G;
  const int64_t R = rows * H;  // query vectors, in output order (row, head)
  const int64_t padded = (bs + kLanes - 1) / kLanes * kLanes;
  scratch.resize(2 * bs * D + padded + 2 * R + R * D);
  float* const k_buf = scratch.data();
  float* const v_buf = k_buf + bs * D;
  float* const sr = v_buf + bs * D;  // [padded] one query's scores over one tile
  float* const m = sr + padded;      // [R] running peak
  float* const l = m + R;            // [R] running denominator
  float* const a = l + R;            // [R, D] running numerator
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R + R * D, 0.0f);
  if (p.sinks) {  // a sink: a key of score sinks[h] and value 0, so it only joins the denominator
    for (int64_t r = 0; r < R; ++r) {
      m[r] = p.sinks[r % H];
      l[r] = 1.0f;
    }
  }
  const int64_t start = p.starts[seq];
  const int64_t first = row0 - start;  // the item's first row, counted among its sequence's new tokens
  const int64_t lowest = first_visible(p, cached + first);  // the item's first row sees least far back
  const int64_t first_block = lowest / bs;
  const int64_t blocks = std::min((cached + bs - 1) / bs, p.width);
  const int64_t tile_size = bs * D, tile_bytes = tile_size * kElem;
  const int32_t* table = p.tables + seq * p.width;
  auto query = [&](int64_t i, int64_t h) { return p.q + ((row0 + i) * H + h) * D; };

  for (int64_t b = first_block; b < blocks; ++b) {
    const int64_t block = table[b];
    if (block < 0 || block >= p.num_blocks) continue;  // never for a well-formed table; no stray reads
    const int64_t n = std::min(bs, cached - b * bs);  // keys of this block that are cached
    for (int64_t kv_head = 0; kv_head < H_kv; ++kv_head) {
      const int64_t k_off = (((p.layer * 2) * p.num_blocks + block) * H_kv + kv_head) * tile_size;
      const float* __restrict k = tile(k_off, tile_size, k_buf);
      const float* __restrict v = tile(k_off + p.num_blocks * H_kv * tile_size, tile_size, v_buf);
      // The same head's K and V tiles in the next block, asked for by the first query's pass over this one.
      const char* next_k = nullptr;
      const char* next_v = nullptr;
      const int64_t next = b + 1 < blocks ? table[b + 1] : -1;
      if (next >= 0 && next < p.num_blocks) {
        next_k = static_cast<const char*>(p.cache) + (((p.layer * 2) * p.num_blocks + next) * H_kv + kv_head) * tile_bytes;
        next_v = next_k + p.num_blocks * H_kv * tile_bytes;
      }
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t h = kv_head * G; h < (kv_head + 1) * G; ++h) {
          const int64_t r = i * H + h;
          const bool lead = i == 0 && h == kv_head * G;
          fold_tile<kD, kElem>(p, query(i, h), k, v, n, b * bs, cached + first + i, h, sr, m[r], l[r], a + r * D,
                               lead ? next_k : nullptr, lead ? next_v : nullptr);
        }
      }
    }
  }

  // This step's keys, bs at a time, copied out of k_new / v_new ([T, H_kv, D]) into a tile. Row i sees them up to
  // its own (causal), or up to its key end (an image's tokens attending to each other both ways, Gemma 3).
  auto last_seen = [&](int64_t i) {
    const int64_t own = first + i;
    if (!p.key_ends) return own;
    const int64_t last = p.starts[seq + 1] - start - 1;  // the sequence's last new token
    return std::max<int64_t>(own, std::min<int64_t>(last, p.key_ends[row0 + i] - cached));
  };
  int64_t seen = first + rows;  // the item's rows see this step's keys [0, seen)
  if (p.key_ends) {
    for (int64_t i = 0; i < rows; ++i) seen = std::max<int64_t>(seen, last_seen(i) + 1);
  }
  for (int64_t j0 = 0; j0 < seen; j0 += bs) {
    const int64_t n = std::min(bs, seen - j0);
    if (cached + j0 + n - 1 < lowest) continue;  // outside every row's window or chunk
    for (int64_t kv_head = 0; kv_head < H_kv; ++kv_head) {
      for (int64_t c = 0; c < n; ++c) {
        const int64_t from = ((start + j0 + c) * H_kv + kv_head) * D;
        std::memcpy(k_buf + c * D, p.k_new + from, D * sizeof(float));
        std::memcpy(v_buf + c * D, p.v_new + from, D * sizeof(float));
      }
      for (int64_t i = p.key_ends ? 0 : std::max<int64_t>(0, j0 - first); i < rows; ++i) {
        const int64_t visible = std::min(n, last_seen(i) - j0 + 1);  // not the row's future
        if (visible <= 0) continue;
        for (int64_t h = kv_head * G; h < (kv_head + 1) * G; ++h) {
          const int64_t r = i * H + h;
          fold_tile<kD, kElem>(p, query(i, h), k_buf, v_buf, visible, cached + j0, cached + first + i, h, sr, m[r],
                               l[r], a + r * D, nullptr, nullptr);
        }
      }
    }
  }

  float* const out = p.out + row0 * H * D;
  for (int64_t r = 0; r < R; ++r) {
    const float denom = l[r] == 0.0f ? 1.0f : l[r];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = a[r * D + d] / denom;
  }
}

struct Item {
  int64_t seq, row0, rows, cached, cost;
};

// Work items: (sequence, a run of at most kRowsPerItem of its rows), so that one long prompt
// chunk still spreads over the cores.
constexpr int64_t kRowsPerItem = 32;

template <int64_t kD, int64_t kElem, typename Tile>
void run(const Problem& p, Tile tile, ffi::ThreadPool& pool) {
  const int64_t H = p.num_kv_heads * p.group;
  std::fill(p.out, p.out + p.num_tokens * H * p.head_dim, 0.0f);  // padding rows stay 0

  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t seq = 0; seq < p.num_seqs; ++seq) {
    const int64_t start = p.starts[seq], q_len = p.starts[seq + 1] - start;
    const int64_t cached = p.seq_lens[seq] - q_len;
    if (q_len <= 0 || cached < 0 || start < 0 || start + q_len > p.num_tokens) continue;
    for (int64_t row0 = start; row0 < start + q_len; row0 += kRowsPerItem) {
      const int64_t rows = std::min(kRowsPerItem, start + q_len - row0);
      const int64_t cost = (cached + row0 - start + rows) * (rows * H + 2 * p.num_kv_heads);
      items.push_back({seq, row0, rows, cached, cost});
      total += cost;
    }
  }
  // Costliest first, so the last items handed out are small ones.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  // Small problems stay on this thread; JAXPAGED_CPU_ATTENTION_THREADS caps the threads.
  static const int64_t cap = [] {
    const char* env = std::getenv("JAXPAGED_CPU_ATTENTION_THREADS");
    return env ? std::max(1, std::atoi(env)) : std::numeric_limits<int>::max();
  }();
  const int64_t threads = std::min<int64_t>({cap, pool.num_threads(), 1 + total / (1 << 16)});
  parallel_for(pool, static_cast<int64_t>(items.size()), threads, [&](int64_t i) {
    thread_local std::vector<float> scratch;
    const Item& it = items[i];
    attend<kD, kElem>(p, it.seq, it.row0, it.rows, it.cached, tile, scratch);
  });
}

// The common head dims get code compiled for their size.
template <int64_t kElem, typename Tile>
void dispatch(const Problem& p, Tile tile, ffi::ThreadPool& pool) {
  switch (p.head_dim) {
    case 64: return run<64, kElem>(p, tile, pool);
    case 128: return run<128, kElem>(p, tile, pool);
    default: return run<0, kElem>(p, tile, pool);
  }
}

// An 8-bit cache's tile reader: a tile is whole tokens, so offset / D is its first token's scale.
template <typename T, typename Decode>
auto scaled_tiles(const Problem& p, Decode decode) {
  const T* base = static_cast<const T*>(p.cache);
  const float* scale = p.scales;
  const int64_t D = p.head_dim;
  return [base, scale, D, decode](int64_t offset, int64_t n, float* out) {
    for (int64_t t = 0; t < n / D; ++t) {
      const float s = scale[offset / D + t];
      const T* from = base + offset + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[t * D + d] = decode(from[d]) * s;
    }
    return static_cast<const float*>(out);
  };
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                              ffi::AnyBuffer cache, ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> seq_lens,
                              ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::F32> slopes,
                              ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> key_ends,
                              ffi::ResultBuffer<ffi::F32> out, int64_t layer, int64_t storage, int64_t window,
                              int64_t chunk, float scale, float soft_cap, bool alibi, bool use_sinks,
                              bool bidirectional) {
  const auto qd = q.dimensions(), kd = k_new.dimensions(), cd = cache.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || cd.size() != 6 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be [T, H, D], the cache 6-d, tables [S, W]");
  }
  const auto vd = v_new.dimensions();
  if (kd.size() != 3 || kd[0] != qd[0] || kd[1] != cd[3] || kd[2] != qd[2] ||
      vd.size() != 3 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
    return ffi::Error::InvalidArgument("paged attention: this step's k and v must be [T, H_kv, D]");
  }
  Problem p;
  p.num_tokens = qd[0];
  p.num_kv_heads = cd[3];
  p.group = qd[1] / cd[3];
  p.head_dim = qd[2];
  p.num_blocks = cd[2];
  p.block_size = cd[4];
  p.num_seqs = td[0];
  p.width = td[1];
  p.layer = layer;
  p.storage = storage;
  p.window = window;
  p.chunk = chunk;
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.alibi = alibi;
  if (qd[1] % cd[3] != 0 || cd[5] != qd[2] || layer < 0 || layer >= cd[0]) {
    return ffi::Error::InvalidArgument("paged attention: q's heads or head dim do not match the cache");
  }
  const ffi::DataType want = storage == kFloat32 ? ffi::DataType::F32
                            : storage == kInt8   ? ffi::DataType::S8
                            : storage == kFp8    ? ffi::DataType::U8
                                                 : ffi::DataType::U16;
  if (storage < kFloat32 || storage > kFp8 || cache.element_type() != want) {
    return ffi::Error::InvalidArgument(
        "paged attention: the cache must be float32, uint16 16-bit float bits, int8, or uint8 fp8 bits");
  }
  const bool quantized = storage == kInt8 || storage == kFp8;
  if (quantized && scales.element_count() != cache.element_count() / cd[5]) {
    return ffi::Error::InvalidArgument("paged attention: an 8-bit cache needs one scale per token and head");
  }
  p.q = q.typed_data();
  p.k_new = k_new.typed_data();
  p.v_new = v_new.typed_data();
  p.cache = cache.untyped_data();
  p.scales = scales.typed_data();
  p.tables = tables.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.starts = starts.typed_data();
  p.slopes = slopes.typed_data();
  if (use_sinks && sinks.element_count() != qd[1]) {
    return ffi::Error::InvalidArgument("paged attention: sinks must have one entry per query head");
  }
  p.sinks = use_sinks ? sinks.typed_data() : nullptr;
  if (bidirectional && key_ends.element_count() != qd[0]) {
    return ffi::Error::InvalidArgument("paged attention: key_ends must have one entry per row");
  }
  p.key_ends = bidirectional ? key_ends.typed_data() : nullptr;
  p.out = out->typed_data();

  if (storage == kFloat32) {
    const float* base = static_cast<const float*>(p.cache);
    dispatch<4>(p, [base](int64_t offset, int64_t, float*) { return base + offset; }, pool);
  } else if (storage == kBFloat16) {
    const uint16_t* base = static_cast<const uint16_t*>(p.cache);
    dispatch<2>(p, [base](int64_t offset, int64_t n, float* out) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(base[offset + i]);
      return static_cast<const float*>(out);
    }, pool);
  } else if (storage == kFloat16) {
    const uint16_t* base = static_cast<const uint16_t*>(p.cache);
    dispatch<2>(p, [base](int64_t offset, int64_t n, float* out) {
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_float(base[offset + i]);
      return static_cast<const float*>(out);
    }, pool);
  } else if (storage == kInt8) {
    dispatch<1>(p, scaled_tiles<int8_t>(p, [](int8_t x) { return static_cast<float>(x); }), pool);
  } else {
    static const Fp8Table fp8;
    dispatch<1>(p, scaled_tiles<uint8_t>(p, [](uint8_t x) { return fp8.value[x]; }), pool);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // this step's k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // this step's v
                                  .Arg<ffi::AnyBuffer>()         // cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales of an 8-bit cache (else one unused)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query start loc
                                  .Arg<ffi::Buffer<ffi::F32>>()  // alibi slopes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks (use_sinks only, else one unused)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // key ends (bidirectional only, else one unused)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("storage")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("chunk")
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("alibi")
                                  .Attr<bool>("use_sinks")
                                  .Attr<bool>("bidirectional"));
