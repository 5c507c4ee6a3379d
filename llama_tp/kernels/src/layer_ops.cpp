// The layers' operations other than products as MLX primitives: RoPE, attention, the
// heads' split, SwiGLU, RMSNorm and the residual sum with a norm, each one primitive where
// MLX's CPU backend composes several (the kernels: attention.h).
#include <array>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "pool.h"
#include "mlx/backend/cpu/encoder.h"
#include "primitive.h"
#include "primitive_util.h"
#include "profile.h"

namespace lt {

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

namespace {

template <typename T>
struct AttentionJob {
  lt::View4 q, k, v;
  float scale;
  bool causal;
  T* out;
  const int32_t* ranges;
  bool merged;
  static void unit(void* ctx, int u) {
    auto& j = *static_cast<AttentionJob*>(ctx);
    thread_local std::vector<float> scratch;
    scratch.resize(2 * j.q.shape[3] + j.k.shape[2]);
    lt::attention_unit<T>(j.q, j.k, j.v, j.scale, j.causal, j.out, j.ranges, j.merged, u,
                          scratch.data());
  }
};

}  // namespace

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
      AttentionJob<T> job{q, k, v, scale, causal, static_cast<T*>(o), ranges, merged};
      // the heads are independent: the pool's threads take them (decode's only
      // single-threaded stretch between products was this one)
      lt::Pool::get().run((int)(q.shape[0] * q.shape[1]), AttentionJob<T>::unit, &job);
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
    add_rms_norm_into(xf.data(), rf.data(), wf.data(), x.dtype, ot, rows, n, eps, h, o);
  });
}

void add_rms_norm_into(float* xf, const float* rf, const float* wf, mx::Dtype x_type,
                       mx::Dtype ot, int64_t rows, int64_t n, float eps, void* h, void* o) {
  // the sum in x's type (as MLX's add), then the norm of those values
  by_type(x_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* hp = static_cast<T*>(h);
    for (int64_t i = 0; i < rows * n; i++) {
      hp[i] = static_cast<T>(xf[i] + rf[i]);
      xf[i] = static_cast<float>(hp[i]);
    }
  });
  by_type(ot, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    lt::rms_norm<T>(xf, wf, rows, n, eps, static_cast<T*>(o));
  });
}

void AddRMSNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

}  // namespace lt