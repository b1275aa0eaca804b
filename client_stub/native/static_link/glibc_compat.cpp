// Stand-ins for glibc symbols newer than the stub's floor (glibc 2.34: Ubuntu 22.04, RHEL 9).
//
// The static libstdc++ linked into both libraries was built on glibc 2.36, and its
// std::random_device calls arc4random (new in 2.36). Defined here, hidden, the call
// stays inside the library and the library loads on older glibc.
#include <sys/random.h>

#include <cstdint>

extern "C" __attribute__((visibility("hidden"))) uint32_t arc4random(void) {
    uint32_t value = 0;
    while (getrandom(&value, sizeof value, 0) != static_cast<ssize_t>(sizeof value)) {
    }
    return value;
}
