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

// An attention kernel's mask kind (0: none, 1: causal, 2: boolean, 3: additive float32);
// `op` names the kernel in the error a mask of another form gets.
int mask_kind(const std::optional<mx::array>& mask, bool causal, const std::string& op) {
  if (!mask.has_value()) {
    return causal ? 1 : 0;
  }
  if (mask->ndim() > 4) {
    throw std::invalid_argument(op + "a mask has at most 4 axes");
  }
  if (mask->dtype() == mx::bool_) {
    return 2;
  }
  if (mask->dtype() == mx::float32) {
    return 3;
  }
  throw std::invalid_argument(op + "the mask must be bool or float32");
}

// Checks q, k, v and the mask for the attention kernel; the mask's kind (mask_kind).
int checked_attention(const mx::array& q, const mx::array& k, const mx::array& v,
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
  return mask_kind(mask, causal, "attention: ");
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::optional<mx::array>& mask, bool causal) {
  const int kind = checked_attention(q, k, v, mask, causal);
  std::vector<mx::array> inputs = {q, k, v};
  if (mask.has_value()) {
    inputs.push_back(*mask);
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
  const int kind = mask_kind(mask, causal, what);
  std::vector<mx::array> inputs = {q, k, k_scales, k_biases, v, v_scales, v_biases};
  if (mask.has_value()) {
    inputs.push_back(*mask);
  }
  auto shape = q.shape();
  shape.back() = Dv;
  return mx::array(std::move(shape), q.dtype(),
                   std::make_shared<QuantAttentionCpu>(cpu_stream(), scale, kind, group_size,
                                                       bits),
                   std::move(inputs));
}

// ---- silu(gate) * up -----------------------------------------------------------------------

// silu(gate) * up into out (out's shape and dtype), threaded over its elements.
void run_silu_mul(const mx::array& gate, const mx::array& up, mx::array& out) {
  std::vector<uint8_t> gs, us;
  const void* gp = row_major(gate, gs);
  const void* upp = row_major(up, us);
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
      k.silu_mul(gp, upp, op, t, i0, i1);
    }
  });
}

class SiluMulCpu : public mx::UnaryPrimitive {
 public:
  explicit SiluMulCpu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out, [](std::vector<mx::array>& in, mx::array& out) {
      run_silu_mul(in[0], in[1], out);
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

// RMSNorm of x's rows (any uniform row stride) into out (row-major); weight may be null.
void run_rms_norm(const mx::array& x, const mx::array* weight, mx::array& out, float eps) {
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
  const float* wp =
      weight != nullptr ? static_cast<const float*>(row_major(*weight, ws)) : nullptr;
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
}

class RmsNormCpu : public mx::UnaryPrimitive {
 public:
  RmsNormCpu(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out, [eps = eps_](std::vector<mx::array>& in, mx::array& out) {
      run_rms_norm(in[0], in.size() > 1 ? &in[1] : nullptr, out, eps);
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

// ---- a decoder layer's decode step, in two ops ---------------------------------------------
//
// A llama-shaped layer at one query a row is ~25 graph nodes (RMSNorm, q/k/v, reshapes,
// RoPE, attention, o, residual, RMSNorm, gate/up, SiLU, down, residual); each costs the
// Python forward, MLX's evaluation and an allocation, a third of a one-row step. Here it is
// two ops around the cache's own update, calling the separate ops' code in their order:
// the same bits.

// How one projection (or sibling group) is quantized.
struct QuantSpec {
  int group;
  int bits;
};

// An evaluated row-major array of its own (an intermediate of a fused op).
mx::array fresh(mx::Shape shape, mx::Dtype dtype = mx::float32) {
  mx::array a(std::move(shape), dtype, nullptr, {});
  a.set_data(mx::allocator::malloc(a.nbytes()));
  return a;
}

// Row-major `a` seen with another shape of the same size (no copy).
mx::array reshaped(const mx::array& a, const mx::Shape& shape) {
  mx::array v(shape, a.dtype(), nullptr, {});
  mx::Strides strides(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; d--) {
    strides[d] = strides[d + 1] * shape[d + 1];
  }
  v.copy_shared_buffer(a, strides, {true, true, false}, a.size());
  return v;
}

// out = a + b elementwise (float32, b row-major, a any layout of out's shape).
void add_into(const mx::array& a, const mx::array& b, mx::array& out) {
  std::vector<uint8_t> as;
  const float* ap = static_cast<const float*>(row_major(a, as));
  const float* bp = b.data<float>();
  float* op = out.data<float>();
  for (size_t i = 0; i < out.size(); i++) {
    op[i] = ap[i] + bp[i];
  }
}

struct QkvParams {
  float eps;
  QuantSpec qkv;
  bool int8;
  int heads;
  int kv_heads;
  int head_dim;
  RopeParams rope;
  bool has_bias;  // q, k and v add a bias after their product (Qwen2)
  bool has_qk_norm;  // q and k take an RMSNorm over each head before RoPE (Qwen3)
  float qk_eps;
};

// out += bias along its last axis (row-major out).
void add_bias(mx::array& out, const mx::array& bias) {
  std::vector<uint8_t> bs;
  const float* b = static_cast<const float*>(row_major(bias, bs));
  float* o = out.data<float>();
  const size_t n = bias.size();
  for (size_t i = 0; i < out.size(); i++) {
    o[i] = o[i] + b[i % n];
  }
}

// inputs: x (B, 1, H), norm weight, (w, scales, biases) for q, k and v, offset, [freqs],
// [q, k and v biases], [q and k norm weights]; outputs: q (B, heads, 1, D) and
// k (B, kv_heads, 1, D) turned, v (B, kv_heads, 1, D).
void run_decode_qkv(const std::vector<mx::array>& in, std::vector<mx::array>& out,
                    const QkvParams& p) {
  const int B = in[0].shape(0);
  const int D = p.head_dim;
  const int heads[2] = {p.heads, p.kv_heads};
  mx::array normed = fresh({B, 1, in[0].shape(-1)});
  run_rms_norm(in[0], &in[1], normed, p.eps);
  std::vector<mx::array> mm_in = {normed};
  mm_in.insert(mm_in.end(), in.begin() + 2, in.begin() + 11);
  std::vector<mx::array> mm_out = {fresh({B, 1, p.heads * D}), fresh({B, 1, p.kv_heads * D}),
                                   reshaped(out[2], {B, 1, p.kv_heads * D})};
  run_qmm_many(mm_in, mm_out, p.qkv.group, p.qkv.bits, p.int8);
  size_t at = p.rope.has_freqs ? 13 : 12;
  if (p.has_bias) {
    for (int i = 0; i < 3; i++) {
      add_bias(mm_out[i], in[at + i]);
    }
    at += 3;
  }
  std::vector<mx::array> rope_in = {mm_out[0], in[11]};
  if (p.rope.has_freqs) {
    rope_in.push_back(in[12]);
  }
  for (int i = 0; i < 2; i++) {
    mx::array turned = mm_out[i];
    if (p.has_qk_norm) {
      turned = fresh({B, 1, heads[i], D});
      run_rms_norm(reshaped(mm_out[i], {B, 1, heads[i], D}), &in[at + i], turned, p.qk_eps);
    }
    rope_in[0] = reshaped(turned, {B, heads[i], 1, D});
    run_rope(rope_in, out[i], p.rope);
  }
}

class DecodeQkvCpu : public mx::Primitive {
 public:
  DecodeQkvCpu(mx::Stream stream, QkvParams params) : mx::Primitive(stream), p_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch_cpu(stream(), inputs, outputs,
                 [p = p_](std::vector<mx::array>& in, std::vector<mx::array>& out) {
                   run_decode_qkv(in, out, p);
                 });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuDecodeQkv";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeQkvCpu&>(other).p_;
    return p_.eps == o.eps && p_.qkv.group == o.qkv.group && p_.qkv.bits == o.qkv.bits &&
        p_.int8 == o.int8 && p_.heads == o.heads && p_.kv_heads == o.kv_heads &&
        p_.head_dim == o.head_dim && p_.rope.dims == o.rope.dims &&
        p_.rope.traditional == o.rope.traditional && p_.rope.base == o.rope.base &&
        p_.rope.scale == o.rope.scale && p_.rope.has_freqs == o.rope.has_freqs &&
        p_.has_bias == o.has_bias && p_.has_qk_norm == o.has_qk_norm && p_.qk_eps == o.qk_eps;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int B = inputs[0].shape(0);
    return {{B, p_.heads, 1, p_.head_dim}, {B, p_.kv_heads, 1, p_.head_dim},
            {B, p_.kv_heads, 1, p_.head_dim}};
  }

 private:
  QkvParams p_;
};

std::vector<mx::array> decode_qkv(const mx::array& x, const mx::array& norm_weight, float eps,
                                  const std::vector<mx::array>& ws,
                                  const std::vector<mx::array>& scales,
                                  const std::vector<mx::array>& biases, int group_size, int bits,
                                  bool int8, int heads, int kv_heads, int rope_dims,
                                  bool traditional, float base, float rope_scale,
                                  const mx::array& offset, const std::optional<mx::array>& freqs,
                                  const std::vector<mx::array>& qkv_bias,
                                  const std::vector<mx::array>& qk_norm, float qk_eps) {
  if (x.ndim() != 3 || x.shape(1) != 1 || x.dtype() != mx::float32) {
    throw std::invalid_argument("decode_qkv: x must be float32 (B, 1, hidden)");
  }
  if (ws.size() != 3 || scales.size() != 3 || biases.size() != 3 || heads <= 0 ||
      kv_heads <= 0 || heads % kv_heads != 0) {
    throw std::invalid_argument("decode_qkv: q, k and v weights, heads a multiple of kv_heads");
  }
  const int D = ws[0].shape(0) / heads;
  if (D * heads != ws[0].shape(0) || ws[1].shape(0) != kv_heads * D ||
      ws[2].shape(0) != kv_heads * D || D > 256) {
    throw std::invalid_argument("decode_qkv: projection sizes do not match the heads");
  }
  if (norm_weight.ndim() != 1 || norm_weight.size() != static_cast<size_t>(x.shape(-1)) ||
      norm_weight.dtype() != mx::float32) {
    throw std::invalid_argument("decode_qkv: the norm weight must be float32 of x's width");
  }
  for (int i = 0; i < 3; i++) {
    if (checked_qmm(x, ws[i], scales[i], biases[i], group_size, bits) != mx::float32) {
      throw std::invalid_argument("decode_qkv: the projections must give float32");
    }
  }
  if (rope_dims <= 0 || rope_dims % 2 != 0 || rope_dims > D || offset.dtype() != mx::int32 ||
      offset.ndim() > 1 || (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0)))) {
    throw std::invalid_argument("decode_qkv: rope dims even and at most the head's; offset int32");
  }
  std::vector<mx::array> inputs = {x, norm_weight};
  for (int i = 0; i < 3; i++) {
    inputs.push_back(ws[i]);
    inputs.push_back(scales[i]);
    inputs.push_back(biases[i]);
  }
  inputs.push_back(offset);
  if (freqs.has_value()) {
    if (freqs->ndim() != 1 || freqs->size() != static_cast<size_t>(rope_dims / 2) ||
        freqs->dtype() != mx::float32) {
      throw std::invalid_argument("decode_qkv: freqs must be float32 of size rope_dims / 2");
    }
    inputs.push_back(*freqs);
  }
  if (!qkv_bias.empty()) {
    if (qkv_bias.size() != 3) {
      throw std::invalid_argument("decode_qkv: a bias for each of q, k and v, or none");
    }
    for (int i = 0; i < 3; i++) {
      if (qkv_bias[i].ndim() != 1 || qkv_bias[i].size() != static_cast<size_t>(ws[i].shape(0)) ||
          qkv_bias[i].dtype() != mx::float32) {
        throw std::invalid_argument("decode_qkv: each bias float32 of its projection's width");
      }
      inputs.push_back(qkv_bias[i]);
    }
  }
  if (!qk_norm.empty()) {
    if (qk_norm.size() != 2) {
      throw std::invalid_argument("decode_qkv: a norm weight for each of q and k, or none");
    }
    for (const auto& w : qk_norm) {
      if (w.ndim() != 1 || w.size() != static_cast<size_t>(D) || w.dtype() != mx::float32) {
        throw std::invalid_argument("decode_qkv: q and k norm weights float32 of the head's width");
      }
      inputs.push_back(w);
    }
  }
  QkvParams p{eps, {group_size, bits}, int8, heads, kv_heads, D,
              {rope_dims, traditional, base, rope_scale, freqs.has_value()},
              !qkv_bias.empty(), !qk_norm.empty(), qk_eps};
  const int B = x.shape(0);
  return mx::array::make_arrays({{B, heads, 1, D}, {B, kv_heads, 1, D}, {B, kv_heads, 1, D}},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<DecodeQkvCpu>(cpu_stream(), p),
                                std::move(inputs));
}

struct RestParams {
  float scale;
  int mask_kind;
  float eps;
  QuantSpec o;
  QuantSpec gate_up;
  QuantSpec down;
  bool int8;
};

// inputs: q (B, Hq, 1, D), keys, values (B, Hkv, S, ·), x (B, 1, H): the layer's input,
// (w, scales, biases) for o, the second norm's weight, (w, scales, biases) for gate, up
// and down, [mask]; output: the layer's output (B, 1, H).
void run_decode_rest(const std::vector<mx::array>& in, mx::array& out, const RestParams& p) {
  const int B = in[0].shape(0);
  const int Hq = in[0].shape(1);
  const int Dv = in[2].shape(3);
  const int H = in[3].shape(-1);
  const int F = in[8].shape(0);
  mx::array attended = fresh({B, Hq, 1, Dv});
  std::vector<mx::array> attn_in = {in[0], in[1], in[2]};
  if (p.mask_kind >= 2) {
    attn_in.push_back(in[17]);
  }
  run_attention(attn_in, attended, p.scale, p.mask_kind);
  mx::array projected = fresh({B, 1, H});
  run_qmm(reshaped(attended, {B, 1, Hq * Dv}), in[4], in[5], in[6], projected, p.o.group,
          p.o.bits, p.int8);
  mx::array mid = fresh({B, 1, H});
  add_into(in[3], projected, mid);
  mx::array normed = fresh({B, 1, H});
  run_rms_norm(mid, &in[7], normed, p.eps);
  std::vector<mx::array> mm_in = {normed, in[8], in[9], in[10], in[11], in[12], in[13]};
  std::vector<mx::array> mm_out = {fresh({B, 1, F}), fresh({B, 1, F})};
  run_qmm_many(mm_in, mm_out, p.gate_up.group, p.gate_up.bits, p.int8);
  mx::array activated = fresh({B, 1, F});
  run_silu_mul(mm_out[0], mm_out[1], activated);
  mx::array down = fresh({B, 1, H});
  run_qmm(activated, in[14], in[15], in[16], down, p.down.group, p.down.bits, p.int8);
  add_into(mid, down, out);
}

class DecodeRestCpu : public mx::UnaryPrimitive {
 public:
  DecodeRestCpu(mx::Stream stream, RestParams params) : mx::UnaryPrimitive(stream), p_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_cpu(stream(), inputs, out, [p = p_](std::vector<mx::array>& in, mx::array& y) {
      run_decode_rest(in, y, p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuDecodeRest";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeRestCpu&>(other).p_;
    return p_.scale == o.scale && p_.mask_kind == o.mask_kind && p_.eps == o.eps &&
        p_.o.group == o.o.group && p_.o.bits == o.o.bits && p_.gate_up.group == o.gate_up.group &&
        p_.gate_up.bits == o.gate_up.bits && p_.down.group == o.down.group &&
        p_.down.bits == o.down.bits && p_.int8 == o.int8;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[3].shape()};
  }

 private:
  RestParams p_;
};

mx::array decode_rest(const mx::array& q, const mx::array& keys, const mx::array& values,
                      float scale, const std::optional<mx::array>& mask, bool causal,
                      const mx::array& x, const std::vector<mx::array>& o_proj, int o_group,
                      int o_bits, const mx::array& norm_weight, float eps,
                      const std::vector<mx::array>& gate, const std::vector<mx::array>& up,
                      int gate_up_group, int gate_up_bits, const std::vector<mx::array>& down,
                      int down_group, int down_bits, bool int8) {
  if (x.ndim() != 3 || x.shape(1) != 1 || x.dtype() != mx::float32 || q.ndim() != 4 ||
      q.shape(2) != 1 || q.shape(0) != x.shape(0) || q.dtype() != mx::float32) {
    throw std::invalid_argument("decode_rest: x float32 (B, 1, hidden), q (B, heads, 1, D)");
  }
  if (o_proj.size() != 3 || gate.size() != 3 || up.size() != 3 || down.size() != 3) {
    throw std::invalid_argument("decode_rest: (w, scales, biases) for o, gate, up and down");
  }
  const mx::array attended({q.shape(0), 1, q.shape(1) * values.shape(-1)}, mx::float32,
                           nullptr, {});
  const mx::array hidden({x.shape(0), 1, gate[0].shape(0)}, mx::float32, nullptr, {});
  if (checked_qmm(attended, o_proj[0], o_proj[1], o_proj[2], o_group, o_bits) != mx::float32 ||
      o_proj[0].shape(0) != x.shape(-1) ||
      checked_qmm(x, gate[0], gate[1], gate[2], gate_up_group, gate_up_bits) != mx::float32 ||
      checked_qmm(x, up[0], up[1], up[2], gate_up_group, gate_up_bits) != mx::float32 ||
      up[0].shape(0) != gate[0].shape(0) ||
      checked_qmm(hidden, down[0], down[1], down[2], down_group, down_bits) != mx::float32 ||
      down[0].shape(0) != x.shape(-1)) {
    throw std::invalid_argument("decode_rest: projections that do not fit the layer");
  }
  if (norm_weight.ndim() != 1 || norm_weight.size() != static_cast<size_t>(x.shape(-1)) ||
      norm_weight.dtype() != mx::float32) {
    throw std::invalid_argument("decode_rest: the norm weight must be float32 of x's width");
  }
  const int kind = checked_attention(q, keys, values, mask, causal);
  std::vector<mx::array> inputs = {q, keys, values, x};
  inputs.insert(inputs.end(), o_proj.begin(), o_proj.end());
  inputs.push_back(norm_weight);
  inputs.insert(inputs.end(), gate.begin(), gate.end());
  inputs.insert(inputs.end(), up.begin(), up.end());
  inputs.insert(inputs.end(), down.begin(), down.end());
  if (mask.has_value()) {
    inputs.push_back(*mask);
  }
  RestParams p{scale, kind, eps, {o_group, o_bits}, {gate_up_group, gate_up_bits},
               {down_group, down_bits}, int8};
  return mx::array(x.shape(), mx::float32, std::make_shared<DecodeRestCpu>(cpu_stream(), p),
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
  m.def("decode_qkv", &mlxp::decode_qkv, "x"_a, "norm_weight"_a, "eps"_a, "ws"_a, "scales"_a,
        "biases"_a, "group_size"_a, "bits"_a, "int8"_a, "heads"_a, "kv_heads"_a, "rope_dims"_a,
        "traditional"_a, "base"_a, "rope_scale"_a, "offset"_a, "freqs"_a = nb::none(),
        "qkv_bias"_a = std::vector<mx::array>(), "qk_norm"_a = std::vector<mx::array>(),
        "qk_eps"_a = 0.0f,
        "A decoder layer's first half at one query a row: RMSNorm, the q/k/v products (and "
        "biases), the q/k norms and RoPE as one op; (q, k, v) as (B, heads, 1, D).");
  m.def("decode_rest", &mlxp::decode_rest, "q"_a, "keys"_a, "values"_a, "scale"_a, "mask"_a,
        "causal"_a, "x"_a, "o_proj"_a, "o_group"_a, "o_bits"_a, "norm_weight"_a, "eps"_a,
        "gate"_a, "up"_a, "gate_up_group"_a, "gate_up_bits"_a, "down"_a, "down_group"_a,
        "down_bits"_a, "int8"_a,
        "A decoder layer's second half at one query a row: attention over the cache, the "
        "o product, the residual, RMSNorm, gate/up, SiLU, down and the residual as one op.");
  m.def("read_through", &mlxp::read_through, "a"_a,
        "Reads an evaluated array's bytes on the kernels' threads (memory bandwidth).");
  m.def("info", &mlxp::info, "The kernel set in use, its threads and the mlx it was built on.");
}
