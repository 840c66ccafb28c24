// The CPU kernels' plain-C++ interface: raw pointers and shapes, no MLX types.
//
// Each instruction set has its own translation unit (isa_*.cpp), compiled with its own
// flags, that fills a KernelTable; dispatch.cpp picks the table this CPU can run. Keeping
// MLX and the standard library's templates out of those units matters: an inline function
// compiled there with AVX-512 enabled could be the copy the linker keeps for every caller.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlxp {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

// y[M, N] = x[M, K] @ dequantize(w)[N, K]^T, MLX's affine layout: w holds N rows of
// K * bits / 8 bytes (element k of a row in bits [bits * (k % per_word)] of word k / per_word,
// little endian), scales and biases N rows of K / group values; w = scale * q + bias.
struct QmmProblem {
  const void* x;
  DType x_dtype;
  int64_t x_row_stride;  // elements between rows; a row itself is contiguous
  const uint8_t* w;
  const void* scales;
  const void* biases;
  DType s_dtype;
  int M, N, K, bits, group;
  void* out;  // M x N, row-major, out_dtype
  DType out_dtype;
};

// out[b, h, i, :] = softmax(scale * q[b, h, i] . k[b, h / rep, j] + mask) @ v[b, h / rep, j]
// over the keys j the mask allows, skipping the others (never read, never summed).
struct AttentionProblem {
  const void* q;
  const void* k;
  const void* v;
  DType dtype;  // q, k, v and out share it
  int B, Hq, Hkv, Lq, Lk, D, Dv;
  int64_t q_strides[3];  // b, h, i (the last axis is contiguous)
  int64_t k_strides[3];
  int64_t v_strides[3];
  float scale;
  // mask: 0 none, 1 causal (key j allowed for query i iff j <= i + Lk - Lq),
  // 2 boolean array, 3 additive float32 array; arrays are indexed by strides (0: broadcast).
  int mask_kind;
  const void* mask;
  int64_t mask_strides[4];  // b, h, i, j
  void* out;  // B x Hq x Lq x Dv, row-major
};

// Attention over a quantized KV cache (mlx-lm's QuantizedKVCache, mx.quantize along the head
// dimension): a.k / a.v point at the packed uint32 words (a.k_strides / a.v_strides count
// words; a key's D * bits / 32 words are contiguous), a.D / a.Dv are the unpacked head sizes,
// a.dtype is the queries' and the output's. Each key's group of `group` values has one scale
// and bias (s_dtype), strided like the packed words. key = scale * q_int + bias, computed per
// group as scale * (q . k_int) + bias * sum(q): the cache is never dequantized to a copy.
struct QuantAttentionProblem {
  AttentionProblem a;
  const void* k_scales;
  const void* k_biases;
  const void* v_scales;
  const void* v_biases;
  DType s_dtype;
  int64_t ks_strides[3];  // b, h, j (a key's groups are contiguous)
  int64_t kb_strides[3];
  int64_t vs_strides[3];
  int64_t vb_strides[3];
  int bits, group;
};

// What one instruction set provides. The matmul runs in two phases over a scratch buffer:
// stage the activations as float32 rows (rows in parallel), then the products (columns in
// parallel).
struct KernelTable {
  const char* name;
  // Whether this table handles the shape; others fall back to the next table.
  bool (*qmm_supports)(int K, int bits, int group);
  size_t (*qmm_row_bytes)(int K, int bits, int group);
  void (*qmm_prepare)(const QmmProblem& p, uint8_t* scratch, int m0, int m1);
  void (*qmm_compute)(const QmmProblem& p, const uint8_t* scratch, int n0, int n1);
  // One work item: batch b, kv head g, query row i; every query head of the group.
  void (*attention)(const AttentionProblem& p, int b, int g, int i, float* work);
  size_t (*attention_work_floats)(const AttentionProblem& p);
  // out[i] = silu(gate[i]) * up[i] for i in [i0, i1) (mlx-lm's swiglu), contiguous arrays.
  void (*silu_mul)(const void* gate, const void* up, void* out, DType t, int64_t i0,
                   int64_t i1);
  // The attention's work item over a quantized cache; its scratch in floats.
  void (*quant_attention)(const QuantAttentionProblem& p, int b, int g, int i, float* work);
  size_t (*quant_attention_work_floats)(const QuantAttentionProblem& p);
};

// The tables compiled in (null where the unit was built for another architecture).
const KernelTable* kernels_generic();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();
// The int8-activation matmul (qmm_* only; the other entries are null): not a rung of the
// ladder, a second path asked for by name (int8_kernels_for).
const KernelTable* kernels_avx512_vnni();
const KernelTable* kernels_neon();

}  // namespace mlxp
