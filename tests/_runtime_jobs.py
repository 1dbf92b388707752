"""Helpers for the multi-process runtime tests: tiny-GPT plans, a launched job, the reference losses."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "planner.examples.gpt:gpt_tiny"


def make_plans(root: Path) -> dict[str, Any]:
    """A profile of the tiny GPT and two 2-stage plans on cpu-2: cut before blocks.1 (A) and before blocks.0.mlp (B)."""
    import torch

    from planner.formats.cluster import load_cluster
    from planner.formats.plan import save_plan
    from planner.formats.profile import save_profile
    from planner.partition.model.convert import build_plan
    from planner.partition.model.problem import StageSpec, build_problem
    from planner.app.partition import profile_ref
    from planner.profile import profile_model

    torch.set_num_threads(1)
    profile = profile_model(MODEL, repeats=1, warmup=1)
    save_profile(profile, root / "tiny.profile.json")
    cluster = load_cluster(ROOT / "profiles" / "clusters" / "cpu-2.json")
    problem = build_problem(profile, cluster, microbatches=2, schedule="1f1b", optimizer="adam")
    ref = profile_ref(root / "tiny.profile.json", "tiny")
    cuts = {}
    for name, module in (("a", "blocks.1"), ("b", "blocks.0.mlp"), ("c", "blocks.1.mlp")):
        cut = cuts[name] = next(i for i, n in enumerate(profile.nodes) if n.module_path.startswith(module))
        split = (StageSpec(0, cut, "cpu0"), StageSpec(cut, len(profile.nodes), "cpu1"))
        save_plan(build_plan(problem, split, method="manual", profile_ref=ref), root / f"{name}.json")
    return {"a": root / "a.json", "b": root / "b.json", "root": root, "cuts": cuts}


def job(plan: Path, steps: int, options: dict[str, Any], *, restarts: int = 0, timeout_s: float = 60,
        env: dict[str, str] | None = None, nproc: int = 2) -> tuple[int, dict[str, Any], float]:
    """``plan run``'s launcher in this process (see ``tests/_inproc.py``) with the fault-injection plugin and any in
    ``PLANNER_TEST_HOOKS``: exit status, summary (or ``{"error": ...}``) and seconds taken. ``env`` is set for the
    job (the ranks adopt it); ``PLANNER_TEST_PARAMS_OUT``: where the ranks write their parameters. The test's
    ``timeout`` mark is the hard limit."""
    from planner.errors import PlannerError
    from planner.runtime.launch.config import RunConfig
    from planner.runtime.launch.elastic import LaunchOptions, launch

    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    plugins = ("tests._faults:hooks", *(h for h in env.get("PLANNER_TEST_HOOKS", "").split(",") if h))
    config = RunConfig(plan=str(plan), model=MODEL, steps=steps, round_steps=2, timeout_s=timeout_s,
                       plugins=plugins, options=options, params_out=env.get("PLANNER_TEST_PARAMS_OUT") or None)
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        try:
            results = launch(config, LaunchOptions(nproc_per_node=nproc, max_restarts=restarts))
        except PlannerError as exc:
            return 1, {"error": str(exc)}, time.monotonic() - start
    first = results[0]
    summary = {"losses": first["losses"], "plan": first["plan"], "first_step": first.get("first_step")}
    return 0, summary, time.monotonic() - start


def stopped_and_resumed(plan: Path, tmp: Path, stop: int, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A job that checkpoints every 2 steps and stops at ``stop``, then the same job run on to ``steps``, which
    resumes from the checkpoint; the parameters go to ``tmp / "params"`` (for ``assert_parity``). Their summaries."""
    options = {"rebalance": False, "checkpoint_dir": str(tmp / "ckpt"), "checkpoint_every": 2}
    env = {"PLANNER_TEST_PARAMS_OUT": str(tmp / "params")}
    code, first, _ = job(plan, stop, options, env=env)
    assert code == 0, first
    code, second, _ = job(plan, steps, options, env=env)
    assert code == 0, second
    assert second["first_step"] == stop and second["losses"][:stop] == pytest.approx(first["losses"], rel=1e-6)
    return first, second


def reference_losses(plan: Path, steps: int) -> list[float]:
    """The same training in one process (the pipeline's parity baseline)."""
    import torch

    from planner.runtime.launch.prepare import prepare
    from planner.runtime.pipeline.training import train_reference
    from planner.runtime.launch.config import RunConfig

    config = RunConfig(plan=str(plan), model=MODEL, steps=steps)
    prepared = prepare(config, 2, torch.device("cpu"))
    return list(train_reference(prepared.module, prepared.spec, prepared.settings, prepared.batch, steps).losses)


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a rendezvous the test starts next)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def emulated_hosts(runs: list[tuple[list[str], Path, dict[str, str]]], timeout_s: float) -> list[tuple[int, str, str]]:
    """Run one command per emulated host at once (``(command, cwd, env)``: a torchrun agent each), and return each one's
    exit status, stdout and stderr; every process is killed when the wait ends, however it ends."""
    import subprocess

    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, cwd, env in runs]
    try:
        outputs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
