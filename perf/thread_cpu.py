"""Which threads of which processes a run keeps busy: CPU seconds per thread, from /proc, for
every process whose command line matches, sampled until this is stopped (SIGINT or SIGTERM)
or --seconds pass. It sees what a Python profiler cannot: ZeroMQ's I/O threads (encryption),
the driver's threads, and whether one thread (an event loop holding the interpreter's lock)
is the one at 100%.

    python3 perf/thread_cpu.py --match 'phos|bench' --out cpu.txt &  ...run...; kill -INT $!

Per process: its threads by CPU seconds, each with its busiest interval's share of a core.
"""
import argparse
import os
import re
import signal
import time

TICK = os.sysconf("SC_CLK_TCK")


def thread_times(match):
    """{(pid, tid): (process's command line, thread's name, cpu seconds)} of matching processes."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if int(pid) == os.getpid() or not match.search(cmd):
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                out[pid, tid] = (cmd, name, (int(fields[11]) + int(fields[12])) / TICK)
        except (OSError, ValueError):
            continue               # gone meanwhile
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--match", default="phos|bench", help="regular expression on the command line")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--seconds", type=float, default=3600)
    ap.add_argument("--min", type=float, default=0.05, help="leave out threads with fewer CPU seconds")
    ap.add_argument("--out", help="write the table here (else stdout)")
    ap.add_argument("--series", help="also write each interval's busy threads here: seconds, pid, thread, share of a core")
    args = ap.parse_args()
    match = re.compile(args.match)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    first, last, busiest = {}, {}, {}
    t0 = prev_t = time.monotonic()
    series = open(args.series, "w") if args.series else None
    if series:
        series.write(f"# seconds after {time.time():.3f} (wall clock)\n")
    while not stop and time.monotonic() - t0 < args.seconds:
        now, t = thread_times(match), time.monotonic()
        for key, (cmd, name, cpu) in now.items():
            first.setdefault(key, (cmd, name, cpu))
            if key in last and t > prev_t:
                share = (cpu - last[key][2]) / (t - prev_t)
                busiest[key] = max(busiest.get(key, 0.0), share)
                if series and share >= 0.05:
                    series.write(f"{t - t0:.2f} {key[0]} {name}[{key[1]}] {100 * share:.0f}%\n")
            last[key] = (cmd, name, cpu)
        prev_t = t
        time.sleep(args.interval)
    if series:
        series.close()
    lines = [f"{time.monotonic() - t0:.1f} s sampled every {args.interval} s"]
    by_pid = {}
    for key, (cmd, name, cpu) in last.items():
        by_pid.setdefault(key[0], []).append((cpu - first[key][2], busiest.get(key, 0.0), name, key[1], cmd))
    for pid, threads in sorted(by_pid.items(), key=lambda kv: -sum(t[0] for t in kv[1])):
        total = sum(t[0] for t in threads)
        if total < args.min:
            continue
        lines.append(f"\npid {pid}: {total:.2f} CPU s  {threads[0][4][:150]}")
        for cpu, peak, name, tid, _ in sorted(threads, reverse=True):
            if cpu >= args.min:
                lines.append(f"  {cpu:7.2f} s  peak {100 * peak:4.0f}%  {name}{' (main)' if tid == pid else ''} [{tid}]")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
