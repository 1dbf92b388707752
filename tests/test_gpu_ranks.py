"""What the GPU machine showed (scripts/gpu_check.sh on one H200): a GPU rank's process group needs gloo beside
nccl for the runtime's CPU messages, and a host cannot run more ranks than it has GPUs. The GPU is faked here:
CI has none."""

from __future__ import annotations

import pytest
import torch

from planner.errors import DistributedError
from planner.runtime.launch.config import RunConfig
from planner.runtime.launch.elastic import LaunchOptions, launch
from planner.runtime.links import check_gpus_per_host, process_group_backend, rank_device


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_gpu_ranks_send_cpu_tensors_through_gloo() -> None:
    assert process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_each_rank_takes_the_gpu_of_its_local_rank(one_gpu, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert rank_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(DistributedError, match="2 ranks would share this host's 1 GPU"):
        rank_device()


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(one_gpu, tmp_path) -> None:
    check_gpus_per_host(1)
    config = RunConfig(plan=str(tmp_path / "absent.json"), model="planner.examples.gpt:gpt_tiny", steps=1)
    with pytest.raises(DistributedError, match="each rank needs a GPU of its own") as refused:
        launch(config, LaunchOptions(nproc_per_node=2))
    assert "\n" not in str(refused.value)


def test_cpu_hosts_run_any_number_of_ranks(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_gpus_per_host(8)
    assert rank_device() == torch.device("cpu")


def test_a_gpu_ranks_clock_waits_for_its_device_before_reading(monkeypatch) -> None:
    """On the H200 a 1-rank run logged up to a third of its step as wait: the host clock timed the kernels' issuing
    and the device's time landed in the next wait. The rank's clock now synchronises first."""
    import time

    from planner.runtime.timing import RankTimer, device_clock

    assert device_clock(torch.device("cpu")) is time.perf_counter
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    gpu = torch.device("cuda", 0)
    clock = device_clock(gpu)
    timer = RankTimer(0, "gpu0", clock=clock)
    with timer.compute():
        pass
    timer.end_round()
    assert calls == [gpu] * 4  # the round's start, the compute interval's two ends, the round's end
