// The MLX side: two primitives that run the plain kernels on MLX's CPU stream.
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace lt {

namespace mx = mlx::core;

// RoPE's parameters where another operation rotates (mx.fast.rope's meaning).
struct RopeParams {
  int dims = 0;  // 0: no rotation
  bool traditional = false;
  float base = 0.f, scale = 1.f;
  int offset = 0;
  bool operator==(const RopeParams&) const = default;
};

// What a product does with its values before storing them: nothing, SwiGLU of its two
// halves (gate | up), split into q/k/v heads (a, b, c heads of d, q and k rotated
// when rope.dims > 0), or added to a residual and normed (RMSNorm of epsilon `eps`).
// One primitive then does the work of two or three.
struct Epilogue {
  enum Kind : int { NONE = 0, SWIGLU = 1, HEADS = 2, ADD_NORM = 3 } kind = NONE;
  int a = 0, b = 0, c = 0, d = 0;
  RopeParams rope;
  float eps = 0.f;  // ADD_NORM's
  bool operator==(const Epilogue&) const = default;
};

// x (..., n) @ W^T -> (..., N), W quantized: a GGUF format (w uint8 (N, blocks * bytes),
// x's values at columns [lead, lead + n) of the blocks) or MLX affine (w uint32
// (N, k * bits / 32), scales and biases (N, k / group_size)).
mx::array qmatmul(const mx::array& x, const mx::array& w, const std::optional<mx::array>& scales,
                  const std::optional<mx::array>& biases, int format, int group_size, int lead,
                  mx::StreamOrDevice s = {});

// qmatmul, then SwiGLU of its output's halves: x (..., n) -> (..., N / 2).
mx::array qmatmul_swiglu(const mx::array& x, const mx::array& w,
                         const std::optional<mx::array>& scales,
                         const std::optional<mx::array>& biases, int format, int group_size,
                         int lead, mx::StreamOrDevice s = {});

// qmatmul of x (B, L, n), its output split into heads as `split_heads` splits it (q and k
// rotated with rope_dims > 0): q (B, a, L, d), k (B, b, L, d), v (B, c, L, d).
std::vector<mx::array> qmatmul_heads(const mx::array& x, const mx::array& w,
                                     const std::optional<mx::array>& scales,
                                     const std::optional<mx::array>& biases, int format,
                                     int group_size, int lead, int a, int b, int c, int d,
                                     int rope_dims, bool traditional, float base, float scale,
                                     int offset, const std::optional<mx::array>& offsets,
                                     mx::StreamOrDevice s = {});

// Rows of GGUF blocks w (..., blocks * bytes) -> values [lead, lead + n) of each, (..., n).
mx::array dequantize(const mx::array& w, int format, int lead, int n, mx::Dtype dtype,
                     mx::StreamOrDevice s = {});

// qmatmul, then the residual sum and the next norm (`add_rms_norm` of r and the
// product): x (..., n), r (..., N) -> [h = r + x W^T, rms_norm(h) * weight].
std::vector<mx::array> qmatmul_add_norm(const mx::array& x, const mx::array& w,
                                        const std::optional<mx::array>& scales,
                                        const std::optional<mx::array>& biases, int format,
                                        int group_size, int lead, const mx::array& r,
                                        const mx::array& weight, float eps,
                                        mx::StreamOrDevice s = {});

class QMatmul : public mx::Primitive {
 public:
  QMatmul(mx::Stream stream, int format, int group_size, int lead, int k, Epilogue epilogue = {})
      : mx::Primitive(stream), format_(format), group_size_(group_size), lead_(lead), k_(k),
        epilogue_(epilogue) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "LlamaTpQMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int format_, group_size_, lead_, k_;
  Epilogue epilogue_;
};

class Dequantize : public mx::Primitive {
 public:
  Dequantize(mx::Stream stream, int format, int lead, int n)
      : mx::Primitive(stream), format_(format), lead_(lead), n_(n) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "LlamaTpDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int format_, lead_, n_;
};

// mx.fast.rope of x (B, H, L, D) from position `offset`, or from `offsets` (int32: one, or
// one per row (B,)) when given (then the graph does not change with the position); one
// primitive.
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale,
               int offset, const std::optional<mx::array>& offsets = std::nullopt,
               mx::StreamOrDevice s = {});

// Attention of q (B, Hq, L, D) over k, v (B, Hkv, S, D): no mask, or causal (aligned to
// the last keys, as MLX's); one primitive. `ranges` (B, 2) int32: row b's keys [start,
// stop) of S (a cache buffer longer than its keys), the causal mask aligned to stop.
// `merged`: the output is (B, L, Hq * D), the heads side by side (what the output
// projection takes), instead of (B, Hq, L, D).
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    bool causal, const std::optional<mx::array>& ranges = std::nullopt,
                    bool merged = false, mx::StreamOrDevice s = {});

// mx.fast.rms_norm of x (..., n) with weight (n,): one primitive (MLX composes it on the
// CPU); its output type is x's and the weight's result type.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s = {});

// y (B, L, (a + b + c) * d) -> its heads as (B, a, L, d), (B, b, L, d), (B, c, L, d): a
// fused q/k/v product's output split into q, k and v, one primitive (for MLX a reshape,
// a transpose and three slices). With `rope_dims` > 0, q and k come out rotated as
// `rope` rotates them (the same parameters; `offsets` as rope's): no Rope operations.
std::vector<mx::array> split_heads(const mx::array& y, int a, int b, int c, int d,
                                   int rope_dims = 0, bool traditional = false, float base = 0.f,
                                   float scale = 1.f, int offset = 0,
                                   const std::optional<mx::array>& offsets = std::nullopt,
                                   mx::StreamOrDevice s = {});

// y (..., 2n) -> silu(y[..., :n]) * y[..., n:] (..., n): SwiGLU on a fused gate/up
// product's output, one primitive (for MLX two slices and a fused elementwise kernel).
mx::array swiglu(const mx::array& y, mx::StreamOrDevice s = {});

// (x + r, rms_norm(x + r, w)): a block's residual sum and the next norm of it, one
// primitive with two outputs (for MLX an add and a norm); x and r of one type and shape.
std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& r, const mx::array& w,
                                    float eps, mx::StreamOrDevice s = {});

class AddRMSNorm : public mx::Primitive {
 public:
  AddRMSNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "LlamaTpAddRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const AddRMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};


class SplitHeads : public mx::Primitive {
 public:
  SplitHeads(mx::Stream stream, int d, RopeParams rope)
      : mx::Primitive(stream), d_(d), rope_(rope) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "LlamaTpSplitHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const SplitHeads&>(other);
    return d_ == o.d_ && rope_ == o.rope_;
  }

 private:
  int d_;
  RopeParams rope_;
};

class SwiGLU : public mx::Primitive {
 public:
  explicit SwiGLU(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "LlamaTpSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

class RMSNorm : public mx::Primitive {
 public:
  RMSNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "LlamaTpRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

class Rope : public mx::Primitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale, int offset)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base),
        scale_(scale), offset_(offset) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "LlamaTpRope"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int offset_;
};

class Attention : public mx::Primitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal, bool merged)
      : mx::Primitive(stream), scale_(scale), causal_(causal), merged_(merged) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "LlamaTpAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  bool causal_, merged_;
};

// The instruction set in use ("avx512", "avx2", "neon", "scalar"); set_isa picks another
// one this CPU runs (false if it does not).
const char* isa();
bool set_isa(const char* name);

}  // namespace lt
