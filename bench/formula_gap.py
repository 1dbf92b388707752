"""Where the exact placers' formula and the simulator disagree: the DP's plan against torchgpipe's.

The DP and the ILP minimise ``sum_k L_k + (m - 1) * max_k L_k`` (docs/exact-methods.md). Under 1F1B the
simulator sees two things the formula does not:

- *absorption*: the stage ``b`` that sets the pace runs ``p - 1 - b`` warm-up forwards while its first
  micro-batch travels through the stages after it, so those stages cost only what the warm-up does not
  cover, ``max(0, sum_{k>b} L_k - (p - 1 - b) F_b)``, not their whole sum;
- *overlap*: sends run on their own links while the device computes, so in the steady state a stage
  repeats every ``max(C_b, X_b^fwd, X_b^bwd)``, not every ``C_b + X_b``.

Hence the estimate ``max_b [sum_{k<b} L_k + L_b + (m - 1) * max(C_b, X_b^fwd, X_b^bwd)
+ max(0, sum_{k>b} L_k - (p - 1 - b) F_b)]`` printed next to the formula and the simulated step. It is a
diagnostic, not an objective: it is not a sum of per-stage terms, so neither the DP's shortest path nor
the ILP's linear model can carry it as is.

    python3 bench/formula_gap.py gpt3_96:a100-2x8-ib:8 gpt_small:a100-2x8-ib:8 gpt_medium:dgx-h100-8:32
"""

from __future__ import annotations

import argparse

import _paths  # noqa: F401  # first: the repository on sys.path, bench/ last (see bench/_paths.py)

from suite import OPTIMIZER, SCHEDULE, cached_profile, torchgpipe_partition  # noqa: E402

from planner.clusters import load_cluster_spec  # noqa: E402
from planner.partition.model.cost import evaluate, stage_compute_s, transfer_s  # noqa: E402
from planner.partition.placers.dp import solve_dp  # noqa: E402
from planner.partition.model.granularity import groups_for  # noqa: E402
from planner.partition.model.objective import stage_latencies_s, step_time_formula_s  # noqa: E402
from planner.partition.model.problem import Partition, Problem, build_problem  # noqa: E402


def one_f_one_b_estimate_s(problem: Problem, partition: Partition) -> float:
    """The 1F1B estimate of the module docstring (absorption by the warm-up, transfers overlapped)."""
    tables, m, p = problem.tables, problem.microbatches, len(partition)
    latency = stage_latencies_s(problem, partition)
    out = 0.0
    for b, st in enumerate(partition):
        fwd_s = (tables.fwd_prefix[st.device][st.stop] - tables.fwd_prefix[st.device][st.start]) * tables.speed[st.device]
        period = stage_compute_s(tables, st.device, st.start, st.stop)
        if b + 1 < p:
            nxt, cut = partition[b + 1].device, st.stop - 1
            period = max(period, transfer_s(tables, st.device, nxt, problem.cut_fwd_bytes[cut]),
                         transfer_s(tables, nxt, st.device, problem.cut_bwd_bytes[cut]))
        tail = max(0.0, sum(latency[b + 1:]) - (p - 1 - b) * fwd_s)
        out = max(out, sum(latency[:b]) + latency[b] + (m - 1) * period + tail)
    return out


def report(spec: str) -> str:
    model, cluster, m = spec.split(":")
    profile = cached_profile(model)
    problem = build_problem(profile, load_cluster_spec(cluster), microbatches=int(m), schedule=SCHEDULE,
                            optimizer=OPTIMIZER, groups=groups_for(profile, "layer"))
    rows = []
    for name, plan in (("dp", solve_dp(problem).partition), ("torchgpipe", torchgpipe_partition(problem))):
        rows.append(f"| {spec} | {name} | {len(plan)} | {1e3 * step_time_formula_s(problem, plan):.3f} | "
                    f"{1e3 * one_f_one_b_estimate_s(problem, plan):.3f} | "
                    f"{1e3 * evaluate(problem, plan, record_events=False).step_time_s:.3f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Formula, 1F1B estimate and simulator: DP vs torchgpipe.")
    parser.add_argument("cases", nargs="+", help="MODEL:CLUSTER:MICROBATCHES (layer blocks, 1f1b, adam)")
    args = parser.parse_args(argv)
    print("| case | plan | stages | formula ms | 1F1B estimate ms | simulated ms |\n|---|---|---|---|---|---|")
    for spec in args.cases:
        print(report(spec), flush=True)


if __name__ == "__main__":
    main()
