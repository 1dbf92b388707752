"""Our split against torchtitan's default split, both simulated, for plans exported with ``plan export --to torchtitan``.

torchtitan 0.3.0 without ``module_fqns_per_model_part`` splits an LLM evenly by layer count, counting the
input embeddings and the output norm + head as one layer each (``pipeline_parallel_first_stage_less_layers``
and ``..._last_stage_less_layers`` = 1: "first and last stage one layer less"; its
``generate_llm_fqn_per_model_part``), stage i on rank i. ``torchtitan_default`` reproduces that rule on our
profile's layers; both plans are simulated by the same cost model at layer granularity, 1F1B with 8
micro-batches, and ours is dp at ``--granularity layer`` (what ``plan export`` can express).

Models: the bundled GPT-style decoder (``gpt_small``, 6 layers) and a Hugging Face Llama from a config
(``llama_deep``, 12 layers); clusters: ``dgx-h100-8`` (identical GPUs) and ``mixed-3type-2host`` (H100, A100,
V100, L4 over two hosts). Profiles are measured on this machine's CPU with roofline estimates for the
GPU types (docs/profiling.md). Writes docs/bench-export.md.

    python3 bench/export.py
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

from _paths import REPO  # first: the repository on sys.path

from planner.app.export import module_parts  # noqa: E402
from planner.clusters import resolve_cluster  # noqa: E402
from planner.examples import BUNDLED  # noqa: E402
from planner.formats.catalog import load_catalog  # noqa: E402
from planner.formats.cluster import load_cluster  # noqa: E402
from planner.formats.profile import Profile, load_profile, save_profile  # noqa: E402
from planner.partition import partition  # noqa: E402
from planner.partition.model.cost import evaluate  # noqa: E402
from planner.partition.model.granularity import groups_for  # noqa: E402
from planner.partition.model.problem import StageSpec, build_problem, layer_of  # noqa: E402

MODELS = ("gpt_small", "llama_deep")
CLUSTERS = ("dgx-h100-8", "mixed-3type-2host")
MICROBATCHES = 8
CACHE = REPO / "bench" / ".cache" / "export"
OUTPUT = REPO / "docs" / "bench-export.md"


def profile_of(name: str) -> Profile:
    from planner.profile import profile_model

    path = CACHE / f"{name}.profile.json"
    if not path.is_file():
        catalog = load_catalog()
        CACHE.mkdir(parents=True, exist_ok=True)
        save_profile(profile_model(BUNDLED[name], estimate=tuple(catalog), repeats=3, warmup=1), path)
    return load_profile(path)


def torchtitan_default(layers: list[str], stages: int) -> list[list[str]]:
    """torchtitan's even split: embeddings and the output count as one layer each; extra layers go to the first
    stages. ``layers`` are the repeated layers in order; the returned lists hold indices into them."""
    effective = len(layers) + 2
    per, extra = divmod(effective, stages)
    if per == 0:
        raise ValueError(f"{stages} stages for {effective} effective layers")
    out, current = [], 0
    for k in range(stages):
        take = per + (1 if k < extra else 0) - (1 if k in (0, stages - 1) else 0)
        out.append(layers[current:current + take] if k < stages - 1 else layers[current:])
        current += take
    return out


def compare(name: str, cluster_name: str) -> dict[str, Any]:
    profile, cluster, catalog = profile_of(name), load_cluster(resolve_cluster(cluster_name)), load_catalog()
    ours = partition(profile, cluster, method="dp", microbatches=MICROBATCHES, schedule="1f1b", granularity="layer",
                     catalog=catalog)
    problem = build_problem(profile, cluster, microbatches=MICROBATCHES, schedule="1f1b",
                            groups=groups_for(profile, "layer"), catalog=catalog)
    repeated = list(dict.fromkeys(layer for layer in (layer_of(n.module_path) for n in profile.nodes)
                                  if re.search(r"\.\d+$", layer)))  # the repeated layers, in order
    split = torchtitan_default(repeated, len(cluster.devices))
    first_block, end_block = {}, {}
    for b, block in enumerate(problem.blocks):
        for layer in block.layers:
            first_block.setdefault(layer, b)
            end_block[layer] = b + 1
    cuts, taken = [], []
    for part in split[1:]:  # a stage begins at its first layer; the last may hold only the output modules
        taken += part
        cuts.append(first_block[part[0]] if part else end_block[taken[-1] if taken else repeated[-1]])
    bounds = [0, *cuts, len(problem.blocks)]
    devices = cluster.device_ids
    titan = tuple(StageSpec(a, b, devices[k]) for k, (a, b) in enumerate(zip(bounds, bounds[1:])))
    titan_s = evaluate(problem, titan, record_events=False).step_time_s
    return {"model": name, "cluster": cluster_name, "layers": len(repeated), "stages": len(cluster.devices),
            "ours_s": ours.step_time_s, "ours_stages": len(ours.stages), "titan_s": titan_s,
            "titan_split": [len(p) for p in split], "ours_parts": module_parts(ours, profile)}


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["# Our split against torchtitan's default split", "",
             "<!-- generated by bench/export.py; do not edit by hand -->", "",
             f"Reproduce: `python3 bench/export.py`. Profiles measured on this machine ({platform.machine()}, "
             f"{os.cpu_count()} cores) with roofline estimates for the GPU types; both plans simulated by the same "
             f"cost model at layer granularity, 1F1B, {MICROBATCHES} micro-batches. torchtitan's default: layers "
             f"split evenly with the embeddings and the output counted as one layer each, stage i on rank i. Ours: "
             f"`plan partition --method dp --granularity layer`, exported with `plan export --to torchtitan`. "
             f"No training was run: these are simulated step times.", "",
             "| model | cluster | layers | torchtitan default: layers per stage | its step | ours: stages | our step | "
             "ours / default |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['cluster']} | {r['layers']} | {r['titan_split']} | "
                     f"{r['titan_s'] * 1e3:.3f} ms | {r['ours_stages']} | {r['ours_s'] * 1e3:.3f} ms | "
                     f"{r['ours_s'] / r['titan_s']:.2f} |")
    lines += ["", "Our `module_fqns_per_model_part` (`plan export --to torchtitan`), per row:", ""]
    for r in rows:
        lines += [f"- {r['model']} on {r['cluster']}: `{r['ours_parts']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    rows = [compare(name, cluster) for name in MODELS for cluster in CLUSTERS]
    OUTPUT.write_text(render(rows))
    print(OUTPUT.read_text())


if __name__ == "__main__":
    main()
