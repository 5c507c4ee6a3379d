#include "pool.h"

#include <chrono>

#include "profile.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LT_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define LT_PAUSE() asm volatile("yield")
#else
#define LT_PAUSE() ((void)0)
#endif

namespace lt {

namespace {
constexpr int GEN_SHIFT = 44, N_SHIFT = 22;
constexpr uint64_t MASK22 = (1u << 22) - 1;
inline uint64_t gen_of(uint64_t w) { return w >> GEN_SHIFT; }
inline int n_of(uint64_t w) { return (int)((w >> N_SHIFT) & MASK22); }
inline int next_of(uint64_t w) { return (int)(w & MASK22); }
// How long an idle worker spins before it sleeps: longer than the gap between two
// products of one generation step, short enough not to hold a core between requests.
// Past YIELD it spins with sched_yield, so that a busy machine's other work (or a rank's
// own main thread) gets the core when it needs it.
constexpr auto SPIN = std::chrono::milliseconds(2);
constexpr auto YIELD = std::chrono::microseconds(50);
}  // namespace

Pool& Pool::get() {
  static Pool pool;
  return pool;
}

Pool::~Pool() { stop_workers(); }

void Pool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
  tids_.clear();
  stop_ = false;
}

void Pool::set_threads(int n) {
  std::lock_guard<std::mutex> lock(run_mutex_);
  if (n < 1) n = 1;
  if (n == threads()) return;
  stop_workers();
  for (int i = 1; i < n; i++) workers_.emplace_back([this] { loop(); });
}

int Pool::work(uint64_t gen) {
  uint64_t w = word_.load();
  int ran = 0;
  while (gen_of(w) == gen && next_of(w) < n_of(w)) {
    if (!word_.compare_exchange_weak(w, w + 1)) continue;  // w reloaded
    int i = next_of(w);
    fn_[gen & 1](ctx_[gen & 1], i);
    done_.fetch_add(1);
    ran++;
    w = word_.load();
  }
  return ran;
}

std::vector<int> Pool::worker_tids() {
  std::lock_guard<std::mutex> lock(sleep_mutex_);
  return tids_;
}

void Pool::loop() {
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    int tid = prof::this_tid();
    if (tid >= 0) tids_.push_back(tid);
  }
  uint64_t seen = gen_of(word_.load());
  while (true) {
    auto start = std::chrono::steady_clock::now();
    uint64_t gen;
    for (int i = 0;; i++) {
      gen = gen_of(word_.load());
      if (gen != seen || stop_) break;
      auto waited = std::chrono::steady_clock::now() - start;
      if ((i & 255) == 255 && waited > SPIN) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_++;
        wake_.wait(lock, [&] { return gen_of(word_.load()) != seen || stop_; });
        sleepers_--;
        gen = gen_of(word_.load());
        break;
      }
      if (waited > YIELD) {
        std::this_thread::yield();
      } else {
        LT_PAUSE();
      }
    }
    if (stop_) return;
    seen = gen;
    int ran = work(gen);
    if (ran && prof::on.load(std::memory_order_relaxed))
      prof::calls[prof::WORKER_CHUNKS].fetch_add(ran, std::memory_order_relaxed);
  }
}

void Pool::run(int n, Fn fn, void* ctx) {
  std::lock_guard<std::mutex> lock(run_mutex_);
  if (workers_.empty() || n <= 1) {
    for (int i = 0; i < n; i++) fn(ctx, i);
    return;
  }
  uint64_t gen = (gen_of(word_.load()) + 1) & ((1u << 20) - 1);
  fn_[gen & 1] = fn;
  ctx_[gen & 1] = ctx;
  done_.store(0);
  word_.store(gen << GEN_SHIFT | (uint64_t)n << N_SHIFT);  // seq_cst: pairs with sleepers_
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> wake_lock(sleep_mutex_);
    wake_.notify_all();
  }
  work(gen);
  // the last chunks are in other threads' hands: spin briefly, then yield the core (one
  // of them may be waiting for it on a busy machine)
  prof::Scope waited(prof::POOL_WAIT);
  for (int i = 0; done_.load() < n; i++) {
    if (i < 2000) {
      LT_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace lt
