"""PTX statements -> instructions: closures `fn(S, m)` over the batch state S and a lane mask m.

Each opcode has a decoder (the DECODERS table, filled by @op) that reads the modifiers
it knows and raises Unsupported on anything else, so an unknown instruction or modifier
fails the launch with its name instead of being guessed at. Control-flow instructions
decode to tuples for the scheduler in interp.py: (kind, arg, None, guard, line).
Register and symbol names of function f become 'f|name' in the register file and the
symbol table, so callees never clobber their callers.
"""
import re
import time

import numpy as np

from phos.gpu_server.address_space import BASE
from phos.gpu_server.backends.ptx import ops
from phos.gpu_server.backends.ptx import parser as P
from phos.gpu_server.backends.ptx.ops import DT, as_, f32, f64, i64, pred, u8, u16, u32, u64
from phos.schema.cuda_types import CudaError, CUresult

# Generic-address windows of the state spaces, 4 GiB each, 1-3 TiB below EmuMemory's arena at BASE
# (the gap makes a pointer that strays below the first allocation fault, not hit a window).
PARAM_WIN, LOCAL_WIN, SHARED_WIN, WIN = BASE - (1 << 40), BASE - (2 << 40), BASE - (3 << 40), 1 << 32
OP, BRA, BRX, CALL, RET, EXIT, BAR, TRAP = range(8)
M64 = (1 << 64) - 1
ENVREG = re.compile(r'%envreg([0-9]|[12][0-9]|3[01])')


class Unsupported(Exception):
    pass


TRAP_STATUS = CUresult.CUDA_ERROR_LAUNCH_FAILED    # what __trap() gave on the H200 (CUDA 13, driver 580)


def err(status, msg):
    return CudaError(status, msg)


SPECIAL = {f'%{r}.{c}': u32 for r in ('tid', 'ntid', 'ctaid', 'nctaid') for c in 'xyz'}
SPECIAL.update({r: u32 for r in ('%laneid', '%warpid', '%nwarpid', '%smid', '%nsmid', '%lanemask_eq', '%lanemask_le',
                                 '%lanemask_lt', '%lanemask_ge', '%lanemask_gt', '%dynamic_smem_size',
                                 '%total_smem_size', '%clock', '%clock_hi', '%globaltimer_lo', '%globaltimer_hi')})
SPECIAL.update({'%clock64': u64, '%globaltimer': u64, '%gridid': u64})
DYNAMIC = {
    '%clock': lambda S: u32(S.clock & 0xFFFFFFFF), '%clock_hi': lambda S: u32(S.clock >> 32),
    '%clock64': lambda S: u64(S.clock),
    '%globaltimer': lambda S: u64(time.monotonic_ns()),
    '%globaltimer_lo': lambda S: u32(time.monotonic_ns() & 0xFFFFFFFF),
    '%globaltimer_hi': lambda S: u32(time.monotonic_ns() >> 32),
}
SPACE = {'global': 'global', 'shared': 'shared', 'shared::cta': 'shared', 'local': 'local', 'const': 'const',
         'param': 'param', 'param::entry': 'param', 'param::func': 'param'}
MEM_IGNORED = {'weak', 'volatile', 'relaxed', 'acquire', 'release', 'acq_rel', 'mmio', 'cta', 'gpu', 'sys', 'cluster',
               'ca', 'cg', 'cs', 'lu', 'cv', 'wb', 'wt', 'nc', 'L2::cache_hint', 'L2::64B', 'L2::128B', 'L2::256B',
               'L1::evict_normal', 'L1::evict_unchanged', 'L1::evict_first', 'L1::evict_last', 'L1::no_allocate',
               'L2::evict_normal', 'L2::evict_first', 'L2::evict_last', 'aligned'}
CMP_INT = {'eq': np.equal, 'ne': np.not_equal, 'lt': np.less, 'le': np.less_equal, 'gt': np.greater,
           'ge': np.greater_equal, 'lo': np.less, 'ls': np.less_equal, 'hi': np.greater, 'hs': np.greater_equal}


def _nan2(a, b):
    return np.isnan(a) | np.isnan(b)


CMP_FLOAT = {
    'eq': np.equal, 'lt': np.less, 'le': np.less_equal, 'gt': np.greater, 'ge': np.greater_equal,
    'ne': lambda a, b: np.not_equal(a, b) & ~_nan2(a, b),
    'equ': lambda a, b: np.equal(a, b) | _nan2(a, b), 'neu': np.not_equal,
    'ltu': lambda a, b: ~np.greater_equal(a, b), 'leu': lambda a, b: ~np.greater(a, b),
    'gtu': lambda a, b: ~np.less_equal(a, b), 'geu': lambda a, b: ~np.less(a, b),
    'num': lambda a, b: ~_nan2(a, b), 'nan': _nan2,
}
BOOL = {'and': np.logical_and, 'or': np.logical_or, 'xor': np.logical_xor}


class Mods:
    """The modifiers after an opcode; decoders take what they know, done() rejects the rest."""

    def __init__(self, mods):
        self.l = list(mods)

    def take(self, *opts):
        for o in opts:
            if o in self.l:
                self.l.remove(o)
                return o
        return None

    def types(self):
        ts = [m for m in self.l if m in P.TYPE_SIZE]
        self.l = [m for m in self.l if m not in P.TYPE_SIZE]
        return ts

    def type1(self):
        ts = self.types()
        if len(ts) != 1:
            raise Unsupported("expected one type")
        return ts[0]

    def drop(self, names):
        self.l = [m for m in self.l if m not in names]

    def space(self):
        for m in self.l:
            if m in SPACE:
                self.l.remove(m)
                return SPACE[m]
        return 'generic'

    def vec(self):
        v = self.take('v2', 'v4', 'v8')
        return int(v[1:]) if v else 1

    def done(self):
        if self.l:
            raise Unsupported(f"modifier .{self.l[0]}")


def imm(o, dt):
    """An immediate operand as a NumPy scalar of dt."""
    v, kind = o.value, o.kind
    if dt == pred:
        return np.bool_(v)
    if dt.kind == 'f':
        return dt.type(v)
    n = dt.itemsize
    if kind == 'f32':
        v = int(np.float32(v).view(u32))
    elif kind == 'f64':
        v = int(np.float64(v).view(u64))
    elif kind == 'float':
        raise Unsupported("float literal for an integer type")
    return np.array(v & ((1 << 8 * n) - 1), ops.UINT[n]).view(dt)[()]


DECODERS = {}


def op(*names):
    def reg(fn):
        for n in names:
            DECODERS[n] = fn
        return fn
    return reg


class Decoder:
    """Decodes one function's statements into instructions; names get the prefix 'func|'."""

    def __init__(self, mod, fn):
        self.mod, self.fn, self.pre = mod, fn, fn.name + '|'
        self.fvars = {v.name: v for v in fn.vars}
        self.fparams = {v.name: v for v in fn.params + fn.rets}
        self.callees, self.msyms = set(), set()
        self.touched = set()                    # registers the current statement reads or writes

    def decode(self):
        """(instructions, label -> index, errors, registers each instruction touches)."""
        code, labels, errors, regsets = [], {}, [], []
        for st in self.fn.body:
            if isinstance(st, P.Label):
                labels[st.name] = len(code)
                continue
            self.touched = set()
            try:
                ins = self.stmt(st)
            except Unsupported as e:
                detail = f": {e}" if str(e) else ""
                errors.append(f"unsupported PTX instruction '{st.op}' at line {st.line}{detail}")
                ins = [(TRAP, None, None, None, st.line)]
            except (AttributeError, TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
                errors.append(f"unsupported PTX instruction '{st.op}' at line {st.line}: operands not understood "
                              f"({type(e).__name__}: {e})")
                ins = [(TRAP, None, None, None, st.line)]
            code += ins
            regsets += [frozenset(self.touched)] * len(ins)
        code.append((RET, None, None, None, self.fn.line))     # falling off the end returns
        regsets.append(frozenset())
        return code, labels, errors, regsets

    def stmt(self, st):
        parts = st.op.split('.')
        dec = DECODERS.get(parts[0])
        if dec is None:
            raise Unsupported()
        M = Mods(parts[1:])
        r = dec(self, st, M)
        M.done()
        if callable(r):
            fn = r
            if st.guard is not None:
                fn = self.guarded(fn, st.guard)
            return [(OP, fn, None, None, st.line)]
        g = None if st.guard is None else self.src(st.guard, pred)
        return [ins[:3] + (g, st.line) if ins[0] != OP else
                (OP, ins[1] if g is None else self.guarded(ins[1], st.guard), None, None, st.line) for ins in r]

    def guarded(self, fn, guard):
        g = self.src(guard, pred)

        def run(S, m):
            p = g(S)
            if np.ndim(p) == 0:
                if p:
                    fn(S, m)
                return
            mm = p if m is None else p & m
            if mm.any():
                fn(S, mm)
        return run

    def args(self, st, n):
        if len(st.args) != n:
            raise Unsupported(f"expected {n} operands, found {len(st.args)}")
        return st.args

    # -- operands --
    def reg(self, name):
        """(register file key, dtype) of a declared register."""
        if name == '%cc':                       # the carry flag of add.cc/addc
            return '%cc', np.dtype(u32)
        if name not in self.fn.regs:
            raise Unsupported(f"unknown register {name}")
        if self.fn.regs[name] not in DT:
            raise Unsupported(f"register {name} of type .{self.fn.regs[name]}")
        return self.pre + name, DT[self.fn.regs[name]]

    def src(self, o, dt):
        dt = np.dtype(dt)
        if isinstance(o, P.Reg):
            if o.name in self.fn.regs or o.name == '%cc':
                key, rdt = self.reg(o.name)
                self.touched.add(key)
                g = (lambda S: S.R[key]) if rdt == dt else (lambda S: as_(S.R[key], dt))
            elif o.name in DYNAMIC:
                d = DYNAMIC[o.name]
                g = lambda S: as_(d(S), dt)
            elif o.name in SPECIAL:
                key = o.name
                g = (lambda S: S.R[key]) if SPECIAL[key] == dt else (lambda S: as_(S.R[key], dt))
            elif ENVREG.fullmatch(o.name):          # the driver's environment registers (interp.launch)
                n = int(ENVREG.fullmatch(o.name).group(1))
                g = lambda S: as_(np.asarray(u32(S.envreg.get(n, 0))), dt)[()]
            else:
                raise Unsupported(f"unknown register {o.name}")
            if o.neg:
                if dt != pred:
                    raise Unsupported("negated non-predicate operand")
                g0 = g
                g = lambda S: np.logical_not(g0(S))
            return g
        if isinstance(o, P.Imm):
            c = imm(o, dt)
            return lambda S: c
        if isinstance(o, P.Sym):
            if o.name == 'WARP_SZ':                 # PTX's built-in constant
                c = as_(np.asarray(u32(32)), dt)[()]
                return lambda S: c
            key, kind = self.sym(o.name)
            if kind in ('func', 'fparam'):
                raise Unsupported(f"address of {o.name}")
            off, mask = o.off, (1 << 8 * dt.itemsize) - 1
            t = dt.type
            return lambda S: t((S.sym[key] + off) & mask)
        raise Unsupported(f"operand {o}")

    def dst(self, o, dt, compressed=False):
        """Setter (S, value, mask) for a destination; compressed: value holds only the masked lanes."""
        if isinstance(o, P.Reg) and o.name == '_':
            return lambda S, v, m: None
        if not isinstance(o, P.Reg) or o.neg:
            raise Unsupported("bad destination")
        key, rdt = self.reg(o.name)
        self.touched.add(key)
        if compressed:
            def setc(S, v, m):
                v = as_(v, rdt)
                if m is None:
                    S.R[key] = v
                else:
                    r = np.array(np.broadcast_to(S.R[key], (S.N,)))
                    r[m] = v
                    S.R[key] = r
            return setc

        def set_(S, v, m):
            if v.dtype != rdt:
                v = as_(v, rdt)
            S.R[key] = v if m is None else np.where(m, v, S.R[key])
        return set_

    def sym(self, name):
        """(key in S.sym, kind) of a symbol: global, shared, local, kparam, fparam or func."""
        if name in self.fvars:
            v = self.fvars[name]
            kind = {'param': 'fparam', 'shared': 'shared', 'local': 'local'}.get(v.space)
            if kind is None:
                raise Unsupported(f"function-scope .{v.space} variable {name}")
            return self.pre + name, kind
        if name in self.fparams:
            return self.pre + name, ('kparam' if self.fn.entry else 'fparam')
        tree = self.mod.tree
        if name in tree.vars:
            v = tree.vars[name]
            self.msyms.add(name)
            if v.space in ('global', 'const'):
                return name, 'global'
            if v.space in ('shared', 'local'):
                return name, v.space
            raise Unsupported(f".{v.space} variable {name}")
        if name in tree.funcs:
            return name, 'func'
        raise Unsupported(f"unknown symbol {name}")

    def addr(self, o, space):
        """Getter of the uint64 address an [a+off] operand names, in `space` (generic: a generic address)."""
        if not isinstance(o, P.Addr):
            raise Unsupported("expected an address operand")
        off = o.off & M64
        if o.base is None:
            c = u64(off)
            return lambda S: c
        if isinstance(o.base, P.Reg):
            g = self.src(o.base, u64)
            if not off:
                return g
            c = u64(off)
            return lambda S: g(S) + c
        key, kind = self.sym(o.base.name)
        win = 0
        if space == 'generic':
            win = {'shared': SHARED_WIN, 'local': LOCAL_WIN, 'kparam': PARAM_WIN, 'global': 0}.get(kind)
            if win is None:
                raise Unsupported(f"generic address of {o.base.name}")
        elif {'global': 'global', 'const': 'global', 'shared': 'shared', 'local': 'local',
              'param': 'kparam'}[space] != kind:
            raise Unsupported(f"{o.base.name} is not in .{space}")
        return lambda S: u64((S.sym[key] + off + win) & M64)

    def pbuf(self, o):
        """(key, kind, offset) of a .param operand [name+off]: a kernel parameter or a per-lane buffer."""
        if not isinstance(o, P.Addr) or not isinstance(o.base, P.Sym):
            raise Unsupported("param access through a register")
        key, kind = self.sym(o.base.name)
        return key, kind, o.off


def _u(v):
    return np.asarray(v).astype(np.int64)


# ---- arithmetic ----
def _float_mods(M):
    return M.take('rn', 'rz', 'rm', 'rp'), M.take('ftz'), M.take('sat')


def _post(t, ftz, sat):
    """Output flushing / saturation for float results."""
    if not ftz and not sat:
        return lambda x: x
    def post(x):
        x = np.asarray(x, DT[t])
        if ftz and t == 'f32':
            x = ops.ftz(x)
        if sat:
            x = ops.sat(x)
        return x[()] if x.ndim == 0 else x
    return post


def _ftz(v):
    r = ops.ftz(np.asarray(v))
    return r[()] if r.ndim == 0 else r


def _pre(t, ftz):
    """Input flushing for .ftz (f32 only)."""
    if ftz and t == 'f32':
        return lambda g: (lambda S: _ftz(g(S)))
    return lambda g: g


def alu(D, st, dt, fn, n, sdt=None):
    """d = fn(a, b, ...) over n sources of dtype sdt (default dt)."""
    D.args(st, n + 1)
    d = D.dst(st.args[0], dt)
    gs = [D.src(a, sdt or dt) for a in st.args[1:]]
    if n == 1:
        g0, = gs
        return lambda S, m: d(S, fn(g0(S)), m)
    if n == 2:
        g0, g1 = gs
        return lambda S, m: d(S, fn(g0(S), g1(S)), m)
    g0, g1, g2 = gs
    return lambda S, m: d(S, fn(g0(S), g1(S), g2(S)), m)


def _arr(x, dt):
    x = np.asarray(x).astype(dt, copy=False)
    return x[()] if x.ndim == 0 else x


HALF = {'f16x2': ('f16', True), 'bf16': ('bf16', False), 'bf16x2': ('bf16', True)}   # values held as bits


def float_alu(D, st, M, name, t, n):
    mode, ftz, sat = _float_mods(M)
    if name in ('mad', 'fma') and mode is None:
        raise Unsupported("fma/mad without a rounding mode")
    opn = {'mad': 'fma'}.get(name, name)
    if t in HALF:
        if mode not in (None, 'rn') or ftz or name == 'mad':
            raise Unsupported()
        elem, packed = HALF[t]
        return alu(D, st, DT[t], lambda *a: ops.half_op(opn, elem, packed, a, bool(sat)), n)
    dt = DT[t]
    pre, post = _pre(t, ftz), _post(t, ftz, sat)
    D.args(st, n + 1)
    d = D.dst(st.args[0], dt)
    gs = [pre(D.src(a, dt)) for a in st.args[1:]]
    mode = mode or 'rn'
    if opn in ('add', 'sub', 'mul', 'fma'):
        def f(S, m):
            d(S, post(_arr(ops.float_op(opn, t, mode, [g(S) for g in gs]), dt)), m)
        return f
    raise Unsupported()


@op('add', 'sub', 'mul', 'mad', 'fma')
def d_arith(D, st, M):
    name = st.op.split('.')[0]
    ts = M.types()
    if len(ts) != 1:
        raise Unsupported("expected one type")
    t = ts[0]
    if ops.is_float(t) or t in ('f16x2', 'bf16', 'bf16x2'):
        return float_alu(D, st, M, name, t, 3 if name in ('mad', 'fma') else 2)
    dt = DT[t]
    if t == 'pred':
        raise Unsupported()
    if name in ('add', 'sub'):
        sat, cc = M.take('sat'), M.take('cc')
        if sat:
            if t != 's32':
                raise Unsupported(".sat on non-s32")
            sign = 1 if name == 'add' else -1
            return alu(D, st, dt, lambda a, b: _arr(np.clip(_u(a) + sign * _u(b), -2 ** 31, 2 ** 31 - 1), dt), 2)
        if cc:
            return _carry(D, st, dt, name, cin=False, cout=True)
        return alu(D, st, dt, (lambda a, b: a + b) if name == 'add' else (lambda a, b: a - b), 2)
    if name == 'mul':
        mode = M.take('lo', 'hi', 'wide')
        if mode is None or mode == 'lo':
            return alu(D, st, dt, lambda a, b: a * b, 2)
        if mode == 'hi':
            return alu(D, st, dt, lambda a, b: ops.mulhi(np.asarray(a), np.asarray(b), dt), 2)
        wd = ops.wide(dt)
        return alu(D, st, wd, lambda a, b: _arr(np.asarray(a).astype(wd) * np.asarray(b).astype(wd), wd), 2, sdt=dt)
    # mad
    mode = M.take('lo', 'hi', 'wide')
    sat, cc = M.take('sat'), M.take('cc')
    if cc:
        if mode not in ('lo', 'hi'):
            raise Unsupported()
        return _carry(D, st, dt, 'add', cin=False, cout=True, mul=mode)
    if sat:
        raise Unsupported()
    if mode is None or mode == 'lo':
        return alu(D, st, dt, lambda a, b, c: a * b + c, 3)
    if mode == 'hi':
        return alu(D, st, dt, lambda a, b, c: ops.mulhi(np.asarray(a), np.asarray(b), dt) + c, 3)
    wd = ops.wide(dt)
    D.args(st, 4)
    d = D.dst(st.args[0], wd)
    ga, gb, gc = D.src(st.args[1], dt), D.src(st.args[2], dt), D.src(st.args[3], wd)
    return lambda S, m: d(S, _arr(np.asarray(ga(S)).astype(wd) * np.asarray(gb(S)).astype(wd) + gc(S), wd), m)


@op('addc', 'subc', 'madc')
def d_addc(D, st, M):
    name = st.op.split('.')[0]
    mul = M.take('lo', 'hi') if name == 'madc' else None
    cc = M.take('cc')
    dt = DT[M.type1()]
    if name == 'madc' and mul is None:
        raise Unsupported()
    return _carry(D, st, dt, 'sub' if name == 'subc' else 'add', cin=True, cout=bool(cc), mul=mul)


def _carry(D, st, dt, name, cin, cout, mul=None):
    """add.cc/addc/sub.cc/subc/mad{c}.{lo,hi}.cc: the carry (borrow) flag lives in the per-lane register %cc."""
    ud = ops.UINT[dt.itemsize]
    D.args(st, 4 if mul else 3)
    d = D.dst(st.args[0], dt)
    gs = [D.src(x, dt) for x in st.args[1:]]
    setcc = D.dst(P.Reg('%cc'), u32)
    getcc = D.src(P.Reg('%cc'), u32)

    def f(S, m):
        v = [np.asarray(g(S)) for g in gs]
        if mul:                                  # the lo or hi half of a*b takes a's place
            v = [(v[0] * v[1]).astype(dt) if mul == 'lo' else ops.mulhi(v[0], v[1], dt), v[2]]
        a, b = as_(np.asarray(v[0]), ud), as_(np.asarray(v[1]), ud)
        c = np.asarray(getcc(S)).astype(ud) if cin else ud.type(0)
        if name == 'add':
            r1 = (a + b).astype(ud)
            r = (r1 + c).astype(ud)
            co = (r1 < a) | (r < r1)
        else:
            r1 = (a - b).astype(ud)
            r = (r1 - c).astype(ud)
            co = (a < b) | (r1 < c)
        d(S, _arr(r, ud), m)
        if cout:
            setcc(S, _arr(co.astype(u32), u32), m)
    return f


@op('div', 'rem')
def d_div(D, st, M):
    name = st.op.split('.')[0]
    t = M.types()
    if len(t) != 1:
        raise Unsupported()
    t = t[0]
    dt = DT.get(t)
    if ops.is_float(t) and t != 'f16' and name == 'div':
        kind = M.take('approx', 'full')
        mode, ftz, sat = _float_mods(M)
        if sat:
            raise Unsupported()
        pre, post = _pre(t, ftz), _post(t, ftz, False)
        if kind:
            if t != 'f32':
                raise Unsupported()
            return alu(D, st, dt, lambda a, b: post(_arr(np.true_divide(a, b), dt)), 2)
        if mode is None:
            raise Unsupported("div without a rounding mode")
        D.args(st, 3)
        d = D.dst(st.args[0], dt)
        ga, gb = pre(D.src(st.args[1], dt)), pre(D.src(st.args[2], dt))
        return lambda S, m: d(S, post(_arr(ops.float_op('div', t, mode, [ga(S), gb(S)]), dt)), m)
    if dt is None or dt.kind not in 'iu':
        raise Unsupported()
    return alu(D, st, dt, lambda a, b: ops.int_div(np.asarray(a), np.asarray(b), dt, name == 'rem'), 2)


@op('min', 'max')
def d_minmax(D, st, M):
    name = st.op.split('.')[0]
    ftz, nan, relu = M.take('ftz'), M.take('NaN'), M.take('relu')
    t = M.type1()
    dt = DT.get(t)
    if dt is None or t == 'pred':
        raise Unsupported()
    if t in HALF:
        if ftz or nan or relu:
            raise Unsupported()
        elem, packed = HALF[t]
        return alu(D, st, dt, lambda a, b: ops.half_op(name, elem, packed, (a, b)), 2)
    if dt.kind == 'f':
        f = {('min', False): np.fmin, ('max', False): np.fmax, ('min', True): np.minimum,
             ('max', True): np.maximum}[name, bool(nan)]
        pre = _pre(t, ftz)
        D.args(st, 3)
        d = D.dst(st.args[0], dt)
        ga, gb = pre(D.src(st.args[1], dt)), pre(D.src(st.args[2], dt))
        if relu:
            def frelu(S, m):
                r = f(ga(S), gb(S))
                d(S, _arr(np.where(np.isnan(r), r, np.maximum(r, 0)), dt), m)
            return frelu
        return lambda S, m: d(S, f(ga(S), gb(S)), m)
    if relu:
        if t != 's32':
            raise Unsupported()
        f = np.minimum if name == 'min' else np.maximum
        return alu(D, st, dt, lambda a, b: np.maximum(f(a, b), dt.type(0)), 2)
    return alu(D, st, dt, np.minimum if name == 'min' else np.maximum, 2)


@op('abs', 'neg')
def d_absneg(D, st, M):
    name = st.op.split('.')[0]
    ftz = M.take('ftz')
    t = M.type1()
    dt = DT.get(t)
    if dt is None or t == 'pred':
        raise Unsupported()
    if t in HALF:                               # sign-bit operations on the packed bits
        if ftz:
            raise Unsupported()
        sign = dt.type(0x80008000 if dt.itemsize == 4 else 0x8000)
        return alu(D, st, dt, (lambda a: a & ~sign) if name == 'abs' else (lambda a: a ^ sign), 1)
    if dt.kind == 'f':
        pre = _pre(t, ftz)
        D.args(st, 2)
        d = D.dst(st.args[0], dt)
        g = pre(D.src(st.args[1], dt))
        f = np.abs if name == 'abs' else np.negative
        return lambda S, m: d(S, f(g(S)), m)
    if dt.kind == 'u':
        raise Unsupported()
    return alu(D, st, dt, (lambda a: np.abs(a)) if name == 'abs' else (lambda a: dt.type(0) - a), 1)


@op('sad')
def d_sad(D, st, M):
    dt = DT[M.type1()]
    w = i64

    def f(a, b, c):
        a, b = np.asarray(a).astype(w), np.asarray(b).astype(w)
        return _arr(np.abs(a - b).astype(dt) + c, dt)
    return alu(D, st, dt, f, 3)


@op('mul24', 'mad24')
def d_mul24(D, st, M):
    name = st.op.split('.')[0]
    mode = M.take('lo', 'hi')
    if M.take('sat'):
        raise Unsupported()
    t = M.type1()
    dt = DT[t]

    def prod(a, b):
        a, b = np.asarray(a).astype(i64), np.asarray(b).astype(i64)
        if t == 's32':
            a, b = (a << 40) >> 40, (b << 40) >> 40
        else:
            a, b = a & 0xFFFFFF, b & 0xFFFFFF
        p = a * b
        return _arr((p >> 16) if mode == 'hi' else p, dt)
    if name == 'mul24':
        return alu(D, st, dt, prod, 2)
    return alu(D, st, dt, lambda a, b, c: prod(a, b) + c, 3)


@op('copysign')
def d_copysign(D, st, M):
    t = M.type1()
    dt = DT[t]
    return alu(D, st, dt, lambda a, b: np.copysign(b, a), 2)


@op('testp')
def d_testp(D, st, M):
    kind = M.take('finite', 'infinite', 'number', 'notanumber', 'normal', 'subnormal')
    t = M.type1()
    dt = DT[t]
    tiny = np.finfo(dt).tiny
    f = {'finite': np.isfinite, 'infinite': np.isinf, 'number': lambda x: ~np.isnan(x), 'notanumber': np.isnan,
         'normal': lambda x: np.isfinite(x) & (np.abs(x) >= tiny),
         'subnormal': lambda x: (x != 0) & (np.abs(x) < tiny)}[kind]
    D.args(st, 2)
    d = D.dst(st.args[0], pred)
    g = D.src(st.args[1], dt)
    return lambda S, m: d(S, np.asarray(f(g(S)))[()], m)


@op('rcp', 'sqrt', 'rsqrt', 'ex2', 'lg2', 'sin', 'cos', 'tanh')
def d_math(D, st, M):
    name = st.op.split('.')[0]
    approx = M.take('approx')
    mode, ftz, sat = _float_mods(M)
    t = M.type1()
    if t not in ('f32', 'f64') or sat:
        raise Unsupported()
    dt = DT[t]
    pre, post = _pre(t, ftz), _post(t, ftz, False)
    D.args(st, 2)
    d = D.dst(st.args[0], dt)
    g = pre(D.src(st.args[1], dt))
    if approx:
        if mode or (t == 'f64' and name not in ('rcp', 'rsqrt', 'sqrt')):
            raise Unsupported()
        def f(S, m):
            r = ops.approx(name, np.asarray(g(S)))
            d(S, post(r[()] if r.ndim == 0 else r), m)
        return f
    if name not in ('rcp', 'sqrt') or mode is None:
        raise Unsupported("needs .approx or a rounding mode")
    return lambda S, m: d(S, post(_arr(ops.float_op(name, t, mode, [g(S)]), dt)), m)


# ---- logic and bits ----
@op('and', 'or', 'xor', 'not', 'cnot')
def d_logic(D, st, M):
    name = st.op.split('.')[0]
    t = M.type1()
    dt = DT[t]
    if t == 'pred':
        f = {'and': np.logical_and, 'or': np.logical_or, 'xor': np.logical_xor, 'not': np.logical_not}.get(name)
        if f is None:
            raise Unsupported()
        return alu(D, st, pred, f, 1 if name == 'not' else 2)
    if dt.kind == 'f':
        raise Unsupported()
    if name == 'not':
        return alu(D, st, dt, np.invert, 1)
    if name == 'cnot':
        return alu(D, st, dt, lambda a: _arr(a == 0, dt), 1)
    return alu(D, st, dt, {'and': np.bitwise_and, 'or': np.bitwise_or, 'xor': np.bitwise_xor}[name], 2)


@op('shl', 'shr')
def d_shift(D, st, M):
    name = st.op.split('.')[0]
    dt = DT[M.type1()]
    D.args(st, 3)
    d = D.dst(st.args[0], dt)
    ga, gb = D.src(st.args[1], dt), D.src(st.args[2], u32)
    left = name == 'shl'
    return lambda S, m: d(S, ops.shift(ga(S), gb(S), left, dt), m)


@op('bfe')
def d_bfe(D, st, M):
    dt = DT[M.type1()]
    D.args(st, 4)
    d = D.dst(st.args[0], dt)
    ga, gb, gc = D.src(st.args[1], dt), D.src(st.args[2], u32), D.src(st.args[3], u32)
    return lambda S, m: d(S, ops.bfe(ga(S), gb(S), gc(S), dt), m)


@op('bfi')
def d_bfi(D, st, M):
    dt = DT[M.type1()]
    D.args(st, 5)
    d = D.dst(st.args[0], dt)
    ga, gb, gc, gd = (D.src(st.args[1], dt), D.src(st.args[2], dt), D.src(st.args[3], u32), D.src(st.args[4], u32))
    return lambda S, m: d(S, ops.bfi(ga(S), gb(S), gc(S), gd(S), dt), m)


@op('popc', 'clz', 'brev', 'bfind')
def d_bits(D, st, M):
    name = st.op.split('.')[0]
    shiftamt = M.take('shiftamt') if name == 'bfind' else None
    t = M.type1()
    dt = DT[t]
    D.args(st, 2)
    g = D.src(st.args[1], dt)
    if name == 'brev':
        d = D.dst(st.args[0], dt)
        return lambda S, m: d(S, ops.brev(g(S)), m)
    d = D.dst(st.args[0], u32)
    f = {'popc': ops.popc, 'clz': lambda a: ops.clz(np.asarray(a)),
         'bfind': lambda a: ops.bfind(np.asarray(a), shiftamt)}[name]
    return lambda S, m: d(S, f(g(S)), m)


@op('prmt')
def d_prmt(D, st, M):
    M.take('b32')
    if M.l:
        raise Unsupported(f"prmt mode .{M.l[0]}")
    return alu(D, st, u32, ops.prmt, 3)


@op('bmsk')
def d_bmsk(D, st, M):
    clamp = M.take('clamp', 'wrap') == 'clamp'
    M.take('b32')
    return alu(D, st, u32, lambda a, b: ops.bmsk(a, b, clamp), 2)


@op('lop3')
def d_lop3(D, st, M):
    M.take('b32')
    D.args(st, 5)
    if not isinstance(st.args[4], P.Imm):
        raise Unsupported()
    lut = st.args[4].value & 0xFF
    st2 = P.Stmt(st.line, None, st.op, st.args[:4])
    return alu(D, st2, u32, lambda a, b, c: ops.lop3(np.asarray(a), np.asarray(b), np.asarray(c), lut), 3)


@op('shf')
def d_shf(D, st, M):
    left = M.take('l', 'r') == 'l'
    clamp = M.take('clamp', 'wrap') == 'clamp'
    M.take('b32')
    D.args(st, 4)
    d = D.dst(st.args[0], u32)
    ga, gb, gc = D.src(st.args[1], u32), D.src(st.args[2], u32), D.src(st.args[3], u32)

    def f(S, m):
        v = (np.asarray(gb(S)).astype(u64) << u64(32)) | np.asarray(ga(S)).astype(u64)
        n = np.asarray(gc(S)).astype(u64)
        n = np.minimum(n, u64(32)) if clamp else n & u64(31)
        r = ((v << n) >> u64(32)) if left else (v >> n)
        d(S, _arr(r & u64(0xFFFFFFFF), u32), m)
    return f


@op('dp4a', 'dp2a')
def d_dp(D, st, M):
    name = st.op.split('.')[0]
    half = M.take('lo', 'hi') if name == 'dp2a' else None
    ta, tb = M.types()
    D.args(st, 4)
    dt = DT['s32'] if 's32' in (ta, tb) else u32
    d = D.dst(st.args[0], dt)
    ga, gb, gc = D.src(st.args[1], u32), D.src(st.args[2], u32), D.src(st.args[3], dt)

    def parts(x, t, n, bits):
        x = np.asarray(x).astype(i64)
        out = []
        for k in range(n):
            v = (x >> (bits * k)) & ((1 << bits) - 1)
            if t == 's32':
                v = np.where(v >= 1 << (bits - 1), v - (1 << bits), v)
            out.append(v)
        return out

    def f(S, m):
        if name == 'dp4a':
            pa, pb = parts(ga(S), ta, 4, 8), parts(gb(S), tb, 4, 8)
        else:
            pa = parts(ga(S), ta, 2, 16)
            pb = parts(gb(S), tb, 4, 8)[2:] if half == 'hi' else parts(gb(S), tb, 4, 8)[:2]
        s = sum(x * y for x, y in zip(pa, pb)) + np.asarray(gc(S)).astype(i64)
        d(S, _arr(s, dt), m)
    return f


SIMD = {'vadd': np.add, 'vsub': np.subtract, 'vabsdiff': lambda a, b: np.abs(a - b), 'vmin': np.minimum,
        'vmax': np.maximum, 'vavrg': lambda a, b: (a + b + 1) >> 1}


@op(*[f"{v}{n}" for v in SIMD for n in (2, 4)])
def d_simd(D, st, M):
    """SIMD video ops (vabsdiff4 ...): per byte (or half) op, .sat clamps to the lane type, .add sums into c."""
    name = st.op.split('.')[0]
    f, n = SIMD[name[:-1]], int(name[-1])
    sat, add = M.take('sat'), M.take('add')
    ts = M.types()
    if len(ts) != 3 or sat and add or any(x not in ('u32', 's32') for x in ts):
        raise Unsupported()
    dtyp, atyp, btyp = ts
    D.args(st, 4)
    if any(not isinstance(x, (P.Reg, P.Imm)) for x in st.args):
        raise Unsupported("byte selectors or masks")
    d = D.dst(st.args[0], DT[dtyp])
    ga, gb, gc = D.src(st.args[1], u32), D.src(st.args[2], u32), D.src(st.args[3], u32)
    bits = 32 // n

    def lanes(x, signed):
        x = np.asarray(x).astype(i64)
        out = [(x >> (bits * k)) & ((1 << bits) - 1) for k in range(n)]
        return [np.where(v >= 1 << (bits - 1), v - (1 << bits), v) for v in out] if signed else out

    def fn(S, m):
        ra = [f(x, y) for x, y in zip(lanes(ga(S), atyp == 's32'), lanes(gb(S), btyp == 's32'))]
        c = np.asarray(gc(S)).astype(i64)
        if add:
            r = c + sum(ra)
        else:
            if sat:
                lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if dtyp == 's32' else (0, (1 << bits) - 1)
                ra = [np.clip(v, lo, hi) for v in ra]
            r = sum((v & ((1 << bits) - 1)) << (bits * k) for k, v in enumerate(ra))
        d(S, _arr(np.asarray(r) & 0xFFFFFFFF, u32).view(DT[dtyp]) if np.ndim(r) else
          _arr(np.asarray(r) & 0xFFFFFFFF, u32).view(DT[dtyp])[()], m)
    return fn


# ---- comparison and selection ----
def _cmp(cmpop, t):
    if ops.is_float(t):
        f = CMP_FLOAT.get(cmpop)
    else:
        f = CMP_INT.get(cmpop)
    if f is None:
        raise Unsupported(f"comparison .{cmpop}")
    return f


@op('setp', 'set')
def d_setp(D, st, M):
    name = st.op.split('.')[0]
    cmpop = M.l.pop(0) if M.l else None
    boolop = M.take('and', 'or', 'xor')
    ftz = M.take('ftz')
    ts = M.types()
    if name == 'setp':
        if len(ts) != 1:
            raise Unsupported()
        t = ts[0]
    else:
        if len(ts) != 2:
            raise Unsupported()
        dtyp, t = ts
    if t in ('f16x2', 'bf16x2', 'pred'):
        raise Unsupported()
    cf = _cmp(cmpop, 'f32' if t == 'bf16' else t)
    dt = DT[t]
    pre = (lambda g: (lambda S: ops.from_bf16(g(S)))) if t == 'bf16' else _pre(t, ftz)
    nargs = 4 if boolop else 3
    D.args(st, nargs)
    ga, gb = pre(D.src(st.args[1], dt)), pre(D.src(st.args[2], dt))
    gc = D.src(st.args[3], pred) if boolop else None
    bf = BOOL.get(boolop)
    out = st.args[0]
    if name == 'set':
        rdt = DT[dtyp]
        one = rdt.type(1.0) if rdt.kind == 'f' else rdt.type(-1 & ((1 << 8 * rdt.itemsize) - 1))
        d = D.dst(out, rdt)

        def f(S, m):
            r = cf(ga(S), gb(S))
            if gc:
                r = bf(r, gc(S))
            d(S, _arr(np.where(r, one, rdt.type(0)), rdt), m)
        return f
    dp = D.dst(out.a if isinstance(out, P.Pair) else out, pred)
    dq = D.dst(out.b, pred) if isinstance(out, P.Pair) else None

    def f(S, m):
        r = cf(ga(S), gb(S))
        if gc:
            c = gc(S)
            if dq:
                dq(S, np.asarray(bf(np.logical_not(r), c))[()], m)
            r = bf(r, c)
        elif dq:
            dq(S, np.asarray(np.logical_not(r))[()], m)
        dp(S, np.asarray(r)[()], m)
    return f


@op('selp')
def d_selp(D, st, M):
    dt = DT[M.type1()]
    D.args(st, 4)
    d = D.dst(st.args[0], dt)
    ga, gb, gc = D.src(st.args[1], dt), D.src(st.args[2], dt), D.src(st.args[3], pred)
    return lambda S, m: d(S, _arr(np.where(gc(S), ga(S), gb(S)), dt), m)


@op('slct')
def d_slct(D, st, M):
    ftz = M.take('ftz')
    dtyp, ctyp = M.types()
    dt, ct = DT[dtyp], DT[ctyp]
    D.args(st, 4)
    d = D.dst(st.args[0], dt)
    ga, gb, gc = D.src(st.args[1], dt), D.src(st.args[2], dt), _pre(ctyp, ftz)(D.src(st.args[3], ct))
    return lambda S, m: d(S, _arr(np.where(gc(S) >= 0, ga(S), gb(S)), dt), m)


# ---- moves and conversions ----
@op('mov')
def d_mov(D, st, M):
    t = M.type1()
    dt = DT.get(t)
    if dt is None:
        raise Unsupported()
    D.args(st, 2)
    dst, a = st.args
    if isinstance(a, P.Vec):            # pack {lo, ..., hi} into one wide register
        n = len(a.items)
        pt = ops.UINT[dt.itemsize // n]
        gs = [D.src(x, pt) for x in a.items]
        d = D.dst(dst, dt)
        wd = ops.UINT[dt.itemsize]
        bits = 8 * pt.itemsize

        def pack(S, m):
            r = wd.type(0)
            for k, g in enumerate(gs):
                r = r | (np.asarray(g(S)).astype(wd) << wd.type(bits * k))
            d(S, _arr(r, wd), m)
        return pack
    if isinstance(dst, P.Vec):          # unpack one wide register into {lo, ..., hi}
        n = len(dst.items)
        pt = ops.UINT[dt.itemsize // n]
        wd = ops.UINT[dt.itemsize]
        g = D.src(a, wd)
        ds = [D.dst(x, pt) for x in dst.items]
        bits = 8 * pt.itemsize

        def unpack(S, m):
            v = np.asarray(g(S))
            for k, d in enumerate(ds):
                d(S, _arr(v >> wd.type(bits * k), pt), m)
        return unpack
    d = D.dst(dst, dt)
    g = D.src(a, dt)
    return lambda S, m: d(S, g(S), m)


IRND = ('rni', 'rzi', 'rmi', 'rpi')
FRND = ('rn', 'rz', 'rm', 'rp', 'rna')


@op('cvt')
def d_cvt(D, st, M):
    irnd, frnd = M.take(*IRND), M.take(*FRND)
    ftz, sat, relu = M.take('ftz'), M.take('sat'), M.take('relu')
    ts = M.types()
    if len(ts) != 2:
        raise Unsupported("expected two types")
    dtyp, styp = ts
    if frnd == 'rna' or relu and dtyp not in ('f16', 'bf16', 'f16x2', 'bf16x2'):
        raise Unsupported()
    if dtyp in ('f16x2', 'bf16x2'):        # cvt.rn.f16x2.f32 d, a, b: d = {hi: a, lo: b}
        if styp != 'f32' or sat:
            raise Unsupported()
        D.args(st, 3)
        d = D.dst(st.args[0], u32)
        ga, gb = D.src(st.args[1], f32), D.src(st.args[2], f32)
        one = _cvt_fn(dtyp[:-2], 'f32', None, frnd or 'rn', False, False, bool(relu))

        def f(S, m):
            hi, lo = (as_(np.asarray(one(g(S))), u16).astype(u32) for g in (ga, gb))
            d(S, _arr((hi << u32(16)) | lo, u32), m)
        return f
    fn = _cvt_fn(dtyp, styp, irnd, frnd, ftz, sat, bool(relu))
    D.args(st, 2)
    sdt = u16 if styp == 'bf16' else DT[styp]
    ddt = u16 if dtyp == 'bf16' else DT[dtyp]
    d = D.dst(st.args[0], ddt)
    g = D.src(st.args[1], sdt)
    return lambda S, m: d(S, fn(g(S)), m)


def _cvt_fn(dtyp, styp, irnd, frnd, ftz, sat, relu):
    """The value conversion of cvt as a function of the source value."""
    sf, df = ops.is_float(styp) or styp == 'bf16', ops.is_float(dtyp) or dtyp == 'bf16'
    if styp == 'pred' or dtyp == 'pred' or styp in ('f16x2', 'bf16x2'):
        raise Unsupported()
    sdt = f32 if styp == 'bf16' else DT[styp]
    ddt = DT[dtyp] if dtyp != 'bf16' else u16

    def src(x):
        if styp == 'bf16':
            x = ops.from_bf16(x)
        if ftz and styp == 'f32':
            x = ops.ftz(np.asarray(x))
        return x
    if not sf and not df:                                   # int -> int
        if irnd or frnd or ftz:
            raise Unsupported()
        if not sat:
            return lambda x: _arr(x, ddt)
        lo, hi = ops.int_bounds(ddt)

        def isat(x):
            x = np.asarray(x)
            if x.dtype == u64:
                return _arr(np.minimum(x, u64(hi)) if hi < 2 ** 64 - 1 else x, ddt)
            x = x.astype(i64)
            if ddt == u64:
                return _arr(np.maximum(x, 0), ddt)
            return _arr(np.clip(x, lo, hi), ddt)
        return isat
    if sf and not df:                                       # float -> int
        if not irnd or frnd:
            raise Unsupported("float-to-int needs .rni/.rzi/.rmi/.rpi")
        return lambda x: ops.float_to_int(src(x), irnd, ddt)
    post = _post('f32' if dtyp == 'f32' else dtyp if dtyp in ('f16', 'f64') else 'f32', ftz and dtyp == 'f32', sat)
    if not sf:                                              # int -> float
        if irnd:
            raise Unsupported()
        mode = frnd or 'rn'
        if dtyp == 'bf16':
            return lambda x: ops.to_bf16(ops.int_to_float(np.asarray(x), mode, f32), 'rn')
        return lambda x: post(ops.int_to_float(np.asarray(x), mode, ddt))
    # float -> float
    if dtyp == 'bf16':
        if frnd not in ('rn', 'rz') or sat:
            raise Unsupported()
        return lambda x: ops.to_bf16(np.maximum(src(x), 0) if relu else src(x), frnd)
    ssz, dsz = np.dtype(sdt).itemsize, np.dtype(ddt).itemsize
    if irnd:
        if ssz != dsz:
            raise Unsupported()
        f = {'rni': np.rint, 'rzi': np.trunc, 'rmi': np.floor, 'rpi': np.ceil}[irnd]
        return lambda x: post(_arr(f(src(x)), ddt))
    if dsz > ssz or dsz == ssz:
        if frnd and dsz > ssz:
            raise Unsupported()
        return lambda x: post(_arr(src(x), ddt))
    if not frnd:
        raise Unsupported("narrowing cvt needs a rounding mode")
    mode = frnd
    if relu:
        return lambda x: post(ops.round_to(np.maximum(np.asarray(src(x), f64), 0), 0, mode, ddt))
    if styp == 'f64' and mode == 'rn':
        return lambda x: post(_arr(src(x), ddt))
    return lambda x: post(ops.round_to(np.asarray(src(x), f64), 0, mode, ddt))


@op('cvta')
def d_cvta(D, st, M):
    to = M.take('to')
    sp = M.space()
    t = M.type1()
    if sp == 'generic' or t not in ('u32', 'u64'):
        raise Unsupported()
    win = {'global': 0, 'const': 0, 'shared': SHARED_WIN, 'local': LOCAL_WIN, 'param': PARAM_WIN}[sp]
    dt = DT[t]
    D.args(st, 2)
    d = D.dst(st.args[0], dt)
    g = D.src(st.args[1], u64)
    w = u64((-win if to else win) & M64)
    return lambda S, m: d(S, _arr(np.asarray(g(S)) + w, dt), m)


@op('isspacep')
def d_isspacep(D, st, M):
    sp = M.space()
    if sp == 'generic':
        raise Unsupported()
    D.args(st, 2)
    d = D.dst(st.args[0], pred)
    g = D.src(st.args[1], u64)
    win = {'shared': SHARED_WIN, 'local': LOCAL_WIN, 'param': PARAM_WIN}.get(sp)

    def f(S, m):
        a = np.asarray(g(S))
        if win is None:
            r = (a >= u64(S.mem.base)) & (a < u64(S.mem.base + S.mem.capacity))
        else:
            r = (a - u64(win)) < u64(WIN)
        d(S, r[()] if r.ndim == 0 else r, m)
    return f


# ---- memory ----
def _mem_common(M):
    sp = M.space()
    if 'shared::cluster' in M.l:
        raise Unsupported("cluster shared memory")
    nvec = M.vec()
    M.drop(MEM_IGNORED)
    M.l = [x for x in M.l if not x.startswith('L1::') and not x.startswith('L2::')]
    t = M.type1()
    if t in ('b128', 'pred'):
        raise Unsupported(f".{t}")
    return sp, nvec, t


@op('ld', 'ldu')
def d_ld(D, st, M):
    sp, nvec, t = _mem_common(M)
    dt = DT[t]
    if len(st.args) == 3 and isinstance(st.args[2], P.Reg):   # cache policy operand
        st = P.Stmt(st.line, st.guard, st.op, st.args[:2])
    D.args(st, 2)
    dst, a = st.args
    dests = dst.items if isinstance(dst, P.Vec) else [dst]
    if len(dests) != nvec:
        raise Unsupported("vector size mismatch")
    sets = [D.dst(x, dt, compressed=True) for x in dests]
    if sp == 'param' and isinstance(a, P.Addr) and isinstance(a.base, P.Sym):
        key, kind, off = D.pbuf(a)
        w = dt.itemsize
        if kind == 'kparam':                                 # uniform: one value for all lanes
            def ldk(S, m):
                for k, s in enumerate(sets):
                    o = S.sym[key] + off + k * w
                    if o + w > len(S.kparams):
                        raise err(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "kernel parameter read past the parameter buffer")
                    v = np.frombuffer(S.kparams, dt, 1, o)[0]
                    s(S, v if m is None else np.full(S.count(m), v), m)
            return ldk

        def ldp(S, m):
            buf = S.pb[key]
            for k, s in enumerate(sets):
                o = off + k * w
                raw = buf[:, o:o + w] if m is None else buf[m, o:o + w]
                s(S, np.ascontiguousarray(raw).view(dt).reshape(-1), m)
        return ldp
    ag = D.addr(a, sp)

    def ld(S, m):
        a = S.take(ag(S), m)
        vals = S.load(sp, a, dt, nvec, m)
        for k, s in enumerate(sets):
            s(S, vals[k], m)
    return ld


@op('st')
def d_st(D, st, M):
    sp, nvec, t = _mem_common(M)
    dt = DT[t]
    if len(st.args) == 3 and isinstance(st.args[2], P.Reg):
        st = P.Stmt(st.line, st.guard, st.op, st.args[:2])
    D.args(st, 2)
    a, val = st.args
    items = val.items if isinstance(val, P.Vec) else [val]
    if len(items) != nvec:
        raise Unsupported("vector size mismatch")
    gs = [D.src(x, dt) for x in items]
    w = dt.itemsize
    if sp == 'param':
        key, kind, off = D.pbuf(a)
        if kind == 'kparam':
            raise Unsupported("store to a kernel parameter")

        def stp(S, m):
            buf = S.pb[key]
            n = S.count(m)
            for k, g in enumerate(gs):
                v = np.ascontiguousarray(S.take(as_(np.asarray(g(S)), dt), m))
                o = off + k * w
                if m is None:
                    buf[:, o:o + w] = v.view(u8).reshape(n, w)
                else:
                    buf[m, o:o + w] = v.view(u8).reshape(n, w)
        return stp
    ag = D.addr(a, sp)

    def st_(S, m):
        a = S.take(ag(S), m)
        S.store(sp, a, dt, [S.take(as_(np.asarray(g(S)), dt), m) for g in gs], m)
    return st_


@op('prefetch', 'prefetchu', 'discard', 'applypriority')
def d_prefetch(D, st, M):
    M.l = []
    return lambda S, m: None


@op('createpolicy')
def d_createpolicy(D, st, M):
    M.l = []          # an opaque L2 policy; only cache-hint operands (which we ignore) consume it
    d = D.dst(st.args[0], u64)
    return lambda S, m: d(S, u64(0), m)


ATOM_OPS = ('add', 'min', 'max', 'and', 'or', 'xor', 'exch', 'cas', 'inc', 'dec')


@op('atom', 'red')
def d_atom(D, st, M):
    name = st.op.split('.')[0]
    sp = M.space()
    if sp not in ('global', 'shared', 'generic'):
        raise Unsupported()
    aop = M.take(*ATOM_OPS)
    if aop is None:
        raise Unsupported("atomic operation")
    M.drop(MEM_IGNORED)
    M.l = [x for x in M.l if not x.startswith('L2::')]
    if M.take('v2', 'v4', 'v8'):
        raise Unsupported("vector atomics")
    t = M.type1()
    if t not in ('b32', 'b64', 'u32', 'u64', 's32', 's64', 'f32', 'f64'):
        raise Unsupported(f"atomic .{t}")
    dt = DT[t]
    args = list(st.args)
    if len(args) and isinstance(args[-1], P.Reg) and 'L2::cache_hint' in st.op:
        args = args[:-1]
    n = (3 if aop == 'cas' else 2) + (name == 'atom')
    if len(args) != n:
        raise Unsupported("operand count")
    d = D.dst(args[0], dt, compressed=True) if name == 'atom' else None
    rest = args[1:] if name == 'atom' else args
    ag = D.addr(rest[0], sp)
    gb = D.src(rest[1], dt)
    gc = D.src(rest[2], dt) if aop == 'cas' else None
    fn, uf = ops.atom_fn(aop, dt)

    def f(S, m):
        a = S.take(ag(S), m)
        b = S.take(gb(S), m)
        c = None if gc is None else S.take(gc(S), m)
        old = S.atomic(sp, a, dt, fn, uf, b, c, m)
        if d:
            d(S, old, m)
    return f


def _mb_update(D, o, fn):
    """An op on the mbarrier at shared (or generic) address o: fn(S, lane, word) -> new word or None,
    lane by lane in order, as the arrivals of a warp happen one after another."""
    space = 'shared'
    ga = D.addr(o, space)

    def f(S, m):
        a = np.broadcast_to(ga(S), (S.N,))
        for lane in S.lane_list(m):
            sel = np.zeros(S.N, bool)
            sel[lane] = True
            (_, buf, off), = S.locate(space, np.array([a[lane]], u64), 8, sel)
            o8 = int(off[0])
            word = int(np.frombuffer(bytes(buf[o8:o8 + 8]), u64)[0])
            new = fn(S, lane, word)
            if new is not None:
                buf[o8:o8 + 8] = np.frombuffer(np.uint64(new).tobytes(), u8)
    return f


@op('mbarrier')
def d_mbarrier(D, st, M):
    """mbarrier.init/arrive/arrive_drop/test_wait/try_wait{.parity}/inval on .shared, as cuda::barrier uses them."""
    kind = M.take('init', 'arrive', 'arrive_drop', 'test_wait', 'try_wait', 'inval')
    parity = M.take('parity')
    sp = M.space()
    M.drop(MEM_IGNORED)
    M.take('b64')
    if kind is None or sp not in ('shared', 'generic') or M.l:
        raise Unsupported()
    if sp == 'generic':
        raise Unsupported("mbarrier on a generic address")
    args = st.args
    if kind == 'inval':
        return lambda S, m: None
    if kind == 'init':
        D.args(st, 2)
        gc = D.src(args[1], u32)
        return _mb_update(D, args[0], lambda S, lane, w: ops.mb_init(int(np.broadcast_to(gc(S), (S.N,))[lane])))
    if kind in ('arrive', 'arrive_drop'):
        if len(args) not in (2, 3):
            raise Unsupported("operand count")
        gc = D.src(args[2], u32) if len(args) == 3 else None
        d = D.dst(args[0], u64)
        tokens = {}

        def arrive(S, lane, w):
            n = 1 if gc is None else int(np.broadcast_to(gc(S), (S.N,))[lane])
            new, tokens[lane] = ops.mb_arrive(w, n, kind == 'arrive_drop')
            return new
        up = _mb_update(D, args[1], arrive)

        def f(S, m):
            tokens.clear()
            up(S, m)
            tok = np.zeros(S.N, u64)
            for lane, v in tokens.items():
                tok[lane] = v
            d(S, tok, m)
        return f
    if len(args) not in (3, 4):
        raise Unsupported("operand count")
    d = D.dst(args[0], pred)
    gs = D.src(args[2], u64)
    done = {}

    def test(S, lane, w):
        done[lane] = ops.mb_done(w, int(np.broadcast_to(gs(S), (S.N,))[lane]), bool(parity))
    up = _mb_update(D, args[1], test)

    def f(S, m):
        done.clear()
        up(S, m)
        r = np.zeros(S.N, bool)
        for lane, v in done.items():
            r[lane] = v
        d(S, r, m)
    return f


@op('cp')
def d_cp(D, st, M):
    """cp.async.{ca,cg}.shared.global: done synchronously (commit/wait become no-ops); so an mbarrier
    arrival on their completion is an arrival now (.noinc), or none (the pending count it adds first)."""
    if M.take('async') is None:
        raise Unsupported()
    if M.take('commit_group', 'wait_group', 'wait_all'):
        M.l = []
        return lambda S, m: None
    if M.take('mbarrier'):
        M.take('arrive')
        noinc = M.take('noinc')
        sp = M.space()
        M.take('b64')
        if sp != 'shared' or M.l:
            raise Unsupported()
        D.args(st, 1)
        if not noinc:
            return lambda S, m: None
        return _mb_update(D, st.args[0], lambda S, lane, w: ops.mb_arrive(w)[0])
    M.take('ca', 'cg')
    if M.take('shared') is None or M.take('global') is None:
        raise Unsupported()
    M.l = [x for x in M.l if not x.startswith('L2::')]
    args = st.args
    if len(args) < 3:
        raise Unsupported()
    gdst, gsrc = D.addr(args[0], 'shared'), D.addr(args[1], 'global')
    size = args[2].value if isinstance(args[2], P.Imm) else None
    if size not in (4, 8, 16):
        raise Unsupported("cp-size")
    gss = None
    if len(args) > 3:
        x = args[3]
        if isinstance(x, P.Imm) or isinstance(x, P.Reg) and D.fn.regs.get(x.name) in ('b32', 'u32', 's32'):
            gss = D.src(x, u32)
        elif not (isinstance(x, P.Reg) and 'L2::cache_hint' in st.op):
            raise Unsupported("cp.async operand")

    def f(S, m):
        dst, src = S.take(gdst(S), m), S.take(gsrc(S), m)
        vals = S.load('global', src, u8, size, m) if gss is None else None
        if gss is not None:
            ss = S.take(gss(S), m).astype(np.int64)
            vals = []
            for k in range(size):
                keep = k < ss
                v = np.zeros(len(src), u8)
                if keep.any():
                    v[keep] = S.load('global', src[keep] + u64(k), u8, 1, None)[0]
                vals.append(v)
        S.store('shared', dst, u8, vals, m)
    return f


# ---- synchronisation and warps ----
@op('bar', 'barrier')
def d_bar(D, st, M):
    M.take('cta')
    if M.take('warp'):
        M.take('sync')
        return lambda S, m: None                # __syncwarp: lanes of a group already run in lockstep
    kind = M.take('sync', 'arrive', 'red')
    M.take('aligned')
    if kind is None:
        kind = 'sync'
    red = None
    args = list(st.args)
    if kind == 'red':
        rop = M.take('popc', 'and', 'or')
        t = M.type1()
        if rop is None:
            raise Unsupported()
        d = D.dst(args[0], u32 if rop == 'popc' else pred, compressed=True)
        gp = D.src(args[-1], pred)
        red = (rop, d, gp)
        args = args[1:-1]
    if not 1 <= len(args) <= 2:
        raise Unsupported("operand count")
    gid = D.src(args[0], u32)
    gcount = D.src(args[1], u32) if len(args) > 1 else None
    if kind == 'arrive' and gcount is None:
        raise Unsupported("bar.arrive without a count")
    return [(BAR, (gid, gcount, kind != 'arrive', red), None)]


@op('membar', 'fence')
def d_fence(D, st, M):
    M.l = []
    return lambda S, m: None


@op('nanosleep', 'pmevent', 'griddepcontrol', 'setmaxnreg')
def d_noop(D, st, M):
    M.l = []
    return lambda S, m: None


@op('shfl')
def d_shfl(D, st, M):
    M.take('sync')
    mode = M.take('up', 'down', 'bfly', 'idx')
    if mode is None:
        raise Unsupported()
    t = M.type1()
    if t not in ('b32', 'u32', 's32', 'f32'):
        raise Unsupported()
    args = st.args
    if len(args) not in (4, 5):
        raise Unsupported("operand count")
    out = args[0]
    d = D.dst(out.a if isinstance(out, P.Pair) else out, u32)
    dp = D.dst(out.b, pred) if isinstance(out, P.Pair) else None
    ga, gb, gc = D.src(args[1], u32), D.src(args[2], u32), D.src(args[3], u32)

    def f(S, m):
        v, p = S.shfl(mode, ga(S), gb(S), gc(S))
        d(S, v, m)
        if dp:
            dp(S, p, m)
    return f


@op('vote')
def d_vote(D, st, M):
    M.take('sync')
    mode = M.take('all', 'any', 'uni', 'ballot')
    t = M.type1()
    if mode is None:
        raise Unsupported()
    if len(st.args) not in (2, 3):
        raise Unsupported("operand count")
    g = D.src(st.args[1], pred)
    if mode == 'ballot':
        d = D.dst(st.args[0], u32)
        return lambda S, m: d(S, S.ballot(g(S), m), m)
    d = D.dst(st.args[0], pred)

    def f(S, m):
        p = np.broadcast_to(g(S), (S.N,))
        yes = S.ballot(p, m)
        act = S.ballot(True, m)
        r = {'all': yes == act, 'any': yes != 0, 'uni': (yes == act) | (yes == 0)}[mode]
        d(S, r, m)
    return f


@op('activemask')
def d_activemask(D, st, M):
    M.take('b32')
    D.args(st, 1)
    d = D.dst(st.args[0], u32)
    return lambda S, m: d(S, S.ballot(True, m), m)


@op('match')
def d_match(D, st, M):
    M.take('sync')
    mode = M.take('any', 'all')
    t = M.type1()
    if mode is None or t not in ('b32', 'b64'):
        raise Unsupported()
    dt = DT[t]
    out = st.args[0]
    d = D.dst(out.a if isinstance(out, P.Pair) else out, u32)
    dp = D.dst(out.b, pred) if isinstance(out, P.Pair) else None
    g = D.src(st.args[1], dt)

    def f(S, m):
        same, act = S.match(g(S), m)
        if mode == 'any':
            d(S, same, m)
        else:
            allsame = same == act
            d(S, np.where(allsame, act, u32(0)), m)
            if dp:
                dp(S, allsame, m)
    return f


@op('redux')
def d_redux(D, st, M):
    M.take('sync')
    rop = M.take('add', 'min', 'max', 'and', 'or', 'xor')
    t = M.type1()
    if rop is None or t not in ('u32', 's32', 'b32'):
        raise Unsupported()
    dt = DT[t]
    D.args(st, 3)
    d = D.dst(st.args[0], dt)
    g = D.src(st.args[1], dt)
    return lambda S, m: d(S, S.redux(rop, g(S), dt, m), m)


# ---- control flow ----
@op('bra')
def d_bra(D, st, M):
    M.take('uni')
    D.args(st, 1)
    if not isinstance(st.args[0], P.Sym):
        raise Unsupported("indirect branch")
    return [(BRA, st.args[0].name, None)]


@op('brx')
def d_brx(D, st, M):
    M.take('idx')
    M.take('uni')
    D.args(st, 2)
    labels = D.fn.targets.get(st.args[1].name) if isinstance(st.args[1], P.Sym) else None
    if not labels:
        raise Unsupported("brx.idx without .branchtargets")
    return [(BRX, (D.src(st.args[0], u32), labels), None)]


@op('ret')
def d_ret(D, st, M):
    M.take('uni')
    return [(RET, None, None)]


@op('exit')
def d_exit(D, st, M):
    return [(EXIT, None, None)]


@op('trap')
def d_trap(D, st, M):
    return [(TRAP, 'trap', None)]


@op('call')
def d_call(D, st, M):
    M.take('uni')
    args = list(st.args)
    rets = args.pop(0).items if args and isinstance(args[0], P.Group) else []
    if not args or not isinstance(args[0], P.Sym):
        raise Unsupported("indirect call")
    callee = args.pop(0).name
    actuals = args.pop(0).items if args and isinstance(args[0], P.Group) else []
    if args:
        raise Unsupported("call with a prototype")
    akeys = [D.sym(a.name)[0] for a in actuals]
    rkeys = [D.sym(r.name)[0] for r in rets]
    if callee in BUILTINS:
        return BUILTINS[callee](D, akeys, rkeys)
    fn = D.mod.tree.funcs.get(callee)
    if fn is None:
        raise Unsupported(f"call to unknown function {callee}")
    if fn.body is None:
        raise Unsupported(f"call to external function {callee}")
    if len(fn.params) != len(actuals) or len(fn.rets) != len(rets):
        raise Unsupported(f"call to {callee} with the wrong number of arguments")
    D.callees.add(callee)
    pre = callee + '|'
    ins = [(pre + p.name, a) for p, a in zip(fn.params, akeys)]
    outs = [(r, pre + p.name) for p, r in zip(fn.rets, rkeys)]

    def copy(pairs):
        def f(S, m):
            for dst, src in pairs:
                db, sb = S.pb[dst], S.pb[src]
                n = min(db.shape[1], sb.shape[1])
                if m is None:
                    db[:, :n] = sb[:, :n]
                else:
                    db[m, :n] = sb[m, :n]
        return f
    return [(CALL, (callee, copy(ins)), None), (OP, copy(outs), None)]


def _vprintf(D, akeys, rkeys):
    if len(akeys) != 2:
        raise Unsupported("vprintf arguments")

    def f(S, m):
        fmts = S.pb[akeys[0]].view(u64)[:, 0]
        argp = S.pb[akeys[1]].view(u64)[:, 0]
        nargs = np.zeros(S.N, np.int32)
        for lane in S.lane_list(m):
            if not fmts[lane]:
                nargs[lane] = -1                # what printf returns for a NULL format
                continue
            fmt = S.read_cstr(int(fmts[lane]), lane)

            def read_arg(off, size, kind, lane=lane):
                raw = S.read_bytes(int(argp[lane]) + off, size, lane)
                return int.from_bytes(raw, 'little', signed=kind == 'i') if kind != 'f' else \
                    float(np.frombuffer(raw, f64)[0])
            text = ops.format_printf(fmt, read_arg, lambda a, lane=lane: S.read_cstr(a, lane))
            nargs[lane] = sum(c[-1] != '%' for c in ops._FMT.findall(fmt))    # printf returns the argument count
            S.printf(text)
        li = S.lanes(m)
        for r in rkeys:
            S.pb[r][li, :4] = nargs[li].view(u8).reshape(-1, 4)
    return [(OP, f, None)]


def _assertfail(D, akeys, rkeys):
    if len(akeys) < 4:
        raise Unsupported("__assertfail arguments")

    def f(S, m):
        for lane in S.lane_list(m):             # every failing thread reports, as on the GPU
            val = lambda k, w=8: int(S.pb[akeys[k]][lane, :w].view(u64 if w == 8 else u32)[0])
            msg, file, func = (S.read_cstr(val(k), lane) for k in (0, 1, 3))
            line = val(2, 4)
            tid = [int(S.R[f'%tid.{c}'][lane]) for c in 'xyz']
            bid = [int(np.broadcast_to(S.R[f'%ctaid.{c}'], (S.N,))[lane]) for c in 'xyz']
            S.printf(f"{file}:{line}: {func}: block: [{bid[0]},{bid[1]},{bid[2]}], thread: "
                     f"[{tid[0]},{tid[1]},{tid[2]}] Assertion `{msg}` failed.\n")
        raise err(CUresult.CUDA_ERROR_ASSERT, f"kernel '{S.kname}': device-side assert triggered")
    return [(OP, f, None)]


BUILTINS = {'vprintf': _vprintf, '__assertfail': _assertfail}
