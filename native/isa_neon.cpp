// aarch64 NEON (every Armv8 CPU: Graviton, Ampere, Apple silicon under Linux or macOS):
// weights dequantized exactly to float32 (w = scale * q + bias), 4 products per fused
// multiply-add. Compiled everywhere; empty off aarch64.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

namespace mlxp {
namespace {

#include "portable.h"

using X4 = XLayout<32, true>;
using X8 = XLayout<32, false>;
constexpr int ROW_BLOCK = 64;

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

// 16 bytes of quantized values to 16 float32 weights (four vectors) with one scale and bias.
inline void dequant16(uint8x16_t q, float scale, float bias, float* out) {
  const uint16x8_t lo = vmovl_u8(vget_low_u8(q));
  const uint16x8_t hi = vmovl_u8(vget_high_u8(q));
  const uint32x4_t parts[4] = {vmovl_u16(vget_low_u16(lo)), vmovl_u16(vget_high_u16(lo)),
                               vmovl_u16(vget_low_u16(hi)), vmovl_u16(vget_high_u16(hi))};
  const float32x4_t s = vdupq_n_f32(scale);
  const float32x4_t b = vdupq_n_f32(bias);
  for (int t = 0; t < 4; t++) {
    vst1q_f32(out + 4 * t, vfmaq_f32(b, vcvtq_f32_u32(parts[t]), s));
  }
}

void compute(const QmmProblem& p, const uint8_t* scratch, int n0, int n1) {
  const int K = p.K;
  const int blocks = K / 32;
  const int groups = K / p.group;
  const size_t stride = X4::row_bytes(K);
  const size_t wrow = static_cast<size_t>(K) * p.bits / 8;
  auto* wf = static_cast<float*>(__builtin_alloca(sizeof(float) * (K + 4)));
  for (int m0 = 0; m0 < p.M; m0 += ROW_BLOCK) {
    const int m1 = m0 + ROW_BLOCK < p.M ? m0 + ROW_BLOCK : p.M;
    for (int n = n0; n < n1; n++) {
      const uint8_t* w = p.w + static_cast<size_t>(n) * wrow;
      const int64_t goff = static_cast<int64_t>(n) * groups;
      for (int blk = 0; blk < blocks; blk++) {
        const int64_t g = goff + (32 * blk) / p.group;
        const float s = load_f(p.scales, p.s_dtype, g);
        const float b = load_f(p.biases, p.s_dtype, g);
        if (p.bits == 4) {  // low nibbles are the even elements, high ones the odd
          const uint8x16_t raw = vld1q_u8(w + 16 * blk);
          dequant16(vandq_u8(raw, vdupq_n_u8(0x0f)), s, b, wf + 32 * blk);
          dequant16(vshrq_n_u8(raw, 4), s, b, wf + 32 * blk + 16);
        } else {
          dequant16(vld1q_u8(w + 32 * blk), s, b, wf + 32 * blk);
          dequant16(vld1q_u8(w + 32 * blk + 16), s, b, wf + 32 * blk + 16);
        }
      }
      for (int m = m0; m < m1; m++) {
        const float* x = reinterpret_cast<const float*>(scratch + static_cast<size_t>(m) * stride);
        float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f),
                              vdupq_n_f32(0.0f)};
        for (int k = 0; k < K; k += 16) {
          for (int t = 0; t < 4; t++) {
            acc[t] = vfmaq_f32(acc[t], vld1q_f32(wf + k + 4 * t), vld1q_f32(x + k + 4 * t));
          }
        }
        const float32x4_t sum = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
        store_f(p.out, p.out_dtype, static_cast<int64_t>(m) * p.N + n, vaddvq_f32(sum));
      }
    }
  }
}

const KernelTable table = {
    "neon",  supports,       row_bytes,      prepare,
    compute, attention_item, attention_work, silu_mul,
    quant_attention_item, quant_attention_work,
};

}  // namespace

const KernelTable* kernels_neon() {
  return &table;
}
}  // namespace mlxp

#else

namespace mlxp {
const KernelTable* kernels_neon() {
  return nullptr;
}
}  // namespace mlxp

#endif
