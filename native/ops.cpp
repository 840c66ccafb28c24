// The kernels as operations of the MLX graph: a Primitive each, evaluated on MLX's CPU
// stream like MLX's own ops, and the Python module (nanobind, in MLX's binding domain so that
// mlx.core.array crosses over as the same type).
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "mlx/version.h"

#include "dispatch.h"
#include "threads.h"

#define MLXP_STR2(x) #x
#define MLXP_STR(x) MLXP_STR2(x)
#define MLX_BUILT_VERSION \
  MLXP_STR(MLX_VERSION_MAJOR) "." MLXP_STR(MLX_VERSION_MINOR) "." MLXP_STR(MLX_VERSION_PATCH)

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace mlxp {
namespace {

DType dtype_of(const mx::array& a) {
  switch (a.dtype()) {
    case mx::float32:
      return DType::f32;
    case mx::float16:
      return DType::f16;
    case mx::bfloat16:
      return DType::bf16;
    default:
      throw std::invalid_argument("mlx_providers cpu kernels: float32, float16 or bfloat16 only");
  }
}

// A pointer to a's elements in row-major order: a's own data when it is laid out so,
// else a copy into storage (views the kernels cannot walk: rare, and correct either way).
const void* row_major(const mx::array& a, std::vector<uint8_t>& storage) {
  if (a.flags().row_contiguous) {
    return a.data<void>();
  }
  const size_t item = a.itemsize();
  storage.resize(a.size() * item);
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const uint8_t* src = a.data<uint8_t>();
  std::vector<int> index(shape.size(), 0);
  for (size_t e = 0; e < a.size(); e++) {
    int64_t at = 0;
    for (size_t d = 0; d < shape.size(); d++) {
      at += static_cast<int64_t>(index[d]) * strides[d];
    }
    std::memcpy(storage.data() + e * item, src + at * static_cast<int64_t>(item), item);
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; d--) {
      if (++index[d] < shape[d]) {
        break;
      }
      index[d] = 0;
    }
  }
  return storage.data();
}

// x's rows (all axes but the last, flattened) as one stride, when its layout allows.
bool uniform_rows(const mx::array& x, int64_t* row_stride) {
  const int nd = x.ndim();
  if (x.strides()[nd - 1] != 1) {
    return false;
  }
  if (nd == 1) {
    *row_stride = x.shape(0);
    return true;
  }
  int64_t stride = x.strides()[nd - 2];
  for (int d = nd - 3; d >= 0; d--) {
    if (x.shape(d) != 1 && x.strides()[d] != stride * x.shape(d + 1)) {
      return false;
    }
  }
  *row_stride = x.shape(nd - 2) == 1 && nd == 2 ? x.shape(nd - 1) : stride;
  return true;
}

uint8_t* scratch(size_t bytes) {
  // Per thread, grown as needed and kept: decode steps ask for the same sizes again.
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < bytes + 64) {
    buffer.resize(bytes + 64);
  }
  return reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
}

// Column (or row) ranges for the pool: several per thread so a thread slowed by other
// work on the machine hands its share on; ranges are multiples of align.
int split(int total, int align, int per_thread) {
  const int threads = pool_threads();
  int parts = threads * per_thread;
  const int most = (total + align - 1) / align;
  return parts < most ? parts : (most > 0 ? most : 1);
}

// The table for a matmul: the int8-activation one where asked for and the CPU has it.
const KernelTable& qmm_table(int K, int bits, int group, bool int8) {
  if (int8) {
    if (const KernelTable* t = int8_kernels_for(K, bits, group)) {
      return *t;
    }
  }
  return kernels_for(K, bits, group);
}

void run_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
             const mx::array& biases, mx::array& out, int group, int bits, bool int8) {
  std::vector<uint8_t> xs, ws, ss, bs;
  QmmProblem p{};
  p.K = x.shape(-1);
  p.N = out.shape(-1);
  p.M = static_cast<int>(x.size() / p.K);
  p.bits = bits;
  p.group = group;
  p.x_dtype = dtype_of(x);
  if (uniform_rows(x, &p.x_row_stride)) {
    p.x = x.data<void>();
  } else {
    p.x = row_major(x, xs);
    p.x_row_stride = p.K;
  }
  p.w = static_cast<const uint8_t*>(row_major(w, ws));
  p.scales = row_major(scales, ss);
  p.biases = row_major(biases, bs);
  p.s_dtype = dtype_of(scales);
  p.out = out.data<void>();
  p.out_dtype = dtype_of(out);
  if (p.M == 0 || p.N == 0) {
    return;
  }
  const KernelTable& t = qmm_table(p.K, bits, group, int8);
  const size_t row_bytes = t.qmm_row_bytes(p.K, bits, group);
  uint8_t* buf = scratch(row_bytes * p.M);
  const int row_parts = p.M >= 16 ? split(p.M, 4, 1) : 1;
  const int rows_each = (p.M + row_parts - 1) / row_parts;
  parallel_for(row_parts, [&](int i) {
    const int m0 = i * rows_each;
    const int m1 = m0 + rows_each < p.M ? m0 + rows_each : p.M;
    if (m0 < m1) {
      t.qmm_prepare(p, buf, m0, m1);
    }
  });
  const double work = static_cast<double>(p.M) * p.N * p.K;
  const int col_parts = split(p.N, 16, work > 4.0e6 ? 4 : 1);
  const int cols_each = ((p.N + col_parts - 1) / col_parts + 15) / 16 * 16;
  parallel_for(col_parts, [&](int i) {
    const int n0 = i * cols_each;
    const int n1 = n0 + cols_each < p.N ? n0 + cols_each : p.N;
    if (n0 < n1) {
      t.qmm_compute(p, buf, n0, n1);
    }
  });
}

// A primitive's evaluation on MLX's CPU stream: its outputs allocated, its arrays registered
// with the stream's encoder (which keeps them alive until the task ran), then
// task(inputs, outputs) queued on weak copies of them.
template <typename Task>
void dispatch_cpu(mx::Stream stream, const std::vector<mx::array>& inputs,
                  std::vector<mx::array>& outputs, Task task) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in;
  std::vector<mx::array> out;
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
    out.push_back(mx::array::unsafe_weak_copy(o));
  }
  encoder.dispatch([in = std::move(in), out = std::move(out), task = std::move(task)]() mutable {
    task(in, out);
  });
}

// The same for a primitive of one output: task(inputs, output).
template <typename Task>
void dispatch_cpu(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out,
                  Task task) {
  std::vector<mx::array> outputs = {out};  // a copy shares out's data: allocated through it
  dispatch_cpu(stream, inputs, outputs,
               [task = std::move(task)](std::vector<mx::array>& in,
                                        std::vector<mx::array>& o) mutable { task(in, o[0]); });
}

class QuantizedMatmulCpu : public mx::UnaryPrimitive {
 public:
  QuantizedMatmulCpu(mx::Stream stream, int group, int bits, bool int8)
      : mx::UnaryPrimitive(stream), group_(group), bits_(bits), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out,
                 [group = group_, bits = bits_, int8 = int8_](std::vector<mx::array>& in,
                                                              mx::array& y) {
                   run_qmm(in[0], in[1], in[2], in[3], y, group, bits, int8);
                 });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmulCpu&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && int8_ == o.int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_;
  int bits_;
  bool int8_;
};

mx::Stream cpu_stream() {
  mx::Stream s = mx::to_stream(std::monostate{});
  if (s.device != mx::Device::cpu) {
    throw std::invalid_argument("mlx_providers cpu kernels: the default device is not the CPU");
  }
  return s;
}

// Checks x against one weight of MLX's affine layout; the output's dtype.
mx::Dtype checked_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                      const mx::array& biases, int group_size, int bits) {
  if (w.ndim() != 2 || x.ndim() < 1 || w.dtype() != mx::uint32) {
    throw std::invalid_argument("quantized_matmul: w must be a 2-D uint32 array");
  }
  const int K = x.shape(-1);
  if (w.shape(1) * 32 / bits != K || scales.shape(-1) * group_size != K ||
      scales.shape(0) != w.shape(0) || biases.shape() != scales.shape()) {
    throw std::invalid_argument("quantized_matmul: shapes do not match");
  }
  if ((bits != 4 && bits != 8) || (group_size != 32 && group_size != 64)) {
    throw std::invalid_argument("quantized_matmul: 4 or 8 bits, groups of 32 or 64");
  }
  dtype_of(x);
  dtype_of(scales);
  if (biases.dtype() != scales.dtype()) {
    throw std::invalid_argument("quantized_matmul: scales and biases must share a dtype");
  }
  return mx::promote_types(x.dtype(), scales.dtype());
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, bool int8) {
  const mx::Dtype out_type = checked_qmm(x, w, scales, biases, group_size, bits);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), out_type,
                   std::make_shared<QuantizedMatmulCpu>(cpu_stream(), group_size, bits, int8),
                   {x, w, scales, biases});
}

// ---- several weights against one x (q/k/v, gate/up) --------------------------------------

// x against each weight of a group sharing K, bits and group size: x staged once, the
// columns of all the weights shared out in one parallel pass. Each column's arithmetic is
// the single-weight kernel's, so every output has the bits run_qmm gives it alone.
void run_qmm_many(const std::vector<mx::array>& in, std::vector<mx::array>& outs, int group,
                  int bits, bool int8) {
  const mx::array& x = in[0];
  const size_t count = outs.size();
  std::vector<uint8_t> xs;
  std::vector<std::vector<uint8_t>> copies(3 * count);
  std::vector<QmmProblem> ps(count);
  std::vector<int> offsets(count + 1, 0);
  QmmProblem base{};
  base.K = x.shape(-1);
  base.M = static_cast<int>(x.size() / base.K);
  base.bits = bits;
  base.group = group;
  base.x_dtype = dtype_of(x);
  if (uniform_rows(x, &base.x_row_stride)) {
    base.x = x.data<void>();
  } else {
    base.x = row_major(x, xs);
    base.x_row_stride = base.K;
  }
  for (size_t i = 0; i < count; i++) {
    QmmProblem& p = ps[i];
    p = base;
    const mx::array& w = in[1 + 3 * i];
    p.N = outs[i].shape(-1);
    p.w = static_cast<const uint8_t*>(row_major(w, copies[3 * i]));
    p.scales = row_major(in[2 + 3 * i], copies[3 * i + 1]);
    p.biases = row_major(in[3 + 3 * i], copies[3 * i + 2]);
    p.s_dtype = dtype_of(in[2 + 3 * i]);
    p.out = outs[i].data<void>();
    p.out_dtype = dtype_of(outs[i]);
    offsets[i + 1] = offsets[i] + p.N;
  }
  const int total = offsets[count];
  if (base.M == 0 || total == 0) {
    return;
  }
  const KernelTable& t = qmm_table(base.K, bits, group, int8);
  const size_t row_bytes = t.qmm_row_bytes(base.K, bits, group);
  uint8_t* buf = scratch(row_bytes * base.M);
  const int row_parts = base.M >= 16 ? split(base.M, 4, 1) : 1;
  const int rows_each = (base.M + row_parts - 1) / row_parts;
  parallel_for(row_parts, [&](int i) {
    const int m0 = i * rows_each;
    const int m1 = m0 + rows_each < base.M ? m0 + rows_each : base.M;
    if (m0 < m1) {
      t.qmm_prepare(ps[0], buf, m0, m1);
    }
  });
  const double work = static_cast<double>(base.M) * total * base.K;
  const int col_parts = split(total, 16, work > 4.0e6 ? 4 : 1);
  const int cols_each = ((total + col_parts - 1) / col_parts + 15) / 16 * 16;
  parallel_for(col_parts, [&](int part) {
    const int c0 = part * cols_each;
    const int c1 = c0 + cols_each < total ? c0 + cols_each : total;
    for (size_t i = 0; i < count && c0 < c1; i++) {
      const int a = c0 > offsets[i] ? c0 : offsets[i];
      const int b = c1 < offsets[i + 1] ? c1 : offsets[i + 1];
      if (a < b) {
        t.qmm_compute(ps[i], buf, a - offsets[i], b - offsets[i]);
      }
    }
  });
}

class QuantizedMatmulManyCpu : public mx::Primitive {
 public:
  QuantizedMatmulManyCpu(mx::Stream stream, int group, int bits, bool int8)
      : mx::Primitive(stream), group_(group), bits_(bits), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs,
                 [group = group_, bits = bits_, int8 = int8_](std::vector<mx::array>& in,
                                                              std::vector<mx::array>& out) {
                   run_qmm_many(in, out, group, bits, int8);
                 });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuQuantizedMatmulMany";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmulManyCpu&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && int8_ == o.int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (size_t i = 1; i < inputs.size(); i += 3) {
      auto shape = inputs[0].shape();
      shape.back() = inputs[i].shape(0);
      shapes.push_back(std::move(shape));
    }
    return shapes;
  }

 private:
  int group_;
  int bits_;
  bool int8_;
};

std::vector<mx::array> quantized_matmul_many(const mx::array& x, const std::vector<mx::array>& ws,
                                             const std::vector<mx::array>& scales,
                                             const std::vector<mx::array>& biases,
                                             int group_size, int bits, bool int8) {
  if (ws.empty() || ws.size() != scales.size() || ws.size() != biases.size()) {
    throw std::invalid_argument("quantized_matmul_many: one scales and biases array per weight");
  }
  std::vector<mx::array> inputs = {x};
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t i = 0; i < ws.size(); i++) {
    dtypes.push_back(checked_qmm(x, ws[i], scales[i], biases[i], group_size, bits));
    auto shape = x.shape();
    shape.back() = ws[i].shape(0);
    shapes.push_back(std::move(shape));
    inputs.push_back(ws[i]);
    inputs.push_back(scales[i]);
    inputs.push_back(biases[i]);
  }
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<QuantizedMatmulManyCpu>(cpu_stream(), group_size,
                                                                         bits, int8),
                                inputs);
}

// ---- attention -----------------------------------------------------------------------------

void run_attention(const std::vector<mx::array>& in, mx::array& out, float scale,
                   int mask_kind) {
  const mx::array& q = in[0];
  const mx::array& k = in[1];
  const mx::array& v = in[2];
  AttentionProblem p{};
  std::vector<uint8_t> copies[3];
  const mx::array* qkv[3] = {&q, &k, &v};
  const void* data[3];
  int64_t* strides[3] = {p.q_strides, p.k_strides, p.v_strides};
  for (int a = 0; a < 3; a++) {
    const mx::array& t = *qkv[a];
    if (t.strides()[3] == 1 || t.shape(3) == 1) {  // walk it by its strides
      data[a] = t.data<void>();
      for (int d = 0; d < 3; d++) {
        strides[a][d] = t.strides()[d];
      }
    } else {  // rows of a head not contiguous: a row-major copy
      data[a] = row_major(t, copies[a]);
      strides[a][2] = t.shape(3);
      strides[a][1] = strides[a][2] * t.shape(2);
      strides[a][0] = strides[a][1] * t.shape(1);
    }
  }
  p.q = data[0];
  p.k = data[1];
  p.v = data[2];
  p.dtype = dtype_of(q);
  p.B = q.shape(0);
  p.Hq = q.shape(1);
  p.Lq = q.shape(2);
  p.D = q.shape(3);
  p.Hkv = k.shape(1);
  p.Lk = k.shape(2);
  p.Dv = v.shape(3);
  p.scale = scale;
  p.mask_kind = mask_kind;
  if (mask_kind >= 2) {
    const mx::array& m = in[3];
    p.mask = m.data<void>();
    const int nd = m.ndim();
    for (int d = 0; d < 4; d++) {
      const int md = d - (4 - nd);  // the mask's axes line up with the last ones
      p.mask_strides[d] = (md < 0 || m.shape(md) == 1) ? 0 : m.strides()[md];
    }
  }
  p.out = out.data<void>();
  const KernelTable& t = best_kernels();
  const size_t work_floats = t.attention_work_floats(p);
  const int items = p.B * p.Hkv * p.Lq;
  const int parts = split(items, 1, 2);
  const int each = (items + parts - 1) / parts;
  parallel_for(parts, [&](int part) {
    float* work = reinterpret_cast<float*>(scratch(work_floats * sizeof(float)));
    const int i0 = part * each;
    const int i1 = i0 + each < items ? i0 + each : items;
    for (int item = i0; item < i1; item++) {
      const int i = item % p.Lq;
      const int g = (item / p.Lq) % p.Hkv;
      const int b = item / (p.Lq * p.Hkv);
      t.attention(p, b, g, i, work);
    }
  });
}

class AttentionCpu : public mx::UnaryPrimitive {
 public:
  AttentionCpu(mx::Stream stream, float scale, int mask_kind)
      : mx::UnaryPrimitive(stream), scale_(scale), mask_kind_(mask_kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out,
                 [scale = scale_, kind = mask_kind_](std::vector<mx::array>& in, mx::array& y) {
                   run_attention(in, y, scale, kind);
                 });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuDecodeAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionCpu&>(other);
    return scale_ == o.scale_ && mask_kind_ == o.mask_kind_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(-1);
    return {shape};
  }

 private:
  float scale_;
  int mask_kind_;
};

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::optional<mx::array>& mask, bool causal) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    throw std::invalid_argument("attention: q, k and v must be 4-D (B, heads, length, dim)");
  }
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    throw std::invalid_argument("attention: q, k and v must share a dtype");
  }
  dtype_of(q);
  const int Hq = q.shape(1);
  const int Hkv = k.shape(1);
  if (Hkv == 0 || Hq % Hkv != 0 || v.shape(1) != Hkv || k.shape(0) != q.shape(0) ||
      v.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) || v.shape(2) != k.shape(2)) {
    throw std::invalid_argument("attention: shapes do not match");
  }
  if (q.shape(3) > 256 || v.shape(3) > 256) {
    throw std::invalid_argument("attention: head dimensions up to 256");
  }
  std::vector<mx::array> inputs = {q, k, v};
  int kind = causal ? 1 : 0;
  if (mask.has_value()) {
    const mx::array& m = *mask;
    if (m.ndim() > 4) {
      throw std::invalid_argument("attention: a mask has at most 4 axes");
    }
    if (m.dtype() == mx::bool_) {
      kind = 2;
    } else if (m.dtype() == mx::float32) {
      kind = 3;
    } else {
      throw std::invalid_argument("attention: the mask must be bool or float32");
    }
    inputs.push_back(m);
  }
  auto shape = q.shape();
  shape.back() = v.shape(3);
  return mx::array(std::move(shape), q.dtype(),
                   std::make_shared<AttentionCpu>(cpu_stream(), scale, kind), std::move(inputs));
}

// ---- attention over a quantized KV cache ---------------------------------------------------

// Where a 4-D array's elements lie for the kernels: its own data, walked by its strides over
// the first three axes, when its last axis is contiguous (a cache's slice of its buffer);
// else a row-major copy.
const void* walkable(const mx::array& t, std::vector<uint8_t>& copy, int64_t strides[3]) {
  if (t.strides()[3] == 1 || t.shape(3) == 1) {
    for (int d = 0; d < 3; d++) {
      strides[d] = t.strides()[d];
    }
    return t.data<void>();
  }
  const void* data = row_major(t, copy);
  strides[2] = t.shape(3);
  strides[1] = strides[2] * t.shape(2);
  strides[0] = strides[1] * t.shape(1);
  return data;
}

// Inputs: q, k packed, k scales, k biases, v packed, v scales, v biases[, mask].
void run_quant_attention(const std::vector<mx::array>& in, mx::array& out, float scale,
                         int mask_kind, int group, int bits) {
  QuantAttentionProblem p{};
  AttentionProblem& a = p.a;
  std::vector<uint8_t> copies[7];
  a.q = walkable(in[0], copies[0], a.q_strides);
  a.k = walkable(in[1], copies[1], a.k_strides);
  p.k_scales = walkable(in[2], copies[2], p.ks_strides);
  p.k_biases = walkable(in[3], copies[3], p.kb_strides);
  a.v = walkable(in[4], copies[4], a.v_strides);
  p.v_scales = walkable(in[5], copies[5], p.vs_strides);
  p.v_biases = walkable(in[6], copies[6], p.vb_strides);
  a.dtype = dtype_of(in[0]);
  p.s_dtype = dtype_of(in[2]);
  a.B = in[0].shape(0);
  a.Hq = in[0].shape(1);
  a.Lq = in[0].shape(2);
  a.D = in[0].shape(3);
  a.Hkv = in[1].shape(1);
  a.Lk = in[1].shape(2);
  a.Dv = in[4].shape(3) * 32 / bits;
  a.scale = scale;
  a.mask_kind = mask_kind;
  if (mask_kind >= 2) {
    const mx::array& m = in[7];
    a.mask = m.data<void>();
    const int nd = m.ndim();
    for (int d = 0; d < 4; d++) {
      const int md = d - (4 - nd);
      a.mask_strides[d] = (md < 0 || m.shape(md) == 1) ? 0 : m.strides()[md];
    }
  }
  a.out = out.data<void>();
  p.bits = bits;
  p.group = group;
  const KernelTable& t = best_kernels();
  const size_t work_floats = t.quant_attention_work_floats(p);
  const int items = a.B * a.Hkv * a.Lq;
  const int parts = split(items, 1, 2);
  const int each = (items + parts - 1) / parts;
  parallel_for(parts, [&](int part) {
    float* work = reinterpret_cast<float*>(scratch(work_floats * sizeof(float)));
    const int i0 = part * each;
    const int i1 = i0 + each < items ? i0 + each : items;
    for (int item = i0; item < i1; item++) {
      const int i = item % a.Lq;
      const int g = (item / a.Lq) % a.Hkv;
      const int b = item / (a.Lq * a.Hkv);
      t.quant_attention(p, b, g, i, work);
    }
  });
}

class QuantAttentionCpu : public mx::UnaryPrimitive {
 public:
  QuantAttentionCpu(mx::Stream stream, float scale, int mask_kind, int group, int bits)
      : mx::UnaryPrimitive(stream), scale_(scale), mask_kind_(mask_kind), group_(group),
        bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out,
                 [scale = scale_, kind = mask_kind_, group = group_, bits = bits_](
                     std::vector<mx::array>& in, mx::array& y) {
                   run_quant_attention(in, y, scale, kind, group, bits);
                 });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuQuantizedKVAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantAttentionCpu&>(other);
    return scale_ == o.scale_ && mask_kind_ == o.mask_kind_ && group_ == o.group_ &&
           bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[4].shape(-1) * 32 / bits_;
    return {shape};
  }

 private:
  float scale_;
  int mask_kind_;
  int group_;
  int bits_;
};

mx::array quantized_attention(const mx::array& q, const mx::array& k, const mx::array& k_scales,
                              const mx::array& k_biases, const mx::array& v,
                              const mx::array& v_scales, const mx::array& v_biases, float scale,
                              int group_size, int bits, const std::optional<mx::array>& mask,
                              bool causal) {
  const char* what = "quantized_attention: ";
  auto fail = [&](const std::string& why) { throw std::invalid_argument(what + why); };
  if (bits != 4 && bits != 8) {
    fail("bits must be 4 or 8");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128");
  }
  const std::vector<const mx::array*> all = {&q, &k, &k_scales, &k_biases, &v, &v_scales,
                                             &v_biases};
  for (const mx::array* t : all) {
    if (t->ndim() != 4) {
      fail("every array must be 4-D (B, heads, length, width)");
    }
  }
  dtype_of(q);
  if (k.dtype() != mx::uint32 || v.dtype() != mx::uint32) {
    fail("packed keys and values must be uint32 (mx.quantize's layout)");
  }
  dtype_of(k_scales);
  if (k_biases.dtype() != k_scales.dtype() || v_scales.dtype() != k_scales.dtype() ||
      v_biases.dtype() != k_scales.dtype()) {
    fail("scales and biases must share a dtype");
  }
  const int B = q.shape(0);
  const int Hq = q.shape(1);
  const int D = q.shape(3);
  const int Hkv = k.shape(1);
  const int Lk = k.shape(2);
  const int per = 32 / bits;
  const int Dv = v.shape(3) * per;
  if (D > 256 || Dv > 256) {
    fail("head dimensions up to 256");
  }
  if (D % group_size != 0 || Dv % group_size != 0 || k.shape(3) * per != D) {
    fail("the packed keys must hold the queries' head size in whole groups");
  }
  if (Hkv == 0 || Hq % Hkv != 0) {
    fail("query heads must be a multiple of the key heads");
  }
  for (const mx::array* t : all) {
    if (t == &q) {
      continue;
    }
    if (t->shape(0) != B || t->shape(1) != Hkv || t->shape(2) != Lk) {
      fail("keys, values, scales and biases must share (B, heads, length)");
    }
  }
  if (k_scales.shape(3) != D / group_size || k_biases.shape(3) != D / group_size ||
      v_scales.shape(3) != Dv / group_size || v_biases.shape(3) != Dv / group_size) {
    fail("one scale and bias a group");
  }
  std::vector<mx::array> inputs = {q, k, k_scales, k_biases, v, v_scales, v_biases};
  int kind = causal ? 1 : 0;
  if (mask.has_value()) {
    const mx::array& m = *mask;
    if (m.ndim() > 4) {
      fail("a mask has at most 4 axes");
    }
    if (m.dtype() == mx::bool_) {
      kind = 2;
    } else if (m.dtype() == mx::float32) {
      kind = 3;
    } else {
      fail("the mask must be bool or float32");
    }
    inputs.push_back(m);
  }
  auto shape = q.shape();
  shape.back() = Dv;
  return mx::array(std::move(shape), q.dtype(),
                   std::make_shared<QuantAttentionCpu>(cpu_stream(), scale, kind, group_size,
                                                       bits),
                   std::move(inputs));
}

// ---- silu(gate) * up -----------------------------------------------------------------------

class SiluMulCpu : public mx::UnaryPrimitive {
 public:
  explicit SiluMulCpu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out, [](std::vector<mx::array>& in, mx::array& out) {
      std::vector<uint8_t> gs, us;
      const void* gp = row_major(in[0], gs);
      const void* up = row_major(in[1], us);
      void* op = out.data<void>();
      const DType t = dtype_of(out);
      const int64_t n = static_cast<int64_t>(out.size());
      const KernelTable& k = best_kernels();
      const int parts = n >= 16384 ? split(static_cast<int>(n / 1024), 1, 1) : 1;
      const int64_t each = ((n + parts - 1) / parts + 15) / 16 * 16;
      parallel_for(parts, [&](int i) {
        const int64_t i0 = i * each;
        const int64_t i1 = i0 + each < n ? i0 + each : n;
        if (i0 < i1) {
          k.silu_mul(gp, up, op, t, i0, i1);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuSiluMul";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

mx::array silu_mul(const mx::array& gate, const mx::array& up) {
  if (gate.shape() != up.shape() || gate.dtype() != up.dtype()) {
    throw std::invalid_argument("silu_mul: gate and up must share shape and dtype");
  }
  dtype_of(gate);
  return mx::array(gate.shape(), gate.dtype(), std::make_shared<SiluMulCpu>(cpu_stream()),
                   {gate, up});
}

// ---- RMSNorm and RoPE ---------------------------------------------------------------------
//
// MLX's CPU backend runs mx.fast.rms_norm and mx.fast.rope as their fallbacks: ~7 and ~20
// small ops each, 90 of these calls a decode step of a 30-layer model, most of a step's
// ops. One op each here, float32, with the fallbacks' formulas.

// x: rows of D floats, each `stride` apart; w: D floats or null.
void rms_norm_rows(const float* x, int64_t stride, const float* w, float* out, int64_t r0,
                   int64_t r1, int D, float eps) {
  const float inv_n = static_cast<float>(1.0 / D);
  for (int64_t r = r0; r < r1; r++) {
    const float* row = x + r * stride;
    float* dst = out + r * D;
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 partial sums: a fixed order that vectorises
    int k = 0;
    for (; k + 8 <= D; k += 8) {
      for (int j = 0; j < 8; j++) {
        part[j] += row[k + j] * row[k + j];
      }
    }
    for (; k < D; k++) {
      part[0] += row[k] * row[k];
    }
    const float sum = ((part[0] + part[1]) + (part[2] + part[3])) +
                      ((part[4] + part[5]) + (part[6] + part[7]));
    const float scale = 1.0f / __builtin_sqrtf(sum * inv_n + eps);
    for (int i = 0; i < D; i++) {
      const float y = row[i] * scale;
      dst[i] = w != nullptr ? y * w[i] : y;
    }
  }
}

class RmsNormCpu : public mx::UnaryPrimitive {
 public:
  RmsNormCpu(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out, [eps = eps_](std::vector<mx::array>& in, mx::array& out) {
      const mx::array& x = in[0];
      const int D = x.shape(-1);
      std::vector<uint8_t> xs, ws;
      int64_t stride = D;
      const float* xp;
      if (uniform_rows(x, &stride)) {
        xp = x.data<float>();
      } else {
        xp = static_cast<const float*>(row_major(x, xs));
        stride = D;
      }
      const float* wp = in.size() > 1 ? static_cast<const float*>(row_major(in[1], ws)) : nullptr;
      float* op = out.data<float>();
      const int64_t rows = D > 0 ? static_cast<int64_t>(x.size() / D) : 0;
      const int parts = rows * D >= (1 << 16) ? split(static_cast<int>(rows), 1, 1) : 1;
      const int64_t each = (rows + parts - 1) / parts;
      parallel_for(parts, [&](int i) {
        const int64_t r0 = i * each;
        const int64_t r1 = r0 + each < rows ? r0 + each : rows;
        if (r0 < r1) {
          rms_norm_rows(xp, stride, wp, op, r0, r1, D, eps);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuRmsNorm";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNormCpu&>(other).eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  if (x.ndim() < 1 || x.dtype() != mx::float32) {
    throw std::invalid_argument("rms_norm: x must be a float32 array of at least 1 axis");
  }
  std::vector<mx::array> inputs = {x};
  if (weight.has_value()) {
    if (weight->ndim() != 1 || weight->size() != static_cast<size_t>(x.shape(-1)) ||
        weight->dtype() != mx::float32) {
      throw std::invalid_argument("rms_norm: weight must be float32 of x's last axis' size");
    }
    inputs.push_back(*weight);
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNormCpu>(cpu_stream(), eps),
                   std::move(inputs));
}

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
  bool has_freqs;
};

// The rotated copy of x (any strides, rows along its last axis) into out (row-major, x's
// shape): positions (t + offset[b]) * scale over axis -2, batch b over axis 0.
void run_rope(const std::vector<mx::array>& in, mx::array& out, const RopeParams& rp) {
  const mx::array& x = in[0];
  const mx::array& offset = in[1];
  const int nd = x.ndim();
  const int D = x.shape(nd - 1);
  const int T = x.shape(nd - 2);
  const int B = x.shape(0);
  const int half = rp.dims / 2;
  std::vector<float> inv_freq(half);
  if (rp.has_freqs) {
    std::vector<uint8_t> fs;
    const float* f = static_cast<const float*>(row_major(in[2], fs));
    for (int i = 0; i < half; i++) {
      inv_freq[i] = 1.0f / f[i];
    }
  } else {
    const float step = __builtin_logf(rp.base) / static_cast<float>(half);
    for (int i = 0; i < half; i++) {
      inv_freq[i] = __builtin_expf(static_cast<float>(-i) * step);
    }
  }
  // cos and sin per (batch, position): every head of a row shares them.
  const int offsets = static_cast<int>(offset.size());
  const int tb = offsets > 1 ? B : 1;
  std::vector<float> cs(static_cast<size_t>(tb) * T * half * 2);
  const int32_t* off = offset.data<int32_t>();
  const int64_t off_stride = offset.ndim() == 1 ? offset.strides()[0] : 0;
  for (int b = 0; b < tb; b++) {
    const float o = static_cast<float>(off[b * off_stride]);
    for (int t = 0; t < T; t++) {
      const float pos = (static_cast<float>(t) + o) * rp.scale;
      float* row = cs.data() + (static_cast<size_t>(b) * T + t) * half * 2;
      for (int i = 0; i < half; i++) {
        const float theta = pos * inv_freq[i];
        row[2 * i] = __builtin_cosf(theta);
        row[2 * i + 1] = __builtin_sinf(theta);
      }
    }
  }
  const float* src = x.data<float>();
  float* dst = out.data<float>();
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  const int64_t rows = static_cast<int64_t>(x.size() / D);
  const int64_t last = strides[nd - 1];
  std::vector<int> index(nd - 1, 0);
  for (int64_t r = 0; r < rows; r++) {
    int64_t at = 0;
    for (int d = 0; d < nd - 1; d++) {
      at += static_cast<int64_t>(index[d]) * strides[d];
    }
    const float* xr = src + at;
    float* yr = dst + r * D;
    const int b = tb > 1 ? index[0] : 0;
    const float* c = cs.data() + (static_cast<size_t>(b) * T + index[nd - 2]) * half * 2;
    for (int i = 0; i < half; i++) {
      const int i1 = rp.traditional ? 2 * i : i;
      const int i2 = rp.traditional ? 2 * i + 1 : i + half;
      const float x1 = xr[i1 * last];
      const float x2 = xr[i2 * last];
      // The fallback's separate products, then the difference (no fused multiply-add).
      const float a = x1 * c[2 * i];
      const float bsin = x2 * c[2 * i + 1];
      yr[i1] = a - bsin;
      const float e = x1 * c[2 * i + 1];
      const float f = x2 * c[2 * i];
      yr[i2] = e + f;
    }
    for (int i = rp.dims; i < D; i++) {
      yr[i] = xr[i * last];
    }
    for (int d = nd - 2; d >= 0; d--) {
      if (++index[d] < shape[d]) {
        break;
      }
      index[d] = 0;
    }
  }
}

class RopeCpu : public mx::UnaryPrimitive {
 public:
  RopeCpu(mx::Stream stream, RopeParams params) : mx::UnaryPrimitive(stream), p_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out, [params = p_](std::vector<mx::array>& in, mx::array& y) {
      run_rope(in, y, params);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuRope";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeCpu&>(other).p_;
    return p_.dims == o.dims && p_.traditional == o.traditional && p_.base == o.base &&
        p_.scale == o.scale && p_.has_freqs == o.has_freqs;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  RopeParams p_;
};

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale,
               const mx::array& offset, const std::optional<mx::array>& freqs) {
  if (x.ndim() < 3 || x.dtype() != mx::float32) {
    throw std::invalid_argument("rope: x must be a float32 array of at least 3 axes");
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument("rope: dims must be even, positive and at most x's last axis");
  }
  if (offset.ndim() > 1 || (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0))) ||
      offset.dtype() != mx::int32) {
    throw std::invalid_argument("rope: offset must be int32, one value or one a batch row");
  }
  std::vector<mx::array> inputs = {x, offset};
  if (freqs.has_value()) {
    if (freqs->ndim() != 1 || freqs->size() != static_cast<size_t>(dims / 2) ||
        freqs->dtype() != mx::float32) {
      throw std::invalid_argument("rope: freqs must be float32 of size dims / 2");
    }
    inputs.push_back(*freqs);
  }
  RopeParams params{dims, traditional, base, scale, freqs.has_value()};
  return mx::array(x.shape(), mx::float32, std::make_shared<RopeCpu>(cpu_stream(), params),
                   std::move(inputs));
}

// Reads an evaluated array's bytes with the pool's threads (what a memory-bound kernel can
// get); the benchmark times it. Returns a checksum so the reads cannot be skipped.
uint64_t read_through(const mx::array& a) {
  const uint64_t* words = reinterpret_cast<const uint64_t*>(a.data<uint8_t>());
  const int64_t n = static_cast<int64_t>(a.nbytes() / 8);
  const int parts = split(static_cast<int>(n / 4096 + 1), 1, 4);
  const int64_t each = (n + parts - 1) / parts;
  std::vector<uint64_t> sums(parts, 0);
  parallel_for(parts, [&](int i) {
    uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t i0 = i * each;
    const int64_t i1 = i0 + each < n ? i0 + each : n;
    int64_t j = i0;
    for (; j + 8 <= i1; j += 8) {
      for (int t = 0; t < 8; t++) {
        acc[t] += words[j + t];
      }
    }
    for (; j < i1; j++) {
      acc[0] += words[j];
    }
    sums[i] = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
  });
  uint64_t total = 0;
  for (uint64_t v : sums) {
    total += v;
  }
  return total;
}

nb::dict info() {
  nb::dict d;
  d["isa"] = std::string(best_kernels().name);
  d["threads"] = pool_threads();
  d["mlx_version"] = std::string(MLX_BUILT_VERSION);
  const KernelTable* int8 = int8_kernels_for(64, 4, 32);
  d["int8"] = std::string(int8 != nullptr ? int8->name : "");
  return d;
}

}  // namespace
}  // namespace mlxp

NB_MODULE(cpu_native, m) {
  m.doc() = "CPU kernels for mlx-providers: quantized matmul and decode attention";
  m.def("quantized_matmul", &mlxp::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "int8"_a = false,
        "x @ dequantize(w).T for MLX's affine 4/8-bit layout, as an op of the graph; int8: "
        "x rounded to int8 blocks where the CPU has the int8 path (info()['int8']).");
  m.def("quantized_matmul_many", &mlxp::quantized_matmul_many, "x"_a, "ws"_a, "scales"_a,
        "biases"_a, "group_size"_a, "bits"_a, "int8"_a = false,
        "x against several weights of one layout in one op: one output per weight, each with "
        "the bits quantized_matmul gives it.");
  m.def("attention", &mlxp::attention, "q"_a, "k"_a, "v"_a, "scale"_a,
        "mask"_a = nb::none(), "causal"_a = false,
        "Fused attention of (B, Hq, Lq, D) queries over (B, Hkv, Lk, D) keys and values.");
  m.def("quantized_attention", &mlxp::quantized_attention, "q"_a, "k"_a, "k_scales"_a,
        "k_biases"_a, "v"_a, "v_scales"_a, "v_biases"_a, "scale"_a, "group_size"_a, "bits"_a,
        "mask"_a = nb::none(), "causal"_a = false,
        "Fused attention of (B, Hq, Lq, D) queries over keys and values kept as mx.quantize's "
        "(packed, scales, biases), read where they lie.");
  m.def("silu_mul", &mlxp::silu_mul, "gate"_a, "up"_a, "silu(gate) * up (mlx-lm's swiglu).");
  m.def("rms_norm", &mlxp::rms_norm, "x"_a, "weight"_a = nb::none(), "eps"_a,
        "mx.fast.rms_norm's formula, float32, as one op.");
  m.def("rope", &mlxp::rope, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a,
        "offset"_a, "freqs"_a = nb::none(),
        "mx.fast.rope's formula (offset: int32, one value or one a batch row), float32, as "
        "one op.");
  m.def("read_through", &mlxp::read_through, "a"_a,
        "Reads an evaluated array's bytes on the kernels' threads (memory bandwidth).");
  m.def("info", &mlxp::info, "The kernel set in use, its threads and the mlx it was built on.");
}
