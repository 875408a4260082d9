#!/usr/bin/env bash
# All of issue 47's GPU figures in priority order, each phase only while time is left (BUDGET s).
set -uo pipefail
PH=${1:-corpus,test,mut,train,hybrid,main,usertf,ranks,bench,cost}
BUDGET=${BUDGET:-560}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
has() { [[ ",$PH," == *",$1,"* ]]; }
go() { local l; l=$(left); if (( l < $1 )); then echo "=== SKIP $2 (left ${l}s < $1)"; return 1; fi; echo "=== $2 at +$(( $(date +%s) - T0 ))s"; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
if [[ ! -d /tmp/site/nvidia ]]; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1; fi
rm -rf /tmp/site/prefetchd /tmp/site/prefetchd_client
cp -r prefetchd /tmp/site/prefetchd && cp -r client /tmp/site/prefetchd_client || exit 1
nvidia-smi -L; nproc; python3 -c "import torch, torchvision, nvidia.nvimgcodec as n; print('torch', torch.__version__, torchvision.__version__, 'nvimgcodec', getattr(n, '__version__', '?'))"
if has corpus && [[ ! -d /tmp/corpus ]]; then go 0 corpus
  mkdir -p /tmp/corpus /tmp/cparts /tmp/val
  for i in $(seq 0 15); do python3 .gpu/make_corpus.py /tmp/cparts/$i --classes 1 --per-class 600 --seed $i 2>/dev/null & done
  for i in $(seq 0 15); do python3 .gpu/make_corpus.py /tmp/cparts/v$i --classes 1 --per-class 50 --seed $((100+i)) 2>/dev/null & done; wait
  for i in $(seq 0 15); do mv /tmp/cparts/$i/n00000000 /tmp/corpus/$(printf n%08d $i); mv /tmp/cparts/v$i/n00000000 /tmp/val/$(printf n%08d $i); done
  for f in /tmp/val/*/*.JPEG; do mv "$f" "$(dirname "$f")/val_$(basename "$f")"; done
  ls /tmp/corpus | wc -l; find /tmp/corpus -type f | wc -l; find /tmp/val -type f | wc -l
fi
if has test && go 60 test; then
  timeout $(( $(left) < 240 ? $(left) : 240 )) python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_hybrid.py tests/test_client.py 2>&1 | tail -25
fi
if has mut && go 60 mutations; then MUT_T=90 bash .gpu/mutate.sh; fi
if has train; then for m in resnet50 resnet18; do go 50 "train $m" || break
  timeout $(( $(left) < 150 ? $(left) : 150 )) python3 .gpu/gpu_train.py /tmp/corpus --model $m --workers 14 --warmup 30 --steps 100 --json "$OUT/train.jsonl" 2>&1 | grep -v Warning
done; fi
if has hybrid; then for d in hybrid gpu; do go 40 "decode $d" || break
  timeout $(( $(left) < 120 ? $(left) : 120 )) python3 .gpu/gpu_train.py /tmp/corpus --model resnet18 --workers 14 --warmup 30 --steps 100 \
    --modes prefetchd --decode $d --gpu-share 0.5 --json "$OUT/train.jsonl" 2>&1 | grep -v Warning
done; fi
if has main && go 60 main.py; then MAIN_T=$(( $(left) < 150 ? $(left) - 10 : 140 )) bash .gpu/main_run.sh; fi
if has usertf && go 40 usertf; then timeout $(( $(left) < 90 ? $(left) : 90 )) python3 .gpu/user_tf.py /tmp/corpus "$OUT/usertf.jsonl" 2>&1 | grep -v Warning | tail -20; fi
if has ranks && go 60 ranks; then
  timeout $(( $(left) < 150 ? $(left) : 150 )) python3 -m prefetchd bench --ranks 8 --capacity 1000 --root /tmp/corpus --workers 14 --batch-size 64 \
    --mode random_resized_crop --quiet --json "$OUT/ranks.json" 2>&1 | grep -v Warning | tail -12
fi
if has bench; then for m in resnet50 resnet18; do go 60 "bench $m" || break
  timeout $(( $(left) < 150 ? $(left) : 150 )) python3 -m prefetchd bench --train $m --root /tmp/corpus --workers 14 --quiet --json "$OUT/bench-$m.json" 2>&1 | grep -v Warning | tail -15
done; fi
if has cost; then for m in resnet50 resnet18; do go 50 "cost $m" || break
  timeout $(( $(left) < 120 ? $(left) : 120 )) python3 .gpu/gpu_client_cost.py /tmp/corpus --model $m --json "$OUT/cost.jsonl" 2>&1 | grep -v Warning
done; fi
echo "=== done at +$(( $(date +%s) - T0 ))s"
