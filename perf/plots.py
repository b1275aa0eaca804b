"""PNG plots of the benchmarks' JSON: the figures of perf/RESULTS.md's tables, drawn.

    python3 perf/plots.py --snapshot bench_snapshot.json --handoff bench_handoff.json \\
        --copies bench_stub.json [--out perf/plots]

`bash perf/device/run.sh plots` runs it on the device run's JSON in $OUT. Every input is
optional; one not given, missing or without the fields a plot needs is skipped with a message.
Writes into --out:

  checkpoint_restore.png  checkpoint and restore seconds against context size: phos and the
                          driver's cuCheckpointProcess* (perf/bench_snapshot.py --json)
  checkpoint_rate.png     the application's kernels per second through a checkpoint, one kernel
                          a sync and GPU_BOUND a sync (bench_snapshot's rate_timeline)
  handoff_rate.png        the application's syncs per second through a live handoff
                          (perf/bench_handoff.py --json, its rate_timeline)
  copy_bandwidth.png      cudaMemcpy GB/s against size, native and phos, H2D and D2H, pinned
                          and pageable (perf/bench_stub.sh --json)

Points are the median of a size's runs, bars their least and most (perf/spread.py).

Needs matplotlib (`pip install matplotlib`): a need of these plots alone, so it is not among
phos's dependencies in pyproject.toml.
"""
import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from spread import spread  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def load(path, flag):
    """The JSON at `path`, or None with a message saying why not."""
    if not path:
        print(f"plots: no {flag}: its plots skipped")
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"plots: {flag} {path}: {e}: its plots skipped")
        return None


def pyplot():
    import matplotlib
    matplotlib.use("Agg")       # files only: the device machine has no display
    import matplotlib.pyplot as plt
    return plt


def by_size(points):
    """[(x, value)] -> xs, medians and the error bars' lower and upper lengths, values None left out."""
    groups = {}
    for x, v in points:
        if v is not None:
            groups.setdefault(x, []).append(v)
    xs = sorted(groups)
    s = [spread(groups[x]) for x in xs]
    return xs, [m for _, m, _ in s], [[m - lo for lo, m, _ in s], [hi - m for _, m, hi in s]]


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    print(f"plots: wrote {path}")


def checkpoint_restore(rows, out):
    """(a) seconds against context size, log-log: the driver is some 30× slower than phos."""
    def driver(key):
        return lambda r: (r.get("driver") or {}).get(key)

    def phos(key):
        return lambda r: r["phos"].get(key)
    series = [("phos checkpoint to host memory", phos("checkpoint_host_s"), "tab:blue", "-"),
              ("phos full restore from host memory", phos("restore_host_full_s"), "tab:blue", "--"),
              ("phos checkpoint to disk", phos("checkpoint_disk_s"), "tab:cyan", "-"),
              ("phos full restore from disk", phos("restore_disk_full_s"), "tab:cyan", "--"),
              ("driver cuCheckpointProcess checkpoint", driver("checkpoint_s"), "tab:red", "-"),
              ("driver cuCheckpointProcess restore", driver("restore_s"), "tab:red", "--")]
    unit, scale = ("GiB", GiB) if max(r["bytes"] for r in rows) >= GiB else ("MiB", MiB)    # emu's runs are MiB
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, get, color, style in series:
        xs, med, err = by_size((r["bytes"] / scale, get(r)) for r in rows)
        if xs:
            ax.errorbar(xs, med, yerr=err, label=label, color=color, linestyle=style, marker="o", capsize=3)
    ax.set(xscale="log", yscale="log", xlabel=f"context size ({unit})", ylabel="seconds",
           title="Checkpoint and restore: phos and the driver")
    sizes = sorted({r["bytes"] / scale for r in rows})
    ax.set_xticks(sizes, [f"{x:g}" for x in sizes])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, out, "checkpoint_restore.png")


MIN_PER_BIN = 5     # syncs a plotted bin holds on average, at least: fewer draw noise, not a rate


def rate_curve(timeline):
    """Bin centres (ms) and rates (per second) of a benchmark's rate_timeline, its bins merged
    where a slow loop (emu's, or many kernels a sync) ends too few syncs in one."""
    counts, per_sync = timeline["counts"], timeline.get("per_sync", 1)
    k = max(1, math.ceil(MIN_PER_BIN * len(counts) / max(sum(counts), 1)))
    k = min(k, max(1, len(counts) // 10))       # but ten bins at least: a line, even where syncs are rare
    counts = [sum(counts[i:i + k]) for i in range(0, len(counts) - k + 1, k)]
    bin_ms = timeline["bin_ms"] * k
    xs = [timeline["start_ms"] + bin_ms * (i + 0.5) for i in range(len(counts))]
    return xs, [c * per_sync * 1e3 / bin_ms for c in counts]


def rate_panel(ax, runs, span, line, ylabel):
    """One line per run, a colour per size; `span` shaded from 0 to that mark, `line` dotted."""
    colors = {}
    for size, timeline in runs:
        first = size not in colors      # the legend names each size once, not each run
        color = colors.setdefault(size, COLORS[len(colors) % len(COLORS)])
        xs, rates = rate_curve(timeline)
        ax.plot(xs, rates, drawstyle="steps-mid", color=color, alpha=0.7, linewidth=1, label=size if first else None)
        marks = timeline.get("marks_ms", {})
        if span in marks:
            ax.axvspan(0, marks[span], color=color, alpha=0.08)
        if line in marks:
            ax.axvline(marks[line], color=color, linestyle=":", linewidth=1)
    ax.set(ylabel=ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, title="context size")


def checkpoint_rate(rows, out):
    """(b) the application's rate through a concurrent checkpoint, both of bench_snapshot's loops."""
    loops = [("one kernel a sync", [(r["size"], r["phos"]["rate_timeline"]) for r in rows if "rate_timeline" in r["phos"]]),
             ("throughput-bound loop", [(r["size"], r["phos"]["gpu_bound"]["rate_timeline"]) for r in rows
                                        if "rate_timeline" in r["phos"].get("gpu_bound", {})])]
    loops = [(name, runs) for name, runs in loops if runs]
    if not loops:
        print("plots: the snapshot JSON has no rate_timeline (a run before it was recorded): checkpoint_rate.png skipped")
        return
    plt = pyplot()
    fig, axes = plt.subplots(len(loops), 1, figsize=(8, 3.2 * len(loops)), squeeze=False)
    for ax, (name, runs) in zip(axes[:, 0], loops):
        rate_panel(ax, runs, "checkpoint_end", "cut", f"kernels/s ({name})")
    axes[0, 0].set_title("The application through a checkpoint (shaded: the checkpoint; dotted: its cut)")
    axes[-1, 0].set_xlabel("ms after the checkpoint began")
    save(fig, out, "checkpoint_rate.png")


def handoff_rate(rows, out):
    """(c) the application's rate through a live handoff: the freeze is the dip."""
    runs = [(f"{r['size']}", r["rate_timeline"]) for r in rows if "rate_timeline" in r]
    if not runs:
        print("plots: the handoff JSON has no rate_timeline (a run before it was recorded): handoff_rate.png skipped")
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    rate_panel(ax, runs, "answered", "frozen", "syncs/s (one write step a sync)")
    ax.set(title="The application through a live handoff (shaded: the call; dotted: the freeze)",
           xlabel="ms after the Handoff call")
    save(fig, out, "handoff_rate.png")


def size_label(nbytes):
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / 1024:g} KiB"


def copy_bandwidth(data, out):
    """(d) GB/s against size: a panel per memory kind and direction, native beside phos."""
    copies = data["copies"]
    if not copies:
        print("plots: the copies JSON holds no sweep (bench_stub run with --sweep-min-kib 0?): copy_bandwidth.png skipped")
        return
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), sharex=True, squeeze=False)
    for i, memory in enumerate(("pinned", "pageable")):
        for j, direction in enumerate(("h2d", "d2h")):
            ax = axes[i, j]
            for path, color in (("native", "tab:gray"), ("phos", "tab:blue")):
                mine = [c for c in copies if (c["path"], c["memory"], c["direction"]) == (path, memory, direction)]
                xs, med, err = by_size((c["bytes"], v) for c in mine for v in c["GBps"])
                if xs:
                    ax.errorbar(xs, med, yerr=err, label=path, color=color, marker="o", capsize=3)
            ax.set(title=f"{memory}, {direction.upper()}", ylabel="GB/s")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: size_label(v)))
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("copy size")
        ax.tick_params(axis="x", labelrotation=45)
    fig.suptitle(f"cudaMemcpy bandwidth, native and through phos ({data.get('runs', '?')} runs: median, least-most)")
    save(fig, out, "copy_bandwidth.png")


def attempt(name, plot, *args):
    """Draw one plot; a JSON without the fields it needs costs that plot alone, with a message."""
    try:
        plot(*args)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        print(f"plots: {name} skipped: the JSON lacks what it needs ({type(e).__name__}: {e})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snapshot", help="perf/bench_snapshot.py --json's file")
    ap.add_argument("--handoff", help="perf/bench_handoff.py --json's file")
    ap.add_argument("--copies", help="perf/bench_stub.sh --json's file")
    ap.add_argument("--out", default=os.path.join(HERE, "plots"))
    args = ap.parse_args()
    inputs = [load(args.snapshot, "--snapshot"), load(args.handoff, "--handoff"), load(args.copies, "--copies")]
    if not any(x is not None for x in inputs):
        print("plots: nothing to draw")
        return
    os.makedirs(args.out, exist_ok=True)
    snapshot, handoff, copies = inputs
    if snapshot is not None:
        attempt("checkpoint_restore.png", checkpoint_restore, snapshot, args.out)
        attempt("checkpoint_rate.png", checkpoint_rate, snapshot, args.out)
    if handoff is not None:
        attempt("handoff_rate.png", handoff_rate, handoff, args.out)
    if copies is not None:
        attempt("copy_bandwidth.png", copy_bandwidth, copies, args.out)


if __name__ == "__main__":
    main()
