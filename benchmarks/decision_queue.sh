#!/usr/bin/env bash
# The decision test end to end (docs/protocol_decision.md, "Commands"), restartable on a new machine:
#   benchmarks/decision_queue.sh [OUTPUT]      # default outputs/decision_test; from the repository's root
# 1. the records kept so far, if any, are restored (runs finished on an earlier machine are reported, never trained again;
#    the check's start-check.json comes back with them, so the check is not run again);
# 2. the start-policy check, once (it trains the start first when it is not cached: about 95 minutes on 2 cores);
# 3. the protocol's rule, read from the check's start-check.json: on "stop" the queue ends and no run starts;
# 4. the start on every thread, then two one-thread workers (even and odd seeds) sharing OUTPUT;
# 5. while they run, the finished runs' records are saved every SAVE_EVERY seconds into results/decision_test/
#    (a session commits them as runs end: a machine lost between sessions loses only the runs in progress);
# 6. when both end, the records once more and the report.
set -euo pipefail
OUTPUT=${1:-outputs/decision_test}
SAVE_EVERY=${SAVE_EVERY:-600}
PY=${PYTHON:-python}
say() { echo "decision queue: $* ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))"; }

# records.tar.xz, or records.tar.gz as an older checkout wrote them (run_records.py reads either)
if [ -f results/decision_test/records.tar.xz ] || [ -f results/decision_test/records.tar.gz ]; then
  $PY benchmarks/run_records.py restore "$OUTPUT"
fi
if [ ! -f "$OUTPUT/start-check.json" ]; then
  say "the start-policy check"
  $PY benchmarks/decision_check.py --output "$OUTPUT"
fi
if ! $PY benchmarks/decision_check.py --rule "$OUTPUT/start-check.json"; then
  say "the rule says stop: no run starts"
  exit 1
fi
say "the start"
$PY benchmarks/bench_decision.py --resume --start-only --output "$OUTPUT"
# Runs restored from another machine trained from its build of the start (the same recipe, keyed by its cache path);
# the digest of this machine's build goes in the log, so that the protocol's log can say whether they are the same.
say "the start's weights digest: $($PY -c 'import sys
from pathlib import Path
from benchmarks import bench_decision as b
from experiments.model_manifest import weights_digest
args = b.parse_args(["--output", sys.argv[1]])
print(weights_digest(Path(b.start_policy(b.testbed(args), args))))' "$OUTPUT")"
say "two workers"
OMP_NUM_THREADS=1 $PY benchmarks/bench_decision.py --resume --output "$OUTPUT" --seeds 0 2 4 6 8 10 12 14 16 18 \
  > "$OUTPUT.worker0.log" 2>&1 &
even=$!
OMP_NUM_THREADS=1 $PY benchmarks/bench_decision.py --resume --output "$OUTPUT" --seeds 1 3 5 7 9 11 13 15 17 19 \
  > "$OUTPUT.worker1.log" 2>&1 &
odd=$!
while kill -0 "$even" 2>/dev/null || kill -0 "$odd" 2>/dev/null; do
  sleep "$SAVE_EVERY"
  $PY benchmarks/run_records.py save "$OUTPUT" > /dev/null
done
status=0
wait "$even" || status=$?
wait "$odd" || status=$?
$PY benchmarks/run_records.py save "$OUTPUT"
if [ "$status" -ne 0 ]; then
  say "a worker failed (exit $status): rerun this script, which resumes"
  exit "$status"
fi
say "every run ended: the report"
$PY benchmarks/bench_decision.py --resume --report --output "$OUTPUT"
