"""Data parallelism through a parameter server: ``bsp``, ``asp``, ``ssp`` and seed 002's ``dasp`` (docs/sync.md).

A plan with ``data_parallel.sync`` one of ``SERVER_SYNCS`` has one stage and ``d`` replicas of it, one per device;
``plan run`` starts ``d + 1`` ranks: ranks ``0 .. d - 1`` are the workers (rank ``r`` is replica ``r``, on the
plan's ``r``-th device, with its share of the micro-batches), rank ``d`` is the server, which holds the global
model and the optimizer (``server.Server``). They talk by gloo point-to-point messages only (``wire``): the
server receives from any source, so no worker waits on another unless the mode says so, and nothing calls
``torch.distributed.rpc`` (in maintenance mode; a receive from any source returns the sender, which is all a
server needs). Every receive is bounded by the process group's timeout (``--timeout-s``); a worker that dies
ends the run with one line naming its rank (the launcher's).

The server evaluates the global model on the held-out batches every ``--eval-every`` steps (its time excluded
from training time, and the workers wait meanwhile), writes one round record per ``--round-steps`` steps to
``--log`` -- each worker's state, iteration time, staleness of its applied updates and waiting time -- and its
summary is the run's; ``-o`` writes the plan as it ran. Rebalancing and checkpoints do not apply to these modes.

The package imports nothing itself, so the pure rule (``rule``) loads without torch for the command line's
checks; ``run.run_served`` is where ``plan run``'s ranks enter.
"""
