#include "primitive.h"

#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "profile.h"
#include "matmul.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmv.h"

namespace lt {

namespace {

std::atomic<const Kernels*> current{nullptr};

const Kernels& kernels() {
  const Kernels* k = current.load();
  return k ? *k : best_kernels();
}

int scale_type(mx::Dtype t) {
  if (t == mx::float32) return F32;
  if (t == mx::float16) return F16;
  if (t == mx::bfloat16) return BF16;
  throw std::invalid_argument("llama_tp kernels: scales must be float32, float16 or bfloat16");
}

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

void store_floats(const float* y, size_t n, mx::Dtype dtype, void* out) {
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

void check_float(const mx::array& x, const char* what) {
  if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16)
    throw std::invalid_argument(std::string("llama_tp kernels: ") + what +
                                " must be float32, float16 or bfloat16");
}

}  // namespace

namespace {

View4 view4(const mx::array& a) {
  View4 v{a.data<void>(), {}, {}};
  for (int i = 0; i < 4; i++) {
    v.shape[i] = a.shape(i);
    v.strides[i] = a.strides()[i];
  }
  return v;
}

void check_4d(const mx::array& a, const char* what) {
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
// outs[0..2]; q and k rotated by `rope` when rope.dims > 0 (rope's own code, reading y's
// rows in place).
void split_heads_into(const uint8_t* src, mx::Dtype dtype, int B, int L,
                      const std::array<int, 3>& heads, int d, const RopeParams& rope,
                      const int32_t* offsets, bool per_row, const std::vector<uint8_t*>& outs) {
  size_t item = mx::size_of(dtype);
  int64_t H = heads[0] + heads[1] + heads[2];
  size_t row = (size_t)H * d * item, span = (size_t)d * item;
  size_t first = 0;  // the output's first head within a row, in bytes
  for (int i = 0; i < 3; i++) {
    if (rope.dims > 0 && i < 2) {
      View4 x{src + first, {B, heads[i], L, d}, {L * H * d, d, H * d, 1}};
      by_type(dtype, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        lt::rope<T>(x, rope.dims, rope.traditional, rope.base, rope.scale, rope.offset,
                    reinterpret_cast<T*>(outs[i]), offsets, per_row);
      });
    } else {
      for (int b = 0; b < B; b++)
        for (int h = 0; h < heads[i]; h++)
          for (int l = 0; l < L; l++)
            std::memcpy(outs[i] + (((size_t)b * heads[i] + h) * L + l) * span,
                        src + ((size_t)b * L + l) * row + first + (size_t)h * span, span);
    }
    first += (size_t)heads[i] * span;
  }
}

}  // namespace

const char* isa() { return kernels().isa; }

bool set_isa(const char* name) {
  int n;
  const Kernels* const* all = compiled_kernels(&n);
  for (int i = 0; i < n; i++) {
    if (!std::strcmp(all[i]->isa, name) && cpu_supports(name)) {
      current.store(all[i]);
      return true;
    }
  }
  return false;
}

namespace {

// qmatmul's checked inputs (x, w[, scales, biases]) and its k (values per weight row).
std::vector<mx::array> qmatmul_inputs(const mx::array& x, const mx::array& w,
                                      const std::optional<mx::array>& scales,
                                      const std::optional<mx::array>& biases, int format,
                                      int group_size, int lead, int* k_out) {
  check_float(x, "x");
  if (w.ndim() != 2 || x.ndim() < 1)
    throw std::invalid_argument("llama_tp kernels: w must be 2-D and x at least 1-D");
  int n = x.shape(-1), N = w.shape(0), k;
  std::vector<mx::array> inputs = {x, w};
  if (format == AFFINE4 || format == AFFINE8) {
    int bits = format == AFFINE4 ? 4 : 8;
    if (w.dtype() != mx::uint32 || !scales || !biases)
      throw std::invalid_argument("llama_tp kernels: affine weights are uint32 with scales and biases");
    if (group_size != 32 && group_size != 64 && group_size != 128)
      throw std::invalid_argument("llama_tp kernels: group size must be 32, 64 or 128, got " +
                                  std::to_string(group_size));
    k = w.shape(1) * 32 / bits;
    if (scales->shape() != mx::Shape{N, k / group_size} || biases->shape() != scales->shape() ||
        biases->dtype() != scales->dtype())
      throw std::invalid_argument("llama_tp kernels: scales and biases must be (" +
                                  std::to_string(N) + ", " + std::to_string(k / group_size) + ")");
    scale_type(scales->dtype());
    if (lead != 0 || n != k)
      throw std::invalid_argument("llama_tp kernels: x has " + std::to_string(n) +
                                  " values per row, the weights " + std::to_string(k));
    inputs.push_back(*scales);
    inputs.push_back(*biases);
  } else {
    int per = block_values(format), bytes = block_bytes(format);
    if (per == 0) throw std::invalid_argument("llama_tp kernels: unknown format " + std::to_string(format));
    if (w.dtype() != mx::uint8 || w.shape(1) % bytes)
      throw std::invalid_argument("llama_tp kernels: GGUF weights are uint8 rows of whole blocks");
    k = w.shape(1) / bytes * per;
    if (lead < 0 || lead + n > k)
      throw std::invalid_argument("llama_tp kernels: x's " + std::to_string(n) + " values from " +
                                  std::to_string(lead) + " exceed the blocks' " + std::to_string(k));
  }
  *k_out = k;
  return inputs;
}

}  // namespace

mx::array qmatmul(const mx::array& x, const mx::array& w, const std::optional<mx::array>& scales,
                  const std::optional<mx::array>& biases, int format, int group_size, int lead,
                  mx::StreamOrDevice s) {
  int k;
  auto inputs = qmatmul_inputs(x, w, scales, biases, format, group_size, lead, &k);
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, x.dtype(),
                   std::make_shared<QMatmul>(mx::to_stream(s), format, group_size, lead, k),
                   std::move(inputs));
}

mx::array qmatmul_swiglu(const mx::array& x, const mx::array& w,
                         const std::optional<mx::array>& scales,
                         const std::optional<mx::array>& biases, int format, int group_size,
                         int lead, mx::StreamOrDevice s) {
  int k;
  auto inputs = qmatmul_inputs(x, w, scales, biases, format, group_size, lead, &k);
  if (w.shape(0) % 2)
    throw std::invalid_argument("llama_tp kernels: a gate/up product has an even row count");
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0) / 2;
  Epilogue ep;
  ep.kind = Epilogue::SWIGLU;
  return mx::array(shape, x.dtype(),
                   std::make_shared<QMatmul>(mx::to_stream(s), format, group_size, lead, k, ep),
                   std::move(inputs));
}

std::vector<mx::array> qmatmul_heads(const mx::array& x, const mx::array& w,
                                     const std::optional<mx::array>& scales,
                                     const std::optional<mx::array>& biases, int format,
                                     int group_size, int lead, int a, int b, int c, int d,
                                     int rope_dims, bool traditional, float base, float scale,
                                     int offset, const std::optional<mx::array>& offsets,
                                     mx::StreamOrDevice s) {
  int k;
  auto inputs = qmatmul_inputs(x, w, scales, biases, format, group_size, lead, &k);
  if (x.ndim() != 3 || d < 1 || a < 0 || b < 0 || c < 0 || w.shape(0) != (a + b + c) * d)
    throw std::invalid_argument("llama_tp kernels: qmatmul_heads takes x (B, L, n) and "
                                "(a + b + c) * d weight rows");
  if (rope_dims < 0 || rope_dims % 2 || rope_dims > d)
    throw std::invalid_argument("llama_tp kernels: rope dims must be even and <= the head size");
  if (offsets) {
    if (offsets->size() != 1 && (offsets->ndim() != 1 || offsets->shape(0) != x.shape(0)))
      throw std::invalid_argument("llama_tp kernels: rope offsets must be one, or one per row");
    inputs.push_back(mx::astype(*offsets, mx::int32, s));
  }
  int B = x.shape(0), L = x.shape(1);
  Epilogue ep{Epilogue::HEADS, a, b, c, d, RopeParams{rope_dims, traditional, base, scale, offset}};
  std::vector<mx::Shape> shapes = {{B, a, L, d}, {B, b, L, d}, {B, c, L, d}};
  return mx::array::make_arrays(
      std::move(shapes), {x.dtype(), x.dtype(), x.dtype()},
      std::make_shared<QMatmul>(mx::to_stream(s), format, group_size, lead, k, ep),
      std::move(inputs));
}

void QMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  std::vector<uint8_t*> outs;
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
    outs.push_back(o.data<uint8_t>());
  }
  bool affine = format_ == AFFINE4 || format_ == AFFINE8;
  size_t held = affine ? 4 : 2;  // then the rotation's positions, if any
  const int32_t* offsets = nullptr;
  bool per_row = false;
  if (inputs.size() > held) {
    if (!inputs[held].flags().row_contiguous)
      throw std::invalid_argument("llama_tp kernels: rope offsets must be contiguous");
    offsets = inputs[held].data<int32_t>();
    per_row = inputs[held].size() > 1;
  }
  int n = inputs[0].shape(-1), N = inputs[1].shape(0);
  int B = (int)(inputs[0].size() / n);
  int Bx = inputs[0].ndim() == 3 ? inputs[0].shape(0) : 0, L = inputs[0].ndim() == 3 ? inputs[0].shape(1) : 0;
  size_t row_bytes = inputs[1].shape(1) * inputs[1].itemsize();
  int stype = affine ? scale_type(inputs[2].dtype()) : F16;
  enc.dispatch([x = View(inputs[0]), w = View(inputs[1]), s = View(inputs[affine ? 2 : 1]),
                b = View(inputs[affine ? 3 : 1]), outs, y_dtype = outputs[0].dtype(), affine, n,
                N, B, Bx, L, row_bytes, stype, format = format_, gs = group_size_, lead = lead_,
                k = k_, ep = epilogue_, offsets, per_row]() {
    prof::Scope timed(prof::QMATMUL);
    std::vector<uint8_t> keep_w, keep_s, keep_b;
    Matrix m{};
    m.format = format;
    m.data = w.bytes(keep_w);
    m.row_bytes = row_bytes;
    m.k = k;
    if (affine) {
      m.scales = s.bytes(keep_s);
      m.biases = b.bytes(keep_b);
      m.scale_type = stype;
      m.group_size = gs;
      m.groups = k / gs;
    }
    // float32 in and out (the common case): no copies, the output written in place
    thread_local std::vector<float> xf, y;
    const float* xp = x.float32_rows();
    if (xp == nullptr) {
      xf.resize((size_t)B * n);
      x.floats(xf.data());
      xp = xf.data();
    }
    bool direct = y_dtype == mx::float32 && ep.kind == Epilogue::NONE;
    float* yp = reinterpret_cast<float*>(outs[0]);
    if (!direct) {
      y.resize((size_t)B * N);
      yp = y.data();
    }
    matmul(kernels(), m, N, xp, B, n, lead, yp);
    if (direct) return;
    if (ep.kind == Epilogue::NONE) {
      store_floats(yp, (size_t)B * N, y_dtype, outs[0]);
      return;
    }
    // the product's values as its output type holds them, then the epilogue over them
    // (what the separate operation would read): the same values as the two operations
    thread_local std::vector<uint8_t> typed;
    const uint8_t* yt = reinterpret_cast<const uint8_t*>(yp);
    if (y_dtype != mx::float32) {
      typed.resize((size_t)B * N * mx::size_of(y_dtype));
      store_floats(yp, (size_t)B * N, y_dtype, typed.data());
      yt = typed.data();
    }
    if (ep.kind == Epilogue::SWIGLU) {
      by_type(y_dtype, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        lt::swiglu<T>(reinterpret_cast<const T*>(yt), B, N / 2, reinterpret_cast<T*>(outs[0]));
      });
    } else {
      split_heads_into(yt, y_dtype, Bx, L, {ep.a, ep.b, ep.c}, ep.d, ep.rope, offsets, per_row,
                       outs);
    }
  });
}

void QMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

bool QMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QMatmul&>(other);
  return format_ == o.format_ && group_size_ == o.group_size_ && lead_ == o.lead_ && k_ == o.k_ &&
         epilogue_ == o.epilogue_;
}

mx::array dequantize(const mx::array& w, int format, int lead, int n, mx::Dtype dtype,
                     mx::StreamOrDevice s) {
  int per = block_values(format), bytes = block_bytes(format);
  if (per == 0) throw std::invalid_argument("llama_tp kernels: unknown format " + std::to_string(format));
  if (w.dtype() != mx::uint8 || w.ndim() < 1 || w.shape(-1) % bytes)
    throw std::invalid_argument("llama_tp kernels: GGUF weights are uint8 rows of whole blocks");
  if (lead < 0 || n < 1 || lead + n > w.shape(-1) / bytes * per)
    throw std::invalid_argument("llama_tp kernels: values [" + std::to_string(lead) + ", " +
                                std::to_string(lead + n) + ") are outside the blocks");
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16)
    throw std::invalid_argument("llama_tp kernels: dequantize to a float dtype");
  mx::Shape shape = w.shape();
  shape.back() = n;
  return mx::array(shape, dtype, std::make_shared<Dequantize>(mx::to_stream(s), format, lead, n),
                   {w});
}

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& w = inputs[0];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(w);
  enc.set_output_array(out);
  int rows = (int)(w.size() / w.shape(-1));
  size_t row_bytes = w.shape(-1);
  enc.dispatch([v = View(w), y_out = out.data<void>(), y_dtype = out.dtype(), rows, row_bytes,
                format = format_, lead = lead_, n = n_]() {
    prof::Scope timed(prof::DEQUANTIZE);
    std::vector<uint8_t> keep;
    std::vector<float> y((size_t)rows * n);
    dequantize_rows(format, v.bytes(keep), row_bytes, rows, lead, n, y.data());
    store_floats(y.data(), y.size(), y_dtype, y_out);
  });
}

void Dequantize::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

bool Dequantize::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Dequantize&>(other);
  return format_ == o.format_ && lead_ == o.lead_ && n_ == o.n_;
}


mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale,
               int offset, const std::optional<mx::array>& offsets, mx::StreamOrDevice s) {
  check_4d(x, "x");
  if (dims < 2 || dims % 2 || dims > x.shape(3))
    throw std::invalid_argument("llama_tp kernels: rope dims must be even and <= the last axis");
  std::vector<mx::array> inputs = {x};
  if (offsets) {
    if (offsets->size() != 1 && (offsets->ndim() != 1 || offsets->shape(0) != x.shape(0)))
      throw std::invalid_argument("llama_tp kernels: rope offsets must be one, or one per row");
    inputs.push_back(mx::astype(*offsets, mx::int32, s));
  }
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<Rope>(mx::to_stream(s), dims, traditional, base, scale, offset),
                   std::move(inputs));
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  bool dynamic = inputs.size() == 2;
  const int32_t* offsets = dynamic ? inputs[1].data<int32_t>() : nullptr;
  bool per_row = dynamic && inputs[1].size() > 1;
  if (dynamic && !inputs[1].flags().row_contiguous && per_row)
    throw std::invalid_argument("llama_tp kernels: rope offsets must be contiguous");
  enc.dispatch([x = view4(inputs[0]), dtype = out.dtype(), o = out.data<void>(), dims = dims_,
                trad = traditional_, base = base_, scale = scale_, offset = offset_, offsets,
                per_row]() {
    prof::Scope timed(prof::ROPE);
    by_type(dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      lt::rope<T>(x, dims, trad, base, scale, offset, static_cast<T*>(o), offsets, per_row);
    });
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
         scale_ == o.scale_ && offset_ == o.offset_;
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    bool causal, const std::optional<mx::array>& ranges, bool merged,
                    mx::StreamOrDevice s) {
  check_4d(q, "q");
  check_4d(k, "k");
  check_4d(v, "v");
  if (k.shape() != v.shape() || k.dtype() != q.dtype() || v.dtype() != q.dtype() ||
      q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3) || q.shape(1) % k.shape(1) ||
      (causal && q.shape(2) > k.shape(2)))
    throw std::invalid_argument("llama_tp kernels: attention shapes or dtypes do not match");
  std::vector<mx::array> inputs = {q, k, v};
  if (ranges) {
    if (ranges->shape() != mx::Shape{q.shape(0), 2})
      throw std::invalid_argument("llama_tp kernels: attention ranges must be (batch, 2)");
    inputs.push_back(mx::astype(*ranges, mx::int32, s));
  }
  mx::Shape shape = q.shape();
  if (merged) shape = {q.shape(0), q.shape(2), q.shape(1) * q.shape(3)};
  return mx::array(std::move(shape), q.dtype(),
                   std::make_shared<Attention>(mx::to_stream(s), scale, causal, merged),
                   std::move(inputs));
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  const int32_t* ranges = nullptr;
  std::vector<int32_t> packed;
  if (inputs.size() == 4) {
    const mx::array& r = inputs[3];
    if (r.flags().row_contiguous) {
      ranges = r.data<int32_t>();
    } else {
      throw std::invalid_argument("llama_tp kernels: attention ranges must be contiguous");
    }
  }
  enc.dispatch([q = view4(inputs[0]), k = view4(inputs[1]), v = view4(inputs[2]),
                dtype = out.dtype(), o = out.data<void>(), scale = scale_, causal = causal_,
                ranges, merged = merged_]() {
    prof::Scope timed(prof::ATTENTION);
    by_type(dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      lt::attention<T>(q, k, v, scale, causal, static_cast<T*>(o), ranges, merged);
    });
  });
}

void Attention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Attention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && merged_ == o.merged_;
}

std::vector<mx::array> split_heads(const mx::array& y, int a, int b, int c, int d,
                                   int rope_dims, bool traditional, float base, float scale,
                                   int offset, const std::optional<mx::array>& offsets,
                                   mx::StreamOrDevice s) {
  check_float(y, "y");
  if (y.ndim() != 3 || d < 1 || a < 0 || b < 0 || c < 0 || y.shape(2) != (a + b + c) * d)
    throw std::invalid_argument("llama_tp kernels: split_heads takes (B, L, (a + b + c) * d)");
  if (rope_dims < 0 || rope_dims % 2 || rope_dims > d)
    throw std::invalid_argument("llama_tp kernels: rope dims must be even and <= the head size");
  int B = y.shape(0), L = y.shape(1);
  std::vector<mx::array> inputs = {y};
  if (offsets) {
    if (offsets->size() != 1 && (offsets->ndim() != 1 || offsets->shape(0) != B))
      throw std::invalid_argument("llama_tp kernels: rope offsets must be one, or one per row");
    inputs.push_back(mx::astype(*offsets, mx::int32, s));
  }
  RopeParams rope{rope_dims, traditional, base, scale, offset};
  std::vector<mx::Shape> shapes = {{B, a, L, d}, {B, b, L, d}, {B, c, L, d}};
  return mx::array::make_arrays(std::move(shapes), {y.dtype(), y.dtype(), y.dtype()},
                                std::make_shared<SplitHeads>(mx::to_stream(s), d, rope),
                                std::move(inputs));
}

void SplitHeads::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  std::vector<uint8_t*> outs;
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
    outs.push_back(o.data<uint8_t>());
  }
  const mx::array& y = inputs[0];
  int B = y.shape(0), L = y.shape(1), d = d_;
  std::array<int, 3> heads = {outputs[0].shape(1), outputs[1].shape(1), outputs[2].shape(1)};
  const int32_t* offsets = nullptr;
  bool per_row = false;
  if (inputs.size() == 2) {
    enc.set_input_array(inputs[1]);
    if (!inputs[1].flags().row_contiguous)
      throw std::invalid_argument("llama_tp kernels: rope offsets must be contiguous");
    offsets = inputs[1].data<int32_t>();
    per_row = inputs[1].size() > 1;
  }
  enc.dispatch([v = View(y), outs, heads, B, L, d, rope = rope_, offsets, per_row]() {
    std::vector<uint8_t> keep;
    split_heads_into(v.bytes(keep), v.dtype, B, L, heads, d, rope, offsets, per_row, outs);
  });
}

void SplitHeads::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

mx::array swiglu(const mx::array& y, mx::StreamOrDevice s) {
  check_float(y, "y");
  if (y.ndim() < 1 || y.shape(-1) % 2)
    throw std::invalid_argument("llama_tp kernels: swiglu takes (..., 2n)");
  mx::Shape shape = y.shape();
  shape.back() /= 2;
  return mx::array(std::move(shape), y.dtype(), std::make_shared<SwiGLU>(mx::to_stream(s)), {y});
}

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.set_output_array(out);
  int64_t n = out.shape(-1), rows = n ? (int64_t)(out.size() / n) : 0;
  enc.dispatch([v = View(inputs[0]), o = out.data<void>(), rows, n]() {
    std::vector<uint8_t> keep;
    const uint8_t* src = v.bytes(keep);  // row-major (rows, 2n)
    by_type(v.dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      lt::swiglu<T>(reinterpret_cast<const T*>(src), rows, n, static_cast<T*>(o));
    });
  });
}

void SwiGLU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s) {
  check_float(x, "x");
  check_float(w, "weight");
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("llama_tp kernels: rms_norm weight must be (" +
                                std::to_string(x.ndim() ? x.shape(-1) : 0) + ",)");
  auto out_type = mx::promote_types(x.dtype(), w.dtype());
  return mx::array(x.shape(), out_type, std::make_shared<RMSNorm>(mx::to_stream(s), eps),
                   {x, w});
}

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  int64_t n = inputs[0].shape(-1), rows = n ? (int64_t)(inputs[0].size() / n) : 0;
  enc.dispatch([x = View(inputs[0]), w = View(inputs[1]), o = out.data<void>(), ot = out.dtype(),
                rows, n, eps = eps_]() {
    prof::Scope timed(prof::NORM);
    std::vector<float> xf(x.size), wf(w.size);
    x.floats(xf.data());  // strided views and every float type, as float32
    w.floats(wf.data());
    by_type(ot, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      lt::rms_norm<T>(xf.data(), wf.data(), rows, n, eps, static_cast<T*>(o));
    });
  });
}

void RMSNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

bool RMSNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const RMSNorm&>(other).eps_;
}

std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& r, const mx::array& w,
                                    float eps, mx::StreamOrDevice s) {
  check_float(x, "x");
  check_float(w, "weight");
  if (r.dtype() != x.dtype() || r.shape() != x.shape())
    throw std::invalid_argument("llama_tp kernels: add_rms_norm's x and r differ in type or shape");
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("llama_tp kernels: rms_norm weight must be (" +
                                std::to_string(x.ndim() ? x.shape(-1) : 0) + ",)");
  auto out_type = mx::promote_types(x.dtype(), w.dtype());
  return mx::array::make_arrays({x.shape(), x.shape()}, {x.dtype(), out_type},
                                std::make_shared<AddRMSNorm>(mx::to_stream(s), eps), {x, r, w});
}

void AddRMSNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
  }
  int64_t n = inputs[0].shape(-1), rows = n ? (int64_t)(inputs[0].size() / n) : 0;
  enc.dispatch([x = View(inputs[0]), r = View(inputs[1]), w = View(inputs[2]),
                h = outputs[0].data<void>(), o = outputs[1].data<void>(),
                ot = outputs[1].dtype(), rows, n, eps = eps_]() {
    prof::Scope timed(prof::NORM);
    std::vector<float> xf(x.size), rf(r.size), wf(w.size);
    x.floats(xf.data());
    r.floats(rf.data());
    w.floats(wf.data());
    // the sum in x's type (as MLX's add), then the norm of those values
    by_type(x.dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      T* hp = static_cast<T*>(h);
      for (size_t i = 0; i < x.size; i++) {
        hp[i] = static_cast<T>(xf[i] + rf[i]);
        xf[i] = static_cast<float>(hp[i]);
      }
    });
    by_type(ot, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      lt::rms_norm<T>(xf.data(), wf.data(), rows, n, eps, static_cast<T*>(o));
    });
  });
}

void AddRMSNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

}  // namespace lt
