"""How steady this machine's speed is: the same fixed work timed over and over, by as many single-threaded
processes at once as the benchmarks run ranks (2 by default).

A prediction can only be checked to within the machine's own drift. ``bench/run.py`` compares a step time
measured now with op times profiled minutes earlier, and the rebalancer compares rounds seconds apart; on a
shared virtual machine the same work can take a different time from one minute to the next, which neither
the load average nor the steal counter shows. This prints, per process, the median and 5th-95th percentile of
one unit of work (200 products of 256 x 256 matrices) and the mean of each 10-second window relative to the
fastest window.

    python3 bench/drift.py                 # 2 processes, 150 s
    python3 bench/drift.py --seconds 60 --processes 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_WORK = """
import json, sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(256, 256), torch.randn(256, 256)
def unit():
    start = time.perf_counter()
    for _ in range(200):
        a @ b
    return time.perf_counter() - start
for _ in range(5):
    unit()
end, times = time.time() + float(sys.argv[1]), []
while time.time() < end:
    times.append(unit())
print(json.dumps(times))
"""


def windows(times: list[float], seconds: float = 10.0) -> list[float]:
    """Mean unit time of each consecutive window of about ``seconds`` of work."""
    out, current, spent = [], [], 0.0
    for t in times:
        current.append(t)
        spent += t
        if spent >= seconds:
            out.append(sum(current) / len(current))
            current, spent = [], 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    procs = [subprocess.Popen([sys.executable, "-c", _WORK, str(args.seconds)], stdout=subprocess.PIPE, text=True)
             for _ in range(args.processes)]
    load = os.getloadavg()[0]
    results = [json.loads(p.communicate()[0]) for p in procs]
    print(f"machine drift, {args.processes} process(es) x {args.seconds:g} s (one torch thread per process; load "
          f"average at start {load:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    for i, times in enumerate(results):
        ordered = sorted(times)
        n = len(ordered)
        win = windows(times)
        fastest = min(win)
        print(f"process {i}: {n} units, median {statistics.median(times) * 1e3:.1f} ms, 5th-95th percentile "
              f"{ordered[n // 20] * 1e3:.1f}-{ordered[-(n // 20) - 1] * 1e3:.1f} ms; 10-s windows relative to the "
              f"fastest: {', '.join(f'{w / fastest:.2f}' for w in win)} (slowest {max(win) / fastest:.2f}x)")


if __name__ == "__main__":
    main()
