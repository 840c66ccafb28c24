#include "dispatch.h"

#include <cstdlib>
#include <cstring>


namespace mlxp {
namespace {

bool cpu_has_avx512() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // libgcc's checks include the OS saving the zmm and mask registers (XCR0).
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool cpu_has_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// Best first; every entry the CPU can run.
struct Ladder {
  const KernelTable* tables[4] = {nullptr, nullptr, nullptr, nullptr};
  int count = 0;
  void add(const KernelTable* t) {
    if (t != nullptr) {
      tables[count++] = t;
    }
  }
};

Ladder build_ladder() {
  Ladder all;
  if (cpu_has_avx512()) {
    all.add(kernels_avx512());
  }
  if (cpu_has_avx2()) {
    all.add(kernels_avx2());
  }
  all.add(kernels_neon());  // null off aarch64; NEON is baseline there
  all.add(kernels_generic());
  const char* wanted = std::getenv("MLX_PROVIDERS_CPU_ISA");
  if (wanted == nullptr || *wanted == '\0') {
    return all;
  }
  Ladder from;  // start the ladder at the named table
  bool found = false;
  for (int i = 0; i < all.count; i++) {
    found = found || std::strcmp(all.tables[i]->name, wanted) == 0;
    if (found) {
      from.add(all.tables[i]);
    }
  }
  return found ? from : all;
}

const Ladder& ladder() {
  static const Ladder instance = build_ladder();
  return instance;
}

}  // namespace

const KernelTable& best_kernels() {
  return *ladder().tables[0];
}

const KernelTable& kernels_for(int K, int bits, int group) {
  const Ladder& l = ladder();
  for (int i = 0; i < l.count; i++) {
    if (l.tables[i]->qmm_supports(K, bits, group)) {
      return *l.tables[i];
    }
  }
  return *l.tables[l.count - 1];
}

const KernelTable* int8_kernels_for(int K, int bits, int group) {
  // Off where MLX_PROVIDERS_CPU_ISA caps the ladder below AVX-512.
  static const KernelTable* const vnni =
      cpu_has_avx512_vnni() && std::strcmp(best_kernels().name, "avx512") == 0
          ? kernels_avx512_vnni()
          : nullptr;
  return vnni != nullptr && vnni->qmm_supports(K, bits, group) ? vnni : nullptr;
}

}  // namespace mlxp
