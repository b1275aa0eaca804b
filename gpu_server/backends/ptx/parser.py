"""PTX text -> a syntax tree: module variables, functions, and their statements.

Only syntax is checked here (CUDA_ERROR_INVALID_PTX); what an instruction means is
decided by interp.py, which fails at launch on anything it does not know.
Registers and variables declared in nested `{ }` scopes are renamed `name#k` so that
every name in a function is unique (inline asm re-declares `%tmp` with other types).
What a module declares is held to the caps below as it is read, before anything is expanded.
"""
import gc
import math
import re
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from phos.schema.cuda_types import CudaError, CUresult

TYPE_SIZE = {
    'b8': 1, 'u8': 1, 's8': 1, 'b16': 2, 'u16': 2, 's16': 2, 'f16': 2, 'bf16': 2,
    'b32': 4, 'u32': 4, 's32': 4, 'f32': 4, 'f16x2': 4, 'bf16x2': 4, 'tf32': 4,
    'b64': 8, 'u64': 8, 's64': 8, 'f64': 8, 'b128': 16, 'pred': 1,
    'texref': 8, 'samplerref': 8, 'surfref': 8,
}
SPACES = ('global', 'const', 'shared', 'local', 'param', 'reg', 'tex')

# Caps on what a module declares, checked before a declaration is expanded or sized: a few bytes
# of text (`.reg .b32 %r<5000000>;`) must not cost the server gigabytes and minutes. Generous for
# real PTX: nvcc declares at most tens of thousands of registers in a kernel.
MAX_FUNCTION_NAMES = 1 << 17        # registers and variables one function declares
MAX_MODULE_NAMES = 1 << 19          # ... that a whole module declares (each costs the parser time and memory)
MAX_ARRAY_BYTES = {                 # one declaration's bytes, by state space
    'shared': 227 << 10,            # a block's shared memory with the opt-in (H100/H200)
    'local': 512 << 10,             # a thread's local memory (CUDA's limit)
    'param': 512 << 10,
}
MAX_GLOBAL_BYTES = 1 << 40          # any other space: beyond any device (the emu also counts globals as device memory)
MAX_INITIALIZER_VALUES = 1 << 24    # values in one initialiser
# Past the caps above, what a module costs grows with its text: one initialiser of
# MAX_INITIALIZER_VALUES would hold the parser for long and take gigabytes. So a module's tokens are
# capped, and its load has a deadline (load_deadline; emu.py adds its globals' placing).
MAX_MODULE_TOKENS = 1 << 21
# What a load's parse may take at its peak, per token, counted against the tenant's host memory
# (PHOS_TENANT_HOST_QUOTA) before it starts: above the peak of a large initialiser's parse per
# byte of its text (a token is one or two bytes of text), as a text has no more tokens than bytes.
PARSE_BYTES_PER_TOKEN = 160
CHECK_EVERY = 1 << 16               # tokens or values between two looks at the clock


# ---- operands ----
@dataclass
class Reg:            # %r1, !%p1, %tid.x; '_' is the sink
    name: str
    neg: bool = False


@dataclass
class Imm:            # kind: 'int', 'f32' (0f bits), 'f64' (0d bits), 'float' (decimal literal)
    value: object
    kind: str


@dataclass
class Sym:            # a variable, function or label name, optionally + offset
    name: str
    off: int = 0


@dataclass
class Addr:           # [base+off]; base None for an absolute address
    base: object
    off: int = 0


@dataclass
class Vec:            # {a, b, c, d}
    items: list


@dataclass
class Group:          # (a, b) in call
    items: list


@dataclass
class Pair:           # p|q
    a: object
    b: object


# ---- declarations and statements ----
@dataclass
class Var:
    name: str
    space: str
    type: str
    size: int          # bytes; 0 for an unsized extern array
    align: int
    init: bytes = None
    relocs: list = field(default_factory=list)   # (byte offset, symbol, addend, width)
    extern: bool = False
    attrs: tuple = ()
    line: int = 0


@dataclass
class Stmt:
    line: int
    guard: object      # Reg or None
    op: str            # full opcode with modifiers, e.g. 'ld.global.v4.f32'
    args: list


@dataclass
class Label:
    name: str
    line: int


@dataclass
class Function:
    name: str
    entry: bool
    params: list                     # [Var]
    rets: list                       # [Var]
    body: list = None                # [Stmt | Label]; None for a declaration
    regs: dict = field(default_factory=dict)      # unique name -> type
    vars: list = field(default_factory=list)      # function-scope .shared/.local/.param Vars
    targets: dict = field(default_factory=dict)   # .branchtargets label -> [labels]
    attrs: dict = field(default_factory=dict)     # maxntid, reqntid, ...
    line: int = 0


@dataclass
class Module:
    version: str = ''
    target: str = ''
    address_size: int = 64
    vars: dict = field(default_factory=dict)       # module-scope variables
    funcs: dict = field(default_factory=dict)


def syntax_error(line, msg):
    return CudaError(CUresult.CUDA_ERROR_INVALID_PTX, f"PTX syntax error at line {line}: {msg}")


_deadline = [math.inf]              # time.monotonic() past which the load in progress is refused


def check_deadline(line, deadline=None):
    if time.monotonic() > (_deadline[0] if deadline is None else deadline):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_PTX, f"PTX refused{f' at line {line}' if line else ''}: loading the "
                        "module took longer than PHOS_EMU_MODULE_LOAD_TIMEOUT allows")


def cap_error(line, what, value, cap, name):
    return CudaError(CUresult.CUDA_ERROR_INVALID_PTX,
                     f"PTX refused at line {line}: {what} is {value}, more than the cap of {cap} ({name})")


# ---- lexing ----
_TOKEN = re.compile(r'''
    (?P<nl>\n) | (?P<ws>[ \t\r\f\v]+) |
    (?P<str>"(?:[^"\\\n]|\\.)*") |
    (?P<num>0[fF][0-9a-fA-F]{8}(?![\w$])|0[dD][0-9a-fA-F]{16}(?![\w$])|0[xX][0-9a-fA-F]+U?|
            [0-9]+\.[0-9]*(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+|[0-9]+U?) |
    (?P<id>[A-Za-z_$%.][A-Za-z0-9_$.]*(?:::[A-Za-z0-9_$.]+)*) |
    (?P<p>[{}\[\]();,:+\-!@|<>=*])
''', re.X)
_LINE_DIRECTIVE = re.compile(r'^[ \t]*(\.version|\.target|\.address_size|\.file|\.loc|@@DWARF)\b(.*)$', re.M)


def _strip_comments(text):
    def blank(m):
        return re.sub(r'[^\n]', ' ', m.group(0))
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:[^"\\\n]|\\.)*"', lambda m: m.group(0) if m.group(0)[0] == '"' else blank(m),
                  text, flags=re.S)


def tokenize(text, mod):
    text = _strip_comments(text)

    def line_directive(m):
        kind, rest = m.group(1), m.group(2).strip()
        if kind == '.version':
            mod.version = rest
        elif kind == '.target':
            mod.target = rest
        elif kind == '.address_size':
            mod.address_size = int(rest)
        return ' ' * len(m.group(0))
    text = _LINE_DIRECTIVE.sub(line_directive, text)
    toks, line, pos = [], 1, 0
    for m in _TOKEN.finditer(text):
        if m.start() != pos:
            raise syntax_error(line, f"unexpected character {text[pos]!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind == 'nl':
            line += 1
        elif kind != 'ws':
            toks.append((kind, m.group(0), line))
            if not len(toks) % CHECK_EVERY:
                if len(toks) > MAX_MODULE_TOKENS:
                    raise cap_error(line, "the count of the module's tokens", len(toks),
                                    MAX_MODULE_TOKENS, "MAX_MODULE_TOKENS")
                check_deadline(line)
    if pos != len(text):
        raise syntax_error(line, f"unexpected character {text[pos]!r}")
    toks.append(('eof', '', line))
    return toks


def parse_int(s):
    s = s.rstrip('U')
    return int(s, 16) if s[:2] in ('0x', '0X') else int(s)


def parse_number(tok, line):
    s = tok
    if s[:2] in ('0f', '0F'):
        return Imm(struct.unpack('<f', struct.pack('<I', int(s[2:], 16)))[0], 'f32')
    if s[:2] in ('0d', '0D'):
        return Imm(struct.unpack('<d', struct.pack('<Q', int(s[2:], 16)))[0], 'f64')
    if '.' in s or (('e' in s or 'E' in s) and s[:2] not in ('0x', '0X')):
        return Imm(float(s), 'float')
    return Imm(parse_int(s), 'int')


class Parser:
    def __init__(self, text):
        self.mod = Module()
        self.toks = tokenize(text, self.mod)
        self.i = 0
        self.module_names = 0
        self.function_names = None       # in a function body: the names it declared so far

    def count_names(self, n, line):
        """Hold n more registers or variables to the caps, before they are made."""
        if n < 0:
            raise syntax_error(line, f"a negative count of registers ({n})")
        if self.function_names is not None:
            self.function_names += n
            if self.function_names > MAX_FUNCTION_NAMES:
                raise cap_error(line, f"the count of registers and variables function {self.fn.name} declares",
                                self.function_names, MAX_FUNCTION_NAMES, "MAX_FUNCTION_NAMES")
        self.module_names += n
        if self.module_names > MAX_MODULE_NAMES:
            raise cap_error(line, "the count of registers and variables the module declares", self.module_names,
                            MAX_MODULE_NAMES, "MAX_MODULE_NAMES")

    @staticmethod
    def check_size(space, name, size, line):
        """Hold one declaration's bytes to its space's cap (a negative size is no size at all)."""
        cap = MAX_ARRAY_BYTES.get(space, MAX_GLOBAL_BYTES)
        if size < 0:
            raise syntax_error(line, f"the .{space} variable {name} has a negative size ({size} bytes)")
        if size > cap:
            cap_name = f"MAX_ARRAY_BYTES[{space!r}]" if space in MAX_ARRAY_BYTES else "MAX_GLOBAL_BYTES"
            raise cap_error(line, f"the size in bytes of .{space} variable {name}", size, cap, cap_name)

    # -- token helpers --
    def peek(self, k=0):
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def next(self):
        t = self.toks[self.i]
        if t[0] != 'eof':
            self.i += 1
        return t

    def expect(self, val):
        t = self.next()
        if t[1] != val:
            raise syntax_error(t[2], f"expected {val!r}, found {t[1] or 'end of file'!r}")
        return t

    def accept(self, val):
        if self.peek()[1] == val:
            self.i += 1
            return True
        return False

    def ident(self):
        t = self.next()
        if t[0] != 'id':
            raise syntax_error(t[2], f"expected a name, found {t[1] or 'end of file'!r}")
        return t[1]

    def intval(self):
        neg = self.accept('-')
        t = self.next()
        if t[0] != 'num':
            raise syntax_error(t[2], f"expected a number, found {t[1]!r}")
        v = parse_int(t[1])
        return -v if neg else v

    # -- module level --
    def parse(self):
        while self.peek()[0] != 'eof':
            self.toplevel()
        return self.mod

    def toplevel(self):
        kind, tok, line = self.peek()
        check_deadline(line)
        linkage = []
        while tok in ('.visible', '.extern', '.weak', '.common'):
            linkage.append(tok)
            self.next()
            kind, tok, line = self.peek()
        if tok in ('.entry', '.func'):
            self.function(linkage)
        elif tok in ('.global', '.const', '.shared', '.local', '.tex'):
            for v in self.var_decl(module=True):
                v.extern = '.extern' in linkage
                self.mod.vars[v.name] = v
        elif tok == '.section':
            self.next()
            self.ident()
            self.skip_braces()
        elif tok in ('.pragma', '.alias'):
            while self.next()[1] != ';':
                pass
        else:
            raise syntax_error(line, f"unexpected {tok!r} at module scope")

    def skip_braces(self):
        self.expect('{')
        depth = 1
        while depth:
            t = self.next()
            if t[0] == 'eof':
                raise syntax_error(t[2], "unbalanced '{'")
            depth += {'{': 1, '}': -1}.get(t[1], 0)

    def var_decl(self, module=False, renamer=None):
        """`.space [.align N] [.vN] .type name[dims] [= init]{, name...};` -> [Var]."""
        line = self.peek()[2]
        space = self.next()[1][1:]
        align, vec, typ, attrs = 0, 1, None, []
        while True:
            t = self.peek()[1]
            if t == '.align':
                self.next()
                align = self.intval()
            elif t in ('.v2', '.v4', '.v8'):
                self.next()
                vec = int(t[2:])
            elif t == '.attribute':
                self.next()
                self.expect('(')
                attrs.append(self.ident())
                self.expect(')')
            elif t == '.ptr':       # pointee attributes: .ptr [.space] [.align N]
                self.next()
                if self.peek()[1][1:] in SPACES:
                    self.next()
                if self.accept('.align'):
                    self.intval()
            elif t.startswith('.') and t[1:] in TYPE_SIZE and typ is None:
                self.next()
                typ = t[1:]
            else:
                break
        if typ is None:
            raise syntax_error(line, f"missing type in .{space} declaration")
        out = []
        while True:
            kind, name, nline = self.next()
            if kind != 'id':
                raise syntax_error(nline, f"expected a variable name, found {name!r}")
            elem = TYPE_SIZE[typ] * vec
            count, unsized = 1, False
            if self.peek()[1] == '<':       # %r<10>: a range of registers
                self.next()
                n = self.intval()
                self.expect('>')
                self.count_names(n, nline)
                out += [Var(f"{name}{k}", space, typ, elem, align or elem, line=line) for k in range(n)]
            else:
                self.count_names(1, nline)
                while self.accept('['):
                    if self.accept(']'):
                        unsized = True
                        continue
                    count *= self.intval()
                    self.expect(']')
                self.check_size(space, name, 0 if unsized else elem * count, nline)
                v = Var(name, space, typ, 0 if unsized else elem * count, align or TYPE_SIZE[typ] * vec,
                        attrs=tuple(attrs), line=line)
                if self.accept('='):
                    self.initializer(v, elem // vec if vec > 1 else elem)
                out.append(v)
            if not self.accept(','):
                break
        self.expect(';')
        return out

    def initializer(self, v, esize):
        vals = []

        def item():
            if self.accept('{'):
                while True:
                    item()
                    if not self.accept(','):
                        break
                self.expect('}')
                return
            kind, tok, line = self.peek()
            if tok in ('generic', 'mask'):
                self.next()
                self.expect('(')
                name = self.ident()
                self.expect(')')
                off = self.intval() if self.accept('+') else 0
                vals.append(Sym(name, off) if tok == 'generic' else None)
                if tok == 'mask':
                    raise syntax_error(line, "mask() initializers are not supported")
            elif kind == 'id':
                name = self.ident()
                off = self.intval() if self.accept('+') else 0
                vals.append(Sym(name, off))
            else:
                neg = self.accept('-')
                t = self.next()
                if t[0] != 'num':
                    raise syntax_error(t[2], f"bad initializer {t[1]!r}")
                imm = parse_number(t[1], t[2])
                if neg:
                    imm.value = -imm.value
                vals.append(imm)
            if not len(vals) % CHECK_EVERY:
                check_deadline(line)
            if len(vals) > MAX_INITIALIZER_VALUES:
                raise cap_error(line, f"the count of values initialising {v.name}", len(vals),
                                MAX_INITIALIZER_VALUES, "MAX_INITIALIZER_VALUES")
        item()
        if v.size and len(vals) * esize > v.size:
            raise syntax_error(v.line, f"too many initializers for {v.name}")
        if not v.size:
            v.size = len(vals) * esize
            self.check_size(v.space, v.name, v.size, v.line)
        buf = bytearray(len(vals) * esize)     # the bytes initialised; the rest of the variable is zeros
        for k, x in enumerate(vals):
            off = k * esize
            if isinstance(x, Sym):
                v.relocs.append((off, x.name, x.off, esize))
                continue
            val = x.value
            if v.type in ('f32', 'f64', 'f16') and x.kind == 'int':
                val, kind = float(val), 'float'
            else:
                kind = x.kind
            if kind == 'int':
                buf[off:off + esize] = (val & ((1 << (8 * esize)) - 1)).to_bytes(esize, 'little')
            elif esize == 8:
                buf[off:off + 8] = struct.pack('<d', val)
            elif esize == 4:
                buf[off:off + 4] = struct.pack('<f', val)
            elif esize == 2:
                buf[off:off + 2] = struct.pack('<e', val)
            else:
                raise syntax_error(v.line, f"float initializer for {esize}-byte element")
        v.init = bytes(buf)

    def param_list(self):
        """`( .param ..., .param ... )` -> [Var] with offsets laid out later."""
        out = []
        self.expect('(')
        if self.accept(')'):
            return out
        while True:
            t = self.peek()
            if t[1] not in ('.param', '.reg'):
                raise syntax_error(t[2], f"expected .param, found {t[1]!r}")
            line = t[2]
            space = self.next()[1][1:]
            align, typ, ptr = 0, None, False
            while True:
                tok = self.peek()[1]
                if tok == '.align':
                    self.next()
                    a = self.intval()
                    if not ptr:
                        align = a
                elif tok == '.ptr':
                    self.next()
                    ptr = True
                elif tok.startswith('.') and tok[1:] in SPACES and ptr:
                    self.next()
                elif tok.startswith('.') and tok[1:] in TYPE_SIZE and typ is None:
                    self.next()
                    typ = tok[1:]
                else:
                    break
            if typ is None:
                raise syntax_error(line, "missing type in parameter")
            name = self.ident()
            count = 1
            while self.accept('['):
                count *= self.intval()
                self.expect(']')
            size = TYPE_SIZE[typ] * count
            self.check_size(space, name, size, line)
            out.append(Var(name, space, typ, size, align or TYPE_SIZE[typ], line=line))
            if self.accept(')'):
                return out
            self.expect(',')

    def function(self, linkage):
        line = self.peek()[2]
        entry = self.next()[1] == '.entry'
        rets = self.param_list() if not entry and self.peek()[1] == '(' else []
        name = self.ident()
        params = self.param_list() if self.peek()[1] == '(' else []
        fn = Function(name, entry, params, rets, line=line)
        while True:        # performance directives up to the body or ';'
            kind, tok, tline = self.peek()
            if tok == '{':
                break
            if tok == ';':
                self.next()
                break
            if tok == '.pragma':
                while self.next()[1] != ';':
                    pass
                continue
            if kind != 'id' or not tok.startswith('.'):
                raise syntax_error(tline, f"unexpected {tok!r} after the signature of {name}")
            self.next()
            args = []
            while self.peek()[0] == 'num':
                args.append(self.intval())
                if not self.accept(','):
                    break
            fn.attrs[tok[1:]] = args
        if self.peek()[1] == '{':
            self.body(fn)
        old = self.mod.funcs.get(name)
        if old is None or old.body is None:
            self.mod.funcs[name] = fn
        elif fn.body is not None:
            raise syntax_error(line, f"function {name} defined twice")

    # -- function bodies --
    def body(self, fn):
        self.fn = fn
        self.function_names = 0
        fn.body = []
        declared = {p.name for p in fn.params + fn.rets}
        scopes = [{}]

        def declare(name):
            unique, k = name, 1
            while unique in declared:
                k += 1
                unique = f"{name}#{k}"
            declared.add(unique)
            scopes[-1][name] = unique
            return unique

        def resolve(name):
            for s in reversed(scopes):
                if name in s:
                    return s[name]
            return name

        self.expect('{')
        depth = 1
        while True:
            kind, tok, line = self.peek()
            if tok == '{':
                self.next()
                depth += 1
                scopes.append({})
            elif tok == '}':
                self.next()
                depth -= 1
                scopes.pop()
                if depth == 0:
                    self.function_names = None
                    return
            elif kind == 'eof':
                raise syntax_error(line, f"missing '}}' at the end of {fn.name}")
            elif tok == '.reg':
                for v in self.var_decl():
                    fn.regs[declare(v.name)] = v.type
            elif tok in ('.shared', '.local', '.param', '.const', '.global'):
                for v in self.var_decl():
                    v.name = declare(v.name)
                    fn.vars.append(v)
            elif tok == '.pragma':
                while self.next()[1] != ';':
                    pass
            elif tok == '.loc' or tok == '.file':
                raise syntax_error(line, f"misplaced {tok}")
            elif kind == 'id' and self.peek(1)[1] == ':':
                self.next()
                self.next()
                if self.peek()[1] == '.branchtargets':
                    self.next()
                    labels = [self.ident()]
                    while self.accept(','):
                        labels.append(self.ident())
                    self.expect(';')
                    fn.targets[tok] = labels
                elif self.peek()[1] == '.callprototype':
                    while self.next()[1] != ';':
                        pass
                    fn.targets[tok] = None
                else:
                    fn.body.append(Label(tok, line))
            elif tok.startswith('.'):
                raise syntax_error(line, f"unexpected directive {tok!r} in {fn.name}")
            else:
                fn.body.append(self.statement(resolve))

    def statement(self, resolve):
        line = self.peek()[2]
        guard = None
        if self.accept('@'):
            neg = self.accept('!')
            guard = Reg(resolve(self.ident()), neg)
        kind, op, oline = self.next()
        if kind != 'id':
            raise syntax_error(oline, f"expected an instruction, found {op!r}")
        args = []
        if not self.accept(';'):
            while True:
                args.append(self.operand(resolve))
                if self.accept(';'):
                    break
                if not self.accept(','):
                    t = self.peek()
                    raise syntax_error(t[2], f"expected ',' or ';' in '{op}', found {t[1]!r}")
        return Stmt(line, guard, op, args)

    def is_reg(self, name):
        """Registers usually start with %, but inline asm also declares plain names (.reg .f16 low)."""
        return name.startswith('%') or name in self.fn.regs

    def operand(self, resolve):
        kind, tok, line = self.peek()
        if tok == '[':
            self.next()
            base, off = None, 0
            if self.peek(1)[1] == ',':          # [tex, {coords}]: texture/surface operands
                items = [self.operand(resolve)]
                while self.accept(','):
                    items.append(self.operand(resolve))
                self.expect(']')
                return Addr(Group(items))
            if self.peek()[0] == 'id':
                name = resolve(self.ident())
                base = Reg(name) if self.is_reg(name) else Sym(name)
                if self.accept('+'):
                    off = self.intval()
                elif self.peek()[1] == '-':
                    off = self.intval()
            else:
                off = self.intval()
            self.expect(']')
            return Addr(base, off)
        if tok in ('{', '('):
            self.next()
            close = '}' if tok == '{' else ')'
            items = []
            if not self.accept(close):
                while True:
                    items.append(self.operand(resolve))
                    if self.accept(close):
                        break
                    self.expect(',')
            return Vec(items) if tok == '{' else Group(items)
        if tok == '!':
            self.next()
            return Reg(resolve(self.ident()), True)
        if tok == '-' or kind == 'num':
            neg = self.accept('-')
            t = self.next()
            if t[0] != 'num':
                raise syntax_error(t[2], f"bad operand {t[1]!r}")
            imm = parse_number(t[1], t[2])
            if neg:
                imm.value = -imm.value
            return imm
        if kind == 'id':
            self.next()
            name = resolve(tok)
            a = Reg(name) if self.is_reg(name) or name == '_' else Sym(name)
            if self.accept('|'):
                return Pair(a, self.operand(resolve))
            if isinstance(a, Sym) and self.peek()[1] == '+':
                self.next()
                a.off = self.intval()
            return a
        raise syntax_error(line, f"bad operand {tok or 'end of file'!r}")


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off meanwhile: a module's parse, decode and C source make
    millions of objects that live on, and the collections their allocation sets off found nothing
    to free yet took as long as the work itself."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def parse(text, deadline=math.inf):
    """deadline: a time.monotonic() past which the parse is refused (CUDA_ERROR_INVALID_PTX)."""
    p = None
    _deadline[0] = deadline
    try:
        p = Parser(text)
        return p.parse()
    except (ValueError, KeyError, OverflowError, RecursionError, struct.error) as e:    # e.g. a malformed number
        raise syntax_error(p.peek()[2] if p else 0, f"{type(e).__name__}: {e}") from None
    finally:
        _deadline[0] = math.inf
