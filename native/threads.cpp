#include "threads.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXP_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define MLXP_PAUSE() asm volatile("yield")
#else
#define MLXP_PAUSE() ((void)0)
#endif

namespace mlxp {
namespace {

int detect_threads() {
  if (const char* env = std::getenv("MLX_PROVIDERS_CPU_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) {
      return n;
    }
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) {
      return n;
    }
  }
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

// Spinning this long after a job keeps a worker ready for the next op of the same step
// (ops come microseconds apart) without holding a core through Python's work between steps.
constexpr auto SPIN = std::chrono::microseconds(100);
constexpr int SOLO_OPS = 512;  // about two decode steps of a small model

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int i = 1; i < threads_; i++) {
      workers_.emplace_back([this] { work(); });
    }
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
  }

  int threads() const {
    return threads_;
  }

  void run(int count, const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock() || threads_ == 1 || count == 1 || solo_ > 0) {
      if (busy.owns_lock() && solo_ > 0) {
        solo_--;
      }
      for (int i = 0; i < count; i++) {
        task(i);
      }
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      count_ = count;
      next_.store(0);
      done_.store(0);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    const auto started = std::chrono::steady_clock::now();
    drain(&task, count);
    const auto drained = std::chrono::steady_clock::now();
    while (done_.load(std::memory_order_acquire) < count) {
      MLXP_PAUSE();
    }
    judge(drained - started, std::chrono::steady_clock::now() - drained);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = nullptr;
    }
    // A worker that picked this job up may still be leaving drain(); the next job resets
    // the counters it reads, so wait for it.
    while (active_.load(std::memory_order_acquire) > 0) {
      MLXP_PAUSE();
    }
  }

 private:
  // On a machine busy with other work a worker is often descheduled in the middle of its
  // share, and the caller waits a whole time slice for it, op after op. When the caller
  // keeps waiting longer than it worked, run alone for a while, then try again.
  void judge(std::chrono::steady_clock::duration worked,
             std::chrono::steady_clock::duration waited) {
    if (waited > worked + std::chrono::microseconds(100)) {
      if (++strikes_ >= 3) {
        strikes_ = 0;
        solo_ = SOLO_OPS;
      }
    } else if (strikes_ > 0) {
      strikes_--;
    }
  }

  void drain(const std::function<void(int)>* task, int count) {
    int i;
    while ((i = next_.fetch_add(1)) < count) {
      (*task)(i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void work() {
    unsigned seen = generation_.load();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + SPIN;
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen &&
           std::chrono::steady_clock::now() < until; spins++) {
        MLXP_PAUSE();
        if (spins % 64 == 63) {
          std::this_thread::yield();  // a busy machine's other work gets the core
        }
      }
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      if (stop_) {
        return;
      }
      if (task_ == nullptr) {
        continue;
      }
      const std::function<void(int)>* task = task_;
      const int count = count_;
      active_.fetch_add(1);
      lock.unlock();
      drain(task, count);
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::mutex run_mutex_;
  std::condition_variable wake_;
  std::atomic<unsigned> generation_{0};
  std::atomic<int> next_{0};
  std::atomic<int> done_{0};
  std::atomic<int> active_{0};
  const std::function<void(int)>* task_ = nullptr;
  int strikes_ = 0;  // recent ops whose caller waited on a late worker (under run_mutex_)
  int solo_ = 0;  // ops still to run on the caller alone
  int count_ = 0;
  bool stop_ = false;
};

Pool& pool() {
  // Never destroyed: joining threads from a static destructor at exit can hang.
  static Pool* instance = new Pool(detect_threads());
  return *instance;
}

}  // namespace

int pool_threads() {
  return pool().threads();
}

void parallel_for(int count, const std::function<void(int)>& task) {
  if (count <= 0) {
    return;
  }
  pool().run(count, task);
}

}  // namespace mlxp
