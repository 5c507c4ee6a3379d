// Quantized matrix-vector products on the CPU: y = x W^T for a quantized W.
//
// Plain C++ (no MLX): the MLX primitive (primitive.cpp) and the standalone tests
// (selftest.cpp) call these. One function per weight format and instruction set
// (qmv_scalar.cpp, qmv_x86.cpp compiled once per x86 level, qmv_neon.cpp), chosen at
// run time by `best_kernels()`.
//
// The method is llama.cpp's: each activation row is quantized once per product, in
// blocks of 32 values with one float scale each (here to 16-bit integers: 8-bit
// activations measured 0.45 nats off a float64 reference on the built-in model, see
// docs/cpu-kernels.md), then every 32 weights give an exact integer dot product that is
// scaled once: for a weight w = A * u + B over 16 values (u the stored integer, A and
// B the block's or sub-block's scale and offset),
//     sum_i w_i x_i = A * dx * sum_i u_i q_i + B * dx * sum_i q_i.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lt {

// ggml's type ids for the GGUF block formats, and two ids of our own for MLX's affine
// layout (uint32 words holding 4- or 8-bit values, little end first; float scales and
// biases per group of `group_size` values along the row).
enum Format : int {
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  AFFINE4 = 1004,
  AFFINE8 = 1008,
};

enum ScaleType : int { F32 = 0, F16 = 1, BF16 = 2 };

// Values and bytes per block of a GGUF format (0, 0 for the affine ones and unknown ids).
int block_values(int format);
int block_bytes(int format);
bool is_gguf(int format);

// N rows of a quantized matrix. GGUF: each row is `row_bytes` of whole blocks; affine:
// `row_bytes` of packed values and `scales`/`biases` with `groups` entries per row.
// `k` is the values per row the blocks cover (blocks * values per block for GGUF).
struct Matrix {
  int format;
  const uint8_t* data;
  size_t row_bytes;
  int k;
  // affine only
  const void* scales = nullptr;
  const void* biases = nullptr;
  int scale_type = F16;
  int group_size = 0;
  size_t groups = 0;  // scale entries per row
};

// One activation row quantized in blocks of 32: q (k int16), d (k / 32 scales),
// m (k / 16: d times the sum of each 16 q's) and dm (k / 16: d and the block's two m's
// summed, interleaved per block: what a block's scale and offset multiply).
struct XRow {
  const int16_t* q;
  const float* d;
  const float* m;
  const float* dm;
};

// The order of each 32 values of q: natural, or (MLX 4-bit) the even positions first,
// then the odd ones, matching the low and high nibbles of 16 packed bytes. PAIRED adds,
// for every two blocks (but a last odd one), their halves interleaved: block c's first
// 16, block c + 1's first 16, c's second 16, c + 1's second 16 (AVX-512 takes two
// blocks of 4-bit values per instruction so).
enum Order : int { NATURAL = 0, EVEN_ODD = 1, PAIRED = 2 };

// Quantize x[0, n) into a row of `k` >= lead + n values: zeros before `lead` and after
// lead + n (a column slice that starts inside a block); q, d, m, dm as in XRow. `order`:
// NATURAL or EVEN_ODD, | PAIRED.
void quantize_row(const float* x, int n, int lead, int k, int order, int16_t* q, float* d,
                  float* m, float* dm);
int order_of(int format);

// y[i] = dot(row r0 + i, x) for r0 <= r0 + i < r1.
typedef void (*RowsFn)(const Matrix& w, const XRow& x, int r0, int r1, float* y);

// The functions of one instruction set, indexed by `slot(format)`; null where missing.
constexpr int N_SLOTS = 12;
int slot(int format);

struct Kernels {
  const char* isa;
  RowsFn rows[N_SLOTS];
  int paired[N_SLOTS] = {};  // 1: the kernel reads its activations in PAIRED order
};

const Kernels& scalar_kernels();
// Instruction sets compiled in, best first, whether or not this CPU has them.
const Kernels* const* compiled_kernels(int* n);
bool cpu_supports(const char* isa);
// The best instruction set this CPU runs (the scalar one at worst).
const Kernels& best_kernels();
// The kernel for `format` from `k`, or the scalar one where `k` lacks it.
RowsFn rows_fn(const Kernels& k, int format);

// Dequantize rows of a GGUF format: out (rows, n) = values [lead, lead + n) of each row.
void dequantize_rows(int format, const uint8_t* data, size_t row_bytes, int rows, int lead,
                     int n, float* out);

// Convert n scales of `type` to float.
void to_float(const void* src, int type, size_t n, float* out);

}  // namespace lt
