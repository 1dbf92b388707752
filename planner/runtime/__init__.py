"""The executor of ``plan run``: a plan and a model factory become pipelined training on torch.distributed.

Public entry points: ``launch.launch`` (start ranks with torch's elastic launcher), ``worker.run_rank``
(one rank's training; ``RunConfig``, ``RunHooks``, ``RankRun``), ``stages.build_rank_stages`` (a rank's
``PipelineStage`` s for a plan), ``graph_split.split_graph`` (per-stage ``GraphModule`` s),
``training.train_reference`` (the single-process baseline). Rebalancing, timing, migration and
checkpoints: ``dynamic`` and the modules it uses (docs/rebalancing.md); the rest: docs/run.md.
"""
