// libnvidia-ml.so.1: the NVML calls PyTorch makes (torch.cuda's device count and UUIDs before
// CUDA starts, its caching allocator's NVLink and process queries, memory and utilisation
// queries), answered from the server's devices through phos's libcuda.so.1.
//
// What a phos client can know is what its driver calls tell it: names, UUIDs, PCI ids,
// compute capability and total memory. The device's use by others, its clocks, temperature,
// power and processes belong to the server's host; those calls answer
// NVML_ERROR_NOT_SUPPORTED (processes: none of this client's), and are named when called.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace {

using nvmlReturn_t = int;
constexpr nvmlReturn_t NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
                       NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NOT_FOUND = 6, NVML_ERROR_INSUFFICIENT_SIZE = 7,
                       NVML_ERROR_DRIVER_NOT_LOADED = 9, NVML_ERROR_UNKNOWN = 999;

struct Device {
    CUdevice cu = 0;
    unsigned index = 0;
};
using nvmlDevice_t = Device*;

struct nvmlMemory_t {
    unsigned long long total, free, used;
};
struct nvmlMemory_v2_t {
    unsigned version;
    unsigned long long total, reserved, free, used;
};
struct nvmlPciInfo_t {          // nvmlPciInfo_v3
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
};
struct nvmlProcessInfo_t;

std::mutex lock;
int initialised = 0;            // nvmlInit calls not yet matched by nvmlShutdown
std::vector<Device> devices;

nvmlReturn_t from_cuda(CUresult r) {
    switch (r) {
    case CUDA_SUCCESS: return NVML_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: return NVML_ERROR_INVALID_ARGUMENT;
    case CUDA_ERROR_INVALID_DEVICE: return NVML_ERROR_NOT_FOUND;
    case CUDA_ERROR_NO_DEVICE: case CUDA_ERROR_NOT_INITIALIZED: return NVML_ERROR_DRIVER_NOT_LOADED;
    default: return NVML_ERROR_UNKNOWN;
    }
}

nvmlReturn_t ready(nvmlDevice_t device) {
    std::lock_guard<std::mutex> g(lock);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    for (const Device& d : devices)
        if (&d == device) return NVML_SUCCESS;
    return NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t copy_text(const std::string& text, char* out, unsigned length) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (text.size() + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    std::memcpy(out, text.c_str(), text.size() + 1);
    return NVML_SUCCESS;
}

std::string uuid_text(nvmlDevice_t device) {
    CUuuid id;
    if (cuDeviceGetUuid_v2(&id, device->cu) != CUDA_SUCCESS) return "";
    char s[64];
    const auto* b = reinterpret_cast<const unsigned char*>(id.bytes);
    std::snprintf(s, sizeof s, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
                  b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    return s;
}

nvmlReturn_t not_supported(const char* name) {
    static std::mutex said_lock;
    static std::vector<std::string> said;
    std::lock_guard<std::mutex> g(said_lock);
    if (std::find(said.begin(), said.end(), name) == said.end()) {
        said.emplace_back(name);
        phos::log_error("%s: not supported on a phos client (the server's host has the device)", name);
    }
    return NVML_ERROR_NOT_SUPPORTED;
}

}  // namespace


PHOS_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int) {
    std::lock_guard<std::mutex> g(lock);
    if (initialised) {
        initialised++;
        return NVML_SUCCESS;
    }
    int count = 0;
    CUresult r = cuInit(0);
    if (r == CUDA_SUCCESS) r = cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS) return from_cuda(r);
    devices.assign(static_cast<size_t>(count), Device{});
    for (int i = 0; i < count; i++) {
        devices[static_cast<size_t>(i)].index = static_cast<unsigned>(i);
        if ((r = cuDeviceGet(&devices[static_cast<size_t>(i)].cu, i)) != CUDA_SUCCESS) return from_cuda(r);
    }
    initialised = 1;
    return NVML_SUCCESS;
}
PHOS_EXPORT nvmlReturn_t nvmlInit_v2() { return nvmlInitWithFlags(0); }
PHOS_EXPORT nvmlReturn_t nvmlInit() { return nvmlInitWithFlags(0); }

PHOS_EXPORT nvmlReturn_t nvmlShutdown() {
    std::lock_guard<std::mutex> g(lock);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

PHOS_EXPORT const char* nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

PHOS_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int* version) {
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    return from_cuda(cuDriverGetVersion(version));
}
PHOS_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int* version) { return nvmlSystemGetCudaDriverVersion(version); }

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* count) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    std::lock_guard<std::mutex> g(lock);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *count = static_cast<unsigned>(devices.size());
    return NVML_SUCCESS;
}
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int* count) { return nvmlDeviceGetCount_v2(count); }

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    std::lock_guard<std::mutex> g(lock);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (index >= devices.size()) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t* device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int* index) {
    nvmlReturn_t r = ready(device);
    if (r == NVML_SUCCESS && !index) r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS) *index = device->index;
    return r;
}

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length) {
    nvmlReturn_t r = ready(device);
    if (r != NVML_SUCCESS) return r;
    char text[256] = {};
    CUresult e = cuDeviceGetName(text, sizeof text - 1, device->cu);
    return e == CUDA_SUCCESS ? copy_text(text, name, length) : from_cuda(e);
}

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
    nvmlReturn_t r = ready(device);
    if (r != NVML_SUCCESS) return r;
    std::string text = uuid_text(device);
    return text.empty() ? NVML_ERROR_UNKNOWN : copy_text(text, uuid, length);
}

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, nvmlDevice_t* device) {
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned count = 0;
    nvmlReturn_t r = nvmlDeviceGetCount_v2(&count);
    for (unsigned i = 0; r == NVML_SUCCESS && i < count; i++)
        if (uuid_text(&devices[i]) == uuid) {
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    return r == NVML_SUCCESS ? NVML_ERROR_NOT_FOUND : r;
}

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t* pci) {
    nvmlReturn_t r = ready(device);
    if (r != NVML_SUCCESS) return r;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    int domain = 0, bus = 0, dev = 0;
    CUresult e = cuDeviceGetAttribute(&domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, device->cu);
    if (e == CUDA_SUCCESS) e = cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, device->cu);
    if (e == CUDA_SUCCESS) e = cuDeviceGetAttribute(&dev, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, device->cu);
    if (e != CUDA_SUCCESS) return from_cuda(e);
    std::memset(pci, 0, sizeof *pci);
    pci->domain = static_cast<unsigned>(domain);
    pci->bus = static_cast<unsigned>(bus);
    pci->device = static_cast<unsigned>(dev);
    std::snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", domain, bus, dev);
    std::snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", domain, bus, dev);
    return NVML_SUCCESS;
}
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t* pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, nvmlDevice_t* device) {
    if (!bus_id || !device) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned count = 0;
    nvmlReturn_t r = nvmlDeviceGetCount_v2(&count);
    for (unsigned i = 0; r == NVML_SUCCESS && i < count; i++) {
        nvmlPciInfo_t pci;
        if (nvmlDeviceGetPciInfo_v3(&devices[i], &pci) == NVML_SUCCESS &&
            (strcasecmp(pci.busId, bus_id) == 0 || strcasecmp(pci.busIdLegacy, bus_id) == 0)) {
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return r == NVML_SUCCESS ? NVML_ERROR_NOT_FOUND : r;
}

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int* major, int* minor) {
    nvmlReturn_t r = ready(device);
    if (r != NVML_SUCCESS) return r;
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    CUresult e = cuDeviceGetAttribute(major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device->cu);
    if (e == CUDA_SUCCESS) e = cuDeviceGetAttribute(minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device->cu);
    return from_cuda(e);
}

// The device's whole memory; its use belongs to the server's host (cuMemGetInfo answers for
// this client's context), so none is reported here.
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) {
    nvmlReturn_t r = ready(device);
    if (r != NVML_SUCCESS) return r;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    size_t total = 0;
    CUresult e = cuDeviceTotalMem_v2(&total, device->cu);
    if (e != CUDA_SUCCESS) return from_cuda(e);
    *memory = nvmlMemory_t{total, total, 0};
    return NVML_SUCCESS;
}
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory) {
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlMemory_t m;
    nvmlReturn_t r = nvmlDeviceGetMemoryInfo(device, &m);
    if (r == NVML_SUCCESS) *memory = nvmlMemory_v2_t{memory->version, m.total, 0, m.free, m.used};
    return r;
}

// This client's processes on the device: none NVML could name (the server's workers run them).
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int* count, nvmlProcessInfo_t*) {
    nvmlReturn_t r = ready(device);
    if (r == NVML_SUCCESS && !count) r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS) *count = 0;
    return r;
}

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int* count, nvmlProcessInfo_t* infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos);
}
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int* count, nvmlProcessInfo_t* infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos);
}

PHOS_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t, unsigned int, int*) {
    return not_supported("nvmlDeviceGetNvLinkRemoteDeviceType");
}
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t, unsigned int, nvmlPciInfo_t*) {
    return not_supported("nvmlDeviceGetNvLinkRemotePciInfo_v2");
}
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t, void*) { return not_supported("nvmlDeviceGetUtilizationRates"); }
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t, int, unsigned int*) { return not_supported("nvmlDeviceGetTemperature"); }
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t, unsigned int*) { return not_supported("nvmlDeviceGetPowerUsage"); }
PHOS_EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t, int, unsigned int*) { return not_supported("nvmlDeviceGetClockInfo"); }

