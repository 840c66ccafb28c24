// AVX-512 (Skylake-X, Ice Lake, Zen 4 and later): weights dequantized exactly to float32 in
// 512-bit registers, 16 products per fused multiply-add, a 4 x 4 tile of rows and columns.
//
// Built with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; run only where the CPU
// reports all of them (dispatch.cpp).
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>

namespace mlxp {
namespace {

#include "portable.h"

// A chunk is 64 weights. 4-bit: its 32 packed bytes unpack to low nibbles (the even
// elements) and high nibbles (the odd ones); the activations are stored in that order, so
// each 16-lane vector of weights lies inside one block of 32 and takes one scale and bias.
using X4 = XLayout<64, true>;
using X8 = XLayout<64, false>;
constexpr int ROW_BLOCK = 64;  // activation rows kept hot in L2 while the weights stream
constexpr int COLS = 4;        // columns per tile: 4 x 4 accumulators, loads shared

bool supports(int K, int bits, int group) {
  return (bits == 4 || bits == 8) && (group == 32 || group == 64) && K % 64 == 0;
}

size_t row_bytes(int K, int bits, int group) {
  (void)bits;
  (void)group;
  return X4::row_bytes(K);
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

// XLayout::prepare in 512-bit registers: [evens of 0..31, evens of 32..63, odds, odds].
template <bool PERM>
void prepare_simd(const QmmProblem& p, uint8_t* scratch, int m0, int m1) {
  const size_t stride = X4::row_bytes(p.K);
  const int chunks = p.K / 64;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int m = m0; m < m1; m++) {
    float* row = reinterpret_cast<float*>(scratch + static_cast<size_t>(m) * stride);
    const int64_t base = static_cast<int64_t>(m) * p.x_row_stride;
    for (int c = 0; c < chunks; c++) {
      __m512 v[4];
      for (int t = 0; t < 4; t++) {
        v[t] = load_x16(p, base + 64 * c + 16 * t);
      }
      if (PERM) {
        _mm512_store_ps(row + 64 * c, _mm512_permutex2var_ps(v[0], even, v[1]));
        _mm512_store_ps(row + 64 * c + 16, _mm512_permutex2var_ps(v[2], even, v[3]));
        _mm512_store_ps(row + 64 * c + 32, _mm512_permutex2var_ps(v[0], odd, v[1]));
        _mm512_store_ps(row + 64 * c + 48, _mm512_permutex2var_ps(v[2], odd, v[3]));
      } else {
        for (int t = 0; t < 4; t++) {
          _mm512_store_ps(row + 64 * c + 16 * t, v[t]);
        }
      }
    }
  }
}

void prepare(const QmmProblem& p, uint8_t* scratch, int m0, int m1) {
  if (p.bits == 4) {
    prepare_simd<true>(p, scratch, m0, m1);
  } else {
    prepare_simd<false>(p, scratch, m0, m1);
  }
}

// count values of a row of scales or biases, as float32.
void row_to_f32(const void* src, DType t, int64_t offset, int count, float* dst) {
  int i = 0;
  if (t == DType::f32) {
    memcpy(dst, static_cast<const float*>(src) + offset, sizeof(float) * count);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src) + offset;
  for (; i + 16 <= count; i += 16) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i));
    __m512 f = t == DType::f16
        ? _mm512_cvtph_ps(raw)
        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    _mm512_storeu_ps(dst + i, f);
  }
  for (; i < count; i++) {
    dst[i] = t == DType::f16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
  }
}

inline __m512 dequant16(__m128i q8, float scale, float bias) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q8)), _mm512_set1_ps(scale),
                         _mm512_set1_ps(bias));
}

// A 4-bit weight takes one of 16 values a block: the block's 16 dequantized values, each
// dequant16's own fmadd(q, scale, bias), so a lookup gives dequant16's floats with one
// permute (a shuffle unit) where dequant16 takes a conversion and a multiply-add (the FMA
// units).
inline __m512 dequant_table(float scale, float bias) {
  const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(nibbles, _mm512_set1_ps(scale), _mm512_set1_ps(bias));
}

inline __m512 looked_up(__m128i q4, __m512 table) {
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q4), table);
}

// Column n's weights in float32, in the activations' order: K floats into wf; s and b are
// the column's scales and biases in float32.
template <int BITS>
inline void dequant_column(const QmmProblem& p, int n, const float* s, const float* b,
                           float* wf) {
  const int chunks = p.K / 64;
  const uint8_t* w = p.w + static_cast<size_t>(n) * (static_cast<size_t>(p.K) * BITS / 8);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int c = 0; c < chunks; c++) {
    const int ga = (64 * c) / p.group;  // the chunk's blocks of 32: A, then B
    const int gb = (64 * c + 32) / p.group;
    float* out = wf + 64 * c;
    if (BITS == 4) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      const __m512 table_a = dequant_table(s[ga], b[ga]);
      const __m512 table_b = ga == gb ? table_a : dequant_table(s[gb], b[gb]);
      _mm512_store_ps(out, looked_up(_mm256_castsi256_si128(lo), table_a));
      _mm512_store_ps(out + 16, looked_up(_mm256_extracti128_si256(lo, 1), table_b));
      _mm512_store_ps(out + 32, looked_up(_mm256_castsi256_si128(hi), table_a));
      _mm512_store_ps(out + 48, looked_up(_mm256_extracti128_si256(hi, 1), table_b));
    } else {
      for (int t = 0; t < 4; t++) {
        const int g = t < 2 ? ga : gb;
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 64 * c + 16 * t));
        _mm512_store_ps(out + 16 * t, dequant16(raw, s[g], b[g]));
      }
    }
  }
}

// R rows by C columns: each output is the same sequence of operations whatever R and C are
// (the tails use smaller tiles), so a row's result never depends on the batch around it.
template <int R, int C>
inline void tile(const QmmProblem& p, const float* const* rows, const float* cols,
                 size_t col_stride, int n, int m) {
  const int vecs = p.K / 16;
  __m512 acc[R][C];
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < C; j++) {
      acc[r][j] = _mm512_setzero_ps();
    }
  }
  for (int v = 0; v < vecs; v++) {
    __m512 wv[C];
    for (int j = 0; j < C; j++) {
      wv[j] = _mm512_load_ps(cols + j * col_stride + 16 * v);
    }
    for (int r = 0; r < R; r++) {
      const __m512 xv = _mm512_load_ps(rows[r] + 16 * v);
      for (int j = 0; j < C; j++) {
        acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < C; j++) {
      store_f(p.out, p.out_dtype, static_cast<int64_t>(m + r) * p.N + n + j,
              _mm512_reduce_add_ps(acc[r][j]));
    }
  }
}

// All rows of [m0, m1) against the nb dequantized columns at cols (column n0 first): tiles
// of 4 x 4, row by row, so that each row's outputs are written in order.
template <int R>
inline void rows_against(const QmmProblem& p, const float* const* rows, const float* cols,
                         size_t col_stride, int n0, int nb, int m) {
  int j = 0;
  for (; j + COLS <= nb; j += COLS) {
    tile<R, COLS>(p, rows, cols + j * col_stride, col_stride, n0 + j, m);
  }
  for (; j < nb; j++) {
    tile<R, 1>(p, rows, cols + j * col_stride, col_stride, n0 + j, m);
  }
}

// One activation row against C columns, each dequantized in registers on the way (no
// buffer): a decode step of one row is bound by reading the weights. The same operations
// per output as tile<1, C> over dequant_column, so the bits match a row in a batch.
template <int BITS, int C>
inline void row_fused(const QmmProblem& p, const float* x, const float* s, const float* b,
                      int n) {
  const int chunks = p.K / 64;
  const int groups = p.K / p.group;
  const size_t wrow = static_cast<size_t>(p.K) * BITS / 8;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m512 acc[C];
  for (int j = 0; j < C; j++) {
    acc[j] = _mm512_setzero_ps();
  }
  for (int c = 0; c < chunks; c++) {
    const int ga = (64 * c) / p.group;
    const int gb = (64 * c + 32) / p.group;
    __m512 xv[4];
    for (int t = 0; t < 4; t++) {
      xv[t] = _mm512_load_ps(x + 64 * c + 16 * t);
    }
    for (int j = 0; j < C; j++) {
      const uint8_t* w = p.w + static_cast<size_t>(n + j) * wrow;
      const float* sj = s + j * groups;
      const float* bj = b + j * groups;
      __m128i q[4];
      if (BITS == 4) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
        const __m256i lo = _mm256_and_si256(raw, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        q[0] = _mm256_castsi256_si128(lo);
        q[1] = _mm256_extracti128_si256(lo, 1);
        q[2] = _mm256_castsi256_si128(hi);
        q[3] = _mm256_extracti128_si256(hi, 1);
        const __m512 table_a = dequant_table(sj[ga], bj[ga]);  // dequant16's floats
        const __m512 table_b = ga == gb ? table_a : dequant_table(sj[gb], bj[gb]);
        for (int t = 0; t < 4; t++) {
          acc[j] = _mm512_fmadd_ps(looked_up(q[t], (t & 1) ? table_b : table_a), xv[t], acc[j]);
        }
        continue;
      } else {
        for (int t = 0; t < 4; t++) {
          q[t] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 64 * c + 16 * t));
        }
      }
      for (int t = 0; t < 4; t++) {
        // 4-bit: vectors 0 and 2 lie in block A; 8-bit: vectors 0 and 1.
        const int g = (BITS == 4 ? (t & 1) : (t >> 1)) ? gb : ga;
        acc[j] = _mm512_fmadd_ps(dequant16(q[t], sj[g], bj[g]), xv[t], acc[j]);
      }
    }
  }
  for (int j = 0; j < C; j++) {
    store_f(p.out, p.out_dtype, n + j, _mm512_reduce_add_ps(acc[j]));
  }
}

inline void* align64(void* p) {
  return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

template <int BITS>
void compute_bits(const QmmProblem& p, const uint8_t* scratch, int n0, int n1) {
  const size_t stride = X4::row_bytes(p.K);
  const size_t col_stride = stride / 4;
  const int groups = p.K / p.group;
  // A block of columns dequantized at once (at most ~192 KB: L2-resident while the rows
  // pass over it); its scales and biases converted to float32 in one go.
  int block = static_cast<int>((192 * 1024) / stride);
  block = block < COLS ? COLS : (block > 64 ? 64 : block / COLS * COLS);
  auto* cols = static_cast<float*>(align64(__builtin_alloca(block * stride + 64)));
  auto* s = static_cast<float*>(__builtin_alloca(sizeof(float) * (block * groups + 16)));
  auto* b = static_cast<float*>(__builtin_alloca(sizeof(float) * (block * groups + 16)));
  for (int m0 = 0; m0 < p.M; m0 += ROW_BLOCK) {
    const int m1 = m0 + ROW_BLOCK < p.M ? m0 + ROW_BLOCK : p.M;
    for (int nb0 = n0; nb0 < n1; nb0 += block) {
      const int nb = n1 - nb0 < block ? n1 - nb0 : block;
      const int64_t goff = static_cast<int64_t>(nb0) * groups;
      const float* sp = s;
      const float* bp = b;
      if (p.s_dtype == DType::f32) {
        sp = static_cast<const float*>(p.scales) + goff;
        bp = static_cast<const float*>(p.biases) + goff;
      } else {
        row_to_f32(p.scales, p.s_dtype, goff, nb * groups, s);
        row_to_f32(p.biases, p.s_dtype, goff, nb * groups, b);
      }
      if (p.M == 1) {
        const float* x = reinterpret_cast<const float*>(scratch);
        int j = 0;
        for (; j + COLS <= nb; j += COLS) {
          row_fused<BITS, COLS>(p, x, sp + j * groups, bp + j * groups, nb0 + j);
        }
        for (; j < nb; j++) {
          row_fused<BITS, 1>(p, x, sp + j * groups, bp + j * groups, nb0 + j);
        }
        continue;
      }
      for (int j = 0; j < nb; j++) {
        dequant_column<BITS>(p, nb0 + j, sp + j * groups, bp + j * groups,
                             cols + j * col_stride);
      }
      const float* rows[4];
      int m = m0;
      for (; m + 4 <= m1; m += 4) {
        for (int r = 0; r < 4; r++) {
          rows[r] = reinterpret_cast<const float*>(scratch + static_cast<size_t>(m + r) * stride);
        }
        rows_against<4>(p, rows, cols, col_stride, nb0, nb, m);
      }
      for (; m < m1; m++) {
        rows[0] = reinterpret_cast<const float*>(scratch + static_cast<size_t>(m) * stride);
        rows_against<1>(p, rows, cols, col_stride, nb0, nb, m);
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

// ---- attention: the portable algorithm (portable.h) with the dot products and the
// weighted sums of values in 512-bit registers, several query heads of a KV group sharing
// each key and value row ----------------------------------------------------------------

inline __m512 load16(const void* base, DType t, int64_t offset) {
  if (t == DType::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + offset);
  }
  const __m256i raw =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + offset));
  return t == DType::f16 ? _mm512_cvtph_ps(raw)
                         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 in 16 lanes: the same steps as exp_nonpositive, lane by lane.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187045e-06f)));
  __m512 poly = _mm512_set1_ps(1.0f / 720.0f);
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.0f / 120.0f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.0f / 24.0f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.0f / 6.0f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(0.5f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.0f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(poly, _mm512_castsi512_ps(e));
}

// HT query heads of group g (h0 ..) over the allowed keys, D = 16 * DC, Dv = 16 * DV.
template <int DC, int DV, int HT>
void attend_heads(const AttentionProblem& p, int b, int g, int i, int h0, int nh,
                  const int32_t* keys, int n, float* scores) {
  __m512 q[HT][DC];
  __m512 o[HT][DV];
  float run_max[HT];
  float total[HT];
  for (int h = 0; h < HT; h++) {
    const int hh = h < nh ? h0 + h : h0;
    const int64_t qoff = b * p.q_strides[0] + hh * p.q_strides[1] + i * p.q_strides[2];
    for (int c = 0; c < DC; c++) {
      q[h][c] = _mm512_mul_ps(load16(p.q, p.dtype, qoff + 16 * c), _mm512_set1_ps(p.scale));
    }
    for (int c = 0; c < DV; c++) {
      o[h][c] = _mm512_setzero_ps();
    }
    run_max[h] = -3.4e38f;
    total[h] = 0.0f;
  }
  const int64_t kbase = b * p.k_strides[0] + g * p.k_strides[1];
  const int64_t vbase = b * p.v_strides[0] + g * p.v_strides[1];
  const bool additive = p.mask_kind == 3;
  for (int start = 0; start < n; start += KB) {
    const int count = n - start < KB ? n - start : KB;
    for (int t = 0; t < count; t++) {
      const int j = keys[start + t];
      const int64_t koff = kbase + j * p.k_strides[2];
      __m512 acc[HT];
      for (int h = 0; h < HT; h++) {
        acc[h] = _mm512_setzero_ps();
      }
      for (int c = 0; c < DC; c++) {
        const __m512 kv = load16(p.k, p.dtype, koff + 16 * c);
        for (int h = 0; h < HT; h++) {
          acc[h] = _mm512_fmadd_ps(q[h][c], kv, acc[h]);
        }
      }
      for (int h = 0; h < HT; h++) {
        float s = _mm512_reduce_add_ps(acc[h]);
        if (additive) {
          float add;
          key_allowed(p, b, h0 + (h < nh ? h : 0), i, j, &add);
          s += add;
        }
        scores[h * KB + t] = s;
      }
    }
    for (int h = 0; h < HT; h++) {
      float* sc = scores + h * KB;
      __m512 mx = _mm512_set1_ps(-3.4e38f);
      int t = 0;
      for (; t + 16 <= count; t += 16) {
        mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + t));
      }
      float block_max = _mm512_reduce_max_ps(mx);
      for (; t < count; t++) {
        block_max = fmax2(block_max, sc[t]);
      }
      const float new_max = fmax2(run_max[h], block_max);
      const float alpha = exp_nonpositive(run_max[h] - new_max);
      const __m512 m16 = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (t = 0; t < count; t += 16) {
        const __mmask16 live = count - t >= 16 ? 0xFFFF : (__mmask16)((1u << (count - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + t), m16));
        _mm512_mask_storeu_ps(sc + t, live, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
      }
      total[h] = total[h] * alpha + _mm512_reduce_add_ps(sum);
      const __m512 a16 = _mm512_set1_ps(alpha);
      for (int c = 0; c < DV; c++) {
        o[h][c] = _mm512_mul_ps(o[h][c], a16);
      }
      run_max[h] = new_max;
    }
    for (int t = 0; t < count; t++) {
      const int64_t voff = vbase + keys[start + t] * p.v_strides[2];
      for (int c = 0; c < DV; c++) {
        const __m512 vv = load16(p.v, p.dtype, voff + 16 * c);
        for (int h = 0; h < HT; h++) {
          o[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[h * KB + t]), vv, o[h][c]);
        }
      }
    }
  }
  for (int h = 0; h < nh; h++) {
    const float inv = total[h] > 0.0f ? 1.0f / total[h] : 0.0f;
    const int64_t out = ((static_cast<int64_t>(b) * p.Hq + h0 + h) * p.Lq + i) * p.Dv;
    for (int c = 0; c < DV; c++) {
      const __m512 r = _mm512_mul_ps(o[h][c], _mm512_set1_ps(inv));
      if (p.dtype == DType::f32) {
        _mm512_storeu_ps(static_cast<float*>(p.out) + out + 16 * c, r);
      } else {
        float tmp[16];
        _mm512_storeu_ps(tmp, r);
        for (int d = 0; d < 16; d++) {
          store_f(p.out, p.dtype, out + 16 * c + d, tmp[d]);
        }
      }
    }
  }
}

// The allowed keys of query row i of batch b (head h's mask row), in order.
inline int allowed_keys(const AttentionProblem& p, int b, int h, int i, int32_t* keys) {
  int n = 0;
  if (p.mask_kind <= 1) {
    const int last = p.mask_kind == 1 ? i + (p.Lk - p.Lq) : p.Lk - 1;
    for (int j = 0; j <= last && j < p.Lk; j++) {
      keys[n++] = j;
    }
    return n;
  }
  for (int j = 0; j < p.Lk; j++) {
    float add;
    if (key_allowed(p, b, h, i, j, &add)) {
      keys[n++] = j;
    }
  }
  return n;
}

template <int DC, int DV, int HT>
void attention_group(const AttentionProblem& p, int b, int g, int i, float* work) {
  const int rep = p.Hq / p.Hkv;
  int32_t* keys = reinterpret_cast<int32_t*>(work);
  float* scores = work + p.Lk;
  // Heads of a group share their key list when the mask does not vary by head.
  const bool shared = p.mask_kind <= 1 || p.mask_strides[1] == 0;
  int n = shared ? allowed_keys(p, b, g * rep, i, keys) : 0;
  for (int h0 = 0; h0 < rep; h0 += shared ? HT : 1) {
    const int nh = shared ? (rep - h0 < HT ? rep - h0 : HT) : 1;
    if (!shared) {
      n = allowed_keys(p, b, g * rep + h0, i, keys);
    }
    attend_heads<DC, DV, HT>(p, b, g, i, g * rep + h0, nh, keys, n, scores);
  }
}

size_t attention_work_simd(const AttentionProblem& p) {
  return static_cast<size_t>(p.Lk) + 4 * KB + attention_work(p);
}

void attention(const AttentionProblem& p, int b, int g, int i, float* work) {
  if (p.D == 64 && p.Dv == 64) {
    attention_group<4, 4, 4>(p, b, g, i, work);
  } else if (p.D == 128 && p.Dv == 128) {
    attention_group<8, 8, 2>(p, b, g, i, work);
  } else if (p.D == 96 && p.Dv == 96) {
    attention_group<6, 6, 2>(p, b, g, i, work);
  } else if (p.D == 256 && p.Dv == 256) {
    attention_group<16, 16, 1>(p, b, g, i, work);
  } else {
    attention_item(p, b, g, i, work);
  }
}

// ---- attention over a quantized cache: the portable algorithm (portable.h) with each key and
// value row unpacked once into 512-bit registers and shared by the query heads of its group.
// A row's integers are multiplied by their group's scale as they are unpacked (one product a
// value, not one a value and head); the biases meet the query's group sums as scalars. 4-bit
// rows unpack a chunk of 32 values to its even values, then its odd ones; the query and the
// accumulator are kept in that order (perm_index) and put back in order at the end.

inline float load_scale(const void* base, DType t, int64_t i) {
  if (t == DType::f16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
  }
  return load_f(base, t, i);
}

// Where value d of a row sits among the unpacked lanes.
template <int BITS>
inline int perm_index(int d) {
  if (BITS == 8) {
    return d;
  }
  const int e = d & 31;
  return (d & ~31) + 16 * (e & 1) + (e >> 1);
}

// A packed row's DC vectors of 16 values as float32, each times its group's scale where
// SCALED (else the integers themselves: one group a row takes its scale after the sum).
template <int BITS, int DC, bool SCALED>
inline void unpack_row(const uint32_t* row, const float* scales, int vshift, __m512* out) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  if constexpr (BITS == 8) {
    for (int c = 0; c < DC; c++) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * c));
      out[c] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw));
      if (SCALED) {
        out[c] = _mm512_mul_ps(out[c], _mm512_set1_ps(scales[c >> vshift]));
      }
    }
  } else {
    const __m512i low = _mm512_set1_epi32(0x0f);
    for (int c = 0; c < DC; c += 2) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 8 * c));
      const __m512i w = _mm512_cvtepu8_epi32(raw);
      out[c] = _mm512_cvtepi32_ps(_mm512_and_si512(w, low));
      out[c + 1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
      if (SCALED) {
        const __m512 s = _mm512_set1_ps(scales[c >> vshift]);
        out[c] = _mm512_mul_ps(out[c], s);
        out[c + 1] = _mm512_mul_ps(out[c + 1], s);
      }
    }
  }
}

// r[t] = the sum of v[t]'s 16 lanes, for 16 vectors at once (a transposing tree: ~3
// instructions a vector where one reduction each takes ~8).
__attribute__((always_inline)) inline __m512 sum_lanes16(const float (*v)[16]) {
  __m512 w[8];
  for (int k = 0; k < 8; k++) {
    const __m512 a = _mm512_load_ps(v[2 * k]);
    const __m512 b = _mm512_load_ps(v[2 * k + 1]);
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  __m512 u[4];
  for (int k = 0; k < 4; k++) {
    const __m512d c = _mm512_castps_pd(w[2 * k]);
    const __m512d d = _mm512_castps_pd(w[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  // u[k]'s 128-bit lane l holds keys 4k .. 4k + 3 summed over that lane's elements.
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// HT query heads of group g (h0 ..) over the allowed keys of a quantized cache, D = Dv = 16 * DC;
// ONE: a row is one group (its scale applies once, to a key's score or a value's weight).
template <int DC, int HT, int BITS, bool ONE>
void quant_attend_heads(const QuantAttentionProblem& p, int b, int g, int i, int h0, int nh,
                        const int32_t* keys, int n, float* scores) {
  const AttentionProblem& a = p.a;
  const int vshift = p.group == 32 ? 1 : (p.group == 64 ? 2 : 3);  // vectors a group: 2^vshift
  const int groups = a.D / p.group;
  __m512 q[HT][DC];
  __m512 o[HT][DC];
  float qsum[HT][MAXG];
  float vbias[HT][MAXG];
  float run_max[HT];
  float total[HT];
  for (int h = 0; h < HT; h++) {
    const int hh = h < nh ? h0 + h : h0;
    const int64_t qoff = b * a.q_strides[0] + hh * a.q_strides[1] + i * a.q_strides[2];
    alignas(64) float tmp[16 * DC];
    for (int d = 0; d < 16 * DC; d++) {
      tmp[perm_index<BITS>(d)] = load_f(a.q, a.dtype, qoff + d) * a.scale;
    }
    for (int c = 0; c < DC; c++) {
      q[h][c] = _mm512_load_ps(tmp + 16 * c);
      o[h][c] = _mm512_setzero_ps();
    }
    for (int gi = 0; gi < groups; gi++) {  // a group's vectors are contiguous in both orders
      __m512 sum = _mm512_setzero_ps();
      for (int c = gi << vshift; c < (gi + 1) << vshift; c++) {
        sum = _mm512_add_ps(sum, q[h][c]);
      }
      qsum[h][gi] = _mm512_reduce_add_ps(sum);
      vbias[h][gi] = 0.0f;
    }
    run_max[h] = -3.4e38f;
    total[h] = 0.0f;
  }
  const uint32_t* kw = static_cast<const uint32_t*>(a.k);
  const uint32_t* vw = static_cast<const uint32_t*>(a.v);
  const int64_t kbase = b * a.k_strides[0] + g * a.k_strides[1];
  const int64_t vbase = b * a.v_strides[0] + g * a.v_strides[1];
  const int64_t ksbase = b * p.ks_strides[0] + g * p.ks_strides[1];
  const int64_t kbbase = b * p.kb_strides[0] + g * p.kb_strides[1];
  const int64_t vsbase = b * p.vs_strides[0] + g * p.vs_strides[1];
  const int64_t vbbase = b * p.vb_strides[0] + g * p.vb_strides[1];
  const bool additive = a.mask_kind == 3;
  // A block's scales and biases by group, then key (the scalar work done once, as vectors).
  alignas(64) float kss[MAXG][KB];
  alignas(64) float kbs[MAXG][KB];
  alignas(64) float vss[MAXG][KB];
  alignas(64) float vbs[MAXG][KB];
  alignas(64) float adds[HT][KB];
  for (int start = 0; start < n; start += KB) {
    const int count = n - start < KB ? n - start : KB;
    for (int t = 0; t < count; t++) {  // lanes past count are masked wherever read
      const int j = keys[start + t];
      for (int gi = 0; gi < groups; gi++) {
        kss[gi][t] = load_scale(p.k_scales, p.s_dtype, ksbase + j * p.ks_strides[2] + gi);
        kbs[gi][t] = load_scale(p.k_biases, p.s_dtype, kbbase + j * p.kb_strides[2] + gi);
        vss[gi][t] = load_scale(p.v_scales, p.s_dtype, vsbase + j * p.vs_strides[2] + gi);
        vbs[gi][t] = load_scale(p.v_biases, p.s_dtype, vbbase + j * p.vb_strides[2] + gi);
      }
      if (additive) {
        for (int h = 0; h < HT; h++) {
          key_allowed(a, b, h0 + (h < nh ? h : 0), i, j, &adds[h][t]);
        }
      }
    }
    // Scores 16 keys at a time: each key's products stay a vector until the 16 are summed
    // lane-wise together (sum_lanes16); scale, bias and mask then apply as vectors.
    for (int t0 = 0; t0 < count; t0 += 16) {
      const int tn = count - t0 < 16 ? count - t0 : 16;
      alignas(64) float part[HT][16][16];
      for (int tt = 0; tt < 16; tt++) {
        if (tt >= tn) {
          for (int h = 0; h < HT; h++) {
            _mm512_store_ps(part[h][tt], _mm512_setzero_ps());
          }
          continue;
        }
        const int t = t0 + tt;
        float ks[MAXG];
        if (!ONE) {
          for (int gi = 0; gi < groups; gi++) {
            ks[gi] = kss[gi][t];
          }
        }
        __m512 kf[DC];
        unpack_row<BITS, DC, !ONE>(kw + kbase + keys[start + t] * a.k_strides[2], ks, vshift,
                                   kf);
#pragma GCC unroll 4
        for (int h = 0; h < HT; h++) {
          __m512 acc = _mm512_mul_ps(q[h][0], kf[0]);
#pragma GCC unroll 16
          for (int c = 1; c < DC; c++) {
            acc = _mm512_fmadd_ps(q[h][c], kf[c], acc);
          }
          _mm512_store_ps(part[h][tt], acc);
        }
      }
      const __mmask16 live = tn == 16 ? 0xFFFF : (__mmask16)((1u << tn) - 1);
      for (int h = 0; h < HT; h++) {
        __m512 r = sum_lanes16(part[h]);
        if (ONE) {
          r = _mm512_mul_ps(r, _mm512_maskz_loadu_ps(live, kss[0] + t0));
        }
        for (int gi = 0; gi < groups; gi++) {
          r = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, kbs[gi] + t0),
                              _mm512_set1_ps(qsum[h][gi]), r);
        }
        if (additive) {
          r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(live, adds[h] + t0));
        }
        _mm512_mask_storeu_ps(scores + h * KB + t0, live, r);
      }
    }
    for (int h = 0; h < HT; h++) {
      float* sc = scores + h * KB;
      __m512 mx = _mm512_set1_ps(-3.4e38f);
      int t = 0;
      for (; t + 16 <= count; t += 16) {
        mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + t));
      }
      float block_max = _mm512_reduce_max_ps(mx);
      for (; t < count; t++) {
        block_max = fmax2(block_max, sc[t]);
      }
      const float new_max = fmax2(run_max[h], block_max);
      const float alpha = exp_nonpositive(run_max[h] - new_max);
      const __m512 m16 = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      __m512 bsum[MAXG];
      for (int gi = 0; gi < groups; gi++) {
        bsum[gi] = _mm512_setzero_ps();
      }
      for (t = 0; t < count; t += 16) {
        const __mmask16 live = count - t >= 16 ? 0xFFFF : (__mmask16)((1u << (count - t)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(
            live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + t), m16)));
        sum = _mm512_add_ps(sum, e);
        // The values' biases meet the weights here: sum_t p_t * bias_t, a group at a time.
        for (int gi = 0; gi < groups; gi++) {
          bsum[gi] = _mm512_fmadd_ps(e, _mm512_maskz_loadu_ps(live, vbs[gi] + t), bsum[gi]);
        }
        // One group a row: its scale folds into the weight.
        _mm512_mask_storeu_ps(sc + t, live,
                              ONE ? _mm512_mul_ps(e, _mm512_maskz_loadu_ps(live, vss[0] + t))
                                  : e);
      }
      total[h] = total[h] * alpha + _mm512_reduce_add_ps(sum);
      const __m512 a16 = _mm512_set1_ps(alpha);
      for (int c = 0; c < DC; c++) {
        o[h][c] = _mm512_mul_ps(o[h][c], a16);
      }
      for (int gi = 0; gi < groups; gi++) {
        vbias[h][gi] = vbias[h][gi] * alpha + _mm512_reduce_add_ps(bsum[gi]);
      }
      run_max[h] = new_max;
    }
    for (int t = 0; t < count; t++) {
      float vs[MAXG];
      if (!ONE) {
        for (int gi = 0; gi < groups; gi++) {
          vs[gi] = vss[gi][t];
        }
      }
      __m512 vf[DC];
      unpack_row<BITS, DC, !ONE>(vw + vbase + keys[start + t] * a.v_strides[2], vs, vshift, vf);
#pragma GCC unroll 4
      for (int h = 0; h < HT; h++) {
        const __m512 w16 = _mm512_set1_ps(scores[h * KB + t]);
#pragma GCC unroll 16
        for (int c = 0; c < DC; c++) {
          o[h][c] = _mm512_fmadd_ps(w16, vf[c], o[h][c]);
        }
      }
    }
  }
  for (int h = 0; h < nh; h++) {
    const float inv = total[h] > 0.0f ? 1.0f / total[h] : 0.0f;
    alignas(64) float tmp[16 * DC];
    for (int c = 0; c < DC; c++) {
      const __m512 r = _mm512_add_ps(o[h][c], _mm512_set1_ps(vbias[h][c >> vshift]));
      _mm512_store_ps(tmp + 16 * c, _mm512_mul_ps(r, _mm512_set1_ps(inv)));
    }
    const int64_t out = ((static_cast<int64_t>(b) * a.Hq + h0 + h) * a.Lq + i) * a.Dv;
    for (int d = 0; d < 16 * DC; d++) {
      store_f(a.out, a.dtype, out + d, tmp[perm_index<BITS>(d)]);
    }
  }
}

template <int DC, int HT, int BITS, bool ONE>
void quant_attention_group(const QuantAttentionProblem& p, int b, int g, int i, float* work) {
  const AttentionProblem& a = p.a;
  const int rep = a.Hq / a.Hkv;
  int32_t* keys = reinterpret_cast<int32_t*>(work);
  float* scores = work + a.Lk;
  const bool shared = a.mask_kind <= 1 || a.mask_strides[1] == 0;
  int n = shared ? allowed_keys(a, b, g * rep, i, keys) : 0;
  for (int h0 = 0; h0 < rep; h0 += shared ? HT : 1) {
    const int nh = shared ? (rep - h0 < HT ? rep - h0 : HT) : 1;
    if (!shared) {
      n = allowed_keys(a, b, g * rep + h0, i, keys);
    }
    quant_attend_heads<DC, HT, BITS, ONE>(p, b, g, i, g * rep + h0, nh, keys, n, scores);
  }
}

size_t quant_attention_work_simd(const QuantAttentionProblem& p) {
  return static_cast<size_t>(p.a.Lk) + 4 * KB + quant_attention_work(p);
}

// Heads taken together: the most (up to cap) that divide a group's heads evenly, else cap.
inline int heads_per_pass(int rep, int cap) {
  for (int ht = cap; ht > 1; ht--) {
    if (rep % ht == 0) {
      return ht;
    }
  }
  return rep < cap ? rep : cap;
}

template <int DC, int HT, int BITS>
void quant_attention_ht(const QuantAttentionProblem& p, int b, int g, int i, float* work) {
  if (p.group >= 16 * DC) {
    quant_attention_group<DC, HT, BITS, true>(p, b, g, i, work);
  } else {
    quant_attention_group<DC, HT, BITS, false>(p, b, g, i, work);
  }
}

template <int DC, int CAP, int BITS>
void quant_attention_dc(const QuantAttentionProblem& p, int b, int g, int i, float* work) {
  const int ht = heads_per_pass(p.a.Hq / p.a.Hkv, CAP);
  if (CAP >= 4 && ht == 4) {
    quant_attention_ht<DC, (CAP >= 4 ? 4 : 1), BITS>(p, b, g, i, work);
  } else if (CAP >= 3 && ht == 3) {
    quant_attention_ht<DC, (CAP >= 3 ? 3 : 1), BITS>(p, b, g, i, work);
  } else if (CAP >= 2 && ht == 2) {
    quant_attention_ht<DC, (CAP >= 2 ? 2 : 1), BITS>(p, b, g, i, work);
  } else {
    quant_attention_ht<DC, 1, BITS>(p, b, g, i, work);
  }
}

template <int BITS>
void quant_attention_bits(const QuantAttentionProblem& p, int b, int g, int i, float* work) {
  switch (p.a.D) {
    case 32:
      quant_attention_dc<2, 4, BITS>(p, b, g, i, work);
      break;
    case 64:
      quant_attention_dc<4, 4, BITS>(p, b, g, i, work);
      break;
    case 96:
      quant_attention_dc<6, 3, BITS>(p, b, g, i, work);
      break;
    case 128:
      quant_attention_dc<8, 2, BITS>(p, b, g, i, work);
      break;
    case 256:
      quant_attention_dc<16, 1, BITS>(p, b, g, i, work);
      break;
    default:
      quant_attention_item(p, b, g, i, work);
  }
}

void quant_attention(const QuantAttentionProblem& p, int b, int g, int i, float* work) {
  if (p.a.D != p.a.Dv) {
    quant_attention_item(p, b, g, i, work);
  } else if (p.bits == 8) {
    quant_attention_bits<8>(p, b, g, i, work);
  } else {
    quant_attention_bits<4>(p, b, g, i, work);
  }
}

// silu(gate) * up, 16 at a time, the portable formula lane by lane.
void silu_mul_simd(const void* gate, const void* up, void* out, DType t, int64_t i0,
                   int64_t i1) {
  if (t != DType::f32) {
    silu_mul(gate, up, out, t, i0, i1);
    return;
  }
  const float* g = static_cast<const float*>(gate);
  const float* u = static_cast<const float*>(up);
  float* o = static_cast<float*>(out);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x80000000));
  int64_t i = i0;
  for (; i < i1; i += 16) {
    const __mmask16 live = i1 - i >= 16 ? 0xFFFF : (__mmask16)((1u << (i1 - i)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(live, g + i);
    const __m512 uv = _mm512_maskz_loadu_ps(live, u + i);
    const __m512 e = exp16(_mm512_or_ps(gv, sign));  // exp(-|g|)
    const __m512 denom = _mm512_add_ps(one, e);
    const __mmask16 nonneg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 sig = _mm512_mask_blend_ps(nonneg, _mm512_div_ps(e, denom),
                                            _mm512_div_ps(one, denom));
    _mm512_mask_storeu_ps(o + i, live, _mm512_mul_ps(_mm512_mul_ps(gv, sig), uv));
  }
}

const KernelTable table = {
    "avx512", supports,  row_bytes,           prepare,
    compute,       attention, attention_work_simd, silu_mul_simd,
    quant_attention, quant_attention_work_simd,
};

}  // namespace

const KernelTable* kernels_avx512() {
  return &table;
}

}  // namespace mlxp

#else

namespace mlxp {
const KernelTable* kernels_avx512() {
  return nullptr;
}
}  // namespace mlxp

#endif
