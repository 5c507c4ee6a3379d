// arm64 NEON kernels (baseline ARMv8-A: no dot-product extension needed, the products
// are int16 x int16 -> int32 with vmlal_s16). Same method and chunk decoding as
// qmv_x86.cpp: 32 weights -> 32 bytes u, widened to int16, multiplied with the int16
// activations; each half's int32 sum scaled by A * dx in float.
#include <arm_neon.h>

#include "formats.h"

namespace lt {
namespace neon {
namespace {

struct U32 {
  uint8x16_t lo, hi;  // values 0-15, 16-31 of a chunk
};

// u . q over one half of 16 -> int32x4 partial sums
inline int32x4_t half_dot(uint8x16_t u, const int16_t* q) {
  int16x8_t w0 = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(u)));
  int16x8_t w1 = vreinterpretq_s16_u16(vmovl_high_u8(u));
  int16x8_t q0 = vld1q_s16(q), q1 = vld1q_s16(q + 8);
  int32x4_t s = vmull_s16(vget_low_s16(w0), vget_low_s16(q0));
  s = vmlal_high_s16(s, w0, q0);
  s = vmlal_s16(s, vget_low_s16(w1), vget_low_s16(q1));
  return vmlal_high_s16(s, w1, q1);
}

inline int32x4_t half_dot_signed(int8x16_t u, const int16_t* q) {
  int16x8_t w0 = vmovl_s8(vget_low_s8(u)), w1 = vmovl_high_s8(u);
  int16x8_t q0 = vld1q_s16(q), q1 = vld1q_s16(q + 8);
  int32x4_t s = vmull_s16(vget_low_s16(w0), vget_low_s16(q0));
  s = vmlal_high_s16(s, w0, q0);
  s = vmlal_s16(s, vget_low_s16(w1), vget_low_s16(q1));
  return vmlal_high_s16(s, w1, q1);
}

inline float32x4_t fma_same(U32 u, const int16_t* q, float s, float32x4_t acc) {
  int32x4_t p = vaddq_s32(half_dot(u.lo, q), half_dot(u.hi, q + 16));
  return vfmaq_n_f32(acc, vcvtq_f32_s32(p), s);
}

inline float32x4_t fma_halves(U32 u, const int16_t* q, float s0, float s1, float32x4_t acc) {
  acc = vfmaq_n_f32(acc, vcvtq_f32_s32(half_dot(u.lo, q)), s0);
  return vfmaq_n_f32(acc, vcvtq_f32_s32(half_dot(u.hi, q + 16)), s1);
}

// 16 bytes -> 32 values: the low nibbles (values 0-15), then the high ones (16-31).
inline U32 nibbles16(const uint8_t* p) {
  uint8x16_t b = vld1q_u8(p);
  return {vandq_u8(b, vdupq_n_u8(15)), vshrq_n_u8(b, 4)};
}

// 32 bytes (natural order) as two halves.
inline U32 load32(const uint8_t* p) { return {vld1q_u8(p), vld1q_u8(p + 16)}; }

// 16 bits -> 16 bytes, 16 where the bit is set (Q5_0/Q5_1's fifth bits).
inline uint8x16_t fifth_bits16(uint32_t bits) {
  const uint8x16_t mask = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  uint8x16_t b = vcombine_u8(vdup_n_u8(bits & 0xff), vdup_n_u8((bits >> 8) & 0xff));
  return vandq_u8(vtstq_u8(b, mask), vdupq_n_u8(16));
}

template <int F>
void rows_small(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  constexpr bool MIN = F == Q4_1 || F == Q5_1, FIVE = F == Q5_0 || F == Q5_1;
  const int bytes = block_bytes(F), nb = w.k / 32;
  for (int r = r0; r < r1; r++) {
    const uint8_t* blk = w.data + (size_t)r * w.row_bytes;
    float32x4_t acc = vdupq_n_f32(0.f);
    float off = 0.f;
    for (int c = 0; c < nb; c++, blk += bytes) {
      float d = load_f16(blk);
      const int16_t* q = x.q + 32 * c;
      if (F == Q8_0) {
        int8x16_t a = vld1q_s8((const int8_t*)blk + 2), b = vld1q_s8((const int8_t*)blk + 18);
        int32x4_t p = vaddq_s32(half_dot_signed(a, q), half_dot_signed(b, q + 16));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(p), d * x.d[c]);
        continue;
      }
      U32 u = nibbles16(blk + (MIN ? 4 : 2) + (FIVE ? 4 : 0));
      if (FIVE) {
        uint32_t qh;
        std::memcpy(&qh, blk + (MIN ? 4 : 2), 4);
        u.lo = vorrq_u8(u.lo, fifth_bits16(qh));
        u.hi = vorrq_u8(u.hi, fifth_bits16(qh >> 16));
      }
      acc = fma_same(u, q, d * x.d[c], acc);
      float b = MIN ? load_f16(blk + 2) : -d * (FIVE ? 16.f : 8.f);
      off += b * (x.m[2 * c] + x.m[2 * c + 1]);
    }
    y[r - r0] = vaddvq_f32(acc) + off;
  }
}

inline uint8x16_t shr(uint8x16_t v, int n) { return vshlq_u8(v, vdupq_n_s8((int8_t)-n)); }

template <int F>
void rows_k(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  const int bytes = block_bytes(F), nb = w.k / 256;
  const uint8x16_t m4 = vdupq_n_u8(15), m3 = vdupq_n_u8(3), m1 = vdupq_n_u8(1);
  for (int r = r0; r < r1; r++) {
    const uint8_t* blk = w.data + (size_t)r * w.row_bytes;
    float32x4_t acc = vdupq_n_f32(0.f);
    float off = 0.f;
    for (int b = 0; b < nb; b++, blk += bytes) {
      const int16_t* q = x.q + 256 * b;
      const float* dx = x.d + 8 * b;
      const float* mx = x.m + 16 * b;
      if (F == Q4_K || F == Q5_K) {
        uint8_t sc[8], mn[8];
        k4_scale_min(blk + 4, sc, mn);
        float d = load_f16(blk), dmin = load_f16(blk + 2);
        const uint8_t* qs = blk + (F == Q5_K ? 48 : 16);
        U32 qh = load32(blk + 16);
        for (int j = 0; j < 8; j++) {
          U32 bits = load32(qs + 32 * (j / 2));
          int s = 4 * (j % 2);
          U32 u = {vandq_u8(shr(bits.lo, s), m4), vandq_u8(shr(bits.hi, s), m4)};
          if (F == Q5_K) {
            u.lo = vorrq_u8(u.lo, vshlq_n_u8(vandq_u8(shr(qh.lo, j), m1), 4));
            u.hi = vorrq_u8(u.hi, vshlq_n_u8(vandq_u8(shr(qh.hi, j), m1), 4));
          }
          acc = fma_same(u, q + 32 * j, d * sc[j] * dx[j], acc);
          off -= dmin * mn[j] * (mx[2 * j] + mx[2 * j + 1]);
        }
      } else if (F == Q6_K) {
        const int8_t* sc = (const int8_t*)(blk + 192);
        float d = load_f16(blk + 208);
        for (int j = 0; j < 8; j++) {
          U32 ql = load32(blk + 64 * (j / 4) + 32 * (j % 2));
          U32 qh = load32(blk + 128 + 32 * (j / 4));
          int ls = 4 * ((j % 4) / 2), hs = 2 * (j % 4);
          U32 u = {vorrq_u8(vandq_u8(shr(ql.lo, ls), m4), vshlq_n_u8(vandq_u8(shr(qh.lo, hs), m3), 4)),
                   vorrq_u8(vandq_u8(shr(ql.hi, ls), m4), vshlq_n_u8(vandq_u8(shr(qh.hi, hs), m3), 4))};
          float a0 = d * sc[2 * j], a1 = d * sc[2 * j + 1];
          acc = fma_halves(u, q + 32 * j, a0 * dx[j], a1 * dx[j], acc);
          off -= 32.f * (a0 * mx[2 * j] + a1 * mx[2 * j + 1]);
        }
      } else if (F == Q3_K) {
        int sc[16];
        k3_scales(blk + 96, sc);
        float d = load_f16(blk + 108);
        U32 hm = load32(blk);
        for (int j = 0; j < 8; j++) {
          U32 qs = load32(blk + 32 + 32 * (j / 4));
          int s = 2 * (j % 4);
          U32 u = {vorrq_u8(vandq_u8(shr(qs.lo, s), m3), vshlq_n_u8(vandq_u8(shr(hm.lo, j), m1), 2)),
                   vorrq_u8(vandq_u8(shr(qs.hi, s), m3), vshlq_n_u8(vandq_u8(shr(hm.hi, j), m1), 2))};
          float a0 = d * sc[2 * j], a1 = d * sc[2 * j + 1];
          acc = fma_halves(u, q + 32 * j, a0 * dx[j], a1 * dx[j], acc);
          off -= 4.f * (a0 * mx[2 * j] + a1 * mx[2 * j + 1]);
        }
      } else {  // Q2_K
        const uint8_t* sc = blk;
        float d = load_f16(blk + 80), dmin = load_f16(blk + 82);
        for (int j = 0; j < 8; j++) {
          U32 qs = load32(blk + 16 + 32 * (j / 4));
          int s = 2 * (j % 4);
          U32 u = {vandq_u8(shr(qs.lo, s), m3), vandq_u8(shr(qs.hi, s), m3)};
          float a0 = d * (sc[2 * j] & 15), a1 = d * (sc[2 * j + 1] & 15);
          acc = fma_halves(u, q + 32 * j, a0 * dx[j], a1 * dx[j], acc);
          off -= dmin * ((sc[2 * j] >> 4) * mx[2 * j] + (sc[2 * j + 1] >> 4) * mx[2 * j + 1]);
        }
      }
    }
    y[r - r0] = vaddvq_f32(acc) + off;
  }
}

template <int F, int S>
void rows_affine_t(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  constexpr int STEP = F == AFFINE4 ? 16 : 32;
  const int per_group = w.group_size / 32, ng = w.k / w.group_size;
  for (int r = r0; r < r1; r++) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    size_t g0 = (size_t)r * w.groups;
    float32x4_t acc = vdupq_n_f32(0.f);
    float off = 0.f;
    for (int g = 0, c = 0; g < ng; g++) {
      float a = scale_at(w.scales, S, g0 + g), b = scale_at(w.biases, S, g0 + g);
      for (int e = c + per_group; c < e; c++) {
        U32 u = F == AFFINE4 ? nibbles16(row + STEP * c) : load32(row + STEP * c);
        acc = fma_same(u, x.q + 32 * c, a * x.d[c], acc);
        off += b * (x.m[2 * c] + x.m[2 * c + 1]);
      }
    }
    y[r - r0] = vaddvq_f32(acc) + off;
  }
}

template <int F>
void rows_affine(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  switch (w.scale_type) {
    case F32: return rows_affine_t<F, F32>(w, x, r0, r1, y);
    case F16: return rows_affine_t<F, F16>(w, x, r0, r1, y);
    default: return rows_affine_t<F, BF16>(w, x, r0, r1, y);
  }
}

}  // namespace

extern const Kernels kernels = {
    "neon",
    {rows_small<Q4_0>, rows_small<Q4_1>, rows_small<Q5_0>, rows_small<Q5_1>, rows_small<Q8_0>,
     rows_k<Q2_K>, rows_k<Q3_K>, rows_k<Q4_K>, rows_k<Q5_K>, rows_k<Q6_K>,
     rows_affine<AFFINE4>, rows_affine<AFFINE8>},
};

}  // namespace neon
}  // namespace lt
