"""Statistics of the probability map P without holding all of it (issue 16).

attention_stats(q, k, v, ..., col_sum=..., row_entropy=..., rows=..., head_mean=..., kl_to=...)
returns O and the statistics asked for; exact definitions, dtypes and the GQA and
visible-queries rules: docs/statistics.md. The modules, one job each:

  api             attention_stats: the arguments checked, P's shape found, the route chosen
  fused_operator  col_sum, row_entropy and rows with no gradient from one fused operator
                  (torch.ops.sdpa_math.forward_stats) that never writes P: the CPU kernel for
                  every input, on CUDA the decode kernels (up to 4 query rows) and the Hopper
                  kernel where they take the inputs
  rows_alone      `rows` alone on CUDA fp16/bf16 (no mask, no gradient, a window of at most a
                  quarter of the rows): O from PyTorch's fused kernel, only the window's rows formed
  chunks          everything else: sdpa_math.attention on chunks of query rows, each chunk's P
                  reduced and dropped (checkpointed under autograd, so backward recomputes it)
  kl_rows         the KL of a chunk's rows, one function per route (from P, from fp32 logits,
                  from the operator on fp32 copies on the CPU, differentiable)
  kl_chunk        kl_to alone with a gradient off the fused route: an autograd function per chunk
                  that keeps O and lse, never P, and forms the KL's gradient to the logits
  kl_cuda         kl_to alone on CUDA's Hopper kernels, whole, P never formed
  pytorch_fused   O and lse from PyTorch's own fused SDPA kernels, for kl_cuda and rows_alone
  logits          fp32 logits, log P and P from them, and the gradient's products with K and Q
  rows            the chunk size and a chunk's rows of a mask (the top-left causal rule included)
"""
from .api import COL_SUM_MODES, attention_stats
from .rows import CHUNK_BYTES, default_chunk_rows

__all__ = ["attention_stats", "default_chunk_rows", "COL_SUM_MODES", "CHUNK_BYTES"]
