// The scalar kernels: any CPU, and the fallback for shapes the SIMD units do not take.
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace mlxp {
namespace {

#include "portable.h"

bool supports(int K, int bits, int group) {
  return (bits == 4 || bits == 8) && (group == 32 || group == 64) && K % group == 0;
}

size_t row_bytes(int K, int bits, int group) {
  (void)bits;
  (void)group;
  return GenericX::row_bytes(K);
}

const KernelTable table = {
    "generic",        supports,       row_bytes,      GenericX::prepare,
    generic_compute,  attention_item, attention_work, silu_mul,
    quant_attention_item, quant_attention_work,
};

}  // namespace

const KernelTable* kernels_generic() {
  return &table;
}

}  // namespace mlxp
