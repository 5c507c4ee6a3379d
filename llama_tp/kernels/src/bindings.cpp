// The Python module `llama_tp.kernels._ext` (nanobind, in MLX's nanobind domain so that
// its functions take and return mx.array).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "matmul.h"
#include "mlx/version.h"
#include "pool.h"
#include "profile.h"
#include "primitive.h"
#include "selftest.h"

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define LT_CALLGRIND(on) \
  do {                   \
    if (on) {            \
      CALLGRIND_START_INSTRUMENTATION; \
    } else {             \
      CALLGRIND_STOP_INSTRUMENTATION; \
    }                    \
  } while (0)
#else
#define LT_CALLGRIND(on) ((void)(on))
#endif

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "llama_tp's native quantized matrix-vector products on MLX's CPU stream";
  m.def("qmatmul", &lt::qmatmul, "x"_a, "w"_a, "scales"_a = nb::none(), "biases"_a = nb::none(),
        nb::kw_only(), "format"_a, "group_size"_a = 0, "lead"_a = 0, "stream"_a = nb::none(),
        "x (..., n) @ W^T for quantized W: GGUF blocks or MLX affine 4/8-bit.");
  m.def("qmatmul_swiglu", &lt::qmatmul_swiglu, "x"_a, "w"_a, "scales"_a = nb::none(),
        "biases"_a = nb::none(), nb::kw_only(), "format"_a, "group_size"_a = 0, "lead"_a = 0,
        "stream"_a = nb::none(), "qmatmul, then silu(gate) * up of its halves, one primitive.");
  m.def("qmatmul_add_norm", &lt::qmatmul_add_norm, "x"_a, "w"_a, "scales"_a = nb::none(),
        "biases"_a = nb::none(), nb::kw_only(), "format"_a, "group_size"_a = 0, "lead"_a = 0,
        "r"_a, "weight"_a, "eps"_a, "stream"_a = nb::none(),
        "qmatmul, then add_rms_norm(r, product): [r + product, its norm], one primitive.");
  m.def("qmatmul_heads", &lt::qmatmul_heads, "x"_a, "w"_a, "scales"_a = nb::none(),
        "biases"_a = nb::none(), nb::kw_only(), "format"_a, "group_size"_a = 0, "lead"_a = 0,
        "a"_a, "b"_a, "c"_a, "d"_a, "rope_dims"_a = 0, "traditional"_a = false, "base"_a = 0.f,
        "scale"_a = 1.f, "offset"_a = 0, "offsets"_a = nb::none(), "stream"_a = nb::none(),
        "qmatmul of (B, L, n), split into q/k/v heads (q, k rotated), one primitive.");
  m.def("dequantize", &lt::dequantize, "w"_a, nb::kw_only(), "format"_a, "lead"_a, "n"_a,
        "dtype"_a, "stream"_a = nb::none(), "Rows of GGUF blocks -> values [lead, lead + n).");
  m.def("rope", &lt::rope, "x"_a, nb::kw_only(), "dims"_a, "traditional"_a, "base"_a, "scale"_a,
        "offset"_a = 0, "offsets"_a = nb::none(), "stream"_a = nb::none(),
        "mx.fast.rope of (B, H, L, D) from `offset` or an int32 array `offsets`, one primitive.");
  m.def("attention", &lt::attention, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a, "causal"_a,
        "ranges"_a = nb::none(), "merged"_a = false, "stream"_a = nb::none(),
        "Attention of (B, Hq, L, D) over (B, Hkv, S, D) [keys ranges (B, 2)], one primitive; "
        "merged: out (B, L, Hq * D).");
  m.def("split_heads", &lt::split_heads, "y"_a, "a"_a, "b"_a, "c"_a, "d"_a, nb::kw_only(),
        "rope_dims"_a = 0, "traditional"_a = false, "base"_a = 0.f, "scale"_a = 1.f,
        "offset"_a = 0, "offsets"_a = nb::none(), "stream"_a = nb::none(),
        "(B, L, (a+b+c)*d) -> heads (B, a, L, d), (B, b, L, d), (B, c, L, d), one primitive; "
        "with rope_dims, q and k rotated as rope's.");
  m.def("swiglu", &lt::swiglu, "y"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(y[..., :n]) * y[..., n:] of (..., 2n), one primitive.");
  m.def("rms_norm", &lt::rms_norm, "x"_a, "weight"_a, nb::kw_only(), "eps"_a,
        "stream"_a = nb::none(), "mx.fast.rms_norm of (..., n) with weight (n,), one primitive.");
  m.def("add_rms_norm", &lt::add_rms_norm, "x"_a, "r"_a, "weight"_a, nb::kw_only(), "eps"_a,
        "stream"_a = nb::none(), "(x + r, rms_norm(x + r, weight)), one primitive.");
  m.def("isa", &lt::isa, "The instruction set in use.");
  m.def("set_isa", &lt::set_isa, "name"_a, "Use another instruction set this CPU runs.");
  m.def("compiled_isas", [] {
    int n;
    const lt::Kernels* const* all = lt::compiled_kernels(&n);
    std::vector<std::pair<std::string, bool>> out;
    for (int i = 0; i < n; i++) out.emplace_back(all[i]->isa, lt::cpu_supports(all[i]->isa));
    return out;
  }, "(instruction set, this CPU runs it) for each one compiled in.");
  m.def("threads", [] { return lt::Pool::get().threads(); });
  m.def("profile", [](bool on) {
    for (int i = 0; i < lt::prof::KINDS; i++) {
      lt::prof::ns[i] = 0;
      lt::prof::calls[i] = 0;
    }
    lt::prof::on = on;
  }, "on"_a, "Start (and zero) or stop counting the primitives' calls and time.");
  m.def("profile_counts", [] {
    std::vector<std::tuple<std::string, int64_t, int64_t>> out;
    for (int i = 0; i < lt::prof::KINDS; i++)
      out.emplace_back(lt::prof::NAMES[i], lt::prof::calls[i].load(), lt::prof::ns[i].load());
    return out;
  }, "(kind, calls, nanoseconds) of each primitive kind since profile(True).");
  m.def("callgrind", [](bool on) { LT_CALLGRIND(on); }, "on"_a,
        "Under valgrind --tool=callgrind --instr-atstart=no: count instructions from here "
        "(on) or stop (no effect otherwise).");
  m.def("thread_ids", [] {
    return std::make_pair(lt::prof::stream_tid.load(), lt::Pool::get().worker_tids());
  }, "(the stream thread that last ran a profiled task, the pool's worker threads).");
  m.def("read_bandwidth", &lt::read_bandwidth, "bytes"_a, "reps"_a = 5,
        "GB/s of reading a buffer of this many bytes over the pool's threads (best of reps).");
  m.def("set_threads", [](int n) { lt::Pool::get().set_threads(n); }, "n"_a);
  m.def("mlx_version", [] { return std::string(mlx::core::version()); },
        "The version of the MLX library this module is linked against.");
  m.attr("BUILT_WITH_MLX") = std::to_string(MLX_VERSION_MAJOR) + "." +
                             std::to_string(MLX_VERSION_MINOR) + "." +
                             std::to_string(MLX_VERSION_PATCH);
  m.def("selftest", [](double bound) {
    bool ok;
    std::string report = lt::selftest(bound, &ok);
    return std::make_pair(report, ok);
  }, "bound"_a = 1e-5, "Every SIMD kernel this CPU runs against the scalar one.");
}
