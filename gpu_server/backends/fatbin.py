"""Module images -> the PTX text the emu backend interprets.

cuModuleLoadData and nvcc-built programs hand us one of:
  * PTX text (maybe NUL-terminated);
  * a fatbin, or several back to back (an executable's .nv_fatbin section);
  * a fatbin wrapper (what __cudaRegisterFatBinary gets) followed by the fatbin it
    points to: the native stub sends the bytes, since the pointer is meaningless here;
  * a cubin (ELF with SASS only), which the emu device cannot run.

The layouts below were read off nvcc 13.0 output (all little-endian):

  fatbin header, 16 bytes: u32 magic, u16 version (1), u16 header_size (16),
                           u64 size of the entries that follow.
  entry header, 64 bytes (header_size may be larger: PTX entries keep an options
  string, and -G/-lineinfo builds a file name, after these fields):
     0 u16 kind (1 PTX, 2 ELF/SASS, 8 LTO IR)    2 u16 version (0x0101)
     4 u32 header_size                            8 u64 payload size (padded to 8)
    16 u32 compressed size (0 if stored plain)   20 u32 offset in this header of
                                                    {u32 options offset, u32 options length}
    24 u16 minor, 26 u16 major (PTX ISA, e.g. 9.0; ELF 1.8)
    28 u32 arch (sm number: 90)                  32 u32 file-name offset, 36 u32 its length
    40 u64 flags                                 48 u64 (0)
    56 u64 uncompressed size (0 if stored plain)
  flags: 0x1 64-bit, 0x2 debug, 0x10 Linux, 0x2000 LZ4 block, 0x8000 zstd frame,
         0x100000 arch-specific target (sm_90a), 0x200000 family target (sm_100f).

nvcc 13 compresses with zstd by default (modes default/balance: PTX only; size and
-Xfatbin=-compress-all: ELF too), with LZ4 for --compress-mode=speed, and not at all
for --compress-mode=none / --no-compress.
"""
import re
import struct
from dataclasses import dataclass

from phos.schema.cuda_types import CudaError, CUresult

DEVICE_ARCH = 90  # the emu device reports compute capability 9.0
MAX_UNCOMPRESSED = 1 << 30  # refuse to inflate anything bigger: it would be a bomb, not a kernel

FATBIN_MAGIC = 0xBA55ED50
WRAPPER_MAGIC = 0x466243B1
ELF_MAGIC = b"\x7fELF"

FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header_size, size
ENTRY_HEADER = struct.Struct("<HHIQIIHHIIIQQQ")  # see the table above
MAGIC = struct.Struct("<I")
# The wrapper is {u32 magic; u32 version; u64 data; u64 filename_or_fatbins} (24 bytes);
# a sender may send just its first 16 bytes before the fatbin, or all of it.
WRAPPER_SIZES = (16, 24)

KIND_PTX, KIND_ELF, KIND_LTO = 1, 2, 8
KIND_NAMES = {KIND_PTX: "ptx", KIND_ELF: "elf", KIND_LTO: "lto"}
FLAG_LZ4 = 0x2000
FLAG_ZSTD = 0x8000
FLAG_ARCH_VARIANT = 0x100000 | 0x200000  # sm_XXa / sm_XXf

# ELF64: e_shoff at 0x28, e_flags at 0x30, e_shentsize and e_shnum at 0x3A; a section; a symbol
ELF_SHOFF = struct.Struct("<Q")
ELF_FLAGS = struct.Struct("<I")
ELF_SHCOUNT = struct.Struct("<HH")
ELF_SECTION = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, align, entsize
ELF_SYMBOL = struct.Struct("<IBBHQQ")  # name, info, other, shndx, value, size
SHT_SYMTAB = 2
STT_OBJECT, STT_FUNC = 1, 2
STO_CUDA_ENTRY = 0x10  # st_other bit nvcc sets on __global__ functions

# Leading whitespace and comments, then `.version`; possessive so junk can't backtrack.
_PTX_START = re.compile(rb"(?:\s|//[^\n]*|/\*.*?\*/)*+\.version\b", re.S)
_ZEROS = re.compile(rb"\0*")
# A module-scope __device__ or __constant__ variable: `.visible .global .align 8 .u64 name ...`
_PTX_VARIABLE = re.compile(r"^[ \t]*(?:\.(?:visible|weak)[ \t]+)?\.(?:global|const)[ \t]+"
                           r"(?:\.\w+(?:\([^)\n]*\))?(?:[ \t]+\d+)?[ \t]+)*([A-Za-z_$%][\w$]*)", re.M)
_REBUILD = ("rebuild with PTX embedded, e.g. nvcc -gencode arch=compute_90,code=compute_90 "
            "(or -arch=sm_90, which embeds compute_90 PTX too)")


def _invalid(msg):
    return CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, msg)


@dataclass(frozen=True)
class Entry:
    index: int  # position among all entries of the image, as in describe()
    kind: int
    arch: int
    flags: int
    stored: bytes  # payload as stored: compressed bytes, or the plain (padded) image
    size: int  # uncompressed size

    @property
    def compression(self):
        return "zstd" if self.flags & FLAG_ZSTD else "lz4" if self.flags & FLAG_LZ4 else None

    @property
    def name(self):
        kind = KIND_NAMES.get(self.kind, f"kind {self.kind}")
        return f"fatbin entry {self.index} ({kind} sm_{self.arch})"


# ---------------------------------------------------------------- public API

def image_kind(image) -> str:
    """'ptx', 'fatbin', 'wrapper' or 'elf'; INVALID_IMAGE for anything else."""
    image = bytes(image)
    buf = image[:4]
    magic = MAGIC.unpack(buf)[0] if len(buf) == 4 else None
    if magic == FATBIN_MAGIC:
        return "fatbin"
    if magic == WRAPPER_MAGIC:
        return "wrapper"
    if buf == ELF_MAGIC:
        return "elf"
    if _PTX_START.match(_until_nul(image)):
        return "ptx"
    raise _invalid(f"image is not PTX, a fatbin, a fatbin wrapper or a cubin "
                   f"(starts with {image[:16]!r})")


def fatbin_size(header) -> int:
    """Total bytes of the fatbin whose first 16 (or more) bytes are `header`."""
    header = bytes(header[:FATBIN_HEADER.size])
    if len(header) < FATBIN_HEADER.size:
        raise _invalid(f"fatbin header is truncated ({len(header)} of {FATBIN_HEADER.size} bytes)")
    magic, _version, header_size, size = FATBIN_HEADER.unpack(header)
    if magic != FATBIN_MAGIC:
        raise _invalid(f"bad fatbin magic {magic:#010x} (expected {FATBIN_MAGIC:#010x})")
    if header_size < FATBIN_HEADER.size:
        raise _invalid(f"fatbin header size {header_size} is below {FATBIN_HEADER.size}")
    return header_size + size


def extract_ptx(image) -> str:
    """The PTX the emu device should run: raw PTX as is, else the best fatbin PTX entry."""
    image = bytes(image)
    kind = image_kind(image)
    if kind == "ptx":
        return _ptx_text(image, "PTX image")
    if kind == "elf":
        raise _no_ptx([], _elf_arch(image), _elf_kernels(image))
    entries = _entries(image, kind)
    usable = [e for e in entries if e.kind == KIND_PTX and e.arch <= DEVICE_ARCH]
    if not usable:
        raise _no_ptx(entries)
    # Highest arch wins; at a tie a portable target beats sm_90a-style, then the first.
    best = max(usable, key=lambda e: (e.arch, not e.flags & FLAG_ARCH_VARIANT))
    return _ptx_text(_payload(best), best.name)


def module_variables(image) -> list[str]:
    """Names of the __device__ and __constant__ variables a module image defines (the driver
    cannot list a module's globals). PTX, or a cubin's symbols when there is no PTX; [] for
    an image we cannot read (the driver loaded it: its globals are then the ones looked up)."""
    try:
        image = bytes(image)
        kind = image_kind(image)
        if kind == "ptx":
            return _PTX_VARIABLE.findall(_ptx_text(image, "PTX image"))
        if kind == "elf":
            return _elf_symbols(image, STT_OBJECT)
        entries = _entries(image, kind)
        for e in sorted(entries, key=lambda e: e.kind != KIND_PTX):
            if e.kind == KIND_PTX:
                return _PTX_VARIABLE.findall(_ptx_text(_payload(e), e.name))
            if e.kind == KIND_ELF:
                return _elf_symbols(_payload(e), STT_OBJECT)
    except CudaError:
        pass
    return []


def describe(image) -> list[dict]:
    """One dict per module image inside: kind, arch, compressed, size (uncompressed)."""
    image = bytes(image)
    kind = image_kind(image)
    if kind == "ptx":
        target = re.search(rb"\.target\s+sm_(\d+)", _until_nul(image))
        return [{"kind": "ptx", "arch": int(target[1]) if target else None,
                 "compressed": False, "compression": None, "size": len(_until_nul(image))}]
    if kind == "elf":
        return [{"kind": "elf", "arch": _elf_arch(image), "compressed": False,
                 "compression": None, "size": len(image)}]
    return [{"kind": KIND_NAMES.get(e.kind, e.kind), "arch": e.arch,
             "compressed": e.compression is not None, "compression": e.compression,
             "size": e.size, "stored_size": len(e.stored)} for e in _entries(image, kind)]


# ---------------------------------------------------------------- fatbin walking

def _entries(buf, kind):
    if kind == "wrapper":
        for start in WRAPPER_SIZES:
            if buf[start:start + 4] == MAGIC.pack(FATBIN_MAGIC):
                return _walk(buf, start, only_one=True)
        raise _invalid(f"fatbin wrapper is not followed by a fatbin (no magic "
                       f"{FATBIN_MAGIC:#010x} at offset {' or '.join(map(str, WRAPPER_SIZES))})")
    return _walk(buf, 0, only_one=False)


def _walk(buf, off, only_one):
    """Entries of the fatbin at `off` and (unless only_one) of any fatbins after it."""
    entries, fatbin = [], 0
    while off < len(buf):
        remain = len(buf) - off
        try:
            total = fatbin_size(buf[off:off + FATBIN_HEADER.size])
        except CudaError as e:
            raise _invalid(f"fatbin {fatbin} at offset {off}: {e.message}") from None
        if total > remain:
            raise _invalid(f"fatbin {fatbin} claims {total} bytes but only {remain} remain")
        header_size = FATBIN_HEADER.unpack_from(buf, off)[2]
        _entries_of(buf, off + header_size, off + total, entries)
        off += total
        fatbin += 1
        if only_one:
            break  # the wrapper names one fatbin; whatever follows is not ours
        off = _ZEROS.match(buf, off).end()  # sections pad between fatbins with zeros
    return entries


def _entries_of(buf, p, end, entries):
    while p < end:
        i, remain = len(entries), end - p
        if remain < ENTRY_HEADER.size:
            raise _invalid(f"fatbin entry {i} header is truncated "
                           f"({remain} of {ENTRY_HEADER.size} bytes)")
        (kind, _ver, header_size, size, csize, _opts, _minor, _major, arch,
         _name_off, _name_len, flags, _zero, usize) = ENTRY_HEADER.unpack_from(buf, p)
        if header_size < ENTRY_HEADER.size:
            raise _invalid(f"fatbin entry {i} header size {header_size} is below {ENTRY_HEADER.size}")
        if header_size + size > remain:
            raise _invalid(f"fatbin entry {i} claims {header_size + size} bytes "
                           f"but only {remain} remain")
        payload = buf[p + header_size:p + header_size + size]
        if flags & (FLAG_LZ4 | FLAG_ZSTD):
            if flags & FLAG_LZ4 and flags & FLAG_ZSTD:
                raise _invalid(f"fatbin entry {i} is flagged both LZ4- and zstd-compressed")
            if csize > size:
                raise _invalid(f"fatbin entry {i} claims {csize} compressed bytes "
                               f"in a {size}-byte payload")
            if usize > MAX_UNCOMPRESSED:
                raise _invalid(f"fatbin entry {i} claims to inflate to {usize} bytes "
                               f"(limit {MAX_UNCOMPRESSED})")
            payload = payload[:csize]
        else:
            usize = size
        entries.append(Entry(i, kind, arch, flags, payload, usize))
        p += header_size + size


def _payload(entry):
    """The entry's image, decompressed and checked against its recorded size."""
    if entry.compression == "zstd":
        data = _unzstd(entry.stored, entry.size, entry.name)
    elif entry.compression == "lz4":
        data = lz4_block_decompress(entry.stored, entry.size, entry.name)
    else:
        return entry.stored
    if len(data) != entry.size:
        raise _invalid(f"{entry.name} inflates to {len(data)} bytes, header says {entry.size}")
    return data


def _unzstd(data, size, where):
    try:
        import zstandard
    except ImportError:
        raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                        f"{where} is zstd-compressed (nvcc 13's default); reading it needs the "
                        f"'zstandard' Python package") from None
    out = bytearray()
    try:
        # Stream in chunks so a lying frame header can't make us allocate more than size + 64K.
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            while len(out) <= size:
                chunk = reader.read(1 << 16)
                if not chunk:
                    break
                out += chunk
    except zstandard.ZstdError as e:
        raise _invalid(f"{where}: corrupt zstd data ({e})") from None
    return bytes(out)


def lz4_block_decompress(src, size, where="LZ4 block"):
    """Decode one LZ4 block (no frame) that must inflate to exactly `size` bytes."""
    out, i, n = bytearray(), 0, len(src)

    def length(base):  # 15 in the token means: add bytes until one isn't 255
        nonlocal i
        if base != 15:
            return base
        while True:
            if i >= n:
                raise _invalid(f"{where}: LZ4 length runs past the end of the data")
            b = src[i]
            i += 1
            base += b
            if b != 255:
                return base

    while i < n:
        token = src[i]
        i += 1
        lit = length(token >> 4)
        if lit > n - i or len(out) + lit > size:
            raise _invalid(f"{where}: LZ4 literal run of {lit} bytes overflows the block")
        out += src[i:i + lit]
        i += lit
        if i == n:
            break  # the last sequence is literals only
        if n - i < 2:
            raise _invalid(f"{where}: LZ4 match offset is truncated")
        offset = src[i] | src[i + 1] << 8
        i += 2
        match = length(token & 15) + 4
        if not 0 < offset <= len(out):
            raise _invalid(f"{where}: LZ4 match offset {offset} points outside the "
                           f"{len(out)} bytes decoded so far")
        if len(out) + match > size:
            raise _invalid(f"{where}: LZ4 data inflates past the {size} bytes the header says")
        start = len(out) - offset
        if match <= offset:
            out += out[start:start + match]
        else:  # overlapping copy: the match repeats the last `offset` bytes
            out += (out[start:] * (match // offset + 1))[:match]
    if len(out) != size:
        raise _invalid(f"{where}: LZ4 data inflates to {len(out)} bytes, header says {size}")
    return bytes(out)


# ---------------------------------------------------------------- PTX and ELF

def _until_nul(buf):
    nul = buf.find(b"\0")
    return buf if nul < 0 else buf[:nul]


def _ptx_text(raw, where):
    text = _until_nul(raw)
    if not _PTX_START.match(text):
        raise _invalid(f"{where} does not start with a PTX .version line "
                       f"(starts with {text[:16]!r})")
    return text.decode("utf-8", "replace")  # PTX is ASCII; comments may not be


def _no_ptx(entries, elf_arch=None, kernels=None):
    """NO_BINARY_FOR_GPU naming what the image does hold and which kernels it has."""
    ptx = sorted({e.arch for e in entries if e.kind == KIND_PTX})
    sass = sorted({e.arch for e in entries if e.kind == KIND_ELF})
    if elf_arch is not None:
        sass.append(elf_arch)
    if kernels is None:
        kernels = []
        for e in entries:
            if e.kind == KIND_ELF and not kernels:
                try:
                    kernels = _elf_kernels(_payload(e))
                except CudaError:
                    pass  # a damaged SASS entry only costs us the names in the message
    holds = [f"SASS for {', '.join(f'sm_{a}' for a in sass)}"] if sass else []
    holds += [f"PTX for {', '.join(f'compute_{a}' for a in ptx)} (newer than the device's 9.0)"] if ptx else []
    if any(e.kind == KIND_LTO for e in entries):
        holds.append("LTO IR")
    named = f" with kernel(s) {', '.join(kernels)}" if kernels else ""
    return CudaError(CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU,
                     f"the image{named} holds {' and '.join(holds) or 'no code'} but no PTX for "
                     f"compute_{DEVICE_ARCH} or older, and the emu device runs PTX only; {_REBUILD}")


def _elf_arch(elf):
    if len(elf) < 0x34:
        return None
    flags = ELF_FLAGS.unpack_from(elf, 0x30)[0]
    # CUDA ELF ABI version 8+ (byte 8) moved the sm number from bits 0-7 to bits 8-15.
    return (flags >> 8) & 0xFF if elf[8] >= 8 else flags & 0xFF


def _elf_kernels(elf):
    """Names of the __global__ functions in a cubin (mangled); [] if its tables are damaged."""
    names, funcs = [], []
    for name, info, other in _elf_symbol_table(elf):
        if info & 0xF == STT_FUNC:
            (names if other & STO_CUDA_ENTRY else funcs).append(name)
    return names or funcs


def _elf_symbols(elf, kind):
    """Names of a cubin's symbols of one type (STT_OBJECT: its variables), but the
    toolchain's own (named after sections, such as .nv.reservedSmem.offset0)."""
    return [name for name, info, _ in _elf_symbol_table(elf) if info & 0xF == kind and not name.startswith(".")]


def _elf_symbol_table(elf):
    """[(name, info, other)] of a cubin's symbols; [] if its tables are damaged."""
    try:
        shoff = ELF_SHOFF.unpack_from(elf, 0x28)[0]
        shentsize, shnum = ELF_SHCOUNT.unpack_from(elf, 0x3A)
        if shentsize < ELF_SECTION.size or shoff + shnum * shentsize > len(elf):
            return []
        sections = [ELF_SECTION.unpack_from(elf, shoff + k * shentsize) for k in range(shnum)]
        symtab = next((s for s in sections if s[1] == SHT_SYMTAB), None)  # an ELF has one
        if symtab is None or symtab[9] < ELF_SYMBOL.size or symtab[6] >= shnum:
            return []
        _n, _t, _f, _a, offset, size, link, _i, _al, entsize = symtab
        strtab = sections[link]
        strings = elf[strtab[4]:strtab[4] + strtab[5]]
        out = []
        for s in range(offset, min(offset + size, len(elf)) - ELF_SYMBOL.size + 1, entsize):
            st_name, info, other, _shndx, _v, _sz = ELF_SYMBOL.unpack_from(elf, s)
            out.append((_until_nul(strings[st_name:]).decode("ascii", "replace"), info, other))
        return out
    except struct.error:
        return []
