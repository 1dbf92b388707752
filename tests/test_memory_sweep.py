"""The exact methods search under the feasibility rule's memory account (issue 22, point 4).

The bug these catch: ``--method dp`` (the default) and ``ilp`` failing with "made a split that does not fit"
on a memory-tight cluster where greedy writes a plan that fits, because the optimality guard polished a
baseline's plan that did not fit into the result; and a plan labelled "optimal" that simulates slower than
greedy's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from planner.clusters import resolve_cluster
from planner.errors import PlannerError
from planner.formats.catalog import load_catalog
from planner.formats.cluster import Cluster, Device, Link, load_cluster
from planner.formats.plan import Plan
from planner.formats.profile import Profile, load_profile
from planner.partition import partition
from planner.partition.validate import validate_plan

GOLDEN = Path(__file__).resolve().parent / "golden" / "profiles"
MIB = 1 << 20
CATALOG = load_catalog()


def _cluster(count: int, memory_bytes: int, device_type: str = "h100-sxm") -> Cluster:
    devices = tuple(Device(f"g{i}", device_type, "h0", memory_bytes) for i in range(count))
    return Cluster("tight", devices, Link(4.5e11, 3e-6), Link(5e10, 5e-6))


def _scaled(cluster: Cluster, factor: float) -> Cluster:
    return replace(cluster, devices=tuple(replace(d, memory_bytes=int(d.memory_bytes * factor))
                                          for d in cluster.devices))


def _plan(profile: Profile, cluster: Cluster, method: str, **options: object) -> Plan | PlannerError:
    try:
        return partition(profile, cluster, method=method, microbatches=8, schedule="1f1b", catalog=CATALOG,
                         **options)
    except PlannerError as exc:
        return exc


def _least_greedy_factor(profile: Profile, cluster: Cluster) -> float:
    """The least factor on every device's memory (to 1%) at which greedy still writes a plan."""
    lo, hi = 1e-6, 1.0
    while hi / lo > 1.01:
        mid = (lo * hi) ** 0.5
        if isinstance(_plan(profile, _scaled(cluster, mid), "greedy"), PlannerError):
            lo = mid
        else:
            hi = mid
    return hi


def _assert_exact_holds(profile: Profile, cluster: Cluster, where: str, methods: tuple[str, ...]) -> int:
    """Where greedy fits: every exact method writes a valid plan, and one it calls optimal is not slower than
    greedy's in the simulator. Returns how many optimality claims were checked."""
    greedy = _plan(profile, cluster, "greedy")
    if isinstance(greedy, PlannerError):
        return 0
    claims = 0
    for method in methods:
        options = {"time_limit_s": 2.0} if method == "ilp" else {}
        plan = _plan(profile, cluster, method, **options)
        assert not isinstance(plan, PlannerError), f"{where}: {method} failed where greedy fits: {plan}"
        assert validate_plan(plan, profile, cluster, CATALOG) == [], where
        if plan.extra["solver"]["result"] == "optimal":
            assert plan.step_time_s <= greedy.step_time_s * (1 + 1e-9), (where, method)
            claims += 1
    return claims


@pytest.mark.slow  # about 5 s
def test_issue_case_dp_ilp_and_auto_fit_where_greedy_fits() -> None:
    """The issue's case: an unseen 8-layer transformer on 4 devices of 48 MiB, 1F1B, 8 micro-batches."""
    profile = load_profile(GOLDEN / "tx8.json")
    cluster = _cluster(4, 48 * MIB)
    greedy = _plan(profile, cluster, "greedy", data_parallel=1)
    assert isinstance(greedy, Plan)
    for method, options in (("dp", {"data_parallel": 1}), ("ilp", {"data_parallel": 1}),
                            ("dp", {"data_parallel": "auto"})):
        plan = _plan(profile, cluster, method, **options)
        assert isinstance(plan, Plan), (method, options, plan)
        assert validate_plan(plan, profile, cluster, CATALOG) == []
        assert plan.step_time_s <= greedy.step_time_s * (1 + 1e-9), (method, options)


def test_optimal_never_loses_to_greedy_on_two_hosts() -> None:
    """The issue's second case: on 2 hosts of 4 H100s at layer granularity the ILP's formula optimum simulated
    slower than greedy --refine and was still called optimal. Now "optimal" is kept only where neither greedy,
    a baseline nor the simulator's polish does better; otherwise the plan says "best found"."""
    profile = load_profile(GOLDEN / "tx8.json")
    devices = tuple(Device(f"h{h}g{i}", "h100-sxm", f"host{h}", 80 << 30) for h in range(2) for i in range(4))
    cluster = Cluster("h100-2x4", devices, Link(4.5e11, 3e-6), Link(5e10, 5e-6))
    refined = partition(profile, cluster, method="greedy", refine=True, microbatches=8, schedule="1f1b",
                        catalog=CATALOG, granularity="layer")
    for method in ("ilp", "dp"):
        plan = partition(profile, cluster, method=method, microbatches=8, schedule="1f1b", catalog=CATALOG,
                         granularity="layer")
        solver = plan.extra["solver"]
        assert solver["result"] in ("optimal", "best found")
        if solver["result"] == "best found":
            assert solver["formula_result"] == "optimal" and solver["simulated"]["step_time_s"] == plan.step_time_s
        assert plan.step_time_s <= refined.step_time_s * (1 + 1e-9), method


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["gpt_tiny", "resnet_small", "unet_small", "tx8"])
def test_sweep_memory_down_to_what_greedy_fits(model: str) -> None:
    """Bundled models (and the unseen one) x clusters x capacities, from generous down to the least that greedy
    fits: dp and ilp never fail where greedy fits, their plans pass the checks, and "optimal" never simulates
    slower than greedy's plan."""
    profile = load_profile(GOLDEN / f"{model}.json")
    claims = 0
    for name in ("a100-4", "t4-4-pcie", "mixed-a100-v100-pcie", "dgx-h100-8", "cpu-2"):
        cluster = load_cluster(resolve_cluster(name))
        least = _least_greedy_factor(profile, cluster)
        for factor in (least, least * 1.05, least * 1.3, 1.0):
            # the ILP (2 s limit) where memory is tightest, the cluster small and the model short (the unseen
            # model's ILP at op granularity is pinned by the issue's case above), to keep the sweep short
            methods = ("dp", "ilp") if len(cluster.devices) <= 4 and factor < least * 1.1 and len(profile.nodes) < 100 \
                else ("dp",)
            claims += _assert_exact_holds(profile, _scaled(cluster, min(factor, 1.0)), f"{model} {name} x{factor:.4g}",
                                          methods)
    assert claims > 0  # the claims were checked, not skipped
