// The generic CUDA path: one thread block per query row (forward, dQ) or per key row (dK, dV),
// plain fp32/fp64 arithmetic, any head size, any dtype. It is the path for fp32 inputs (which
// must keep fp32 accuracy, so no TF32 tensor cores) and float64 (gradcheck), and for shapes the
// tensor-core kernels do not take. It re-reads K and V from L2 for every row: correct, not fast.
#include "generic.cuh"

namespace sdpa_math::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 512;  // keys (or query rows) whose weights are staged in shared memory

// Elements of a shared-memory region, rounded up so that every region starts on a 128-byte
// boundary. compute-sanitizer's racecheck reported hazards between a read of q (or dO) and a
// write of the next region when E or Ev is 1, though no element is shared: it tracks shared
// memory in blocks wider than one element, and neighbouring regions must not share one.
template <typename Acc>
SDPA_MATH_HD int64_t region(int64_t n) {
  constexpr int64_t k = 128 / sizeof(Acc);
  return (n + k - 1) / k * k;
}

template <typename Acc>
__device__ Acc dot_rows(const DevOperand& a, int64_t a_at, const Acc* b, int64_t n) {
  Acc s = 0;
  for (int64_t e = 0; e < n; ++e) s += load_elem<Acc>(a.dtype, a.data, a_at + e * a.col) * b[e];
  return s;
}

template <typename Acc>
__device__ Acc dot_two(const DevOperand& a, int64_t a_at, const DevOperand& b, int64_t b_at, int64_t n) {
  Acc s = 0;
  for (int64_t e = 0; e < n; ++e)
    s += load_elem<Acc>(a.dtype, a.data, a_at + e * a.col) * load_elem<Acc>(b.dtype, b.data, b_at + e * b.col);
  return s;
}

// Block-wide sum (all threads get the result). `red` holds kThreads values.
template <typename Acc>
__device__ Acc block_sum(Acc v, Acc* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  Acc r = red[0];
  __syncthreads();
  return r;
}

template <typename Acc>
__global__ void __launch_bounds__(kThreads) forward_rows(DevProblem p) {
  extern __shared__ unsigned char smem_raw[];
  Acc* q = reinterpret_cast<Acc*>(smem_raw);  // E
  Acc* w = q + region<Acc>(p.E);              // kChunk
  Acc* red = w + kChunk;                       // 2 * kThreads
  Acc* o = red + 2 * kThreads;                 // Ev
  const int64_t lead = blockIdx.x / p.L, i = blockIdx.x % p.L;
  const int64_t q_at = lead_off(p, p.q, lead) + i * p.q.row;
  const int64_t k_at = lead_off(p, p.k, lead), v_at = lead_off(p, p.v, lead);
  const int64_t m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  for (int64_t e = threadIdx.x; e < p.E; e += kThreads) q[e] = load_elem<Acc>(p.q.dtype, p.q.data, q_at + e * p.q.col);
  for (int64_t e = threadIdx.x; e < p.Ev; e += kThreads) o[e] = 0;
  __syncthreads();
  const int64_t visible = p.causal ? (i + 1 < p.S ? i + 1 : p.S) : p.S;

  // Pass 1: the row's max and sum.
  Acc m = neg_inf<Acc>(), l = 0;
  for (int64_t j = threadIdx.x; j < visible; j += kThreads) {
    const Acc s = masked_logit<Acc>(p, dot_rows<Acc>(p.k, k_at + j * p.k.row, q, p.E), m_at, i, j);
    lse_combine<Acc>(m, l, s, Acc(1));
  }
  red[threadIdx.x] = m;
  red[kThreads + threadIdx.x] = l;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) lse_combine<Acc>(red[threadIdx.x], red[kThreads + threadIdx.x], red[threadIdx.x + s], red[kThreads + threadIdx.x + s]);
    __syncthreads();
  }
  // P = exp(s - m) / l, not exp(s - lse): where every logit is huge and negative (finfo.min
  // masks) m + log(l) rounds to m and would lose the 1/l.
  const Acc row_max = red[0], row_sum = red[kThreads];
  if (threadIdx.x == 0)
    store_elem<Acc>(p.lse.dtype, p.lse.data, lead_off(p, p.lse, lead) + i * p.lse.row, lse_from_max_sum<Acc>(row_max, row_sum));

  // Pass 2: P written once; O accumulated from staged weights.
  const int64_t p_at = lead_off(p, p.probs, lead) + i * p.probs.row;
  for (int64_t c0 = 0; c0 < p.S; c0 += kChunk) {
    const int64_t n = p.S - c0 < kChunk ? p.S - c0 : kChunk;
    for (int64_t jj = threadIdx.x; jj < n; jj += kThreads) {
      const int64_t j = c0 + jj;
      Acc pr = prob_of_hidden_key<Acc>(row_sum);
      if (j < visible) {
        const Acc s = masked_logit<Acc>(p, dot_rows<Acc>(p.k, k_at + j * p.k.row, q, p.E), m_at, i, j);
        pr = returned_prob<Acc>(p, prob_from_max_sum<Acc>(s, row_max, row_sum), keep_of<Acc>(p, d_at, lead, i, j));
      }
      w[jj] = pr;
      store_elem<Acc>(p.probs.dtype, p.probs.data, p_at + j * p.probs.col, pr);
    }
    __syncthreads();
    const int64_t n_vis = visible - c0 < n ? (visible - c0 > 0 ? visible - c0 : 0) : n;
    for (int64_t e = threadIdx.x; e < p.Ev; e += kThreads) {
      Acc acc = 0;
      for (int64_t jj = 0; jj < n_vis; ++jj)
        acc += w[jj] * load_elem<Acc>(p.v.dtype, p.v.data, v_at + (c0 + jj) * p.v.row + e * p.v.col);
      o[e] += acc;
    }
    __syncthreads();
  }
  const Acc f = output_factor<Acc>(p);
  const int64_t o_at = lead_off(p, p.out, lead) + i * p.out.row;
  for (int64_t e = threadIdx.x; e < p.Ev; e += kThreads) store_elem<Acc>(p.out.dtype, p.out.data, o_at + e * p.out.col, o[e] * f);
}

// The per-element quantities of the backward at (lead, i, j), from the raw dot products.
template <typename Acc>
struct BackElem {
  Acc a;   // softmax A
  Acc da;  // dA (contract §11)
  Acc w;   // the weight W that multiplied V
};

// Without dropout A is the forward's P: read it where the caller kept it (pr_at: row i's start),
// which is exact also where exp(s - lse) is not (rows near finfo.min); else recompute it.
__device__ bool a_from_probs(const DevProblem& p) {
  return p.probs.data != nullptr && p.dropout == Dropout::None;
}

template <typename Acc>
__device__ BackElem<Acc> back_elem(const DevProblem& p, int64_t lead, int64_t i, int64_t j, Acc qk, Acc dov, Acc lse,
                                   int64_t m_at, int64_t d_at, int64_t gp_at, int64_t pr_at) {
  BackElem<Acc> r;
  r.a = a_from_probs(p) ? load_elem<Acc>(p.probs.dtype, p.probs.data, pr_at + j * p.probs.col)
                             : prob_from_lse<Acc>(masked_logit<Acc>(p, qk, m_at, i, j), lse);
  const Acc keep = keep_of<Acc>(p, d_at, lead, i, j);
  const Acc dp = p.grad_probs.data ? load_elem<Acc>(p.grad_probs.dtype, p.grad_probs.data, gp_at + j * p.grad_probs.col) : Acc(0);
  r.da = grad_softmax<Acc>(p, dov, dp, keep);
  r.w = value_weight<Acc>(p, r.a, keep);
  return r;
}

// Per query row: delta = rowsum(A . dA), dS, dQ (dense accumulation) and the mask gradient.
template <typename Acc>
__global__ void __launch_bounds__(kThreads) backward_rows(DevProblem p, BackwardBuffers<Acc> g) {
  extern __shared__ unsigned char smem_raw[];
  Acc* q = reinterpret_cast<Acc*>(smem_raw);  // E
  Acc* dout = q + region<Acc>(p.E);           // Ev
  Acc* ds = dout + region<Acc>(p.Ev);          // kChunk
  Acc* red = ds + kChunk;                      // kThreads
  const int64_t lead = blockIdx.x / p.L, i = blockIdx.x % p.L;
  const int64_t q_at = lead_off(p, p.q, lead) + i * p.q.row;
  const int64_t k_at = lead_off(p, p.k, lead), v_at = lead_off(p, p.v, lead);
  const int64_t m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  const int64_t gp_at = p.grad_probs.data ? lead_off(p, p.grad_probs, lead) + i * p.grad_probs.row : 0;
  const int64_t go_at = p.grad_out.data ? lead_off(p, p.grad_out, lead) + i * p.grad_out.row : 0;
  const int64_t pr_at = p.probs.data ? lead_off(p, p.probs, lead) + i * p.probs.row : 0;
  for (int64_t e = threadIdx.x; e < p.E; e += kThreads) q[e] = load_elem<Acc>(p.q.dtype, p.q.data, q_at + e * p.q.col);
  for (int64_t e = threadIdx.x; e < p.Ev; e += kThreads)
    dout[e] = p.grad_out.data ? load_elem<Acc>(p.grad_out.dtype, p.grad_out.data, go_at + e * p.grad_out.col) : Acc(0);
  __syncthreads();
  const Acc lse = load_elem<Acc>(p.lse.dtype, p.lse.data, lead_off(p, p.lse, lead) + i * p.lse.row);
  const int64_t visible = p.causal ? (i + 1 < p.S ? i + 1 : p.S) : p.S;
  const bool has_go = p.grad_out.data != nullptr;

  Acc part = 0;
  for (int64_t j = threadIdx.x; j < visible; j += kThreads) {
    const Acc qk = dot_rows<Acc>(p.k, k_at + j * p.k.row, q, p.E);
    const Acc dov = has_go ? dot_rows<Acc>(p.v, v_at + j * p.v.row, dout, p.Ev) : Acc(0);
    const BackElem<Acc> b = back_elem<Acc>(p, lead, i, j, qk, dov, lse, m_at, d_at, gp_at, pr_at);
    part += b.a * b.da;
  }
  const Acc delta = block_sum<Acc>(part, red);
  if (threadIdx.x == 0) g.delta[blockIdx.x] = delta;
  if (!g.dq && !g.dmask) return;

  const int64_t gm_at = g.dmask ? dense_lead_off(p, p.mask, lead) + i * p.mask.dense_row : 0;
  const int64_t dq_at = g.dq ? dense_lead_off(p, p.q, lead) + i * p.q.dense_row : 0;
  for (int64_t c0 = 0; c0 < visible; c0 += kChunk) {
    const int64_t n = visible - c0 < kChunk ? visible - c0 : kChunk;
    for (int64_t jj = threadIdx.x; jj < n; jj += kThreads) {
      const int64_t j = c0 + jj;
      const Acc qk = dot_rows<Acc>(p.k, k_at + j * p.k.row, q, p.E);
      const Acc dov = has_go ? dot_rows<Acc>(p.v, v_at + j * p.v.row, dout, p.Ev) : Acc(0);
      const BackElem<Acc> b = back_elem<Acc>(p, lead, i, j, qk, dov, lse, m_at, d_at, gp_at, pr_at);
      const Acc dsv = b.a * (b.da - delta);
      ds[jj] = dsv;
      if (g.dmask && dsv != Acc(0)) atomicAdd(g.dmask + gm_at + j * p.mask.dense_col, dsv);
    }
    __syncthreads();
    if (g.dq) {
      for (int64_t e = threadIdx.x; e < p.E; e += kThreads) {
        Acc acc = 0;
        for (int64_t jj = 0; jj < n; ++jj)
          acc += ds[jj] * load_elem<Acc>(p.k.dtype, p.k.data, k_at + (c0 + jj) * p.k.row + e * p.k.col);
        atomicAdd(g.dq + dq_at + e * p.q.dense_col, acc * static_cast<Acc>(p.scale));
      }
    }
    __syncthreads();
  }
}

// Per key row j of one lead index: dK_j = scale sum_i dS_ij q_i, dV_j = sum_i W_ij dO_i.
template <typename Acc>
__global__ void __launch_bounds__(kThreads) backward_cols(DevProblem p, BackwardBuffers<Acc> g) {
  extern __shared__ unsigned char smem_raw[];
  Acc* ds = reinterpret_cast<Acc*>(smem_raw);  // kChunk
  Acc* w = ds + kChunk;                        // kChunk
  const int64_t lead = blockIdx.x / p.S, j = blockIdx.x % p.S;
  const int64_t q_at = lead_off(p, p.q, lead), k_at = lead_off(p, p.k, lead) + j * p.k.row;
  const int64_t v_at = lead_off(p, p.v, lead) + j * p.v.row;
  const int64_t m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  const int64_t gp_lead = p.grad_probs.data ? lead_off(p, p.grad_probs, lead) : 0;
  const int64_t go_at = p.grad_out.data ? lead_off(p, p.grad_out, lead) : 0;
  const int64_t lse_at = lead_off(p, p.lse, lead);
  const int64_t pr_lead = p.probs.data ? lead_off(p, p.probs, lead) : 0;
  const bool has_go = p.grad_out.data != nullptr;
  const int64_t first = p.causal ? j : 0;  // causal: row i sees key j iff j <= i
  const int64_t dk_at = g.dk ? dense_lead_off(p, p.k, lead) + j * p.k.dense_row : 0;
  const int64_t dv_at = g.dv ? dense_lead_off(p, p.v, lead) + j * p.v.dense_row : 0;
  for (int64_t c0 = first; c0 < p.L; c0 += kChunk) {
    const int64_t n = p.L - c0 < kChunk ? p.L - c0 : kChunk;
    for (int64_t ii = threadIdx.x; ii < n; ii += kThreads) {
      const int64_t i = c0 + ii;
      const Acc qk = dot_two<Acc>(p.q, q_at + i * p.q.row, p.k, k_at, p.E);
      const Acc dov = has_go ? dot_two<Acc>(p.grad_out, go_at + i * p.grad_out.row, p.v, v_at, p.Ev) : Acc(0);
      const Acc lse = load_elem<Acc>(p.lse.dtype, p.lse.data, lse_at + i * p.lse.row);
      const BackElem<Acc> b = back_elem<Acc>(p, lead, i, j, qk, dov, lse, m_at, d_at, gp_lead + i * p.grad_probs.row,
                                                 pr_lead + i * p.probs.row);
      ds[ii] = b.a * (b.da - g.delta[lead * p.L + i]) * static_cast<Acc>(p.scale);
      w[ii] = b.w;
    }
    __syncthreads();
    if (g.dk) {
      for (int64_t e = threadIdx.x; e < p.E; e += kThreads) {
        Acc acc = 0;
        for (int64_t ii = 0; ii < n; ++ii) acc += ds[ii] * load_elem<Acc>(p.q.dtype, p.q.data, q_at + (c0 + ii) * p.q.row + e * p.q.col);
        atomicAdd(g.dk + dk_at + e * p.k.dense_col, acc);
      }
    }
    if (g.dv && has_go) {
      for (int64_t e = threadIdx.x; e < p.Ev; e += kThreads) {
        Acc acc = 0;
        for (int64_t ii = 0; ii < n; ++ii)
          acc += w[ii] * load_elem<Acc>(p.grad_out.dtype, p.grad_out.data, go_at + (c0 + ii) * p.grad_out.row + e * p.grad_out.col);
        atomicAdd(g.dv + dv_at + e * p.v.dense_col, acc);
      }
    }
    __syncthreads();
  }
}


}  // namespace

template <typename Acc>
void generic_forward(const DevProblem& p, cudaStream_t stream) {
  const int64_t blocks = p.num_lead * p.L;
  if (blocks == 0) return;
  const size_t smem = sizeof(Acc) * (region<Acc>(p.E) + kChunk + 2 * kThreads + p.Ev);
  set_smem_limit(reinterpret_cast<const void*>(&forward_rows<Acc>), smem);
  forward_rows<Acc><<<grid_x(blocks, "generic forward"), kThreads, smem, stream>>>(p);
  check_launch("generic forward");
}

template <typename Acc>
void generic_backward(const DevProblem& p, const BackwardBuffers<Acc>& g, cudaStream_t stream) {
  const int64_t row_blocks = p.num_lead * p.L;
  if (row_blocks == 0) return;
  const size_t smem_rows = sizeof(Acc) * (region<Acc>(p.E) + region<Acc>(p.Ev) + kChunk + kThreads);
  // Both grids first: the rows kernel writes dQ, so an oversized column grid is refused before it.
  const unsigned rows_grid = grid_x(row_blocks, "generic backward rows");
  const int64_t col_blocks = p.num_lead * p.S;
  const bool cols = (g.dk || g.dv) && col_blocks > 0;
  const unsigned cols_grid = grid_x(cols ? col_blocks : 0, "generic backward columns");
  set_smem_limit(reinterpret_cast<const void*>(&backward_rows<Acc>), smem_rows);
  backward_rows<Acc><<<rows_grid, kThreads, smem_rows, stream>>>(p, g);
  check_launch("generic backward (rows)");
  if (cols) {
    const size_t smem_cols = sizeof(Acc) * 2 * kChunk;
    backward_cols<Acc><<<cols_grid, kThreads, smem_cols, stream>>>(p, g);
    check_launch("generic backward (columns)");
  }
}

template <typename Acc>
void generic_delta(const DevProblem& p, Acc* delta, cudaStream_t stream) {
  BackwardBuffers<Acc> only_delta;
  only_delta.delta = delta;
  const int64_t row_blocks = p.num_lead * p.L;
  if (row_blocks == 0) return;
  const size_t smem_rows = sizeof(Acc) * (region<Acc>(p.E) + region<Acc>(p.Ev) + kChunk + kThreads);
  set_smem_limit(reinterpret_cast<const void*>(&backward_rows<Acc>), smem_rows);
  backward_rows<Acc><<<grid_x(row_blocks, "generic delta"), kThreads, smem_rows, stream>>>(p, only_delta);
  check_launch("generic backward (delta)");
}

template void generic_delta<float>(const DevProblem&, float*, cudaStream_t);
template void generic_forward<float>(const DevProblem&, cudaStream_t);
template void generic_forward<double>(const DevProblem&, cudaStream_t);
template void generic_backward<float>(const DevProblem&, const BackwardBuffers<float>&, cudaStream_t);
template void generic_backward<double>(const DevProblem&, const BackwardBuffers<double>&, cudaStream_t);

}  // namespace sdpa_math::cuda
