"""How long the shape search takes (``--data-parallel auto``), against issue 27's targets.

Three rows of targets, each timed in this process (planning only; profiles are loaded first):

- **Hugging Face models on up to 16 devices** (target: under 5 s): gpt2_small, bert_small and llama_small (profiles
  ``bench/.cache/NAME.json``, shared with bench/suite.py; measured if absent) on a100-4, dgx-h100-8,
  mixed-3type-2host and a100-2x8-ib, ``plan partition --method greedy -n 8 -s 1f1b --data-parallel auto``, the
  same with ``--method dp`` (``plan partition``'s default); and
  ``plan train``'s whole strategy search (schedule and micro-batches auto under a global batch of 8 example
  batches, ``--refine``, asynchronous schedules priced for its default rounds of ``--round-steps``) beside it;
- **64 devices of 3 types, a 1,000-op model** (target: under 10 s): the synthetic transformer of
  bench/synthetic.py on 8 hosts of 8 (H100, A100, V100 by host), 64 micro-batches, greedy;
- **512 identical devices** (target: under 30 s): the same model on 64 hosts of 8 H100, 64 micro-batches, greedy.

    python3 bench/scale.py                  # writes docs/bench-scale.md
    python3 bench/scale.py --output /tmp/s.md --models gpt2_small
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

from _paths import REPO  # first: the repository on sys.path, bench/ last (see bench/_paths.py)

from planner.app.partition import partition_file  # noqa: E402
from planner.app.train import TrainRequest  # noqa: E402
from planner.clusters import load_cluster_spec  # noqa: E402
from planner.formats.catalog import load_catalog  # noqa: E402
from planner.formats.profile import save_profile  # noqa: E402
from planner.partition import partition  # noqa: E402

HF_MODELS = ("gpt2_small", "bert_small", "llama_small")
HF_CLUSTERS = ("a100-4", "dgx-h100-8", "mixed-3type-2host", "a100-2x8-ib")
TARGETS = {"hf": 5.0, "mixed64": 10.0, "identical512": 30.0}
TRAIN_ROUND_STEPS = TrainRequest.__dataclass_fields__["round_steps"].default
"""``plan train``'s default rounds: its search prices the asynchronous schedules for them."""


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def verdict(seconds: float, target: float) -> str:
    """"meets 5 s" or "misses 5 s"."""
    return f"{'meets' if seconds < target else 'misses'} {target:.0f} s"


def hf_rows(models: tuple[str, ...], work: Path) -> list[str]:
    import suite

    rows = []
    for name in models:
        profile = suite.cached_profile(name)
        path = work / f"{name}.json"
        save_profile(profile, path)
        global_batch = 8 * int(profile.model.get("microbatch_size") or 1)
        for cluster in HF_CLUSTERS:
            shape, shape_s = timed(lambda: partition_file(path, cluster, None, method="greedy", microbatches=8,
                                                          schedule="1f1b", data_parallel="auto"))
            exact, exact_s = timed(lambda: partition_file(path, cluster, None, method="dp", microbatches=8,
                                                          schedule="1f1b", data_parallel="auto"))
            whole, whole_s = timed(lambda: partition_file(path, cluster, None, method="greedy", microbatches="auto",
                                                          global_batch=global_batch, schedule="auto",
                                                          data_parallel="auto", refine=True,
                                                          round_steps=TRAIN_ROUND_STEPS))
            devices = len(load_cluster_spec(cluster).devices)
            rows.append(f"| {name} | {cluster} ({devices}) | {len(profile.nodes)} | {shape_s:.1f} s "
                        f"({verdict(shape_s, TARGETS['hf'])}) | "
                        f"{len(shape.stages)}x{shape.shape().degree} | {exact_s:.1f} s "
                        f"({verdict(exact_s, TARGETS['hf'])}) | "
                        f"{len(exact.stages)}x{exact.shape().degree} | {whole_s:.1f} s | {whole.schedule}, "
                        f"{whole.microbatches} x {whole.extra.get('microbatch_size')}, "
                        f"{len(whole.stages)}x{whole.shape().degree} |")
            print(rows[-1], flush=True)
    return rows


def synthetic_rows() -> list[str]:
    from synthetic import synthetic_cluster, transformer_like

    rows = []
    for key, devices, types in (("mixed64", 64, ("h100-sxm", "a100-80g", "v100-32g")),
                                ("identical512", 512, ("h100-sxm",))):
        profile = transformer_like(1000, device_types=types)
        cluster = synthetic_cluster(devices, device_types=types)
        plan, seconds = timed(lambda: partition(profile, cluster, method="greedy", microbatches=64, schedule="1f1b",
                                                data_parallel="auto", catalog=load_catalog()))
        target = TARGETS[key]
        rows.append(f"| {devices} devices of {len(types)} type(s) | 1000 | {seconds:.1f} s "
                    f"({verdict(seconds, target)}) | "
                    f"{len(plan.stages)}x{plan.shape().degree} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(HF_MODELS))
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "bench-scale.md")
    args = parser.parse_args()
    import tempfile

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        hf = hf_rows(tuple(args.models), Path(work))
    synthetic = synthetic_rows()
    elapsed = time.perf_counter() - started
    lines = ["# How long the shape search takes", "", "<!-- generated by bench/scale.py; do not edit by hand -->", "",
             f"Command: `python3 bench/scale.py` ({elapsed:.0f} s on {platform.machine()}, {os.cpu_count()} cores; "
             f"1-minute load {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end). Planning time "
             f"only (profiles loaded first), one process. Targets from issue 27: auto shape under 5 s for 16 devices "
             f"or fewer on the Hugging Face models, under 10 s for 64 devices of 3 types and a 1,000-op model, under "
             f"30 s for 512 identical devices.", "",
             "## Hugging Face models, up to 16 devices", "",
             "Shape: `--method greedy -n 8 -s 1f1b --data-parallel auto` (greedy: `plan train`'s placer); dp: the "
             "same with `--method dp`, `plan partition`'s default (the exact placer, its guard and polish on every "
             "pipeline the search tries). Whole strategy: what `plan train` searches "
             "(`-n auto --global-batch` 8 example batches, `-s auto`, `--data-parallel auto`, `--refine`: every "
             f"candidate planned, the 3 fastest refined; `--round-steps {TRAIN_ROUND_STEPS}`: an asynchronous "
             "schedule pays a fill and drain per round).", "",
             "| model | cluster (devices) | ops | shape search | shape | dp shape search | dp shape | whole strategy | "
             "chosen |",
             "|---|---|---:|---:|---|---:|---|---:|---|", *hf, "",
             "## Synthetic, 64 and 512 devices", "",
             "`transformer_like(1000)` of bench/synthetic.py, `--method greedy -n 64 -s 1f1b --data-parallel auto`.",
             "", "| cluster | ops | shape search | shape |", "|---|---:|---:|---|", *synthetic, ""]
    args.output.write_text("\n".join(lines))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
