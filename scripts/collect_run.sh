#!/usr/bin/env bash
# Copy a finished run's small artifacts into the repository's results/ (never checkpoints):
# config.yaml, metrics.jsonl, summary.json, alerts.jsonl, eval/ and diagnosis.json
# (written by `keel diagnose RUN` first).   scripts/collect_run.sh [--prune] RUN_DIR DEST_DIR
# --prune: then delete RUN_DIR/checkpoints (hundreds of MB to GB per run) once the copy is made.
set -euo pipefail
prune=0
if [ "${1:-}" = "--prune" ]; then prune=1; shift; fi
run=${1:?RUN_DIR}; dest=${2:?DEST_DIR}
[ -f "$run/summary.json" ] || { echo "collect_run: $run has no summary.json (not finished?)" >&2; exit 1; }
[ -e "$dest" ] && { echo "collect_run: $dest exists; not overwritten" >&2; exit 1; }
${KEEL:-.venv/bin/keel} diagnose "$run" > /dev/null
mkdir -p "$dest"
for f in config.yaml metrics.jsonl summary.json alerts.jsonl diagnosis.json; do
  [ -f "$run/$f" ] && cp "$run/$f" "$dest/"
done
[ -d "$run/eval" ] && cp -r "$run/eval" "$dest/"
if [ "$prune" = 1 ] && [ -d "$run/checkpoints" ]; then
  rm -rf "$run/checkpoints"
  echo "collect_run: removed $run/checkpoints" >&2
fi
echo "$dest"
