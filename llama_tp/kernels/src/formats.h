// The GGUF block layouts (as ggml stores them) and scalar helpers shared by every
// instruction set: float16/bfloat16 conversion, the K-quants' packed scales, and the
// decoding of one 32-value chunk into integers u and per-16 (A, B), w = A * u + B.
#pragma once

#include <cstdint>
#include <cstring>

#include "qmv.h"

namespace lt {

inline float f16_to_f32(uint16_t h) {
  // IEEE half -> float, exact, without F16C (the scalar path runs anywhere).
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float load_f16(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

inline float scale_at(const void* s, int type, size_t i) {
  switch (type) {
    case F32:
      return static_cast<const float*>(s)[i];
    case F16:
      return f16_to_f32(static_cast<const uint16_t*>(s)[i]);
    default:
      return bf16_to_f32(static_cast<const uint16_t*>(s)[i]);
  }
}

// Q4_K / Q5_K: 12 bytes of eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4).
inline void k4_scale_min(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; j++) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q3_K: 12 bytes of sixteen 6-bit scales, offset by 32.
inline void k3_scales(const uint8_t* s, int sc[16]) {
  for (int k = 0; k < 16; k++) {
    int lo = k < 8 ? (s[k] & 15) : (s[k - 8] >> 4);
    int hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
    sc[k] = (lo | hi << 4) - 32;
  }
}

// Chunk j (32 values) of one GGUF block: u[32] (the integers as stored, 0 <= u < 2^bits;
// Q8_0: signed), and A[2], B[2] of its two halves of 16.
inline void decode_chunk(int format, const uint8_t* b, int j, int u[32], float A[2],
                         float B[2]) {
  switch (format) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      float d = load_f16(b);
      bool has_min = format == Q4_1 || format == Q5_1;
      bool five = format == Q5_0 || format == Q5_1;
      const uint8_t* p = b + (has_min ? 4 : 2);
      uint32_t qh = 0;
      if (five) {
        std::memcpy(&qh, p, 4);
        p += 4;
      }
      for (int i = 0; i < 16; i++) {
        u[i] = (p[i] & 15) | (five ? ((qh >> i) & 1) << 4 : 0);
        u[i + 16] = (p[i] >> 4) | (five ? ((qh >> (i + 16)) & 1) << 4 : 0);
      }
      float bias = has_min ? load_f16(b + 2) : -d * (five ? 16.f : 8.f);
      A[0] = A[1] = d;
      B[0] = B[1] = bias;
      return;
    }
    case Q8_0: {
      for (int i = 0; i < 32; i++) u[i] = (int8_t)b[2 + i];
      A[0] = A[1] = load_f16(b);
      B[0] = B[1] = 0.f;
      return;
    }
    case Q2_K: {
      const uint8_t* sc = b;
      const uint8_t* qs = b + 16 + 32 * (j / 4);
      int shift = 2 * (j % 4);
      float d = load_f16(b + 80), dmin = load_f16(b + 82);
      for (int i = 0; i < 32; i++) u[i] = (qs[i] >> shift) & 3;
      for (int h = 0; h < 2; h++) {
        A[h] = d * (sc[2 * j + h] & 15);
        B[h] = -dmin * (sc[2 * j + h] >> 4);
      }
      return;
    }
    case Q3_K: {
      const uint8_t* hm = b;
      const uint8_t* qs = b + 32 + 32 * (j / 4);
      int shift = 2 * (j % 4);
      int sc[16];
      k3_scales(b + 96, sc);
      float d = load_f16(b + 108);
      for (int i = 0; i < 32; i++) u[i] = ((qs[i] >> shift) & 3) | (((hm[i] >> j) & 1) << 2);
      for (int h = 0; h < 2; h++) {
        A[h] = d * sc[2 * j + h];
        B[h] = -4.f * A[h];
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      uint8_t sc[8], mn[8];
      k4_scale_min(b + 4, sc, mn);
      bool five = format == Q5_K;
      const uint8_t* qs = b + (five ? 48 : 16) + 32 * (j / 2);
      int shift = 4 * (j % 2);
      for (int i = 0; i < 32; i++) {
        u[i] = (qs[i] >> shift) & 15;
        if (five) u[i] |= ((b[16 + i] >> j) & 1) << 4;
      }
      A[0] = A[1] = load_f16(b) * sc[j];
      B[0] = B[1] = -load_f16(b + 2) * mn[j];
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b + 64 * (j / 4) + 32 * (j % 2);
      const uint8_t* qh = b + 128 + 32 * (j / 4);
      int lshift = 4 * ((j % 4) / 2), hshift = 2 * (j % 4);
      const int8_t* sc = (const int8_t*)(b + 192);
      float d = load_f16(b + 208);
      for (int i = 0; i < 32; i++) u[i] = ((ql[i] >> lshift) & 15) | (((qh[i] >> hshift) & 3) << 4);
      for (int h = 0; h < 2; h++) {
        A[h] = d * sc[2 * j + h];
        B[h] = -32.f * A[h];
      }
      return;
    }
  }
}

}  // namespace lt
