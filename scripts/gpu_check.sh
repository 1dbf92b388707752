#!/usr/bin/env bash
# The device check: run on a lent GPU machine (not in CI, which has no GPU). It profiles six example models on
# the GPU (committed under profiles/<type>/), trains four of them end to end on one GPU over nccl with
# `plan train` (committed under bench/gpu-runs/<type>-<date>/, which bench/gpu.py replays into docs/bench-gpu.md),
# and records what happens when a plan puts two ranks on one GPU.
# Everything goes to $OUT (default /tmp/gpu-check): log.txt and gpu.tgz (profiles, plans, round logs).
# Uses the machine's own torch; pulp and highspy travel as wheels in .whl/ when the machine lacks them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
WORK=/tmp/gpu-work
mkdir -p "$OUT" "$WORK/profiles" "$WORK/train"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PLANNER_CACHE_DIR=$WORK/cache PYTHONPATH=$PWD
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
mkdir -p "$WORK/bin" && export PATH=$WORK/bin:$PATH
printf '#!/usr/bin/env bash\nexec %s -c "import sys; from planner.cli import main; sys.argv[0] = \\"plan\\"; main()" "$@"\n' "$PY" > "$WORK/bin/plan"
chmod +x "$WORK/bin/plan"
stamp() { date +%s.%N; }
took() { $PY -c "print(f'{$(stamp) - $1:.1f} s')"; }

nvidia-smi -L; echo "load average: $(cat /proc/loadavg)"
$PY -c "import torch, numpy, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), 'numpy', numpy.__version__, 'transformers', transformers.__version__)"
TYPE=$($PY -c "from planner.profile.device import detect_device_type; print(detect_device_type())")
MEM=$($PY -c "from planner.profile.device import device_memory_bytes; print(device_memory_bytes())")
echo "device type $TYPE, $MEM bytes"

echo "== 1. profiles of the example models on the GPU"
for m in gpt:gpt_small resnet:resnet_small unet:unet_small digits:digits_cnn hf:llama_small gpt:gpt_medium; do
  t=$(stamp)
  timeout 150 plan profile "planner.examples.$m" -o "$WORK/profiles/${m#*:}.json" --json > "$WORK/profiles/${m#*:}.log" 2>&1
  echo "$m rc=$? $(took "$t")"
done

echo "== 2. plan train on one GPU (nccl, world size 1)"
$PY - "$TYPE" "$MEM" "$WORK" <<'EOF'
import json, sys
dev_type, mem, work = sys.argv[1], int(sys.argv[2]), sys.argv[3]
link = {"bandwidth_Bps": 4.5e11, "latency_s": 1e-5, "source": "NVLink 4 (assumed; no second GPU on this machine)"}
for n in (1, 2):
    cluster = {"schema_version": 1, "name": f"{dev_type}-{n}", "about": f"{n} rank(s) on the one lent GPU",
               "devices": [{"id": f"gpu{i}", "type": dev_type, "host": "localhost", "memory_bytes": mem}
                           for i in range(n)],
               "links": {"intra_host": link, "inter_host": dict(link, bandwidth_Bps=5e10)}}
    json.dump(cluster, open(f"{work}/cluster-{n}.json", "w"), indent=1)
EOF
for m in gpt:gpt_small resnet:resnet_small unet:unet_small hf:llama_small; do
  t=$(stamp)
  timeout 150 plan train "planner.examples.$m" --cluster "$WORK/cluster-1.json" --steps 40 \
    -o "$WORK/train/${m#*:}" --no-rebalance > "$WORK/train/${m#*:}.log" 2>&1
  echo "train $m rc=$? $(took "$t")"
  grep -E "chosen|^trained|loss|step time|Error|error" "$WORK/train/${m#*:}.log"
done

echo "== 3. two ranks on one GPU: what plan run says"
timeout 60 plan partition "$WORK/profiles/gpt_small.json" --cluster "$WORK/cluster-2.json" -o "$WORK/plan-2.json" 2>&1 | tail -3
timeout 90 plan run "$WORK/plan-2.json" planner.examples.gpt:gpt_small --steps 4 --timeout-s 30 > "$WORK/run-2.log" 2>&1
echo "plan run (2 ranks, 1 GPU) rc=$?"; tail -6 "$WORK/run-2.log"
echo "== 4. NCCL with two ranks on one device, without planner"
cat > "$WORK/nccl_two.py" <<'EOF'
import os, torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=r, world_size=2)
    x = torch.ones(4, device="cuda:0")
    try:
        dist.all_reduce(x); torch.cuda.synchronize(); print(f"rank {r}: all_reduce ok -> {x[0].item()}")
    except Exception as e:
        print(f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(rank, nprocs=2)
EOF
timeout 60 $PY "$WORK/nccl_two.py" 2>&1 | grep -v "^ " | tail -8
echo "nccl duplicate-device rc=${PIPESTATUS[0]}"
tar czf "$OUT/gpu.tgz" -C "$WORK" profiles train plan-2.json run-2.log cluster-1.json cluster-2.json 2>/dev/null
echo "done"
