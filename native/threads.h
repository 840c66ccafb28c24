// A small pool of worker threads for the kernels: the calling thread (MLX's CPU stream
// thread) takes part, workers spin briefly between the many small ops of a decode step,
// then sleep. One caller at a time; a second caller meanwhile runs its tasks alone.
#pragma once

#include <functional>

namespace mlxp {

// Threads the kernels use, the caller included: MLX_PROVIDERS_CPU_THREADS, else the CPUs
// this process may run on.
int pool_threads();

// Runs task(0) .. task(count - 1), spread over the pool; returns when all are done.
void parallel_for(int count, const std::function<void(int)>& task);

}  // namespace mlxp
