// Which kernel table this CPU runs, chosen once.
#pragma once

#include "kernels.h"

namespace mlxp {

// The best table this CPU supports, or a lower one named by MLX_PROVIDERS_CPU_ISA
// (generic, avx2, avx512, neon) when the CPU supports that one too.
const KernelTable& best_kernels();

// The table that takes a matmul of this shape: the best one, else the next one down.
const KernelTable& kernels_for(int K, int bits, int group);

// The int8-activation matmul for this shape, or null where the CPU lacks it.
const KernelTable* int8_kernels_for(int K, int bits, int group);

}  // namespace mlxp
