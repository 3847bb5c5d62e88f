// The tensor-core forward's kernel (forward_tc, mma.sync: fp16/bf16, sm_80 and newer) and its
// launch function, launch_forward<T, DT, BN>. Only the instantiation files
// (forward_sm80_<dtype>_d<head>.cu) instantiate launch_forward, and with it the kernel's two
// variants of each tile, so that a parallel build compiles them side by side; the host side
// (forward_sm80.cu) includes this header for the tile sizes and the shared-memory sizes
// (forward_smem_bytes) and declares the launch functions `extern template`.
//
// The design: per CTA 64 query rows of one head, 4 warps of 16 rows. Pass 1 over the key tiles
// keeps each row's running max and sum (fp32) and yields the log-sum-exp; pass 2 recomputes the
// scores, forms P = dropout(exp(s - lse)) in fp32, rounds and stores it once, and accumulates
// O += P V on the tensor cores (design.md, "two passes over K, one write of P"). Causal tiles
// above the diagonal are never computed: their P is zeros.
//
// The kernel lives in the named namespace sdpa_math::cuda::sm80 (it was in an anonymous one when
// the whole forward was one file), so that the instantiation files and the host side name the
// same functions; the kernel's name and template parameters are unchanged.
#pragma once

#include "../launch.cuh"
#include "../mma.cuh"
#include "../tensor_core.cuh"

namespace sdpa_math::cuda::sm80 {

constexpr int kThreads = 128;  // 4 warps
constexpr int kBM = 64;        // query rows per CTA

struct ForwardFlags {
  bool q_vec, k_vec, v_vec;  // 16-byte row loads
  bool p_pair;               // P stored two elements at a time (P's dtype is the inputs')
  bool p_vec8;               // P zero-filled 16 bytes at a time
};

// The warp's Q fragments for every 16-column chunk of the head: held in registers for the
// whole key sweep where they fit (head tile <= 128), else reloaded per chunk.
template <int DT>
constexpr bool kQInRegisters = DT <= 128;

// s[n][c] = q_row . k_col (raw dot products) for this warp's 16 rows and the tile's BN keys.
// Q and K are zero-padded to DT columns in shared memory, so every chunk is summed.
template <typename T, int DT, int BN, int LD>
SDPA_MATH_D void tile_scores(float (&s)[BN / 8][4], const uint32_t (&qf)[kQInRegisters<DT> ? DT / 16 : 1][4],
                             const T* sQ, const T* sK, int warp, int lane) {
#pragma unroll
  for (int n = 0; n < BN / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[n][c] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < DT / 16; ++kk) {
    uint32_t a[4];
    if constexpr (kQInRegisters<DT>) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = qf[kk][i];
    } else {
      load_a_frag<T>(a, sQ, LD, warp * 16, kk * 16, lane);
    }
#pragma unroll
    for (int n = 0; n < BN / 8; n += 2) {
      uint32_t b[4];
      load_b_pair_nk<T>(b, sK, LD, n * 8, kk * 16, lane);
      mma_16816<T>(s[n], a, b[0], b[1]);
      mma_16816<T>(s[n + 1], a, b[2], b[3]);
    }
  }
}

// GENERAL = false is the plain case (no mask, no dropout, P's rows unit-stride in the inputs'
// dtype): scores stay in base-2 units, each element costs a multiply-add and an ex2, and the
// causal and tail checks run only on the tiles that need them. GENERAL = true applies every rule
// of the contract per element through device_problem.cuh.
template <typename T, int DT, int BN, bool GENERAL>
__global__ void __launch_bounds__(kThreads) forward_tc(DevProblem p, ForwardFlags f, int64_t tiles) {
  constexpr int LD = DT + 8;  // padded rows: fragment loads of the 8 rows of a quad hit 8 banks
  constexpr float kNegInf = -INFINITY;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBM * LD;   // two buffers: the next tile loads while this one is used
  T* sV = sK + 2 * BN * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int64_t lead = blockIdx.x / tiles;
  const int64_t i0 = (tiles - 1 - blockIdx.x % tiles) * kBM;  // the longest causal tiles first
  const int64_t q_at = lead_off(p, p.q, lead), k_at = lead_off(p, p.k, lead), v_at = lead_off(p, p.v, lead);
  const int64_t m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  const int64_t p_at = lead_off(p, p.probs, lead);
  const int64_t row[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
  const int64_t warp_row0 = i0 + warp * 16;  // the warp's first row: causal-free tiles end before it
  const int64_t j_end = p.causal ? (i0 + kBM < p.S ? i0 + kBM : p.S) : p.S;
  const int n_tiles = static_cast<int>((j_end + BN - 1) / BN);
  const float scale = static_cast<float>(p.scale);
  const float scale2 = scale * kLog2e;  // plain case: scores in base-2 units
  T* P = reinterpret_cast<T*>(p.probs.data);
  T* p_row[2] = {P + p_at + row[0] * p.probs.row, P + p_at + row[1] * p.probs.row};

  // Plain case: whether a tile needs per-element checks (keys past S, causal-hidden keys).
  auto tile_is_clean = [&](int64_t j0) {
    return j0 + BN <= p.S && (!p.causal || j0 + BN - 1 <= warp_row0);
  };
  auto plain_logit = [&](float s, int64_t i, int64_t j, bool clean) {
    const float x = s * scale2;
    if (clean) return x;
    return (j >= p.S || (p.causal && j > i)) ? kNegInf : x;
  };

  auto load_k = [&](int nt) {
    load_tile_async<T, BN, DT, LD, kThreads>(sK + (nt & 1) * BN * LD, p.k, k_at, static_cast<int64_t>(nt) * BN, p.S,
                                             p.E, f.k_vec);
  };
  auto load_v = [&](int nt) {
    load_tile_async<T, BN, DT, LD, kThreads>(sV + (nt & 1) * BN * LD, p.v, v_at, static_cast<int64_t>(nt) * BN, p.S,
                                             p.Ev, f.v_vec);
  };

  load_tile_async<T, kBM, DT, LD, kThreads>(sQ, p.q, q_at, i0, p.L, p.E, f.q_vec);
  cp_async_commit();
  if (n_tiles > 0) load_k(0);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  uint32_t qf[kQInRegisters<DT> ? DT / 16 : 1][4];
  if constexpr (kQInRegisters<DT>) {
#pragma unroll
    for (int kk = 0; kk < DT / 16; ++kk) load_a_frag<T>(qf[kk], sQ, LD, warp * 16, kk * 16, lane);
  }

  // Pass 1: running max (common to the quad that shares a row) and per-thread partial sums.
  // GENERAL: natural units; plain: base-2 units. The max keeps NaN, so a NaN score makes the
  // row's max and sum NaN, and with them its P, O and lse (as the math op's softmax).
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  for (int nt = 0; nt < n_tiles; ++nt) {
    const int64_t j0 = static_cast<int64_t>(nt) * BN;
    if (nt + 1 < n_tiles) {
      load_k(nt + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    float s[BN / 8][4];
    tile_scores<T, DT, BN, LD>(s, qf, sQ, sK + (nt & 1) * BN * LD, warp, lane);
    const bool clean = tile_is_clean(j0);
    float tile_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = c >> 1;
        const int64_t j = j0 + n * 8 + 2 * t + (c & 1);
        float x;
        if constexpr (GENERAL) x = (j < p.S && row[r] < p.L) ? masked_logit<float>(p, s[n][c], m_at, row[r], j) : kNegInf;
        else x = plain_logit(s[n][c], row[r], j, clean);
        s[n][c] = x;
        tile_max[r] = max_nan(tile_max[r], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float new_max = max_nan(m[r], quad_max_nan(tile_max[r]));
      if (new_max == kNegInf) continue;
      float add = 0.0f;
      if constexpr (GENERAL) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) add += __expf(s[n][2 * r] - new_max) + __expf(s[n][2 * r + 1] - new_max);
        l[r] = (m[r] == kNegInf ? 0.0f : l[r] * __expf(m[r] - new_max)) + add;
      } else {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) add += fast_exp2(s[n][2 * r] - new_max) + fast_exp2(s[n][2 * r + 1] - new_max);
        l[r] = l[r] * fast_exp2(m[r] - new_max) + add;  // 2^-inf = 0 on the first tile
      }
      m[r] = new_max;
    }
    __syncthreads();  // the buffer is reloaded two tiles on
  }
  if (n_tiles > 0) {
    load_k(0);
    load_v(0);
  }
  cp_async_commit();
  // P = exp(s - m) / l (not exp(s - lse): see prob_from_max_sum). A fully masked row (l = 0)
  // gives P = 0 and lse = -inf; a NaN row (l = NaN) gives NaN through inv_l, lse too.
  __shared__ bool nan_row[kBM];  // for the causal zeros below, which other threads store
  float inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const RowEnd e = end_of_row<GENERAL>(l[r], m[r]);
    inv_l[r] = e.inv_l;
    const float lse = e.lse;
    if (t == 0) nan_row[warp * 16 + g + 8 * r] = e.nan;
    if (t == 0 && row[r] < p.L)
      store_elem<float>(p.lse.dtype, p.lse.data, lead_off(p, p.lse, lead) + row[r] * p.lse.row, lse);
  }

  // Pass 2: P once, O += P V.
  float o[DT / 8][4];
#pragma unroll
  for (int n = 0; n < DT / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[n][c] = 0.0f;
  for (int nt = 0; nt < n_tiles; ++nt) {
    const int64_t j0 = static_cast<int64_t>(nt) * BN;
    if (nt + 1 < n_tiles) {
      load_k(nt + 1);
      load_v(nt + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* kt = sK + (nt & 1) * BN * LD;
    const T* vt = sV + (nt & 1) * BN * LD;
    float s[BN / 8][4];
    tile_scores<T, DT, BN, LD>(s, qf, sQ, kt, warp, lane);
    const bool clean = tile_is_clean(j0);
    // This tile's weights: unnormalised ones u = exp(s - m) (times the dropout factor), rounded
    // once into packed[n][r] -- row r's pair (j, j + 1), j = j0 + 8n + 2t -- as the A fragment
    // of P V (O is divided by the row sum at the end, as flash attention does: u <= 1 keeps fp16
    // clear of subnormals where P = u / l would not be), and P = u / l, rounded and stored once.
    uint32_t packed[BN / 8][2];
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = row[r];
        const int64_t j = j0 + n * 8 + 2 * t;
        float u[2], pr[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if constexpr (GENERAL) {
            u[e] = 0.0f;
            if (j + e < p.S && i < p.L) {
              const float a = __expf(masked_logit<float>(p, s[n][2 * r + e], m_at, i, j + e) - m[r]);
              u[e] = returned_prob<float>(p, a, keep_of<float>(p, d_at, lead, i, j + e));
            }
          } else {
            u[e] = fast_exp2(plain_logit(s[n][2 * r + e], i, j + e, clean) - m[r]);
          }
          pr[e] = u[e] * inv_l[r];
        }
        packed[n][r] = pack2<T>(u[0], u[1]);
        const uint32_t p_pair = pack2<T>(pr[0], pr[1]);
        if (i < p.L) {
          if (f.p_pair && (clean || j + 1 < p.S)) {
            *reinterpret_cast<uint32_t*>(p_row[r] + j) = p_pair;
          } else if (j < p.S) {
            const int64_t at = p_at + i * p.probs.row + j * p.probs.col;
            store_elem<float>(p.probs.dtype, p.probs.data, at, pr[0]);
            if (j + 1 < p.S) store_elem<float>(p.probs.dtype, p.probs.data, at + p.probs.col, pr[1]);
          }
        }
      }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t a[4] = {packed[2 * kk][0], packed[2 * kk][1], packed[2 * kk + 1][0], packed[2 * kk + 1][1]};
#pragma unroll
      for (int n = 0; n < DT / 8; n += 2) {  // V is zero-padded to DT columns
        uint32_t b[4];
        load_b_pair_kn<T>(b, vt, LD, kk * 16, n * 8, lane);
        mma_16816<T>(o[n], a, b[0], b[1]);
        mma_16816<T>(o[n + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }

  // O = (u V) / l, with the explicit-mask dropout factor applied once.
  const float factor = output_factor<float>(p);
  const int64_t o_at = lead_off(p, p.out, lead);
#pragma unroll
  for (int n = 0; n < DT / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t i = row[c >> 1], col = n * 8 + 2 * t + (c & 1);
      if (i < p.L && col < p.Ev)
        store_elem<float>(p.out.dtype, p.out.data, o_at + i * p.out.row + col * p.out.col,
                          o[n][c] * inv_l[c >> 1] * factor);
    }

  // Causal: the keys right of the last computed tile are hidden from every row of the CTA. Their
  // P is zero, or NaN in a NaN row (the math op's softmax is NaN over the whole row).
  const int64_t z0 = static_cast<int64_t>(n_tiles) * BN;
  if (z0 < p.S) {  // the same for the whole CTA
    __syncthreads();  // nan_row complete
    const int64_t rows = (p.L - i0 < kBM ? p.L - i0 : kBM);
    if (f.p_vec8) {
      const uint32_t nan_pair = pack2<T>(NAN, NAN);
      const int64_t chunks = (p.S - z0) / 8;
      for (int64_t idx = threadIdx.x; idx < rows * chunks; idx += kThreads) {
        const int64_t r = idx / chunks, c = z0 + (idx % chunks) * 8;
        const uint32_t fill = nan_row[r] ? nan_pair : 0u;
        *reinterpret_cast<uint4*>(P + p_at + (i0 + r) * p.probs.row + c) = make_uint4(fill, fill, fill, fill);
      }
    } else {
      const int64_t cols = p.S - z0;
      for (int64_t idx = threadIdx.x; idx < rows * cols; idx += kThreads) {
        const int64_t r = idx / cols, c = z0 + idx % cols;
        store_elem<float>(p.probs.dtype, p.probs.data, p_at + (i0 + r) * p.probs.row + c * p.probs.col,
                          nan_row[r] ? NAN : 0.0f);
      }
    }
  }
}

// Dynamic shared memory of a CTA: the Q tile and two stages of K and V tiles.
template <typename T, int DT, int BN>
constexpr size_t forward_smem_bytes() { return sizeof(T) * (kBM + 4 * BN) * (DT + 8); }

template <typename T, int DT, int BN>
void launch_forward(const DevProblem& p, const ForwardFlags& f, bool general, cudaStream_t stream) {
  const int64_t tiles = (p.L + kBM - 1) / kBM;
  const int64_t blocks = tiles * p.num_lead;
  const size_t smem = forward_smem_bytes<T, DT, BN>();
  if (general) {
    set_smem_limit(reinterpret_cast<const void*>(&forward_tc<T, DT, BN, true>), smem);
    forward_tc<T, DT, BN, true><<<grid_x(blocks, "tensor-core forward"), kThreads, smem, stream>>>(p, f, tiles);
  } else {
    set_smem_limit(reinterpret_cast<const void*>(&forward_tc<T, DT, BN, false>), smem);
    forward_tc<T, DT, BN, false><<<grid_x(blocks, "tensor-core forward"), kThreads, smem, stream>>>(p, f, tiles);
  }
  check_launch("tensor-core forward");
}

// The launch function of one tile (DT, BN), compiling both kernel variants (GENERAL true and
// false). PREFIX is `template` (an explicit instantiation: the instantiation files) or
// `extern template` (a declaration that it is compiled elsewhere: the host side).
#define SDPA_MATH_SM80_FWD_TILE(PREFIX, T, DT, BN) \
  PREFIX void launch_forward<T, DT, BN>(const DevProblem&, const ForwardFlags&, bool, cudaStream_t);

}  // namespace sdpa_math::cuda::sm80
