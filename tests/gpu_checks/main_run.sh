#!/usr/bin/env bash
# pytorch/examples imagenet/main.py with the port of docs/porting.md: resnet50, 6 epochs of 37 steps (222), validation each epoch.
mkdir -p /etc/prefetchd /tmp/in && ln -sfn /tmp/corpus /tmp/in/train && ln -sfn /tmp/val /tmp/in/val
cat > /etc/prefetchd/prefetchd.yaml <<Y
dataset: {root: /tmp/corpus}
loader: {batch_size: 256, epochs: null}
workers: {count: 14}
buffer: {dir: /dev/shm/pfd-main, capacity: 48, max_bytes: 16GiB}
augment: {mode: random_resized_crop}
validation: {enabled: true, root: /tmp/val}
Y
python3 -m prefetchd check --config /etc/prefetchd/prefetchd.yaml 2>&1 | tail -5
python3 -m prefetchd run --config /etc/prefetchd/prefetchd.yaml > /tmp/main-daemon.log 2>&1 &
D=$!
t0=$(date +%s)
timeout ${MAIN_T:-150} python3 .gpu/main.py -a resnet50 --epochs 6 --gpu 0 -p 37 /tmp/in 2>&1 | grep -v Warning | grep -E "Epoch|Test|\*|Error|error|Traceback|File" | tail -40
echo "main.py rc ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"
kill $D; wait $D; echo "daemon rc $?"; tail -3 /tmp/main-daemon.log
