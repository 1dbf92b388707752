"""``plan run``'s options for the run-time hooks (rebalancing, checkpoints, logging), validated without torch.

``run_options`` is called in the launching process before any rank starts (and before torch is imported),
so a bad value is one usage error line, at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from planner.errors import UsageError
from planner.formats.jsonio import check_writable
from planner.partition.search.rebalance import RebalanceConfig
from planner.runtime.slowdown import parse_slowdown_patterns

__all__ = ["OPTIONS", "run_options", "rebalance_config", "EmulatedLink", "parse_link", "Target", "parse_target",
           "METRICS"]

OPTIONS: Mapping[str, Any] = {
    "rebalance": True,            # the rebalancing patent's S3-S6 between rounds
    "threshold": 0.05,            # S5 balance threshold (fraction of the round)
    "patience": 3,                # S6 rounds without a plan change
    "gain": 1.0,                  # fraction of the wait-proportional weight move per round
    "min_improvement": 0.05,      # adopt a new plan only if predicted this much faster
    "replan_method": None,        # placer for re-plans (default: the plan's method)
    "emulate_slowdown": None,     # "RANK=FACTOR[,RANK=FACTOR]" (testing aid)
    "log": None,                  # JSONL round log (rank 0, appended); "-" = stdout
    "json": False,                # round records on stdout (set by --log -)
    "live": False,                # live rich table on stderr
    "checkpoint_dir": None,       # per-rank checkpoint files + meta.json
    "checkpoint_every": 0,        # steps between checkpoints (0: none)
    "keep_checkpoints": 2,
    "output": None,               # final plan (-o)
}


def run_options(**given: Any) -> dict[str, Any]:
    """Validate ``plan run``'s rebalancing, checkpoint and logging options (before any rank starts).

    Keys as in ``OPTIONS``; ``None`` values take the default. Raises ``UsageError`` naming the option.
    """
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise UsageError(f"unknown run option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    options = {**OPTIONS, **{k: v for k, v in given.items() if v is not None}}
    parse_slowdown_patterns(options["emulate_slowdown"])  # syntax; a pipeline refuses time-varying ones later
    rebalance_config(options)
    if int(options["checkpoint_every"]) < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 steps, found {options['checkpoint_every']}")
    if int(options["checkpoint_every"]) > 0 and not options["checkpoint_dir"]:
        raise UsageError("--checkpoint-every needs --checkpoint-dir DIR")
    if options["log"] == "-":  # JSON lines on stdout instead of a file
        options["log"], options["json"] = None, True
    for key, what in (("log", "round log"), ("output", "final plan")):
        if options[key]:
            check_writable(options[key], what)
            options[key] = str(options[key])
    if options["checkpoint_dir"]:
        options["checkpoint_dir"] = str(options["checkpoint_dir"])
    if isinstance(options["emulate_slowdown"], (list, tuple)):
        options["emulate_slowdown"] = ",".join(options["emulate_slowdown"]) or None
    return options


def rebalance_config(options: Mapping[str, Any]) -> RebalanceConfig:
    """The rebalancer's knobs from run options (``RebalanceConfig`` validates them)."""
    return RebalanceConfig(threshold=float(options["threshold"]), gain=float(options["gain"]),
                           patience=int(options["patience"]), min_improvement=float(options["min_improvement"]))


@dataclass(frozen=True)
class EmulatedLink:
    """``--emulate-link BANDWIDTH[,LATENCY]``: every transfer between ranks costs ``latency + bytes / bandwidth``
    more wall time (a testing aid, ``planner.runtime.netem``)."""

    bandwidth_Bps: float
    latency_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth_Bps": self.bandwidth_Bps, "latency_s": self.latency_s}


def parse_link(spec: str | None) -> EmulatedLink | None:
    """``"1e8,0.005"`` -> 1e8 bytes/s and 5 ms per transfer; ``"1e9"`` -> no added latency."""
    if spec is None:
        return None
    parts = [p.strip() for p in str(spec).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(v != v or v == float("inf") for v in values):
        raise UsageError(f"--emulate-link must be BANDWIDTH[,LATENCY] in bytes per second and seconds, e.g. "
                         f"1e8,0.005 (100 MB/s, 5 ms); found {spec!r}")
    if not values[0] > 0:
        raise UsageError(f"--emulate-link's bandwidth must be positive (bytes per second, e.g. 1e8), found {parts[0]!r}")
    if len(values) == 2 and values[1] < 0:
        raise UsageError(f"--emulate-link's latency must be 0 or more seconds (e.g. 0.005), found {parts[1]!r}")
    return EmulatedLink(values[0], values[1] if len(values) == 2 else 0.0)


METRICS = ("accuracy", "loss")
"""What ``--target`` may name: validation accuracy reaches at least, or validation loss at most, the value."""


@dataclass(frozen=True)
class Target:
    """``--target METRIC=VALUE``: the evaluation that reaches it sets ``time_to_target_s``."""

    metric: str
    value: float

    def reached(self, loss: float, accuracy: float | None) -> bool:
        if self.metric == "loss":
            return loss <= self.value
        return accuracy is not None and accuracy >= self.value

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value}


def parse_target(spec: str | None) -> Target | None:
    """``"accuracy=0.95"`` or ``"loss=2.1"``."""
    if spec is None:
        return None
    metric, sep, raw = str(spec).partition("=")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not sep or metric.strip() not in METRICS or value != value:
        raise UsageError(f"--target must be METRIC=VALUE with METRIC one of {', '.join(METRICS)}, e.g. accuracy=0.95 "
                         f"or loss=2.1; found {spec!r}")
    if metric.strip() == "accuracy" and not 0 < value <= 1:
        hint = f"; did you mean accuracy={value / 100:g}?" if 1 < value <= 100 else ""
        raise UsageError(f"--target accuracy is a fraction in (0, 1] (accuracy=0.95 for 95%), found {raw.strip()}{hint}")
    return Target(metric.strip(), value)

