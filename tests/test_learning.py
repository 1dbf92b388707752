"""Issue 13: bundled real data, held-out evaluation, time to target, emulated links and curves."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app
from tests._gloo import run_ranks
from tests._inproc import plan as plan_in_process

runner = CliRunner()


def _one_error(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# ----------------------------------------------------------------------------- data

def test_digits_batches_are_deterministic_and_the_splits_disjoint() -> None:
    digits = pytest.importorskip("sklearn") and __import__("planner.data.digits", fromlist=["batches"])
    train, val = digits.split_indices(1797)
    assert len(train) == 1500 and len(val) == 297
    assert set(train.tolist()).isdisjoint(val.tolist()) and len(set(train.tolist()) | set(val.tolist())) == 1797
    a, b = digits.batches(3, 7, 16), digits.batches(3, 7, 16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(digits.batches(3, 8, 16)[0], a[0])
    x, y = digits.batches(0, 0, 16, split="val")
    assert x.shape == (16, 1, 8, 8) and y.dtype == torch.int64 and float(x.max()) <= 1.0
    (_, _), (val_x, _) = digits.load()
    assert torch.equal(x, val_x[:16])  # validation batch 0 is the first 16 validation images, every time


def test_the_digits_read_from_scikit_learns_file_are_its_load_digits(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """The file is read without importing scikit-learn (every rank paid 2.3 s for the import); the arrays are
    ``load_digits``'s, and where the file is not where it is looked for, ``load_digits`` itself is asked."""
    import importlib.util
    from types import SimpleNamespace

    import numpy as np

    from planner.data import digits

    reference = pytest.importorskip("sklearn.datasets").load_digits()
    pixels, labels = digits._read_digits()
    assert np.array_equal(pixels, reference.data) and np.array_equal(labels, reference.target)
    assert labels.dtype == np.int64 and pixels.shape == (1797, 64)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(origin=str(tmp_path / "x.py")))
    pixels, labels = digits._read_digits()
    assert np.array_equal(pixels, reference.data) and np.array_equal(labels, reference.target)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(digits.UsageError, match="pip install 'planner\\[data\\]'"):
        digits._read_digits()


def test_text_batches_are_deterministic_and_validation_comes_from_its_own_bytes() -> None:
    from planner.data import text

    train, val = text.corpus()
    assert len(val) == pytest.approx((len(train) + len(val)) * text.VAL_FRACTION, abs=1)
    x, y = text.batches(0, 5, 4)
    assert x.shape == (4, text.SEQ) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, text.batches(0, 5, 4)[0]) and not torch.equal(x, text.batches(1, 5, 4)[0])
    vx, _ = text.batches(0, 0, 2, split="val")
    joined = bytes(val.tolist())
    assert all(bytes(row.tolist()) in joined for row in vx)
    assert torch.equal(vx, text.batches(9, 0, 2, split="val")[0])  # the same held-out bytes for every seed
    assert len(text.fingerprint()) == 16


def test_gpt_starts_like_gpt2_near_ln_vocab() -> None:
    import math

    import torch.nn.functional as F

    from planner.data import text
    from planner.examples.gpt import gpt_bytes, gpt_small

    model, _ = gpt_bytes()
    x, y = text.batches(0, 0, 8)
    loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
    assert abs(float(loss.detach()) - math.log(256)) < 0.5
    small, (ids,) = gpt_small()
    logits = small(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 4096), ids[:, 1:].reshape(-1))
    assert abs(float(loss.detach()) - math.log(4096)) < 0.5  # PyTorch's default init started at 167.7


def test_classification_targets_choose_cross_entropy_and_accuracy() -> None:
    from planner.data import factory as data_mod

    spec = data_mod.data_spec((torch.zeros(4, 1, 8, 8),), torch.zeros(4, 10))
    assert spec.loss == data_mod.MSE
    task = data_mod.task_spec(spec, torch.zeros(4, dtype=torch.int64))
    assert task.loss == data_mod.CROSS_ENTROPY and data_mod.has_accuracy(task)
    assert data_mod.task_spec(spec, torch.zeros(4, 10)).loss == data_mod.MSE
    assert data_mod.task_spec(spec, torch.zeros(4, 10), custom_loss=True).loss == data_mod.CUSTOM


# ----------------------------------------------------------------------------- time to target and curves

def _log(path: Path, accuracies: list[float], step_s: float) -> Path:
    lines = []
    for i, acc in enumerate(accuracies):
        lines.append({"round": i, "first_step": 10 * i, "steps": 10, "wall_s": 10 * step_s, "step_time_s": step_s,
                      "loss": 1.0 - acc})
        lines.append({"eval": {"step": 10 * (i + 1), "wall_s": 10 * step_s * (i + 1), "loss": 1.0 - acc,
                               "accuracy": acc}})
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


def test_time_to_target_is_the_training_time_of_the_first_evaluation_that_reaches_it(tmp_path: Path) -> None:
    from planner.app.curves import load_run
    from planner.runtime.options import parse_target

    run = load_run(_log(tmp_path / "a.jsonl", [0.5, 0.8, 0.96, 0.94, 0.97], 0.1), parse_target("accuracy=0.95"))
    assert run.time_to_target_s == pytest.approx(3.0)
    assert load_run(tmp_path / "a.jsonl", parse_target("loss=0.01")).time_to_target_s is None
    assert load_run(tmp_path / "a.jsonl", parse_target("loss=0.1")).time_to_target_s == pytest.approx(3.0)


def test_plan_curves_draws_two_runs_and_prints_the_table(tmp_path: Path) -> None:
    _log(tmp_path / "fast.jsonl", [0.6, 0.9, 0.97], 0.1)
    _log(tmp_path / "slow.jsonl", [0.4, 0.7, 0.9, 0.96], 0.2)
    result = runner.invoke(app, ["curves", str(tmp_path / "fast.jsonl"), str(tmp_path / "slow.jsonl"),
                                 "--target", "accuracy=0.95", "-o", str(tmp_path / "c.png"), "--json"])
    assert result.exit_code == 0, result.output
    table = {row["run"]: row for row in json.loads(result.stdout)["runs"]}
    assert table["fast"]["time_to_target_s"] == pytest.approx(3.0) and table["slow"]["time_to_target_s"] == pytest.approx(8.0)
    for suffix in (".png", ".svg"):
        assert (tmp_path / f"c{suffix}").stat().st_size > 1000


# ----------------------------------------------------------------------------- bad input

def test_a_file_that_is_not_a_run_log_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    assert "is not a run log" in _one_error(runner.invoke(app, ["curves", str(tmp_path / "notes.txt")]))
    (tmp_path / "cluster.json").write_text('{"devices": []}')
    assert "no round or eval records" in _one_error(runner.invoke(app, ["curves", str(tmp_path / "cluster.json")]))
    _log(tmp_path / "a.jsonl", [0.5], 0.1)
    assert not (tmp_path / "out.png").exists()
    assert "-o must name a .png or .svg" in _one_error(runner.invoke(app, ["curves", str(tmp_path / "a.jsonl"),
                                                                          "-o", str(tmp_path / "out.pdf")]))


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("sklearn")
    from tests._digits import digits_plan

    return digits_plan(tmp_path_factory.mktemp("digits"))


@pytest.mark.parametrize("extra, words", [
    (["--data", "planner.data.digits:batches", "--eval-every", "5", "--target", "accuracy=2x"], "--target must be METRIC=VALUE"),
    (["--eval-every", "5", "--target", "accuracy=0.9"], "this task has no accuracy"),
    (["--data", "{tmp}/train_only.py:batches", "--eval-every", "5"], "has no split argument"),
    (["--emulate-link", "fast"], "--emulate-link must be BANDWIDTH[,LATENCY]"),
    (["--emulate-link", "1e8,-1"], "--emulate-link's latency must be 0 or more seconds"),
    (["--target", "loss=1"], "pass --eval-every K as well"),
])
def test_bad_learning_options_are_one_line(mlp_plan: Path, tmp_path: Path, extra: list[str], words: str) -> None:
    (tmp_path / "train_only.py").write_text("from planner.data.digits import batches as _b\n"
                                            "def batches(seed, step, batch_size):\n    return _b(seed, step, batch_size)\n")
    args = ["run", str(mlp_plan), "planner.examples.digits:digits_mlp", "--steps", "2",
            *[a.replace("{tmp}", str(tmp_path)) for a in extra]]
    assert words in _one_error(runner.invoke(app, args))


# ----------------------------------------------------------------------------- ranks

def _ping_pong(rank: int, world: int, link: str | None, rounds: int, nbytes: int, out: str) -> None:
    import torch.distributed as dist

    from planner.runtime import netem
    from planner.runtime.options import parse_link

    tensor = torch.zeros(nbytes // 4)
    with netem.instrument(netem.Traffic(), parse_link(link)) as traffic:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            else:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)
        elapsed = time.perf_counter() - start
    if rank == 0:
        Path(out).write_text(json.dumps({"elapsed_s": elapsed, "bytes_sent": traffic.bytes_sent}))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_emulated_link_adds_latency_plus_bytes_over_bandwidth_to_a_ping_pong(tmp_path: Path) -> None:
    rounds, nbytes, bandwidth, latency = 5, 2_000_000, 1e8, 0.01
    results = {}
    for name, link in (("loopback", None), ("emulated", f"{bandwidth},{latency}")):
        run_ranks(_ping_pong, 2, link, rounds, nbytes, str(tmp_path / name), timeout_s=100)
        results[name] = json.loads((tmp_path / name).read_text())
    added = results["emulated"]["elapsed_s"] - results["loopback"]["elapsed_s"]
    expected = 2 * rounds * (latency + nbytes / bandwidth)  # every transfer, one way each, is waited for
    assert 0.85 < added / expected < 1.3, (added, expected)
    assert results["loopback"]["bytes_sent"] == rounds * nbytes


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_evaluation_changes_no_parameter_and_the_digits_learn(mlp_plan: Path, tmp_path: Path) -> None:
    """Two runs, one evaluating every step, end with byte-identical parameters; the evaluations learn."""
    summaries = {}
    for name, extra in (("plain", []), ("eval", ["--eval-every", "1", "--eval-batches", "2", "--target", "accuracy=0.5"]),
                        ("stop", ["--eval-every", "5", "--target", "accuracy=0.5", "--stop-at-target"])):
        done = plan_in_process("run", str(mlp_plan), "planner.examples.digits:digits_mlp", "--data",
                               "planner.data.digits:batches", "--steps", "30", "--round-steps", "5", "--no-rebalance",
                               "--lr", "0.005", "--params-out", str(tmp_path / name), "--json", *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        summaries[name] = json.loads(done.stdout)
    for rank in (0, 1):
        a = torch.load(tmp_path / "plain" / f"rank{rank}.pt")
        b = torch.load(tmp_path / "eval" / f"rank{rank}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    evals = summaries["eval"]["eval"]
    assert [e["step"] for e in evals] == list(range(0, 31, 5))  # at step 0 and at each round's end
    assert evals[-1]["accuracy"] > evals[0]["accuracy"] + 0.3 and summaries["eval"]["time_to_target_s"] is not None
    assert summaries["eval"]["bytes_sent"] > 0 and summaries["eval"]["data"]["task"] == "cross-entropy"
    stopped = summaries["stop"]
    assert stopped["steps"] < 30 and stopped["eval"][-1]["accuracy"] >= 0.5 and stopped["eval"][-2]["accuracy"] < 0.5



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_colocate_records_the_slowdown_of_a_shared_host(tmp_path: Path) -> None:
    """Issue 12: plan profile --colocate 2 times a training micro-batch beside a second training process."""
    result = runner.invoke(app, ["profile", "planner.examples.gpt:gpt_tiny", "-o", str(tmp_path / "p.json"),
                                 "--repeats", "3", "--warmup", "1", "--colocate", "2", "--json"])
    assert result.exit_code == 0, result.output
    colocation = json.loads((tmp_path / "p.json").read_text())["whole_model"]["colocation"]
    assert colocation["ranks"] == 2 and colocation["train_s"] > 0 and colocation["factor"] > 0
    before, after = colocation["alone_s"]  # timed alone on either side of the loaded windows
    loaded = sorted(colocation["loaded_s"])
    assert before > 0 and after > 0 and len(loaded) == 3 and colocation["train_s"] == loaded[1]
    assert colocation["factor"] == pytest.approx(loaded[1] / ((before + after) / 2))
