// Rotary embeddings and attention for a few query positions, in plain C++: on MLX's CPU
// stream each is one primitive where MLX composes them of about a dozen operations
// (each with its own dispatch), which made them half of a small model's decode step.
// Header-only templates over the element type T (anything convertible to and from float):
// the MLX shim instantiates them with MLX's float16/bfloat16 types.
#pragma once

#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace lt {

// A 4-D strided view (elements), e.g. a KV cache's (B, H, S, D) slice of its buffer.
struct View4 {
  const void* data;
  int64_t shape[4], strides[4];
};

// mx.fast.rope: positions offset + l along axis 2 of x (B, H, L, D); the first `dims`
// features rotated in pairs (traditional: adjacent; else i and i + dims / 2) by
// (offset + l) * scale * base^(-2i / dims). out is (B, H, L, D) row-major, same type.
// attention: softmax(scale * q k^T [+ causal mask, aligned to the last keys]) v for
// q (B, Hq, L, D), k, v (B, Hkv, S, D), Hq a multiple of Hkv; out (B, Hq, L, D)
// row-major; float32 inside.
namespace detail {

template <typename T>
inline float at(const View4& a, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  const T* p = static_cast<const T*>(a.data);
  return static_cast<float>(
      p[i0 * a.strides[0] + i1 * a.strides[1] + i2 * a.strides[2] + i3 * a.strides[3]]);
}

}  // namespace detail

// The position of row b's first query: `offsets` (one int32 per row, or one for every
// row when `per_row` is false) or, without them, `offset`.
inline int64_t first_position(const int32_t* offsets, bool per_row, int offset, int64_t b) {
  return offsets ? (int64_t)offsets[per_row ? b : 0] : (int64_t)offset;
}

template <typename T>
void rope(const View4& x, int dims, bool traditional, float base, float scale, int offset,
          T* out, const int32_t* offsets = nullptr, bool per_row = false) {
  const int64_t B = x.shape[0], H = x.shape[1], L = x.shape[2], D = x.shape[3];
  const int half = dims / 2;
  std::vector<float> cs(L * half), sn(L * half);
  int64_t filled = INT64_MIN;  // the first position `cs` and `sn` hold
  for (int64_t b = 0; b < B; b++) {
    const int64_t p0 = first_position(offsets, per_row, offset, b);
    if (p0 != filled) {
      for (int64_t l = 0; l < L; l++) {
        for (int i = 0; i < half; i++) {
          double theta = std::pow((double)base, -2.0 * i / dims);
          double angle = (double)scale * (double)(p0 + l) * theta;
          cs[l * half + i] = (float)std::cos(angle);
          sn[l * half + i] = (float)std::sin(angle);
        }
      }
      filled = p0;
    }
    for (int64_t h = 0; h < H; h++)
      for (int64_t l = 0; l < L; l++) {
        T* o = out + ((b * H + h) * L + l) * D;
        const float* c = &cs[l * half];
        const float* s = &sn[l * half];
        for (int i = 0; i < half; i++) {
          int64_t i0 = traditional ? 2 * i : i, i1 = traditional ? 2 * i + 1 : i + half;
          float x0 = detail::at<T>(x, b, h, l, i0), x1 = detail::at<T>(x, b, h, l, i1);
          o[i0] = static_cast<T>(x0 * c[i] - x1 * s[i]);
          o[i1] = static_cast<T>(x0 * s[i] + x1 * c[i]);
        }
        for (int64_t d = dims; d < D; d++) o[d] = static_cast<T>(detail::at<T>(x, b, h, l, d));
      }
  }
}

namespace detail {

// sum_d a[d] * b[d], in order (one running sum: the rounding of the attention the
// tests' tolerances were measured with)
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; d++) s += a[d] * static_cast<float>(b[d]);
  return s;
}

}  // namespace detail

// `ranges` (B x 2 int32, or null for every key): row b attends to keys [start, stop) of
// its S, the causal mask aligned to `stop` (query l sees keys up to stop - L + l). A
// range over a longer buffer computes what the keys [start, stop) alone would give.
// `merged`: out is (B, L, Hq * D) row-major instead (the heads side by side, as the
// output projection takes them: no transpose and reshape after it).
// attention_unit computes one unit u = b * Hq + h (every query of row b's head h), so that
// the units can be shared among threads; `scratch` holds 2 D + S floats.
template <typename T>
void attention_unit(const View4& q, const View4& k, const View4& v, float scale, bool causal,
                    T* out, const int32_t* ranges, bool merged, int64_t u, float* scratch) {
  const int64_t Hq = q.shape[1], L = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], S = k.shape[2], rep = Hq / Hkv;
  const int64_t b = u / Hq, h = u % Hq, g = h / rep;
  float *qv = scratch, *acc = scratch + D, *p = scratch + 2 * D;
  int64_t start = ranges ? ranges[2 * b] : 0, stop = ranges ? ranges[2 * b + 1] : S;
  start = start < 0 ? 0 : start;
  stop = stop > S ? S : stop;
  // rows of D contiguous values (a cache's usual layout) are read through pointers
  const bool rows = k.strides[3] == 1 && v.strides[3] == 1;
  const T* kb = static_cast<const T*>(k.data) + b * k.strides[0] + g * k.strides[1];
  const T* vb = static_cast<const T*>(v.data) + b * v.strides[0] + g * v.strides[1];
  for (int64_t l = 0; l < L; l++) {
    const int64_t end = causal ? stop - L + l + 1 : stop;  // the mask's lower-right alignment
    T* o = out + (merged ? (b * L + l) * Hq + h : (b * Hq + h) * L + l) * D;
    if (end <= start) {  // no key (a padding row): zeros, as a fully masked row
      for (int64_t d = 0; d < D; d++) o[d] = static_cast<T>(0.f);
      continue;
    }
    for (int64_t d = 0; d < D; d++) qv[d] = detail::at<T>(q, b, h, l, d) * scale;
    float mx = -INFINITY;
    int64_t s = start;
    if (rows) {
      // 8 keys at a time: each key's sum still in order (the same values as one key at a
      // time), the 8 sums independent of each other, so that they overlap in the CPU
      // instead of each addition waiting for the one before
      for (; s + 8 <= end; s += 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        const T* kr = kb + s * k.strides[2];
        const int64_t ks = k.strides[2];
        for (int64_t d = 0; d < D; d++) {
          const float qd = qv[d];
          for (int j = 0; j < 8; j++) acc[j] += qd * static_cast<float>(kr[j * ks + d]);
        }
        for (int j = 0; j < 8; j++) {
          p[s + j] = acc[j];
          mx = std::fmax(mx, acc[j]);
        }
      }
    }
    for (; s < end; s++) {
      float dot = 0.f;
      if (rows) {
        dot = detail::dot(qv, kb + s * k.strides[2], D);
      } else {
        for (int64_t d = 0; d < D; d++) dot += qv[d] * detail::at<T>(k, b, g, s, d);
      }
      p[s] = dot;
      mx = std::fmax(mx, dot);
    }
    float sum = 0.f;
    for (int64_t s = start; s < end; s++) {
      p[s] = std::exp(p[s] - mx);
      sum += p[s];
    }
    for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
    for (int64_t s = start; s < end; s++) {
      const float ps = p[s];
      if (rows) {
        const T* vr = vb + s * v.strides[2];
        for (int64_t d = 0; d < D; d++) acc[d] += ps * static_cast<float>(vr[d]);
      } else {
        for (int64_t d = 0; d < D; d++) acc[d] += ps * detail::at<T>(v, b, g, s, d);
      }
    }
    for (int64_t d = 0; d < D; d++) o[d] = static_cast<T>(acc[d] / sum);
  }
}

// Every unit in turn on the calling thread.
template <typename T>
void attention(const View4& q, const View4& k, const View4& v, float scale, bool causal, T* out,
               const int32_t* ranges = nullptr, bool merged = false) {
  std::vector<float> scratch(2 * q.shape[3] + k.shape[2]);
  for (int64_t u = 0; u < q.shape[0] * q.shape[1]; u++)
    attention_unit<T>(q, k, v, scale, causal, out, ranges, merged, u, scratch.data());
}

// MLX's CPU exp (mlx/backend/cpu/simd/math.h: 2^(x log2 e), its integer part by bit
// shifting, its fraction by Cephes' polynomial), operation for operation: with it the
// sigmoid below is MLX's to the bit.
inline float mlx_exp(float x0) {
  if (std::isnan(x0)) return x0;
  if (x0 > 88.0f) return INFINITY;
  if (x0 < -88.0f) return 0.f;
  float x = x0 * 1.442695f;
  float ipart = std::floor(x + 0.5f), fpart = x - ipart;
  x = 1.535336188319500e-4f;
  x = std::fma(x, fpart, 1.339887440266574e-3f);
  x = std::fma(x, fpart, 9.618437357674640e-3f);
  x = std::fma(x, fpart, 5.550332471162809e-2f);
  x = std::fma(x, fpart, 2.402264791363012e-1f);
  x = std::fma(x, fpart, 6.931472028550421e-1f);
  x = std::fma(x, fpart, 1.000000000000000f);
  int32_t e = ((int32_t)ipart + 127) << 23;
  float two;
  std::memcpy(&two, &e, sizeof two);
  return two * x;
}

// MLX's sigmoid (unary_ops.h): 1 / (1 + exp(|x|)), mirrored for x >= 0; each step rounded
// to T as MLX rounds it.
template <typename T>
inline T mlx_sigmoid(T x) {
  float ax = std::fabs(static_cast<float>(x));
  T e = static_cast<T>(mlx_exp(ax));
  T y = static_cast<T>(1.0f / (1.0f + static_cast<float>(e)));
  return static_cast<float>(x) < 0.f ? y : static_cast<T>(1.0f - static_cast<float>(y));
}

// silu(a) * b of y's rows [a | b] (rows of 2n values) -> rows of n: SwiGLU on a fused
// gate/up product's output (MLX: two slices and a fused sigmoid-multiply-multiply), as
// MLX computes nn.silu(a) * b: (a * sigmoid(a)) * b, rounded to T at each step.
template <typename T>
void swiglu(const T* y, int64_t rows, int64_t n, T* out) {
  for (int64_t r = 0; r < rows; r++) {
    const T* a = y + r * 2 * n;
    const T* b = a + n;
    T* o = out + r * n;
    for (int64_t i = 0; i < n; i++) {
      T silu = static_cast<T>(static_cast<float>(a[i]) * static_cast<float>(mlx_sigmoid(a[i])));
      o[i] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(b[i]));
    }
  }
}

// mx.fast.rms_norm of rows of n values (read as float32): y = x * rsqrt(mean(x^2) + eps) in float32, rounded
// to the output type, then times the weight (in the output type), as MLX composes it.
template <typename T>
void rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, T* out) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * n;
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) {
      ss += xr[i] * xr[i];
    }
    const float inv = 1.f / std::sqrt(ss / (float)n + eps);
    T* o = out + r * n;
    for (int64_t i = 0; i < n; i++) {
      T y = static_cast<T>(xr[i] * inv);
      T wi = static_cast<T>(w[i]);
      o[i] = static_cast<T>(static_cast<float>(y) * static_cast<float>(wi));
    }
  }
}

}  // namespace lt
