// What the primitives share (internal to the extension): a view of an input array as a
// kernel reads it, float conversions, type dispatch, and the heads' split.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention.h"
#include "mlx/backend/common/utils.h"
#include "primitive.h"

namespace lt {

// What a kernel needs of an input array, taken when the primitive is evaluated (the
// task runs later on the stream's thread: it keeps pointers, not the graph).
struct View {
  const uint8_t* data;
  mx::Shape shape;
  mx::Strides strides;
  bool flat;
  size_t item, size;
  mx::Dtype dtype;
  explicit View(const mx::array& a)
      : data(a.data<uint8_t>()), shape(a.shape()), strides(a.strides()),
        flat(a.flags().row_contiguous), item(a.itemsize()), size(a.size()), dtype(a.dtype()) {}
  // `size` row-major values of type `dtype` at `bytes`
  View(const uint8_t* bytes, mx::Dtype dtype, size_t size)
      : data(bytes), flat(true), item(mx::size_of(dtype)), size(size), dtype(dtype) {}
  int64_t at(size_t i) const { return flat ? (int64_t)i : mx::elem_to_loc((int)i, shape, strides); }
  // Row-major bytes: the array's own, or a copy kept in `keep`.
  const uint8_t* bytes(std::vector<uint8_t>& keep) const {
    if (flat) return data;
    keep.resize(size * item);
    for (size_t i = 0; i < size; i++) std::memcpy(keep.data() + i * item, data + at(i) * item, item);
    return keep.data();
  }
  // Its float32 values when they are already row-major float32 (else null).
  const float* float32_rows() const {
    return dtype == mx::float32 && flat ? reinterpret_cast<const float*>(data) : nullptr;
  }
  // Float32, row-major.
  void floats(float* out) const {
    if (dtype == mx::float32) {
      const float* p = reinterpret_cast<const float*>(data);
      for (size_t i = 0; i < size; i++) out[i] = p[at(i)];
    } else if (dtype == mx::float16) {
      const mx::float16_t* p = reinterpret_cast<const mx::float16_t*>(data);
      for (size_t i = 0; i < size; i++) out[i] = static_cast<float>(p[at(i)]);
    } else {
      const mx::bfloat16_t* p = reinterpret_cast<const mx::bfloat16_t*>(data);
      for (size_t i = 0; i < size; i++) out[i] = static_cast<float>(p[at(i)]);
    }
  }
};

inline void store_floats(const float* y, size_t n, mx::Dtype dtype, void* out) {
  if (dtype == mx::float32) {
    std::memcpy(out, y, n * sizeof(float));
  } else if (dtype == mx::float16) {
    mx::float16_t* p = static_cast<mx::float16_t*>(out);
    for (size_t i = 0; i < n; i++) p[i] = static_cast<mx::float16_t>(y[i]);
  } else {
    mx::bfloat16_t* p = static_cast<mx::bfloat16_t*>(out);
    for (size_t i = 0; i < n; i++) p[i] = static_cast<mx::bfloat16_t>(y[i]);
  }
}

inline void check_float(const mx::array& x, const char* what) {
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16)
    throw std::invalid_argument(std::string("llama_tp kernels: ") + what +
                                " must be float32, float16 or bfloat16");
}



inline View4 view4(const mx::array& a) {
  View4 v{a.data<void>(), {}, {}};
  for (int i = 0; i < 4; i++) {
    v.shape[i] = a.shape(i);
    v.strides[i] = a.strides()[i];
  }
  return v;
}

inline void check_4d(const mx::array& a, const char* what) {
  check_float(a, what);
  if (a.ndim() != 4)
    throw std::invalid_argument(std::string("llama_tp kernels: ") + what + " must be 4-D");
}

// Run `f(T*)` with T the C++ type of `dtype` (float32, float16 or bfloat16).
template <typename F>
void by_type(mx::Dtype dtype, F&& f) {
  if (dtype == mx::float32) {
    f(static_cast<float*>(nullptr));
  } else if (dtype == mx::float16) {
    f(static_cast<mx::float16_t*>(nullptr));
  } else {
    f(static_cast<mx::bfloat16_t*>(nullptr));
  }
}

// y (B, L, (a + b + c) * d) row-major, of type `dtype` -> its heads (B, h, L, d) into
// outs[0..2]; q and k rotated by `rope` when rope.dims > 0 (layer_ops.cpp).
void split_heads_into(const uint8_t* src, mx::Dtype dtype, int B, int L,
                      const std::array<int, 3>& heads, int d, const RopeParams& rope,
                      const int32_t* offsets, bool per_row, const std::vector<uint8_t*>& outs);

// h = x + r in x's type (as MLX's add), then rms_norm(h) * w as type `ot` into o, for
// `rows` rows of n values; xf, rf (float32, row-major) are x's and r's values, wf the
// norm's weight; xf is overwritten with h's values (layer_ops.cpp).
void add_rms_norm_into(float* xf, const float* rf, const float* wf, mx::Dtype x_type,
                       mx::Dtype ot, int64_t rows, int64_t n, float eps, void* h, void* o);

}  // namespace lt
