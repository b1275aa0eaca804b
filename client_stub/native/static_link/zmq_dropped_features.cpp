// libzmq features the stub is built without, and why.
//
// Debian's libzmq.a is configured with CURVE (libsodium), GSSAPI (MIT Kerberos),
// PGM (OpenPGM) and NORM. The stub talks DEALER over ipc:// and tcp://, with the NULL
// mechanism or CURVE; CURVE's libsodium is loaded at run time (sodium_loader.cpp), as
// libsodium.a uses local-exec TLS and cannot be linked into a shared object. There are no
// static Kerberos or NORM archives. These stand-ins
// satisfy the linker; none is reached unless a socket is configured for that feature,
// which the stub never does. Should one be reached anyway, it says so and aborts.
#include <cstdio>
#include <cstdlib>

extern "C" {

__attribute__((noreturn, visibility("hidden"))) void phos_zmq_feature_missing(const char* name) {
    fprintf(stderr, "phos: libzmq in the stub is built without %s (GSSAPI, PGM and NORM are left out)\n", name);
    abort();
}

#define MISSING(name) \
    __attribute__((visibility("hidden"))) int name() { phos_zmq_feature_missing(#name); }

// GSSAPI (MIT Kerberos)
MISSING(gss_accept_sec_context)
MISSING(gss_acquire_cred)
MISSING(gss_delete_sec_context)
MISSING(gss_display_name)
MISSING(gss_import_name)
MISSING(gss_init_sec_context)
MISSING(gss_release_buffer)
MISSING(gss_release_cred)
MISSING(gss_release_name)
MISSING(gss_unwrap)
MISSING(gss_wrap)
__attribute__((visibility("hidden"))) void* GSS_C_NT_USER_NAME = nullptr;
__attribute__((visibility("hidden"))) void* GSS_C_NT_HOSTBASED_SERVICE = nullptr;

// PGM (OpenPGM). zmq_ctx_new initialises PGM and zmq_ctx_term shuts it down: both succeed.
__attribute__((visibility("hidden"))) int pgm_init(void**) { return 1; }
__attribute__((visibility("hidden"))) int pgm_shutdown() { return 1; }
MISSING(pgm_bind3)
MISSING(pgm_close)
MISSING(pgm_connect)
MISSING(pgm_error_free)
MISSING(pgm_free)
MISSING(pgm_freeaddrinfo)
MISSING(pgm_getaddrinfo)
MISSING(pgm_getsockopt)
MISSING(pgm_gsi_create_from_data)
MISSING(pgm_recvmsgv)
MISSING(pgm_send)
MISSING(pgm_setsockopt)
MISSING(pgm_socket)

// NORM
MISSING(NormCreateInstance)
MISSING(NormCreateSession)
MISSING(NormDestroyInstance)
MISSING(NormDestroySession)
MISSING(NormGetDescriptor)
MISSING(NormGetNextEvent)
MISSING(NormGetRandomSessionId)
MISSING(NormIsUnicastAddress)
MISSING(NormNodeDelete)
MISSING(NormObjectGetType)
MISSING(NormObjectGetUserData)
MISSING(NormObjectSetUserData)
MISSING(NormSetCongestionControl)
MISSING(NormSetDefaultSyncPolicy)
MISSING(NormSetDefaultUnicastNack)
MISSING(NormSetLoopback)
MISSING(NormSetMulticastInterface)
MISSING(NormSetRxPortReuse)
MISSING(NormSetTTL)
MISSING(NormStartReceiver)
MISSING(NormStartSender)
MISSING(NormStopInstance)
MISSING(NormStopReceiver)
MISSING(NormStopSender)
MISSING(NormStreamFlush)
MISSING(NormStreamOpen)
MISSING(NormStreamRead)
MISSING(NormStreamSeekMsgStart)
MISSING(NormStreamWrite)
__attribute__((visibility("hidden"))) void* NORM_INSTANCE_INVALID = nullptr;
__attribute__((visibility("hidden"))) void* NORM_SESSION_INVALID = nullptr;
__attribute__((visibility("hidden"))) void* NORM_OBJECT_INVALID = nullptr;
__attribute__((visibility("hidden"))) unsigned NORM_NODE_ANY = 0xffffffff;

// libbsd's strlcpy (glibc has it only from 2.38): used by the ws:// transport. No
// <string.h> here, whose newer versions declare it differently.
__attribute__((visibility("hidden"))) unsigned long strlcpy(char* dst, const char* src, unsigned long size) {
    unsigned long length = __builtin_strlen(src);
    if (size > 0) {
        unsigned long n = length < size - 1 ? length : size - 1;
        __builtin_memcpy(dst, src, n);
        dst[n] = '\0';
    }
    return length;
}

}  // extern "C"
