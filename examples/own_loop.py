"""Train with a plan in your own loop: planner's API and torch only.

    plan profile planner.examples.digits:digits_mlp -o profile.json
    plan partition profile.json --cluster cpu-2 -m uniform -n 2 -d 1 -o plan.json
    torchrun --nproc-per-node 2 examples/own_loop.py plan.json --steps 20

Rank 0 prints one JSON line: the loss of every step (as ``plan run ... --data planner.data.digits:batches
--optimizer sgd --lr 0.05 --seed 0`` reports them).
"""

import argparse
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401  before init_process_group (planner.api._warn_if_imported_after_init)
import torch.nn.functional as F

import planner
from planner.data.digits import batches
from planner.examples.digits import digits_mlp

parser = argparse.ArgumentParser()
parser.add_argument("plan")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model, example = digits_mlp()  # example: one micro-batch, the profile's micro-batch size
plan = planner.load_plan(args.plan)
try:
    pipe = planner.build_pipeline(model.train(), example, plan, rank=rank, loss_fn=F.cross_entropy)
except planner.PlannerError as exc:  # e.g. a plan with replicas: one line, every rank stops
    if rank == 0:
        print(f"error: {exc}", file=sys.stderr)
    dist.destroy_process_group()
    sys.exit(2)
optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05)
rows = plan.microbatches * example[0].shape[0]
losses = []
for step in range(args.steps):
    images, labels = batches(seed=0, step=step, batch_size=rows)
    optimizer.zero_grad(set_to_none=True)
    mine = []
    pipe.schedule.step(*((images,) if pipe.is_first else ()), target=labels if pipe.is_last else None, losses=mine,
                       **pipe.step_kwargs)
    pipe.finish_backward()
    optimizer.step()
    loss = torch.tensor([float(torch.stack(mine).mean().detach()) if mine else 0.0], dtype=torch.float64)
    dist.broadcast(loss, src=pipe.last_rank)  # the last stage's rank holds the losses
    losses.append(float(loss))
if rank == 0:
    print(json.dumps({"losses": losses}))
dist.barrier()  # leave together: gloo aborts a rank whose peer tears its connections down mid-transfer
dist.destroy_process_group()
