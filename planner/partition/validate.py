"""The plan invariant checker: what every plan must satisfy against its profile and cluster.

Each violation is one line naming the rule that broke and the offending nodes, stages or devices:

1. every profile node lies in exactly one stage (names dropped, duplicated and unknown nodes);
2. no stage is empty;
3. no edge runs backwards: ``stage(u) <= stage(v)`` for every edge ``u -> v``;
4. stages are contiguous runs of the profile's node order, in stage order (what the runtime cuts);
5. every device is in the cluster (the plan's embedded cluster unless one is given);
6. the feasibility rule (``planner.partition.model.feasibility``): schedule, micro-batch count, stage count,
   devices per stage, replicas (equal degree, no device in two replicas, shares summing to the micro-batches),
   and every device's peak memory, recomputed from the profile with the cost model
   (the plan's own numbers are not trusted). The placers and the runtime apply the same rule;
7. a zero-bubble plan's ``schedule_order`` runs every pass of every micro-batch and does not deadlock.

``plan check`` and every placer test call ``validate_plan``; ``assert_valid_plan`` raises instead.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from planner.errors import PlanMismatchError, PlannerError
from planner.formats.catalog import DeviceSpec
from planner.formats.cluster import Cluster
from planner.formats.plan import ACTION, GENERATED_ORDER_SCHEDULES, ZERO_BUBBLE_SCHEDULES, Plan
from planner.formats.profile import Profile
from planner.graph import backward_edges, op_graph
from planner.partition.model.feasibility import memory_violations, replica_violations
from planner.partition.model.problem import Placed, StageSpec, build_problem
from planner.partition.sim.schedules import order_violations

_SHOWN = 5
"""How many names a violation lists before summarising the rest."""


def validate_plan(plan: Plan, profile: Profile, cluster: Cluster | None = None,
                  catalog: Mapping[str, DeviceSpec] | None = None) -> list[str]:
    """All violations of the rules above (empty when the plan is valid); ``catalog`` estimates device types
    the profile did not time (``planner.formats.catalog.load_catalog``)."""
    violations = _coverage(plan, profile) + _empty_stages(plan)
    violations += _backward_edges(plan, profile)
    contiguous = _contiguity(plan, profile)
    violations += contiguous
    resolved, problems = _cluster(plan, cluster)
    violations += problems
    if resolved is not None:
        layout = _devices(plan, resolved)
        violations += layout
        if not violations:
            violations += _memory(plan, profile, resolved, catalog)
    return violations


def assert_valid_plan(plan: Plan, profile: Profile, cluster: Cluster | None = None,
                      catalog: Mapping[str, DeviceSpec] | None = None) -> None:
    """Raise ``PlanMismatchError`` listing every violation; for tests and callers that must not go on."""
    violations = validate_plan(plan, profile, cluster, catalog)
    if violations:
        raise PlanMismatchError(f"plan ({plan.method}) is invalid: " + "; ".join(violations))


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(repr(x) for x in items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _coverage(plan: Plan, profile: Profile) -> list[str]:
    counts: dict[str, int] = {}
    for stage in plan.stages:
        for name in stage.nodes:
            counts[name] = counts.get(name, 0) + 1
    known = profile.node_index()
    dropped = [n.name for n in profile.nodes if n.name not in counts]
    duplicated = [name for name, c in counts.items() if c > 1]
    unknown = [name for name in counts if name not in known]
    out = []
    if dropped:
        out.append(f"{len(dropped)} profile node(s) in no stage: {_names(dropped)}")
    if duplicated:
        out.append(f"{len(duplicated)} node(s) in more than one stage: {_names(duplicated)}")
    if unknown:
        out.append(f"{len(unknown)} node(s) not in the profile: {_names(unknown)}")
    return out


def _empty_stages(plan: Plan) -> list[str]:
    empty = [str(s.index) for s in plan.stages if not s.nodes]
    return [f"empty stage(s): {', '.join(empty)}; every stage must hold at least one node"] if empty else []


def _backward_edges(plan: Plan, profile: Profile) -> list[str]:
    stage_of = plan.assignment()
    backwards = [f"{src!r} (stage {stage_of[src]}) -> {dst!r} (stage {stage_of[dst]})"
                 for src, dst in backward_edges(op_graph(profile), stage_of)]
    if not backwards:
        return []
    return [f"{len(backwards)} edge(s) run backwards (stage(u) must be <= stage(v)): {', '.join(backwards[:_SHOWN])}"
            + (f" and {len(backwards) - _SHOWN} more" if len(backwards) > _SHOWN else "")]


def _contiguity(plan: Plan, profile: Profile) -> list[str]:
    """Stage ``i`` must hold exactly the profile nodes ``[a_i, a_{i+1})`` for increasing bounds ``a``.

    Positions count only the profile nodes the plan holds, so a dropped node is reported once (by
    the coverage rule), not again as a gap.
    """
    held = {name for stage in plan.stages for name in stage.nodes}
    index = {node.name: i for i, node in enumerate(n for n in profile.nodes if n.name in held)}
    order = [n.name for n in profile.nodes if n.name in held]
    out, expected = [], 0
    for stage in plan.stages:
        positions = sorted({index[n] for n in stage.nodes if n in index})
        if not positions:
            continue
        if positions != list(range(expected, expected + len(positions))):
            first = order[expected] if expected < len(order) else "(end of profile)"
            out.append(f"stage {stage.index} is not the contiguous run of profile nodes starting at {first!r} "
                       f"({len(positions)} nodes, the first at profile position {positions[0]}); "
                       f"stages must be contiguous runs of the profile's order")
        expected = max(expected, positions[-1] + 1)
    return out


def _cluster(plan: Plan, cluster: Cluster | None) -> tuple[Cluster | None, list[str]]:
    if cluster is not None:
        return cluster, []
    from planner.clusters import embedded_cluster

    try:
        return embedded_cluster(plan), []
    except PlannerError as exc:
        return None, [f"cannot check devices and memory: {exc}"]


def _devices(plan: Plan, cluster: Cluster) -> list[str]:
    """Rule 5, and the shape rules of ``planner.partition.model.feasibility`` (the runtime asks the same)."""
    known = set(cluster.device_ids)
    replicas = plan.replicas()
    unknown = sorted({d for devices in replicas for d in devices} - known)
    if unknown:
        return [f"device(s) not in cluster {cluster.name!r}: {_names(unknown)} "
                f"(known: {', '.join(cluster.device_ids)})"]
    firsts = [f"stage {s.index} lists replicas {devices} without its device {s.device!r} first"
              for s, devices in zip(plan.stages, replicas) if devices[0] != s.device]
    if firsts:
        return [firsts[0] + "; replicas must list the stage's device first"]
    return replica_violations(plan.schedule, plan.microbatches, replicas, plan.shares()) or _schedule_order(plan)


def _schedule_order(plan: Plan) -> list[str]:
    """A zero-bubble plan's ``schedule_order``: each replica pipeline's ranks, their passes complete and in an order
    that finishes (``order_violations``); keys number the devices by first appearance (``Plan.replica_devices``)."""
    order = plan.extra.get("schedule_order")
    if plan.schedule not in ZERO_BUBBLE_SCHEDULES or not order:
        return [] if plan.schedule not in GENERATED_ORDER_SCHEDULES else [
            f"a {plan.schedule} plan must carry its schedule_order; re-partition with --schedule {plan.schedule}"]
    rank = {dev: i for i, dev in enumerate(plan.replica_devices())}
    replicas, shares = plan.replicas(), plan.replica_shares()
    out: list[str] = []
    for r, share in enumerate(shares):
        stage_keys = [str(rank[devices[r]]) for devices in replicas]
        keys = list(dict.fromkeys(stage_keys))  # a device holding two stages (a V) has one order
        missing = [k for k in keys if k not in order]
        if missing:
            out.append(f"schedule_order has no passes for rank(s) {missing}; re-partition with --schedule {plan.schedule}")
            continue
        parsed = [[_action(a) for a in order[k]] for k in keys]
        where = f" (replica {r})" if len(shares) > 1 else ""
        out += [f"schedule_order{where}: {v}; re-partition with --schedule {plan.schedule}"
                for v in order_violations(parsed, share, [keys.index(k) for k in stage_keys])]
    return out


def _action(text: str) -> tuple[str, int, int]:
    found = ACTION.match(text)
    assert found is not None  # plan_from_dict checked the notation
    return found.group(2), int(found.group(1)), int(found.group(3))


def _memory(plan: Plan, profile: Profile, cluster: Cluster, catalog: Mapping[str, DeviceSpec] | None) -> list[str]:
    """Recompute each device's peak memory from the profile (one block per stage) with the cost model."""
    optimizer = str(plan.extra.get("optimizer", "adam"))
    rows = plan.extra.get("microbatch_size")  # --microbatches auto planned on the profile rescaled to these rows
    if isinstance(rows, int) and rows != profile.model.get("microbatch_size"):
        from planner.partition.search.settings import rescaled

        profile = rescaled(profile, rows, catalog)
    index = profile.node_index()
    groups = [sorted(s.nodes, key=index.__getitem__) for s in plan.stages]
    try:
        problem = build_problem(profile, cluster, microbatches=plan.microbatches, schedule=plan.schedule,
                                optimizer=optimizer, groups=groups, catalog=catalog,
                                recompute=any(plan.recomputed()))
    except PlannerError as exc:
        return [f"cannot recompute memory: {exc}"]
    replicas = plan.replicas()
    specs = tuple(StageSpec(i, i + 1, s.device, tuple(devices) if len(devices) > 1 else (), again)
                  for i, (s, devices, again) in enumerate(zip(plan.stages, replicas, plan.recomputed())))
    shares = plan.shares()
    return memory_violations(problem, Placed(specs, shares=shares) if shares else specs)
