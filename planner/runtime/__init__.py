"""The executor of ``plan run``: a plan and a model factory become training on torch.distributed.

One room per concern:

- ``launch``: a rank's life. ``config`` (``RunConfig``, ``RunHooks``, plugins), ``prepare`` (everything that can
  be refused, before any collective), ``worker`` (the training loop in rounds), ``main`` (the built-in hooks
  around it), ``elastic`` (start the ranks with torch's elastic launcher).
- ``pipeline``: the pipeline engine. ``graph_split`` (the captured graph cut into per-stage modules),
  ``stages`` (a rank's ``PipelineStage`` s and torch's synchronous schedules), ``training`` (settings, the
  single-process reference).
- ``data_parallel``: the replicas of a stage and how they combine updates (degree 1 today).
- ``rebalancing``: the rebalancing patent's S3-S6 at run time: the hooks, the re-plan, the round log. The loop's decisions
  themselves are pure (``planner.partition.search.rebalance``).
- ``migrate`` (parameters and optimizer state to new owners), ``checkpoint``, ``timing`` (compute and waits
  per rank), ``options`` (the hooks' options, checked without torch), ``slowdown`` (emulated stragglers,
  a testing aid), ``probe`` and ``links`` (runtime and link probing for cluster files).
"""
