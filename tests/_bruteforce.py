"""Brute force over every partition, and seeded random problems: the oracle of the differential tests.

``brute_force`` enumerates every split of the blocks into contiguous stages (2^(B-1)) and every
sequence of *distinct concrete devices* for them (D! / (D - p)!), checks memory with the cost model's
own ``check_fits`` (which replays the schedule) and scores the shared objective. It shares no code
with the DP or the ILP beyond the objective's definition, which is what makes it an oracle. Only for
tiny problems (about 10 blocks and 4 devices).

``random_profile`` and ``random_cluster`` build the seeded cases of the differential tests: chains
and graphs with skip connections, mixed device types and hosts, explicit pair links, memory that
sometimes binds.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from types import MappingProxyType

from planner.errors import InfeasibleError
from planner.formats.cluster import Cluster, Device, Link
from planner.formats.profile import INPUT_OP, Node, OpTime, Profile
from planner.partition.model.feasibility import check_fits
from planner.partition.model.objective import step_time_formula_s
from planner.partition.model.problem import Partition, Problem, StageSpec

__all__ = ["BruteResult", "brute_force", "random_cluster", "random_profile"]


@dataclass(frozen=True)
class BruteResult:
    partition: Partition
    objective_s: float
    feasible_count: int


def brute_force(problem: Problem) -> BruteResult:
    """The partition with the least shared objective among all that fit (ties: first in enumeration order)."""
    nblocks, devices = len(problem.blocks), problem.cluster.device_ids
    best: tuple[float, Partition] | None = None
    feasible = 0
    for cuts in _cut_sets(nblocks, len(devices)):
        bounds = list(zip((0, *cuts), (*cuts, nblocks)))
        for chosen in itertools.permutations(devices, len(bounds)):
            partition = tuple(StageSpec(s, e, d) for (s, e), d in zip(bounds, chosen))
            try:
                check_fits(problem, partition)
            except InfeasibleError:
                continue
            feasible += 1
            value = step_time_formula_s(problem, partition)
            if best is None or value < best[0]:
                best = (value, partition)
    if best is None:
        raise InfeasibleError("brute force: no partition fits in memory")
    return BruteResult(best[1], best[0], feasible)


def _cut_sets(nblocks: int, most_stages: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for p in range(1, min(nblocks, most_stages) + 1):
        out.extend(itertools.combinations(range(1, nblocks), p - 1))
    return out


_TYPES = {"fast": 1.0, "slow": 2.5}
"""Device types of the random cases and how much slower than ``fast`` each runs."""


def random_cluster(seed: int, num_devices: int, *, mem_range: tuple[int, int] = (60, 400)) -> Cluster:
    """Up to two device types on up to two hosts, random memory (bytes, to bind against ``random_profile``),
    and sometimes an explicit pair link that is faster or slower than its host's."""
    rng = random.Random(seed)
    hosts = rng.choice([1, 2])
    devices = tuple(
        Device(f"d{i}", rng.choice(sorted(_TYPES)), f"h{i * hosts // num_devices}", rng.randint(*mem_range))
        for i in range(num_devices))
    pairs = {}
    if num_devices > 1 and rng.random() < 0.5:
        a, b = sorted(rng.sample([d.id for d in devices], 2))
        pairs[(a, b)] = Link(rng.choice([5.0, 1000.0]), 0.02)
    return Cluster("random", devices, intra_host=Link(200.0, 0.01), inter_host=Link(20.0, 0.05),
                   pairs=MappingProxyType(pairs))


def random_profile(seed: int, *, num_nodes: int = 10, skip_prob: float = 0.3) -> Profile:
    """A random graph in topological order: each node reads its predecessor and, with ``skip_prob``, an
    earlier node too (a skip connection that crosses several cuts). ``skip_prob=0`` gives a chain."""
    rng = random.Random(seed)
    zero = MappingProxyType({t: OpTime(0.0, 0.0, "measured") for t in _TYPES})
    nodes = [Node("x", INPUT_OP, (), rng.choice([8, 16, 64]), 0, zero)]
    for i in range(num_nodes - 1):
        inputs = {nodes[-1].name}
        if len(nodes) > 1 and rng.random() < skip_prob:
            inputs.add(rng.choice(nodes[:-1]).name)
        fwd = rng.uniform(0.5, 3.0)
        times = MappingProxyType({t: OpTime(fwd * s, 2 * fwd * s, "measured") for t, s in _TYPES.items()})
        nodes.append(Node(f"v{i}", "aten.mm.default", tuple(sorted(inputs)), rng.choice([0, 8, 16, 64, 128]),
                          rng.randint(1, 12), times, saved_bytes=rng.randint(0, 10), module_path=f"layers.{i // 2}"))
    return Profile(model=MappingProxyType({"name": f"random{seed}"}), nodes=tuple(nodes))
