// A persistent thread pool for the row split: the caller and `threads - 1` workers take
// chunks of one job until none are left. Workers spin for a while after each job (the
// next product follows within microseconds during generation), then sleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace lt {

class Pool {
 public:
  typedef void (*Fn)(void* ctx, int chunk);
  static Pool& get();
  ~Pool();
  // Workers = n - 1 (n >= 1); joins the old ones first.
  void set_threads(int n);
  int threads() const { return (int)workers_.size() + 1; }
  // The workers' OS thread ids (for profiles; empty where the OS has none).
  std::vector<int> worker_tids();
  // fn(ctx, i) for every i in [0, n), on the calling thread and the workers; returns
  // when all are done.
  void run(int n, Fn fn, void* ctx);

 private:
  int work(uint64_t gen);  // chunks this thread ran
  void loop();
  void stop_workers();

  // One word for claims: generation (20 bits), chunk count (22), next chunk (22), so that
  // a worker late from an earlier job can never take a chunk of the next one.
  std::atomic<uint64_t> word_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  Fn fn_[2] = {nullptr, nullptr};  // by generation parity: job g + 1 never overwrites g's
  void* ctx_[2] = {nullptr, nullptr};
  std::vector<std::thread> workers_;
  std::vector<int> tids_;
  std::mutex sleep_mutex_, run_mutex_;
  std::condition_variable wake_;
};

}  // namespace lt
