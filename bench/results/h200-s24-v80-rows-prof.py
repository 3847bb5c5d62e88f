import math, torch
from torch.profiler import ProfilerActivity, profile
from sdpa_math.bench import ANCHORS, make_inputs
from sdpa_math.stats import attention_stats
s = next(x for x in ANCHORS if x.name == "long4k_d128_causal")
q, k, v, _ = make_inputs(s, torch.float16, "cuda")
f = lambda: attention_stats(q, k, v, is_causal=True, scale=1 / math.sqrt(s.D), rows=slice(-64, None))
for _ in range(3): f()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10): f()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
