"""One PTX kernel -> C source for compiler.py, from the same parse tree and link layout the interpreter uses.

Each thread is a C function `thread_fn(block, t)` over its registers as C locals. A sync point
(bar.sync, a warp collective, the periodic yield of a loop) saves the registers live there
(liveness below) in the thread's slots, records where to resume, and returns to the block's
scheduler (crt.py); calling the function again restores them and jumps back in. Anything this
translator does not know raises Refused, and the interpreter runs that kernel instead.
"""
import re
from collections import namedtuple

import numpy as np

from phos.gpu_server.backends.ptx import parser as P
from phos.gpu_server.backends.ptx import syncs as Y
from phos.gpu_server.backends.ptx.crt import PRELUDE, SCHEDULER
from phos.gpu_server.backends.ptx.decode import LOCAL_WIN, MEM_IGNORED, PARAM_WIN, SHARED_WIN, WIN, imm
from phos.gpu_server.backends.ptx.ops import DT


IT, PATH = '@it', '@path'
CC = '@cc'                  # the carry flag of add.cc, addc, ... (one a thread, as the interpreter's %cc)


Line = namedtuple('Line', 'code reads writes kills succ guarded sync jump')   # a translated statement (statement())


class Refused(Exception):
    """The compiler cannot translate this kernel (the message says what); the interpreter runs it."""


CT = {'b8': 'uint8_t', 'u8': 'uint8_t', 's8': 'int8_t', 'b16': 'uint16_t', 'u16': 'uint16_t', 's16': 'int16_t',
      'b32': 'uint32_t', 'u32': 'uint32_t', 's32': 'int32_t', 'b64': 'uint64_t', 'u64': 'uint64_t',
      's64': 'int64_t', 'f32': 'float', 'f64': 'double', 'pred': 'uint8_t',
      'f16': 'uint16_t', 'bf16': 'uint16_t', 'f16x2': 'uint32_t', 'bf16x2': 'uint32_t'}
# f16 and bf16 values are kept as their bits (two to a b32 when packed), as the interpreter keeps
# them; their arithmetic goes through crt.py's half_op in double, where f16 sums and products are exact
HALFS = {'f16': (0, 0), 'bf16': (1, 0), 'f16x2': (0, 1), 'bf16x2': (1, 1)}     # (bf16?, packed?)
HOP = {'add': 0, 'sub': 1, 'mul': 2, 'fma': 3, 'mad': 3, 'min': 4, 'max': 5, 'neg': 6, 'abs': 7}
UT = {1: 'uint8_t', 2: 'uint16_t', 4: 'uint32_t', 8: 'uint64_t'}
ST = {1: 'int8_t', 2: 'int16_t', 4: 'int32_t', 8: 'int64_t'}
SIZE = {t: P.TYPE_SIZE[t] for t in CT}
SPACES = {'global': 'global', 'shared': 'shared', 'shared::cta': 'shared', 'local': 'local', 'const': 'global',
          'param': 'param', 'param::entry': 'param'}
ROUND = {'rn': 'FE_TONEAREST', 'rz': 'FE_TOWARDZERO', 'rm': 'FE_DOWNWARD', 'rp': 'FE_UPWARD'}
CMP = {'eq': '==', 'ne': '!=', 'lt': '<', 'le': '<=', 'gt': '>', 'ge': '>=', 'lo': '<', 'ls': '<=', 'hi': '>',
       'hs': '>='}
SHFL = {'up': 0, 'down': 1, 'bfly': 2, 'idx': 3}
VOTE = {'ballot': 4, 'all': 5, 'any': 6, 'uni': 7}
MATCH = {'any': 16, 'all': 17}
LOCKSTEP = 18
SIMD = {'vadd': 0, 'vsub': 1, 'vabsdiff': 2, 'vmin': 3, 'vmax': 4, 'vavrg': 5}
REDUX = {'add': 9, 'min': 10, 'max': 11, 'and': 12, 'or': 13, 'xor': 14}
ACTIVEMASK, WARPSYNC = 8, 15
SPECIAL = {'%laneid': '(t & 31)', '%warpid': '(t >> 5)', '%nwarpid': '64u', '%nsmid': '132u',
           '%smid': '(b->lin % 132u)', '%gridid': '1ull', '%dynamic_smem_size': '(uint32_t)c->dyn',
           '%total_smem_size': '(uint32_t)c->shbytes', '%lanemask_eq': '(1u << (t & 31))',
           '%lanemask_lt': '((1u << (t & 31)) - 1u)', '%lanemask_le': '((2ull << (t & 31)) - 1u)',
           '%lanemask_gt': '(~((2ull << (t & 31)) - 1u))', '%lanemask_ge': '(~((1u << (t & 31)) - 1u))',
           '%clock': '(uint32_t)now_ns()', '%clock_hi': '(uint32_t)(now_ns() >> 32)', '%clock64': 'now_ns()',
           '%globaltimer': 'now_ns()', '%globaltimer_lo': '(uint32_t)now_ns()',
           '%globaltimer_hi': '(uint32_t)(now_ns() >> 32)'}
for _i, _c in enumerate('xyz'):
    SPECIAL[f'%tid.{_c}'] = f'tid_{_c}'
    SPECIAL[f'%ntid.{_c}'] = f'ntid_{_c}'           # (a thread function's locals: THREAD_VARS)
    SPECIAL[f'%ctaid.{_c}'] = f'ctaid_{_c}'
    SPECIAL[f'%nctaid.{_c}'] = f'nctaid_{_c}'
SPECIAL_TYPE = {'%clock64': 'u64', '%globaltimer': 'u64', '%gridid': 'u64'}


def is_float(t):
    return t in ('f32', 'f64')


def convert(e, frm, to):
    """C expression e of PTX type frm as type `to`: bits reinterpreted between a float and an
    int, ints truncated or extended by their own signedness (ops.as_ does the same)."""
    if CT[frm] == CT[to]:
        return e
    if is_float(frm) or is_float(to):
        if is_float(frm):
            e = f"{'f2u' if frm == 'f32' else 'd2u'}({e})"
            frm = 'u32' if frm == 'f32' else 'u64'
        if is_float(to):
            return f"{'u2f' if to == 'f32' else 'u2d'}(({UT[SIZE[to]]})({e}))"
    return f"(({CT[to]})({e}))"


def escape(name):
    return re.sub(r'[^A-Za-z0-9_]', lambda m: f'_{ord(m.group()):x}_', name)


class KernelSource:
    """C source of kernel K (an interp.Kernel, linked); .text, .nsave, .globals (bound at launch)."""

    def __init__(self, K):
        mod = K.mod
        self.K, self.tree = K, mod.tree
        self.globals = list(K.used_globals)
        self.order = self.callees(mod, K.name)
        self.fidx, self.idents = {f: i for i, f in enumerate(self.order)}, {}
        self.regs = {}                  # 'function|register' -> type, over every function linked in
        self.frame, self.frame_bytes = {}, 0    # 'function|name' of a .param variable -> (offset, size)
        self.stmts, self.owner, self.labels, self.entry = [], [], {}, {}
        for name in self.order:
            fn = mod.tree.funcs[name]
            if fn.body is None:
                raise Refused(f"call to external function {name}")
            self.regs.update({name + '|' + r: t for r, t in fn.regs.items()})
            if name != K.name:
                self.regs[self.rs(name)] = 'u32'
            for v in fn.vars + ([] if fn.entry else fn.params + fn.rets):
                if v.space == 'param':
                    off = -(-self.frame_bytes // max(v.align, 1)) * max(v.align, 1)
                    self.frame[name + '|' + v.name] = (off, v.size)
                    self.frame_bytes = off + v.size
            last = next((x for x in reversed(fn.body) if isinstance(x, P.Stmt)), None)
            if name != K.name and (last is None or last.guard is not None or
                                   last.op.split('.')[0] not in ('ret', 'exit', 'bra', 'trap')):
                raise Refused(f"function {name} does not end in ret")
            self.entry[name] = len(self.stmts)
            labels = self.labels[name] = {}
            for s in fn.body:
                if isinstance(s, P.Label):
                    labels[s.name] = len(self.stmts)
                else:
                    self.stmts.append(s)
                    self.owner.append(name)
        self.frame_bytes = -(-self.frame_bytes // 16) * 16
        # with printf, a thread counts its loop iterations since the last barrier (the register IT)
        # and keeps the call sites it is in (PATH, 16 bits a call): printf's order among threads
        # (compiler.Host) follows them, as lanes in step go
        self.counting = any(s.op.split('.')[0] == 'call' and any(isinstance(a, P.Sym) and a.name == 'vprintf'
                                                                 for a in s.args) for s in self.stmts)
        if self.counting:
            self.regs[IT], self.regs[PATH] = 'u32', 'u64'
        self.syncs = []                 # where each sync point resumes: ('after', k) or ('label', C label, k)
        self.sites = {name: [] for name in self.order}     # call statements of each function
        self.in_step = self.unordered_volatile()
        self.nsites = 0                 # global accesses, each with its allocation cache (crt.py GPTR)
        self.bar_red = False            # a bar.red: barriers have results to give
        self.bar_simple = True          # every barrier a bar.sync 0 of all threads: a waiting thread is an arrival
        self.no_result = set()          # warp sync points that only wait (lockstep, bar.warp.sync): crt.py's SYNC_FREE
        self.body = []
        for k, st in enumerate(self.stmts):
            self.enter(self.owner[k])
            self.body.append(self.statement(k, st))
        self.text = self.assemble()

    def unordered_volatile(self):
        """The volatile shared (or generic) accesses that an earlier one may reach with no block
        barrier between them: a load after a store, a store after either. Only these need the
        warp's lanes in step (access()); a barrier orders the others for every thread already."""
        n = len(self.stmts)
        kinds, succ, succ_extra = [], [], {}
        for k, st in enumerate(self.stmts):
            parts = st.op.split('.')
            name, mods = parts[0], parts[1:]
            vol = name in ('ld', 'st') and any(m in mods for m in ('volatile', 'relaxed', 'acquire', 'release')) \
                and SPACES.get(next((m for m in mods if m in SPACES), 'generic'), 'generic') in ('shared', 'generic')
            barrier = name in ('bar', 'barrier') and 'warp' not in mods and 'arrive' not in mods
            kinds.append('load' if vol and name == 'ld' else 'store' if vol else 'barrier' if barrier else None)
            labels, s = self.labels[self.owner[k]], []
            guarded = st.guard is not None
            if name == 'bra' and st.args and isinstance(st.args[0], P.Sym) and st.args[0].name in labels:
                s.append(labels[st.args[0].name])
            elif name == 'brx' and len(st.args) == 2 and isinstance(st.args[1], P.Sym):
                targets = self.tree.funcs[self.owner[k]].targets.get(st.args[1].name) or []
                s += [labels[x] for x in targets if x in labels]
            elif name == 'call':
                callee = next((a.name for a in st.args if isinstance(a, P.Sym)), None)
                if callee in self.entry:
                    s.append(self.entry[callee])
                    # its ret statements go on after this call
                    end = self.entry[callee]
                    while end < n and self.owner[end] == callee:
                        if self.stmts[end].op.split('.')[0] == 'ret':
                            succ_extra.setdefault(end, []).append(k + 1)
                        end += 1
                    if not guarded:
                        succ.append(s)
                        continue
            if name not in ('bra', 'brx', 'ret', 'exit', 'trap') or guarded:
                s.append(k + 1)
            succ.append(s)
        for k, extra in succ_extra.items():
            succ[k] = succ[k] + extra
        seen = [set() for _ in range(n + 1)]        # volatile kinds reaching each statement unordered
        work = list(range(n))
        while work:
            k = work.pop()
            out = set() if kinds[k] == 'barrier' else seen[k] | ({kinds[k]} if kinds[k] in ('load', 'store') else set())
            for j in succ[k]:
                if j < n and not out <= seen[j]:
                    seen[j] |= out
                    work.append(j)
        return {k for k in range(n) if kinds[k] == 'load' and 'store' in seen[k] or kinds[k] == 'store' and seen[k]}

    @staticmethod
    def callees(mod, name):
        """The kernel and every function it may call, in the order K.link() lays them out."""
        order, seen = [name], {name}

        def visit(n):
            for c in sorted(mod.decoded[n][3]):
                if c not in seen:
                    seen.add(c)
                    order.append(c)
                    visit(c)
        visit(name)
        return order

    def ident(self, key):
        """The C name of register key ('function|register', or one of IT, PATH, CC, rs()): its
        function by number, as a kernel's mangled name is long and every use would repeat it."""
        name = self.idents.get(key)
        if name is None:
            fn, sep, reg = key.partition('|')
            if fn == '@rs':
                name = f"rs_{self.fidx[reg]}"
            elif sep:
                name = f"r{self.fidx[fn]}_{escape(reg)}"
            else:
                name = 'r_' + escape(key)
            self.idents[key] = name
        return name

    def enter(self, name):
        """Translate the statements of function `name` from here on."""
        fn = self.tree.funcs[name]
        self.fn, self.pre = fn, name + '|'
        self.fvars = {v.name: v for v in fn.vars}
        self.fparams = {v.name: v for v in fn.params} if fn.entry else {}

    @staticmethod
    def rs(name):
        """The register holding where a call to `name` returns (one frame a function: no recursion)."""
        return '@rs|' + name

    # -- operands --
    def rtype(self, key):
        t = self.regs.get(key)
        if t not in CT:
            raise Refused(f"register {key.split('|', 1)[1]} of type .{t}")
        return t

    def src(self, o, t):
        if isinstance(o, P.Reg):
            if o.name in self.fn.regs:
                key = self.pre + o.name
                self.reads.add(key)
                e = convert(self.ident(key), self.rtype(key), t)
            elif o.name in SPECIAL:
                e = convert(SPECIAL[o.name], SPECIAL_TYPE.get(o.name, 'u32'), t)
            elif re.fullmatch(r'%envreg([0-9]|[12][0-9]|3[01])', o.name):
                e = convert(f"c->envreg[{o.name[7:]}]", 'u32', t)
            else:
                raise Refused(f"register {o.name}")
            return f"(!{e})" if o.neg else e
        if isinstance(o, P.Imm):
            if t == 'pred':
                return '1' if o.value else '0'
            v = imm(o, DT[t])
            if is_float(t):
                bits = int(np.array(v).view({4: np.uint32, 8: np.uint64}[SIZE[t]]))
                return f"u2f({bits:#x}u)" if t == 'f32' else f"u2d({bits:#x}ull)"
            u = int(np.array(v).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[SIZE[t]]))
            return f"(({CT[t]}){u:#x}ull)"
        if isinstance(o, P.Sym):
            if o.name == 'WARP_SZ':
                return convert('32u', 'u32', t)
            return f"(({CT[t]})({self.symval(o.name)} + {o.off}ull))"
        raise Refused(f"operand {o}")

    def symval(self, name):
        """C expression (uint64) of a symbol's value, as the interpreter's S.sym holds it."""
        if self.pre + name in self.frame:
            raise Refused(f"the address of .param variable {name}")
        if name in self.fvars:
            v = self.fvars[name]
            if v.space not in ('shared', 'local'):
                raise Refused(f".{v.space} variable {name}")
            return f"{self.K.static_symbols[self.pre + name]}ull"
        if name in self.fparams:
            return f"{self.K.static_symbols[self.pre + name]}ull"
        if name in self.tree.vars:
            v = self.tree.vars[name]
            if v.space in ('global', 'const'):
                return f"c->gsym[{self.globals.index(name)}]"
            if v.space in ('shared', 'local'):
                return f"{self.K.static_symbols[name]}ull"
        raise Refused(f"symbol {name}")

    def symspace(self, name):
        if self.pre + name in self.frame:
            return 'param'
        if name in self.fvars:
            return self.fvars[name].space
        if name in self.fparams:
            return 'param'
        if name in self.tree.vars:
            return {'const': 'global'}.get(self.tree.vars[name].space, self.tree.vars[name].space)
        raise Refused(f"symbol {name}")

    def dst(self, o, t, e):
        if isinstance(o, P.Reg) and o.name == '_':
            return f"(void)({e});"
        if not isinstance(o, P.Reg) or o.neg or o.name not in self.fn.regs:
            raise Refused("destination")
        key = self.pre + o.name
        self.writes.add(key)
        return f"{self.ident(key)} = {convert(e, t, self.rtype(key))};"

    def ptr(self, o, space, w, line):
        """C statements setting p_ to the host address of [o] (w bytes), returning on a fault."""
        if not isinstance(o, P.Addr):
            raise Refused("address operand")
        off = o.off & ((1 << 64) - 1)
        if o.base is None:
            a = f"{off}ull"
        elif isinstance(o.base, P.Reg):
            a = f"((uint64_t){self.src(o.base, 'u64')} + {off}ull)"
        elif self.pre + o.base.name in self.frame:
            # a call's .param variable: bytes of the thread's frame, after its local memory
            off, size = self.frame[self.pre + o.base.name]
            if space != 'param' or not 0 <= o.off <= size - w:
                raise Refused(f"access to .param variable {o.base.name}")
            return f"uint8_t *p_ = lbase + {self.K.local_size + off + o.off}ull;"
        else:
            ss = self.symspace(o.base.name)
            a = f"({self.symval(o.base.name)} + {off}ull)"
            if space == 'generic':
                win = {'shared': SHARED_WIN, 'local': LOCAL_WIN, 'param': PARAM_WIN, 'global': 0}[ss]
                a = f"({a} + {win}ull)"
            elif ss != space:
                raise Refused(f"{o.base.name} is not in .{space}")
        if space == 'param':
            at = off if o.base is None else \
                self.K.static_symbols[self.pre + o.base.name] + off if o.base.name in self.fparams else None
            if at is not None and at + w <= self.K.param_size:
                # a kernel parameter: in the launch's buffer (interp checks its size), read from a
                # region's copy, which gcc may load once for all the threads
                return f"uint8_t *p_ = PRM_AT({at}ull);"
            return f"uint8_t *p_; PPTR(p_, {a}, {w}, {line});"
        if space in ('global', 'generic'):
            slow = f"gslow(b, a_, {w}, {line})" if space == 'global' else f"genslow(b, t, a_, {w}, {line})"
            self.nsites += 1
            return f"uint8_t *p_; GPTR(p_, {a}, {w}, {line}, {slow}, {self.nsites - 1});"
        return f"uint8_t *p_; {'SPTR' if space == 'shared' else 'LPTR'}(p_, {a}, {w}, {line});"

    # -- statements --
    def statement(self, k, st):
        """Statement k as a Line; an emitter sets self.jumps to where it goes besides (or, with
        self.falls off, instead of) k + 1, and self.sync_at its sync point."""
        self.reads, self.writes, self.jumps, self.falls, self.sync_at, self.jump = set(), set(), [], True, None, None
        parts = st.op.split('.')
        name, mods = parts[0], parts[1:]
        emit = getattr(self, 'op_' + name, None)
        if emit is None:
            raise Refused(f"instruction '{st.op}' at line {st.line}")
        try:
            code = emit(k, st, mods)
        except Refused as e:
            raise Refused(f"'{st.op}' at line {st.line}: {e}") from None
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as e:
            raise Refused(f"'{st.op}' at line {st.line}: {type(e).__name__} {e}") from None
        kills = set() if st.guard is not None else set(self.writes)
        if st.guard is not None:
            g = self.src(st.guard, 'pred')
            code = f"if ({g}) {{ {code} }}"
        succ = self.jumps + ([k + 1] if self.falls or st.guard is not None else [])
        return Line(code, frozenset(self.reads), frozenset(self.writes), frozenset(kills), succ,
                    st.guard is not None, self.sync_at, self.jump)

    @staticmethod
    def mods(mods, known):
        rest = [m for m in mods if m not in known and m not in MEM_IGNORED]
        if rest:
            raise Refused(f"modifier .{rest[0]}")

    @staticmethod
    def types(mods):
        return [m for m in mods if m in P.TYPE_SIZE]

    def type1(self, mods, halves=False):
        """The one type in mods; f16/bf16 only where the caller handles them (halves)."""
        ts = self.types(mods)
        if len(ts) != 1 or ts[0] not in CT or ts[0] in HALFS and not halves:
            raise Refused(f"type {ts}")
        return ts[0]

    def half(self, st, mods, t, name):
        """add, sub, mul, fma, min, max, neg, abs of f16, bf16 or a packed pair of them (.rn only)."""
        bf, packed = HALFS[t]
        self.mods(mods, {t, 'rn', 'sat'})
        n = 1 if name in ('neg', 'abs') else 3 if name in ('fma', 'mad') else 2
        a = self.args(st, n + 1)
        xs = [self.src(o, 'u32' if packed else 'u16') for o in a[1:]] + ['0'] * (3 - n)
        e = f"half_op({HOP[name]}, {bf}, {packed}, {', '.join(xs)}, {int('sat' in mods)})"
        return self.dst(a[0], t, f"({CT[t]})({e})")

    def args(self, st, n):
        if len(st.args) != n:
            raise Refused("operand count")
        return st.args

    def op_add(self, k, st, mods, name='add'):
        t = self.type1(mods, halves=True)
        if t in HALFS:
            return self.half(st, mods, t, name)
        a = self.args(st, 3)
        x, y = self.src(a[1], t), self.src(a[2], t)
        if is_float(t):
            ftz, sat = self.float_mods(mods, t)
            x, y = self.fz(ftz, x, y)
            op = 'add sub mul'.split().index(name)
            e = self.rounded(t, op, x, y) or f"({x}) {'+-*'[op]} ({y})"
            return self.dst(a[0], t, self.post(e, t, ftz, sat, x, y))
        if 'cc' in mods:
            return self.carry(st, mods, t, name, cin=False)
        if 'sat' in mods and name in ('add', 'sub'):
            self.mods(mods, {'s32', 'sat'})
            return self.dst(a[0], t, f"({{ int64_t _r = (int64_t)({x}) {'+' if name == 'add' else '-'} (int64_t)({y}); "
                                     f"(int32_t)(_r < INT32_MIN ? INT32_MIN : _r > INT32_MAX ? INT32_MAX : _r); }})")
        self.mods(mods, {t, 'lo', 'hi', 'wide'})
        u = UT[SIZE[t]]
        if name == 'mul':
            return self.dst(a[0], *self.mul(mods, t, x, y))
        return self.dst(a[0], t, f"({CT[t]})(({u})({x}) {'+' if name == 'add' else '-'} ({u})({y}))")

    def op_sub(self, k, st, mods):
        return self.op_add(k, st, mods, 'sub')

    def op_mul(self, k, st, mods):
        return self.op_add(k, st, mods, 'mul')

    def mul(self, mods, t, x, y):
        n, s = SIZE[t], t[0] == 's'
        if 'wide' in mods:
            w = ('s' if s else 'u') + str(16 * n)
            return w, f"(({CT[w]})({x}) * ({CT[w]})({y}))"
        if 'hi' in mods:
            if n == 8:
                tt = '__int128' if s else 'unsigned __int128'
                return t, f"({CT[t]})((({tt})({x}) * ({tt})({y})) >> 64)"
            w = (ST if s else UT)[2 * n]
            return t, f"({CT[t]})((({w})({x}) * ({w})({y})) >> {8 * n})"
        return t, f"({CT[t]})(({UT[n]})({x}) * ({UT[n]})({y}))"

    def float_mods(self, mods, t, extra=()):
        """(.ftz, .sat); self.rmode: the directed rounding asked for (.rz, .rm, .rp) or None."""
        rnd = [m for m in mods if m in ROUND]
        self.rmode = rnd[0] if rnd and rnd[0] != 'rn' else None
        self.mods(mods, {t, 'ftz', 'sat', *ROUND, *extra})
        return 'ftz' in mods and t == 'f32', 'sat' in mods

    def rounded(self, t, op, *xs):
        """Float op (crt.py's rnd_f32/rnd_f64 numbering) of xs, under self.rmode, or None for .rn."""
        if self.rmode is None:
            return None
        xs = list(xs) + ['0'] * (3 - len(xs))
        return f"rnd_{t}({op}, {', '.join(xs)}, {ROUND[self.rmode]})"

    @staticmethod
    def fz(ftz, *xs):
        """Sources flushed to zero where .ftz asks."""
        return [f"ftzf({x})" for x in xs] if ftz else list(xs)

    def post(self, e, t, ftz, sat, *srcs):
        if ftz:
            e = f"ftzf({e})"
        if sat:
            e = f"{'satf' if t == 'f32' else 'satd'}({e})"
        return e

    def op_mad(self, k, st, mods):
        t = self.type1(mods, halves=True)
        if t in HALFS:
            return self.half(st, mods, t, 'fma')
        a = self.args(st, 4)
        x, y, z = (self.src(o, t) for o in a[1:])
        if is_float(t):
            if not any(m in ROUND for m in mods):
                raise Refused("mad without a rounding mode")
            ftz, sat = self.float_mods(mods, t)
            x, y, z = self.fz(ftz, x, y, z)
            f = 'fmaf' if t == 'f32' else 'fma'
            e = self.rounded(t, 3, x, y, z) or f"{f}({x}, {y}, {z})"
            return self.dst(a[0], t, self.post(e, t, ftz, sat, x, y, z))
        if 'cc' in mods:
            return self.carry(st, mods, t, 'add', cin=False)
        self.mods(mods, {t, 'lo', 'hi', 'wide'})
        mt, e = self.mul(mods, t, x, y)
        u = UT[SIZE[mt]]
        return self.dst(a[0], mt, f"({CT[mt]})(({u})({e}) + ({u})({self.src(a[3], mt)}))")

    def op_fma(self, k, st, mods):
        return self.op_mad(k, st, mods)

    def carry(self, st, mods, t, name, cin):
        """add.cc, addc, sub.cc, subc, mad.cc, madc: with a carry (borrow) in and out of CC."""
        mul = next((m for m in mods if m in ('lo', 'hi')), None)
        self.mods(mods, {t, 'cc', 'lo', 'hi'})
        a = self.args(st, 4 if mul or name == 'mad' else 3)
        if name == 'mad' and mul is None:
            raise Refused("mad with a carry and no .lo/.hi")
        u = UT[SIZE[t]]
        xs = [self.src(o, t) for o in a[1:]]
        if mul:
            _, p = self.mul([mul], t, xs[0], xs[1])
            xs = [p, xs[2]]
        self.regs[CC] = 'u32'
        c = self.ident(CC)
        cin_e = f"({u}){c}" if cin else f"({u})0"
        if cin:
            self.reads.add(CC)
        if 'cc' in mods:
            self.writes.add(CC)
        code = f"{{ {u} _a = ({u})({xs[0]}), _b = ({u})({xs[1]}), _c = {cin_e}, _r1, _r; "
        if name == 'sub':
            code += "_r1 = _a - _b; _r = _r1 - _c; "
            co = "(_a < _b) | (_r1 < _c)"
        else:
            code += "_r1 = _a + _b; _r = _r1 + _c; "
            co = "(_r1 < _a) | (_r < _r1)"
        if 'cc' in mods:
            code += f"{c} = {co}; "
        return code + self.dst(a[0], t, f"({CT[t]})_r") + " }"

    def op_addc(self, k, st, mods):
        return self.carry(st, mods, self.type1(mods), 'add', cin=True)

    def op_subc(self, k, st, mods):
        return self.carry(st, mods, self.type1(mods), 'sub', cin=True)

    def op_madc(self, k, st, mods):
        return self.carry(st, mods, self.type1(mods), 'mad', cin=True)

    def op_sad(self, k, st, mods):
        t = self.type1(mods)
        self.mods(mods, {t})
        a = self.args(st, 4)
        x, y, z = (self.src(o, t) for o in a[1:])
        u = UT[SIZE[t]]
        return self.dst(a[0], t, f"({{ {CT[t]} _x = {x}, _y = {y}; ({CT[t]})(({u})(_x > _y ? ({u})_x - ({u})_y : "
                                 f"({u})_y - ({u})_x) + ({u})({z})); }})")

    def op_mul24(self, k, st, mods, name='mul24'):
        t = self.type1(mods)
        mode = next((m for m in mods if m in ('lo', 'hi')), 'lo')
        self.mods(mods, {t, 'lo', 'hi'})
        a = self.args(st, 3 if name == 'mul24' else 4)
        x, y = self.src(a[1], t), self.src(a[2], t)
        ext = (lambda v: f"(((int64_t)({v}) << 40) >> 40)") if t == 's32' else (lambda v: f"((int64_t)({v}) & 0xFFFFFF)")
        p = f"({ext(x)} * {ext(y)})"
        if mode == 'hi':
            p = f"({p} >> 16)"
        if name == 'mad24':
            p = f"({p} + (int64_t)({self.src(a[3], t)}))"
        return self.dst(a[0], t, f"({CT[t]})(uint32_t)({p})")

    def op_mad24(self, k, st, mods):
        return self.op_mul24(k, st, mods, 'mad24')

    def op_div(self, k, st, mods, rem=False):
        t = self.type1(mods)
        a = self.args(st, 3)
        x, y = self.src(a[1], t), self.src(a[2], t)
        if is_float(t):
            if rem:
                raise Refused("float rem")
            ftz, sat = self.float_mods(mods, t, ('approx', 'full'))
            x, y = self.fz(ftz, x, y)
            e = self.rounded(t, 4, x, y) or f"({x}) / ({y})"
            return self.dst(a[0], t, self.post(e, t, ftz, sat, x, y))
        self.mods(mods, {t})
        ct, s = CT[t], t[0] == 's'
        # x/0 gives all ones and x%0 gives x, as NVIDIA GPUs do (ops.int_div); MIN/-1 must not trap
        guard = f"_y == 0 ? {'_x' if rem else f'({ct})-1'} : "
        if s:
            guard += f"_y == ({ct})-1 ? {f'({ct})0' if rem else f'({ct})(0 - ({UT[SIZE[t]]})_x)'} : "
        return self.dst(a[0], t, f"({{ {ct} _x = {x}, _y = {y}; {guard}({ct})(_x {'%' if rem else '/'} _y); }})")

    def op_rem(self, k, st, mods):
        return self.op_div(k, st, mods, True)

    def op_min(self, k, st, mods, name='min'):
        t = self.type1(mods, halves=True)
        if t in HALFS:
            return self.half(st, mods, t, name)
        a = self.args(st, 3)
        x, y = self.src(a[1], t), self.src(a[2], t)
        if is_float(t):
            ftz, _ = self.float_mods(mods, t)
            x, y = self.fz(ftz, x, y)
            f = ('fmin' if name == 'min' else 'fmax') + ('f' if t == 'f32' else '')
            return self.dst(a[0], t, self.post(f"{f}({x}, {y})", t, ftz, False, x, y))
        self.mods(mods, {t})
        return self.dst(a[0], t, f"({{ {CT[t]} _x = {x}, _y = {y}; _x {'<' if name == 'min' else '>'} _y ? _x : _y; }})")

    def op_max(self, k, st, mods):
        return self.op_min(k, st, mods, 'max')

    def op_abs(self, k, st, mods, name='abs'):
        t = self.type1(mods, halves=True)
        if t in HALFS:
            return self.half(st, mods, t, name)
        a = self.args(st, 2)
        x = self.src(a[1], t)
        if is_float(t):
            ftz, _ = self.float_mods(mods, t)
            x, = self.fz(ftz, x)
            e = f"{'fabs' + ('f' if t == 'f32' else '')}({x})" if name == 'abs' else f"(-({x}))"
            return self.dst(a[0], t, self.post(e, t, ftz, False, x))
        self.mods(mods, {t})
        u = UT[SIZE[t]]
        if name == 'neg':
            return self.dst(a[0], t, f"({CT[t]})(0 - ({u})({x}))")
        return self.dst(a[0], t, f"({{ {CT[t]} _x = {x}; _x < 0 ? ({CT[t]})(0 - ({u})_x) : _x; }})")

    def op_neg(self, k, st, mods):
        return self.op_abs(k, st, mods, 'neg')

    def op_and(self, k, st, mods, name='and'):
        t = self.type1(mods)
        self.mods(mods, {t})
        if name in ('not', 'cnot'):
            a = self.args(st, 2)
            x = self.src(a[1], t)
            if name == 'cnot':
                return self.dst(a[0], t, f"({CT[t]})(({x}) == 0)")
            return self.dst(a[0], t, f"({CT[t]})(!({x}))" if t == 'pred' else f"({CT[t]})(~({x}))")
        a = self.args(st, 3)
        o = {'and': '&', 'or': '|', 'xor': '^'}[name]
        return self.dst(a[0], t, f"({CT[t]})(({self.src(a[1], t)}) {o} ({self.src(a[2], t)}))")

    def op_or(self, k, st, mods):
        return self.op_and(k, st, mods, 'or')

    def op_xor(self, k, st, mods):
        return self.op_and(k, st, mods, 'xor')

    def op_not(self, k, st, mods):
        return self.op_and(k, st, mods, 'not')

    def op_cnot(self, k, st, mods):
        return self.op_and(k, st, mods, 'cnot')

    def op_shl(self, k, st, mods, name='shl'):
        t = self.type1(mods)
        self.mods(mods, {t})
        a = self.args(st, 3)
        n = 8 * SIZE[t]
        x, y = self.src(a[1], t), self.src(a[2], 'u32')
        if name == 'shl':
            e = f"({{ uint32_t _s = {y}; _s >= {n} ? ({CT[t]})0 : ({CT[t]})(({UT[SIZE[t]]})({x}) << _s); }})"
        elif t[0] == 's':
            e = f"({{ uint32_t _s = {y}; ({CT[t]})(({x}) >> (_s >= {n} ? {n - 1} : _s)); }})"
        else:
            e = f"({{ uint32_t _s = {y}; _s >= {n} ? ({CT[t]})0 : ({CT[t]})(({UT[SIZE[t]]})({x}) >> _s); }})"
        return self.dst(a[0], t, e)

    def op_shr(self, k, st, mods):
        return self.op_shl(k, st, mods, 'shr')

    def op_popc(self, k, st, mods, name='popc'):
        t = self.type1(mods)
        self.mods(mods, {t})
        a = self.args(st, 2)
        n = 8 * SIZE[t]
        x = self.src(a[1], f"u{n}")
        ll = 'll' if n == 64 else ''
        e = {'popc': f"(uint32_t)__builtin_popcount{ll}({x})",
             'clz': f"({{ uint{n}_t _x = {x}; _x ? (uint32_t)__builtin_clz{ll}(_x) : {n}u; }})",
             'brev': f"({{ uint{n}_t _x = {x}, _r = 0; for (int _i = 0; _i < {n}; _i++) {{ _r = (_r << 1) | (_x & 1); _x >>= 1; }} _r; }})"}[name]
        return self.dst(a[0], t if name == 'brev' else 'u32', e)

    def op_clz(self, k, st, mods):
        return self.op_popc(k, st, mods, 'clz')

    def op_brev(self, k, st, mods):
        return self.op_popc(k, st, mods, 'brev')

    def op_bfe(self, k, st, mods):
        t = self.type1(mods)
        self.mods(mods, {t})
        a = self.args(st, 4)
        n = 8 * SIZE[t]
        x = self.src(a[1], 'u' + str(n))
        e = f"bfe_u({x}, {self.src(a[2], 'u32')}, {self.src(a[3], 'u32')}, {n}, {int(t[0] == 's')})"
        return self.dst(a[0], t, f"({CT[t]})({e})")

    def op_bfi(self, k, st, mods):
        t = self.type1(mods)
        self.mods(mods, {t})
        a = self.args(st, 5)
        n = 8 * SIZE[t]
        x, y = self.src(a[1], 'u' + str(n)), self.src(a[2], 'u' + str(n))
        e = f"bfi_u({x}, {y}, {self.src(a[3], 'u32')}, {self.src(a[4], 'u32')}, {n})"
        return self.dst(a[0], t, f"({CT[t]})({e})")

    def op_bfind(self, k, st, mods):
        t = self.type1(mods)
        self.mods(mods, {t, 'shiftamt'})
        a = self.args(st, 2)
        n = 8 * SIZE[t]
        e = f"bfind_u({self.src(a[1], 'u' + str(n))}, {n}, {int(t[0] == 's')}, {int('shiftamt' in mods)})"
        return self.dst(a[0], 'u32', e)

    def op_prmt(self, k, st, mods):
        self.mods(mods, {'b32'})
        a = self.args(st, 4)
        return self.dst(a[0], 'u32', f"prmt_u({', '.join(self.src(o, 'u32') for o in a[1:])})")

    def op_bmsk(self, k, st, mods):
        mode = next((m for m in mods if m in ('clamp', 'wrap')), None)
        self.mods(mods, {'clamp', 'wrap', 'b32'})
        a = self.args(st, 3)
        return self.dst(a[0], 'u32', f"bmsk_u({self.src(a[1], 'u32')}, {self.src(a[2], 'u32')}, {int(mode == 'clamp')})")

    def op_lop3(self, k, st, mods):
        self.mods(mods, {'b32'})
        a = self.args(st, 5)
        if not isinstance(a[4], P.Imm):
            raise Refused("lop3 with a register table")
        xs = ', '.join(self.src(o, 'u32') for o in a[1:4])
        return self.dst(a[0], 'u32', f"lop3_u({xs}, {a[4].value & 0xFF}u)")

    def op_shf(self, k, st, mods):
        left = 'l' in mods
        clamp = 'clamp' in mods
        self.mods(mods, {'l', 'r', 'clamp', 'wrap', 'b32'})
        a = self.args(st, 4)
        x, y, c = (self.src(o, 'u32') for o in a[1:])
        n = f"({{ uint32_t _n = {c}; {'_n > 32 ? 32 : _n' if clamp else '_n & 31'}; }})"
        v = f"(((uint64_t)({y}) << 32) | ({x}))"
        e = f"(uint32_t)(({v} << {n}) >> 32)" if left else f"(uint32_t)({v} >> {n})"
        return self.dst(a[0], 'u32', e)

    def op_dp4a(self, k, st, mods, name='dp4a'):
        half = next((m for m in mods if m in ('lo', 'hi')), None)
        ta, tb = self.types(mods)
        self.mods(mods, {ta, tb, half})
        a = self.args(st, 4)
        dt = 's32' if 's32' in (ta, tb) else 'u32'
        x, y = self.src(a[1], 'u32'), self.src(a[2], 'u32')
        sa, sb = int(ta == 's32'), int(tb == 's32')
        if name == 'dp4a':
            terms = [f"dp_part(_a, {i}, 8, {sa}) * dp_part(_b, {i}, 8, {sb})" for i in range(4)]
        else:
            o = 2 if half == 'hi' else 0
            terms = [f"dp_part(_a, {i}, 16, {sa}) * dp_part(_b, {i + o}, 8, {sb})" for i in range(2)]
        e = (f"({{ uint32_t _a = {x}, _b = {y}; ({CT[dt]})(uint32_t)((int64_t)({self.src(a[3], dt)}) + "
             f"{' + '.join(terms)}); }})")
        return self.dst(a[0], dt, e)

    def op_dp2a(self, k, st, mods):
        return self.op_dp4a(k, st, mods, 'dp2a')

    def simd(self, k, st, mods, name):
        op, n = SIMD[name[:-1]], int(name[-1])
        ts = self.types(mods)
        sat, add = 'sat' in mods, 'add' in mods
        if len(ts) != 3 or sat and add or any(x not in ('u32', 's32') for x in ts):
            raise Refused("SIMD types")
        self.mods(mods, {'u32', 's32', 'sat', 'add'})
        a = self.args(st, 4)
        if any(not isinstance(x, (P.Reg, P.Imm)) for x in a):
            raise Refused("byte selectors or masks")
        dt, at, bt = ts
        xs = ', '.join(self.src(o, 'u32') for o in a[1:])
        e = f"simd_op({op}, {n}, {xs}, {int(at == 's32')}, {int(bt == 's32')}, {int(dt == 's32')}, {int(sat)}, {int(add)})"
        return self.dst(a[0], dt, f"({CT[dt]})({e})")

    def op_copysign(self, k, st, mods):
        t = self.type1(mods)
        self.mods(mods, {t})
        a = self.args(st, 3)
        f = 'copysignf' if t == 'f32' else 'copysign'
        return self.dst(a[0], t, f"{f}({self.src(a[2], t)}, {self.src(a[1], t)})")

    def op_testp(self, k, st, mods):
        kind = next(m for m in mods if m in ('finite', 'infinite', 'number', 'notanumber', 'normal', 'subnormal'))
        t = self.type1(mods)
        self.mods(mods, {t, kind})
        a = self.args(st, 2)
        x = self.src(a[1], t)
        tiny = '1.17549435e-38f' if t == 'f32' else '2.2250738585072014e-308'
        ab = f"{'fabsf' if t == 'f32' else 'fabs'}(_x)"
        e = {'finite': "isfinite(_x)", 'infinite': "isinf(_x)", 'number': "!isnan(_x)", 'notanumber': "isnan(_x)",
             'normal': f"(isfinite(_x) && {ab} >= {tiny})", 'subnormal': f"(_x != 0 && {ab} < {tiny})"}[kind]
        return self.dst(a[0], 'pred', f"({{ {CT[t]} _x = {x}; (uint8_t)({e}); }})")

    def op_isspacep(self, k, st, mods):
        sp = next((m for m in mods if m in SPACES), None)
        self.mods(mods, {sp})
        a = self.args(st, 2)
        x = self.src(a[1], 'u64')
        win = {'shared': SHARED_WIN, 'local': LOCAL_WIN, 'param': PARAM_WIN}.get(SPACES.get(sp))
        if win is not None:
            e = f"(uint8_t)(({x}) - {win}ull < {WIN}ull)"
        elif SPACES.get(sp) == 'global':
            e = f"(uint8_t)(({x}) >= c->base && ({x}) < c->base + c->capacity)"
        else:
            raise Refused(f"isspacep.{sp}")
        return self.dst(a[0], 'pred', e)

    def op_setp(self, k, st, mods):
        t = self.type1(mods, halves=True)
        if t in ('f16x2', 'bf16x2'):
            raise Refused("packed comparison")
        cmp = next((m for m in mods if m in CMP or m in ('equ', 'neu', 'ltu', 'leu', 'gtu', 'geu', 'num', 'nan')), None)
        bop = next((m for m in mods if m in ('and', 'or', 'xor')), None)
        self.mods(mods, {t, cmp, bop, 'ftz'})
        a = st.args
        x, y = self.src(a[1], t), self.src(a[2], t)
        if 'ftz' in mods and t == 'f32':
            x, y = f"ftzf({x})", f"ftzf({y})"
        if t in HALFS:
            x, y = f"half_val({x}, {HALFS[t][0]})", f"half_val({y}, {HALFS[t][0]})"
        if is_float(t) or t in HALFS:
            nan = f"(({x}) != ({x}) || ({y}) != ({y}))"
            if cmp == 'num':
                e = f"!{nan}"
            elif cmp == 'nan':
                e = nan
            elif cmp.endswith('u') and cmp[:-1] in CMP:
                e = f"({nan} || ({x}) {CMP[cmp[:-1]]} ({y}))"
            elif cmp == 'ne':
                e = f"(!{nan} && ({x}) != ({y}))"
            else:
                e = f"(({x}) {CMP[cmp]} ({y}))"
        elif t == 'pred':
            e = f"(({x}) {CMP[cmp]} ({y}))"
        else:
            if cmp in ('lo', 'ls', 'hi', 'hs'):
                x, y = f"({UT[SIZE[t]]})({x})", f"({UT[SIZE[t]]})({y})"
            e = f"(({x}) {CMP[cmp]} ({y}))"
        out = a[0]
        p, q = (out.a, out.b) if isinstance(out, P.Pair) else (out, None)
        if bop:
            if len(a) != 4:
                raise Refused("operand count")
            c = self.src(a[3], 'pred')
            o = {'and': '&&', 'or': '||', 'xor': '!='}[bop]
            code = f"{{ uint8_t _e = {e}, _c = {c}; " + self.dst(p, 'pred', f"(_e {o} _c)")
            if q is not None:
                code += self.dst(q, 'pred', f"(!_e {o} _c)")
            return code + " }"
        if len(a) != 3:
            raise Refused("operand count")
        code = f"{{ uint8_t _e = {e}; " + self.dst(p, 'pred', "_e")
        if q is not None:
            code += self.dst(q, 'pred', "!_e")
        return code + " }"

    def op_selp(self, k, st, mods):
        t = self.type1(mods, halves=True)
        self.mods(mods, {t})
        a = self.args(st, 4)
        return self.dst(a[0], t, f"(({self.src(a[3], 'pred')}) ? ({self.src(a[1], t)}) : ({self.src(a[2], t)}))")

    def op_mov(self, k, st, mods):
        t = self.type1(mods, halves=True)
        self.mods(mods, {t})
        a = self.args(st, 2)
        d, s = a
        if isinstance(s, P.Vec):            # pack: the first item is the low part
            n = len(s.items)
            w = 8 * SIZE[t] // n
            parts = [f"((uint64_t)({self.src(x, 'u' + str(w))}) << {i * w})" for i, x in enumerate(s.items)]
            return self.dst(d, t, convert(f"({' | '.join(parts)})", 'u64', t) if t != 'u64' else f"({' | '.join(parts)})")
        if isinstance(d, P.Vec):            # unpack
            n = len(d.items)
            w = 8 * SIZE[t] // n
            x = self.src(s, 'b64' if SIZE[t] == 8 else 'b32')
            return f"{{ uint64_t _v = {x}; " + " ".join(
                self.dst(o, 'u' + str(w), f"(uint{w}_t)(_v >> {i * w})") for i, o in enumerate(d.items)) + " }"
        return self.dst(d, t, self.src(s, t))

    def op_cvt(self, k, st, mods):
        ts = self.types(mods)
        if len(ts) == 2 and any(x in HALFS for x in ts):
            return self.cvt_half(st, mods, *ts)
        if len(ts) != 2 or any(x not in CT or x == 'pred' for x in ts):
            raise Refused(f"types {ts}")
        dt, stt = ts
        irnd = next((m for m in mods if m in ('rni', 'rzi', 'rmi', 'rpi')), None)
        frnd = next((m for m in mods if m in ('rn', 'rz', 'rm', 'rp')), None)
        self.mods(mods, {dt, stt, irnd, frnd, 'ftz', 'sat'})
        ftz, sat = 'ftz' in mods, 'sat' in mods
        a = self.args(st, 2)
        x = self.src(a[1], stt)
        if ftz and stt == 'f32':
            x = f"ftzf({x})"
        if is_float(stt) and not is_float(dt):
            return self.cvt_to_int(a[0], dt, x, irnd)
        if not is_float(stt) and is_float(dt):
            if sat:
                raise Refused("int-to-float saturation")
            e = f"({CT[dt]})({x})"
            if frnd not in (None, 'rn'):
                i64 = 'int64_t' if stt[0] == 's' else 'uint64_t'
                e = f"cvt_{dt}_{'s' if stt[0] == 's' else 'u'}64(({i64})({x}), {ROUND[frnd]})"
            return self.dst(a[0], dt, self.post(e, dt, ftz and dt == 'f32', False))
        if is_float(stt):
            if irnd:
                r = {'rni': 'rint', 'rzi': 'trunc', 'rmi': 'floor', 'rpi': 'ceil'}[irnd] + ('f' if dt == 'f32' else '')
                e = f"{r}(({CT[dt]})({x}))" if stt == dt else None
                if e is None:
                    raise Refused("cvt between float sizes with integer rounding")
            elif frnd not in (None, 'rn') and (stt, dt) == ('f64', 'f32'):
                e = f"cvt_f32_f64({x}, {ROUND[frnd]})"
            else:
                e = f"({CT[dt]})({x})"
            return self.dst(a[0], dt, self.post(e, dt, ftz and dt == 'f32', sat))
        if sat:
            if SIZE[dt] > 4 and dt[0] != stt[0]:
                raise Refused("64-bit saturating cvt")
            lo, hi = (0, (1 << 8 * SIZE[dt]) - 1) if dt[0] != 's' else (-(1 << 8 * SIZE[dt] - 1), (1 << 8 * SIZE[dt] - 1) - 1)
            xs = f"({CT[stt]})({x})"
            e = f"({{ __int128 _x = {xs}; _x < {lo}ll ? ({CT[dt]}){lo}ll : _x > (__int128){hi}ull ? ({CT[dt]}){hi}ull : ({CT[dt]})_x; }})"
            return self.dst(a[0], dt, e)
        return self.dst(a[0], dt, f"({CT[dt]})({CT[stt]})({x})")

    def cvt_half(self, st, mods, dt, stt):
        """cvt to or from f16/bf16 (and two f32 to a packed pair), the conversions interp's _cvt_fn does
        that round once; the rest (directed modes to halves, 64-bit integers, .relu, .sat) refused."""
        irnd = next((m for m in mods if m in ('rni', 'rzi', 'rmi', 'rpi')), None)
        frnd = next((m for m in mods if m in ('rn', 'rz', 'rm', 'rp')), None)
        self.mods(mods, {dt, stt, irnd, frnd, 'ftz'})
        if dt in ('f16x2', 'bf16x2'):
            if stt != 'f32' or frnd != 'rn':
                raise Refused("packed cvt")
            a = self.args(st, 3)
            one = [self.half_of(self.src(o, 'f32'), 'f32', dt[:-2], frnd) for o in a[1:]]
            return self.dst(a[0], 'u32', f"(((uint32_t)({one[0]}) << 16) | (uint32_t)({one[1]}))")
        a = self.args(st, 2)
        if stt in HALFS:                        # from a half: exact into f32/f64, then as cvt does
            if stt not in ('f16', 'bf16') or dt in HALFS:
                raise Refused("cvt between halves")
            x = f"half_val({self.src(a[1], stt)}, {HALFS[stt][0]})"
            if is_float(dt):
                if irnd:
                    x = f"{ {'rni': 'rint', 'rzi': 'trunc', 'rmi': 'floor', 'rpi': 'ceil'}[irnd]}({x})"
                return self.dst(a[0], dt, f"({CT[dt]})({x})")
            if not irnd:
                raise Refused("float-to-int without an integer rounding")
            return self.cvt_to_int(a[0], dt, x, irnd)
        if irnd:
            raise Refused("integer rounding to a half")
        x = self.src(a[1], stt)
        if 'ftz' in mods and stt == 'f32':
            x = f"ftzf({x})"
        return self.dst(a[0], dt, self.half_of(x, stt, dt, frnd))

    def half_of(self, x, stt, dt, frnd):
        """C expression of the half bits (dt f16 or bf16) of x (of type stt), rounded by frnd."""
        if dt == 'bf16':                        # through f32, as interp's to_bf16 (rn or rz)
            if frnd not in ('rn', 'rz') or stt not in ('f32', 'f64', 's32', 'u32', 's16', 'u16', 's8', 'u8'):
                raise Refused(f"cvt.{frnd}.bf16.{stt}")
            if not is_float(stt) and frnd != 'rn':
                raise Refused(f"cvt.{frnd}.bf16.{stt}")
            return f"bf16_of_f32((float)({x}), {int(frnd == 'rz')})"
        if frnd not in ROUND or SIZE[stt] > 4 and not is_float(stt):
            raise Refused(f"cvt.{frnd}.f16.{stt}")
        if frnd != 'rn':                        # exact in double, then one rounding under the mode
            return f"f16_of_rnd((double)({x}), {ROUND[frnd]})"
        return f"f16_of((double)({x}))"

    def cvt_to_int(self, d, dt, x, irnd):
        """d = the double x rounded to an integer of type dt by irnd, saturated (NaN: 0)."""
        r = {'rni': 'rint', 'rzi': 'trunc', 'rmi': 'floor', 'rpi': 'ceil'}[irnd]
        x = f"{r}((double)({x}))"
        if dt[0] == 'u':
            hi = (1 << 8 * SIZE[dt]) - 1
            e = f"({{ double _x = {x}; _x != _x || _x <= 0.0 ? 0 : _x >= {float(hi + 1)!r} ? {hi}ull : (uint64_t)_x; }})"
        else:
            lo, hi = -(1 << 8 * SIZE[dt] - 1), (1 << 8 * SIZE[dt] - 1) - 1
            e = (f"({{ double _x = {x}; _x != _x ? 0 : _x <= {float(lo)!r} ? (int64_t)(-{hi}ll - 1) : "
                 f"_x >= {float(hi + 1)!r} ? (int64_t){hi}ll : (int64_t)_x; }})")
        return self.dst(d, dt, f"({CT[dt]})({e})")

    def op_cvta(self, k, st, mods):
        t = self.type1(mods)
        to = 'to' in mods
        sp = next((m for m in mods if m in SPACES), None)
        self.mods(mods, {t, 'to', sp})
        a = self.args(st, 2)
        win = {'global': 0, 'shared': SHARED_WIN, 'local': LOCAL_WIN, 'param': PARAM_WIN}[SPACES[sp]]
        x = self.src(a[1], 'u64')
        return self.dst(a[0], 'u64', f"((uint64_t)({x}) {'-' if to else '+'} {win}ull)")

    def access(self, k, st, mods, store):
        sp = next((m for m in mods if m in SPACES), 'generic')
        space = SPACES.get(sp, sp)
        t = self.type1(mods, halves=True)
        if t == 'pred':
            raise Refused("pred access")
        vec = next((int(m[1:]) for m in mods if m in ('v2', 'v4', 'v8')), 1)
        volatile = any(m in mods for m in ('volatile', 'relaxed', 'acquire', 'release'))
        self.mods(mods, {t, sp, 'v2', 'v4', 'v8', 'nc', 'L1::no_allocate'})
        a = st.args
        if len(a) != 2:
            raise Refused("operand count")
        w = SIZE[t]
        vol = 'volatile ' if volatile else ''
        addr, val = (a[0], a[1]) if store else (a[1], a[0])
        code = "{ " + self.ptr(addr, space, w * vec, st.line) + " "
        items = val.items if isinstance(val, P.Vec) else [val]
        if len(items) != vec:
            raise Refused("vector size")
        for i, o in enumerate(items):
            lv = f"*({vol}{CT[t]} *)(p_ + {i * w})"
            if store:
                code += f"{lv} = {self.src(o, t)}; "
            else:
                code += self.dst(o, t, lv) + " "
        code += "}"
        if volatile and space in ('shared', 'generic') and k in self.in_step:
            # warp-synchronous code (volatile shared memory, no barrier between lanes' stores and
            # loads) needs the lanes of a warp in step, as the interpreter runs them: every lane
            # of the warp reaches its next such access (or a barrier, or its end) before any makes it
            rid = self.sync(('label', f"VS{k}", k), Y.BEFORE)       # resumes at the access: its operands live
            self.no_result.add(rid)
            code = (f"{{ Xchg *x_ = &b->x[t]; x_->mask = 0u; x_->site = {k}; x_->kind = {LOCKSTEP}; }} "
                    f"{self.save_marker(rid)} LEAVE_AT(ST_WARP, {rid}); VS{k}:; " + code)
        return code

    def op_ld(self, k, st, mods):
        return self.access(k, st, mods, False)

    def op_ldu(self, k, st, mods):
        return self.access(k, st, mods, False)

    def op_st(self, k, st, mods):
        return self.access(k, st, mods, True)

    def op_atom(self, k, st, mods, red=False):
        sp = next((m for m in mods if m in SPACES), 'generic')
        space = SPACES.get(sp, sp)
        if space not in ('global', 'shared', 'generic'):
            raise Refused(f"atomic in .{sp}")
        aop = next((m for m in mods if m in ('add', 'min', 'max', 'exch', 'cas', 'and', 'or', 'xor', 'inc', 'dec')), None)
        t = self.type1(mods)
        if aop is None or t not in ('b32', 'b64', 'u32', 'u64', 's32', 's64', 'f32', 'f64'):
            raise Refused("atomic")
        self.mods(mods, {t, sp, aop})
        a = list(st.args)
        n = (3 if aop == 'cas' else 2) + (not red)
        if len(a) != n:
            raise Refused("operand count")
        rest = a if red else a[1:]
        w, ct = SIZE[t], CT[t]
        code = "{ " + self.ptr(rest[0], space, w, st.line) + f" {ct} _b = {self.src(rest[1], t)}; "
        if aop == 'cas':
            code += f"{ct} _c = {self.src(rest[2], t)}; {ct} _o = _b; " \
                    f"__atomic_compare_exchange_n(({ct} *)p_, &_o, _c, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED); "
        elif aop == 'add' and is_float(t):
            code += f"{ct} _o = atom_add_{t}(p_, _b); "
        elif aop in ('add', 'and', 'or', 'xor', 'exch') and not is_float(t):
            f = {'add': '__atomic_fetch_add', 'and': '__atomic_fetch_and', 'or': '__atomic_fetch_or',
                 'xor': '__atomic_fetch_xor', 'exch': '__atomic_exchange_n'}[aop]
            code += f"{ct} _o = {f}(({ct} *)p_, _b, __ATOMIC_RELAXED); "
        elif aop in ('min', 'max') and not is_float(t):
            o = '<' if aop == 'min' else '>'
            code += f"{ct} _o = CAS_LOOP({ct}, p_, _b, _b {o} o ? _b : o); "
        elif aop in ('inc', 'dec') and t == 'u32':
            e = "o >= _b ? 0 : o + 1" if aop == 'inc' else "(o == 0 || o > _b) ? _b : o - 1"
            code += f"{ct} _o = CAS_LOOP({ct}, p_, _b, {e}); "
        else:
            raise Refused("atomic operation")
        if not red:
            code += self.dst(a[0], t, "_o")
        return code + " }"

    def op_red(self, k, st, mods):
        return self.op_atom(k, st, mods, True)

    def op_mbarrier(self, k, st, mods):
        """mbarrier.init/arrive/arrive_drop/test_wait/try_wait{.parity}/inval on .shared (cuda::barrier);
        a wait not yet complete yields, so that the threads it waits for run."""
        kind = next((m for m in mods if m in ('init', 'arrive', 'arrive_drop', 'test_wait', 'try_wait', 'inval')), None)
        sp = next((m for m in mods if m in SPACES), None)
        self.mods(mods, {kind, sp, 'parity', 'b64', 'cta', 'acquire', 'release'})
        if kind is None or SPACES.get(sp) != 'shared':
            raise Refused("mbarrier form")
        a = st.args
        if kind == 'inval':
            return ";"
        if kind == 'init':
            self.args(st, 2)
            count = f"(uint64_t)({self.src(a[1], 'u32')} & 0x7FFFFFFFu)"      # pending = expected = count
            return f"{{ {self.ptr(a[0], 'shared', 8, st.line)} *(uint64_t *)p_ = {count} * 0x100000001ull; }}"
        if kind in ('arrive', 'arrive_drop'):
            if len(a) not in (2, 3):
                raise Refused("operand count")
            n = self.src(a[2], 'u32') if len(a) == 3 else '1u'
            return (f"{{ {self.ptr(a[1], 'shared', 8, st.line)} uint64_t _s = mb_arrive(p_, {n}, {int(kind == 'arrive_drop')}); "
                    + self.dst(a[0], 'u64', "_s") + " }")
        if len(a) not in (3, 4):
            raise Refused("operand count")
        rid = self.sync(('label', f"BX{k}", k), Y.RETRY)
        return (f"BX{k}:; {{ {self.ptr(a[1], 'shared', 8, st.line)} uint8_t _d = mb_done(p_, {self.src(a[2], 'u64')}, "
                f"{int('parity' in mods)}); if (!_d) {{ {self.save_marker(rid)} LEAVE_AT(ST_RUN, {rid}); }} "
                + self.dst(a[0], 'pred', "_d") + " }")

    def op_cp(self, k, st, mods):
        """cp.async, done at once (as the interpreter does): commit and wait have nothing to wait for,
        and an mbarrier arrival on completion is one now (.noinc) or none (it adds a pending count first)."""
        if 'async' not in mods:
            raise Refused("cp")
        if any(m in mods for m in ('commit_group', 'wait_group', 'wait_all')):
            return ";"
        if 'mbarrier' in mods:
            sp = next((m for m in mods if m in SPACES), None)
            self.mods(mods, {'async', 'mbarrier', 'arrive', 'noinc', sp, 'b64'})
            if SPACES.get(sp) != 'shared':
                raise Refused("cp.async.mbarrier space")
            self.args(st, 1)
            if 'noinc' not in mods:
                return ";"
            return f"{{ {self.ptr(st.args[0], 'shared', 8, st.line)} mb_arrive(p_, 1, 0); }}"
        self.mods(mods, {'async', 'ca', 'cg', 'shared', 'global', 'L2::64B', 'L2::128B', 'L2::256B', 'L2::cache_hint'})
        if 'shared' not in mods or 'global' not in mods:
            raise Refused("cp.async spaces")
        a = st.args
        if len(a) < 3 or not isinstance(a[2], P.Imm) or a[2].value not in (4, 8, 16):
            raise Refused("cp-size")
        n = a[2].value
        code = f"{{ {self.ptr(a[0], 'shared', n, st.line)} uint8_t *d_ = p_; "
        ss = a[3] if len(a) > 3 and not (isinstance(a[3], P.Reg) and 'L2::cache_hint' in mods
                                         and self.regs.get(self.pre + a[3].name) in ('b64', 'u64')) else None
        if ss is None:
            return code + f"{{ {self.ptr(a[1], 'global', n, st.line)} memcpy(d_, p_, {n}); }} }}"
        src = a[1]
        if not isinstance(src, P.Addr) or not isinstance(src.base, P.Reg):
            raise Refused("cp.async source")
        sa = f"((uint64_t){self.src(src.base, 'u64')} + {src.off & ((1 << 64) - 1)}ull)"
        # src-size: the bytes copied; the rest of the destination is zeroed
        return code + (f"uint32_t _n = {self.src(ss, 'u32')}; if (_n > {n}) _n = {n}; "
                       f"for (uint32_t _i = 0; _i < _n; _i++) {{ uint8_t *q_ = gptr(b, {sa} + _i, 1, {st.line}); "
                       f"if (!q_) return ST_ERR; d_[_i] = *q_; }} memset(d_ + _n, 0, {n} - _n); }}")

    def op_membar(self, k, st, mods):
        return "__atomic_thread_fence(__ATOMIC_SEQ_CST);"

    op_fence = op_membar

    def op_nanosleep(self, k, st, mods):
        return ";"

    op_prefetch = op_nanosleep

    def op_trap(self, k, st, mods):
        return f"fault(b, E_TRAP, 0, 0, {st.line}); return ST_ERR;"

    # -- approximate and exact math --
    def op_rcp(self, k, st, mods, name='rcp'):
        t = self.type1(mods)
        ftz, _ = self.float_mods(mods, t, ('approx',))
        if not ('approx' in mods or any(m in ROUND for m in mods)):
            raise Refused("rounding")
        if self.rmode and name not in ('rcp', 'sqrt'):
            raise Refused("directed rounding")
        a = self.args(st, 2)
        x, = self.fz(ftz, self.src(a[1], t))
        f = 'f' if t == 'f32' else ''
        if t == 'f64' and name not in ('rcp', 'sqrt', 'rsqrt'):
            raise Refused("f64 approximation")
        one = f"u2f(0x3f800000u)" if t == 'f32' else "1.0"
        e = self.rmode and (self.rounded(t, 4, one, x) if name == 'rcp' else self.rounded(t, 5, x))
        e = e or {'rcp': f"(1.0{f} / ({x}))", 'sqrt': f"sqrt{f}({x})", 'rsqrt': f"(1.0{f} / sqrt{f}({x}))",
             'ex2': f"exp2{f}({x})", 'lg2': f"log2{f}({x})", 'sin': f"sin{f}({x})", 'cos': f"cos{f}({x})",
             'tanh': f"tanh{f}({x})"}[name]
        return self.dst(a[0], t, self.post(e, t, ftz, False, x))

    def op_sqrt(self, k, st, mods):
        return self.op_rcp(k, st, mods, 'sqrt')

    def op_rsqrt(self, k, st, mods):
        return self.op_rcp(k, st, mods, 'rsqrt')

    def op_ex2(self, k, st, mods):
        return self.op_rcp(k, st, mods, 'ex2')

    def op_lg2(self, k, st, mods):
        return self.op_rcp(k, st, mods, 'lg2')

    def op_sin(self, k, st, mods):
        return self.op_rcp(k, st, mods, 'sin')

    def op_cos(self, k, st, mods):
        return self.op_rcp(k, st, mods, 'cos')

    # -- control flow and sync points --
    def op_bra(self, k, st, mods):
        self.mods(mods, {'uni'})
        a = self.args(st, 1)
        labels = self.labels[self.fn.name]
        if not isinstance(a[0], P.Sym) or a[0].name not in labels:
            raise Refused("branch target")
        lab, to = a[0].name, labels[a[0].name]
        self.jumps, self.falls, self.jump = [to], False, to
        go = f"@GO{k}:{self.label(lab)}@"         # assemble(): the goto, or where it leaves at to's sync point
        target = self.body[to] if to < k else None
        if to > k or target.sync and target.sync[1] in Y.HARD and not target.guarded:
            return go                             # (no yield before a barrier: the thread stops there anyway)
        # a loop: yield now and then, so that a thread spinning on another one lets it run
        rid = self.sync(('label', self.label(lab), to), Y.LOOP)
        count = ""
        if self.counting:
            self.reads |= {IT, PATH}
            count = f"{self.ident(IT)}++; "
        return f"{count}if (--yc == 0) {{ {self.save_marker(rid)} LEAVE_AT(ST_RUN, {rid}); }} {go}"

    def op_brx(self, k, st, mods):
        self.mods(mods, {'idx', 'uni'})
        a = self.args(st, 2)
        labels = self.fn.targets.get(a[1].name) if isinstance(a[1], P.Sym) else None
        if not labels or any(x not in self.labels[self.fn.name] for x in labels):
            raise Refused("brx.idx without .branchtargets")
        to = [self.labels[self.fn.name][x] for x in labels]
        self.jumps, self.falls = to, False
        code = f"switch ({self.src(a[0], 'u32')}) {{ " + " ".join(
            f"case {i}: goto {self.label(x)};" for i, x in enumerate(labels)) + \
            f" default: fault(b, E_BRX, 0, 0, {st.line}); return ST_ERR; }}"
        if min(to) > k:
            return code
        rid = self.sync(('label', f"BX{k}", k), Y.RETRY)        # a loop through the table: yield as bra does
        return f"BX{k}:; if (--yc == 0) {{ {self.save_marker(rid)} LEAVE_AT(ST_RUN, {rid}); }} {code}"

    def op_ret(self, k, st, mods):
        self.falls = False
        if self.fn.entry:
            return "LEAVE(ST_EXIT);"
        # back to the statement after the call that entered this frame (resolved in liveness())
        key = self.rs(self.fn.name)
        self.reads.add(key)
        self.jumps = [('ret', self.fn.name)]
        return f"RETURN_{self.fidx[self.fn.name]}"

    def op_exit(self, k, st, mods):
        self.falls = False
        return "LEAVE(ST_EXIT);"

    def op_call(self, k, st, mods):
        """A call to a device function: .param arguments copied into its frame, a jump to its body,
        and back (its `ret` jumps to the call site its return register names); no recursion, so a
        function's registers and frame are its own. vprintf and __assertfail go to the host."""
        self.mods(mods, {'uni'})
        args = list(st.args)
        rets = args.pop(0).items if args and isinstance(args[0], P.Group) else []
        if not args or not isinstance(args[0], P.Sym):
            raise Refused("indirect call")
        callee = args.pop(0).name
        actuals = args.pop(0).items if args and isinstance(args[0], P.Group) else []
        if args:
            raise Refused("call with a prototype")
        akeys = [self.param_var(a) for a in actuals]
        rkeys = [self.param_var(r) for r in rets]
        if callee in ('vprintf', '__assertfail'):
            return self.host_call(k, st, callee, akeys, rkeys)
        fn = self.tree.funcs[callee]
        if len(fn.params) != len(actuals) or len(fn.rets) != len(rets):
            raise Refused(f"call to {callee} with the wrong number of arguments")
        pre = callee + '|'
        copy_in = self.copies([(pre + p.name, a) for p, a in zip(fn.params, akeys)])
        copy_out = self.copies([(r, pre + p.name) for p, r in zip(fn.rets, rkeys)])
        self.sites[callee].append(k)
        key = self.rs(callee)
        self.writes.add(key)
        if self.counting:
            self.reads.add(PATH)
            path = self.ident(PATH)
            copy_in += f" {path} = ({path} << 16) | {(k + 1) & 0xFFFF};"
            copy_out += f" {path} >>= 16;"
        self.jumps, self.falls = [self.entry[callee]], False
        return (f"{copy_in} {self.ident(key)} = {k}; goto {self.func_label(callee)}; "
                f"{self.ret_label(k)}:; {copy_out}")

    def param_var(self, o):
        if not isinstance(o, P.Sym) or self.pre + o.name not in self.frame:
            raise Refused("call argument")
        return self.pre + o.name

    def copies(self, pairs):
        out = []
        for dst, src in pairs:
            (do, dn), (so, sn) = self.frame[dst], self.frame[src]
            base = self.K.local_size
            out.append(f"memcpy(lbase + {base + do}ull, lbase + {base + so}ull, {min(dn, sn)});")
        return " ".join(out)

    def host_call(self, k, st, callee, akeys, rkeys):
        """printf and assert: the host formats them (compiler.py), as the interpreter does."""
        def word(key, w=8):
            off, size = self.frame[key]
            if size < w:
                raise Refused(f"{callee} arguments")
            return f"*(uint{8 * w}_t *)(lbase + {self.K.local_size + off}ull)"
        if callee == 'vprintf':
            if len(akeys) != 2:
                raise Refused("vprintf arguments")
            self.reads |= {IT, PATH}
            site = f"({self.ident(PATH)} << 16) | {(k + 1) & 0xFFFF}"
            when = f"((uint64_t)b->epoch << 32) | {self.ident(IT)}"
            code = (f"{{ int64_t _n = HOST_CALL(0, {word(akeys[0])}, {word(akeys[1])}, {site}, {when}); "
                    f"if (_n < -1) {{ fault(b, E_HOST, 0, 0, {st.line}); return ST_ERR; }} ")
            for r in rkeys:
                code += f"{word(r, 4)} = (uint32_t)_n; "
            return code + "}"
        if len(akeys) < 4:
            raise Refused("__assertfail arguments")
        return (f"HOST_CALL(1, {word(akeys[0])}, {word(akeys[1])}, {word(akeys[2], 4)}, {word(akeys[3])}); "
                f"fault(b, E_ASSERT, 0, 0, {st.line}); return ST_ERR;")

    def func_label(self, name):
        return f'F{self.fidx[name]}'

    @staticmethod
    def ret_label(k):
        return f"RS{k}"

    def op_bar(self, k, st, mods):
        if 'warp' in mods:
            self.mods(mods, {'warp', 'sync'})
            return self.warp_op(k, st, WARPSYNC, None, '0', '0', '0', self.src(self.args(st, 1)[0], 'u32'))
        kind = next((m for m in mods if m in ('sync', 'arrive', 'red')), 'sync')
        rop = next((m for m in mods if m in ('popc', 'and', 'or')), None) if kind == 'red' else None
        self.mods(mods, {'cta', 'sync', 'arrive', 'red', 'aligned', 'u32', 'pred', rop})
        args = list(st.args)
        if kind == 'red':
            if rop is None or len(args) not in (3, 4):
                raise Refused("bar.red form")
            out, pv, args = args[0], self.src(args[-1], 'pred'), args[1:-1]
        if not 1 <= len(args) <= 2 or kind == 'arrive' and len(args) != 2:
            raise Refused("barrier operands")
        bid = self.src(args[0], 'u32')
        count = self.src(args[1], 'u32') if len(args) == 2 else '0u'
        arrive = f"bar_arrive(b, {bid}, {count});"
        if kind == 'arrive':
            self.bar_simple = False
            return arrive
        rid = self.sync(('after', k), Y.AFTER)
        self.bar_red |= rop is not None
        self.bar_simple &= kind == 'sync' and len(args) == 1 and isinstance(args[0], P.Imm) and args[0].value == 0
        red = f"x_->a = {pv}; x_->c = {('popc', 'and', 'or').index(rop) + 1};" if rop else "x_->c = 0;"
        code = (f"if (!BAR_SIMPLE) {{ Xchg *x_ = &b->x[t]; x_->b = ({bid}) & 15; {red} {arrive} }} "
                f"{self.save_marker(rid)} LEAVE_AT(ST_BAR, {rid}); {self.resume(rid)}:;")
        if self.counting:
            self.writes.add(IT)
            code += f" {self.ident(IT)} = 0;"
        if rop:
            code += " " + self.dst(out, 'u32' if rop == 'popc' else 'pred',
                                   "(uint32_t)b->x[t].r" if rop == 'popc' else "(uint8_t)b->x[t].r")
        return code

    op_barrier = op_bar

    def warp_op(self, k, st, kind, dst, a, bb, cc, mask, pdst=None, dtype='u32'):
        rid = self.sync(('after', k), Y.AFTER)
        if kind == WARPSYNC:
            self.no_result.add(rid)
        code = (f"{{ Xchg *x_ = &b->x[t]; x_->a = (uint64_t)({a}); x_->b = {bb}; x_->c = {cc}; "
                f"x_->mask = {mask}; x_->site = {k}; x_->kind = {kind}; }} "
                f"{self.save_marker(rid)} LEAVE_AT(ST_WARP, {rid}); {self.resume(rid)}:; ")
        if dst is not None:
            code += self.dst(dst, dtype, f"({CT[dtype]})b->x[t].{'p' if dtype == 'pred' else 'r'}")
        if pdst is not None:
            code += self.dst(pdst, 'pred', "b->x[t].p")
        return code

    def op_shfl(self, k, st, mods):
        mode = next(m for m in mods if m in SHFL)
        t = self.type1(mods)
        self.mods(mods, {'sync', mode, t})
        a = st.args
        if len(a) not in (4, 5):
            raise Refused("operand count")
        out = a[0]
        d, p = (out.a, out.b) if isinstance(out, P.Pair) else (out, None)
        mask = self.src(a[4], 'u32') if len(a) == 5 else '0xffffffffu'
        return self.warp_op(k, st, SHFL[mode], d, self.src(a[1], 'u32'), self.src(a[2], 'u32'),
                            self.src(a[3], 'u32'), mask, p)

    def op_vote(self, k, st, mods):
        mode = next(m for m in mods if m in VOTE)
        t = self.type1(mods)
        self.mods(mods, {'sync', mode, t})
        a = st.args
        mask = self.src(a[2], 'u32') if len(a) == 3 else '0xffffffffu'
        return self.warp_op(k, st, VOTE[mode], a[0], self.src(a[1], 'pred'), '0', '0', mask,
                            dtype='u32' if mode == 'ballot' else 'pred')

    def op_activemask(self, k, st, mods):
        self.mods(mods, {'b32'})
        return self.warp_op(k, st, ACTIVEMASK, self.args(st, 1)[0], '0', '0', '0', '0u')

    def op_match(self, k, st, mods):
        mode = next(m for m in mods if m in MATCH)
        t = self.type1(mods)
        if t not in ('b32', 'b64'):
            raise Refused("match type")
        self.mods(mods, {'sync', mode, t})
        a = self.args(st, 3)
        out = a[0]
        d, p = (out.a, out.b) if isinstance(out, P.Pair) else (out, None)
        return self.warp_op(k, st, MATCH[mode], d, self.src(a[1], 'u64' if t == 'b64' else 'u32'), '0', '0',
                            self.src(a[2], 'u32'), p)

    def op_redux(self, k, st, mods):
        rop = next(m for m in mods if m in REDUX)
        t = self.type1(mods)
        if t not in ('u32', 's32', 'b32'):
            raise Refused("redux type")
        self.mods(mods, {'sync', rop, t})
        a = self.args(st, 3)
        return self.warp_op(k, st, REDUX[rop], a[0], self.src(a[1], 'u32'), '0', '1' if t == 's32' else '0',
                            self.src(a[2], 'u32'), dtype=t)

    # -- assembly --
    def sync(self, where, mode):
        """A sync point of the statement being translated: its rid (pc value), resuming at `where`:
        ('after', k) the resume label after it, or ('label', C label, statement it starts)."""
        self.syncs.append(where)
        rid = len(self.syncs)
        self.sync_at = (rid, mode, where[-1])
        return rid

    @staticmethod
    def save_marker(rid):
        return f"@SAVE{rid}@"

    @staticmethod
    def resume(rid):
        return f"R{rid}"

    def label(self, name):
        return 'L' + self.ident(self.pre + name)

    def successors(self):
        """Each statement's successors, calls and returns resolved: a function's `ret` goes on after
        every call to it; past its function's last statement, the kernel's end (callees end in ret)."""
        n = len(self.stmts)
        out = []
        for k in range(n):
            s = []
            for j in self.body[k].succ:
                s += [c + 1 for c in self.sites[j[1]]] if isinstance(j, tuple) else [j]
            out.append([x for x in s if x < n and (x != k + 1 or self.owner[x] == self.owner[k])])
        return out

    def assemble(self):
        names = list(self.regs)
        bit = {r: 1 << i for i, r in enumerate(names)}

        def mask(rs):
            m = 0
            for r in rs:
                m |= bit[r]
            return m

        def regs_of(m):
            out = []
            while m:
                low = m & -m
                out.append(names[low.bit_length() - 1])
                m ^= low
            return sorted(out)
        flows = [Y.Flow(mask(line.reads), mask(line.writes), mask(line.kills), succ, line.guarded, line.sync,
                        line.jump) for line, succ in zip(self.body, self.successors())]
        plan = Y.plan(flows, (1 << len(names)) - 1)
        member = {'f32': 'f', 'f64': 'd'}

        def slot(r):
            return f"SV({plan.slot[bit[r]]}).{member.get(self.regs[r], 'u')}"
        saves = {rid: " ".join(f"{slot(r)} = {self.ident(r)};" for r in regs_of(m)) for rid, m in plan.save.items()}
        targets = {rid: self.resume(rid) if where[0] == 'after' else where[1] for rid, where in enumerate(self.syncs, 1)}
        restores = {rid: " ".join(f"{self.ident(r)} = ({CT[self.regs[r]]}){slot(r)};" for r in regs_of(m))
                    for rid, m in plan.restore.items()}
        returns = {f"RETURN_{self.fidx[f]}": "switch (" + self.ident(self.rs(f)) + ") { " + " ".join(
            f"case {c}: goto {self.ret_label(c)};" for c in self.sites[f]) + " } return ST_ERR;"
            for f in self.order[1:]}

        def saved(m):
            return " ".join(f"{slot(r)} = {self.ident(r)};" for r in regs_of(m))

        def go(m):
            j, label = int(m.group(1)), m.group(2)
            if j not in plan.jump_save:
                into = plan.entry_save.get((j, self.body[j].jump))
                return f"goto {label};" if into is None else f"{{ {saved(into)} goto {label}; }}"
            # leave at the target's sync point from here: its code up to the save, this way's save
            target = self.body[self.body[j].jump]
            pre, rest = target.code.split("@SAVE", 1)
            rid = int(rest.split("@", 1)[0])
            leave = rest.split("@", 1)[1].split(";", 1)[0] + ";"        # LEAVE_AT(ST_.., rid);
            return f"{{ {pre} {saved(plan.jump_save[j])} {leave} }}"

        def code(k):
            c = re.sub(r'@GO(\d+):(\w+)@', go, self.body[k].code)
            c = re.sub(r'@SAVE(\d+)@', lambda m: saves[int(m.group(1))], c)
            if (k, k + 1) in plan.entry_save and self.body[k].jump != k + 1:    # falling into a loop
                c += " " + saved(plan.entry_save[k, k + 1])
            return "    " + re.sub(r'RETURN_\w+', lambda m: returns[m.group()], c)
        lines = []
        for i, f in enumerate(self.order):
            end = self.entry[self.order[i + 1]] if i + 1 < len(self.order) else len(self.stmts)
            lines.append(f"{self.func_label(f)}:;")
            for k in range(self.entry[f], end):
                lines += [f"{lab}:;" for lab in self.labels_at(f, k)] + [code(k)]
            lines += [f"{lab}:;" for lab in self.labels_at(f, end)]
            lines.append("    LEAVE(ST_EXIT);" if i == 0 else "    return ST_ERR;")
        cases = "\n".join(f"    case {rid}: {restores[rid]} goto {targets[rid]};" for rid in targets)
        regions = self.regions(plan, code, restores, targets)
        table = ", ".join(f"region_{regions[rid][0]}" if rid in regions else "0" for rid in range(len(self.syncs) + 1))
        prelude = PRELUDE % dict(shared_win=SHARED_WIN, local_win=LOCAL_WIN, param_win=PARAM_WIN, win=WIN)
        return "\n".join([
            prelude,
            f"#define NSAVE {plan.nslots}",
            f"#define NSITES {self.nsites}",
            f"#define NSYNC {len(self.syncs)}",
            f"#define BAR_RED {int(self.bar_red)}",
            f"#define BAR_SIMPLE {int(self.bar_simple)}",
            "#define SV(i) sv[(size_t)(i) * nt_]      /* the thread's home slot i: slot i of every thread in a row */",
            "#define PRM_AT(o) (prm + (o))",
            "#define LEAVE(s) return (s)",
            "#define LEAVE_AT(s, p) do { pc_[t] = (p); return (s); } while (0)",
            THREAD_FN % dict(decl=self.declare(self.regs), cases=cases, body="\n".join(lines)),
            "#undef LEAVE",
            "#undef LEAVE_AT",
            "#define LEAVE(s) do { state_[t] = (s); exits_++; goto next_t; } while (0)",    # (ST_EXIT only)
            "#define LEAVE_AT(s, p) do { pc_[t] = (p); state_[t] = (s); at_##p++; goto next_t; } while (0)",
            "#undef GPTR",
            "#define GPTR GPTR_SITE",
            "#undef PRM_AT",
            "#define PRM_AT(o) ((uint8_t *)prmc_ + (o))",
            *(text for _, text in regions.values()),
            "#undef GPTR",
            "#undef LEAVE",
            "#undef LEAVE_AT",
            f"static int (*const REGIONS[NSYNC + 1])(Blk *, uint32_t, uint32_t) = {{ {table} }};",
            "static const uint8_t SYNC_FREE[NSYNC + 1] = { " +
            ", ".join("1" if rid in self.no_result else "0" for rid in range(len(self.syncs) + 1)) + " };",
            SCHEDULER])

    def labels_at(self, f, k):
        """C labels of function f's PTX labels at its statement k."""
        if not hasattr(self, '_labels_at'):
            self._labels_at = {}
            for g in self.order:
                self.enter(g)
                for name, j in self.labels[g].items():
                    self._labels_at.setdefault((g, j), []).append(self.label(name))
        return self._labels_at.get((f, k), [])

    def declare(self, regs):
        return "\n".join(f"    {CT[self.rtype(r)]} {self.ident(r)} = 0;" for r in regs)

    def regions(self, plan, code, restores, targets):
        """rid -> (rid, C function) of each region crt.py's scheduler runs as a loop over the block's
        threads (syncs.py), while their statements together stay within REGION_BUDGET times the
        kernel's; none in a kernel that calls functions (their returns jump between call sites)."""
        if len(self.order) > 1:
            return {}
        out, budget = {}, REGION_BUDGET * max(len(self.stmts), 1)
        n = self.K.param_size
        params = f"uint8_t prmc_[{n}] __attribute__((aligned(16))); memcpy(prmc_, c->params, {n});" \
            if 0 < n <= PARAM_COPY else "const uint8_t *const prmc_ = c->params;"
        idents = {r: self.ident(r) for r in self.regs}
        n = len(self.stmts)
        for rid, stmts in sorted(plan.regions.items()):
            budget -= len(stmts)
            if budget < 0:
                break
            body, inside = [], set(stmts)
            for k in stmts:
                if k - 1 not in inside and body:
                    body.append("    return ST_ERR;")        # no path of this region comes here
                body += [f"{lab}:;" for lab in self.labels_at(self.K.name, k)] + [code(k)]
            if stmts and stmts[-1] == n - 1:
                body += [f"{lab}:;" for lab in self.labels_at(self.K.name, n)] + ["    LEAVE(ST_EXIT);"]
            else:
                body.append("    return ST_ERR;")
            enter = "" if rid == 0 else f"{restores[rid]} goto {targets[rid]};"
            text = enter + "\n".join(body)
            sites = sorted(set(re.findall(r'LEAVE_AT\((ST_\w+), (\d+)\)', text)), key=lambda x: int(x[1]))
            used = set(re.findall(r'\br[s0-9_]\w*', text))       # the code a region holds names registers it never runs
            counters = " ".join(f"uint32_t at_{p} = 0;" for _, p in sites)
            gsites = sorted({int(k) for k in re.findall(r'GPTR\([^;]*?, (\d+)\);', text)})
            counters += "".join(f" GCache g_{k} = b->site[{k}];" for k in gsites)
            tally = "".join(f" b->site[{k}] = g_{k};" for k in gsites) + "\n"
            # (a thread that yields still runs: the counts stay)
            tally += "\n".join(f"    if (at_{p}) {{ " + ("" if st == 'ST_RUN' else f"b->n[{st}] += at_{p}; gone_ += at_{p}; ")
                               + f"only_ = only_ == -2 ? {p} : -1; }}" for st, p in sites)
            out[rid] = (rid, REGION_FN % dict(rid=rid, decl=self.declare([r for r, i in idents.items() if i in used]),
                                             enter=enter, body="\n".join(body), counters=counters, tally=tally,
                                             params=params))
        return out


REGION_BUDGET = 4       # region statements, over the kernel's: each region repeats the code it runs
PARAM_COPY = 512        # parameter bytes a region copies to a local array (so that gcc hoists their loads)

THREAD_FN = r"""
/* One thread from where it waits (b->pc[t]) to its next sync point; returns its state there. */
static inline __attribute__((always_inline)) int thread_fn(Blk *b, uint32_t t) {
    Ctx *c = b->c; const uint32_t nt_ = THREADS(b); (void)nt_; int32_t *const pc_ = b->pc;
    BLOCK_VARS
    const uint32_t *const tids_ = b->tid;
    THREAD_VARS
    Slot *sv = b->save + t; (void)sv;
    int yc = YIELD_EVERY; (void)yc;
    uint64_t glo = b->g.lo, ghi = b->g.hi; uint8_t *gh = b->g.host;
    uint8_t *const shm = b->shm; const uint64_t shlim = SHBYTES(c);
    const uint64_t lsz = c->local_size; uint8_t *const lbase = b->loc + (uint64_t)t * lsz;
    uint8_t *const prm = c->params; const uint64_t psz = c->psize;
    (void)glo; (void)ghi; (void)gh; (void)shm; (void)shlim; (void)lsz; (void)lbase; (void)prm; (void)psz;
%(decl)s
    switch (b->pc[t]) {
    case 0: break;
%(cases)s
    default: return ST_ERR;
    }
%(body)s
}
"""

REGION_FN = r"""
/* Threads t0..t1-1 of the block, all running and all waiting at sync point %(rid)d (crt.py's block_step
   saw to it), each to its next one; b->left_at: the sync point they all left at (-1 several, -2 none). */
static int region_%(rid)d(Blk *b, uint32_t t0, uint32_t t1) {
    Ctx *c = b->c; const uint32_t nt_ = THREADS(b); (void)nt_;
    uint8_t *const state_ = b->state; int32_t *const pc_ = b->pc; Slot *const save_ = b->save;
    const uint32_t *const tids_ = b->tid; uint8_t *const loc_ = b->loc;
    uint32_t exits_ = 0; %(counters)s
    uint64_t glo = b->g.lo, ghi = b->g.hi; uint8_t *gh = b->g.host;
    uint8_t *const shm = b->shm; const uint64_t shlim = SHBYTES(c);
    const uint64_t lsz = c->local_size;
    uint8_t *const prm = c->params; const uint64_t psz = c->psize;
    (void)glo; (void)ghi; (void)gh; (void)shm; (void)shlim; (void)prm; (void)psz; (void)state_; (void)pc_;
    BLOCK_VARS
    %(params)s
    for (uint32_t t = t0; t < t1; t++) {
        THREAD_VARS
        Slot *sv = save_ + t; (void)sv;
        int yc = YIELD_EVERY; (void)yc;
        uint8_t *const lbase = loc_ + (uint64_t)t * lsz; (void)lbase;
%(decl)s
        %(enter)s
%(body)s
    next_t:;
    }
    uint32_t gone_ = exits_; int32_t only_ = -2;
    b->n[ST_EXIT] += exits_;
%(tally)s
    b->n[ST_RUN] -= gone_;
    b->left_at = only_;
    return 0;
}
"""


for _v in SIMD:
    for _n in (2, 4):
        setattr(KernelSource, f"op_{_v}{_n}", lambda self, k, st, mods, _name=f"{_v}{_n}": self.simd(k, st, mods, _name))
