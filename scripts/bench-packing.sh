#!/usr/bin/env bash
# Packed against padded fine-tuning on one set of short examples (benches/RESULTS.md,
# "Packing"): 400 prompt/completion rows of 90 to 310 bytes (median ~200 tokens with
# the bytes tokenizer), a 2-layer GPT at T = 512, micro-batch 4, on DEVICE. Each run
# trains STEPS steps; the summary's mean step time (warm-up excluded) and the log's
# padding share give the trained tokens per second of each.
#   bash scripts/bench-packing.sh [DEVICE] [STEPS]        (default vulkan:0, 12)
set -euo pipefail
device="${1:-vulkan:0}"
steps="${2:-12}"
cd "$(dirname "$0")/.."
kiln="${KILN:-target/release/kiln}"
[ -x "$kiln" ] || cargo build --release --quiet
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir/rows.jsonl" <<'EOF'
import json, random, sys
random.seed(7)
words = "the of and a to in is you that it he was for on are as with his they".split()
def text(n):
    out = ""
    while len(out) < n:
        out += random.choice(words) + " "
    return out[:n]
with open(sys.argv[1], "w") as f:
    for _ in range(400):
        f.write(json.dumps({"prompt": text(random.randint(30, 110)),
                            "completion": text(random.randint(60, 200))}) + "\n")
EOF
"$kiln" prepare "$dir/rows.jsonl" "$dir/ex.bin" --tokenizer bytes >/dev/null
echo '{"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 512, "vocab_size": 256}' >"$dir/model.json"
echo '{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}' >"$dir/ds.json"
for mode in packed padded; do
    flag=()
    [ "$mode" = padded ] && flag=(--no-packing)
    "$kiln" train --config "$dir/ds.json" --model "$dir/model.json" --data "$dir/ex.bin" \
        --devices "$device" --steps "$steps" --eval-every 0 --out "$dir/$mode" "${flag[@]}" \
        2>"$dir/$mode.log" >/dev/null
    share=$(grep -o '[0-9.]* % padding' "$dir/$mode.log" | head -1 | cut -d' ' -f1)
    python3 - "$dir/$mode/summary.json" "$mode" "$share" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
share = float(sys.argv[3]) / 100
ms = s["mean_step_ms"]
real = 4 * 513 * (1 - share) / (ms / 1000)
print(f"{sys.argv[2]}: padding {share * 100:.1f} %, {ms:.0f} ms/step, {real:.0f} trained-row tokens/s")
EOF
done
