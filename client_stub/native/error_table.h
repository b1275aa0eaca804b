// The value, name and text of each error code, one table per library, from a .def file.
#pragma once
#include <cstddef>

namespace phos {

struct ErrorText {
    int value;
    const char* name;
    const char* text;
};

template <std::size_t N>
const ErrorText* lookup_error(const ErrorText (&table)[N], int value) {
    for (const auto& e : table)
        if (e.value == value) return &e;
    return nullptr;
}

}  // namespace phos
