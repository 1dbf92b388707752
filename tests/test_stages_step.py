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
