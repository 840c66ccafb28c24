// AVX2 with FMA and F16C (Haswell, Zen 1-3 and later): weights dequantized exactly to
// float32, 8 products per fused multiply-add, a 4 x 2 tile of rows and columns.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace mlxp {
namespace {

#include "portable.h"

// A chunk is one block of 32 weights; 4-bit ones unpack to [low nibbles | high nibbles]
// (even elements, then odd), the activations stored in that order.
using X4 = XLayout<32, true>;
using X8 = XLayout<32, false>;
constexpr int ROW_BLOCK = 64;
constexpr int COLS = 2;  // columns per tile: 4 x 2 accumulators of 8 lanes

bool supports(int K, int bits, int group) {
  return (bits == 4 || bits == 8) && (group == 32 || group == 64) && K % group == 0;
}

size_t row_bytes(int K, int bits, int group) {
  (void)bits;
  (void)group;
  return X4::row_bytes(K);
}

void prepare(const QmmProblem& p, uint8_t* scratch, int m0, int m1) {
  if (p.bits == 4) {
    X4::prepare(p, scratch, m0, m1);
  } else {
    X8::prepare(p, scratch, m0, m1);
  }
}

void row_to_f32(const void* src, DType t, int64_t offset, int count, float* dst) {
  if (t == DType::f32) {
    memcpy(dst, static_cast<const float*>(src) + offset, sizeof(float) * count);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src) + offset;
  int i = 0;
  for (; t == DType::f16 && i + 8 <= count; i += 8) {
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
  for (; i < count; i++) {
    dst[i] = t == DType::f16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
  }
}

inline __m256 dequant8(__m128i q8, float scale, float bias) {  // the low 8 bytes
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8)), _mm256_set1_ps(scale),
                         _mm256_set1_ps(bias));
}

template <int BITS>
inline void dequant_column(const QmmProblem& p, int n, float* s, float* b, float* wf) {
  const int blocks = p.K / 32;
  const int groups = p.K / p.group;
  const uint8_t* w = p.w + static_cast<size_t>(n) * (static_cast<size_t>(p.K) * BITS / 8);
  const int64_t goff = static_cast<int64_t>(n) * groups;
  row_to_f32(p.scales, p.s_dtype, goff, groups, s);
  row_to_f32(p.biases, p.s_dtype, goff, groups, b);
  const __m128i low4 = _mm_set1_epi8(0x0f);
  for (int blk = 0; blk < blocks; blk++) {
    const int g = (32 * blk) / p.group;
    float* out = wf + 32 * blk;
    __m128i parts[4];
    if (BITS == 4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * blk));
      const __m128i lo = _mm_and_si128(raw, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
      parts[0] = lo;
      parts[1] = _mm_srli_si128(lo, 8);
      parts[2] = hi;
      parts[3] = _mm_srli_si128(hi, 8);
    } else {
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 32 * blk));
      const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 32 * blk + 16));
      parts[0] = r0;
      parts[1] = _mm_srli_si128(r0, 8);
      parts[2] = r1;
      parts[3] = _mm_srli_si128(r1, 8);
    }
    for (int t = 0; t < 4; t++) {
      _mm256_store_ps(out + 8 * t, dequant8(parts[t], s[g], b[g]));
    }
  }
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int R, int C>
inline void tile(const QmmProblem& p, const float* const* rows, const float* const* cols, int n,
                 int m) {
  const int vecs = p.K / 8;
  __m256 acc[R][C];
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < C; j++) {
      acc[r][j] = _mm256_setzero_ps();
    }
  }
  for (int v = 0; v < vecs; v++) {
    __m256 wv[C];
    for (int j = 0; j < C; j++) {
      wv[j] = _mm256_load_ps(cols[j] + 8 * v);
    }
    for (int r = 0; r < R; r++) {
      const __m256 xv = _mm256_load_ps(rows[r] + 8 * v);
      for (int j = 0; j < C; j++) {
        acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < C; j++) {
      store_f(p.out, p.out_dtype, static_cast<int64_t>(m + r) * p.N + n + j, hsum8(acc[r][j]));
    }
  }
}

template <int C>
inline void columns(const QmmProblem& p, const uint8_t* scratch, size_t stride,
                    const float* const* cols, int n, int m0, int m1) {
  const float* rows[4];
  int m = m0;
  for (; m + 4 <= m1; m += 4) {
    for (int r = 0; r < 4; r++) {
      rows[r] = reinterpret_cast<const float*>(scratch + static_cast<size_t>(m + r) * stride);
    }
    tile<4, C>(p, rows, cols, n, m);
  }
  for (; m < m1; m++) {
    rows[0] = reinterpret_cast<const float*>(scratch + static_cast<size_t>(m) * stride);
    tile<1, C>(p, rows, cols, n, m);
  }
}

template <int BITS>
void compute_bits(const QmmProblem& p, const uint8_t* scratch, int n0, int n1) {
  const size_t stride = X4::row_bytes(p.K);
  const int groups = p.K / p.group;
  auto* area = static_cast<float*>(__builtin_alloca(COLS * stride + 64));
  area = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(area) + 63) & ~uintptr_t(63));
  auto* s = static_cast<float*>(__builtin_alloca(sizeof(float) * (groups + 8)));
  auto* b = static_cast<float*>(__builtin_alloca(sizeof(float) * (groups + 8)));
  const float* cols[COLS];
  for (int j = 0; j < COLS; j++) {
    cols[j] = area + j * (stride / 4);
  }
  for (int m0 = 0; m0 < p.M; m0 += ROW_BLOCK) {
    const int m1 = m0 + ROW_BLOCK < p.M ? m0 + ROW_BLOCK : p.M;
    int n = n0;
    for (; n + COLS <= n1; n += COLS) {
      for (int j = 0; j < COLS; j++) {
        dequant_column<BITS>(p, n + j, s, b, area + j * (stride / 4));
      }
      columns<COLS>(p, scratch, stride, cols, n, m0, m1);
    }
    for (; n < n1; n++) {
      dequant_column<BITS>(p, n, s, b, area);
      columns<1>(p, scratch, stride, cols, n, m0, m1);
    }
  }
}

void compute(const QmmProblem& p, const uint8_t* scratch, int n0, int n1) {
  if (p.bits == 4) {
    compute_bits<4>(p, scratch, n0, n1);
  } else {
    compute_bits<8>(p, scratch, n0, n1);
  }
}

const KernelTable table = {
    "avx2",  supports,       row_bytes,      prepare,
    compute, attention_item, attention_work, silu_mul,
    quant_attention_item, quant_attention_work,
};

}  // namespace

const KernelTable* kernels_avx2() {
  return &table;
}

}  // namespace mlxp

#else

namespace mlxp {
const KernelTable* kernels_avx2() {
  return nullptr;
}
}  // namespace mlxp

#endif
