// The quantized products and dequantization as MLX primitives (the layers' other
// operations: layer_ops.cpp).
#include "primitive.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "matmul.h"
#include "mlx/backend/cpu/encoder.h"
#include "primitive_util.h"
#include "profile.h"
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

std::vector<mx::array> qmatmul_add_norm(const mx::array& x, const mx::array& w,
                                        const std::optional<mx::array>& scales,
                                        const std::optional<mx::array>& biases, int format,
                                        int group_size, int lead, const mx::array& r,
                                        const mx::array& weight, float eps, mx::StreamOrDevice s) {
  int k;
  auto inputs = qmatmul_inputs(x, w, scales, biases, format, group_size, lead, &k);
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  check_float(weight, "weight");
  if (r.shape() != shape || r.dtype() != x.dtype())
    throw std::invalid_argument("llama_tp kernels: qmatmul_add_norm's residual differs from the "
                                "product in type or shape");
  if (weight.ndim() != 1 || weight.shape(0) != w.shape(0))
    throw std::invalid_argument("llama_tp kernels: rms_norm weight must be (" +
                                std::to_string(w.shape(0)) + ",)");
  inputs.push_back(r);
  inputs.push_back(weight);
  Epilogue ep;
  ep.kind = Epilogue::ADD_NORM;
  ep.eps = eps;
  return mx::array::make_arrays(
      {shape, shape}, {x.dtype(), mx::promote_types(x.dtype(), weight.dtype())},
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
  if (inputs.size() > held && epilogue_.kind == Epilogue::HEADS) {
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
  // ADD_NORM's residual and norm weight (else placeholders: not read)
  bool add_norm = epilogue_.kind == Epilogue::ADD_NORM;
  const mx::array& res = inputs[add_norm ? held : 0];
  const mx::array& nw = inputs[add_norm ? held + 1 : 0];
  enc.dispatch([x = View(inputs[0]), w = View(inputs[1]), s = View(inputs[affine ? 2 : 1]),
                b = View(inputs[affine ? 3 : 1]), r = View(res), nw = View(nw),
                normed_dtype = outputs.back().dtype(), outs, y_dtype = outputs[0].dtype(), affine, n,
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
    if (ep.kind == Epilogue::ADD_NORM) {  // as add_rms_norm(r, product)
      thread_local std::vector<float> rf, yf, wf;
      rf.resize(r.size);
      yf.resize((size_t)B * N);
      wf.resize(nw.size);
      r.floats(rf.data());
      nw.floats(wf.data());
      if (y_dtype == mx::float32) {
        std::memcpy(yf.data(), yp, yf.size() * sizeof(float));
      } else {
        View(yt, y_dtype, yf.size()).floats(yf.data());
      }
      add_rms_norm_into(rf.data(), yf.data(), wf.data(), y_dtype, normed_dtype, B, N, ep.eps,
                        outs[0], outs[1]);
    } else if (ep.kind == Epilogue::SWIGLU) {
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

}  // namespace lt
