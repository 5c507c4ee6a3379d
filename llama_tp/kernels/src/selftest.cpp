#include "selftest.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "formats.h"
#include "matmul.h"

namespace lt {

namespace {

uint16_t f32_to_f16(float f) {  // for test scales only: normal range, truncating
  uint32_t b;
  std::memcpy(&b, &f, 4);
  uint32_t sign = (b >> 16) & 0x8000;
  int exp = (int)((b >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return (uint16_t)sign;
  return (uint16_t)(sign | exp << 10 | ((b >> 13) & 0x3ff));
}

void put_f16(uint8_t* p, float f) {
  uint16_t h = f32_to_f16(f);
  std::memcpy(p, &h, 2);
}

// Random bytes for every block, with its float16 fields set to moderate values.
void random_blocks(int format, uint8_t* data, size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  for (size_t i = 0; i < n; i++) data[i] = (uint8_t)byte(rng);
  int bytes = block_bytes(format);
  if (bytes == 0) return;  // affine: scales are separate
  for (size_t at = 0; at + bytes <= n; at += bytes) {
    uint8_t* b = data + at;
    switch (format) {
      case Q4_0: case Q5_0: case Q8_0: put_f16(b, scale(rng)); break;
      case Q4_1: case Q5_1: put_f16(b, scale(rng)); put_f16(b + 2, -scale(rng) * 8); break;
      case Q2_K: put_f16(b + 80, scale(rng)); put_f16(b + 82, scale(rng)); break;
      case Q3_K: put_f16(b + 108, scale(rng)); break;
      case Q4_K: case Q5_K: put_f16(b, scale(rng)); put_f16(b + 2, scale(rng)); break;
      case Q6_K: put_f16(b + 208, scale(rng)); break;
    }
  }
}

const char* name_of(int format) {
  switch (format) {
    case Q4_0: return "Q4_0"; case Q4_1: return "Q4_1"; case Q5_0: return "Q5_0";
    case Q5_1: return "Q5_1"; case Q8_0: return "Q8_0"; case Q2_K: return "Q2_K";
    case Q3_K: return "Q3_K"; case Q4_K: return "Q4_K"; case Q5_K: return "Q5_K";
    case Q6_K: return "Q6_K"; case AFFINE4: return "affine4"; case AFFINE8: return "affine8";
    default: return "?";
  }
}

}  // namespace

double compare_with_scalar(const Kernels& k, int format, unsigned seed) {
  std::mt19937 rng(seed);
  double worst = 0;
  const int shapes[][3] = {{37, 2, 1}, {70, 3, 3}, {5, 1, 8}};  // rows, blocks / groups, batch
  for (auto& s : shapes) {
    int rows = s[0], B = s[2];
    Matrix w{};
    w.format = format;
    std::vector<uint8_t> data;
    std::vector<uint16_t> scales, biases;
    int lead = 0, n;
    if (is_gguf(format)) {
      int per = block_values(format);
      w.k = per * s[1];
      w.row_bytes = (size_t)block_bytes(format) * s[1];
      data.resize(w.row_bytes * rows);
      random_blocks(format, data.data(), data.size(), rng);
      lead = per > 32 ? 100 : 0;  // a slice starting inside the first block
      n = w.k - lead - (per > 32 ? 60 : 0);
    } else {
      int gs = 32 << (s[1] % 3);  // 32, 64, 128
      w.k = gs * (s[1] + 1);
      w.row_bytes = (size_t)w.k * (format == AFFINE4 ? 4 : 8) / 8;
      data.resize(w.row_bytes * rows);
      random_blocks(format, data.data(), data.size(), rng);
      w.group_size = gs;
      w.groups = w.k / gs;
      w.scale_type = F16;
      std::uniform_real_distribution<float> sc(0.001f, 0.05f);
      for (size_t i = 0; i < w.groups * rows; i++) {
        scales.push_back(f32_to_f16(sc(rng)));
        biases.push_back(f32_to_f16(-sc(rng) * 8));
      }
      w.scales = scales.data();
      w.biases = biases.data();
      n = w.k;
    }
    w.data = data.data();
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> x((size_t)B * n);
    for (auto& v : x) v = normal(rng);
    x[0] = 40.f;  // an outlier, as activations have
    std::vector<float> ya((size_t)B * rows), yb((size_t)B * rows);
    matmul(k, w, rows, x.data(), B, n, lead, ya.data());
    matmul(scalar_kernels(), w, rows, x.data(), B, n, lead, yb.data());
    double scale = 0, diff = 0;
    for (size_t i = 0; i < ya.size(); i++) {
      scale = std::fmax(scale, std::fabs(yb[i]));
      diff = std::fmax(diff, std::fabs((double)ya[i] - yb[i]));
    }
    worst = std::fmax(worst, diff / (scale > 0 ? scale : 1));
  }
  return worst;
}

std::string selftest(double bound, bool* ok) {
  static const int formats[] = {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
                                Q3_K, Q4_K, Q5_K, Q6_K, AFFINE4, AFFINE8};
  std::string out;
  *ok = true;
  int n;
  const Kernels* const* all = compiled_kernels(&n);
  for (int i = 0; i < n; i++) {
    if (!cpu_supports(all[i]->isa) || all[i] == &scalar_kernels()) continue;
    for (int f : formats) {
      double e = compare_with_scalar(*all[i], f, 1234 + f);
      char line[96];
      std::snprintf(line, sizeof line, "%s %s %.3g\n", all[i]->isa, name_of(f), e);
      out += line;
      if (!(e <= bound)) *ok = false;
    }
  }
  return out;
}

}  // namespace lt
