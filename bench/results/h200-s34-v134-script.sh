#!/usr/bin/env bash
# Prepared in session 33 for session 34 (needs no carried build): main built on the H200 by pip,
# then (1) the many-blocks decode test, whose Ev 8 and 128 cases have not run on a GPU;
# (2) what decode_partial's L2 traffic is made of, against PyTorch's flash decode kernel on the
# same shape (decode_s2k_d128, fp16): L2 requests and sectors by source, DRAM bytes, L1 requests,
# instructions (session 33: our partial kernel at 78 % DRAM with L2 at 84 %; flash at the floor).
# About 6 minutes. Writes one results file (the tool returns at most 8).
set -uo pipefail
export PYTHONUNBUFFERED=1
{
s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 330 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s"
export PYTHONPATH=/tmp/site
(cd tests/python && timeout 120 python3 -m pytest -q -p no:cacheprovider test_cuda.py -k many_key_blocks 2>&1 | grep -E "FAILED|passed|failed|rror" | head)
cat > /tmp/decode_pair.py <<'PY'
import sys, torch, torch.nn.functional as F
import sdpa_math
q = torch.randn(32, 32, 1, 128, device="cuda", dtype=torch.float16)
k, v = (torch.randn(32, 32, 2048, 128, device="cuda", dtype=torch.float16) for _ in range(2))
for _ in range(3):
    with torch.no_grad():
        sdpa_math.attention(q, k, v) if sys.argv[1] == "ours" else F.scaled_dot_product_attention(q, k, v)
torch.cuda.synchronize()
PY
M=lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,dram__bytes_read.sum,dram__bytes_write.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,sm__inst_executed.sum,gpu__time_duration.sum,lts__t_sectors_srcunit_ltcfabric.sum
for who in ours flash; do
  echo "== ncu $who"
  regex=decode_partial; [ $who = flash ] && regex='flash|fmha|sdpa'
  timeout 150 ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 2 --launch-count 1 --metrics $M \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables python3 /tmp/decode_pair.py $who 2>&1 \
    | grep -vE "^==PROF==|^ *$|^ +-+ +-+" | cut -c1-150 | head -120
done
} 2>&1 | tee $OUT/results.txt
