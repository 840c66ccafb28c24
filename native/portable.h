// Portable pieces every instruction-set unit compiles with its own flags: float formats,
// the activations staged as float32 rows, the scalar matmul and the fused attention.
//
// Included inside an anonymous namespace (internal linkage: no copy compiled for one ISA can
// be shared with another unit) after <cstdint> and <cstring>; it includes nothing itself and
// uses compiler builtins rather than <cmath> or <algorithm>, whose inline templates would
// be such shared copies.

#define MLXP_ALIGN64(n) ((((n) + 63) / 64) * 64)

// ---- float formats -----------------------------------------------------------------------

inline float bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_f32(uint16_t h) {
  return bits_to_f32(static_cast<uint32_t>(h) << 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  if (exp == 0x1f) {  // inf or nan
    return bits_to_f32(sign | 0x7f800000u | (man << 13));
  }
  if (exp == 0) {
    if (man == 0) {
      return bits_to_f32(sign);
    }
    // Subnormal: value = man * 2^-24, exact in float32.
    float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

// Round to nearest even, as MLX converts float32 to bfloat16 (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x40);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7e00u);
  }
  if (a >= 0x477ff000u) {  // rounds to or past 65520: infinity
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (a < 0x38800000u) {  // below the smallest normal half: a subnormal, rounded to even
    float v = bits_to_f32(a) * 16777216.0f;  // in units of 2^-24, exact
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(__builtin_rintf(v)));
  }
  uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

inline float load_f(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(base)[i];
    case DType::f16:
      return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default:
      return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
}

inline void store_f(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(base)[i] = v;
      break;
    case DType::f16:
      static_cast<uint16_t*>(base)[i] = f32_to_f16(v);
      break;
    default:
      static_cast<uint16_t*>(base)[i] = f32_to_bf16(v);
      break;
  }
}

inline float fmax2(float a, float b) {
  return a > b ? a : b;
}

// exp(x) for x <= 0 (softmax after its max is subtracted): 2^n * p(r), |r| <= ln2 / 2,
// a degree-6 polynomial; ~2 ulp. The same code in every lane, so vectorizable.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = __builtin_rintf(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t e = static_cast<int32_t>(n) + 127;
  return p * bits_to_f32(static_cast<uint32_t>(e) << 23);
}

inline float sum16(const float* a) {
  float t[8];
  for (int i = 0; i < 8; i++) {
    t[i] = a[i] + a[i + 8];
  }
  for (int i = 0; i < 4; i++) {
    t[i] = t[i] + t[i + 4];
  }
  t[0] = t[0] + t[2];
  t[1] = t[1] + t[3];
  return t[0] + t[1];
}

// ---- the activations, in float32, in the order the weights unpack in --------------------
//
// The matmul dequantizes weights exactly (w = scale * q + bias, in float32) and multiplies
// them with float32 activations: MLX's own arithmetic, in another order. A row's scratch is
// its K activations as float32; with PERM (4-bit weights, where a byte's low nibble is the
// even element) each chunk of CHUNK holds its even elements first, then its odd ones, so
// that unpacked nibbles meet their activations without shuffling the weights.

template <int CHUNK, bool PERM>
struct XLayout {
  static size_t row_bytes(int K) {
    return MLXP_ALIGN64(static_cast<size_t>(K) * 4);
  }
  // Where element e of a chunk goes.
  static int position(int e) {
    if (!PERM) {
      return e;
    }
    return (e & 1) ? CHUNK / 2 + e / 2 : e / 2;
  }
  static void prepare(const QmmProblem& p, uint8_t* scratch, int m0, int m1) {
    const size_t stride = row_bytes(p.K);
    for (int m = m0; m < m1; m++) {
      float* row = reinterpret_cast<float*>(scratch + static_cast<size_t>(m) * stride);
      const int64_t base = static_cast<int64_t>(m) * p.x_row_stride;
      for (int k = 0; k < p.K; k++) {
        row[(k / CHUNK) * CHUNK + position(k % CHUNK)] = load_f(p.x, p.x_dtype, base + k);
      }
    }
  }
};

// ---- the matmul in scalar code (any CPU; the reference the SIMD units follow) ------------

using GenericX = XLayout<32, false>;

inline uint32_t weight_q(const uint8_t* row, int bits, int k) {
  if (bits == 8) {
    return row[k];
  }
  const uint8_t byte = row[k / 2];
  return (k & 1) ? (byte >> 4) : (byte & 0x0f);
}

inline void generic_compute(const QmmProblem& p, const uint8_t* scratch, int n0, int n1) {
  const size_t stride = GenericX::row_bytes(p.K);
  const int groups = p.K / p.group;
  const size_t wrow = static_cast<size_t>(p.K) * p.bits / 8;
  for (int n = n0; n < n1; n++) {
    const uint8_t* w = p.w + static_cast<size_t>(n) * wrow;
    for (int m = 0; m < p.M; m++) {
      const float* x = reinterpret_cast<const float*>(scratch + static_cast<size_t>(m) * stride);
      float acc[16] = {0};
      for (int k = 0; k < p.K; k++) {
        const int64_t g = static_cast<int64_t>(n) * groups + k / p.group;
        const float wk = static_cast<float>(weight_q(w, p.bits, k)) *
                load_f(p.scales, p.s_dtype, g) + load_f(p.biases, p.s_dtype, g);
        acc[k % 16] += wk * x[k];
      }
      store_f(p.out, p.out_dtype, static_cast<int64_t>(m) * p.N + n, sum16(acc));
    }
  }
}

// ---- fused attention: one pass over the allowed keys with an online softmax -------------
//
// Keys are taken in blocks of KB *allowed* keys, counted from the first allowed one, so a
// row's result does not depend on how much padding sits before its keys: batched equals
// alone, bit for bit. Every sum runs in 16 partial lanes, then one fixed tree.

constexpr int KB = 64;   // allowed keys per block
constexpr int MAXD = 256;  // head dimensions handled (larger fall back to MLX)

inline float dot_f32(const float* a, const float* b, int n) {
  float acc[16] = {0};
  int d = 0;
  for (; d + 16 <= n; d += 16) {
    for (int t = 0; t < 16; t++) {
      acc[t] += a[d + t] * b[d + t];
    }
  }
  for (int t = 0; d + t < n; t++) {
    acc[t] += a[d + t] * b[d + t];
  }
  return sum16(acc);
}

// Copies n values of any float type into f32 (keys and values of f16/bf16 caches).
inline void to_f32(const void* src, DType t, int64_t offset, int n, float* dst) {
  if (t == DType::f32) {
    memcpy(dst, static_cast<const float*>(src) + offset, sizeof(float) * n);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src) + offset;
  if (t == DType::bf16) {
    for (int i = 0; i < n; i++) {
      dst[i] = bf16_to_f32(h[i]);
    }
  } else {
    for (int i = 0; i < n; i++) {
      dst[i] = f16_to_f32(h[i]);
    }
  }
}

inline size_t attention_work(const AttentionProblem& p) {
  // allowed key indices, a block's scores, the query, a key or value row, the accumulator
  const int widest = p.D > p.Dv ? p.D : p.Dv;
  return static_cast<size_t>(p.Lk) + KB + p.D + widest + p.Dv + 64;
}

inline bool key_allowed(const AttentionProblem& p, int b, int h, int i, int j, float* add) {
  *add = 0.0f;
  switch (p.mask_kind) {
    case 0:
      return true;
    case 1:
      return j <= i + (p.Lk - p.Lq);
    default: {
      const int64_t at = b * p.mask_strides[0] + h * p.mask_strides[1] +
          i * p.mask_strides[2] + j * p.mask_strides[3];
      if (p.mask_kind == 2) {
        return static_cast<const uint8_t*>(p.mask)[at] != 0;
      }
      *add = static_cast<const float*>(p.mask)[at];
      return *add > -3.0e38f;  // -inf (or float32's lowest) masks the key out
    }
  }
}

// One query head's pass over its allowed keys; out gets Dv values.
inline void attend_head(const AttentionProblem& p, int b, int h, int i, const float* q,
                        int32_t* keys, float* scores, float* krow, float* acc, float* out) {
  const int g = h / (p.Hq / p.Hkv);
  int n = 0;
  for (int j = 0; j < p.Lk; j++) {
    float add;
    if (key_allowed(p, b, h, i, j, &add)) {
      keys[n++] = j;
    }
  }
  for (int d = 0; d < p.Dv; d++) {
    acc[d] = 0.0f;
  }
  float running_max = -3.4e38f;
  float total = 0.0f;
  const int64_t kbase = b * p.k_strides[0] + g * p.k_strides[1];
  const int64_t vbase = b * p.v_strides[0] + g * p.v_strides[1];
  for (int start = 0; start < n; start += KB) {
    const int count = n - start < KB ? n - start : KB;
    float block_max = -3.4e38f;
    for (int t = 0; t < count; t++) {
      const int j = keys[start + t];
      float add;
      key_allowed(p, b, h, i, j, &add);
      to_f32(p.k, p.dtype, kbase + j * p.k_strides[2], p.D, krow);
      const float s = dot_f32(q, krow, p.D) * p.scale + add;
      scores[t] = s;
      block_max = fmax2(block_max, s);
    }
    const float new_max = fmax2(running_max, block_max);
    const float alpha = exp_nonpositive(running_max - new_max);
    float partial[16] = {0};
    for (int t = 0; t < count; t++) {
      scores[t] = exp_nonpositive(scores[t] - new_max);
      partial[t % 16] += scores[t];
    }
    total = total * alpha + sum16(partial);
    for (int d = 0; d < p.Dv; d++) {
      acc[d] *= alpha;
    }
    for (int t = 0; t < count; t++) {
      to_f32(p.v, p.dtype, vbase + keys[start + t] * p.v_strides[2], p.Dv, krow);
      const float w = scores[t];
      for (int d = 0; d < p.Dv; d++) {
        acc[d] += w * krow[d];
      }
    }
    running_max = new_max;
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = 0; d < p.Dv; d++) {
    out[d] = acc[d] * inv;
  }
}

inline void attention_item(const AttentionProblem& p, int b, int g, int i, float* work) {
  const int rep = p.Hq / p.Hkv;
  int32_t* keys = reinterpret_cast<int32_t*>(work);
  float* scores = work + p.Lk;
  float* q = scores + KB;
  float* krow = q + p.D;
  float* acc = krow + (p.D > p.Dv ? p.D : p.Dv);
  float out[MAXD];
  for (int r = 0; r < rep; r++) {
    const int h = g * rep + r;
    to_f32(p.q, p.dtype, b * p.q_strides[0] + h * p.q_strides[1] + i * p.q_strides[2], p.D,
           q);
    attend_head(p, b, h, i, q, keys, scores, krow, acc, out);
    const int64_t o = ((static_cast<int64_t>(b) * p.Hq + h) * p.Lq + i) * p.Dv;
    for (int d = 0; d < p.Dv; d++) {
      store_f(p.out, p.dtype, o + d, out[d]);
    }
  }
}

// ---- fused attention over a quantized KV cache ------------------------------------------
//
// The same pass as above (blocks of KB allowed keys from the first allowed one, an online
// softmax), reading mx.quantize's packed keys and values where they lie. The query is scaled
// first (as mlx-lm's quantized attention does) and its sum over each group taken once:
// q . key = sum over groups of scale * (q_g . k_int_g) + bias * sum(q_g). The values
// accumulate p * scale * v_int per element and p * bias per group, added at the end.

constexpr int MAXG = MAXD / 32;  // groups of a head, at the smallest group (32)

// Element k of a packed row (little endian within each uint32 word).
inline uint32_t packed_q(const uint32_t* words, int bits, int k) {
  const int per = 32 / bits;
  return (words[k / per] >> (bits * (k % per))) & ((1u << bits) - 1u);
}

inline size_t quant_attention_work(const QuantAttentionProblem& p) {
  // allowed key indices, a block's scores, the query, its group sums, the accumulator, the
  // value groups' bias sums
  return static_cast<size_t>(p.a.Lk) + KB + p.a.D + MAXG + p.a.Dv + MAXG + 64;
}

// One query head's pass over its allowed keys (q scaled, qsum its group sums); out gets Dv
// values.
inline void quant_attend_head(const QuantAttentionProblem& p, int b, int h, int i,
                              const float* q, const float* qsum, int32_t* keys, float* scores,
                              float* acc, float* vbias, float* out) {
  const AttentionProblem& a = p.a;
  const int g = h / (a.Hq / a.Hkv);
  const int kgroups = a.D / p.group;
  const int vgroups = a.Dv / p.group;
  int n = 0;
  for (int j = 0; j < a.Lk; j++) {
    float add;
    if (key_allowed(a, b, h, i, j, &add)) {
      keys[n++] = j;
    }
  }
  for (int d = 0; d < a.Dv; d++) {
    acc[d] = 0.0f;
  }
  for (int c = 0; c < vgroups; c++) {
    vbias[c] = 0.0f;
  }
  const uint32_t* kw = static_cast<const uint32_t*>(a.k);
  const uint32_t* vw = static_cast<const uint32_t*>(a.v);
  const int64_t kbase = b * a.k_strides[0] + g * a.k_strides[1];
  const int64_t vbase = b * a.v_strides[0] + g * a.v_strides[1];
  const int64_t ksbase = b * p.ks_strides[0] + g * p.ks_strides[1];
  const int64_t kbbase = b * p.kb_strides[0] + g * p.kb_strides[1];
  const int64_t vsbase = b * p.vs_strides[0] + g * p.vs_strides[1];
  const int64_t vbbase = b * p.vb_strides[0] + g * p.vb_strides[1];
  float running_max = -3.4e38f;
  float total = 0.0f;
  for (int start = 0; start < n; start += KB) {
    const int count = n - start < KB ? n - start : KB;
    float block_max = -3.4e38f;
    for (int t = 0; t < count; t++) {
      const int j = keys[start + t];
      float add;
      key_allowed(a, b, h, i, j, &add);
      const uint32_t* row = kw + kbase + j * a.k_strides[2];
      float s = 0.0f;
      for (int c = 0; c < kgroups; c++) {
        float lanes[16] = {0};
        for (int e = 0; e < p.group; e++) {
          const int d = c * p.group + e;
          lanes[e % 16] += q[d] * static_cast<float>(packed_q(row, p.bits, d));
        }
        const float scale = load_f(p.k_scales, p.s_dtype, ksbase + j * p.ks_strides[2] + c);
        const float bias = load_f(p.k_biases, p.s_dtype, kbbase + j * p.kb_strides[2] + c);
        s += scale * sum16(lanes) + bias * qsum[c];
      }
      s += add;
      scores[t] = s;
      block_max = fmax2(block_max, s);
    }
    const float new_max = fmax2(running_max, block_max);
    const float alpha = exp_nonpositive(running_max - new_max);
    float partial[16] = {0};
    for (int t = 0; t < count; t++) {
      scores[t] = exp_nonpositive(scores[t] - new_max);
      partial[t % 16] += scores[t];
    }
    total = total * alpha + sum16(partial);
    for (int d = 0; d < a.Dv; d++) {
      acc[d] *= alpha;
    }
    for (int c = 0; c < vgroups; c++) {
      vbias[c] *= alpha;
    }
    for (int t = 0; t < count; t++) {
      const int j = keys[start + t];
      const uint32_t* row = vw + vbase + j * a.v_strides[2];
      const float w = scores[t];
      for (int c = 0; c < vgroups; c++) {
        const float ws = w * load_f(p.v_scales, p.s_dtype, vsbase + j * p.vs_strides[2] + c);
        vbias[c] += w * load_f(p.v_biases, p.s_dtype, vbbase + j * p.vb_strides[2] + c);
        for (int e = 0; e < p.group; e++) {
          const int d = c * p.group + e;
          acc[d] += ws * static_cast<float>(packed_q(row, p.bits, d));
        }
      }
    }
    running_max = new_max;
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = 0; d < a.Dv; d++) {
    out[d] = (acc[d] + vbias[d / p.group]) * inv;
  }
}

// The query of head h, row i, scaled, and its sums over each group of the keys.
inline void quant_query(const QuantAttentionProblem& p, int b, int h, int i, float* q,
                        float* qsum) {
  const AttentionProblem& a = p.a;
  to_f32(a.q, a.dtype, b * a.q_strides[0] + h * a.q_strides[1] + i * a.q_strides[2], a.D, q);
  for (int d = 0; d < a.D; d++) {
    q[d] *= a.scale;
  }
  for (int c = 0; c < a.D / p.group; c++) {
    float lanes[16] = {0};
    for (int e = 0; e < p.group; e++) {
      lanes[e % 16] += q[c * p.group + e];
    }
    qsum[c] = sum16(lanes);
  }
}

inline void quant_attention_item(const QuantAttentionProblem& p, int b, int g, int i,
                                 float* work) {
  const AttentionProblem& a = p.a;
  const int rep = a.Hq / a.Hkv;
  int32_t* keys = reinterpret_cast<int32_t*>(work);
  float* scores = work + a.Lk;
  float* q = scores + KB;
  float* qsum = q + a.D;
  float* acc = qsum + MAXG;
  float* vbias = acc + a.Dv;
  float out[MAXD];
  for (int r = 0; r < rep; r++) {
    const int h = g * rep + r;
    quant_query(p, b, h, i, q, qsum);
    quant_attend_head(p, b, h, i, q, qsum, keys, scores, acc, vbias, out);
    const int64_t o = ((static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i) * a.Dv;
    for (int d = 0; d < a.Dv; d++) {
      store_f(a.out, a.dtype, o + d, out[d]);
    }
  }
}

// ---- silu(gate) * up ---------------------------------------------------------------------

inline float silu_mul_one(float g, float u) {
  const float e = exp_nonpositive(g > 0.0f ? -g : g);  // exp(-|g|), never overflows
  const float sig = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return g * sig * u;
}

inline void silu_mul(const void* gate, const void* up, void* out, DType t, int64_t i0,
                     int64_t i1) {
  if (t == DType::f32) {
    const float* g = static_cast<const float*>(gate);
    const float* u = static_cast<const float*>(up);
    float* o = static_cast<float*>(out);
    for (int64_t i = i0; i < i1; i++) {
      o[i] = silu_mul_one(g[i], u[i]);
    }
    return;
  }
  for (int64_t i = i0; i < i1; i++) {
    store_f(out, t, i, silu_mul_one(load_f(gate, t, i), load_f(up, t, i)));
  }
}
