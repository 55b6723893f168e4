#!/usr/bin/env bash
# Probe driver (untracked): each "case|fields" line of $1, the option timed
# interleaved against the heuristic's config.
while IFS='|' read -r case option; do
  [ -n "$case" ] || continue
  timeout 120 python3 experiments/lab/ragged_profile_case.py --case "$case" \
    --kernel mosaic --versus "$option" --time 20 2>&1 \
    | grep -E "relative error|us \(CUPTI|time =|Error"
done < "$1"
