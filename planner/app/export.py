"""``plan export``: a plan in the form other trainers read, split at module boundaries.

* ``torchtitan``: the ``[parallelism]`` table of torchtitan's config (``ParallelismConfig``):
  ``module_fqns_per_model_part`` (one list of module FQNs per stage, in plan order), the degrees, the
  schedule under torchtitan's name and the micro-batch size; the device order the plan chose is a comment; and
  ``[activation_checkpoint] mode``: ``full`` when any stage of the plan recomputes its activations, else ``none``
  (torchtitan applies one mode to every stage; where the plan recomputes only some, ``full`` never needs more
  memory than the plan, and a comment names the stages the plan recomputes).
* ``pipelining``: the ``split_spec`` of ``torch.distributed.pipelining.pipeline`` (the module that begins
  each stage after the first -> ``SplitPoint.BEGINNING``), as data and as a Python snippet.
* ``schedule-csv``: each rank's order of passes as the simulator ran them (``sim.schedules.device_orders``, or a
  zero-bubble plan's ``schedule_order``), one CSV row per rank of actions such as ``1F0`` / ``0B3`` / ``1I2`` /
  ``1W2`` (stage, F, B or a backward's input or weight half, micro-batch): the format
  ``torch.distributed.pipelining``'s ``_PipelineScheduleRuntime._load_csv`` reads, and torchtitan's
  ``pipeline_parallel_schedule_csv``. It needs no module boundaries.

A module is a repeated module's entry (``blocks.3``, ``model.model.layers.3``) or, outside repeated
modules, the op's own module (``wte``, ``model.model.embed_tokens``). Module lists cannot express a cut inside a layer, so a plan that makes one (from
``--granularity op``) is refused in one line that names the first such cut and gives the simulated step
time of the same method's plan with ``--granularity layer``, so the user sees what the boundary costs.
Ops outside every module (the root's own arithmetic) and shared parameters (a tied LM head) are left to
the trainer, as torchtitan's model code does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import PlanMismatchError, PlannerError, UsageError
from planner.formats.catalog import load_catalog
from planner.formats.cluster import cluster_from_dict
from planner.formats.jsonio import check_writable, write_bytes_atomic
from planner.formats.plan import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, Plan, load_plan
from planner.formats.profile import Profile, load_profile
from planner.partition.model.problem import layer_of

__all__ = ["FORMATS", "TORCHTITAN_SCHEDULES", "Exported", "export_file", "module_parts", "module_fqn"]

FORMATS = ("torchtitan", "pipelining", "schedule-csv")
TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                        "zb-h1": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
"""Our schedule names -> torchtitan's ``pipeline_parallel_schedule`` (torch.distributed.pipelining's classes;
``ScheduleInterleavedZeroBubble`` on one stage per rank runs ``zb-h1``'s order, and so a ``zbv`` or ``dualpipev`` plan
that kept one stage per device; torchtitan lays ``ZBVZeroBubble``'s and ``DualPipeV``'s two stages per rank out in a V
itself)."""
CSV_ONLY_SCHEDULES = tuple(s for s in ZERO_BUBBLE_SCHEDULES if s not in TORCHTITAN_SCHEDULES)
"""Zero-bubble schedules torchtitan has no class for (``zb-planned``'s order exists only as the plan's own; torch
ships no ZB-H2): exported as the plan's order, which torchtitan reads from a CSV."""
CSV_SCHEDULES = (*TORCHTITAN_SCHEDULES, *CSV_ONLY_SCHEDULES)
"""Schedules ``schedule-csv`` writes: the flushing ones."""


@dataclass(frozen=True)
class Exported:
    format: str
    data: dict[str, Any]
    text: str
    """What ``-o`` writes: TOML for torchtitan, a Python snippet for pipelining."""
    output: str | None


def module_fqn(module_path: str) -> str:
    """The module an op belongs to for a trainer: the entry of a repeated module (``layer_of``: ``blocks.3``,
    ``model.model.layers.3``), else the op's own module (``wte``, ``model.model.embed_tokens``, ``model.lm_head``;
    a wrapper's top-level name would put a model's embeddings and its head in one module)."""
    layer = layer_of(module_path)
    return layer if layer != module_path.split(".")[0] or layer == module_path else module_path


def module_parts(plan: Plan, profile: Profile) -> list[list[str]]:
    """Module FQNs per stage, in plan and execution order; ``PlanMismatchError`` for a cut inside a module."""
    stage_of = {name: k for k, stage in enumerate(plan.stages) for name in stage.nodes}
    owner: dict[str, tuple[int, str]] = {}
    parts: list[list[str]] = [[] for _ in plan.stages]
    names = {module_fqn(node.module_path) for node in profile.nodes} - {""}
    # A container's own glue ops (an HF model's mask and rotary set-up) would name the whole container, and
    # with it every layer inside: they are left to the trainer, like the root's own ops.
    containers = {name for name in names if any(other.startswith(name + ".") for other in names)}
    for node in profile.nodes:
        layer = module_fqn(node.module_path)
        if not layer or layer in containers or node.name not in stage_of:
            continue
        k = stage_of[node.name]
        if layer in owner and owner[layer][0] != k:
            first_stage, first_node = owner[layer]
            raise _CutInside(layer, first_stage, first_node, k, node.name)
        if layer not in owner:
            owner[layer] = (k, node.name)
            parts[k].append(layer)
    return parts


class _CutInside(PlanMismatchError):
    def __init__(self, layer: str, a: int, node_a: str, b: int, node_b: str) -> None:
        super().__init__(layer)
        self.where = (f"the plan cuts inside module {layer!r} (its op {node_a!r} is on stage {a}, {node_b!r} on "
                      f"stage {b})")


def export_file(plan_path: str | Path, fmt: str, output: str | Path | None = None,
                profile_path: str | Path | None = None) -> Exported:
    """Export ``plan_path`` to ``fmt``; write the text form to ``output`` when given."""
    if fmt not in FORMATS:
        raise UsageError(f"--to must be one of {', '.join(FORMATS)}, found {fmt!r}")
    if output is not None:
        check_writable(output, f"{fmt} export")
    from planner.app.check import profile_path_of

    plan = load_plan(plan_path)
    from planner.partition.model.feasibility import replica_violations

    shape = replica_violations(plan.schedule, plan.microbatches, plan.replicas(), plan.shares())
    if shape:  # e.g. an interleaved plan (several stages per device) under a single-stage schedule
        raise PlanMismatchError(f"{plan_path}: the plan cannot be exported as {plan.schedule}: {shape[0]}")
    if plan.schedule in CSV_ONLY_SCHEDULES and fmt == "torchtitan":
        raise PlanMismatchError(f"{plan_path}: the plan's schedule is {plan.schedule}, an order torchtitan has no "
                                f"schedule class for; export it with --to schedule-csv and give the file to "
                                f"torchtitan's pipeline_parallel_schedule_csv, or re-partition with --schedule zb-h1")
    if plan.schedule not in CSV_SCHEDULES and fmt != "pipelining":
        raise PlanMismatchError(f"{plan_path}: the plan's schedule is {plan.schedule}, which has no flush between steps "
                                f"and runs only under `plan run` (docs/async.md); {fmt} expects one of "
                                f"{', '.join(CSV_SCHEDULES if fmt == 'schedule-csv' else TORCHTITAN_SCHEDULES)}: re-partition with --schedule 1f1b to export it")
    if fmt == "schedule-csv":
        data = _schedule_csv(plan)
        text = "".join(",".join(row) + "\n" for row in data["rows"])
        if output is not None:
            write_bytes_atomic(Path(output), text.encode())
        return Exported(fmt, data, text, None if output is None else str(output))
    profile = load_profile(profile_path or profile_path_of(plan, Path(plan_path)))
    try:
        parts = module_parts(plan, profile)
    except _CutInside as cut:
        raise PlanMismatchError(f"{cut.where}, and {fmt} splits only at module boundaries; re-partition with "
                                f"--granularity layer ({_layer_cost(plan, profile)}) or --granularity depth:N") from None
    empty = [k for k, part in enumerate(parts) if not part]
    if empty:
        raise PlanMismatchError(f"stage {empty[0]} of the plan holds no module (only the root's own ops), which "
                                f"{fmt} cannot express; re-partition with --granularity layer")
    data = _torchtitan(plan, profile, parts) if fmt == "torchtitan" else _pipelining(parts)
    text = _toml(plan, data, str(plan_path)) if fmt == "torchtitan" else _snippet(data)
    if output is not None:
        write_bytes_atomic(Path(output), text.encode())
    return Exported(fmt, data, text, None if output is None else str(output))


def _devices(plan: Plan) -> list[str]:
    """Replica 0's pipeline devices, in stage order."""
    return list(dict.fromkeys(stage.device for stage in plan.stages))


def _torchtitan(plan: Plan, profile: Profile, parts: list[list[str]]) -> dict[str, Any]:
    """torchtitan's parallelism table. Its device mesh puts ``pp`` outermost, so rank ``s d + r`` runs stage slot
    ``s`` of replica ``r``: ``device_order`` lists the plan's devices in that order. torchtitan splits each step's
    batch evenly over its data-parallel replicas, so uneven shares are refused."""
    shape = plan.shape()
    replicas, degree, shares = shape.replicas, shape.degree, shape.shares
    if len(set(shares)) > 1:
        if plan.microbatches % degree:
            fix = (f"re-partition with a micro-batch count that {degree} divides (-n {degree * (plan.microbatches // degree + 1)}"
                   f" or -n {degree * max(plan.microbatches // degree, 1)})")
        else:
            fix = ("the shares follow the replicas' speeds (devices of different types); re-partition with replicas "
                   "of one device type")
        raise PlanMismatchError(f"the plan gives its {degree} replicas uneven micro-batch shares {list(shares)}, but "
                                f"torchtitan splits every batch evenly over its data-parallel replicas; {fix}, or "
                                f"run it with plan run")
    rows = int(plan.extra.get("microbatch_size") or profile.model.get("microbatch_size", 1))
    order = [devices[r] for devices in replicas for r in range(degree)]
    return {"parallelism": {
        "pipeline_parallel_degree": len(_devices(plan)),
        "pipeline_parallel_schedule": TORCHTITAN_SCHEDULES[
            "zb-h1" if plan.schedule in V_SCHEDULES and len(parts) == len(_devices(plan)) else plan.schedule],
        "pipeline_parallel_microbatch_size": rows,
        "module_fqns_per_model_part": parts,
        "data_parallel_replicate_degree": degree,
    }, "activation_checkpoint": {"mode": "full" if any(plan.recomputed()) else "none"},
        "recomputed_stages": [i for i, again in enumerate(plan.recomputed()) if again],
        "device_order": list(dict.fromkeys(order)), "global_batch_size": rows * plan.microbatches}


def _schedule_csv(plan: Plan) -> dict[str, Any]:
    """Each rank's action order; a hybrid plan's replicas each with their share, ranks replica by replica. A
    zero-bubble plan's own ``schedule_order`` is written as it is (``I`` and ``W`` for the backward's halves)."""
    from planner.partition.sim.schedules import device_orders, pipeline_layout

    shape = plan.shape()
    recorded = plan.extra.get("schedule_order")
    if recorded:
        return {"rows": [list(recorded[k]) for k in sorted(recorded, key=int)], "device_order": plan.replica_devices()}
    rows, order = [], []
    for r, share in enumerate(shape.shares):
        ranks, chunks = pipeline_layout([devices[r] for devices in shape.replicas], plan.schedule)
        for actions in device_orders(plan.schedule, len(ranks), chunks, share):
            rows.append([f"{stage}{kind}{mb}" for kind, stage, mb in actions])
        order += list(ranks)
    return {"rows": rows, "device_order": order}


def _pipelining(parts: list[list[str]]) -> dict[str, Any]:
    return {"split_spec": {part[0]: "BEGINNING" for part in parts[1:]}, "stages": parts}


def _toml(plan: Plan, data: dict[str, Any], plan_path: str) -> str:
    table = data["parallelism"]
    order = ", ".join(f"rank {r}: {d}" for r, d in enumerate(data["device_order"]))
    lines = [f"# from plan export of {plan_path}: {plan.method}, {plan.schedule}, {plan.microbatches} micro-batches, "
             f"predicted step {plan.step_time_s:.6g} s",
             f"# device order the plan chose ({order}): start torchrun so that rank r runs on that device",
             f"# [training] global_batch_size = {data['global_batch_size']} (micro-batch rows x the plan's micro-batches)",
             "[parallelism]"]
    for key, value in table.items():
        lines.append(f"{key} = {json.dumps(value)}")
    again = data["recomputed_stages"]
    lines += ["", "# the plan's recompute; torchtitan's full AC recomputes each block (keeping every block's input), "
              "the plan each stage", *([f"# the plan recomputes stages {again} of {len(plan.stages)}; torchtitan "
                                        f"applies one mode to every stage, and full needs no more memory"]
                                       if again and len(again) < len(plan.stages) else []),
              "[activation_checkpoint]",
              f"mode = {json.dumps(data['activation_checkpoint']['mode'])}"]
    return "\n".join(lines) + "\n"


def _snippet(data: dict[str, Any]) -> str:
    spec = ", ".join(f"{fqn!r}: SplitPoint.BEGINNING" for fqn in data["split_spec"])
    return ("# from plan export --to pipelining: the plan's stages as torch.distributed.pipelining's split_spec\n"
            "from torch.distributed.pipelining import SplitPoint, pipeline\n\n"
            f"split_spec = {{{spec}}}\n"
            "# pipe = pipeline(model, mb_args=(example_microbatch,), split_spec=split_spec)\n")


def _layer_cost(plan: Plan, profile: Profile) -> str:
    """The same method's plan at layer granularity, simulated, against this plan's step time."""
    from planner.partition import partition
    from planner.partition.placers import registry

    raw = plan.extra.get("cluster")
    if not isinstance(raw, dict):
        return "the plan embeds no cluster, so its cost was not simulated"
    method = plan.method if plan.method in registry.names() else "dp"
    try:
        coarse = partition(profile, cluster_from_dict(dict(raw), "the plan's cluster"), method=method,
                           microbatches=plan.microbatches, schedule=plan.schedule,
                           optimizer=str(plan.extra.get("optimizer", "adam")), granularity="layer",
                           catalog=load_catalog())
    except PlannerError as exc:
        return f"no {method} plan at layer granularity: {exc}"
    return (f"{method} at layer granularity simulates {coarse.step_time_s * 1e3:.3f} ms per step against this plan's "
            f"{plan.step_time_s * 1e3:.3f} ms, {coarse.step_time_s / plan.step_time_s - 1:+.1%}")
