"""Where a compiled kernel's threads save and restore their registers, and the regions between sync points.

A thread leaves its C code at a sync point (bar.sync, a warp collective, the lockstep of volatile
accesses, a yield) and comes back at the point's resume label (cgen.py). Its registers wait in its
save slots meanwhile. Saving every live register at every sync point and restoring them all
costs more than the code between two barriers does, so each register has a home slot of its own
and:

  a sync point saves the live registers that may have been written since the thread last came
  back (`save`): the others already hold their value in their slot;
  a resume restores the registers the thread may read, or may save again unwritten, before its
  next sync point (`restore`): a register saved later must hold its value, not garbage.

At the kernel's start every register counts as written (its slot holds nothing yet).

A region is what a thread may run from a resume point (or the kernel's start) to its next hard
sync point (a barrier, a warp collective, a lockstep access): crt.py's scheduler runs a region
for every thread waiting at it in one C loop, instead of one call a thread. Yields (a loop that
spins, an mbarrier wait, a jump table in a loop) are soft: a region runs on through them, and a
thread that does yield comes back through the thread function, which holds every resume point.

Registers are bits of Python ints here: kernels have thousands of statements and registers.
"""
from dataclasses import dataclass, field

# how a statement's sync point sits in it (cgen.py's emitters say which)
AFTER = 'after'     # bar.sync, warp collectives: sources read, the thread leaves, destinations written on return
BEFORE = 'before'   # a lockstep access: the thread leaves first, then makes the access on return
RETRY = 'retry'     # mbarrier wait, jump-table yield: returns to the start of the statement, which checks again
LOOP = 'loop'       # a backward branch's yield: returns to the branch target
HARD = (AFTER, BEFORE)


@dataclass
class Flow:
    """One statement as the analysis sees it. Registers are bit masks (cgen numbers them)."""
    reads: int
    writes: int                 # every destination, guarded or not
    kills: int                  # destinations surely written (an unguarded statement's)
    succ: list                  # statements it may go on to
    guarded: bool
    sync: tuple | None = None   # (rid, mode, resume statement) of its sync point
    jump: int | None = None     # the statement a branch goes to


@dataclass
class Plan:
    keep: dict = field(default_factory=dict)      # rid -> registers live at its sync point
    save: dict = field(default_factory=dict)      # rid -> registers its sync point saves
    restore: dict = field(default_factory=dict)   # rid -> registers its resume restores
    jump_save: dict = field(default_factory=dict)  # branch statement -> registers it saves leaving at its target's sync point
    entry_save: dict = field(default_factory=dict)  # (statement, loop head after it) -> registers saved on the way in
    slot: dict = field(default_factory=dict)      # register bit -> its home slot
    nslots: int = 0
    regions: dict = field(default_factory=dict)   # rid (0: the kernel's start) -> its statements, sorted


class Graph:
    """Statements split at their sync point: node 3k is statement k's entry (A), 3k+1 its sync
    point (S), 3k+2 what follows its return (B). A plain statement is its node 3k alone.

    A branch to a statement that leaves at a hard sync point (unguarded: a barrier at a loop's
    head) leaves there itself, through a copy of that statement's entry and sync point (nodes
    from 3n on): the registers a loop's body wrote are all it saves, not those the way into the
    loop wrote too."""

    def __init__(self, flows):
        n = len(flows)
        self.n = 3 * n
        self.jump_sync = {}                     # branch statement -> its copy of the target's sync node
        copies = [j for j, f in enumerate(flows) if f.jump is not None and f.jump != j + 1 and
                  flows[f.jump].sync is not None and flows[f.jump].sync[1] in HARD and not flows[f.jump].guarded]
        base = self.n + 3                       # (3n: past the last statement, the kernel's end)
        entries = self.loop_entries(flows)
        self.n = base + 2 * len(copies) + len(entries)
        self.reads, self.writes, self.kills = [0] * self.n, [0] * self.n, [0] * self.n
        self.succ = [[] for _ in range(self.n)]
        self.resume_to = {}                     # sync node -> the node its thread returns to
        self.rid_of = {}                        # sync node -> rid
        self.soft = set()                       # sync nodes of yields

        def entry(j):
            return 3 * j

        for k, f in enumerate(flows):
            a, s, b = 3 * k, 3 * k + 1, 3 * k + 2
            nxt = [entry(j) for j in f.succ]
            bypass = [entry(k + 1)] if f.guarded and k + 1 < n else []
            if f.sync is None:
                self.reads[a], self.writes[a], self.kills[a] = f.reads, f.writes, f.kills
                self.succ[a] = nxt
                continue
            rid, mode, resume = f.sync
            self.rid_of[s] = rid
            if mode == AFTER:
                self.reads[a] = f.reads
                self.succ[a] = [s] + bypass
                self.resume_to[s] = b
                self.writes[b] = self.kills[b] = f.writes
                self.succ[b] = nxt
            elif mode == BEFORE:
                self.reads[a] = f.reads
                self.succ[a] = [s] + bypass
                self.resume_to[s] = b
                self.reads[b], self.writes[b], self.kills[b] = f.reads, f.writes, f.writes
                self.succ[b] = nxt
            elif mode == RETRY:
                self.reads[a] = f.reads
                self.succ[a] = [s, b] + bypass
                self.resume_to[s] = a
                self.soft.add(s)
                self.reads[b], self.writes[b], self.kills[b] = f.reads, f.writes, f.writes
                self.succ[b] = nxt
            elif mode == LOOP:
                self.reads[a], self.writes[a] = f.reads, f.writes
                self.succ[a] = [s, b] + bypass
                self.resume_to[s] = entry(resume)
                self.soft.add(s)
                self.succ[b] = [entry(resume)]
            else:
                raise ValueError(mode)
        for i, j in enumerate(copies):
            k = flows[j].jump
            a, s = base + 2 * i, base + 2 * i + 1
            self.reads[a] = self.reads[3 * k]
            self.succ[a] = [s]
            self.resume_to[s], self.rid_of[s] = self.resume_to[3 * k + 1], self.rid_of[3 * k + 1]
            self.jump_sync[j] = s
            for u in (3 * j, 3 * j + 2):             # the branch's own node, or its B past a yield
                self.succ[u] = [a if v == 3 * k else v for v in self.succ[u]]
        self.owner = {base + 2 * i + d: j for i, j in enumerate(copies) for d in (0, 1)}   # copies' code: at the branch
        self.entry_node = {}                    # (statement, loop head) -> its save node on that edge
        for i, (w, v) in enumerate(entries):
            e = base + 2 * len(copies) + i
            self.succ[e] = [3 * v]
            for u in (3 * w, 3 * w + 2):
                self.succ[u] = [e if x == 3 * v else x for x in self.succ[u]]
            self.entry_node[w, v] = e
            self.owner[e] = w
        self.succ = [[x for x in s if x < 3 * n or x in self.owner] for s in self.succ]
        self.preds = [[] for _ in range(self.n)]
        for u, ss in enumerate(self.succ):
            for v in ss:
                self.preds[v].append(u)

    @staticmethod
    def loop_entries(flows):
        """(w, v): the edges from a statement w into the head v of a loop (a branch back to v) that
        holds a hard sync point, by falling through or by a branch: there the registers written
        before the loop are saved once (plan()), not at each of its iterations' sync points. Not
        into a head that is itself a sync statement (a branch there leaves there: Graph's copies)."""
        back = {}                               # loop head -> its last statement
        for u, f in enumerate(flows):
            for v in f.succ:
                if v <= u:
                    back[v] = max(back.get(v, v), u)
        out = []
        for v, last in sorted(back.items()):
            if flows[v].sync is not None or not any(flows[k].sync and flows[k].sync[1] in HARD
                                                     for k in range(v, last + 1)):
                continue
            for w in range(v):
                f = flows[w]
                if f.jump == v or w == v - 1 and v in f.succ and f.sync is None:
                    out.append((w, v))
        return out

    def statement(self, u):
        """The statement whose code holds node u."""
        return self.owner[u] if u in self.owner else u // 3

    def dirty(self, all_regs, clear):
        """Registers possibly written since the thread last came back, into each node: all of them at
        the kernel's start, none where it comes back; a node's `clear` ones saved there."""
        dirty = [0] * self.n
        seen = [False] * self.n
        dirty[0] = all_regs
        work = [0] + sorted(set(self.resume_to.values()))
        for u in work:
            seen[u] = True
        while work:
            u = work.pop()
            out = (dirty[u] & ~clear[u]) | self.writes[u]
            for v in self.succ[u]:
                if not seen[v] or out & ~dirty[v]:
                    dirty[v] |= out
                    seen[v] = True
                    work.append(v)
        return dirty

    def backward(self, uses, through_syncs):
        """Least fixpoint of in(u) = uses(u) | (out(u) & ~kills(u)), out(u) = OR of in(successors):
        through_syncs, a sync point's successor is where its thread returns (liveness); else it has
        none (what a thread runs before it leaves)."""
        succ, preds = self.succ, self.preds
        if through_syncs:
            succ = [([self.resume_to[u]] if u in self.resume_to else s) for u, s in enumerate(succ)]
            preds = [list(p) for p in preds]
            for s, r in self.resume_to.items():
                preds[r].append(s)
        live = [0] * self.n
        work = list(range(self.n))
        on = [True] * self.n
        while work:
            u = work.pop()
            on[u] = False
            out = 0
            for v in succ[u]:
                out |= live[v]
            new = uses[u] | (out & ~self.kills[u])
            if new != live[u]:
                live[u] = new
                for q in preds[u]:
                    if not on[q]:
                        on[q] = True
                        work.append(q)
        return live


def plan(flows, all_regs):
    """The Plan of a kernel's statements (flows); all_regs: the mask of every register."""
    g = Graph(flows)
    live = g.backward(g.reads, through_syncs=True)
    p = Plan()
    copied = set(g.jump_sync.values())
    syncs = sorted((s for s in g.rid_of if s not in copied), key=g.rid_of.get)
    for s in syncs:
        p.keep[g.rid_of[s]] = live[g.resume_to[s]]

    # dirty: registers possibly written since the thread last came back (all of them at the start);
    # a loop's way in saves what is dirty there and live, once (the second pass knows it clean after)
    clear = [0] * g.n
    dirty = g.dirty(all_regs, clear)
    for (w, v), e in g.entry_node.items():
        p.entry_save[w, v] = clear[e] = dirty[e] & live[3 * v]
    dirty = g.dirty(all_regs, clear)
    uses = list(g.reads)
    for e in g.entry_node.values():
        uses[e] = clear[e]
    for s in syncs:
        rid = g.rid_of[s]
        p.save[rid] = p.keep[rid] & dirty[s]
        uses[s] = p.save[rid]
    for j, s in g.jump_sync.items():
        p.jump_save[j] = p.keep[g.rid_of[s]] & dirty[s]
        uses[s] = p.jump_save[j]
    needed = g.backward(uses, through_syncs=False)
    for s in syncs:
        rid = g.rid_of[s]
        p.restore[rid] = needed[g.resume_to[s]] & p.keep[rid]

    # home slots: registers live together at a sync point take different slots
    occupied = []                            # slot -> mask of the sync points it is taken at
    at = {}                                  # register bit -> mask of the sync points it lives at
    together = [p.keep[g.rid_of[s]] for s in syncs] + [live[3 * v] for (w, v) in g.entry_node]
    for i, m in enumerate(together):
        while m:
            low = m & -m
            at[low] = at.get(low, 0) | (1 << i)
            m ^= low
    for bit in sorted(at, key=lambda b: -bin(at[b]).count('1')):
        for k, occ in enumerate(occupied):
            if not occ & at[bit]:
                occupied[k] |= at[bit]
                p.slot[bit] = k
                break
        else:
            p.slot[bit] = len(occupied)
            occupied.append(at[bit])
    p.nslots = len(occupied)

    # regions: from the start and from each hard sync point's return, up to the next hard sync points
    starts = {0: 0}
    starts.update({g.rid_of[s]: g.resume_to[s] for s in syncs if s not in g.soft})
    for rid, u0 in starts.items():
        seen_nodes, work = {u0}, [u0]
        while work:
            u = work.pop()
            for v in g.succ[u]:
                if v not in seen_nodes:
                    seen_nodes.add(v)
                    work.append(v)
        p.regions[rid] = sorted({g.statement(u) for u in seen_nodes})
    return p
