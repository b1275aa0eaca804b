// What Cap'n Proto's libkj needs from its exception.c++, for linking into a shared object.
//
// Debian's libkj.a builds exception.o with local-exec TLS (R_X86_64_TPOFF32), which a
// shared object cannot contain, so the Makefile leaves that one member out and links
// this instead: the same entry points (declared in <kj/exception.h>), written small.
// Failures become C++ exceptions of type kj::Exception, which wire.cpp catches; there
// are no stack traces. Only what the stub's use of libcapnp and libkj reaches is here.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include <kj/exception.h>
#include <kj/function.h>

namespace kj {

namespace {
thread_local ExceptionCallback* current_callback = nullptr;   // global-dynamic TLS: fine in a .so
}

class ExceptionCallback::RootExceptionCallback : public ExceptionCallback {
public:
    RootExceptionCallback() : ExceptionCallback(*this) {}

    void onRecoverableException(Exception&& exception) override { throw Exception(kj::mv(exception)); }
    void onFatalException(Exception&& exception) override { throw Exception(kj::mv(exception)); }
    void logMessage(LogSeverity, const char* file, int line, int, String&& text) override {
        fprintf(stderr, "phos: capnp: %s:%d: %s\n", file, line, text.cStr());
    }
    StackTraceMode stackTraceMode() override { return StackTraceMode::NONE; }
    Function<void(Function<void()>)> getThreadInitializer() override {
        return [](Function<void()> run) { run(); };
    }
};

ExceptionCallback::ExceptionCallback() : next(getExceptionCallback()) { current_callback = this; }
ExceptionCallback::ExceptionCallback(ExceptionCallback& next) : next(next) {}
ExceptionCallback::~ExceptionCallback() noexcept(false) {
    if (&next != this) current_callback = &next;
}
void ExceptionCallback::onRecoverableException(Exception&& e) { next.onRecoverableException(kj::mv(e)); }
void ExceptionCallback::onFatalException(Exception&& e) { next.onFatalException(kj::mv(e)); }
void ExceptionCallback::logMessage(LogSeverity severity, const char* file, int line, int depth, String&& text) {
    next.logMessage(severity, file, line, depth, kj::mv(text));
}
ExceptionCallback::StackTraceMode ExceptionCallback::stackTraceMode() { return next.stackTraceMode(); }
Function<void(Function<void()>)> ExceptionCallback::getThreadInitializer() { return next.getThreadInitializer(); }

ExceptionCallback& getExceptionCallback() {
    static ExceptionCallback::RootExceptionCallback root;
    return current_callback ? *current_callback : root;
}

void throwFatalException(Exception&& exception, uint) {
    getExceptionCallback().onFatalException(kj::mv(exception));
    std::abort();   // a callback that returns from a fatal exception
}

void throwRecoverableException(Exception&& exception, uint) {
    getExceptionCallback().onRecoverableException(kj::mv(exception));
}

Exception::Exception(Type type, const char* file, int line, String description) noexcept
    : file(file), line(line), type(type), description(kj::mv(description)), traceCount(0) {}

Exception::Exception(Type type, String file, int line, String description) noexcept
    : ownFile(kj::mv(file)), file(ownFile.cStr()), line(line), type(type), description(kj::mv(description)),
      traceCount(0) {}

Exception::Exception(const Exception& other) noexcept
    : file(other.file), line(other.line), type(other.type), description(heapString(other.description)),
      remoteTrace(heapString(other.remoteTrace)), traceCount(other.traceCount) {
    if (other.file == other.ownFile.cStr()) {
        ownFile = heapString(other.ownFile);
        file = ownFile.cStr();
    }
    for (uint i = 0; i < traceCount; i++) trace[i] = other.trace[i];
    KJ_IF_MAYBE(c, other.context) { context = heap<Context>(**c); }
}

Exception::~Exception() noexcept {}

Exception::Context::Context(const Context& other) noexcept
    : file(other.file), line(other.line), description(heapString(other.description)) {
    KJ_IF_MAYBE(n, other.next) { next = heap<Context>(**n); }
}

void Exception::wrapContext(const char* file, int line, String&& description) {
    context = heap<Context>(file, line, kj::mv(description), kj::mv(context));
}

void Exception::addTrace(void* ptr) {
    if (traceCount < sizeof(trace) / sizeof(trace[0])) trace[traceCount++] = ptr;
}
void Exception::addTraceHere() {}
void Exception::extendTrace(uint, uint) {}
void Exception::truncateCommonTrace() {}

String getStackTrace() { return heapString(""); }
StringPtr trimSourceFilename(StringPtr filename) { return filename; }

UnwindDetector::UnwindDetector() : uncaughtCount(static_cast<uint>(std::uncaught_exceptions())) {}
bool UnwindDetector::isUnwinding() const { return static_cast<uint>(std::uncaught_exceptions()) > uncaughtCount; }
void UnwindDetector::catchExceptionsAsSecondaryFaults(_::Runnable& runnable) const {
    try {
        runnable.run();
    } catch (...) {
        // A second failure while unwinding from the first: keep the first.
    }
}

namespace _ {
Maybe<Exception> runCatchingExceptions(Runnable& runnable) {
    try {
        runnable.run();
        return nullptr;
    } catch (Exception& e) {
        return kj::mv(e);
    } catch (std::exception& e) {
        return Exception(Exception::Type::FAILED, "(unknown)", -1, heapString(e.what()));
    } catch (...) {
        return Exception(Exception::Type::FAILED, "(unknown)", -1, heapString("unknown non-KJ exception"));
    }
}
}  // namespace _

}  // namespace kj
