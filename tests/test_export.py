"""Issue 18 (part): plan export to torchtitan's parallelism table and torch.distributed.pipelining's split_spec."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "tests" / "golden" / "profiles"
runner = CliRunner()


def _plan(tmp_path: Path, model: str, cluster: str, *extra: str) -> Path:
    out = tmp_path / f"{model}-{cluster}.json"
    result = runner.invoke(app, ["partition", str(PROFILES / f"{model}.json"), "--cluster", cluster, "-d", "1", "-n", "8",
                                 "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("model, factory, cluster", [("resnet_small", "planner.examples.resnet:resnet_small", "a100-4"),
                                                     ("unet_small", "planner.examples.unet:unet_small", "t4-4-pcie"),
                                                     ("gpt_tiny", "planner.examples.gpt:gpt_tiny", "a100-4")])
def test_the_module_lists_cover_every_parameter_once_in_stage_order(tmp_path: Path, model: str, factory: str,
                                                                   cluster: str) -> None:
    from planner.profile.loader import load_factory

    plan = _plan(tmp_path, model, cluster, "--granularity", "layer")
    result = runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "-o", str(tmp_path / "p.toml")])
    assert result.exit_code == 0, result.output
    table = tomllib.loads((tmp_path / "p.toml").read_text())["parallelism"]
    parts = table["module_fqns_per_model_part"]
    stages = json.loads(plan.read_text())["stages"]
    assert len(parts) == len(stages) and table["pipeline_parallel_degree"] == len({s["device"] for s in stages})
    assert table["pipeline_parallel_schedule"] == "1F1B"
    module, _ = load_factory(factory)
    owners: dict[int, list[int]] = {}
    for k, part in enumerate(parts):
        for fqn in part:
            for _, param in module.get_submodule(fqn).named_parameters():
                owners.setdefault(id(param), []).append(k)
    shared = {id(p) for n, p in module.named_parameters(remove_duplicate=False)
              if sum(1 for _, q in module.named_parameters(remove_duplicate=False) if q is p) > 1}
    for name, param in module.named_parameters():
        stages_of = owners.get(id(param), [])
        assert stages_of, f"{name} is in no stage"
        assert len(stages_of) == 1 or id(param) in shared, (name, stages_of)  # a tied weight sits where it is used
    from planner.formats.profile import load_profile

    tensors = dict(module.named_parameters(remove_duplicate=False))
    order = [min(owners[id(tensors[n])]) for node in load_profile(PROFILES / f"{model}.json").nodes
             for n in node.params if n in tensors]
    assert order == sorted(order)  # in execution order, every parameter's stage comes after the ones before it


@pytest.mark.parametrize("recompute, mode", [("off", "none"), ("on", "full")])
def test_recomputation_maps_to_torchtitans_activation_checkpointing(tmp_path: Path, recompute: str, mode: str) -> None:
    plan = _plan(tmp_path, "gpt_tiny", "a100-4", "--granularity", "layer", "--recompute", recompute)
    stages = json.loads(plan.read_text())["stages"]
    assert [s.get("recompute", "none") for s in stages] == [mode] * len(stages)
    result = runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "-o", str(tmp_path / "p.toml")])
    assert result.exit_code == 0, result.output
    assert tomllib.loads((tmp_path / "p.toml").read_text())["activation_checkpoint"] == {"mode": mode}


def test_a_plan_recomputing_some_stages_exports_full_and_names_them(tmp_path: Path) -> None:
    """torchtitan applies one mode to every stage: full (never more memory than the plan), with the plan's
    recomputing stages named in a comment and in the JSON."""
    plan = _plan(tmp_path, "gpt_tiny", "a100-4", "--granularity", "layer")
    doc = json.loads(plan.read_text())
    doc["stages"][1]["recompute"] = "full"
    plan.write_text(json.dumps(doc))
    result = runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "-o", str(tmp_path / "p.toml")])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "p.toml").read_text()
    assert tomllib.loads(text)["activation_checkpoint"] == {"mode": "full"}
    assert f"# the plan recomputes stages [1] of {len(doc['stages'])}" in text
    result = runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "--json"])
    assert json.loads(result.stdout)["recomputed_stages"] == [1]


def test_pipelining_split_spec_begins_each_later_stage(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "gpt_tiny", "a100-4", "--granularity", "layer")
    result = runner.invoke(app, ["export", str(plan), "--to", "pipelining", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert list(data["split_spec"]) == [part[0] for part in data["stages"][1:]]
    assert set(data["split_spec"].values()) == {"BEGINNING"}
    snippet = runner.invoke(app, ["export", str(plan), "--to", "pipelining"]).stdout
    compile(snippet, "snippet", "exec")


def test_a_cut_inside_a_module_is_one_line_with_the_cost_of_cutting_at_layers(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "gpt_tiny", "a100-4")  # --granularity op cuts inside blocks
    result = runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "-o", str(tmp_path / "p.toml")])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: the plan cuts inside module")
    assert "--granularity layer (dp at layer granularity simulates" in lines[0] and "ms per step" in lines[0]
    assert not (tmp_path / "p.toml").exists()
    bad = runner.invoke(app, ["export", str(plan), "--to", "deepspeed"])
    assert bad.exit_code == 2 and "--to must be one of torchtitan, pipelining, schedule-csv" in bad.output


@pytest.mark.parametrize("cluster, schedule", [("a100-4", "1f1b"), ("a100-4", "gpipe"), ("a100-4", "interleaved-1f1b")])
def test_the_schedule_csv_is_the_simulated_order_in_torchs_action_format(tmp_path: Path, cluster: str,
                                                                         schedule: str) -> None:
    from torch.distributed.pipelining.schedules import _Action

    plan = _plan(tmp_path, "gpt_tiny", cluster, "-s", schedule)
    result = runner.invoke(app, ["export", str(plan), "--to", "schedule-csv", "-o", str(tmp_path / "s.csv")])
    assert result.exit_code == 0, result.output
    stages = json.loads(plan.read_text())["stages"]
    devices = list(dict.fromkeys(s["device"] for s in stages))
    rows = [line.split(",") for line in (tmp_path / "s.csv").read_text().splitlines()]
    assert len(rows) == len(devices)
    for rank, row in enumerate(rows):
        actions = [_Action.from_str(a) for a in row]
        held = {k for k, s in enumerate(stages) if s["device"] == devices[rank]}
        assert {a.stage_index for a in actions} == held
        for k in held:  # every micro-batch once forward and once backward, forward first
            fwd = [a.microbatch_index for a in actions if a.stage_index == k and a.computation_type.value == "F"]
            bwd = [a.microbatch_index for a in actions if a.stage_index == k and a.computation_type.value == "B"]
            assert sorted(fwd) == sorted(bwd) == list(range(8))
            assert all(row.index(f"{k}F{j}") < row.index(f"{k}B{j}") for j in range(8))


def _run_csv(rank: int, world: int, plan_path: str, csv_path: str, out: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    import planner
    from planner.data.digits import batches
    from planner.examples.digits import digits_mlp

    torch.manual_seed(0)
    model, example = digits_mlp()
    plan = planner.load_plan(plan_path)
    pipe = planner.build_pipeline(model.train(), example, plan, rank=rank, loss_fn=F.cross_entropy)
    runtime = _PipelineScheduleRuntime(list(pipe.stages), plan.microbatches, loss_fn=F.cross_entropy, scale_grads=False)
    runtime._load_csv(csv_path)
    x, y = batches(0, 0, plan.microbatches * example[0].shape[0])
    from_csv: list = []
    runtime.step(*((x,) if pipe.is_first else ()), target=y if pipe.is_last else None, losses=from_csv)
    built_in: list = []  # no optimizer step in between: the same parameters, so the same losses
    pipe.schedule.step(*((x,) if pipe.is_first else ()), target=y if pipe.is_last else None, losses=built_in)
    if pipe.is_last:
        Path(out).write_text(json.dumps({"csv": [float(v.detach()) for v in from_csv],
                                         "built_in": [float(v.detach()) for v in built_in]}))


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_the_schedule_csv_runs_one_step_in_torchs_runtime_schedule(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from tests._digits import digits_plan
    from tests._gloo import run_ranks

    result = runner.invoke(app, ["export", str(digits_plan(tmp_path)), "--to", "schedule-csv", "-o", str(tmp_path / "s.csv")])
    assert result.exit_code == 0, result.output
    run_ranks(_run_csv, 2, str(tmp_path / "plan.json"), str(tmp_path / "s.csv"), str(tmp_path / "out.json"),
              timeout_s=150)
    losses = json.loads((tmp_path / "out.json").read_text())
    assert len(losses["csv"]) == 2 and losses["csv"] == pytest.approx(losses["built_in"], rel=1e-6)


TORCHTITAN_0_3_0_PARALLELISM_FIELDS = (  # torchtitan/config/configs.py, ParallelismConfig, torchtitan 0.3.0
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
    "enable_fsdp_symm_mem", "tensor_parallel_degree", "enable_sequence_parallel", "spmd_backend",
    "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size", "context_parallel_degree",
    "context_parallel_load_balancer", "context_parallel_ptrr_mask_key", "expert_parallel_degree")


def _torchtitan_parallelism_config() -> type:
    """torchtitan's ``ParallelismConfig``, loaded from its file: ``pip install torchtitan --no-deps`` leaves out
    what ``torchtitan.config``'s package imports (tyro), and ``configs.py`` itself needs only torch."""
    import importlib.util

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtitan is not installed (pip install torchtitan --no-deps to run this test)")
    path = Path(list(spec.submodule_search_locations)[0]) / "config" / "configs.py"
    if not path.is_file():
        pytest.skip(f"this torchtitan has no {path.name}; the recorded 0.3.0 field list is checked instead")
    loader = importlib.util.spec_from_file_location("_torchtitan_configs", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module.ParallelismConfig


def test_the_torchtitan_export_names_only_fields_of_parallelism_config(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "gpt_tiny", "a100-4", "--granularity", "layer", "-s", "interleaved-1f1b")
    result = runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "--json"])
    assert result.exit_code == 0, result.output
    table = json.loads(result.stdout)["parallelism"]
    assert set(table) <= set(TORCHTITAN_0_3_0_PARALLELISM_FIELDS)
    assert table["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert len(table["module_fqns_per_model_part"]) == len(json.loads(plan.read_text())["stages"])


def test_torchtitans_own_dataclass_takes_the_export(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "unet_small", "t4-4-pcie", "--granularity", "layer")
    table = json.loads(runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "--json"]).stdout)["parallelism"]
    config = _torchtitan_parallelism_config()(**table)
    assert config.module_fqns_per_model_part == table["module_fqns_per_model_part"]
    assert config.pipeline_parallel_degree == table["pipeline_parallel_degree"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hugging_face_llama_exports_modules_that_cover_its_parameters(tmp_path: Path) -> None:
    """HF models sit under a wrapper (``model.model.layers.3``); their container's glue ops are left out."""
    pytest.importorskip("transformers")
    from planner.profile.loader import load_factory

    for args in (["profile", "planner.examples.hf:llama_small", "-o", str(tmp_path / "profile.json"), "--repeats", "1",
                  "--warmup", "0", "--estimate", "a100-80g"],
                 ["partition", str(tmp_path / "profile.json"), "--cluster", "a100-4", "-d", "1", "-g", "layer", "-o",
                  str(tmp_path / "plan.json")],
                 ["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "-o", str(tmp_path / "p.toml")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    parts = tomllib.loads((tmp_path / "p.toml").read_text())["parallelism"]["module_fqns_per_model_part"]
    module, _ = load_factory("planner.examples.hf:llama_small")
    seen: dict[int, int] = {}
    for k, part in enumerate(parts):
        for fqn in part:
            for _, param in module.get_submodule(fqn).named_parameters():
                assert id(param) not in seen or seen[id(param)] == k, fqn  # no parameter in two stages
                seen[id(param)] = k
    missing = [name for name, p in module.named_parameters() if id(p) not in seen]
    assert missing == []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, factory", [("resnet_small", "planner.examples.resnet:resnet_small"),
                                            ("gpt_tiny", "planner.examples.gpt:gpt_tiny")])
def test_the_split_spec_gives_torch_pipeline_stages_with_the_plans_modules(tmp_path: Path, model: str,
                                                                           factory: str) -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    from planner.profile.loader import load_factory

    plan = _plan(tmp_path, model, "a100-4", "--granularity", "layer")
    data = json.loads(runner.invoke(app, ["export", str(plan), "--to", "pipelining", "--json"]).stdout)
    module, example = load_factory(factory)
    tied = {name for name, p in module.named_parameters(remove_duplicate=False)
            if sum(1 for _, q in module.named_parameters(remove_duplicate=False) if q is p) > 1}
    pipe = pipeline(module, mb_args=tuple(example), split_spec={k: SplitPoint.BEGINNING for k in data["split_spec"]})
    assert pipe.num_stages == len(data["stages"])
    for k, part in enumerate(data["stages"]):
        names = [n for n, _ in pipe.get_stage_module(k).named_parameters() if n not in tied]
        owners = {next((fqn for fqn in part if n.startswith(fqn + ".")), None) for n in names}
        assert None not in owners, (k, names)  # every parameter of torch's stage k is in the plan's stage k


def test_an_interleaved_plan_exported_as_a_single_stage_schedule_is_one_line(tmp_path: Path) -> None:
    """Several stages per device need an interleaved schedule; relabelled 1F1B, every format refuses it."""
    doc = json.loads((ROOT / "tests" / "golden" / "plans" / "gpt_tiny-a100-4-greedy-interleaved.json").read_text())
    devices = [s["device"] for s in doc["stages"]]
    assert doc["schedule"] == "interleaved-1f1b" and len(set(devices)) < len(devices)
    doc["schedule"] = "1f1b"
    (tmp_path / "relabelled.json").write_text(json.dumps(doc))
    for fmt in ("torchtitan", "pipelining", "schedule-csv"):
        done = runner.invoke(app, ["export", str(tmp_path / "relabelled.json"), "--to", fmt,
                                   "--profile", str(PROFILES / "gpt_tiny.json")])
        assert done.exit_code != 0, fmt
        text = " ".join(done.output.split())
        assert "cannot be exported as 1f1b" in text and "Traceback" not in done.output


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-planned", "zb-h2"])
def test_zero_bubble_plans_export_their_recorded_order_and_torchtitans_name(tmp_path: Path, schedule: str) -> None:
    plan = _plan(tmp_path, "gpt_tiny", "a100-4", "-s", schedule, "--granularity", "layer")
    order = json.loads(plan.read_text())["schedule_order"]
    result = runner.invoke(app, ["export", str(plan), "--to", "schedule-csv", "-o", str(tmp_path / "s.csv")])
    assert result.exit_code == 0, result.output
    rows = [line.split(",") for line in (tmp_path / "s.csv").read_text().splitlines()]
    assert rows == [order[k] for k in sorted(order, key=int)]
    assert all(any(a[len(str(r)):].startswith("W") for a in row) for r, row in enumerate(rows))
    titan = runner.invoke(app, ["export", str(plan), "--to", "torchtitan"])
    if schedule == "zb-h1":
        assert titan.exit_code == 0 and '"InterleavedZeroBubble"' in titan.output
    else:
        assert titan.exit_code == 1 and "pipeline_parallel_schedule_csv" in titan.output
        assert len(titan.output.strip().splitlines()) == 1


def test_a_zbv_plan_exports_its_v_to_torchtitan_and_its_order_to_csv(tmp_path: Path) -> None:
    """A ``zbv`` plan with two stages per device names torchtitan's ``ZBVZeroBubble`` with one module list per stage
    (torchtitan lays them out in a V itself); one that kept a stage per device runs ``zb-h1``'s order there."""
    plan = _plan(tmp_path, "resnet_small", "a100-4", "-s", "zbv", "--granularity", "layer")
    doc = json.loads(plan.read_text())
    assert doc["interleave"]["chunks"] == 2 and len(doc["stages"]) == 8
    result = runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "-o", str(tmp_path / "p.toml")])
    assert result.exit_code == 0, result.output
    table = tomllib.loads((tmp_path / "p.toml").read_text())["parallelism"]
    assert table["pipeline_parallel_schedule"] == "ZBVZeroBubble" and table["pipeline_parallel_degree"] == 4
    assert len(table["module_fqns_per_model_part"]) == 8
    result = runner.invoke(app, ["export", str(plan), "--to", "schedule-csv", "-o", str(tmp_path / "s.csv")])
    rows = [line.split(",") for line in (tmp_path / "s.csv").read_text().splitlines()]
    assert rows[0][:2] == ["0F0", "0F1"] and {a[0] for a in rows[0]} == {"0", "7"}  # device 0: stages 0 and 7
    one = _plan(tmp_path, "gpt_tiny", "a100-4", "-s", "zbv", "--granularity", "layer")
    assert json.loads(one.read_text())["interleave"]["chunks"] == 1
    titan = runner.invoke(app, ["export", str(one), "--to", "torchtitan"])
    assert titan.exit_code == 0 and '"InterleavedZeroBubble"' in titan.output


def test_a_dualpipev_plan_exports_torchs_dualpipev_and_its_order_with_whole_backwards(tmp_path: Path) -> None:
    """A ``dualpipev`` plan in a V names torchtitan's ``DualPipeV``; its CSV is torch's order, the paired passes written
    one after the other and the main part's backwards whole (``B``)."""
    plan = _plan(tmp_path, "resnet_small", "a100-4", "-s", "dualpipev", "--granularity", "layer")
    doc = json.loads(plan.read_text())
    assert doc["interleave"]["chunks"] == 2 and len(doc["stages"]) == 8 and doc["microbatches"] >= 8
    result = runner.invoke(app, ["export", str(plan), "--to", "torchtitan", "-o", str(tmp_path / "p.toml")])
    assert result.exit_code == 0, result.output
    table = tomllib.loads((tmp_path / "p.toml").read_text())["parallelism"]
    assert table["pipeline_parallel_schedule"] == "DualPipeV" and len(table["module_fqns_per_model_part"]) == 8
    result = runner.invoke(app, ["export", str(plan), "--to", "schedule-csv", "-o", str(tmp_path / "s.csv")])
    rows = [line.split(",") for line in (tmp_path / "s.csv").read_text().splitlines()]
    assert len(rows) == 4 and any("B" in a for a in rows[0]) and any("I" in a for a in rows[0])
