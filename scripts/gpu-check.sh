#!/usr/bin/env bash
# What to run on a machine with a real GPU: lists the devices of both backends, runs
# the kernel tests on that GPU through wgpu (`vulkan:N`) and through Kiln's raw Vulkan
# backend (`vk:N`), benches GEMM and attention at GPT-2 shapes (and a GPT-2 training
# step) with % of the device's measured peak, and writes a Markdown report to paste
# into benches/RESULTS.md.
#
#   bash scripts/gpu-check.sh                    # the first non-CPU Vulkan device of each backend
#   bash scripts/gpu-check.sh --vulkan vulkan:1 --vk vk:1
#   bash scripts/gpu-check.sh --quick            # small shapes and a few tests (minutes on lavapipe)
#   bash scripts/gpu-check.sh --dry-run          # print the steps, run nothing
#   bash scripts/gpu-check.sh --out report.md
#   bash scripts/gpu-check.sh --no-coopmat       # a GPU without VK_KHR_cooperative_matrix
#
# The cooperative-matrix GEMM (f16, VK_KHR_cooperative_matrix) is checked against the
# CPU with KILN_TEST_COOPMAT=1: on a GPU without it that step fails, naming why (pass
# --no-coopmat there). Its f16 GEMMs are benched twice, with it and without it
# (KILN_VK_COOPMAT=0), rows `coopmat MxNxK` beside the other kernel.
#
# The kernel tests find the device through KILN_TEST_VULKAN and KILN_TEST_VK
# (tests/common/mod.rs). They check what the device routes, not lavapipe's routing:
# `KILN_PLAN_AS_GPU=1 bash scripts/gpu-check.sh --quick` plans for lavapipe as for a
# GPU, to see a GPU's routes here. KILN=path/to/kiln uses that binary instead of
# building one. A failing step is recorded in the report and the rest still run; the
# exit status is 1 if any step failed.
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
quick=0 dry=0 vulkan="" vk="" out="" coopmat=1
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --dry-run) dry=1 ;;
        --vulkan) vulkan="${2:?--vulkan takes a wgpu device, e.g. vulkan:1}"; shift ;;
        --vk) vk="${2:?--vk takes a raw Vulkan device, e.g. vk:1}"; shift ;;
        --out) out="${2:?--out takes a file}"; shift ;;
        --no-coopmat) coopmat=0 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument \`$1\` (see --help)" >&2; exit 2 ;;
    esac
    shift
done
command -v python3 >/dev/null || { echo "gpu-check: needs python3 (for the report's tables)" >&2; exit 2; }

# The release build for real figures; --quick takes the dev profile (optimized in this
# workspace) so that it runs without a second full build.
profile=(--release)
[ "$quick" = 1 ] && profile=()
dir=release
[ "$quick" = 1 ] && dir=debug
if [ -z "${KILN:-}" ]; then
    KILN="${CARGO_TARGET_DIR:-$root/target}/$dir/kiln"
    if [ "$dry" = 0 ]; then
        (cd "$root" && cargo build -q "${profile[@]}" -p kiln) || { echo "gpu-check: cargo build failed" >&2; exit 1; }
    fi
fi

# The device of each backend: the first that is not a CPU one (lavapipe, llvmpipe),
# else the first (a machine without a GPU: the report says so).
pick() { # backend
    "$KILN" devices --json 2>/dev/null | python3 -c '
import json, sys
backend = sys.argv[1]
rows = [d for d in json.load(sys.stdin) if d["backend"] == backend]
gpu = [d for d in rows if d["device_type"] != "cpu"]
pick = (gpu or rows or [None])[0]
if pick is None:
    sys.exit(1)
spec = pick["spec"] if backend == "vk" else "vulkan:%d" % rows.index(pick)
print(spec + ("" if gpu else " cpu"))
' "$1"
}
cpu_only=0
if [ "$dry" = 0 ] || [ -x "$KILN" ]; then
    for b in vulkan vk; do
        [ "$b" = vulkan ] && [ -n "$vulkan" ] && continue
        [ "$b" = vk ] && [ -n "$vk" ] && continue
        got="$(pick "$b")" || { echo "gpu-check: no \`$b\` device: see \`$KILN devices\`" >&2; exit 1; }
        case "$got" in *" cpu") cpu_only=1; got="${got% cpu}" ;; esac
        [ "$b" = vulkan ] && vulkan="$got" || vk="$got"
    done
fi
vulkan="${vulkan:-vulkan:0}" vk="${vk:-vk:0}"
# A CPU driver (no GPU found) has no cooperative matrix: the check then only shows
# the route refusing it.
[ "$cpu_only" = 1 ] && coopmat=0

stamp="$(date -u +%Y-%m-%dT%H%M%SZ)"
[ -n "$out" ] || out="$root/benches/gpu-check-$stamp.md"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failed=0

# Steps: a title and a command line. In a dry run they are printed, not run.
steps=()
step() { steps+=("$1"$'\t'"$2"); }

step "devices" "\"$KILN\" devices"
tests=(--test kernels --test matmul --test gemm_tiles --test attention --test layers --test loss --test optim)
filter=""
if [ "$quick" = 1 ]; then
    tests=(--test matmul)
    filter="-- vk"
fi
step "kernel tests ($vulkan, $vk)" "KILN_TEST_VULKAN=$vulkan KILN_TEST_VK=$vk cargo test ${profile[*]} -p kiln ${tests[*]} $filter"
# The cooperative-matrix GEMM against the CPU (tests/vk.rs), required unless --no-coopmat.
step "cooperative-matrix GEMM ($vk)" "KILN_TEST_VK=$vk KILN_TEST_COOPMAT=$coopmat KILN_GEMM_LOG=1 cargo test ${profile[*]} -p kiln --test vk -- cooperative_matrix_gemm --nocapture"
step "peak" "\"$KILN\" bench peak --devices $vulkan --json > $work/peak.json"
if [ "$quick" = 1 ]; then
    step "GEMM" "\"$KILN\" bench matmul --devices $vk,$vulkan --spirv --dtypes f32 --sizes 96 --naive-up-to 0 --budget-ms 20 --json $work/matmul.json"
    step "attention" "\"$KILN\" bench attention --devices $vk,$vulkan --heads 2 --dim 16 --seqs 64 --budget-ms 10 --json $work/attention.json"
else
    # The default shapes: squares 256..2048 and GPT-2 124M's GEMMs at T 1024.
    step "GEMM" "\"$KILN\" bench matmul --devices $vk,$vulkan --spirv --dtypes f32,f16 --naive-up-to 0 --json $work/matmul.json"
    # The same f16 GEMMs on the raw Vulkan device without the cooperative-matrix GEMM.
    [ "$coopmat" = 1 ] && step "GEMM without coopmat" "KILN_VK_COOPMAT=0 \"$KILN\" bench matmul --devices $vk --dtypes f16 --naive-up-to 0 --json $work/matmul_nocoop.json"
    # GPT-2 124M: 12 heads of 64, T 1024 (batch 1), and longer contexts.
    step "attention" "\"$KILN\" bench attention --devices $vk,$vulkan --heads 12 --dim 64 --seqs 1024,2048 --dtype f16 --json $work/attention.json"
    step "train" "\"$KILN\" bench train --model gpt2 --devices $vk,$vulkan --precision fp32,fp16 --json $work/train.json"
fi

if [ "$dry" = 1 ]; then
    echo "gpu-check (dry run): $([ "$quick" = 1 ] && echo quick || echo full) mode, wgpu device $vulkan, raw Vulkan device $vk; report: $out"
    for s in "${steps[@]}"; do
        printf '%s:\n    %s\n' "${s%%$'\t'*}" "${s#*$'\t'}"
    done
    exit 0
fi

{
    echo "## GPU check, $stamp"
    echo
    echo "\`bash scripts/gpu-check.sh$([ "$quick" = 1 ] && echo " --quick")\` at $(cd "$root" && git rev-parse --short HEAD 2>/dev/null || echo '?'); wgpu device \`$vulkan\`, raw Vulkan device \`$vk\`."
    [ "$cpu_only" = 1 ] && echo "No GPU was found: these are a CPU driver's figures (lavapipe), not a GPU's."
    echo
} > "$out"

for s in "${steps[@]}"; do
    title="${s%%$'\t'*}" cmd="${s#*$'\t'}"
    echo "gpu-check: $title" >&2
    t0=$(date +%s)
    (cd "$root" && bash -c "$cmd") > "$work/step.out" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    [ $rc = 0 ] || failed=1
    {
        echo "### $title ($([ $rc = 0 ] && echo ok || echo "FAILED, exit $rc"), ${secs} s)"
        echo
        echo '```'
        echo "$cmd" | sed "s|$work/||g; s|\"$KILN\"|kiln|g"
        echo '```'
        echo
        echo '```'
        case "$title/$rc" in
            "kernel tests"*/0) grep -E "^test result" "$work/step.out" ;;
            *) tail -n 40 "$work/step.out" ;;
        esac
        echo '```'
        echo
    } >> "$out"
done

# The benches' rows with % of the measured peak (f32 FMA; f16 rows are against that
# f32 figure too). Attention FLOPs: causal forward 2·T²·d per head, backward 2.5x that
# (recomputing the scores), as FlashAttention-2 counts.
python3 - "$work" >> "$out" <<'EOF'
import json, os, sys
work = sys.argv[1]
def load(name):
    p = os.path.join(work, name)
    return json.load(open(p)) if os.path.exists(p) else None
peaks = load("peak.json") or []
peak = peaks[0]["gflops"] if peaks else None
def pct(g):
    return "-" if not peak else "%.1f%%" % (100.0 * g / peak)
if peak:
    print("Peak (`kiln bench peak`): %.1f GFLOP/s f32 FMA, %.1f GB/s copy.\n" % (peak, peaks[0]["gbps"]))
rows = (load("matmul.json") or []) + (load("matmul_nocoop.json") or [])
if rows:
    print("| device | dtype | shape | M x N x K | kernel | GFLOP/s | % of peak | CPU sgemm GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s (%s) | %s | %s | %dx%dx%d | %s | %.1f | %s | %.1f |" % (
            r["adapter"], r["backend"], r["dtype"], r["shape"], r["m"], r["n"], r["k"],
            r["variant"], r["gflops"], pct(r["gflops"]), r["cpu_gflops"]))
    print()
rows = load("attention.json")
if rows:
    print("| device | dtype | B*H | T | d | fused ms | GFLOP/s | % of peak | straightforward ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        flops = 3.5 * 2.0 * r["heads"] * r["seq"] ** 2 * r["dim"]
        g = flops / (r["fused_ms"] * 1e6)
        s = "-" if r.get("straight_ms") is None else "%.2f" % r["straight_ms"]
        print("| %s (%s) | %s | %d | %d | %d | %.2f | %.1f | %s | %s |" % (
            r["adapter"], r["backend"], r["dtype"], r["heads"], r["seq"], r["dim"],
            r["fused_ms"], g, pct(g), s))
    print()
rows = load("train.json")
if rows:
    print("| model | device | precision | tokens/s | step ms | GFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s (%s) | %s | %.0f | %.1f | %.1f | %s |" % (
            r["model"], r["adapter"], r["backend"], r["precision"], r["tokens_per_s"],
            r["step_ms"], r["achieved_gflops"], pct(r["achieved_gflops"])))
    print()
EOF
echo "gpu-check: report in $out$([ $failed = 1 ] && echo ' (some steps FAILED)')" >&2
exit $failed
