// Every SIMD kernel against its scalar twin on random blocks (no MLX: runs under
// qemu-user for other architectures, see tests/test_kernels.py).
#pragma once

#include <string>

#include "qmv.h"

namespace lt {

// Largest |y_isa - y_scalar| / max |y_scalar| of `format` on random rows (lengths that
// are not multiples of the row chunk, column slices starting inside a block).
double compare_with_scalar(const Kernels& k, int format, unsigned seed);

// One line per (instruction set this CPU runs, format): "isa format error"; `ok` false
// when an error exceeds `bound`.
std::string selftest(double bound, bool* ok);

}  // namespace lt
