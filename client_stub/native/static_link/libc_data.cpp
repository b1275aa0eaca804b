// Private copies of the few glibc symbols that Debian's libzmq.a reaches in a way a
// shared object cannot.
//
// Debian builds libzmq.a as position-independent *executable* code: it addresses
// `stderr` and `in6addr_any` PC-relative (R_X86_64_PC32), as if they lived in the same
// module. Defining hidden copies here makes them live in the same module. This file
// must not include <stdio.h> or <netinet/in.h>, which declare the real ones.
#include <dlfcn.h>

extern "C" {

// zmq prints its assertion failures here; it gets the process's real stderr at load time.
__attribute__((visibility("hidden"))) void* stderr = nullptr;

// The IPv6 wildcard address is all zeros by definition.
__attribute__((visibility("hidden"))) extern const unsigned char in6addr_any[16];
const unsigned char in6addr_any[16] = {0};

// libstdc++ skips atomic reference counts while this says the process is single
// threaded; zmq starts threads, so say "not single threaded" from the start.
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

}  // extern "C"

__attribute__((constructor(101))) static void bind_libc_data() {
    if (void* real = dlsym(RTLD_DEFAULT, "stderr")) stderr = *static_cast<void**>(real);
}
