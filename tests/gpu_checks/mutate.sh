#!/usr/bin/env bash
# Each of the three synchronisations removed in turn from the installed client: tests/test_gpu.py must fail.
S=/tmp/site/prefetchd_client
cp -r $S /tmp/client.orig
try() {  # name file python-expr
  rm -rf $S && cp -r /tmp/client.orig $S
  python3 - "$S/$2" "$3" "$4" <<'PY'
import sys; p, old, new = sys.argv[1:4]; s = open(p).read(); assert s.count(old) == 1, (p, old); open(p, "w").write(s.replace(old, new))
PY
  timeout ${MUT_T:-100} python3 -m pytest -x -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -4 > /tmp/mut.txt
  if grep -q "failed" /tmp/mut.txt; then r=FAILS; else r=PASSES; fi
  echo "MUTATION $1: test_gpu $r :: $(grep -E 'FAILED|passed|failed' /tmp/mut.txt | tr '\n' ' ' | cut -c1-300)"
}
try no_wait_event memory.py "cur.wait_event(event)" "pass"
try no_record_stream memory.py "t.record_stream(cur)" "pass"
try no_release_event reader.py "self._pool.release(host, event)" "self._pool.release(host, None)"
rm -rf $S && cp -r /tmp/client.orig $S
