"""``plan train``: profile (once per model and machine), choose the whole strategy, train with it, summarise.

One command for what ``plan profile``, ``plan partition``, ``plan show``, ``plan run`` and ``plan curves`` do step
by step, with their options chosen (docs/train.md):

1. **Check** every option, the cluster and the output directory, before anything is measured.
2. **Profile** the model as the run will see it: on this machine's device, beside as many co-located training
   processes as the cluster puts CPU ranks on one host, with roofline estimates for the cluster's other device
   types. The profile is cached by what it measured (``planner.profile.cache``); a second call reuses it.
3. **Plan**: ``plan partition``'s search with everything left to choose set to ``auto`` -- shape (stages x
   replicas, shares), schedule (the asynchronous ones too), micro-batch count under ``--global-batch`` -- and the
   sync mode by ``SYNC_RULE``. Every candidate is recorded with its predicted step time, peak memory and why it
   lost.
4. **Train** with rebalancing and held-out evaluation until ``--steps`` or ``--target``; write the timeline, the
   trace, the round log, the curves and one summary under ``-o DIR``.

Under ``torchrun`` (the same command on every host), rank 0 profiles and plans and hands the files to the other
ranks through the launcher's store; every rank then trains in-process.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from planner.errors import PlannerError, UsageError
from planner.formats.plan import DEFAULT_ASYNC_WARMUP, Plan
from planner.formats.profile import Profile

__all__ = ["TrainRequest", "Strategy", "SYNC_RULE", "artifact_paths", "check_request", "choose_strategy",
           "train_command"]

DEFAULT_MICROBATCHES = 8
"""Without ``--global-batch``, the step's batch is this many of the model's example micro-batches."""
TARGET_STEP_CAP = 1000
"""``--target`` without ``--steps`` trains until the target or this many steps."""
SYNC_SHARE = 0.1
"""The sync rule's threshold: adaptive's default overhead budget (``--sync-overhead``)."""
SYNC_RULE = (f"replicas combine by ssgd unless its predicted all-reduce takes more than {SYNC_SHARE:.0%} of the step "
             f"(adaptive's overhead budget); then by adaptive (adaptive local SGD). The parameter-server modes (dasp) "
             f"answer stragglers that appear while training, which no prediction shows: pass --sync dasp")

Announce = Callable[[str], None]


@dataclass(frozen=True)
class TrainRequest:
    """``plan train``'s options (see its ``--help``)."""

    model: str
    cluster: str
    output_dir: Path = Path("out")
    data: str | None = None
    steps: int | None = None
    target: str | None = None
    global_batch: int | None = None
    microbatches: str = "auto"
    schedule: str = "auto"
    data_parallel: str = "auto"
    sync: str = "auto"
    sync_period: int | None = None
    method: str = "greedy"
    recompute: str = "auto"
    async_warmup: int | None = None
    """An asynchronous schedule's synchronous warm-up in steps (``None``: ``DEFAULT_ASYNC_WARMUP``)."""
    optimizer: str | None = None
    lr: float | None = None
    seed: int = 0
    round_steps: int = 5
    eval_every: int | None = None
    eval_batches: int = 4
    dry_run: bool = False
    reprofile: bool = False
    cache_dir: Path | None = None
    input_spec: str | None = None
    tracer: str = "auto"
    repeats: int = 5
    warmup: int = 2
    emulate_link: str | None = None
    emulate_slowdown: tuple[str, ...] = ()
    rebalance: bool = True
    timeout_s: float = 120.0
    show: int = 6
    """Candidates listed beside the chosen strategy."""

    @property
    def step_count(self) -> int:
        return self.steps if self.steps is not None else (TARGET_STEP_CAP if self.target else 40)

    @property
    def eval_interval(self) -> int:
        """``--eval-every``, by default every round when there is held-out data or a target to judge."""
        if self.eval_every is not None:
            return self.eval_every
        return self.round_steps if (self.data or self.target) else 0


def artifact_paths(directory: Path) -> dict[str, Path]:
    """Every file ``plan train`` writes under ``-o DIR``, by name."""
    from planner.app.show import default_report_paths

    report = default_report_paths(directory / "plan.json")  # the names plan show gives them
    return {"profile": directory / "profile.json", "plan": directory / "plan.json", "timeline_png": report["png"],
            "timeline_svg": report["svg"], "trace": report["trace"], "rounds": directory / "rounds.jsonl",
            "final_plan": directory / "final-plan.json", "curves_png": directory / "curves.png",
            "curves_svg": directory / "curves.svg", "summary": directory / "summary.json"}


@dataclass(frozen=True)
class Checked:
    """What ``check_request`` resolved: this machine's device type, the types to estimate and the co-located ranks."""

    local_type: str
    estimate: tuple[str, ...]
    colocate: int


def check_request(request: TrainRequest) -> Checked:
    """Refuse every bad option in one line, before anything is profiled or written."""
    from planner.app.partition import check_recompute, check_settings
    from planner.app.run import check_learning_options
    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import device_spec, load_catalog
    from planner.partition.model.problem import check_sync
    from planner.partition.search.hybrid import parse_degree
    from planner.partition.search.settings import parse_microbatches
    from planner.runtime.options import run_options

    target, sep, attr = request.model.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"MODEL must look like pkg.mod:factory or file.py:factory, found {request.model!r}")
    for name, value, low in (("--steps", request.steps, 1), ("--round-steps", request.round_steps, 1),
                             ("--global-batch", request.global_batch, 1), ("--repeats", request.repeats, 1),
                             ("--warmup", request.warmup, 0), ("--sync-period", request.sync_period, 1),
                             ("--eval-every", request.eval_every, 0), ("--eval-batches", request.eval_batches, 1),
                             ("--show", request.show, 0), ("--async-warmup", request.async_warmup, 0)):
        if value is not None and value < low:
            raise UsageError(f"{name} must be a whole number >= {low}, found {value}")
    if not request.timeout_s > 0:
        raise UsageError(f"--timeout-s must be positive, found {request.timeout_s}")
    if request.microbatches != "auto" and request.global_batch is not None:
        raise UsageError("--global-batch goes with --microbatches auto (the default); drop one of them")
    # auto needs a global batch (the search's default stands in here); a fixed count takes none
    parse_microbatches(request.microbatches, request.global_batch or 1 if request.microbatches == "auto" else None)
    check_settings(request.method, None, request.schedule, "adam")
    check_recompute(request.recompute, request.schedule)
    parse_degree(request.data_parallel)
    if request.sync != "auto":
        check_sync(request.sync, request.sync_period)
    elif request.sync_period is not None:
        raise UsageError("--sync-period goes with --sync local-sgd or adaptive; pass one, or drop --sync-period")
    if request.optimizer is not None and request.optimizer not in ("sgd", "adam"):
        raise UsageError(f"--optimizer must be sgd or adam, found {request.optimizer!r}")
    if request.tracer not in ("auto", "export", "fx"):
        raise UsageError(f"--tracer must be auto, export or fx, found {request.tracer!r}")
    check_learning_options({"eval_every": request.eval_interval, "eval_batches": request.eval_batches,
                            "target": request.target, "stop_at_target": bool(request.target),
                            "emulate_link": request.emulate_link})
    run_options(emulate_slowdown=list(request.emulate_slowdown) or None)
    if request.data is not None:
        from planner.data.factory import load_data_factory

        load_data_factory(request.data)
    _check_directory(request.output_dir)
    cluster = load_cluster_spec(request.cluster)
    catalog = load_catalog()
    types = list(dict.fromkeys(d.type for d in cluster.devices))
    for dev_type in types:
        device_spec(dev_type, catalog)
    from planner.profile.device import detect_device_type

    local = detect_device_type()
    if not request.dry_run and types != [local]:
        raise UsageError(f"plan train trains on this machine's {local} devices, but cluster {request.cluster!r} has "
                         f"{', '.join(types)}; pass --dry-run to plan only, or a cluster of {local} devices "
                         f"(for CPU ranks: --cluster cpu-2)")
    colocate = cluster.most_on_one_host() if local == "cpu" else 1  # CPU ranks share their host's cores
    return Checked(local, tuple(t for t in types if t != local), colocate)


def _check_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"-o {str(directory)!r} is a file; expected a directory for the plan, logs and pictures")
    parent = next((p for p in (directory, *directory.parents) if p.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        raise UsageError(f"cannot write under {str(directory)!r}: {str(parent)!r} is not writable; choose another -o")


@dataclass(frozen=True)
class ProfileUse:
    path: Path
    profile: Profile
    cached: bool
    cache_file: Path
    seconds: float


def cached_profile(request: TrainRequest, checked: Checked, destination: Path,
                   announce: Announce | None = None) -> ProfileUse:
    """The model's profile at ``destination``: copied from the cache when it holds one for this model, inputs,
    tracer and device (``planner.profile.cache``), else measured and kept there."""
    from planner.formats.jsonio import write_bytes_atomic
    from planner.formats.profile import load_profile, save_profile
    from planner.profile.cache import cache_dir, cached_profile_path, profile_key

    key, _ = profile_key(request.model, input_spec=request.input_spec, microbatch_size=None, tracer=request.tracer,
                         colocate=checked.colocate, repeats=request.repeats, warmup=request.warmup,
                         estimate=checked.estimate, model_output=None)
    kept = cached_profile_path(key, cache_dir(request.cache_dir))
    if kept.is_file() and not request.reprofile:
        try:
            found = load_profile(kept)
        except PlannerError:
            pass  # a damaged cache entry is measured again
        else:
            write_bytes_atomic(destination, kept.read_bytes())
            if announce:
                announce(f"profile: from the cache ({kept}; same model, inputs, tracer and device), "
                         f"--reprofile measures again")
            return ProfileUse(destination, found, True, kept, 0.0)
    from planner.profile import profile_model

    if announce:
        colocated = f", beside {checked.colocate - 1} co-located rank(s)" if checked.colocate > 1 else ""
        announce(f"profile: measuring {request.model} on {checked.local_type}{colocated} ...")
    started = time.perf_counter()
    profile = profile_model(request.model, input_spec=request.input_spec, tracer=request.tracer,
                            repeats=request.repeats, warmup=request.warmup, estimate=checked.estimate,
                            colocate=checked.colocate)
    seconds = time.perf_counter() - started
    save_profile(profile, destination)
    kept.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(kept, destination.read_bytes())
    if announce:
        announce(f"profile: measured in {seconds:.1f} s, kept in {kept}")
    return ProfileUse(destination, profile, False, kept, seconds)


@dataclass(frozen=True)
class Strategy:
    """The chosen plan, every candidate the search weighed, and the sync decision."""

    plan: Plan
    candidates: tuple[dict[str, Any], ...]
    sync: Mapping[str, Any] | None = None
    global_batch: int | None = None
    search_s: float = 0.0
    every_rank: Mapping[str, Any] | None = None
    """Under torchrun, when the fastest plan used fewer devices than the ranks started: what it used, and the
    replica degree re-planned with so that every rank trains (``_every_rank_degree``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": describe(self.plan), "candidates": list(self.candidates), "sync": self.sync,
                "global_batch": self.global_batch, "search_s": self.search_s, "every_rank": self.every_rank}


def describe(plan: Plan) -> dict[str, Any]:
    """The strategy of ``plan`` as the candidate table names it."""
    from planner.partition.search.settings import candidate_facts

    shape = plan.shape()
    return {"schedule": plan.schedule, "microbatches": plan.microbatches,
            "microbatch_size": plan.extra.get("microbatch_size"), **candidate_facts(plan),
            "shares": list(shape.shares) if shape.replicated else None,
            "sync": shape.sync if shape.replicated else None, "step_time_s": plan.step_time_s}


def choose_strategy(profile: ProfileUse, request: TrainRequest, ranks: int | None = None) -> Strategy:
    """Plan the whole strategy (``plan partition`` with everything left to choose on ``auto``), then the sync mode
    by ``SYNC_RULE``; every candidate weighed is returned, best first, with why it lost. ``ranks``: the ranks
    torchrun started, which the plan must use (``_every_rank_degree``)."""
    from planner.app.partition import partition_file

    started = time.perf_counter()
    profile_path = profile.path
    global_batch = request.global_batch
    if request.microbatches == "auto" and global_batch is None:
        global_batch = int(profile.profile.model.get("microbatch_size") or 1) * DEFAULT_MICROBATCHES

    from planner.partition.sim.schedules import run_drain_every

    warmup = DEFAULT_ASYNC_WARMUP if request.async_warmup is None else request.async_warmup
    drains = run_drain_every(request.step_count, request.round_steps, warmup)

    def plan_with(sync: str, period: int | None, degree: str) -> Plan:
        return partition_file(profile_path, request.cluster, None, method=request.method,
                              microbatches=request.microbatches, schedule=request.schedule, refine=True,
                              data_parallel=degree, global_batch=global_batch, sync=sync,
                              sync_period=period, recompute=request.recompute, round_steps=drains,
                              async_warmup=warmup)

    first_sync = "ssgd" if request.sync == "auto" else request.sync
    degree = request.data_parallel
    chosen = plan_with(first_sync, request.sync_period, degree)
    every_rank = None
    if ranks is not None:
        from planner.runtime.launch.prepare import world_size_of

        used = world_size_of(chosen)
        if used != ranks:
            degree = str(_every_rank_degree(used, ranks, request.data_parallel))
            chosen = plan_with(first_sync, request.sync_period, degree)
            if world_size_of(chosen) != ranks:
                raise PlannerError(f"the fastest plan uses {used} of the {ranks} ranks torchrun started, and with "
                                   f"--data-parallel {degree} it uses {world_size_of(chosen)}; start {used} ranks "
                                   f"(--nproc-per-node), or pass a --data-parallel degree whose plan uses all {ranks}")
            every_rank = {"fastest_uses": used, "ranks": ranks, "data_parallel": int(degree)}
    sync = None
    if request.sync == "auto" and chosen.shape().replicated:
        chosen, sync = _choose_sync(chosen, lambda: plan_with("adaptive", None, degree))
    rows = candidate_rows(chosen, sync, first_sync)
    return Strategy(chosen, rows, sync, global_batch if request.microbatches == "auto" else None,
                    time.perf_counter() - started, every_rank)


def _every_rank_degree(used: int, ranks: int, asked: str) -> int:
    """The replica degree to plan again with when the fastest plan used ``used`` of the ``ranks`` torchrun
    started: as many copies of that plan as fill the ranks, else one replica of the whole model per rank. The
    runtime cannot leave a rank idle, and torchrun cannot start fewer once it has started them."""
    if used > ranks:
        raise PlannerError(f"the plan uses {used} devices but torchrun started {ranks} ranks; describe {ranks} devices "
                           f"in the cluster file, or start {used} ranks (--nproc-per-node x --nnodes)")
    if asked != "auto":
        raise PlannerError(f"the plan for --data-parallel {asked} uses {used} of the {ranks} ranks torchrun started; "
                           f"start {used} ranks (--nproc-per-node), or pass a degree whose plan uses all {ranks}")
    return ranks // used if ranks % used == 0 else ranks


def sync_share(plan: Plan) -> float:
    """The predicted share of the step the replicas' all-reduce takes (on the device where it is largest)."""
    devices = plan.predicted.get("devices") or {}
    return max((float(d.get("sync_s") or 0.0) for d in devices.values()), default=0.0) / plan.step_time_s


def _choose_sync(ssgd: Plan, adaptive: Callable[[], Plan]) -> tuple[Plan, dict[str, Any]]:
    """``SYNC_RULE`` on a replicated plan: keep ssgd, or take adaptive when ssgd's sync share is above budget."""
    share = sync_share(ssgd)
    alternatives = [{"sync": "ssgd", "step_time_s": ssgd.step_time_s, "sync_share": share}]
    try:
        other = adaptive()
    except PlannerError as exc:
        other = None
        alternatives.append({"sync": "adaptive", "step_time_s": None, "why": " ".join(str(exc).split())[:200]})
    else:
        alternatives.append({"sync": "adaptive", "step_time_s": other.step_time_s, "sync_share": sync_share(other)})
    pick = other if other is not None and share > SYNC_SHARE else ssgd
    record = {"rule": SYNC_RULE, "ssgd_sync_share": share, "chosen": pick.shape().sync, "alternatives": alternatives}
    return pick, record


def candidate_rows(chosen: Plan, sync: Mapping[str, Any] | None, searched: str) -> tuple[dict[str, Any], ...]:
    """One row per strategy weighed: the schedule x micro-batch candidates (each with its best shape), the chosen
    setting's other shapes, and the sync alternative; best first, each with ``verdict`` (why it lost: its step time
    against the chosen one's; ``tie``: equal, lost to the search order; ``rule``: the sync rule's choice; ``no fit``, with ``why``). ``searched``:
    the sync mode the search planned replicated candidates with."""
    best = describe(chosen)
    rows: list[dict[str, Any]] = []
    choices = chosen.extra.get("choices") or {}
    for c in choices.get("candidates") or ():
        rows.append({**dict(c), "sync": searched if (c.get("degree") or 1) > 1 else None})
    for c in (chosen.extra.get("shape") or {}).get("candidates") or ():
        rows.append({"schedule": chosen.schedule, "microbatches": chosen.microbatches, "stages": c.get("stages"),
                     "degree": c.get("degree"), "step_time_s": c.get("step_time_s"), "peak_memory_bytes": None,
                     "memory_fraction": None,
                     "grouping": " from ".join(x for x in (c.get("grouping"), c.get("order")) if x) or None,
                     "sync": searched if (c.get("degree") or 1) > 1 else None})
    for alt in (sync or {}).get("alternatives") or ():
        if alt["sync"] != best["sync"]:
            rows.append({**{k: best[k] for k in ("schedule", "microbatches", "microbatch_size", "stages", "degree",
                                                 "recompute")}, "sync": alt["sync"],
                         "step_time_s": alt.get("step_time_s"), "peak_memory_bytes": None, "memory_fraction": None,
                         "why": alt.get("why"), "rule": True})
    seen = {_key(best)}
    unique = []
    for row in rows:
        key = _key(row)
        if key in seen:
            continue
        seen.add(key)
        unique.append(row)
    fits = sorted((r for r in unique if r.get("step_time_s") is not None), key=lambda r: r["step_time_s"])
    for row in fits:
        gap = row["step_time_s"] / best["step_time_s"] - 1
        if row.get("rule"):
            row["verdict"] = f"{gap:+.1%} rule"
        elif gap > 5e-4:
            row["verdict"] = f"{gap:+.1%}"
        else:
            row["verdict"] = "tie"
        row.pop("rule", None)
    failed = [r for r in unique if r.get("step_time_s") is None]
    for row in failed:
        row["verdict"] = "no fit"
        row.pop("rule", None)
    return ({**best, "verdict": "chosen"}, *fits, *failed)


def _key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return (row.get("schedule"), row.get("microbatches"), row.get("stages"), row.get("degree"), row.get("sync"))


def train_command(request: TrainRequest, announce: Announce | None = None,
                  show_strategy: Callable[[Strategy], None] | None = None) -> dict[str, Any]:
    """Check, profile (cached), plan and, unless ``dry_run``, train; return the summary (``summary.json``)."""
    checked = check_request(request)
    paths = artifact_paths(request.output_dir)
    shared = _Shared.open()
    if shared is not None and shared.rank != 0:
        return _follow(request, paths, shared)
    created, had_profile = not request.output_dir.exists(), paths["profile"].exists()
    try:
        request.output_dir.mkdir(parents=True, exist_ok=True)
        profile = cached_profile(request, checked, paths["profile"], announce)
        strategy = choose_strategy(profile, request, None if shared is None else shared.world)
        summary, written = _write_plan(request, paths, profile, strategy, show_strategy)
        if shared is not None and not request.dry_run:
            shared.publish(paths)
    except BaseException as exc:
        if shared is not None:  # the other ranks stop with rank 0's reason instead of waiting for the plan
            shared.refuse(str(exc) or type(exc).__name__)
        if isinstance(exc, PlannerError):  # no partial output: what this call made goes
            if created:
                shutil.rmtree(request.output_dir, ignore_errors=True)
            elif not had_profile:
                paths["profile"].unlink(missing_ok=True)
        raise
    if request.dry_run:
        return _finish(summary, paths, written)
    for name in ("rounds", "final_plan", "curves_png", "curves_svg"):
        paths[name].unlink(missing_ok=True)  # this run's log and results, not an earlier run's
    result = _run(request, paths, announce)
    if result is None:
        return summary
    written += ["rounds", "final_plan"]
    if paths["rounds"].is_file() and paths["rounds"].stat().st_size:
        from planner.app.curves import curves_command

        curves = curves_command([paths["rounds"]], paths["curves_png"], request.target)
        written += ["curves_png", "curves_svg"]
        summary["time_to_target_s"] = curves.runs[0].time_to_target_s
    summary["run"] = {k: v for k, v in result.items() if k != "plan"}
    return _finish(summary, paths, written)


def _write_plan(request: TrainRequest, paths: Mapping[str, Path], profile: ProfileUse, strategy: Strategy,
                show_strategy: Callable[[Strategy], None] | None) -> tuple[dict[str, Any], list[str]]:
    """Save the plan, show the strategy, draw the timeline and trace; the summary so far and the files written."""
    from planner.app.show import default_report_paths, show_plan
    from planner.formats.plan import save_plan

    save_plan(strategy.plan, paths["plan"])
    summary: dict[str, Any] = {
        "profile": {"path": str(paths["profile"]), "cached": profile.cached, "cache_file": str(profile.cache_file),
                    "seconds": profile.seconds},
        "strategy": strategy.to_dict(), "dry_run": request.dry_run}
    if show_strategy is not None:
        show_strategy(strategy)
    show_plan(paths["plan"], default_report_paths(paths["plan"]))
    return summary, ["profile", "plan", "timeline_png", "timeline_svg", "trace"]


def _finish(summary: dict[str, Any], paths: Mapping[str, Path], written: Sequence[str]) -> dict[str, Any]:
    from planner.formats.jsonio import write_json_atomic

    summary["artifacts"] = {name: str(paths[name]) for name in [*written, "summary"] if paths[name].is_file() or
                            name == "summary"}
    write_json_atomic(paths["summary"], summary)
    return summary


def _run(request: TrainRequest, paths: Mapping[str, Path], announce: Announce | None) -> dict[str, Any] | None:
    from planner.app.run import Launch, run_config, run_plan

    config = run_config(
        plan=str(paths["plan"]), model=request.model, steps=request.step_count, round_steps=request.round_steps,
        timeout_s=request.timeout_s, optimizer=request.optimizer, lr=request.lr, seed=request.seed, data=request.data,
        profile=str(paths["profile"]), eval_every=request.eval_interval, eval_batches=request.eval_batches,
        target=request.target, stop_at_target=bool(request.target), emulate_link=request.emulate_link,
        options=dict(rebalance=request.rebalance, emulate_slowdown=list(request.emulate_slowdown) or None,
                     log=str(paths["rounds"]), output=paths["final_plan"]))
    return run_plan(config, Launch(), announce=announce)


_SERVED: list[Any] = []
"""The store rank 0 serves under torchrun without the launcher's (``_Shared.open``), alive for the process."""


@dataclass
class _Shared:
    """Under torchrun: the job's store, through which rank 0 hands the profile and the plan to the others.

    With the launcher's shared store (``TORCHELASTIC_USE_AGENT_STORE``, torchrun's default) every rank is its
    client. Without it (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``plan run``'s own launcher sets so that a
    restarted job gets a fresh store), rank 0 serves the store the process group will use, at ``MASTER_PORT``, as
    ``init_process_group`` would: ``multi_tenant``, so that the group's own store in this process reuses the same
    server (it is kept alive in ``_SERVED`` until the process ends)."""

    store: Any
    rank: int
    world: int = 1
    """The ranks torchrun started (``WORLD_SIZE``): the plan must use every one."""
    timeout_s: float = 3600.0
    keys: tuple[str, ...] = field(default=("profile", "plan"))

    @classmethod
    def open(cls) -> "_Shared | None":
        if not os.environ.get("TORCHELASTIC_RUN_ID"):
            return None
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=cls.timeout_s)
        rank = int(os.environ["RANK"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        else:
            store = dist.TCPStore(host, port, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                                  multi_tenant=True)
            _SERVED.append(store)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"/planner-train/attempt_{attempt}", store), rank,
                   int(os.environ.get("WORLD_SIZE", "1")))

    def publish(self, paths: Mapping[str, Path]) -> None:
        for key in self.keys:
            self.store.set(key, paths[key].read_bytes())
        self.store.set("status", b"ok")

    def refuse(self, message: str) -> None:
        """Rank 0 failed before training: the other ranks stop with its message instead of waiting."""
        self.store.set("status", message.encode("utf-8"))

    def fetch(self, paths: Mapping[str, Path]) -> None:
        from planner.formats.jsonio import write_bytes_atomic

        self.store.wait(["status"])
        status = self.store.get("status").decode("utf-8")
        if status != "ok":
            raise PlannerError(f"rank 0 could not plan: {status}")
        for key in self.keys:
            write_bytes_atomic(paths[key], self.store.get(key))


def _follow(request: TrainRequest, paths: Mapping[str, Path], shared: _Shared) -> dict[str, Any]:
    """A rank other than 0 under torchrun: take rank 0's profile and plan, then train as its rank."""
    if request.dry_run:
        return {"dry_run": True, "rank": shared.rank}
    request.output_dir.mkdir(parents=True, exist_ok=True)
    shared.fetch(paths)
    result = _run(request, paths, None)
    return {"rank": shared.rank, "run": result}
