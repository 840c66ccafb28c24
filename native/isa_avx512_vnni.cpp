// AVX-512 VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later): the quantized matmul with int8
// activations, the way llama.cpp multiplies Q4_1 by Q8_1. Each block of 32 activations is
// stored as int8 with one float scale (max |x| / 127) and the float sum of the block; the
// weights' 4- or 8-bit codes meet them in vpdpbusd (64 products an instruction, exact
// integer sums), scaled per block afterwards; the weights' biases meet the exact sums:
//   sum_k x_k w_k = sum_blocks s_w s_x (q_w . q_x) + sum_groups b_w (sum_k x_k).
// Not the float path's bits (the activations are rounded to 8 bits: ~0.4% relative error a
// product), so it runs only where asked for (EngineConfig.cpu_int8). Every output is one
// sequence of operations whatever the rows and columns around it, so a row in a batch gets
// the bits it gets alone.
//
// Built with -mavx512vnni on top of the AVX-512 unit's flags; run only where the CPU reports
// all of them (dispatch.cpp).
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace mlxp {
namespace {

#include "portable.h"

constexpr int ROW_BLOCK = 64;  // activation rows kept hot while a block of columns streams
constexpr int ROWS = 4;        // a tile: 4 rows x 4 columns, the weights unpacked once
constexpr int COLS = 4;

bool supports(int K, int bits, int group) {
  return (bits == 4 || bits == 8) && (group == 32 || group == 64) && K % 64 == 0;
}

// A staged row: K int8 codes (4-bit weights: each chunk of 64 as [evens of 0..31, evens of
// 32..63, odds of 0..31, odds of 32..63], the order unpacked nibbles come in), then per
// chunk the 16 lanes' activation scales, then per weight group the float sum of x.
struct Staged {
  static size_t codes(int K) {
    return MLXP_ALIGN64(static_cast<size_t>(K));
  }
  static size_t lane_scales(int K) {
    return MLXP_ALIGN64(static_cast<size_t>(K / 64) * 16 * sizeof(float));
  }
  static size_t row_bytes(int K, int group) {
    return codes(K) + lane_scales(K) + MLXP_ALIGN64(static_cast<size_t>(K / group + 16) * 4);
  }
};

size_t row_bytes(int K, int bits, int group) {
  (void)bits;
  return Staged::row_bytes(K, group);
}

// 16 activations as float32.
inline __m512 load_x16(const QmmProblem& p, int64_t at) {
  switch (p.x_dtype) {
    case DType::f32:
      return _mm512_loadu_ps(static_cast<const float*>(p.x) + at);
    case DType::f16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p.x) + at)));
    default:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p.x) + at))),
          16));
  }
}

inline float max_abs(__m512 a, __m512 b) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
}

// 16 floats times inv, rounded to the nearest int8 (|x| * inv <= 127 by construction).
inline __m128i to_int8(__m512 v, __m512 inv) {
  return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)));
}

void prepare(const QmmProblem& p, uint8_t* scratch, int m0, int m1) {
  const size_t stride = Staged::row_bytes(p.K, p.group);
  const int chunks = p.K / 64;
  const int groups = p.K / p.group;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  // Which block of 32 (A: 0, B: 1) each lane's four codes come from.
  const __mmask16 lanes_b = p.bits == 4 ? 0xF0F0 : 0xFF00;
  for (int m = m0; m < m1; m++) {
    uint8_t* row = scratch + static_cast<size_t>(m) * stride;
    int8_t* codes = reinterpret_cast<int8_t*>(row);
    float* scales = reinterpret_cast<float*>(row + Staged::codes(p.K));
    float* sums = reinterpret_cast<float*>(row + Staged::codes(p.K) + Staged::lane_scales(p.K));
    for (int g = 0; g < groups; g++) {
      sums[g] = 0.0f;
    }
    const int64_t base = static_cast<int64_t>(m) * p.x_row_stride;
    for (int c = 0; c < chunks; c++) {
      __m512 v[4];
      for (int t = 0; t < 4; t++) {
        v[t] = load_x16(p, base + 64 * c + 16 * t);
      }
      const float sa = max_abs(v[0], v[1]) / 127.0f;
      const float sb = max_abs(v[2], v[3]) / 127.0f;
      const __m512 ia = _mm512_set1_ps(sa > 0.0f ? 1.0f / sa : 0.0f);
      const __m512 ib = _mm512_set1_ps(sb > 0.0f ? 1.0f / sb : 0.0f);
      __m128i q[4];
      if (p.bits == 4) {
        q[0] = to_int8(_mm512_permutex2var_ps(v[0], even, v[1]), ia);
        q[1] = to_int8(_mm512_permutex2var_ps(v[2], even, v[3]), ib);
        q[2] = to_int8(_mm512_permutex2var_ps(v[0], odd, v[1]), ia);
        q[3] = to_int8(_mm512_permutex2var_ps(v[2], odd, v[3]), ib);
      } else {
        q[0] = to_int8(v[0], ia);
        q[1] = to_int8(v[1], ia);
        q[2] = to_int8(v[2], ib);
        q[3] = to_int8(v[3], ib);
      }
      for (int t = 0; t < 4; t++) {
        _mm_store_si128(reinterpret_cast<__m128i*>(codes + 64 * c + 16 * t), q[t]);
      }
      _mm512_store_ps(scales + 16 * c,
                      _mm512_mask_blend_ps(lanes_b, _mm512_set1_ps(sa), _mm512_set1_ps(sb)));
      // The sums in a fixed order: lanes added pairwise, then the two halves.
      sums[(64 * c) / p.group] += _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      sums[(64 * c + 32) / p.group] += _mm512_reduce_add_ps(_mm512_add_ps(v[2], v[3]));
    }
  }
}

// Column n's codes of chunk c as 64 unsigned bytes, in the staged activations' order.
template <int BITS>
inline __m512i codes64(const uint8_t* w, int c) {
  if (BITS == 4) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(raw, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  return _mm512_loadu_si512(w + 64 * c);
}

// R staged rows by C columns (s, b: the columns' scales and biases as float32, `groups` a
// column). Each output: the chunks in order, then its bias term, then the one sum: the same
// operations whatever R and C are.
template <int BITS, int R, int C>
inline void tile(const QmmProblem& p, const uint8_t* const* rows, const float* s,
                 const float* b, int n, int m) {
  const int chunks = p.K / 64;
  const int groups = p.K / p.group;
  const size_t wrow = static_cast<size_t>(p.K) * BITS / 8;
  const size_t scales_at = Staged::codes(p.K);
  const size_t sums_at = scales_at + Staged::lane_scales(p.K);
  const __mmask16 lanes_b = BITS == 4 ? 0xF0F0 : 0xFF00;
  __m512 acc[R][C];
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < C; j++) {
      acc[r][j] = _mm512_setzero_ps();
    }
  }
  for (int c = 0; c < chunks; c++) {
    const int ga = (64 * c) / p.group;
    const int gb = (64 * c + 32) / p.group;
    __m512i wq[C];
    __m512 ws[C];
    for (int j = 0; j < C; j++) {
      wq[j] = codes64<BITS>(p.w + static_cast<size_t>(n + j) * wrow, c);
      const float* sj = s + j * groups;
      ws[j] = _mm512_mask_blend_ps(lanes_b, _mm512_set1_ps(sj[ga]), _mm512_set1_ps(sj[gb]));
    }
    for (int r = 0; r < R; r++) {
      const __m512i xq = _mm512_load_si512(rows[r] + 64 * c);
      const __m512 xs = _mm512_load_ps(reinterpret_cast<const float*>(rows[r] + scales_at) +
                                       16 * c);
      for (int j = 0; j < C; j++) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[j], xq);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[j], xs),
                                    acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    const float* sums = reinterpret_cast<const float*>(rows[r] + sums_at);
    for (int j = 0; j < C; j++) {
      const float* bj = b + j * groups;
      __m512 bias = _mm512_setzero_ps();
      int g = 0;
      for (; g + 16 <= groups; g += 16) {
        bias = _mm512_fmadd_ps(_mm512_loadu_ps(bj + g), _mm512_loadu_ps(sums + g), bias);
      }
      if (g < groups) {
        const __mmask16 live = static_cast<__mmask16>((1u << (groups - g)) - 1);
        bias = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, bj + g),
                               _mm512_maskz_loadu_ps(live, sums + g), bias);
      }
      store_f(p.out, p.out_dtype, static_cast<int64_t>(m + r) * p.N + n + j,
              _mm512_reduce_add_ps(_mm512_add_ps(acc[r][j], bias)));
    }
  }
}

template <int BITS, int R>
inline void rows_against(const QmmProblem& p, const uint8_t* const* rows, const float* s,
                         const float* b, int groups, int n0, int nb, int m) {
  int j = 0;
  for (; j + COLS <= nb; j += COLS) {
    tile<BITS, R, COLS>(p, rows, s + j * groups, b + j * groups, n0 + j, m);
  }
  for (; j < nb; j++) {
    tile<BITS, R, 1>(p, rows, s + j * groups, b + j * groups, n0 + j, m);
  }
}

template <int BITS>
void compute_bits(const QmmProblem& p, const uint8_t* scratch, int n0, int n1) {
  const size_t stride = Staged::row_bytes(p.K, p.group);
  const int groups = p.K / p.group;
  constexpr int BLOCK = 64;  // columns whose scales and biases are converted at once
  auto* s = static_cast<float*>(__builtin_alloca(sizeof(float) * (BLOCK * groups + 16)));
  auto* b = static_cast<float*>(__builtin_alloca(sizeof(float) * (BLOCK * groups + 16)));
  for (int m0 = 0; m0 < p.M; m0 += ROW_BLOCK) {
    const int m1 = m0 + ROW_BLOCK < p.M ? m0 + ROW_BLOCK : p.M;
    for (int nb0 = n0; nb0 < n1; nb0 += BLOCK) {
      const int nb = n1 - nb0 < BLOCK ? n1 - nb0 : BLOCK;
      const int64_t goff = static_cast<int64_t>(nb0) * groups;
      const float* sp = s;
      const float* bp = b;
      if (p.s_dtype == DType::f32) {
        sp = static_cast<const float*>(p.scales) + goff;
        bp = static_cast<const float*>(p.biases) + goff;
      } else {
        to_f32(p.scales, p.s_dtype, goff, nb * groups, s);  // portable.h
        to_f32(p.biases, p.s_dtype, goff, nb * groups, b);
      }
      const uint8_t* rows[ROWS];
      int m = m0;
      for (; m + ROWS <= m1; m += ROWS) {
        for (int r = 0; r < ROWS; r++) {
          rows[r] = scratch + static_cast<size_t>(m + r) * stride;
        }
        rows_against<BITS, ROWS>(p, rows, sp, bp, groups, nb0, nb, m);
      }
      for (; m < m1; m++) {
        rows[0] = scratch + static_cast<size_t>(m) * stride;
        rows_against<BITS, 1>(p, rows, sp, bp, groups, nb0, nb, m);
      }
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

KernelTable make_table() {
  KernelTable t{};
  t.name = "avx512-vnni";
  t.qmm_supports = supports;
  t.qmm_row_bytes = row_bytes;
  t.qmm_prepare = prepare;
  t.qmm_compute = compute;
  return t;
}

const KernelTable table = make_table();

}  // namespace

const KernelTable* kernels_avx512_vnni() {
  return &table;
}

}  // namespace mlxp

#else

namespace mlxp {
const KernelTable* kernels_avx512_vnni() {
  return nullptr;
}
}  // namespace mlxp

#endif
