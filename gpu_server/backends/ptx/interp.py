"""Vectorised PTX interpreter: the `emu` backend's GPU.

A launch runs batches of blocks. All threads of a batch are NumPy lanes: the register
file maps each register to one array (or a NumPy scalar while it is uniform). Control
flow is min-PC scheduling: the lanes at the lowest PC run together as a group (with a
mask), others wait, so divergent branches reconverge where the lowest PC catches up.
A group keeps running without rescanning the lanes until its PC reaches the next
waiting lane's PC (`lim`). Instructions are decoded once, at parse time (decode.py).

Address windows: global memory is EmuMemory's arena (from its device's base, address_space.BASE or above); generic
addresses of shared, local and kernel-param memory live in their own 4 GiB windows
below it (decode.py), so generic ld/st/atom dispatch by range. Shared memory is per block
(one slice per block of the batch); local memory is per lane.
"""
import math
import time
import weakref

import numpy as np

from phos.base import settings
from phos.gpu_server.address_space import BASE
from phos.gpu_server.backends.ptx import ops
from phos.gpu_server.backends.ptx import parser as P
from phos.gpu_server.backends.ptx.decode import (TRAP_STATUS, BAR, BRA, BRX, CALL, EXIT, LOCAL_WIN, OP, PARAM_WIN, RET, SHARED_WIN,
                                        TRAP, WIN, Decoder, err)
from phos.gpu_server.backends.ptx.ops import DT, as_, u8, u32, u64
from phos.schema.cuda_types import CudaError, CUresult

LAUNCH_BOUNDS_STATUS = CUresult.CUDA_ERROR_INVALID_VALUE  # block shape outside .maxntid/.reqntid; to verify on the H200
MAX_SHARED = 48 * 1024          # per block without the opt-in attribute
MAX_SHARED_OPTIN = 227 * 1024   # H100/H200 opt-in limit (Kernel.max_dynamic_shared may raise up to this)
LANES = 1 << 17                 # lanes per batch: big enough to amortise Python, small enough for cache
MAX_DEPTH = 64
SPIN_EVERY = 16                 # backward jumps between two spin checks
NUM_SMS = 132
BATCH_BYTES = 512 << 20         # rough memory budget of one batch (registers, local, shared)
BIG = 1 << 62
_clock = [0]                    # %clock64 keeps counting across batches and launches


class Deadline:
    """When a launch must have ended (timeout seconds from its start; 0: never). The interpreter
    checks it between batches and wherever a kernel can loop (backward jumps, regrouping), so
    neither a kernel that never ends nor a grid of trillions of blocks holds a core for good."""

    def __init__(self, kname, timeout=0):
        self.kname, self.timeout = kname, timeout
        self.at = time.monotonic() + timeout if timeout > 0 else float('inf')

    def check(self):
        if time.monotonic() > self.at:
            raise err(CUresult.CUDA_ERROR_LAUNCH_TIMEOUT,
                      f"kernel '{self.kname}': stopped after {self.timeout:g} s, the emu's launch time limit "
                      "(PHOS_EMU_LAUNCH_TIMEOUT)")


class Regs(dict):
    def __init__(self, N, dtypes):
        super().__init__()
        self.N, self.dtypes = N, dtypes

    def __missing__(self, key):     # registers read before written are 0
        v = np.zeros(self.N, self.dtypes.get(key, u32))
        self[key] = v
        return v


class PBufs(dict):
    def __init__(self, N, sizes):
        super().__init__()
        self.N, self.sizes = N, sizes

    def __missing__(self, key):
        v = np.zeros((self.N, -(-self.sizes.get(key, 8) // 8) * 8), u8)
        self[key] = v
        return v


class State:
    """One batch of blocks in flight."""

    def __init__(self, K, symbols, mem, kparams, printf, grid, block, dyn, b0, nb, deadline=None):
        nt = block[0] * block[1] * block[2]
        self.kname, self.mem, self.printf, self.kparams = K.name, mem, printf, kparams
        self.envreg = {}
        self.deadline = deadline or Deadline(K.name)
        self.N = N = nt * nb
        self.nt, self.nb = nt, nb
        self.R = Regs(N, K.reg_dtypes)
        self.pb = PBufs(N, K.pbuf_sizes)
        self.sym = symbols
        self.clock = _clock[0]
        self.arena = mem.arena
        lane = np.arange(N, dtype=np.int64)
        self.all = lane
        blk, t = lane // nt, lane % nt
        self.lane_blk = blk
        self.shtotal = K.shared_static + dyn
        self.shstride = -(-max(self.shtotal, 1) // 16) * 16
        self.shm = np.zeros(nb * self.shstride, u8)
        self.shbase = blk * self.shstride
        self.locstride = K.local_size
        self.loc = np.zeros(N * self.locstride, u8) if self.locstride else np.zeros(16, u8)
        self.kp8 = np.frombuffer(kparams, u8)
        g = b0 + blk
        R = self.R
        for c, n, k in zip('xyz', block, (1, block[0], block[0] * block[1])):
            R[f'%tid.{c}'] = ((t // k) % n).astype(u32)
            R[f'%ntid.{c}'] = u32(n)
        for c, n, k in zip('xyz', grid, (1, grid[0], grid[0] * grid[1])):
            v = (g // k) % n
            R[f'%ctaid.{c}'] = v.astype(u32) if nb > 1 else u32(v[0])
            R[f'%nctaid.{c}'] = u32(n)
        laneid = t % 32
        self.laneid = laneid
        self.wbase = lane - laneid
        self.wsize = np.minimum(32, nt - (t - laneid))
        nwarps = -(-nt // 32)
        self.wg = blk * nwarps + t // 32
        self.nwg = nb * nwarps
        R['%laneid'] = laneid.astype(u32)
        R['%warpid'] = (t // 32).astype(u32)
        R['%nwarpid'] = u32(64)
        R['%smid'] = (g % NUM_SMS).astype(u32)
        R['%nsmid'] = u32(NUM_SMS)
        R['%gridid'] = u64(1)
        lm = (np.uint64(1) << laneid.astype(u64))
        R['%lanemask_eq'] = lm.astype(u32)
        R['%lanemask_lt'] = (lm - u64(1)).astype(u32)
        R['%lanemask_le'] = ((lm << u64(1)) - u64(1)).astype(u32)
        R['%lanemask_gt'] = (~((lm << u64(1)) - u64(1))).astype(u32)
        R['%lanemask_ge'] = (~(lm - u64(1))).astype(u32)
        R['%dynamic_smem_size'] = u32(dyn)
        R['%total_smem_size'] = u32(self.shtotal)
        # control state
        self.alive = np.ones(N, bool)
        self.run = np.ones(N, bool)
        self.nrun = N
        self.wait = np.full(N, -1, np.int16)
        self.nwait = 0
        self.arrived, self.expect, self.reds = {}, {}, {}
        self.redval = None
        self.dep = np.zeros(N, np.int32)
        self.rstack = None
        self.K = K
        self.susp = np.zeros(N, bool)           # lanes parked by a yield (see stuck())
        self.nsusp = 0
        self.snap = None

    # -- lane helpers --
    def count(self, m):
        return self.N if m is None else int(np.count_nonzero(m))

    def take(self, v, m):
        """Per-lane values of the group m, as a 1-D array (a broadcast view when m is None)."""
        v = np.broadcast_to(v, (self.N,))
        return v if m is None else v[m]

    def lanes(self, m):
        return self.all if m is None else np.flatnonzero(m)

    def lane_list(self, m):
        return range(self.N) if m is None else [int(x) for x in np.flatnonzero(m)]

    # -- memory --
    def _bad(self, what, a):
        raise err(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, f"kernel '{self.kname}': {what} at {int(a):#x}")

    def _align(self, a, width):
        if width & (width - 1) == 0 and width > 1:
            bad = (a & u64(width - 1)) != 0
            if bad.any():
                raise err(CUresult.CUDA_ERROR_MISALIGNED_ADDRESS,
                          f"kernel '{self.kname}': misaligned {width}-byte access at {int(a[bad][0]):#x}")

    def locate(self, space, a, width, m, sel=None):
        """[(sel, byte buffer, byte offsets)] for accesses of `width` bytes at a (one per lane of m).

        sel picks the lanes (of a) that a part covers; None: all of them."""
        if space == 'generic':
            if not len(a):
                return []
            if a.min() >= u64(BASE):
                return self.locate('global', a, width, m)
            parts, rest = [], np.ones(len(a), bool)
            li = self.lanes(m)
            for win, sp in ((SHARED_WIN, 'shared'), (LOCAL_WIN, 'local'), (PARAM_WIN, 'param')):
                hit = (a - u64(win)) < u64(WIN)
                if hit.any():
                    s = np.flatnonzero(hit)
                    rest &= ~hit
                    parts.append((s,) + self._space(sp, a[s] - u64(win), width, li[s])[1:])
            if rest.any():
                s = np.flatnonzero(rest)
                parts += [(s if sel_ is None else s[sel_], buf, off) for sel_, buf, off in self._global(a[s], width)]
            return parts
        if space in ('global', 'const'):
            return self._global(a, width)
        return [self._space(space, a, width, None if m is None else self.lanes(m))]

    def _global(self, a, width):
        """Global accesses: the arena's, and those in the client's memory the device maps in
        place (EmuMemory.host_windows: managed and mapped host memory), each from its buffer."""
        a = np.asarray(a, u64)
        windows = self.mem.host_windows
        if not windows:
            return [self._space('global', a, width, None)]
        self._align(a, width)
        parts, rest = [], np.ones(len(a), bool)
        for lo, hi, buf in windows:
            hit = (a >= u64(lo)) & (a < u64(hi))
            if hit.any():
                s = np.flatnonzero(hit)
                off = a[s] - u64(lo)
                if (off + u64(width) > u64(hi - lo)).any():
                    self._bad(f"{width}-byte access past the end of mapped host memory", int(a[s][0]))
                rest &= ~hit
                parts.append((s, buf, off.astype(np.int64)))
        if rest.all():
            return [self._space('global', a, width, None)]
        if rest.any():
            s = np.flatnonzero(rest)
            parts.append((s,) + self._space('global', a[s], width, None)[1:])
        return parts

    def _space(self, space, a, width, li):
        a = np.asarray(a, u64)
        self._align(a, width)
        if space in ('global', 'const'):
            try:
                return None, self.arena, self.mem.offsets(a, width)
            except CudaError as e:
                raise err(e.status, f"kernel '{self.kname}': {e.message}") from None
        if space == 'shared':
            lim = self.shtotal
            base = self.shbase if li is None else self.shbase[li]
            buf, what = self.shm, "shared"
        elif space == 'local':
            lim = self.locstride
            base = (self.all if li is None else li) * self.locstride
            buf, what = self.loc, "local"
        else:
            lim, base, buf, what = len(self.kparams), 0, self.kp8, "param"
        bad = a > u64(lim - width) if lim >= width else np.ones(len(a), bool)
        if bad.any():
            self._bad(f"{width}-byte {what} access outside the {lim} bytes of {what} memory", a[bad][0])
        return None, buf, base + a.astype(np.int64)

    @staticmethod
    def typed(buf, dt):
        w = dt.itemsize
        return buf[:len(buf) // w * w].view(dt)

    def load(self, space, a, dt, nvec, m):
        dt = np.dtype(dt)
        w = dt.itemsize
        parts = self.locate(space, a, w * nvec, m)
        if len(parts) == 1 and parts[0][0] is None:
            _, buf, off = parts[0]
            v, ix = self.typed(buf, dt), off // w
            return [v[ix + k] for k in range(nvec)]
        out = [np.empty(len(a), dt) for _ in range(nvec)]
        for sel, buf, off in parts:
            v, ix = self.typed(buf, dt), off // w
            for k in range(nvec):
                out[k][sel] = v[ix + k]
        return out

    def store(self, space, a, dt, vals, m):
        dt = np.dtype(dt)
        w = dt.itemsize
        if space == 'const':
            raise err(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, f"kernel '{self.kname}': store to constant memory")
        for sel, buf, off in self.locate(space, a, w * len(vals), m):
            if buf is self.kp8:
                self._bad("store to kernel parameter memory", 0)
            v, ix = self.typed(buf, dt), off // w
            for k, x in enumerate(vals):
                v[ix + k] = x if sel is None else x[sel]

    def atomic(self, space, a, dt, fn, uf, b, c, m):
        old = np.empty(len(a), dt)
        w = dt.itemsize
        for sel, buf, off in self.locate(space, a, w, m):
            if buf is self.loc or buf is self.kp8:
                raise err(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, f"kernel '{self.kname}': atomic on local/param memory")
            v = self.typed(buf, dt)
            if sel is None:
                old[:] = ops.atomic(v, off // w, fn, uf, b, c)
            else:
                old[sel] = ops.atomic(v, off // w, fn, uf, b[sel], None if c is None else c[sel])
        return old

    def _at(self, addr, width, lane):
        m = np.zeros(self.N, bool)
        m[lane] = True
        (_, buf, off), = self.locate('generic', np.array([addr], u64), width, m)
        return buf, int(off[0])

    def read_bytes(self, addr, n, lane):
        """n bytes at a generic address, as thread `lane` sees them (printf arguments)."""
        buf, off = self._at(addr, n, lane)
        return bytes(buf[off:off + n])

    def read_cstr(self, addr, lane):
        buf, off = self._at(addr, 1, lane)
        end = off
        while end < len(buf) and buf[end] and end - off < 1 << 16:
            end += 1
        self._at(addr + end - off, 1, lane)         # the terminator must be in bounds too
        return bytes(buf[off:end]).decode('utf-8', 'replace')

    # -- warps --
    def shfl(self, mode, a, b, c):
        lane = self.laneid
        b, c = np.asarray(b).astype(np.int64), np.asarray(c).astype(np.int64)
        bval, cval, seg = b & 31, c & 31, (c >> 8) & 31
        maxl = (lane & seg) | (cval & ~seg)
        minl = lane & seg
        if mode == 'up':
            j = lane - bval
            ok = j >= maxl
        elif mode == 'down':
            j = lane + bval
            ok = j <= maxl
        elif mode == 'bfly':
            j = lane ^ bval
            ok = j <= maxl
        else:
            j = minl | (bval & ~seg)
            ok = j <= maxl
        j = np.where(ok & (j < self.wsize), j, lane)
        return np.broadcast_to(a, (self.N,))[self.wbase + j], np.broadcast_to(ok, (self.N,))

    def ballot(self, p, m):
        """Per lane: the 32-bit mask of lanes of its warp in group m whose p is true."""
        p = np.broadcast_to(np.asarray(p, bool), (self.N,))
        sel = p if m is None else p & m
        w = np.bincount(self.wg[sel], weights=(2.0 ** self.laneid[sel]), minlength=self.nwg)
        return w.astype(np.uint64).astype(u32)[self.wg]

    def _warp_matrix(self, v, m, fill):
        mat = np.full(self.nwg * 32, fill, dtype=np.asarray(v).dtype)
        li = self.lanes(m)
        mat[self.wg[li] * 32 + self.laneid[li]] = np.broadcast_to(v, (self.N,))[li]
        return mat.reshape(self.nwg, 32)

    def match(self, v, m):
        act = self.ballot(True, m)
        vm = self._warp_matrix(v, m, 0)
        am = self._warp_matrix(np.ones(self.N, bool), m, False)
        own = np.broadcast_to(v, (self.N,))
        rows = vm[self.wg]                      # (N, 32)
        eq = (rows == own[:, None]) & am[self.wg]
        same = (eq * (2.0 ** np.arange(32))).sum(1).astype(np.uint64).astype(u32)
        return same, act

    def redux(self, rop, v, dt, m):
        info = np.iinfo(dt)
        fill = {'add': 0, 'min': info.max, 'max': info.min, 'and': -1 if dt.kind == 'i' else info.max,
                'or': 0, 'xor': 0}[rop]
        mat = self._warp_matrix(as_(np.asarray(v), dt), m, dt.type(fill))
        f = {'add': np.add, 'min': np.minimum, 'max': np.maximum, 'and': np.bitwise_and, 'or': np.bitwise_or,
             'xor': np.bitwise_xor}[rop]
        return f.reduce(mat, axis=1, dtype=dt)[self.wg]

    # -- yields --
    def stuck(self, lo, hi, m):
        """Has group m's loop lo..hi come round with the same registers as SPIN_EVERY jumps ago?

        Such a group is waiting on memory that only lanes parked behind it can change (a spin
        lock, a flag from another block): min-PC scheduling would never run those lanes."""
        snap = [np.array(self.take(self.R[k], m)) for k in self.K.loop_regs(lo, hi) if k in self.R]
        old, self.snap = self.snap, ((lo, hi), snap)
        return old is not None and old[0] == (lo, hi) and all(np.array_equal(a, b) for a, b in zip(old[1], snap))

    def suspend(self, m):
        li = self.lanes(m)
        self.susp[li] = True
        self.run[li] = False
        self.nrun -= len(li)
        self.nsusp += len(li)

    def resume(self):
        self.run |= self.susp
        self.nrun += self.nsusp
        self.susp[:] = False
        self.nsusp = 0

    # -- barriers --
    def arrive(self, m, bid, count, wait, red):
        li = self.lanes(m)
        blk = self.lane_blk[li]
        arr = self.arrived.setdefault(bid, np.zeros(self.nb, np.int64))
        exp = self.expect.setdefault(bid, np.zeros(self.nb, np.int64))
        arr += np.bincount(blk, minlength=self.nb)
        if count is not None:
            exp[np.unique(blk)] = count
        if wait:
            self.wait[li] = bid
            self.run[li] = False
            self.nrun -= len(li)
            self.nwait += len(li)
        if red is not None:
            if self.redval is None:
                self.redval = np.zeros(self.N, np.int64)
            rop, d, gp = red
            self.redval[li] = np.broadcast_to(gp(self), (self.N,))[li]
            self.reds[bid] = (rop, d)

    def release(self):
        """Free the lanes of every block whose barrier is complete; returns how many lanes resumed."""
        if not self.nwait:
            return 0
        alive_pb = np.bincount(self.lane_blk[self.alive], minlength=self.nb)
        total = 0
        for bid, arr in self.arrived.items():
            exp = self.expect[bid]
            need = np.where(exp > 0, exp, alive_pb)
            done = (arr >= need) & (arr > 0)
            if not done.any():
                continue
            lanes = (self.wait == bid) & done[self.lane_blk]
            if bid in self.reds:
                rop, d = self.reds.pop(bid)
                li = np.flatnonzero(lanes)
                blk = self.lane_blk[li]
                vals = self.redval[li] != 0
                cnt = np.bincount(blk, weights=vals, minlength=self.nb)
                tot = np.bincount(blk, minlength=self.nb)
                r = {'popc': cnt.astype(u32), 'and': cnt == tot, 'or': cnt > 0}[rop][blk]
                d(self, r, lanes)
            k = int(np.count_nonzero(lanes))
            self.wait[lanes] = -1
            self.run[lanes] = True
            self.nrun += k
            self.nwait -= k
            arr[done] = 0
            exp[done] = 0
            total += k
        return total


def execute(S, code):
    """Run one batch to completion (min-PC scheduling, see the module docstring)."""
    N = S.N
    pcs = np.zeros(N, np.int64)
    m, pc, cnt, lim, spins = None, 0, N, BIG, 0
    while True:
        if cnt == 0 or pc >= lim:                  # regroup at the lowest PC
            S.deadline.check()
            if cnt:
                if m is None:
                    pcs[:] = pc
                else:
                    pcs[m] = pc
            spins, S.snap = 0, None
            if S.nrun == 0:
                if S.nwait and S.release() or S.nsusp and S.resume() is None:
                    cnt = 0
                    continue
                if S.nwait:
                    raise err(CUresult.CUDA_ERROR_LAUNCH_FAILED,
                              f"kernel '{S.kname}': deadlock, {S.nwait} threads wait at a barrier that cannot complete")
                return
            pm = np.where(S.run, pcs, BIG)
            pc = int(pm.min())
            m = pm == pc
            cnt = int(np.count_nonzero(m))
            if cnt == S.nrun:
                lim = BIG
                if cnt == N:
                    m = None
            else:
                lim = int(np.where(m, BIG, pm).min())
        kind, a, b, g, line = code[pc]
        S.clock += 1
        if kind == OP:
            a(S, m)
            pc += 1
            continue
        if kind == BRA:
            if g is not None:
                p = g(S)
                if np.ndim(p) == 0:
                    if not p:
                        pc += 1
                        continue
                else:
                    t = p if m is None else p & m
                    tc = int(np.count_nonzero(t))
                    if tc == 0:
                        pc += 1
                        continue
                    if tc < cnt:                    # divergence: park both sides, regroup
                        pcs[t] = a
                        pcs[~p if m is None else m & ~p] = pc + 1
                        cnt = 0
                        continue
            if a <= pc:                             # a loop: it may never end
                S.deadline.check()
                if lim != BIG:                      # looping while other lanes wait: a spin on them?
                    spins += 1
                    if (spins < 4 or spins % SPIN_EVERY == 0) and S.stuck(a, pc, m):
                        if m is None:
                            pcs[:] = a
                        else:
                            pcs[m] = a
                        S.suspend(m)                # yield to the parked lanes (legal under Volta+ scheduling)
                        cnt = 0
                        continue
            pc = a
            continue
        if g is not None:                           # guarded control instruction: split off the lanes it skips
            p = g(S)
            if np.ndim(p) == 0:
                if not p:
                    pc += 1
                    continue
            else:
                y = p if m is None else p & m
                yc = int(np.count_nonzero(y))
                if yc == 0:
                    pc += 1
                    continue
                if yc < cnt:
                    pcs[~p if m is None else m & ~p] = pc + 1
                    m, cnt, lim = y, yc, min(lim, pc + 1)
        if kind == BAR:
            gid, gcount, wait, red = a
            if wait and red is None and gcount is None and S.nwait == 0 and S.nsusp == 0 and lim == BIG:
                pc += 1                             # every live thread is here: nothing to wait for
                continue
            li = S.lanes(m)
            bid = int(np.broadcast_to(gid(S), (N,))[li[0]])
            count = None if gcount is None else int(np.broadcast_to(gcount(S), (N,))[li[0]])
            if wait:
                if m is None:
                    pcs[:] = pc + 1
                else:
                    pcs[m] = pc + 1
                S.arrive(m, bid, count, True, red)
                cnt = 0
            else:
                S.arrive(m, bid, count, False, None)
                pc += 1
            S.release()
        elif kind == EXIT or kind == RET:
            d = S.dep if m is None else S.dep[m]
            if kind == RET and d.any():
                li = S.lanes(m)
                dl = S.dep[li]
                up = dl > 0
                ra = S.rstack[np.maximum(dl - 1, 0), li]
                S.dep[li[up]] -= 1
                if up.all() and (ra == ra[0]).all():
                    pc = int(ra[0])
                    continue
                pcs[li[up]] = ra[up]
                lane_exit = li[~up]
            else:
                lane_exit = S.lanes(m)
            if len(lane_exit):
                S.alive[lane_exit] = False
                S.run[lane_exit] = False
                S.nrun -= len(lane_exit)
                if S.nwait:
                    S.release()
            cnt = 0
        elif kind == CALL:
            target, copyin = a
            copyin(S, m)
            if S.rstack is None:
                S.rstack = np.zeros((MAX_DEPTH, N), np.int32)
            li = S.lanes(m)
            d = S.dep[li]
            if d.max() >= MAX_DEPTH - 1:
                raise err(CUresult.CUDA_ERROR_HARDWARE_STACK_ERROR, f"kernel '{S.kname}': call stack overflow")
            S.rstack[d, li] = pc + 1
            S.dep[li] = d + 1
            pc = target
        elif kind == BRX:
            S.deadline.check()
            gi, targets = a
            idx = np.broadcast_to(np.asarray(gi(S)).astype(np.int64), (N,))
            li = S.lanes(m)
            ti = idx[li]
            if (ti >= len(targets)).any():
                raise err(CUresult.CUDA_ERROR_ILLEGAL_INSTRUCTION, f"kernel '{S.kname}': brx.idx out of range")
            tg = targets[ti]
            if (tg == tg[0]).all():
                pc = int(tg[0])
            else:
                pcs[li] = tg
                cnt = 0
        elif kind == TRAP:
            if a == 'trap':
                raise err(TRAP_STATUS, f"kernel '{S.kname}': trap at line {line}")
            raise err(CUresult.CUDA_ERROR_NOT_SUPPORTED, f"kernel '{S.kname}': unsupported instruction at line {line}")


# ---------------------------------------------------------------- module and kernels
class Global:
    """A module-scope .global/.const variable: the backend allocates it, writes its data, then bind_global()s it.

    data: the bytes its initialiser gives, from its start (the rest is zeros), so that a big
    global costs nothing before the backend has found room for it."""

    def __init__(self, size, align, data, space):
        self.size, self.align, self.data, self.space = size, align, data, space

    @property
    def init(self):
        """All its size bytes, zeros after the initialiser's."""
        return self.data + bytes(self.size - len(self.data))

    def __repr__(self):
        return f"Global(size={self.size}, align={self.align}, space={self.space!r})"


def _layout(vars_, start=0):
    off, out = start, {}
    for v in vars_:
        a = max(v.align, 1)
        off = -(-off // a) * a
        out[v.name] = off
        off += v.size
    return out, off


class Kernel:
    """An .entry: `params` is [(offset, size)] as cuFuncGetParamInfo gives it; link() prepares it to run."""

    def __init__(self, mod, fn):
        self.mod, self.fn, self.name = mod, fn, fn.name
        lay, _ = _layout(fn.params)
        self.param_names = [p.name for p in fn.params]
        self.params = [(lay[p.name], p.size) for p in fn.params]
        self.param_size = (self.params[-1][0] + self.params[-1][1]) if self.params else 0
        self.maxntid = fn.attrs.get('maxntid')
        self.reqntid = fn.attrs.get('reqntid')
        self.max_dynamic_shared = MAX_SHARED        # raised by the backend's cuFuncSetAttribute, up to the opt-in limit
        self._linked = None

    @property
    def shared_size(self):
        """Static shared memory per block (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)."""
        self.link()
        return self.shared_static

    def link(self):
        """Concatenate the kernel and every function it may call; resolve labels, calls, memory layout."""
        if self._linked:
            return self._linked
        mod, order, errors, state = self.mod, [self.name], [], {}

        def visit(n):                       # DFS; a call back into the current path is recursion
            state[n] = 1
            for c in sorted(mod.decoded[n][3]):
                if state.get(c) == 1:
                    errors.append(f"recursive call to '{c}' is not supported")
                elif c not in state:
                    order.append(c)
                    visit(c)
            state[n] = 2
        visit(self.name)
        if mod.tree.address_size != 64:
            errors.append(f".address_size {mod.tree.address_size} is not supported (64-bit addresses only)")
        starts, n = {}, 0
        for name in order:
            starts[name], n = n, n + len(mod.decoded[name][0])
        out, self.regsets, self._loops = [], [], {}
        for name in order:
            fcode, labels, ferrs, _, _, regsets = mod.decoded[name]
            self.regsets += regsets
            errors += ferrs
            base = starts[name]
            for kind, a, b, g, line in fcode:
                if kind == BRA:
                    if a not in labels:
                        errors.append(f"branch to unknown label '{a}' at line {line}")
                        a = 0
                    else:
                        a = base + labels[a]
                elif kind == BRX:
                    gi, labs = a
                    if any(x not in labels for x in labs):
                        errors.append(f"brx.idx to an unknown label at line {line}")
                        labs = []
                    a = (gi, np.array([base + labels[x] for x in labs], np.int64))
                elif kind == CALL:
                    a = (starts[a[0]], a[1])
                out.append((kind, a, b, g, line))
        # memory layout: module-scope shared used by these functions, then function-scope shared; dynamic last
        tree = mod.tree
        used = set().union(*(mod.decoded[n][4] for n in order))
        shared = [v for n, v in tree.vars.items() if v.space == 'shared' and n in used and not (v.extern or v.size == 0)]
        shared += [v.__class__(**{**v.__dict__, 'name': n + '|' + v.name}) for n in order
                   for v in tree.funcs[n].vars if v.space == 'shared']
        sh, size = _layout(shared)
        dyn = [n for n, v in tree.vars.items() if v.space == 'shared' and n in used and (v.extern or v.size == 0)]
        dyn_align = max([16] + [tree.vars[n].align for n in dyn])
        dyn_off = -(-size // dyn_align) * dyn_align
        sh.update({n: dyn_off for n in dyn})
        self.shared_static = dyn_off if dyn else size
        local = [v.__class__(**{**v.__dict__, 'name': n + '|' + v.name}) for n in order
                 for v in tree.funcs[n].vars if v.space == 'local']
        local += [v for n, v in tree.vars.items() if v.space == 'local' and n in used]
        lo, lsize = _layout(local)
        self.local_size = -(-lsize // 16) * 16
        if self.local_size > P.MAX_ARRAY_BYTES['local']:        # each function's fit; all of them together may not
            errors.append(f"its functions declare {self.local_size} bytes of local memory a thread, more than the cap "
                          f"of {P.MAX_ARRAY_BYTES['local']} (MAX_ARRAY_BYTES['local'])")
        syms = dict(sh)
        syms.update(lo)
        syms.update({self.name + '|' + p: off for p, (off, _) in zip(self.param_names, self.params)})
        self.static_symbols = syms
        self.used_globals = sorted(n for n in used if tree.vars[n].space in ('global', 'const'))
        dtypes, psizes = {}, {}
        for n in order:
            f = tree.funcs[n]
            dtypes.update({n + '|' + r: DT.get(t, np.dtype(u32)) for r, t in f.regs.items()})
            psizes.update({n + '|' + v.name: v.size for v in f.vars if v.space == 'param'})
            if not f.entry:
                psizes.update({n + '|' + v.name: v.size for v in f.params + f.rets})
        dtypes['%cc'] = np.dtype(u32)
        self.reg_dtypes, self.pbuf_sizes = dtypes, psizes
        self.lane_bytes = sum(d.itemsize for d in dtypes.values()) + sum(psizes.values()) + self.local_size + 64
        self.errors = errors
        self._linked = out
        return out

    def loop_regs(self, lo, hi):
        """Registers the instructions lo..hi touch (a loop body, for spin detection)."""
        if (lo, hi) not in self._loops:
            self._loops[lo, hi] = sorted(frozenset().union(*self.regsets[lo:hi + 1]))
        return self._loops[lo, hi]

    def check_launch(self, grid, block, dyn, params):
        bad = CUresult.CUDA_ERROR_INVALID_VALUE
        if len(grid) != 3 or len(block) != 3 or min(grid) < 1 or min(block) < 1:
            raise err(bad, f"kernel '{self.name}': grid {tuple(grid)} / block {tuple(block)} must be positive")
        if grid[0] > 2 ** 31 - 1 or grid[1] > 65535 or grid[2] > 65535:
            raise err(bad, f"kernel '{self.name}': grid {tuple(grid)} exceeds (2^31-1, 65535, 65535)")
        nt = block[0] * block[1] * block[2]
        if block[0] > 1024 or block[1] > 1024 or block[2] > 64 or nt > 1024:
            raise err(bad, f"kernel '{self.name}': block {tuple(block)} has more than 1024 threads or a bad shape")
        if self.maxntid and nt > int(np.prod(self.maxntid)):
            raise err(LAUNCH_BOUNDS_STATUS, f"kernel '{self.name}': {nt} threads exceed .maxntid {self.maxntid}")
        if self.reqntid and list(block[:len(self.reqntid)]) != list(self.reqntid):
            raise err(LAUNCH_BOUNDS_STATUS, f"kernel '{self.name}': block {tuple(block)} differs from .reqntid {self.reqntid}")
        if dyn < 0 or dyn > min(self.max_dynamic_shared, MAX_SHARED_OPTIN) or \
                self.shared_static + dyn > max(MAX_SHARED, min(self.max_dynamic_shared, MAX_SHARED_OPTIN)):
            raise err(bad, f"kernel '{self.name}': {self.shared_static} + {dyn} bytes of shared memory exceed the limit")
        if len(params) < self.param_size:
            raise err(bad, f"kernel '{self.name}': parameter buffer has {len(params)} bytes, needs {self.param_size}")


class PtxModule:
    """A parsed module: kernels, globals to bind, and launch()."""

    def __init__(self, tree):
        self.tree = tree
        self.globals = {n: Global(v.size, v.align, v.init or b"", v.space)
                        for n, v in tree.vars.items() if v.space in ('global', 'const') and not v.extern}
        self.addrs = {}
        self._patched = set()
        self.decoded = {}
        for name, fn in tree.funcs.items():
            if fn.body is not None:
                D = Decoder(self, fn)
                code, labels, errors, regsets = D.decode()
                self.decoded[name] = (code, labels, errors, D.callees, D.msyms, regsets)
        self.kernels = {n: Kernel(self, f) for n, f in tree.funcs.items() if f.entry and f.body is not None}

    def bind_global(self, name, addr):
        if name not in self.globals:
            raise err(CUresult.CUDA_ERROR_NOT_FOUND, f"no global '{name}' in this module")
        self.addrs[name] = int(addr)

    def relocate(self, mem):
        """Write pointer initialisers (`.u64 p = sym`) once their targets are bound."""
        for name, v in self.tree.vars.items():
            if not v.relocs or name not in self.addrs or (name, self.addrs[name]) in self._patched:
                continue
            for off, target, addend, width in v.relocs:
                if target not in self.addrs:
                    raise err(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                              f"initialiser of '{name}' takes the address of '{target}', which is not a bound global")
                val = (self.addrs[target] + addend) & ((1 << 8 * width) - 1)
                mem.view(self.addrs[name] + off, width)[:] = np.frombuffer(val.to_bytes(width, 'little'), u8)
            self._patched.add((name, self.addrs[name]))

    def launch(self, name, mem, grid, block, shared_bytes, params, printf, timeout=0, cooperative=False):
        """Run the whole grid on EmuMemory `mem`; device printf text goes to printf(str), thread by thread.

        A launch running longer than timeout seconds (0: no limit) fails with CUDA_ERROR_LAUNCH_TIMEOUT.
        A cooperative launch runs every block at once, and gives the kernel (in %envreg1:%envreg2, as
        the driver does) the word cooperative groups' grid.sync() counts arrivals in; a plain launch
        gives it none, and grid.sync() traps there as on a GPU."""
        deadline = Deadline(name, timeout)
        K = self.kernels.get(name)
        if K is None:
            raise err(CUresult.CUDA_ERROR_NOT_FOUND, f"no kernel '{name}' in this module")
        grid, block = tuple(int(x) for x in grid), tuple(int(x) for x in block)
        code = K.link()
        if K.errors:
            raise err(CUresult.CUDA_ERROR_NOT_SUPPORTED, f"kernel '{name}': {K.errors[0]}")
        K.check_launch(grid, block, shared_bytes, params)
        missing = [g for g in K.used_globals if g not in self.addrs]
        if missing:
            raise err(CUresult.CUDA_ERROR_NOT_INITIALIZED, f"kernel '{name}': global '{missing[0]}' is not bound")
        self.relocate(mem)
        symbols = {**K.static_symbols, **self.addrs}
        params = bytes(params) + bytes(-len(params) % 8)
        nt = block[0] * block[1] * block[2]
        nblocks = grid[0] * grid[1] * grid[2]
        per_block = nt * K.lane_bytes + K.shared_static + shared_bytes
        nb = max(1, min(nblocks, LANES // nt, BATCH_BYTES // per_block))      # blocks run together
        envreg = {}
        if cooperative:
            nb = nblocks
            ws = grid_workspace(mem)
            envreg = {1: ws >> 32, 2: ws & 0xFFFFFFFF}
        if settings.emu_compiler():
            from phos.gpu_server.backends.ptx import compiler
            native = compiler.compiled(K)
            lib = native.library(block, K.shared_static + shared_bytes)
            if lib is not None:
                compiler.launch(native, lib, K, mem, symbols, grid, block, shared_bytes, params, printf, nb,
                                deadline, envreg, cooperative)
                return
        with np.errstate(all='ignore'):
            for b0 in range(0, nblocks, nb):
                deadline.check()
                S = State(K, symbols, mem, params, printf, grid, block, shared_bytes, b0, min(nb, nblocks - b0),
                          deadline)
                S.envreg = envreg
                try:
                    execute(S, code)
                finally:
                    _clock[0] = S.clock


_workspaces = weakref.WeakKeyDictionary()


def grid_workspace(mem):
    """Device address of the 8 bytes grid.sync() of a cooperative launch on mem counts in, zeroed
    (one an EmuMemory: its launches run one at a time)."""
    ws = _workspaces.get(mem)
    if ws is None:
        ws = _workspaces[mem] = mem.alloc(8)
    mem.view(ws, 8)[:] = 0
    return int(ws)


def parse_module(text, deadline=math.inf):
    """PTX text -> PtxModule; raises CUDA_ERROR_INVALID_PTX on a syntax error, or past deadline
    (a time.monotonic())."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode('utf-8', 'replace')
    with P.gc_paused():
        return PtxModule(P.parse(text.rstrip('\0'), deadline))
