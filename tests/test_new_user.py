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
from tests._inproc import plan as plan_in_process

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
    done = plan_cli("partition", GPT_TINY, "-d", "1", "--cluster", "a100-4", "-m", "ilp", "--json", "-o", tmp_path / "p.json")
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
    code, out, err = run("partition", GPT_TINY, "-d", "1", "--cluster", cluster, "-o", tmp_path / "plan.json")
    assert code == 0, err
    cluster.write_text(cluster.read_text().replace("host: box, memory_bytes: 32e9", "host: other, memory_bytes: 32e9"))
    code, _, err = run("partition", GPT_TINY, "-d", "1", "--cluster", cluster, "-o", tmp_path / "two-hosts.json")
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
    code, _, err = run("partition", GPT_TINY, "-d", "1", "--cluster", cluster, "-m", method, "-s", "gpipe", "-n", "8",
                       "-o", tmp_path / "plan.json")
    line = one_error_line(err)
    assert code == 1 and "least memory" in line and "854528 bytes" in line and "729446 bytes" in line
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
@pytest.mark.parametrize("command, page", [("partition", "commands.md"), ("show", "commands.md"), ("curves", "commands.md"),
                                           ("export", "commands.md"),
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

    code, _, err = run("partition", GPT_TINY, "-d", "1", "--cluster", "a100-4", "-m", "dp", "-n", "4", "-o", tmp_path / "plan.json")
    assert code == 0, err
    code, _, err = run("run", tmp_path / "plan.json", "planner.examples.gpt:gpt_tiny", "--steps", "2")
    line = one_error_line(err)
    assert code == 1 and "made for a100-80g devices but the ranks run on cpu" in line and "--allow-device-mismatch" in line
    allowed = run_config(plan=str(tmp_path / "plan.json"), model="planner.examples.gpt:gpt_tiny", steps=2, round_steps=1,
                         timeout_s=30, options={}, allow_device_mismatch=True)
    assert preflight(allowed).plan.stages


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
    # uniform layers: two stages whatever a one-repeat profile measured (the default placer may keep a tiny model on
    # one device when its times come out noisy, and test 4 runs a plan of two stages)
    code, _, perr = run("partition", tmp_path / "profile.json", "-d", "1", "--cluster", "cpu-2", "-m", "uniform",
                        "-o", tmp_path / "plan.json")
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
    code, _, err = run("partition", GPT_TINY, "-d", "1", "--cluster", "cpu-2", "-o", tmp_path / "plan.json")
    assert code == 0, err
    done = plan_in_process("run", tmp_path / "plan.json", "planner.examples.gpt:gpt_tiny", "--steps", "2",
                           "--profile", GPT_TINY, "--data", f"{tmp_path / 'batches.py'}:{factory}")
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
    assert len({s.device for s in preflight(config).plan.stages}) == 2


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
    assert len({s.device for s in preflight(config).plan.stages}) == 2
    module, example = load_factory("planner.examples.gpt:gpt_tiny")
    profile = load_profile(tmp_path / "profile.json")
    with pytest.raises(PlanMismatchError, match="the profile was traced with fx, this graph with export"):
        check_graph(capture(module, example, "export"), profile, 2, "profile")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_9_an_fx_profile_trains_on_two_ranks(tmp_path: Path) -> None:
    _, _, plan = _profile_and_plan(tmp_path, "planner.examples.gpt:gpt_tiny", "--tracer", "fx")
    done = plan_in_process("run", plan, "planner.examples.gpt:gpt_tiny", "--steps", "2", "--round-steps", "1",
                           "--timeout-s", "60", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["steps"] == 2 and len(summary["losses"]) == 2


# 2. Ctrl-C during `plan run`: one line, exit 130, every rank stopped, and what the run can resume from.
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_2_ctrl_c_stops_every_rank_and_says_what_resumes(tmp_path: Path) -> None:
    import os
    import signal
    import time

    code, _, err = run("partition", GPT_TINY, "-d", "1", "--cluster", "cpu-2", "-o", tmp_path / "plan.json")
    assert code == 0, err
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", "from planner.cli import main; main()", "run", tmp_path / "plan.json",
                             "planner.examples.gpt:gpt_tiny", "--profile", GPT_TINY, "--steps", "1000000",
                             "--checkpoint-dir", ckpt, "--checkpoint-every", "2", "--timeout-s", "60"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not list(ckpt.glob("step_*/meta.json")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert list(ckpt.glob("step_*/meta.json")), "no checkpoint was written"
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = one_error_line(stderr)
    assert proc.returncode == 130 and "Traceback" not in stderr
    assert line.startswith("error: interrupted; every rank was stopped; the same command resumes from step ")
    deadline = time.monotonic() + 20  # no rank left (spawn's resource tracker may take a moment to follow)
    while subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "processes of the run outlived it"
        time.sleep(0.5)


# 2b. `plan run` from a directory holding a file named like a standard module: the ranks' fork server started as
#     `python -c` there, so the user's profile.py shadowed the `profile` that torch imports, and every rank failed.
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_2b_a_users_profile_py_does_not_break_the_ranks_which_still_import_the_users_model(tmp_path: Path) -> None:
    code, _, err = run("partition", GPT_TINY, "-d", "1", "--cluster", "cpu-2", "-o", tmp_path / "plan.json")
    assert code == 0, err
    (tmp_path / "profile.py").write_text("raise RuntimeError('the user profile.py was imported')\n")
    (tmp_path / "usermodel.py").write_text("from planner.examples.gpt import gpt_tiny as build  # noqa: F401\n")
    done = subprocess.run([Path(sys.executable).parent / "plan", "run", "plan.json", "usermodel.py:build", "--profile",
                           GPT_TINY, "--steps", "2", "--timeout-s", "60", "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the user profile.py was imported" not in done.stderr
    assert json.loads(done.stdout)["steps"] == 2


# 6. Resuming: the checkpoint records what the run depends on; a change is refused naming the checkpoint,
#    --steps at or below the checkpoint's step is refused, and the summary says what resumed from where.
def test_6_resume_is_checked_against_what_the_checkpoint_recorded(tmp_path: Path) -> None:
    from planner.app.run import run_config
    from planner.runtime.launch.prepare import preflight

    code, _, err = run("partition", GPT_TINY, "-d", "1", "--cluster", "cpu-2", "-o", tmp_path / "plan.json")
    assert code == 0, err
    ckpt = tmp_path / "ckpt"
    config = run_config(plan=str(tmp_path / "plan.json"), model="planner.examples.gpt:gpt_tiny", steps=8,
                        round_steps=2, timeout_s=30, options={"checkpoint_dir": str(ckpt)}, profile=str(GPT_TINY))
    first = preflight(config)
    assert first.resume is None
    sealed = ckpt / "step_00000004"
    sealed.mkdir(parents=True)
    (sealed / "meta.json").write_text(json.dumps({
        "schema_version": 1, "step": 4, "world_size": 2, "plan": first.plan.to_dict(),
        "extra": {"run": first.identity, "rebalance": {}, "losses": [1.0] * 4}}))
    assert preflight(config).resume.info.step == 4
    base = ["run", tmp_path / "plan.json", "planner.examples.gpt:gpt_tiny", "--profile", GPT_TINY,
            "--checkpoint-dir", ckpt]
    code, _, err = run(*base, "--steps", "4")
    line = one_error_line(err)
    assert code == 2 and "--steps 4 is not above step 4 of checkpoint" in line and "step_00000004" in line
    for option, value, words in (("--seed", "7", "with --seed 0, this run has 7"),
                                 ("--data", f"{tmp_path / 'batches.py'}:ids", "with --data 'synthetic'"),
                                 ("--lr", "0.5", "with --lr 0.001, this run has 0.5")):
        (tmp_path / "batches.py").write_text("import torch\ndef ids(seed, step, batch_size):\n"
                                             "    return torch.zeros(batch_size, 16, dtype=torch.int64), None\n")
        code, _, err = run(*base, "--steps", "8", option, value)
        line = one_error_line(err)
        assert code == 1 and line.startswith(f"error: checkpoint '{sealed}' was written by a run") and words in line
    code, _, err = run("partition", GPT_TINY, "-d", "1", "--cluster", "cpu-2", "-m", "uniform", "-s", "gpipe",
                       "-o", tmp_path / "other.json")
    assert code == 0, err
    other = run_config(plan=str(tmp_path / "other.json"), model="planner.examples.gpt:gpt_tiny", steps=8,
                       round_steps=2, timeout_s=30, options={"checkpoint_dir": str(ckpt)}, profile=str(GPT_TINY))
    resume = preflight(other).resume  # the checkpoint's plan wins, and the words say so
    assert resume is not None and resume.plan_changed and resume.other_start


def test_6_the_summary_says_what_resumed_and_pairs_losses_with_this_run() -> None:
    from rich.console import Console

    from planner.report.render import render_run

    console = Console(file=io.StringIO(), width=200)
    render_run(console, {"losses": [9.0, 8.0, 3.0, 2.0], "first_step": 2, "steps": 4, "world_size": 2,
                         "backend": "gloo", "schedule": "1f1b", "microbatches": 2, "microbatch_size": 2,
                         "optimizer": "adam", "lr": 1e-3, "loss": "mse", "wall_s": 0.5,
                         "resumed": {"step": 2, "path": "ck/step_00000002", "plan_changed": True}})
    text = console.file.getvalue()
    assert "resumed from step 2 of checkpoint ck/step_00000002, under the plan in force there" in text
    assert "trained steps 2-3 (2 steps)" in text and "loss 3.000000 -> 2.000000 in 0.50 s" in text


# 11. `-s interleaved-1f1b` with dp, greedy or ilp gave exactly the 1F1B plan and said nothing. The placers'
#     plan is now split into v chunks per device when that simulates faster, and the plan says why it did or not.
@pytest.mark.parametrize("method", ["dp", "greedy", "ilp"])
def test_11_interleaved_plans_hold_several_chunks_per_device(tmp_path: Path, method: str) -> None:
    from planner.formats.plan import load_plan
    from planner.partition.sim.schedules import pipeline_layout

    code, out, err = run("partition", GPT_TINY, "-d", "1", "--cluster", "a100-4", "-m", method, "-s", "interleaved-1f1b",
                         "-n", "8", "-o", tmp_path / "plan.json")
    assert code == 0, err
    plan = load_plan(tmp_path / "plan.json")
    ranks, chunks = pipeline_layout([s.device for s in plan.stages], plan.schedule)
    record = plan.extra["interleave"]
    assert chunks == record["chunks"] >= 2 and len(ranks) == 4
    assert record["step_time_s"][str(chunks)] < record["step_time_s"]["1"]
    assert plan.step_time_s == pytest.approx(record["step_time_s"][str(chunks)])
    assert f"interleaved: {chunks} chunks per device simulate fastest" in " ".join(out.split())


def test_11_an_interleaved_plan_that_stays_at_one_chunk_says_why(tmp_path: Path) -> None:
    code, out, err = run("partition", GPT_TINY, "-d", "1", "--cluster", "cpu-2", "-m", "dp", "-s", "interleaved-1f1b",
                         "-n", "4", "-o", tmp_path / "plan.json")
    assert code == 0, err
    record = json.loads((tmp_path / "plan.json").read_text())["interleave"]
    text = " ".join(out.split())
    if record["chunks"] == 1:
        assert "one chunk per device simulates fastest" in text and "the plan runs as 1F1B" in text
    else:
        assert f"{record['chunks']} chunks per device simulate fastest" in text
    assert len(record["step_time_s"]) >= 2


def test_11_chunks_cover_the_model_round_robin() -> None:
    from planner.formats.cluster import load_cluster
    from planner.formats.profile import load_profile
    from planner.partition.model.problem import build_problem
    from planner.partition.search.interleave import chunked

    from planner.clusters import resolve_cluster

    from planner.formats.catalog import load_catalog

    problem = build_problem(load_profile(GPT_TINY), load_cluster(resolve_cluster("mixed-3type-2host")), microbatches=8,
                            schedule="interleaved-1f1b", optimizer="adam", catalog=load_catalog())
    devices = list(problem.cluster.device_ids)[:3]
    for v in (2, 3):
        parts = chunked(problem, devices, v)
        assert parts is not None and len(parts) == 3 * v
        assert parts[0].start == 0 and parts[-1].stop == len(problem.blocks)
        assert all(a.stop == b.start and a.start < a.stop for a, b in zip(parts, parts[1:]))
        assert [s.device for s in parts] == [devices[k % 3] for k in range(3 * v)]
    assert chunked(problem, devices, len(problem.blocks)) is None


# 15. Docs and help pointed at design.md and "seed 003 S2-S6", which a user cannot open; the docs now carry
#     their own account of each method (docs/methods.md) with the paper or patent it comes from.
def test_15_docs_and_help_point_only_at_what_a_user_can_open() -> None:
    import re

    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] + sorted((ROOT / "docs" / "schema").glob("*.json"))
    outside = re.compile(r"design\.md|\.\./shared|seeds/|\bseed[ -]?00\d", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in pages for m in outside.finditer(p.read_text())]
    for command in ("profile", "partition", "show", "check", "diff", "run"):
        code, out, err = run(command, "--help")
        found += [f"plan {command} --help: {m.group(0)}" for m in outside.finditer(out + err)]
    assert found == []
    methods = " ".join((ROOT / "docs" / "methods.md").read_text().split())
    for citation in ("patent", "doi:10.11918/202407052", "Journal of Jilin University", "CAAI Transactions",
                     "GPipe", "PipeDream", "Megatron-LM", "torchgpipe"):
        assert citation in methods
    for link in re.findall(r"\]\(([\w-]+\.md)", methods):
        assert (ROOT / "docs" / link).is_file(), link


# Done-when: docs/ lists every error a user can meet, by command (generated from the raise sites).
def test_the_errors_page_lists_every_error_by_command_and_is_current() -> None:
    done = subprocess.run([sys.executable, "scripts/errors_page.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = " ".join((ROOT / "docs" / "errors.md").read_text().split())
    for command in ("## plan run", "## plan profile", "## plan partition", "## plan check, plan diff"):
        assert command in text
    for message in ("1f1b needs at least as many micro-batches as stages", "interrupted; every rank was stopped",
                    "the factory must accept the keyword arguments",
                    "does not select an output", "is not above step", "was written by a run with"):
        assert message in text, message
