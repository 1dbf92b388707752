"""What a rank is given (``RunConfig``) and the extension points it calls (``RunHooks``, ``RoundEnd``).

Plain values only: the config is pickled across torch's elastic launcher to every rank.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from planner.errors import UsageError
from planner.runtime.parameter_server.rule import DaspRule

if TYPE_CHECKING:
    from planner.runtime.launch.worker import RankRun

__all__ = ["ASYNC_RECEIVES", "RunConfig", "RoundEnd", "RunHooks", "load_plugins"]

ASYNC_RECEIVES = ("auto", "ahead", "on-demand")
"""``--async-receives``: when the asynchronous engine posts a peer's next receive
(``planner.runtime.pipeline.asynchronous.receives_ahead`` says what each means)."""


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs; plain values so it pickles across the launcher."""

    plan: str
    """Path of the plan file."""
    model: str
    """``pkg.mod:factory`` or ``file.py:factory`` (the factory the plan's profile was made from)."""
    steps: int
    """Training steps to run (in total, counting resumed ones)."""
    microbatch_size: int | None = None
    """Rows per micro-batch; default: the profile's micro-batch size."""
    optimizer: str | None = None
    """``sgd`` or ``adam``; default: the plan's optimizer, else sgd."""
    lr: float | None = None
    """Learning rate; default 0.01 (sgd) or 1e-3 (adam)."""
    seed: int = 0
    """Seeds the model factory and the synthetic data."""
    data: str | None = None
    """``pkg.mod:factory`` supplying batches instead of synthetic data (see ``planner.data.factory``)."""
    profile: str | None = None
    """Profile path; default: the plan's ``profile.path``."""
    round_steps: int = 5
    """Steps per round; hooks run after each round."""
    timeout_s: float = 120.0
    """Timeout of the process group's collectives and point-to-point transfers."""
    params_out: str | None = None
    """Directory: each rank writes ``rank{R}.pt`` (its parameters by canonical name) at the end."""
    allow_device_mismatch: bool = False
    """Train with a plan made for other device types (its split and predictions do not hold here)."""
    loss: str | None = None
    """``pkg.mod:fn`` with ``fn(output, target) -> scalar tensor``; default: chosen from the task (docs/run.md)."""
    eval_every: int = 0
    """Evaluate on the validation batches every this many steps (0: never)."""
    eval_batches: int = 4
    """Validation batches per evaluation (the same ones every time)."""
    target: str | None = None
    """``accuracy=0.95`` or ``loss=2.1``: the first evaluation that reaches it sets ``time_to_target_s``."""
    stop_at_target: bool = False
    """End the run at the evaluation that reaches ``target``."""
    emulate_link: str | None = None
    """``BANDWIDTH[,LATENCY]``: every transfer between ranks takes that much longer (testing aid)."""
    sync: str | None = None
    """``--sync``: how replicas combine their updates (default: the plan's ``data_parallel.sync``)."""
    sync_period: int | None = None
    """``--sync-period``: local steps between aggregations (default: the plan's)."""
    sync_elastic: float = 0.0
    """``adaptive``: share of its drift a local model gives back every local step."""
    sync_momentum: float = 0.0
    """``adaptive``: the outer momentum of the global model's steps (SlowMo)."""
    sync_chunk_bytes: int | None = None
    """``adaptive``: size of the sub-tensors an aggregation is cut into (None: from the plan's links)."""
    sync_overhead: float = 0.1
    """``adaptive``: largest share of the step time aggregations may take."""
    sync_max_period: int = 32
    """``adaptive``: the longest interval."""
    staleness: int | None = None
    """``--staleness``: ssp's bound (default: the plan's ``data_parallel.staleness``)."""
    dasp_slow_factor: float = DaspRule.slow_factor
    """``dasp``: a synchronous worker this many times slower than the fastest leaves the group."""
    dasp_rejoin_factor: float = DaspRule.rejoin_factor
    """``dasp``: an asynchronous worker within this many times the fastest rejoins."""
    dasp_patience: int = DaspRule.patience
    """``dasp``: rounds in a row before a worker changes state."""
    dasp_async_update: str = DaspRule.async_update
    """``dasp``: how an asynchronous worker's gradient enters the model (``rule.ASYNC_UPDATES``)."""
    async_receives: str = "auto"
    """``async-1f1b`` and ``2bw``: when a rank posts each receive (``ASYNC_RECEIVES``)."""
    plugins: tuple[str, ...] = ()
    """Extra ``RunHooks``, as ``pkg.mod:factory`` specs with ``factory(config) -> RunHooks`` (strings, because the
    config crosses the launcher to every rank). They run before the built-in rebalancing and checkpoint hooks.
    For extensions and tests (the fault-injection tests pass theirs here); ``plan run`` passes none."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Options for hooks (rebalancing, checkpoints, emulated slowdown), by name."""


@dataclass(frozen=True)
class RoundEnd:
    """One round on this rank."""

    index: int
    first_step: int
    steps: int
    wall_s: float
    """Wall time of the round's steps on this rank (data, schedule, gradient sync, optimizer)."""
    losses: tuple[float, ...]
    """Mean micro-batch loss of each step (summed over the replicas' last stages)."""
    figures: tuple[tuple[float, ...], ...] = ()
    """By rank, what the hook receiving this ``RoundEnd`` returned from ``round_figures`` on that rank."""


class RunHooks:
    """Extension points; override what you need. Every rank calls every method at the same point."""

    def on_start(self, run: "RankRun") -> None:
        """After the stages are built, before ``run.step`` runs (may load a checkpoint and set ``run.step``)."""

    def before_round(self, run: "RankRun") -> None:
        """Just before each round's first step."""

    def after_step(self, run: "RankRun", index: int, steps: int) -> None:
        """After step ``index`` (0-based) of a round of ``steps`` run one step at a time; the asynchronous pipeline runs
        a round at once (``AsyncEngine.run_round``) and calls no hook between its steps."""

    def round_figures(self, run: "RankRun") -> tuple[float, ...]:
        """Right after each round's last step: numbers every rank should see. They travel in the round's one exchange
        (with the losses) and come back, from every rank, as ``on_round``'s ``stats.figures``. Every rank must return
        as many."""
        return ()

    def on_round(self, run: "RankRun", stats: RoundEnd) -> None:
        """After each round (may ``run.install(run.build(new_plan))`` after moving parameters)."""

    def on_eval(self, run: "RankRun", result: Mapping[str, Any]) -> None:
        """After an evaluation (``--eval-every``): ``step``, ``wall_s`` (training time so far), ``loss``,
        ``accuracy``."""

    def on_end(self, run: "RankRun") -> None:
        """After the last step, before results are gathered."""


def load_plugins(config: RunConfig) -> list[RunHooks]:
    """The ``RunHooks`` named in ``config.plugins``, in order."""
    out = []
    for spec in config.plugins:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise UsageError(f"a plugin is named as 'package.module:factory', found {spec!r}")
        out.append(getattr(importlib.import_module(module_name), attr)(config))
    return out
