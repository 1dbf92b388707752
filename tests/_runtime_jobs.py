"""Helpers for the multi-process runtime tests: tiny-GPT plans, a launched job, the reference losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
         env: dict[str, str] | None = None, limit_s: float = 240, nproc: int = 2) -> tuple[int, dict[str, Any], float]:
    cmd = [sys.executable, str(ROOT / "tests" / "_run_job.py"), str(plan), MODEL, str(steps), "2", str(timeout_s),
           str(restarts), json.dumps(options), str(nproc)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})})
    elapsed = time.monotonic() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no summary (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.returncode, json.loads(lines[-1]), elapsed


def reference_losses(plan: Path, steps: int) -> list[float]:
    """The same training in one process (the pipeline's parity baseline)."""
    import torch

    from planner.runtime.launch.prepare import prepare
    from planner.runtime.pipeline.training import train_reference
    from planner.runtime.launch.config import RunConfig

    config = RunConfig(plan=str(plan), model=MODEL, steps=steps)
    prepared = prepare(config, 2, torch.device("cpu"))
    return list(train_reference(prepared.module, prepared.spec, prepared.settings, prepared.batch, steps).losses)
