// Where a decode step's time goes inside the native primitives: per kind, the calls and
// the nanoseconds from a task's start to its end on MLX's stream thread (off unless a
// profiler asks: `python bench/step_profile.py`), and the threads that ran them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace lt::prof {

enum Kind : int { QMATMUL = 0, ROPE, ATTENTION, NORM, DEQUANTIZE, POOL_WAIT, WORKER_CHUNKS, KINDS };
// pool_wait: the calling thread waiting for chunks other threads took (calls: products
// split over threads); worker_chunks: chunks the pool's workers ran (ns unused).
inline const char* const NAMES[KINDS] = {"qmatmul",    "rope",      "attention",    "norm",
                                         "dequantize", "pool_wait", "worker_chunks"};

extern std::atomic<bool> on;
extern std::atomic<int64_t> ns[KINDS], calls[KINDS];
extern std::atomic<int> stream_tid;  // the thread that last ran a primitive's task

int this_tid();  // the OS id of the calling thread (-1 where there is none)

// Adds the scope's time to `kind` while profiling is on.
class Scope {
 public:
  explicit Scope(Kind kind) : kind_(kind), live_(on.load(std::memory_order_relaxed)) {
    if (live_) t0_ = std::chrono::steady_clock::now();
  }
  ~Scope() {
    if (!live_) return;
    auto dt = std::chrono::steady_clock::now() - t0_;
    ns[kind_].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count(),
                        std::memory_order_relaxed);
    calls[kind_].fetch_add(1, std::memory_order_relaxed);
    stream_tid.store(this_tid(), std::memory_order_relaxed);
  }

 private:
  Kind kind_;
  bool live_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace lt::prof
