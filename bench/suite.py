"""The placer benchmark of issue 4: every method side by side on bundled models x clusters x micro-batches.

Methods. Peers: ``uniform`` (Megatron-LM/DeepSpeed layers per stage), ``params`` (DeepSpeed parameter
balance), and ``torchgpipe``: the partition of torchgpipe's ``balance_by_time``, computed by the real
package (``torchgpipe.balance.blockpartition.solve``, installed with ``pip install torchgpipe --no-deps``)
on our per-layer forward + backward times on the first device's type, stages on devices in rank order.
Ours: ``greedy``, ``greedy --refine``, ``dp``, ``dp --refine`` and ``ilp`` (60 s limit, warm-started from greedy).
``--refine`` ends with the boundary polish against the simulator (``planner.partition.search.polish``); for ``dp``,
which takes no weights, it is the polish alone.
Every method sees the same blocks (``--granularity layer``), schedule 1F1B, Adam.

Reported per case: the simulated step time of each plan (``plan.predicted``; a dagger marks a plan
that does not fit in memory, simulated anyway), the ILP's status and gap, the ratios of our plans to
the ILP's, of the ILP's objective to its proven bound and to the LP relaxation, planning wall times,
and on the two-host clusters what topology-aware mapping gains over devices in id order.

    python3 bench/suite.py                      # everything (~20-30 min); writes docs/benchmarks.md
    python3 bench/suite.py --models gpt_tiny --clusters a100-4 --output /tmp/b.md

Profiles are cached in ``bench/.cache`` (shared with bench/partition.py; measured if absent). The
GPT-3-like 96-layer profile is synthesised from gpt_medium by bench/synth.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _paths import REPO  # first: the repository on sys.path, bench/ last (see bench/_paths.py)

from planner.examples import BUNDLED  # noqa: E402
from planner.clusters import bundled_clusters, load_cluster_spec  # noqa: E402
from planner.errors import InfeasibleError, PlannerError  # noqa: E402
from planner.formats.profile import Profile, load_profile, save_profile  # noqa: E402
from planner.partition import partition  # noqa: E402
from planner.partition.placers.baselines import layer_units  # noqa: E402
from planner.partition.model.cost import evaluate  # noqa: E402
from planner.partition.model.feasibility import check_fits  # noqa: E402
from planner.partition.model.granularity import groups_for  # noqa: E402
from planner.partition.placers.ilp import lp_bound_s  # noqa: E402
from planner.partition.placers.mapping import id_order, map_stages  # noqa: E402
from planner.partition.model.objective import step_time_formula_s  # noqa: E402
from planner.partition.model.problem import Partition, Problem, StageSpec, build_problem  # noqa: E402

CACHE = REPO / "bench" / ".cache"
MODELS = {**BUNDLED, "gpt3_96": "synth:gpt_medium:96"}
CLUSTERS = ("a100-4", "dgx-h100-8", "a100-2x8-ib", "mixed-a100-v100-pcie", "mixed-3type-2host")
MIXED = ("mixed-a100-v100-pcie", "mixed-3type-2host")
TWO_HOSTS = ("a100-2x8-ib", "mixed-3type-2host")
MICROBATCHES = (8, 32)
METHODS = ("uniform", "params", "torchgpipe", "greedy", "greedy+refine", "dp", "dp+refine", "ilp")
OURS = ("greedy", "greedy+refine", "dp", "dp+refine", "ilp")
FINE = ("greedy@op", "greedy+refine@op", "dp@op")
"""Ours again with op-granularity blocks (the peers can only cut between layers); models up to FINE_MAX_OPS."""
FINE_MAX_OPS = 400
GRANULARITY, SCHEDULE, OPTIMIZER = "layer", "1f1b", "adam"
ILP_TIME_LIMIT_S = 60.0


# --- inputs ----------------------------------------------------------------------------------------

def cluster_types() -> tuple[str, ...]:
    return tuple(sorted({d.type for name in bundled_clusters() for d in load_cluster_spec(name).devices}))


def cached_profile(name: str) -> Profile:
    path = CACHE / f"{name}.json"
    if path.exists():
        return load_profile(path)
    spec = MODELS[name]
    if spec.startswith("synth:"):
        from synth import synthesize

        _, base, layers = spec.split(":")
        profile = synthesize(cached_profile(base), int(layers))
    else:
        from planner.profile import profile_model

        print(f"profiling {name} ({spec}) ...", file=sys.stderr, flush=True)
        profile = profile_model(spec, estimate=cluster_types())
    CACHE.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    return profile


def with_precision(profile: Profile, precision: str) -> Profile:
    """``profile`` with every estimated device type estimated again assuming ``precision`` (measured kept)."""
    from dataclasses import replace

    from planner.roofline import add_estimates

    estimated = tuple(sorted({t for node in profile.nodes for t, op in node.time_s.items() if op.source == "estimated"}))
    return replace(profile, nodes=add_estimates(profile.nodes, estimated, precision=precision),
                   extra={**profile.extra, "estimate_precision": precision})


def gain_bound(problem: Problem) -> dict[str, float]:
    """Idealised upper bound on any plan's gain over torchgpipe's identical-device balance.

    torchgpipe balances the work ``W`` (on device 0's type) into ``p`` equal stages; a device whose
    type needs ``r_d`` times device 0's time for the same work runs its stage in ``r_d W / p``, so the
    bottleneck is ``max_d r_d W / p``. No plan's bottleneck beats perfect fractional balance,
    ``W / sum_d (1 / r_d)``. Hence, ignoring transfers, per-block variation of ``r`` and torchgpipe's own
    imbalance (it balances whole layers), the steady-state gain is at most
    ``max_d r_d * sum_d (1 / r_d) / p``; with p_fast fast and p_slow slow devices, ``(r p_fast + p_slow) / p``.
    For two device types with device 0 of the fast one this also bounds the fill and drain (torchgpipe's
    sum of stage times is ``W (p_fast + r p_slow) / p``, no plan's is below ``W``), so the whole step.
    """
    devices = problem.cluster.devices
    work = {t: sum(sum(b.time_s[t]) for b in problem.blocks) for t in {d.type for d in devices}}
    ratios = [work[d.type] / work[devices[0].type] for d in devices]
    return {"max_ratio": max(ratios), "min_ratio": min(ratios),
            "bound": max(ratios) * sum(1 / r for r in ratios) / len(ratios)}


# --- one case --------------------------------------------------------------------------------------

@dataclass
class Run:
    method: str
    partition: Partition | None = None
    step_s: float = float("nan")
    formula_s: float = float("nan")
    fits: bool = False
    wall_s: float = 0.0
    error: str = ""
    solver: dict[str, Any] = field(default_factory=dict)


def torchgpipe_partition(problem: Problem) -> Partition:
    """torchgpipe ``balance_by_time``: its block-partition solver on per-layer times of device 0's type."""
    from torchgpipe.balance.blockpartition import solve

    dev_type = problem.cluster.devices[0].type
    units = layer_units(problem)
    # torchgpipe balances integer costs (it profiles in microseconds); keep ns resolution
    costs = [max(1, round(1e9 * sum(sum(problem.blocks[b].time_s[dev_type]) for b in range(s, e)))) for s, e, _ in units]
    parts = solve(costs, partitions=min(len(problem.cluster.devices), len(units)))
    stages, start = [], 0
    for part in parts:
        stop = start + len(part)
        stages.append((units[start][0], units[stop - 1][1]))
        start = stop
    return id_order(problem, tuple(StageSpec(a, b, "") for a, b in stages))


def score(problem: Problem, run: Run) -> Run:
    run.step_s = evaluate(problem, run.partition, record_events=False).step_time_s
    run.formula_s = step_time_formula_s(problem, run.partition)
    try:
        check_fits(problem, run.partition)
        run.fits = True
    except InfeasibleError:
        run.fits = False
    return run


def plan_run(profile: Profile, cluster_name: str, m: int, method: str, problem: Problem) -> Run:
    run = Run(method)
    began = time.perf_counter()
    try:
        if method == "torchgpipe":
            run.partition = torchgpipe_partition(problem)
        else:
            base, _, granularity = method.partition("@")
            name, refine = base.replace("+refine", ""), base.endswith("+refine")
            options = {"time_limit_s": ILP_TIME_LIMIT_S} if name == "ilp" else {}
            plan = partition(profile, load_cluster_spec(cluster_name), method=name, microbatches=m, schedule=SCHEDULE,
                             optimizer=OPTIMIZER, refine=refine, granularity=granularity or GRANULARITY, **options)
            run.partition = tuple(StageSpec(*st.extra["blocks"], st.device) for st in plan.stages)
            run.solver = dict(plan.extra.get("solver", {}))
    except PlannerError as exc:
        run.error = str(exc).split(";")[0][:80]
        return run
    finally:
        run.wall_s = time.perf_counter() - began
    return score(problem, run)


def run_case(profile: Profile, cluster_name: str, m: int) -> dict[str, Any]:
    cluster = load_cluster_spec(cluster_name)
    problem = build_problem(profile, cluster, microbatches=m, schedule=SCHEDULE, optimizer=OPTIMIZER,
                            groups=groups_for(profile, GRANULARITY))
    runs = {method: plan_run(profile, cluster_name, m, method, problem) for method in METHODS}
    if len(profile.nodes) <= FINE_MAX_OPS:
        fine = build_problem(profile, cluster, microbatches=m, schedule=SCHEDULE, optimizer=OPTIMIZER)
        runs.update({method: plan_run(profile, cluster_name, m, method, fine) for method in FINE})
    case: dict[str, Any] = {"blocks": len(problem.blocks), "devices": len(cluster.devices), "runs": runs,
                            "gain_bound": gain_bound(problem)}
    ilp = runs["ilp"]
    if ilp.partition is not None:
        try:
            case["lp_bound_s"] = lp_bound_s(problem, incumbent_s=ilp.formula_s)
        except PlannerError:
            case["lp_bound_s"] = float("nan")
    if cluster_name in TWO_HOSTS:
        case["mapping"] = {name: mapping_gain(problem, runs[name].partition)
                           for name in ("torchgpipe", "dp") if runs[name].partition is not None}
    return case


def mapping_gain(problem: Problem, partition: Partition) -> dict[str, float]:
    """The same stages on devices in id order, and mapped by ``map_stages`` from there."""
    naive = id_order(problem, partition)
    mapped = map_stages(problem, naive)
    out = {}
    for label, p in (("id_order", naive), ("mapped", mapped)):
        out[f"{label}_step_s"] = evaluate(problem, p, record_events=False).step_time_s
        out[f"{label}_formula_s"] = step_time_formula_s(problem, p)
    return out


# --- report ----------------------------------------------------------------------------------------

def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def ms(value: float) -> str:
    return "-" if value != value else f"{1e3 * value:.3f}"


def cell(run: Run) -> str:
    if run.partition is None:
        return "err"
    return ms(run.step_s) + ("" if run.fits else "†")


def best_of(runs: dict[str, Run], names: tuple[str, ...]) -> float:
    """The smallest simulated step time among the named runs that exist and fit."""
    return min((runs[k].step_s for k in names if k in runs and runs[k].partition is not None and runs[k].fits),
               default=float("nan"))


def render(results: dict[tuple[str, str, int], dict[str, Any]], command: str, elapsed_s: float,
           bf16: dict[tuple[str, str, int], dict[str, Any]] | None = None) -> str:
    lines = [header(command, elapsed_s)]
    lines += ["## Simulated step time (ms per step; † = does not fit in memory)", "",
              "| model | cluster | m | blocks | " + " | ".join(METHODS) + " | ILP status (gap) | best ours / torchgpipe |",
              "|" + "---|" * (len(METHODS) + 6)]
    for (model, cl, m), case in results.items():
        runs = case["runs"]
        ilp = runs["ilp"].solver
        status = f"{ilp.get('result', 'err')} ({100 * ilp.get('gap', float('nan')):.2f}%)" if ilp else "err"
        best = best_of(runs, OURS)
        speedup = ratio(runs["torchgpipe"].step_s, best) if runs["torchgpipe"].partition is not None else float("nan")
        lines.append(f"| {model} | {cl} | {m} | {case['blocks']} | " + " | ".join(cell(runs[k]) for k in METHODS)
                     + f" | {status} | {speedup:.3f}x |")
    lines += ["", "## Finer blocks: ours at op granularity (the peers cut between layers only)", "",
              "Models with at most 400 ops; greedy, greedy --refine and dp again, with one block per op. Simulated ms.", "",
              "| model | cluster | m | " + " | ".join(FINE) + " | t dp@op (s) | best ours (any blocks) / torchgpipe |",
              "|" + "---|" * (len(FINE) + 5)]
    for (model, cl, m), case in results.items():
        runs = case["runs"]
        if FINE[0] not in runs:
            continue
        lines.append(f"| {model} | {cl} | {m} | " + " | ".join(cell(runs[k]) for k in FINE)
                     + f" | {runs['dp@op'].wall_s:.2f} | {ratio(runs['torchgpipe'].step_s, best_of(runs, OURS + FINE)):.3f}x |")
    lines += ["", "## Ratios and planning time", "",
              "Step-time ratios use the simulator; objective ratios use the shared step-time formula that the "
              "ILP minimises (its bound and the LP relaxation are bounds on that formula).", "",
              "| model | cluster | m | greedy+refine / ilp | dp / ilp | ilp obj / ilp bound | ilp obj / LP bound "
              "| t greedy (s) | t greedy+refine (s) | t dp (s) | t ilp (s) |", "|" + "---|" * 11]
    for (model, cl, m), case in results.items():
        runs = case["runs"]
        ilp, gr, dp = runs["ilp"], runs["greedy+refine"], runs["dp"]
        bound = ilp.solver.get("bound_s", float("nan"))
        lines.append(f"| {model} | {cl} | {m} | {ratio(gr.step_s, ilp.step_s):.4f} | {ratio(dp.formula_s, ilp.formula_s):.6f} | "
                     f"{ratio(ilp.formula_s, bound):.4f} | {ratio(ilp.formula_s, case.get('lp_bound_s', float('nan'))):.4f} | "
                     f"{runs['greedy'].wall_s:.2f} | {gr.wall_s:.2f} | {dp.wall_s:.2f} | {ilp.wall_s:.2f} |")
    lines += ["", "## Topology-aware mapping on the two-host clusters", "",
              "The same stages on devices in the cluster file's order (id order) and after `map_stages` "
              "(simulated ms; formula ms in brackets).", "",
              "| model | cluster | m | stages of | id order | mapped | gain |", "|---|---|---|---|---|---|---|"]
    for (model, cl, m), case in results.items():
        for name, g in case.get("mapping", {}).items():
            lines.append(f"| {model} | {cl} | {m} | {name} | {ms(g['id_order_step_s'])} ({ms(g['id_order_formula_s'])}) "
                         f"| {ms(g['mapped_step_s'])} ({ms(g['mapped_formula_s'])}) "
                         f"| {ratio(g['id_order_step_s'], g['mapped_step_s']):.3f}x |")
    lines += gain_section(results, bf16 or {})
    lines += ["", summary(results)]
    if bf16:
        lines += ["", summary(bf16, title="Summary, mixed clusters with bf16 estimates (computed by the suite)")]
    return "\n".join(lines) + "\n"


def gain_section(results: dict[tuple[str, str, int], dict[str, Any]],
                 bf16: dict[tuple[str, str, int], dict[str, Any]]) -> list[str]:
    """Mixed clusters: measured gain over torchgpipe next to the idealised bound, fp32 and bf16 estimates."""
    lines = ["", "## Mixed clusters: gain over torchgpipe against its bound, fp32 and bf16 estimates", "",
             "r = slowest device type's total fwd+bwd time / device 0's type (torchgpipe balances on device 0); "
             "bound = max_d r_d * sum_d (1 / r_d) / p, the ceiling on any plan's steady-state gain over a *perfectly "
             "balanced* torchgpipe split (transfers ignored; `gain_bound` in bench/suite.py); measured gains above it "
             "come from torchgpipe's imperfect whole-layer balance, which shows on identical devices too. Gains are torchgpipe / best of ours "
             "(simulated), on layer blocks and including our op-granularity plans. bf16: the GPU times re-estimated "
             "with `--estimate-precision bf16` (matmuls on half-precision tensor cores, half the bytes).", "",
             "| model | cluster | m | r fp32 | bound fp32 | gain fp32 (layer / any) | r bf16 | bound bf16 "
             "| gain bf16 (layer / any) |", "|" + "---|" * 9]
    for key, case in results.items():
        model, cl, m = key
        if cl not in MIXED:
            continue
        cells = []
        for c in (case, bf16.get(key)):
            if c is None:
                cells += ["-", "-", "-"]
                continue
            g, runs = c["gain_bound"], c["runs"]
            cells += [f"{g['max_ratio']:.2f}", f"{g['bound']:.3f}x",
                      f"{ratio(runs['torchgpipe'].step_s, best_of(runs, OURS)):.3f}x / "
                      f"{ratio(runs['torchgpipe'].step_s, best_of(runs, OURS + FINE)):.3f}x"]
        lines.append(f"| {model} | {cl} | {m} | " + " | ".join(cells) + " |")
    return lines


def header(command: str, elapsed_s: float) -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    import pulp
    import torchgpipe

    return (f"# Benchmarks: placers side by side\n\nReproduce: `{command}` (took {elapsed_s / 60:.1f} min on "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average at the end "
            f"{load[0]:.1f}; Python {platform.python_version()}, PuLP {pulp.__version__}, torchgpipe "
            f"{getattr(torchgpipe, '__version__', '?')}). Schedule {SCHEDULE}, optimizer {OPTIMIZER}, granularity "
            f"`{GRANULARITY}`, ILP limit {ILP_TIME_LIMIT_S:.0f} s, one thread.\n")


def summary(results: dict[tuple[str, str, int], dict[str, Any]], title: str = "Summary (computed by the suite)") -> str:
    total = len(results)
    proven = [k for k, c in results.items() if c["runs"]["ilp"].solver.get("result") == "optimal"]
    small = [k for k, c in results.items() if c["blocks"] <= 64 and c["devices"] <= 8]
    small_proven = [k for k in small if k in proven and results[k]["runs"]["ilp"].solver.get("gap", 1) <= 0.01]
    agree = [k for k, c in results.items() if abs(c["runs"]["dp"].formula_s - c["runs"]["ilp"].formula_s)
             <= max(c["runs"]["ilp"].solver.get("gap", 0), 1e-6) * c["runs"]["ilp"].formula_s]
    far = [k for k, c in results.items() if c["runs"]["greedy+refine"].step_s > 1.05 * c["runs"]["ilp"].step_s]
    out = [f"## {title}", "",
           f"- ILP proven optimal (HiGHS `Optimal`, gap <= 1e-4): {len(proven)} of {total} runs.",
           f"- Cases with <= 64 blocks x <= 8 devices proven within the limit (gap <= 1%): {len(small_proven)} of {len(small)}"
           + (f"; not: {', '.join(map(_key, sorted(set(small) - set(small_proven))))}" if set(small) - set(small_proven) else "") + ".",
           f"- DP and ILP objectives agree (within the ILP's gap): {len(agree)} of {total}"
           + (f"; differ: {', '.join(map(_key, sorted(set(results) - set(agree))))}" if len(agree) < total else "") + ".",
           f"- greedy+refine within 5% of the ILP plan (simulated): {total - len(far)} of {total}"
           + (f"; not: {', '.join(map(_key, far))}" if far else "") + "."]
    for label, keep in (("mixed clusters", lambda cl: cl in MIXED), ("identical devices", lambda cl: cl not in MIXED)):
        for what, names in (("same layer blocks", OURS), ("best of ours incl. op-granularity plans", OURS + FINE)):
            ratios = sorted(ratio(c["runs"]["torchgpipe"].step_s, best_of(c["runs"], names))
                            for (model, cl, m), c in results.items() if keep(cl))
            if ratios:
                out.append(f"- {label}, {what}: torchgpipe / best of ours (simulated step): min {ratios[0]:.3f}x, "
                           f"median {ratios[len(ratios) // 2]:.3f}x, max {ratios[-1]:.3f}x over {len(ratios)} cases; "
                           f">= 1.3x in {sum(r >= 1.3 for r in ratios)}, >= 0.99x in {sum(r >= 0.99 for r in ratios)}.")
    return "\n".join(out)


def _key(key: tuple[str, str, int]) -> str:
    return f"{key[0]}/{key[1]}/m={key[2]}"


def to_json(results: dict[tuple[str, str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for (model, cl, m), case in results.items():
        runs = {k: {"step_s": r.step_s, "formula_s": r.formula_s, "fits": r.fits, "wall_s": r.wall_s, "error": r.error,
                    "solver": r.solver, "stages": None if r.partition is None else [list(map(str, (s.start, s.stop, s.device)))
                                                                                   for s in r.partition]}
                for k, r in case["runs"].items()}
        rows.append({"model": model, "cluster": cl, "microbatches": m, "blocks": case["blocks"], "runs": runs,
                     "lp_bound_s": case.get("lp_bound_s"), "mapping": case.get("mapping")})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Placers side by side (issue 4).")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    parser.add_argument("--microbatches", nargs="+", type=int, default=list(MICROBATCHES))
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--skip-bf16", action="store_true",
                        help="skip the second pass over the mixed clusters with bf16 estimates")
    args = parser.parse_args(argv)
    command = "python3 bench/suite.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:]))
    began = time.perf_counter()
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    for model in args.models:
        profile = cached_profile(model)
        for cl in args.clusters:
            for m in args.microbatches:
                results[(model, cl, m)] = case = run_case(profile, cl, m)
                ilp = case["runs"]["ilp"]
                print(f"{model:13s} {cl:22s} m={m:<3d} blocks={case['blocks']:<4d} "
                      + " ".join(f"{k}={cell(r)}" for k, r in case["runs"].items())
                      + f" ilp={ilp.solver.get('result')} gap={ilp.solver.get('gap', float('nan')):.4f} t_ilp={ilp.wall_s:.1f}s",
                      file=sys.stderr, flush=True)
    bf16: dict[tuple[str, str, int], dict[str, Any]] = {}
    for model in [] if args.skip_bf16 else args.models:
        profile = with_precision(cached_profile(model), "bf16")
        for cl in [c for c in args.clusters if c in MIXED]:
            for m in args.microbatches:
                bf16[(model, cl, m)] = case = run_case(profile, cl, m)
                print(f"bf16 {model:13s} {cl:22s} m={m:<3d} " + " ".join(f"{k}={cell(r)}" for k, r in case["runs"].items()),
                      file=sys.stderr, flush=True)
    (CACHE / "suite.json").write_text(json.dumps(to_json(results), indent=1))
    text = render(results, command, time.perf_counter() - began, bf16)
    out = Path(args.output)
    notes = _kept_notes(out)
    out.write_text(text + notes)
    print(f"wrote {out}", file=sys.stderr)


NOTES = "<!-- notes: hand-written below this line; the suite keeps it -->"


def _kept_notes(path: Path) -> str:
    if path.exists() and NOTES in path.read_text():
        return "\n" + NOTES + path.read_text().split(NOTES, 1)[1]
    return ""


if __name__ == "__main__":
    main()
