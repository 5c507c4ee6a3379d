#include "profile.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace lt::prof {

std::atomic<bool> on{false};
std::atomic<int64_t> ns[KINDS], calls[KINDS];
std::atomic<int> stream_tid{-1};

int this_tid() {
#if defined(__linux__)
  return (int)syscall(SYS_gettid);
#else
  return -1;
#endif
}

}  // namespace lt::prof
