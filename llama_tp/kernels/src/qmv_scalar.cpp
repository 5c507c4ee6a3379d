// The scalar reference of every format (what each SIMD kernel is tested against), the
// activation quantizer every instruction set shares, and the GGUF dequantizer.
#include <cmath>

#include "formats.h"

namespace lt {

int block_values(int format) {
  switch (format) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1:
    case Q8_0:
      return 32;
    case Q2_K:
    case Q3_K:
    case Q4_K:
    case Q5_K:
    case Q6_K:
      return 256;
    default:
      return 0;
  }
}

int block_bytes(int format) {
  switch (format) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

bool is_gguf(int format) { return block_values(format) > 0; }

int slot(int format) {
  switch (format) {
    case Q4_0: return 0;
    case Q4_1: return 1;
    case Q5_0: return 2;
    case Q5_1: return 3;
    case Q8_0: return 4;
    case Q2_K: return 5;
    case Q3_K: return 6;
    case Q4_K: return 7;
    case Q5_K: return 8;
    case Q6_K: return 9;
    case AFFINE4: return 10;
    case AFFINE8: return 11;
    default: return -1;
  }
}

int order_of(int format) { return format == AFFINE4 ? EVEN_ODD : NATURAL; }

void quantize_row(const float* x, int n, int lead, int k, int order, int16_t* q, float* d,
                  float* m, float* dm) {
  float v[32];
  int u[32];
  const bool even_odd = order & EVEN_ODD, paired = order & PAIRED;
  const int nc = k / 32;
  for (int c = 0; c < nc; c++) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) {
      int at = 32 * c + i - lead;
      v[i] = (at >= 0 && at < n) ? x[at] : 0.f;
      amax = std::fmax(amax, std::fabs(v[i]));
    }
    float dc = amax / 32767.f;
    float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int i = 0; i < 32; i++) {
      float t = v[i] * inv;
      u[i] = (int)(t + (t < 0.f ? -0.5f : 0.5f));  // to nearest, halves away from zero
    }
    d[c] = dc;
    for (int h = 0; h < 2; h++) {
      int s = 0;
      for (int i = 0; i < 16; i++) {
        int from = even_odd ? 2 * i + h : 16 * h + i;  // position of the half's i-th value
        s += u[from];
      }
      m[2 * c + h] = dc * (float)s;
    }
    dm[2 * c] = dc;
    dm[2 * c + 1] = m[2 * c] + m[2 * c + 1];
    // where half h of block c goes: its own 16 slots, or interleaved with its pair's
    bool in_pair = paired && (c % 2 == 1 || c + 1 < nc);
    for (int h = 0; h < 2; h++) {
      int16_t* out = in_pair ? q + 64 * (c / 2) + 32 * h + 16 * (c % 2) : q + 32 * c + 16 * h;
      for (int i = 0; i < 16; i++) out[i] = (int16_t)u[even_odd ? 2 * i + h : 16 * h + i];
    }
  }
}

namespace {

void rows_gguf(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  int per = block_values(w.format), bytes = block_bytes(w.format);
  int nb = w.k / per;
  int u[32];
  float A[2], B[2];
  for (int r = r0; r < r1; r++) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    float acc = 0.f;
    for (int b = 0; b < nb; b++) {
      for (int j = 0; j < per / 32; j++) {
        decode_chunk(w.format, row + (size_t)b * bytes, j, u, A, B);
        int c = b * per / 32 + j;
        const int16_t* q = x.q + 32 * c;
        for (int h = 0; h < 2; h++) {
          int s = 0;
          for (int i = 16 * h; i < 16 * h + 16; i++) s += u[i] * q[i];
          acc += A[h] * x.d[c] * (float)s + B[h] * x.m[2 * c + h];
        }
      }
    }
    y[r - r0] = acc;
  }
}

void rows_affine(const Matrix& w, const XRow& x, int r0, int r1, float* y) {
  bool four = w.format == AFFINE4;
  for (int r = r0; r < r1; r++) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    size_t g0 = (size_t)r * w.groups;
    float acc = 0.f;
    for (int c = 0; c < w.k / 32; c++) {
      size_t g = g0 + (size_t)c * 32 / w.group_size;
      float A = scale_at(w.scales, w.scale_type, g), B = scale_at(w.biases, w.scale_type, g);
      const int16_t* q = x.q + 32 * c;
      int s = 0;
      for (int i = 0; i < 16; i++) {
        if (four) {  // q holds the even positions, then the odd ones (EVEN_ODD)
          uint8_t byte = row[16 * c + i];
          s += (byte & 15) * q[i] + (byte >> 4) * q[16 + i];
        } else {
          s += row[32 * c + i] * q[i] + row[32 * c + 16 + i] * q[16 + i];
        }
      }
      acc += A * x.d[c] * (float)s + B * (x.m[2 * c] + x.m[2 * c + 1]);
    }
    y[r - r0] = acc;
  }
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k = {
      "scalar",
      {rows_gguf, rows_gguf, rows_gguf, rows_gguf, rows_gguf, rows_gguf, rows_gguf, rows_gguf,
       rows_gguf, rows_gguf, rows_affine, rows_affine},
  };
  return k;
}

void dequantize_rows(int format, const uint8_t* data, size_t row_bytes, int rows, int lead,
                     int n, float* out) {
  int per = block_values(format), bytes = block_bytes(format);
  int u[32];
  float A[2], B[2];
  for (int r = 0; r < rows; r++) {
    const uint8_t* row = data + (size_t)r * row_bytes;
    float* o = out + (size_t)r * n;
    for (int c = lead / 32; c * 32 < lead + n; c++) {
      int b = c * 32 / per, j = (c * 32 % per) / 32;
      decode_chunk(format, row + (size_t)b * bytes, j, u, A, B);
      for (int i = 0; i < 32; i++) {
        int at = 32 * c + i - lead;
        if (at >= 0 && at < n) o[at] = A[i / 16] * (float)u[i] + B[i / 16];
      }
    }
  }
}

void to_float(const void* src, int type, size_t n, float* out) {
  for (size_t i = 0; i < n; i++) out[i] = scale_at(src, type, i);
}

}  // namespace lt
