#!/usr/bin/env bash
# The prepared GPU session (issue 43): everything a short GPU lease should measure, in the order
# that matters, each result written to DIR as soon as it exists, so a run cut short keeps what it
# measured. Run from a checkout on a GPU machine with its own CUDA torch:
#
#   FP8RL_GIT_COMMIT=$(git rev-parse HEAD) bash bench/gpu_session.sh DIR [part]
#
# part 1 (about 4 minutes on an H200, estimated): the machine (commit, GPU, versions), the kernel probe,
# pytest -m gpu with the opt-in Triton switches off (the E4M3 KV write is on by default) and then on (FP8RL_WGRAD_GEMM, FP8RL_SILU_MUL, FP8RL_RMS_NORM, FP8RL_SAMPLING, FP8RL_CHECKSUM, FP8RL_DUAL_QUANT=split among them), the kernel microbenchmark and the host
# overhead of one linear, then the 1B's training profile with the dual-layout quantizer in strips
# (FP8RL_DUAL_QUANT=split, bf16 against fp8-e2e), then the sampling alone (torch's draw against the Triton launches), then
# the long-context rollout rows of the 8b-4l preset (256 and 128 sequences x 4096 new tokens, BF16
# against FP8 weights + E4M3 KV only: about 1.5 minutes).
# part 2 (about 6 minutes): bench rollout of the 1B preset, 64 sequences x 2048 new tokens, graph
# loop with the Triton decode attention and RoPE + the KV write in one launch, BF16/FP8 weights x BF16/E4M3
# KV; the training profile of the 1B (bf16 against fp8-e2e, per kernel); the decode attention
# alone at four shapes; the kernels at training's token counts; the 8b-4l rollout at 256 x 1024 (fused SiLU*mul, RMSNorm and sampling on);
# bench fp8 (train) on the 8B-shaped layers at 4096 tokens, with cuBLAS's wgrad and the Triton
# one; then one RL step per recipe of the 1B
# preset (64 x 8 x 64; bf16 and fp8-gen again with FP8RL_CHECKSUM=triton, the weight sync's reports in one launch) and of the 8b-4l preset (32 x 8 x 1024: bf16, and fp8-e2e with the BF16
# and the E4M3 KV cache).
# Without a part, both run (about 10 minutes: one call of a 15-minute lease).
set -u
dir=${1:?usage: bench/gpu_session.sh DIR [1|2]}
part=${2:-all}
py=${PYTHON:-python3}
mkdir -p "$dir"
export PYTHONUNBUFFERED=1
started=$(date +%s)
stamp() { echo "[gpu-session +$(($(date +%s) - started)) s] $*" | tee -a "$dir/session.log"; }

if [ "$part" = 1 ] || [ "$part" = all ]; then
    stamp "part 1: machine, probe, pytest (opt-in Triton switches off), kernels, overhead"
    $py -m bench.gpu_check --quick --out "$dir/check.md" \
        --sections machine,probe,plan,pytest,kernels,overhead >>"$dir/session.log" 2>&1
    stamp "part 1: pytest -m gpu with FP8RL_DECODE_ATTENTION=triton FP8RL_SMALL_M_GEMM=triton FP8RL_KV_WRITE=triton FP8RL_WGRAD_GEMM=triton FP8RL_SILU_MUL=triton FP8RL_RMS_NORM=triton FP8RL_SAMPLING=triton FP8RL_CHECKSUM=triton FP8RL_DUAL_QUANT=split"
    FP8RL_DECODE_ATTENTION=triton FP8RL_SMALL_M_GEMM=triton FP8RL_KV_WRITE=triton FP8RL_WGRAD_GEMM=triton FP8RL_SILU_MUL=triton FP8RL_RMS_NORM=triton FP8RL_SAMPLING=triton FP8RL_CHECKSUM=triton FP8RL_DUAL_QUANT=split \
        $py -m bench.gpu_check --out "$dir/check-triton.md" --sections pytest >>"$dir/session.log" 2>&1
    stamp "part 1: bench profile-train 1b, fp8-e2e with the dual-layout quantizer in strips (FP8RL_DUAL_QUANT=split)"
    FP8RL_DUAL_QUANT=split $py -m fp8rl.cli bench profile-train --model 1b --device cuda --top 12 \
        --recipes bf16,fp8-e2e >"$dir/profile-train-1b-dual-split.txt" 2>>"$dir/session.log"
    stamp "part 1: bench sampling (torch's draw against the three launches of FP8RL_SAMPLING=triton)"
    $py -m fp8rl.cli bench sampling --device cuda >"$dir/sampling.txt" 2>>"$dir/session.log"
    for n in 256 128; do
        stamp "part 1: bench rollout 8b-4l, $n x 4096, BF16 against FP8 weights + E4M3 KV, every decode switch on"
        FP8RL_KV_WRITE=triton FP8RL_SILU_MUL=triton FP8RL_RMS_NORM=triton FP8RL_SAMPLING=triton \
            $py -m fp8rl.cli bench rollout --model 8b-4l --device cuda --prompts $n --new-tokens 4096 \
            --repeat 1 --decode graph-triton --variants bf16/bf16,fp8/fp8 \
            >"$dir/rollout-8b-4l-${n}x4096.txt" 2>>"$dir/session.log"
    done
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
    stamp "part 2: bench rollout 1b, 64 x 2048, graph-triton, RoPE + the KV write in one launch (FP8RL_KV_WRITE=triton)"
    FP8RL_KV_WRITE=triton $py -m fp8rl.cli bench rollout --model 1b --device cuda --prompts 64 \
        --new-tokens 2048 --repeat 1 --decode graph-triton >"$dir/rollout-1b-64x2048-kvwrite.txt" 2>>"$dir/session.log"
    stamp "part 2: bench profile-train 1b (the kernels fp8-e2e training spends beyond bf16's)"
    $py -m fp8rl.cli bench profile-train --model 1b --device cuda --top 12 \
        >"$dir/profile-train-1b.txt" 2>>"$dir/session.log"
    stamp "part 2: bench decode-attention (BF16 vs E4M3 cache: time, GB/s, error per head against float64 and SDPA)"
    $py -m fp8rl.cli bench decode-attention --device cuda >"$dir/decode-attention.txt" 2>>"$dir/session.log"
    stamp "part 2: bench kernels at training's token counts (quantize_dual, wgrad at M 4736, 14336 -> 4096)"
    $py -m fp8rl.cli bench kernels --device cuda --tokens 256,4096,4736 \
        --shapes 2048x8192,8192x2048,4096x14336,14336x4096 >"$dir/kernels-train.txt" 2>>"$dir/session.log"
    stamp "part 2: bench rollout 8b-4l, 256 x 1024, graph-triton, RoPE + the KV write in one launch, the fused SiLU*mul, RMSNorm and sampling"
    FP8RL_KV_WRITE=triton FP8RL_SILU_MUL=triton FP8RL_RMS_NORM=triton FP8RL_SAMPLING=triton $py -m fp8rl.cli bench rollout --model 8b-4l --device cuda --prompts 256 \
        --new-tokens 1024 --repeat 1 --decode graph-triton >"$dir/rollout-8b-4l-256x1024.txt" 2>>"$dir/session.log"
    stamp "part 2: bench fp8, forward + backward of the 8B-shaped layers at 4096 tokens"
    $py -m fp8rl.cli bench fp8 --shapes 4096x4096x14336,4096x14336x4096 --mode train --device cuda \
        >"$dir/fp8-train-8b-layers.txt" 2>>"$dir/session.log"
    stamp "part 2: the same with the Triton wgrad GEMM (FP8RL_WGRAD_GEMM=triton)"
    FP8RL_WGRAD_GEMM=triton $py -m fp8rl.cli bench fp8 --shapes 4096x4096x14336,4096x14336x4096 --mode train \
        --device cuda >"$dir/fp8-train-8b-layers-wgrad-triton.txt" 2>>"$dir/session.log"
    stamp "part 2: bench step 1b"
    $py -m fp8rl.cli bench step --model 1b --device cuda --prompts 64 --group-size 8 \
        --new-tokens 64 --steps 1 --no-baseline >"$dir/step-1b.txt" 2>>"$dir/session.log"
    stamp "part 2: bench step 1b, bf16 and fp8-gen, the reports' checksums in one launch (FP8RL_CHECKSUM=triton)"
    FP8RL_CHECKSUM=triton $py -m fp8rl.cli bench step --model 1b --device cuda --prompts 64 --group-size 8 \
        --new-tokens 64 --steps 1 --no-baseline --recipes bf16,fp8-gen >"$dir/step-1b-checksum.txt" 2>>"$dir/session.log"
    stamp "part 2: bench step 8b-4l (8B-shaped layers, 4 of them), 32 x 8 x 1024, fp8-e2e with each KV cache"
    FP8RL_DECODE_ATTENTION=triton FP8RL_KV_WRITE=triton $py -m fp8rl.cli bench step --model 8b-4l \
        --device cuda --prompts 32 --group-size 8 --new-tokens 1024 --steps 1 --no-baseline \
        --recipes bf16,fp8-e2e --kv-cache bf16,fp8 >"$dir/step-8b-4l.txt" 2>>"$dir/session.log"
fi
stamp "done"
