#!/usr/bin/env bash
# The GPU checks and benchmarks behind BENCHMARKS.md, in stages that each fit a few minutes:
#   tools/gpu_check.sh tests|quant|bf16|moe|decode|decode-q|decode-q-moe|pdl|gemv|sweeps|ncu|ncu-mm|ncu-columns|mm|columns|serve|serve-ab|peer|ttft|kv|mtp|spec-serve|verify|matvec|prefix|trace|served-profile|warmup|soak|soak-start|soak-finish|prime [OUT_DIR]
# tests: every GPU-marked test (the quantized greedy-token test first) and the Triton kernel tests on the device;
# quant: 9B Q4_K_M end to end and per projection; bf16: 9B and 2B; moe: 35B-A3B bf16 and Q4_K_M;
# decode (bf16: 35B-A3B, 2B, 9B), decode-q (9B Q4_K_M) and decode-q-moe (35B-A3B Q4_K_M): batch-1
# decode, each bench in a time cap of its own (a fresh machine compiles and times every mat-vec candidate
# for each weight type and type pair first: minutes); mat-vec choices go to OUT_DIR/tune.json unless
# HF2Q_TUNE_CACHE names a file; pdl: the 9B Q4_K_M and 35B-A3B bf16 batch-1 decode with programmatic dependent
# launch on, then off (HF2Q_PDL), on the same machine;
# gemv: the bf16 GEMV sweep against cuBLAS at 9B and 2B shapes; sweeps: the configurations of the decode
# step's other kernels at batch 1 (paged attention, the DeltaNet step, the MoE expert kernels); ncu: Nsight Compute's view (bandwidth,
# occupancy, stall reasons) of the int8 mat-vec on a small and a large 9B projection, at the default
# configuration; ncu-mm: the same view of the batched-decode tile kernel (attn.o and gate+up at 16 and 64 rows);
# ncu-columns: the same of the Q4_K column kernel;
# mm: the batched-decode kernels' tests on the device, the tile kernel against the int8
# tensor-core kernel (HF2Q_QUANT_MM=mmq) and dequantize + cuBLAS (tools/quant_mm_sweep.py; SWEEP_FLAGS adds
# flags, e.g. SWEEP_FLAGS=--gemlite for GemLite's kernels, carried as a wheel); columns: the Q4_K column kernel's tests
# on the device and its sweep against cuBLAS on the dense copies at 8-64 rows (tools/q4k_columns_sweep.py); serve: a random GGUF (SHAPE, 9b; MIX=q4_k_m or bf16,
# tools/random_gguf.py) served by hf2q serve and measured by hf2q bench serve at 1, 4, 16 and 64 clients (64-token
# prompts, 256 new tokens), then 16 clients with 2048-token prompts, then a second start (warm caches) and 1 client
# (HF2Q_QUANT_MM=mmq in the environment serves 5-64 rows on the int8 tensor-core kernel; SERVE_FLAGS adds
# flags, e.g. SERVE_FLAGS=--async-scheduling; MTP=1 serves a file with the MTP layer, for SERVE_FLAGS="--speculative
# mtp" against the same file without the flag); peer: llama-server on the same file under the same load (the serve
# stage's table's peer row); serve-ab: the serve stage's load at 1, 16 and 64 clients and 16 x 2048-token prompts
# with the default flags, then with FLAGS_B (default --no-short-prefill-graphs), same GGUF, same run, each server's
# threads sampled by py-spy (carried) throughout (OUT_DIR/spy_a.txt, spy_b.txt: py-spy's raw format); ttft: one
# served request's chunk timeline and the engine's step times and profile for a 64-token prompt
# (tools/ttft_trace.py); kv: the compressed K/V kernels' tests and
# model-level GPU tests, the paged decode configurations over fp8 and tq8 rows, and bench.kv's formats at the 9B
# shape; mtp: train the small Qwen3.5 with its MTP head for MINUTES (5) minutes into MTP_DIR (tools/train_mtp.py;
# carry the test tokenizer as .cache/qwen35_tokenizer.tgz; its DeltaNet delta rule is --gdn auto: fla's PyTorch chunked
# form where fla refuses its gated Triton backward (Hopper with Triton < 3.7.1), train.json's "gdn" says which ran),
# then its acceptance and speed-up on held-out code and prose at K (3) drafts (tools/spec_eval.py); spec-serve: that
# model served with speculation and without at 1 and 64 streams, then a random 9B with an MTP head (SPEC_9B=0 skips
# it); verify: the forced-acceptance verify-cost curves at batch 1 (9B
# Q4_K_M, then bf16), each in a time cap of its own, with the profile of a plain step and an L = 3 round; matvec: the int8 mat-vec at 1, 2 and 4 rows per 9B Q4_K_M
# projection, every candidate timed (the served default) and then the first candidates (HF2Q_GEMV_TUNE=0); prefix: three follow-up turns over an
# 8,000-token shared history, served with the prefix cache and without (PREFIX_OFF=0: with only); trace: where a served
# request waits, by the engine's step lines (HF2Q_STEP_TRACE=1) beside the client's times, on a SHAPE (9b) MIX (q4_k_m)
# file: a lone 64-token request's chunk timeline, three lone requests, three follow-ups over 8,000 tokens, bursts of 16
# and 64 prompts (OUT_DIR/trace.log holds every step line); served-profile: torch's profile of served steps at 1, 16
# and 64 clients (hf2q serve --profile-dir, POST /start_profile and /stop_profile); warmup: one start of hf2q serve under
# cProfile (the warm-up's top functions) on a random SHAPE (9b) model; soak: 64 streaming clients against a served
# 9B Q4_K_M for SOAK_S seconds, RSS and GPU memory sampled (tools/soak.py); soak-start and soak-finish: the same
# for SOAK_S (600) seconds over two chained calls; prime: a fresh machine's first start of the 9B (MIX, MTP as for
# serve) compiles and times for about 8 minutes, so it runs in a process session of its own that outlives the call
# (while the machine is held) and this stage returns after PRIME_S (540) s or at /health 200, stopping the server
# once ready; `prime` again in the next call waits for the same start. Figures also go to OUT_DIR/*.json.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?stage: tests|quant|bf16|moe|decode|decode-q|decode-q-moe|pdl|gemv|sweeps|ncu|ncu-columns|mm|columns|serve|serve-ab|peer|ttft|kv|mtp|spec-serve|verify|matvec|prefix|trace|served-profile|warmup|soak|soak-start|soak-finish|prime}
out=${2:-.}
mkdir -p "$out"
# healthy PID PORT LOG: wait until the server on PORT answers /health with 200; if PID ends first, LOG's tail, exit 1
healthy() {
  until curl -sf "http://127.0.0.1:$2/health" > /dev/null; do
    kill -0 "$1" 2> /dev/null || { tail -30 "$3"; exit 1; }; sleep 0.2; done; }
bench() { python -m hf2q.bench --hf-new 0 "$@"; }
# start LOG FLAGS...: hf2q serve on $model and $port (64 sequences) in the background ($pid), waited for until
# /health is 200; prints how long that took and the load and warm-up lines
start() {
  local t0; t0=$(date +%s%N)
  python -m hf2q.cli serve --model "$model" --port $port --max-num-seqs 64 --log-level info "${@:2}" > "$1" 2>&1 &
  pid=$!
  healthy $pid $port "$1"
  echo "start to /health 200: $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  grep -e "loaded" -e "warmed" "$1" | cut -c1-160; }
# load ARGS...: hf2q bench serve against the server started on $port
load() { python -m hf2q.cli bench serve --url "http://127.0.0.1:$port" --no-progress "$@"; }
# spec_counts: the speculation counters of the server on $port (totals and the acceptance-length sum)
spec_counts() { curl -s "http://127.0.0.1:$port/metrics" \
  | grep -e "^hf2q_spec_decode[a-z_]*_total" -e "^hf2q_spec_decode_acceptance_length_sum"; }
# one CAP_S ARGS...: a batch-1 decode bench ended by its own cap, so one slow start does not take the rest
one() { timeout "$1" python -m hf2q.bench --hf-new 0 --batch 1 --prefill 512 --new 48 "${@:2}" \
          2>&1 | grep -v -e Warning -e _warn_once; }
case "$stage" in
  tests) python -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_loader.py
         python -m pytest -q -p no:cacheprovider -m gpu --ignore=tests/e2e --ignore=tests/server \
           --ignore=tests/quant/test_loader.py tests
         python -m pytest -q -p no:cacheprovider tests/quant/test_kernels.py tests/kernels ;;
  quant) bench --shape 9b --quant q4_k_m --batch 1 16 --new 48 --json "$out/9b_q4_k_m.json"
         python -m hf2q.bench.quant ;;
  bf16)  bench --shape 9b --batch 1 64 --json "$out/9b.json"
         bench --shape 2b --batch 1 64 --json "$out/2b.json" ;;
  moe)   bench --shape 35b-a3b --quant q4_k_m --batch 1 16 --new 48 --json "$out/35b_q4_k_m.json"
         bench --shape 35b-a3b --batch 1 64 --json "$out/35b.json" ;;
  decode) export HF2Q_TUNE_CACHE=${HF2Q_TUNE_CACHE:-$out/tune.json}
         one 150 --shape 35b-a3b --json "$out/35b_b1.json"
         one 120 --shape 2b --json "$out/2b_b1.json"
         one 120 --shape 9b --json "$out/9b_b1.json" ;;
  decode-q) export HF2Q_TUNE_CACHE=${HF2Q_TUNE_CACHE:-$out/tune.json}
         one 500 --shape 9b --quant q4_k_m --json "$out/9b_q4_k_m_b1.json" ;;
  decode-q-moe) export HF2Q_TUNE_CACHE=${HF2Q_TUNE_CACHE:-$out/tune.json}
         one 500 --shape 35b-a3b --quant q4_k_m --json "$out/35b_q4_k_m_b1.json" ;;
  pdl)   export HF2Q_TUNE_CACHE=${HF2Q_TUNE_CACHE:-$out/tune.json}
         for s in 1 0; do
           HF2Q_PDL=$s one 200 --shape 9b --quant q4_k_m --json "$out/9b_q4_k_m_b1_pdl$s.json"
           HF2Q_PDL=$s one 150 --shape 35b-a3b --json "$out/35b_b1_pdl$s.json"
         done ;;
  gemv)  python -m hf2q.bench.gemv --shape 9b 2b ;;
  kv)    python -m pytest -q -p no:cacheprovider -s -m gpu tests/kernels/test_compressed_kv_kernels.py \
           tests/models/test_kv_formats.py
         python -m hf2q.bench.attention --shape 9b --context 4096 32768 --batch 1 64 --kv-format bfloat16 fp8 tq8
         python -m hf2q.bench.kv --shape 9b --formats bfloat16 fp8 tq8 --streams 1 64 --contexts 4096 32768 \
           --json "$out/kv.json" ;;
  mtp)   # issue 22's trained model (kept in $MTP_DIR, not $out: the device returns few files) and its acceptance;
         # spec-serve then serves it. Needs the test tokenizer carried (.cache/qwen35_tokenizer.tgz, gpu_setup.sh)
         dir=${MTP_DIR:-/tmp/hf2q-mtp}; mkdir -p "$dir"
         python tools/train_mtp.py --tokenizer "$HF2Q_TEST_CACHE/qwen35_tokenizer" --out "$dir" --size small --device cuda \
           --gdn auto --steps 100000 --minutes ${MINUTES:-5} --batch-size 8 --outtype bf16 --outtype q8_0 --log-every 200
         cp "$dir/train.json" "$out/" 2> /dev/null
         python tools/spec_eval.py --model "$dir/model-bf16.gguf" --prompts "$dir/heldout.json" --k ${K:-3} \
           --max-tokens 128 -- --max-num-seqs 4 > "$out/spec_bf16.json" ;;
  spec-serve) # issue 22 served: the mtp stage's trained model ($MTP_DIR, where it is) on its held-out prompts with
         # speculation (mtp+ngram) and off, at 1 stream (8 requests in turn) and 64; then a random-weight 9B Q4_K_M with
         # an MTP head, whose drafts are never accepted, with --speculative mtp and off at 1 stream (the cost
         # controller's job) and 64 (the batch rule's)
         port=8090; dir=${MTP_DIR:-/tmp/hf2q-mtp}
         if [ -f "$dir/heldout.json" ]; then
           python -c "import json, sys; kinds = json.load(open(sys.argv[1])).values(); \
             print('\n'.join(json.dumps({'messages': [{'role': 'user', 'content': p['text']}]}) for k in kinds for p in k))" \
             "$dir/heldout.json" > "$out/heldout.jsonl"
           model=$dir/model-bf16.gguf
           for spec in mtp+ngram off; do
             echo "## trained model, --speculative $spec"
             tag=${spec/+/_}  # the device returns no file whose name holds a +
             start "$out/serve_spec_$tag.log" --speculative $spec
             load --dataset "$out/heldout.jsonl" --max-tokens 128 --clients 1 --requests-per-client 8 \
               --json "$out/spec_serve_1_$tag.json"
             load --dataset "$out/heldout.jsonl" --max-tokens 128 --clients 64 --json "$out/spec_serve_64_$tag.json"
             spec_counts
             kill -INT $pid; wait $pid
           done
         fi
         [ "${SPEC_9B:-1}" = 0 ] && exit 0
         model=${MODEL_DIR:-/tmp}/hf2q-9b-q4_k_m-mtp.gguf
         [ -f "$model" ] || python tools/random_gguf.py --shape 9b --mix q4_k_m --mtp -o "$model" > /dev/null
         for spec in mtp off; do
           echo "## random-weight 9B Q4_K_M with MTP, --speculative $spec"
           start "$out/serve_spec9b_$spec.log" --speculative $spec
           load --clients 1 --requests-per-client 4 --prompt-tokens 64 --max-tokens 256 --json "$out/spec9b_1_$spec.json"
           load --clients 64 --prompt-tokens 64 --max-tokens 256 --json "$out/spec9b_64_$spec.json"
           spec_counts
           kill -INT $pid; wait $pid
         done ;;
  verify) for quant in "--quant q4_k_m" ""; do
           timeout 270 python -m hf2q.bench --hf-new 0 --shape 9b $quant --batch 1 --prefill 512 --new 48 \
             --spec-accept 0 1 2 3 --spec-k 3 --profile-spec --json "$out/verify_9b${quant:+_q4_k_m}.json" 2>&1 \
             | grep -v -e Warning -e _warn_once
         done ;;
  matvec) for tune in 1 0; do
           HF2Q_GEMV_TUNE=$tune python -m hf2q.bench.quant --no-prefill --rows 2 4
         done ;;
  prefix) port=8090
         for mix in ${MIXES:-q4_k_m bf16}; do
           model=${MODEL_DIR:-/tmp}/hf2q-9b-$mix.gguf
           [ -f "$model" ] || python tools/random_gguf.py --shape 9b --mix "$mix" -o "$model"
           caches=("" --no-prefix-cache); [ "${PREFIX_OFF:-1}" = 0 ] && caches=("")  # PREFIX_OFF=0: the cache's server only
           for cache in "${caches[@]}"; do  # with the prefix cache, then cold
             python -m hf2q.cli serve --model "$model" --port $port --max-model-len 16384 --max-num-seqs 16 $cache ${SERVE_FLAGS:-} \
               > "$out/serve_prefix_$mix$cache.log" 2>&1 &
             pid=$!
             healthy $pid $port "$out/serve_prefix_$mix$cache.log"
             echo "## $mix ${cache:-with the prefix cache}"
             # follow-up turns over an 8,000-token shared history (their TTFT: hit against cold), three a conversation:
             # one follow-up's TTFT spread by 6-12 ms from run to run on one server (H100, fortieth session)
             python -m hf2q.cli bench serve --url "http://127.0.0.1:$port" --no-progress --endpoint chat --multi-turn 4 \
               --shared-prefix-tokens 8000 --prompt-tokens 32 --max-tokens 16 --clients 1 \
               --json "$out/prefix_8k_$mix$cache.json"
             # the served load with multi-turn conversations: hit rate and throughput (PREFIX_LOAD=0 skips it)
             [ "${PREFIX_LOAD:-1}" = 0 ] || python -m hf2q.cli bench serve --url "http://127.0.0.1:$port" --no-progress --endpoint chat --multi-turn 4 \
               --prompt-tokens 256 --max-tokens 64 --clients 16 --json "$out/prefix_multiturn_$mix$cache.json"
             kill -INT $pid; wait $pid
           done
         done ;;
  sweeps) python -m hf2q.bench.attention --shape 35b-a3b 9b 2b --context 512 4096
         python -m hf2q.bench.gdn --shape 9b 35b-a3b --int8-for Q4_K
         python -m hf2q.bench.gemv --moe --shape 35b-a3b ;;
  ncu)   HF2Q_GEMV_TUNE=0 ncu --clock-control none --kernel-name regex:_gemv_dp4a --launch-count 2 --section SpeedOfLight \
           --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
           python -m hf2q.bench.quant --no-prefill --only gdn.out ffn.gate+up ;;
  ncu-mm) # Nsight Compute's view of the batched-decode tile kernel (stall reasons, bandwidth, occupancy): a 9B
         # Q4_K_M token's attn.o and gate+up at 16 and 64 rows, launched eagerly (each once to compile, then profiled)
         ncu --clock-control none --kernel-name regex:_quant_mm_kernel --launch-skip 4 --launch-count 4 \
           --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
           --section MemoryWorkloadAnalysis --section LaunchStats python -c "
import torch
from hf2q.kernels.quant.mm_triton import quant_mm
from hf2q.quant import keep_blocks, random_blocks
weights = [(keep_blocks(random_blocks('Q4_K', n, 4096, std=0.02, seed=n), 'Q4_K', 'cuda'), n) for n in (4096, 24576)]
for _ in range(2):
    for raw, n in weights:
        for m in (16, 64):
            quant_mm(torch.randn(m, 4096, device='cuda', dtype=torch.bfloat16), raw, 'Q4_K', n)
torch.cuda.synchronize()" | tee "$out/ncu_mm.txt" ;;
  mm)    python -m pytest -q -p no:cacheprovider tests/quant/test_kernels.py tests/quant/test_mmq.py \
           -k "quant_mm or quant_linear or mmq"
         timeout 400 python tools/quant_mm_sweep.py --rows 16 32 64 --configs 64,4 --split-factors 1 ${SWEEP_FLAGS:-} \
           | tee "$out/quant_mm_sweep.txt" ;;
  ncu-columns) # the same view of the Q4_K column kernel (kernels/quant/q4k_columns.py) on the same shapes and rows
         ncu --clock-control none --kernel-name regex:_q4k_columns_kernel --launch-skip 4 --launch-count 4 \
           --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
           --section MemoryWorkloadAnalysis --section LaunchStats python -c "
import torch
from hf2q.kernels.quant.q4k_columns import columns_mm, from_blocks
from hf2q.quant import random_blocks
weights = [from_blocks(random_blocks('Q4_K', n, 4096, std=0.02, seed=n).to('cuda'), n) for n in (4096, 24576)]
for _ in range(2):
    for cols in weights:
        for m in (16, 64):
            columns_mm(torch.randn(m, 4096, device='cuda', dtype=torch.bfloat16), cols)
torch.cuda.synchronize()" | tee "$out/ncu_columns.txt" ;;
  columns) python -m pytest -q -p no:cacheprovider tests/quant/test_kernels.py -k "q4k_columns or kept_columns"
         timeout 300 python tools/q4k_columns_sweep.py --rows 8 16 32 64 | tee "$out/q4k_columns_sweep.txt" ;;
  serve) mix=${MIX:-q4_k_m}; mtp=${MTP:+-mtp}; shape=${SHAPE:-9b}; model=${MODEL_DIR:-/tmp}/hf2q-$shape-$mix$mtp.gguf; port=8090
         [ -f "$model" ] || python tools/random_gguf.py --shape "$shape" --mix "$mix" ${MTP:+--mtp} -o "$model"
         start "$out/serve_$mix.log" ${SERVE_FLAGS:-}
         load --clients 1 4 16 64 --prompt-tokens 64 --max-tokens 256 --json "$out/serve_${mix}.json"
         load --clients 16 --prompt-tokens 2048 --max-tokens 64 --json "$out/serve_${mix}_16x2048.json"
         kill -INT $pid; wait $pid
         start "$out/serve2_$mix.log" ${SERVE_FLAGS:-}  # a second start: Triton's cache and the tune file are warm
         load --clients 1 --prompt-tokens 64 --max-tokens 256
         kill -INT $pid; wait $pid ;;
  serve-ab)
         model=${MODEL_DIR:-/tmp}/hf2q-9b-q4_k_m.gguf; port=8090
         [ -f "$model" ] || python tools/random_gguf.py --shape 9b --mix q4_k_m -o "$model"
         for tag in a b; do
           flags=""; [ $tag = b ] && flags=${FLAGS_B:---no-short-prefill-graphs}
           echo "## ${flags:-default flags}"
           start "$out/serve_$tag.log" $flags
           spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
           "$spy" record -p $pid --threads --nonblocking -r 100 -f raw -o "$out/spy_$tag.txt" > /dev/null 2>&1 &
           spy_pid=$!
           load --clients 1 16 64 --prompt-tokens 64 --max-tokens 256 --json "$out/ab_$tag.json"
           load --clients 16 --prompt-tokens 2048 --max-tokens 64 | tail -1
           kill -INT $spy_pid 2> /dev/null; wait $spy_pid
           kill -INT $pid; wait $pid
         done ;;
  ttft)  model=${MODEL_DIR:-/tmp}/hf2q-9b-q4_k_m.gguf; port=8090
         [ -f "$model" ] || python tools/random_gguf.py --shape 9b --mix q4_k_m -o "$model"
         python -m hf2q.cli serve --model "$model" --port $port --max-num-seqs 4 > "$out/serve_ttft.log" 2>&1 &
         pid=$!
         healthy $pid $port "$out/serve_ttft.log"
         python tools/ttft_trace.py --url "http://127.0.0.1:$port" --prompt-tokens 64 --max-tokens 64
         kill $pid; wait $pid
         python tools/ttft_trace.py --model "$model" --max-num-seqs 4 --profile ;;
  peer)  # llama-server on the serve stage's GGUF, measured by the same load generator (llama.cpp built by
         # tools/gpu_setup.sh with LLAMA_CPP=1, in the background since the call's start)
         mix=${MIX:-q4_k_m}; shape=${SHAPE:-9b}; model=${MODEL_DIR:-/tmp}/hf2q-$shape-$mix.gguf; port=8091
         [ -f "$model" ] || python tools/random_gguf.py --shape "$shape" --mix "$mix" -o "$model"
         until [ -f /tmp/llama.cpp/build.done ]; do sleep 5; done
         [ "$(cat /tmp/llama.cpp/build.done)" = 0 ] || { tail -30 /tmp/llama.cpp/build.log; exit 1; }
         /tmp/llama.cpp/build/bin/llama-server -m "$model" -ngl 99 -fa on -np 64 -c 65536 --port $port \
           > "$out/llama_server_$mix.log" 2>&1 &
         pid=$!
         healthy $pid $port "$out/llama_server_$mix.log"
         python -m hf2q.cli bench serve --url "http://127.0.0.1:$port" --no-progress --clients 1 16 64 \
           --prompt-tokens 64 --max-tokens 256 --json "$out/peer_$mix.json"
         kill $pid; wait $pid ;;
  trace) mix=${MIX:-q4_k_m}; shape=${SHAPE:-9b}; model=${MODEL_DIR:-/tmp}/hf2q-$shape-$mix.gguf; port=8090
         [ -f "$model" ] || python tools/random_gguf.py --shape "$shape" --mix "$mix" -o "$model"
         export HF2Q_STEP_TRACE=1; start "$out/trace.log" --max-model-len 16384
         # steps FROM N: the step lines logged after line FROM of the log, their first N
         steps() { sed -n "$(( $1 + 1 )),\$p" "$out/trace.log" | grep "step:" | cut -c12-24,50-220 | head -"$2"; }
         per() { python -c "import json, sys; [print(lv['clients'], [(r['turn'], r['cached_tokens'], r['ttft_ms']) \
           for r in lv['per_request']][:8]) for lv in json.load(open(sys.argv[1]))['levels']]" "$1"; }
         echo "## a lone request's chunks, then its steps"; m=$(wc -l < "$out/trace.log")
         python tools/ttft_trace.py --url "http://127.0.0.1:$port" --prompt-tokens 64 --max-tokens 4 2>&1 | grep -v HTTP
         steps $m 8
         echo "## three lone requests (TTFT ms), their prefill steps"; m=$(wc -l < "$out/trace.log")
         load --clients 1 --requests-per-client 3 --prompt-tokens 64 --max-tokens 32 --json "$out/trace_lone.json" > /dev/null
         per "$out/trace_lone.json"; steps $m 400 | grep -v "1 sequences, 1 tokens" | head -6
         echo "## three follow-ups over 8,000 tokens (turn, cached, TTFT ms), the steps that are not one-row decodes"
         m=$(wc -l < "$out/trace.log")
         load --endpoint chat --multi-turn 4 --shared-prefix-tokens 8000 --prompt-tokens 32 --max-tokens 16 --clients 1 \
           --json "$out/trace_follow_ups.json" > /dev/null
         per "$out/trace_follow_ups.json"; steps $m 400 | grep -v "1 sequences, 1 tokens" | head -30
         for n in 16 64; do
           echo "## a burst of $n 64-token prompts: its first steps"; m=$(wc -l < "$out/trace.log")
           load --clients $n --prompt-tokens 64 --max-tokens 16 --json "$out/trace_burst$n.json" > /dev/null
           per "$out/trace_burst$n.json" | cut -c1-200; steps $m 10
         done
         kill -INT $pid; wait $pid ;;
  served-profile) # one served step's time under load (issue 20's "where the time goes"): hf2q serve --profile-dir,
         # SHAPE (9b) MIX (q4_k_m), then for 1, 16 and 64 clients (64-token prompts, 256 new tokens) torch's profiler
         # over PROFILE_S (0.3) s of steady decode from 1 s into the load; each table's head is printed, the tables and
         # traces stay in OUT_DIR/profiles
         mix=${MIX:-q4_k_m}; shape=${SHAPE:-9b}; model=${MODEL_DIR:-/tmp}/hf2q-$shape-$mix.gguf; port=8090
         [ -f "$model" ] || python tools/random_gguf.py --shape "$shape" --mix "$mix" -o "$model"
         start "$out/serve_profile.log" --profile-dir "$out/profiles" ${SERVE_FLAGS:-}
         for n in 1 16 64; do
           load --clients $n --prompt-tokens 64 --max-tokens 256 --json "$out/profile_load_$n.json" > /dev/null &
           lpid=$!
           sleep 1
           curl -s -X POST "http://127.0.0.1:$port/start_profile" > /dev/null
           sleep "${PROFILE_S:-0.3}"
           echo "## $n clients: $(curl -s -X POST "http://127.0.0.1:$port/stop_profile")"
           wait $lpid
           head -32 "$(ls -t "$out"/profiles/*.txt | head -1)" | cut -c1-200
         done
         kill -INT $pid; wait $pid ;;
  warmup) # where a start's warm-up goes: hf2q serve under cProfile until /health says 200, then Ctrl-C; the
         # functions with the most cumulative and own time (main thread; compiles run in worker threads)
         shape=${SHAPE:-9b}; model=${MODEL_DIR:-/tmp}/hf2q-$shape-${MIX:-q4_k_m}.gguf; port=8090
         [ -f "$model" ] || python tools/random_gguf.py --shape $shape --mix "${MIX:-q4_k_m}" -o "$model" > /dev/null
         python -m cProfile -o "$out/warmup.prof" -m hf2q.cli serve --model "$model" --port $port \
           --max-num-seqs ${MAX_NUM_SEQS:-64} --log-level info ${SERVE_FLAGS:-} > "$out/serve_warmup.log" 2>&1 &
         pid=$!
         healthy $pid $port "$out/serve_warmup.log"
         kill -INT $pid; wait $pid
         grep -e "warm" -e "captured" -e "loaded" "$out/serve_warmup.log" | cut -c1-220
         python -c "import pstats, sys; p = pstats.Stats(sys.argv[1]); p.sort_stats('cumulative').print_stats(40); \
           p.sort_stats('tottime').print_stats(25)" "$out/warmup.prof" | cut -c1-200 ;;
  soak)  # issue 26: 64 streaming clients against a 9B Q4_K_M served on the GPU (SOAK_S seconds, 540 by default to fit
         # one device call with the first start); RSS and GPU memory sampled every 10 s
         model=${MODEL_DIR:-/tmp}/hf2q-9b-q4_k_m.gguf; port=8090
         [ -f "$model" ] || python tools/random_gguf.py --shape 9b --mix q4_k_m -o "$model"
         python -m hf2q.cli serve --model "$model" --port $port --max-num-seqs 64 > "$out/serve_soak.log" 2>&1 &
         pid=$!
         healthy $pid $port "$out/serve_soak.log"
         python tools/soak.py --url "http://127.0.0.1:$port" --pid $pid --clients 64 --duration "${SOAK_S:-540}" \
           --prompt-tokens 64 --max-tokens 256 --json "$out/soak.json"
         kill -INT $pid; wait $pid ;;
  soak-start) # issue 26's ten minutes, over two chained calls: the server and tools/soak.py start in process sessions
         # of their own (setsid), which the device machine lets outlive the command while it stays held (a next call
         # within its idle time); this call follows the soak's per-minute lines until FOLLOW_S, soak-finish the rest
         model=${MODEL_DIR:-/tmp}/hf2q-9b-q4_k_m.gguf; port=8090; keep=/tmp/hf2q-soak
         [ -f "$model" ] || python tools/random_gguf.py --shape 9b --mix q4_k_m -o "$model"
         rm -rf "$keep"; mkdir -p "$keep"
         setsid python -m hf2q.cli serve --model "$model" --port $port --max-num-seqs 64 > "$keep/serve.log" 2>&1 \
           < /dev/null &
         pid=$!; echo $pid > "$keep/serve.pid"
         healthy $pid $port "$keep/serve.log"
         grep -e "warmed up" -e "loaded" "$keep/serve.log" | cut -c1-220
         setsid python tools/soak.py --url "http://127.0.0.1:$port" --pid $pid --clients 64 \
           --duration "${SOAK_S:-600}" --prompt-tokens 64 --max-tokens 256 --json "$keep/soak.json" \
           > "$keep/soak.log" 2>&1 < /dev/null &
         echo "soak started for ${SOAK_S:-600} s; following it for ${FOLLOW_S:-400} s"
         timeout "${FOLLOW_S:-400}" tail -n +1 -f "$keep/soak.log"; true ;;
  soak-finish) # the end of soak-start's run: waits for its report (at most WAIT_S), then stops the server
         keep=/tmp/hf2q-soak
         [ -f "$keep/serve.pid" ] || { echo "no soak-start on this machine (it went back?)"; exit 1; }
         deadline=$(( $(date +%s) + ${WAIT_S:-480} ))
         until [ -f "$keep/soak.json" ] || [ "$(date +%s)" -ge $deadline ]; do sleep 5; done
         cat "$keep/soak.log"
         pid=$(cat "$keep/serve.pid"); kill -INT $pid 2> /dev/null
         for _ in $(seq 60); do kill -0 $pid 2> /dev/null || break; sleep 0.5; done
         tail -5 "$keep/serve.log"
         cp "$keep"/soak.json "$keep"/soak.log "$keep"/serve.log "$out"/ 2> /dev/null
         [ -f "$out/soak.json" ] ;;
  prime) mix=${MIX:-q4_k_m}; mtp=${MTP:+-mtp}; shape=${SHAPE:-9b}; model=${MODEL_DIR:-/tmp}/hf2q-$shape-$mix$mtp.gguf; port=8090
         keep=/tmp/hf2q-prime; mkdir -p "$keep"; t0=$(date +%s)
         [ -f "$model" ] || python tools/random_gguf.py --shape "$shape" --mix "$mix" ${MTP:+--mtp} -o "$model" > /dev/null
         pid=$(cat "$keep/pid" 2> /dev/null)
         if [ -z "$pid" ] || ! kill -0 "$pid" 2> /dev/null; then
           setsid python -m hf2q.cli serve --model "$model" --port $port --max-num-seqs 64 --log-level info \
             ${SERVE_FLAGS:-} > "$keep/serve.log" 2>&1 < /dev/null &
           pid=$!; echo $pid > "$keep/pid"
         fi
         until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
           kill -0 $pid 2> /dev/null || { tail -30 "$keep/serve.log"; rm -f "$keep/pid"; exit 1; }
           [ $(( $(date +%s) - t0 )) -ge "${PRIME_S:-540}" ] && { echo "still warming up: run prime again"; \
             grep -e loaded -e warm -e captured "$keep/serve.log" | cut -c1-200; exit 0; }
           sleep 1; done
         grep -e loaded -e warm -e captured "$keep/serve.log" | cut -c1-200
         kill -INT $pid; while kill -0 $pid 2> /dev/null; do sleep 0.2; done; rm -f "$keep/pid" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
