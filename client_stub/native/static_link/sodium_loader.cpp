// libsodium for libzmq's CURVE, loaded at run time: the copy beside the stub (the build puts
// one there, so that phos/stub stands alone on a machine without libsodium, as GPU machines
// and GPU-less clients often are), else the system's libsodium.so.23.
//
// libsodium.a cannot be linked into a shared object (local-exec TLS), and linking the shared
// libsodium would make every program that loads the stub need it. So the stub defines the
// libsodium functions libzmq.a calls as forwarders to that library, which it opens
// only when CURVE keys are configured (load_sodium, before the first socket): a program
// that uses no keys never loads it. zmq_ctx_new calls sodium_init and its end
// randombytes_close: answered here too (libsodium's own answers) while nothing is loaded.
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

void* library = nullptr;
constexpr const char* kSoname = "libsodium.so.23";

// The copy in the directory this library was loaded from, if there is one.
std::string beside_the_stub() {
    Dl_info info{};
    if (!dladdr(reinterpret_cast<void*>(&beside_the_stub), &info) || !info.dli_fname) return {};
    std::string path = info.dli_fname;
    size_t slash = path.rfind('/');
    return slash == std::string::npos ? std::string() : path.substr(0, slash + 1) + kSoname;
}

void* symbol(const char* name) {
    void* f = library ? dlsym(library, name) : nullptr;
    if (!f) {
        fprintf(stderr, "phos: %s is needed for CURVE, and libsodium.so.23 %s\n", name,
                library ? "lacks it" : "was not loaded");
        abort();
    }
    return f;
}

}  // namespace

extern "C" {

// Opens libsodium.so.23 and initialises it; false (with the loader's reason in `why`) if it
// cannot be. Called once by the stub, on its own thread, before any socket exists.
__attribute__((visibility("hidden"))) bool phos_load_sodium(const char** why) {
    if (library) return true;
    static std::string reason;
    std::string own = beside_the_stub();
    void* lib = own.empty() ? nullptr : dlopen(own.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        reason = own.empty() ? std::string() : std::string(dlerror()) + "; ";
        lib = dlopen(kSoname, RTLD_NOW | RTLD_LOCAL);
    }
    if (!lib) {
        reason += dlerror();
        *why = reason.c_str();
        return false;
    }
    auto init = reinterpret_cast<int (*)()>(dlsym(lib, "sodium_init"));
    if (!init || init() < 0) {
        *why = "sodium_init failed";
        dlclose(lib);
        return false;
    }
    library = lib;
    return true;
}

__attribute__((visibility("hidden"))) int sodium_init() {
    return library ? reinterpret_cast<int (*)()>(symbol("sodium_init"))() : 0;
}

__attribute__((visibility("hidden"))) int randombytes_close() {
    return library ? reinterpret_cast<int (*)()>(symbol("randombytes_close"))() : 0;
}

#define FORWARD(ret, name, params, args)                                                  \
    __attribute__((visibility("hidden"))) ret name params {                             \
        static const auto real = reinterpret_cast<ret(*) params>(symbol(#name));       \
        return real args;                                                              \
    }

using uc = unsigned char;
using ull = unsigned long long;

FORWARD(int, crypto_box, (uc* c, const uc* m, ull mlen, const uc* n, const uc* pk, const uc* sk), (c, m, mlen, n, pk, sk))
FORWARD(int, crypto_box_open, (uc* m, const uc* c, ull clen, const uc* n, const uc* pk, const uc* sk), (m, c, clen, n, pk, sk))
FORWARD(int, crypto_box_afternm, (uc* c, const uc* m, ull mlen, const uc* n, const uc* k), (c, m, mlen, n, k))
FORWARD(int, crypto_box_open_afternm, (uc* m, const uc* c, ull clen, const uc* n, const uc* k), (m, c, clen, n, k))
FORWARD(int, crypto_box_easy_afternm, (uc* c, const uc* m, ull mlen, const uc* n, const uc* k), (c, m, mlen, n, k))
FORWARD(int, crypto_box_open_easy_afternm, (uc* m, const uc* c, ull clen, const uc* n, const uc* k), (m, c, clen, n, k))
FORWARD(int, crypto_box_beforenm, (uc* k, const uc* pk, const uc* sk), (k, pk, sk))
FORWARD(int, crypto_box_keypair, (uc* pk, uc* sk), (pk, sk))
FORWARD(int, crypto_scalarmult_base, (uc* q, const uc* n), (q, n))
FORWARD(int, crypto_secretbox, (uc* c, const uc* m, ull mlen, const uc* n, const uc* k), (c, m, mlen, n, k))
FORWARD(int, crypto_secretbox_open, (uc* m, const uc* c, ull clen, const uc* n, const uc* k), (m, c, clen, n, k))
FORWARD(void, randombytes, (uc* buf, ull len), (buf, len))
FORWARD(void*, sodium_allocarray, (size_t count, size_t size), (count, size))
FORWARD(void, sodium_free, (void* p), (p))

}  // extern "C"
