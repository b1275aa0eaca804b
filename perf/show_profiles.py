"""Print what the worker spent a checkpoint's time on: the cProfile files that a worker run
with PHOS_PROFILE_DIR=DIR wrote, one per checkpoint, in the order they were taken.

    python perf/show_profiles.py DIR [--top 30] [--only N] [--callers REGEX]
"""
import argparse
import glob
import os
import pstats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--only", type=int, help="the Nth checkpoint alone")
    ap.add_argument("--callers", help="also who called the functions matching this regular expression")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.dir, "checkpoint-*.prof")), key=lambda f: int(f.rsplit("-", 1)[1][:-5]))
    for n, path in enumerate(files, 1):
        if args.only and n != args.only:
            continue
        print(f"\n=== checkpoint {n}: {os.path.basename(path)}")
        stats = pstats.Stats(path)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        if args.callers:
            stats.print_callers(args.callers)


if __name__ == "__main__":
    main()
