"""Issue 11: what a new user hit in a trial run, one test per item, each reproducing the command.

Every refusal must end as one ``error:`` line, a non-zero exit, no traceback and no partial file.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app

ROOT = Path(__file__).resolve().parent.parent
GPT_TINY = ROOT / "tests" / "golden" / "profiles" / "gpt_tiny.json"
runner = CliRunner()


def run(*args: str | Path) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def plan_cli(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed command in a fresh process (what a user runs; output at the file-descriptor level)."""
    return subprocess.run([sys.executable, "-c", "from planner.cli import main; main()", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# 1. `plan partition -m ilp --json` printed HiGHS's banner before the JSON.
def test_1_ilp_json_is_one_json_document(tmp_path: Path) -> None:
    done = plan_cli("partition", GPT_TINY, "--cluster", "a100-4", "-m", "ilp", "--json", "-o", tmp_path / "p.json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["method"] == "ilp" and "HiGHS" not in done.stdout.split("{", 1)[0]


# 7. YAML clusters: 12.0e9 is a number, a one-host cluster needs no inter_host, advice fits a hand-written file.
def test_7_hand_written_yaml_cluster(tmp_path: Path) -> None:
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("schema_version: 1\nname: lab\ndevices:\n"
                       "  - {id: g0, type: a100-80g, host: box, memory_bytes: 80e9}\n"
                       "  - {id: g1, type: v100-32g, host: box, memory_bytes: 32e9}\n"
                       "links:\n  intra_host: {bandwidth_Bps: 12.0e9, latency_s: 5.0e-6}\n")
    code, out, err = run("partition", GPT_TINY, "--cluster", cluster, "-o", tmp_path / "plan.json")
    assert code == 0, err
    cluster.write_text(cluster.read_text().replace("host: box, memory_bytes: 32e9", "host: other, memory_bytes: 32e9"))
    code, _, err = run("partition", GPT_TINY, "--cluster", cluster, "-o", tmp_path / "two-hosts.json")
    line = one_error_line(err)
    assert code == 1 and "links.inter_host" in line and "2 hosts" in line and "regenerate" not in line
    assert not (tmp_path / "two-hosts.json").exists()
    cluster.write_text(cluster.read_text().replace("bandwidth_Bps: 12.0e9", "bandwidth_Bps: fast"))
    line = one_error_line(run("partition", GPT_TINY, "--cluster", cluster)[2])
    assert "bandwidth_Bps" in line and "fix that field in the cluster file" in line


# 8. An infeasible memory budget under dp names the least memory any split needs, the capacity and the stage.
@pytest.mark.parametrize("method", ["dp", "ilp", "greedy"])
def test_8_infeasible_memory_gives_sizes(tmp_path: Path, method: str) -> None:
    cluster = tmp_path / "tight.json"
    cluster.write_text(json.dumps({"schema_version": 1, "name": "tight", "links": {
        "intra_host": {"bandwidth_Bps": 1e10, "latency_s": 1e-6}}, "devices": [
        {"id": f"g{i}", "type": "cpu", "host": "h", "memory_bytes": 729446} for i in range(2)]}))
    code, _, err = run("partition", GPT_TINY, "--cluster", cluster, "-m", method, "-s", "gpipe", "-n", "8",
                       "-o", tmp_path / "plan.json")
    line = one_error_line(err)
    assert code == 1 and "least memory" in line and "818688 bytes" in line and "729446 bytes" in line
    assert "on stage 0 (blocks 0-" in line
    assert not (tmp_path / "plan.json").exists()


# 12. A plan carrying measured speed factors says so, and check notes that the two plans assume different speeds.
def test_12_speed_factors_are_shown_and_checked(tmp_path: Path) -> None:
    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.formats.plan import save_plan
    from planner.formats.profile import load_profile
    from planner.partition import partition

    profile, cluster = load_profile(GPT_TINY), load_cluster_spec("cpu-2")
    args = dict(method="dp", microbatches=4, schedule="1f1b", catalog=load_catalog())
    save_plan(partition(profile, cluster, **args), tmp_path / "base.json")
    save_plan(partition(profile, cluster, speed_factors={"cpu1": 2.0}, **args), tmp_path / "measured.json")
    code, out, _ = run("show", tmp_path / "measured.json", "--no-files")
    flat = " ".join(out.split())
    assert code == 0 and "measured speed factors" in flat and "cpu1 x2.00" in flat
    code, out, _ = run("check", tmp_path / "measured.json", "--baseline", tmp_path / "base.json",
                       "--profile", GPT_TINY, "--tolerance", "1000%")
    assert code == 0
    assert "different device speeds" in " ".join(out.split()) and "cpu1 x2.00" in " ".join(out.split())


# 13. The --live table's last line ends with a newline, so the summary starts on its own line.
def test_13_live_table_ends_with_a_newline() -> None:
    from rich.console import Console

    from planner.report.rounds import LiveRounds

    sink = io.StringIO()
    live = LiveRounds(Console(file=sink, force_terminal=True, width=100))
    live.start()
    live.update([{"round": 0, "first_step": 0, "steps": 2, "step_time_s": 0.5, "imbalance": 0.1,
                  "plan_changed": False, "converged": False, "devices": {"cpu0": {"compute_s": 1, "wait_s": 0}}}])
    live.stop()
    assert sink.getvalue().endswith("\n")


# 14. Every option of every command is in the docs (--granularity was missing from docs/commands.md).
@pytest.mark.parametrize("command, page", [("partition", "commands.md"), ("show", "commands.md"),
                                           ("check", "commands.md"), ("diff", "commands.md"),
                                           ("run", "run.md"), ("profile", "profiling.md")])
def test_14_every_option_is_documented(command: str, page: str) -> None:
    import typer.main

    group = typer.main.get_command(app)
    options = [name for param in group.commands[command].params for name in param.opts if name.startswith("--")]
    text = (ROOT / "docs" / page).read_text()
    import re

    missing = [name for name in options if name != "--help" and not re.search(rf"`[^`]*(?<![\w-]){re.escape(name)}(?![\w-])", text)]
    assert missing == [], f"docs/{page} does not document {missing}"


# 5. A plan made for A100s ran on CPU ranks without a word; now it is refused unless --allow-device-mismatch.
def test_5_a_plan_for_other_devices_is_refused_unless_allowed(tmp_path: Path) -> None:
    from planner.app.run import run_config
    from planner.runtime.launch.prepare import preflight

    code, _, err = run("partition", GPT_TINY, "--cluster", "a100-4", "-m", "dp", "-n", "4", "-o", tmp_path / "plan.json")
    assert code == 0, err
    code, _, err = run("run", tmp_path / "plan.json", "planner.examples.gpt:gpt_tiny", "--steps", "2")
    line = one_error_line(err)
    assert code == 1 and "made for a100-80g devices but the ranks run on cpu" in line and "--allow-device-mismatch" in line
    allowed = run_config(plan=str(tmp_path / "plan.json"), model="planner.examples.gpt:gpt_tiny", steps=2, round_steps=1,
                         timeout_s=30, options={}, allow_device_mismatch=True)
    assert preflight(allowed) >= 1


# 10. Usage errors of every command come at once, before torch is imported.
@pytest.mark.parametrize("args", [["run", "plan.json", "m:f", "--steps", "0"],
                                  ["partition", "p.json", "-c", "cpu-2", "-n", "0"],
                                  ["profile", "m:f", "--repeats", "0"],
                                  ["profile", "m:f", "--estimate", "h900"],
                                  ["check", "p.json", "--tolerance", "bad"],
                                  ["run", "plan.json", "m:f", "--emulate-slowdown", "x"]])
def test_10_usage_errors_come_before_torch_is_imported(args: list[str]) -> None:
    script = ("import sys\nfrom planner.cli import main\nsys.argv = ['plan'] + sys.argv[1:]\n"
              "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
              "print('torch' in sys.modules, code)")
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "2"], (done.stdout, done.stderr)
    one_error_line(done.stderr)


def _profile_and_plan(tmp_path: Path, model: str, *extra: str) -> tuple[int, str, Path]:
    code, out, err = run("profile", model, "-o", tmp_path / "profile.json", "--repeats", "1", "--warmup", "0", *extra)
    assert code == 0, err
    code, _, perr = run("partition", tmp_path / "profile.json", "--cluster", "cpu-2", "-o", tmp_path / "plan.json")
    assert code == 0, perr
    return code, out + err, tmp_path / "plan.json"


# 3. A --data factory with the wrong signature, one that raises, or batches that do not fit the model:
#    checked once in the launcher, before ranks start, as one line.
FACTORIES = '''
import torch
def no_batch_size(seed, step): return torch.zeros(8, 16, dtype=torch.int64), None
def positional_only(seed, step, batch_size, /): return torch.zeros(batch_size, 16, dtype=torch.int64), None
def wrong_shape(seed, step, batch_size): return torch.zeros(batch_size, 3, 5), None
def raises(seed, step, batch_size): raise FileNotFoundError("data.bin")
def float_target(seed, step, batch_size): return torch.zeros(batch_size, 16, dtype=torch.int64), torch.zeros(3)
'''


@pytest.mark.parametrize("factory, words", [
    ("no_batch_size", "must accept the keyword arguments seed, step, batch_size, but its signature is no_batch_size(seed, step)"),
    ("positional_only", "signature is positional_only(seed, step, batch_size, /)"),
    ("wrong_shape", "returned input 0 as float32[16, 3, 5]; the profiled model takes int64[16, 16]"),
    ("raises", "raised FileNotFoundError: data.bin"),
    ("float_target", "a target of float32[3]; a language model trains on next-token ids of int64[16, 16]"),
])
def test_3_a_bad_data_factory_is_one_line_before_ranks_start(tmp_path: Path, factory: str, words: str) -> None:
    (tmp_path / "batches.py").write_text(FACTORIES)
    code, _, err = run("partition", GPT_TINY, "--cluster", "cpu-2", "-o", tmp_path / "plan.json")
    assert code == 0, err
    done = plan_cli("run", tmp_path / "plan.json", "planner.examples.gpt:gpt_tiny", "--steps", "2",
                    "--profile", GPT_TINY, "--data", f"{tmp_path / 'batches.py'}:{factory}", timeout=120)
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and words in line and "starting" not in done.stdout, line


# 4. A model whose forward returns a dict or tuple: flagged at profile, trained with --model-output.
MULTI_OUTPUT = '''
import torch
from torch import nn
class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4)
    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"logits": self.head(h), "hidden": h}
class Pair(Heads):
    def forward(self, x):
        out = super().forward(x)
        return out["logits"], out["hidden"]
def heads(): return Heads(), (torch.randn(4, 8),)
def pair(): return Pair(), (torch.randn(4, 8),)
'''


@pytest.mark.parametrize("factory, selector, kind", [("heads", "logits", "a dict with keys 'logits', 'hidden'"),
                                                     ("pair", "0", "a tuple of 2")])
def test_4_several_outputs_are_flagged_at_profile_and_named_with_model_output(
        tmp_path: Path, factory: str, selector: str, kind: str) -> None:
    from planner.app.run import run_config
    from planner.runtime.launch.prepare import preflight

    (tmp_path / "heads.py").write_text(MULTI_OUTPUT)
    model = f"{tmp_path / 'heads.py'}:{factory}"
    _, said, plan = _profile_and_plan(tmp_path, model)
    assert f"warning: the model returns {kind}; plan run trains on one tensor" in " ".join(said.split())
    code, _, err = run("run", plan, model, "--steps", "2")
    line = one_error_line(err)
    assert code == 1 and f"the model returns {kind}" in line and "--model-output KEY|INDEX" in line
    code, _, err = run("profile", model, "-o", tmp_path / "bad.json", "--model-output", "nope")
    line = one_error_line(err)
    assert code == 1 and "does not select an output" in line and not (tmp_path / "bad.json").exists()
    _, said, plan = _profile_and_plan(tmp_path, model, "--model-output", selector)
    assert "warning" not in said
    assert json.loads((tmp_path / "profile.json").read_text())["model"]["output"] == selector
    config = run_config(plan=str(plan), model=model, steps=2, round_steps=1, timeout_s=30, options={})
    assert preflight(config) == 2


# 9. A plan from an fx-traced profile: the run captures with the profile's tracer (it used to fail with
#    "graph does not match profile"); a graph that does not match names the tracers.
def test_9_an_fx_profile_runs_with_its_tracer(tmp_path: Path) -> None:
    from planner.app.run import run_config
    from planner.errors import PlanMismatchError
    from planner.formats.profile import load_profile
    from planner.profile.capture import capture
    from planner.profile.loader import load_factory
    from planner.runtime.launch.prepare import preflight
    from planner.runtime.pipeline.training import check_graph

    _, _, plan = _profile_and_plan(tmp_path, "planner.examples.gpt:gpt_tiny", "--tracer", "fx")
    config = run_config(plan=str(plan), model="planner.examples.gpt:gpt_tiny", steps=2, round_steps=1,
                        timeout_s=30, options={})
    assert preflight(config) == 2
    module, example = load_factory("planner.examples.gpt:gpt_tiny")
    profile = load_profile(tmp_path / "profile.json")
    with pytest.raises(PlanMismatchError, match="the profile was traced with fx, this graph with export"):
        check_graph(capture(module, example, "export"), profile, 2, "profile")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_9_an_fx_profile_trains_on_two_ranks(tmp_path: Path) -> None:
    _, _, plan = _profile_and_plan(tmp_path, "planner.examples.gpt:gpt_tiny", "--tracer", "fx")
    done = plan_cli("run", plan, "planner.examples.gpt:gpt_tiny", "--steps", "2", "--round-steps", "1",
                    "--timeout-s", "60", "--json", timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
