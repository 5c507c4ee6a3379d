#include "matmul.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "pool.h"

namespace lt {

namespace {

struct Job {
  RowsFn fn;
  const Matrix* w;
  const std::vector<XRow>* xs;
  int N, chunk;
  float* y;
};

void run_chunk(void* ctx, int i) {
  const Job& j = *static_cast<const Job*>(ctx);
  int r0 = i * j.chunk, r1 = std::min(j.N, r0 + j.chunk);
  // every activation row against this chunk's rows: the chunk's weights are read from
  // memory once and from cache for the other rows
  for (size_t b = 0; b < j.xs->size(); b++) j.fn(*j.w, (*j.xs)[b], r0, r1, j.y + b * j.N + r0);
}

}  // namespace

void matmul(const Kernels& k, const Matrix& w, int N, const float* x, int B, int n, int lead,
            float* y) {
  thread_local std::vector<int16_t> q;
  thread_local std::vector<float> d, m, dm;
  const int K = w.k;
  q.resize((size_t)B * K);
  d.resize((size_t)B * K / 32);
  m.resize((size_t)B * K / 16);
  dm.resize((size_t)B * K / 16);
  int order = order_of(w.format) | (k.paired[slot(w.format)] ? PAIRED : 0);
  std::vector<XRow> xs(B);
  for (int b = 0; b < B; b++) {
    int16_t* qb = q.data() + (size_t)b * K;
    float* db = d.data() + (size_t)b * K / 32;
    float* mb = m.data() + (size_t)b * K / 16;
    float* dmb = dm.data() + (size_t)b * K / 16;
    quantize_row(x + (size_t)b * n, n, lead, K, order, qb, db, mb, dmb);
    xs[b] = {qb, db, mb, dmb};
  }
  Pool& pool = Pool::get();
  int threads = pool.threads();
  // About 4 chunks per thread (uneven cores, other work), each at least 16 rows.
  int chunk = std::max(16, (N + 4 * threads - 1) / (4 * threads));
  chunk = (chunk + 3) / 4 * 4;
  Job job{rows_fn(k, w.format), &w, &xs, N, chunk, y};
  pool.run((N + chunk - 1) / chunk, run_chunk, &job);
}

namespace {

struct Read {
  const uint64_t* data;
  size_t words_per_chunk, words;
  std::vector<uint64_t>* sums;
};

void read_chunk(void* ctx, int i) {
  const Read& r = *static_cast<const Read*>(ctx);
  size_t a = i * r.words_per_chunk, b = std::min(r.words, a + r.words_per_chunk);
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // the compiler vectorizes these sums
  for (size_t j = a; j + 4 <= b; j += 4) {
    s0 += r.data[j];
    s1 += r.data[j + 1];
    s2 += r.data[j + 2];
    s3 += r.data[j + 3];
  }
  (*r.sums)[i] = s0 + s1 + s2 + s3;  // kept, so that the reads are not optimized away
}

}  // namespace

double read_bandwidth(size_t bytes, int reps) {
  std::vector<uint64_t> buf(bytes / 8);
  std::memset(buf.data(), 1, buf.size() * 8);
  Pool& pool = Pool::get();
  int chunks = 64 * pool.threads();
  std::vector<uint64_t> sums(chunks);
  Read r{buf.data(), (buf.size() + chunks - 1) / chunks, buf.size(), &sums};
  pool.run(chunks, read_chunk, &r);  // warm: pages touched, threads awake
  double best = 0;
  for (int i = 0; i < reps; i++) {
    auto t0 = std::chrono::steady_clock::now();
    pool.run(chunks, read_chunk, &r);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, buf.size() * 8 / s / 1e9);
  }
  return best;
}

}  // namespace lt
