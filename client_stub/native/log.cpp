#include "common.h"

#include <cstdarg>
#include <cstdio>

namespace phos {

void log_line(const char* fmt, va_list ap) {
    char line[2048];
    vsnprintf(line, sizeof line, fmt, ap);
    fprintf(stderr, "phos: %s\n", line);   // one call, so lines from threads don't interleave
}

void log_error(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_line(fmt, ap);
    va_end(ap);
}

}  // namespace phos
