"""How steady this machine's speed is, and what idling costs on it: the two properties of the host that a cost
model built from per-op timings does not see. Writes docs/bench-machine.md.

1. **Drift.** The same fixed work (200 products of 256 x 256 matrices) timed over and over by as many
   single-threaded processes at once as the benchmarks run ranks (2 by default): the median and 5th-95th
   percentile of one unit, and the mean of each 10-second window relative to the fastest window. A prediction
   can only be checked to within the machine's own drift; on a shared virtual machine the same work can take a
   different time from one minute to the next, which neither the load average nor the steal counter shows.
2. **Cold memory.** One pass over a stage-sized working set (6 weights of 1024 x 1024 floats, 24 MiB: a tanh
   layer chain, like a stage's forward) timed right after the process waited ``gap`` seconds, against the same
   pass right after another. On a host that reclaims or compresses idle guest memory, memory untouched for a
   while is slow to touch again, so a rank's compute depends on how long it idled before it: the waits of an
   unbalanced pipeline make the next passes slower (and so did ``--emulate-slowdown`` while it only slept).
   Three controls say where the time goes: the wait spent spinning instead of sleeping (the core stays busy,
   the memory still goes untouched), the same weights allocated as transparent huge pages
   (``THP_MEM_ALLOC_ENABLE``), and a read-only sweep of the weights (no arithmetic).

    python3 bench/drift.py                          # 2 processes x 150 s, then the cold-memory probe
    python3 bench/drift.py --seconds 60 --processes 1 --output /tmp/m.md
"""

from __future__ import annotations

import _paths  # noqa: F401  (repository first on sys.path)

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _paths import REPO

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

_COLD = """
import json, statistics, sys, time, torch
torch.set_num_threads(1)
gaps, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
weights = [torch.randn(1024, 1024) for _ in range(6)]
x = torch.randn(64, 1024)
def forward():
    y = x
    for w in weights:
        y = torch.tanh(y @ w)
def sweep():
    for w in weights:
        float(w.sum())
def wait(seconds, spin):
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
for _ in range(20):
    forward()
out = {}
for gap, spin, what in gaps:
    fn = sweep if what == "sweep" else forward
    first, again = [], []
    for _ in range(repeats):
        wait(gap, spin)
        first.append(timed(fn))
        again.append(timed(fn))
    out[f"{gap}|{spin}|{what}"] = [statistics.median(first), statistics.median(again)]
print(json.dumps(out))
"""

MIB = sum(4 * 1024 * 1024 for _ in range(6)) / 2 ** 20
"""The cold-memory probe's working set, MiB."""
GAPS = [0.0, 0.01, 0.05, 0.2, 1.0]


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


def drift(seconds: float, processes: int) -> list[str]:
    procs = [subprocess.Popen([sys.executable, "-c", _WORK, str(seconds)], stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    load = os.getloadavg()[0]
    results = [json.loads(p.communicate()[0]) for p in procs]
    lines = ["## 1. Drift", "",
             f"`python3 bench/drift.py --seconds {seconds:g} --processes {processes}`: {processes} single-threaded "
             f"process(es) at once, each timing one unit of work (200 products of 256 x 256 matrices) for "
             f"{seconds:g} s; load average at the start {load:.2f}.", "",
             "| process | units | median (ms) | 5th-95th percentile (ms) | 10-s windows relative to the fastest | "
             "slowest window |", "|---:|---:|---:|---|---|---:|"]
    for i, times in enumerate(results):
        ordered, win = sorted(times), windows(times)
        n, fastest = len(ordered), min(win)
        lines.append(f"| {i} | {n} | {statistics.median(times) * 1e3:.1f} | {ordered[n // 20] * 1e3:.1f}-"
                     f"{ordered[-(n // 20) - 1] * 1e3:.1f} | {', '.join(f'{w / fastest:.2f}' for w in win)} | "
                     f"{max(win) / fastest:.2f}x |")
    return lines + [""]


def _cold_run(cases: list[tuple[float, bool, str]], repeats: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _COLD, json.dumps(cases), str(repeats)], capture_output=True,
                          text=True, check=True, env={**os.environ, **(env or {})})
    return json.loads(done.stdout)


def cold(repeats: int) -> list[str]:
    load = os.getloadavg()[0]
    cases = [(g, False, "forward") for g in GAPS] + [(0.2, True, "forward"), (0.0, False, "sweep"),
                                                     (1.0, False, "sweep")]
    plain = _cold_run(cases, repeats)
    huge = _cold_run([(0.0, False, "forward"), (0.2, False, "forward")], repeats, {"THP_MEM_ALLOC_ENABLE": "1"})
    warm = plain["0.0|False|forward"][1]
    lines = ["## 2. Cold memory: a pass after an idle gap", "",
             f"One forward pass over {MIB:.0f} MiB of weights (6 tanh layers of 1024 x 1024, 64 rows, one thread), "
             f"timed right after the process waited *gap* seconds (*first pass*) and once more right after that "
             f"(*next pass*); medians of {repeats}. Load average at the start {load:.2f}.", "",
             "| gap (s) | waited by | first pass (ms) | next pass (ms) | first / warm pass | "
             "extra per MiB touched (ms) |",
             "|---:|---|---:|---:|---:|---:|"]

    def row(key: str, gap: str, how: str, ref: float) -> str:
        first, again = plain[key]
        return (f"| {gap} | {how} | {first * 1e3:.1f} | {again * 1e3:.1f} | {first / ref:.2f}x | "
                f"{max(first - ref, 0.0) * 1e3 / MIB:.2f} |")

    for g in GAPS:
        lines.append(row(f"{g}|False|forward", f"{g:g}", "sleeping", warm))
    lines.append(row("0.2|True|forward", "0.2", "spinning (core busy)", warm))
    lines.append(_huge_row(huge, huge["0.0|False|forward"][1]))
    sweep_warm = plain["0.0|False|sweep"][1]
    first, again = plain["1.0|False|sweep"]
    lines += ["", f"A read-only sweep of the same weights (a sum per weight, no products) takes "
              f"{sweep_warm * 1e3:.1f} ms warm and {first * 1e3:.1f} ms after 1 s asleep ({first / sweep_warm:.1f}x): "
              f"the extra time is in "
              f"touching the memory again, not in the arithmetic.", ""]
    slow = plain["0.2|False|forward"][0] / warm
    spin = plain["0.2|True|forward"][0] / warm
    huge_slow = huge["0.2|False|forward"][0] / huge["0.0|False|forward"][1]
    stays = "" if min(spin, huge_slow) < 1.1 else \
        ", and neither a busy core nor huge pages removes it"
    lines += ["**What it means.** "
              f"Here a pass that follows 0.2 s asleep takes {slow:.1f}x a warm one; {spin:.1f}x when the wait spun "
              f"on the core instead, {huge_slow:.1f}x with huge pages. Memory left untouched is slow to touch "
              f"again, the longer it was left{stays}. "
              f"A rank's compute therefore depends on how long it idled before it: the fast rank of an unbalanced "
              f"pipeline computes slower than the same rank in a balanced one, and `--emulate-slowdown`, had it only "
              f"slept after each pass, would make the slowed rank more than FACTOR times slower (it keeps the "
              f"rank's memory in use instead, docs/rebalancing.md). The cost model prices "
              f"ops as they run back to back (the profile), so on this host the prediction of a plan with long "
              f"waits comes out low, and speed factors fitted across an unbalanced and a balanced round mix the two "
              f"(docs/rebalancing.md). Accelerators keep their memory resident; the probe is here so that a reader "
              f"of this machine's numbers can size the effect.", ""]
    return lines


def _huge_row(huge: dict[str, Any], warm: float) -> str:
    first, again = huge["0.2|False|forward"]
    return (f"| 0.2 | sleeping, huge pages | {first * 1e3:.1f} | {again * 1e3:.1f} | {first / warm:.2f}x | "
            f"{max(first - warm, 0.0) * 1e3 / MIB:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9, help="Cold memory: passes per gap (the median is shown).")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "bench-machine.md")
    args = parser.parse_args()
    lines = ["# This machine: drift and cold memory", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
             f"{__import__('torch').__version__}. Reproduce: `python3 bench/drift.py` (finished "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `--seconds {args.seconds:g} --processes "
             f"{args.processes} --repeats {args.repeats}`).", ""]
    lines += drift(args.seconds, args.processes)
    lines += cold(args.repeats)
    args.output.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
