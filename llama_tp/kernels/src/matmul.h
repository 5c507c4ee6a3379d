// The whole product: quantize the activations once, split the rows over the pool.
#pragma once

#include "qmv.h"

namespace lt {

// y (B, N) = x (B, n) W^T over the N rows of `w`, computed by `k`'s kernels on the pool's
// threads. x's values sit at columns [lead, lead + n) of w's rows (zeros elsewhere:
// a column slice that starts or stops inside a block).
void matmul(const Kernels& k, const Matrix& w, int N, const float* x, int B, int n, int lead,
            float* y);

// GB/s of reading `bytes` (a buffer of its own, filled first) `reps` times, split over the
// pool's threads as the products are: the machine's read bandwidth, for comparison.
double read_bandwidth(size_t bytes, int reps);

}  // namespace lt
