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

void run_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
             const mx::array& biases, mx::array& out, int group, int bits) {
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
  const KernelTable& t = kernels_for(p.K, bits, group);
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

class QuantizedMatmulCpu : public mx::UnaryPrimitive {
 public:
  QuantizedMatmulCpu(mx::Stream stream, int group, int bits)
      : mx::UnaryPrimitive(stream), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
    }
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                      w = mx::array::unsafe_weak_copy(inputs[1]),
                      s = mx::array::unsafe_weak_copy(inputs[2]),
                      b = mx::array::unsafe_weak_copy(inputs[3]),
                      out = mx::array::unsafe_weak_copy(out), group = group_,
                      bits = bits_]() mutable { run_qmm(x, w, s, b, out, group, bits); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlx_providers cpu kernels run on the CPU only");
  }

  const char* name() const override {
    return "CpuQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmulCpu&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_;
  int bits_;
};

mx::Stream cpu_stream() {
  mx::Stream s = mx::to_stream(std::monostate{});
  if (s.device != mx::Device::cpu) {
    throw std::invalid_argument("mlx_providers cpu kernels: the default device is not the CPU");
  }
  return s;
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
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
  auto shape = x.shape();
  shape.back() = w.shape(0);
  const mx::Dtype out_type = mx::promote_types(x.dtype(), scales.dtype());
  return mx::array(std::move(shape), out_type,
                   std::make_shared<QuantizedMatmulCpu>(cpu_stream(), group_size, bits),
                   {x, w, scales, biases});
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
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> weak;
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
      weak.push_back(mx::array::unsafe_weak_copy(a));
    }
    encoder.set_output_array(out);
    encoder.dispatch([in = std::move(weak), out = mx::array::unsafe_weak_copy(out),
                      scale = scale_, kind = mask_kind_]() mutable {
      run_attention(in, out, scale, kind);
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

// ---- silu(gate) * up -----------------------------------------------------------------------

class SiluMulCpu : public mx::UnaryPrimitive {
 public:
  explicit SiluMulCpu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_input_array(inputs[1]);
    encoder.set_output_array(out);
    encoder.dispatch([g = mx::array::unsafe_weak_copy(inputs[0]),
                      u = mx::array::unsafe_weak_copy(inputs[1]),
                      out = mx::array::unsafe_weak_copy(out)]() mutable {
      std::vector<uint8_t> gs, us;
      const void* gp = row_major(g, gs);
      const void* up = row_major(u, us);
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
  return d;
}

}  // namespace
}  // namespace mlxp

NB_MODULE(cpu_native, m) {
  m.doc() = "CPU kernels for mlx-providers: quantized matmul and decode attention";
  m.def("quantized_matmul", &mlxp::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x @ dequantize(w).T for MLX's affine 4/8-bit layout, as an op of the graph.");
  m.def("attention", &mlxp::attention, "q"_a, "k"_a, "v"_a, "scale"_a,
        "mask"_a = nb::none(), "causal"_a = false,
        "Fused attention of (B, Hq, Lq, D) queries over (B, Hkv, Lk, D) keys and values.");
  m.def("silu_mul", &mlxp::silu_mul, "gate"_a, "up"_a, "silu(gate) * up (mlx-lm's swiglu).");
  m.def("read_through", &mlxp::read_through, "a"_a,
        "Reads an evaluated array's bytes on the kernels' threads (memory bandwidth).");
  m.def("info", &mlxp::info, "The kernel set in use, its threads and the mlx it was built on.");
}
