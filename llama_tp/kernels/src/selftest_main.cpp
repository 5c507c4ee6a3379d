// `selftest [bound]`: every SIMD kernel this CPU runs against the scalar one; exit 1 if
// any relative error exceeds the bound (default 1e-5). Built by tests for qemu-user.
#include <cstdio>
#include <cstdlib>

#include "selftest.h"

int main(int argc, char** argv) {
  double bound = argc > 1 ? std::atof(argv[1]) : 1e-5;
  bool ok;
  std::string report = lt::selftest(bound, &ok);
  std::fputs(report.c_str(), stdout);
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
