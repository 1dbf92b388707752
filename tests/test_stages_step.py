"""``training_step_kwargs``: a training step asks torch's schedule not to keep and concatenate the last stage's
outputs."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def test_torchs_schedules_are_asked_not_to_return_their_outputs() -> None:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from planner.runtime.pipeline.stages import training_step_kwargs

    for kind in (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, _PipelineScheduleRuntime):
        schedule = kind.__new__(kind)  # the signature is the class's: no stage or process group needed
        assert training_step_kwargs(schedule) == {"return_outputs": False}, kind


def test_a_schedule_without_the_keyword_gets_none() -> None:
    """An older torch's ``step(*args, target=None, losses=None, **kwargs)`` hands unknown keywords to the model."""
    from planner.runtime.pipeline.stages import training_step_kwargs

    class Older:
        def step(self, *args, target=None, losses=None, **kwargs):  # type: ignore[no-untyped-def]
            return None

    assert training_step_kwargs(Older()) == {}


def test_the_last_stage_holds_no_outputs_after_a_training_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One rank, one stage (first and last), torch's 1F1B over 4 micro-batches: with the training step's keywords the
    stage keeps none of the 4 outputs (without them it keeps all 4 and the step returns their concatenation)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from planner.runtime.pipeline.stages import training_step_kwargs

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(8, 8)
        stage = PipelineStage(model, 0, 1, torch.device("cpu"))
        schedule = Schedule1F1B(stage, 4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
        x, target = torch.randn(16, 8), torch.randn(16, 8)
        assert schedule.step(x, target=target, losses=[]).shape == (16, 8)
        assert len(stage.output_chunks) == 4  # torch's default: every micro-batch's output, kept
        losses: list[torch.Tensor] = []
        assert schedule.step(x, target=target, losses=losses, **training_step_kwargs(schedule)) is None
        assert stage.output_chunks == [] and len(losses) == 4
    finally:
        dist.destroy_process_group()
