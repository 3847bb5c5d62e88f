// The decode forward's first step and its host side (common.cuh describes the decode kernels):
//   decode_partial: per (head, block of kSplitKeys keys), each key's logit s (kept in the fp32
//     workspace, since P needs the row's max and sum over all blocks), and the block's max m_b,
//     sum of exp(s - m_b) and unnormalized share of O, sum_j exp(s_j - m_b) M_j V_j (M: the
//     returned P's dropout factor), with K and V rows loaded together;
//   decode_partial_tc: the same on tensor cores for fp16/bf16 with E = Ev = 64 or 128 and no
//     mask, causal or dropout: mma.sync for K Q^T and V^T P^T, fed from registers without shared
//     memory or ldmatrix (see the kernel), in blocks of kSplitKeysTc keys.
// The second step (finalize.cu) and the statistics (stats.cu) read the workspace this one
// writes. The workspace is L*S4 + L*blocks*(Ev + 2) floats per head, plus the statistics' entropy
// sums (S4: S rounded up to 4, so that rows of logits start 16-byte aligned); heads are taken in
// chunks so that it stays within kWorkspaceFloats (one head's worth at least).
#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "common.cuh"

namespace sdpa_math::cuda {
namespace {

constexpr int64_t kWorkspaceFloats = (64 << 20) / 4;  // 64 MiB

// weight_to in base 2 (decode_partial_tc's logits are scaled by log2 e).
SDPA_MATH_D float weight2_to(float x, float m) { return x == neg_inf<float>() ? 0.0f : fast_exp2(x - m); }

// Whether decode_partial_tc takes the forward's first step: fp16/bf16, E = Ev = 64 or 128,
// PLAIN. SDPA_MATH_DECODE_TC=0 keeps decode_partial everywhere, for A/B measurements of the two.
// The key block size follows the kernel.
bool tensor_core_partial(const DevProblem& p) {
  static const bool enabled = [] {
    const char* env = std::getenv("SDPA_MATH_DECODE_TC");
    return !(env && std::string(env) == "0");
  }();
  return enabled && (p.q.dtype == DType::Float16 || p.q.dtype == DType::BFloat16) && p.E == p.Ev &&
         (p.E == 64 || p.E == 128) && plain(p);
}

// The masked logits of key rows whose K chunks this lane holds (U warp steps from j0): key
// j0 + u * KPW + (lane / LPK). Every lane of a group gets its key's logit; rows past L and keys
// past j_end give -inf.
template <typename T, int DT, int U, int R, bool PLAIN>
SDPA_MATH_D void key_logits(const DevProblem& p, const float* q, const RowInfo (&rows)[R], int count,
                            const uint4 (&raw)[U][Layout<T, DT>::CH], int64_t j0, int64_t j_end, int lane,
                            float (&s)[U][R]) {
  using Lay = Layout<T, DT>;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < R; ++r) s[u][r] = neg_inf<float>();
  // Rows past count are skipped (the same for the whole CTA): decode's one row costs one pass.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= count) break;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float acc = 0.0f;
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c) {
        float x[Lay::EPL];
        unpack16<T>(raw[u][c], x);
        const float* qr = q + r * DT + (sub + c * Lay::LPK) * Lay::EPL;
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i) acc += qr[i] * x[i];
      }
#pragma unroll
      for (int o = Lay::LPK / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      const int64_t j = j0 + u * Lay::KPW + kofs;
      if (j < j_end) s[u][r] = logit_at<PLAIN>(p, acc, rows[r], j);
    }
  }
}

// One pass over a block's K and V rows. Each group of LPK lanes keeps, per row, a running max m,
// sum l of exp(s - m) and its chunks of sum exp(s - m) M V (M: returned_prob's dropout factor; O's
// own factor comes at the end), rescaled when m grows; the groups, then the warps are merged at
// the end.
// CTAs per SM: five for one row; four for up to four rows (L > 1, or a GQA group's heads)
// without the mask, causal and dropout branches, at 128 registers and no spill (their time is
// their instruction stream and its latencies, so the fourth CTA hides them measurably better
// than three: bench/NOTES.md; GQA decode at head 64 and 128 now runs decode_partial_tc, these
// kernels keep fp32, head 256, Ev != E and PLAIN with SDPA_MATH_DECODE_TC=0); three for the
// four-row kernels with those branches, which spill at 128.
template <typename T, int DT, int R, bool PLAIN>
__global__ void __launch_bounds__(kThreads, R == 1 ? 5 : (PLAIN ? 4 : 3)) decode_partial(DevProblem p, DecodeWorkspace w) {
  using Lay = Layout<T, DT>;
  constexpr int U = Lay::CH == 1 ? kUnroll / 2 : kUnroll / 4;  // per buffer; register budget at head 256
  extern __shared__ float smem[];
  __shared__ RowInfo rows[R];
  const int count = static_cast<int>(w.heads * p.L);  // rows of this CTA, <= R
  float* q = smem;                       // count x DT
  float* sc = q + count * DT;            // count x kSplitKeys: the block's logits
  float* wstat = sc + count * kSplitKeys;  // warps x R x 2: each warp's (m, l)
  float* wacc = wstat + kWarps * R * 2;  // warps x R x DT: each warp's share of O
  const int64_t blk = blockIdx.x % w.blocks, first_lead = w.lead0 + blockIdx.x / w.blocks * w.heads;
  const int64_t row0 = (first_lead - w.lead0) * p.L;  // the CTA's first row in the workspace
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % Lay::LPK, kofs = lane / Lay::LPK;
  describe_rows<R>(p, first_lead, count, rows);
  load_query_rows<DT>(p, p.q, p.E, first_lead, count, q);
  __syncthreads();
  const int64_t k_at = lead_off(p, p.k, first_lead), v_at = lead_off(p, p.v, first_lead);
  const int64_t first = blk * kSplitKeys, j_end = min(p.S, first + kSplitKeys), n = j_end - first;
  constexpr int kStep = U * Lay::KPW;  // keys per warp step
  float m[R], l[R], acc[R][Lay::CH][Lay::EPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf<float>();
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
      for (int i = 0; i < Lay::EPL; ++i) acc[r][c][i] = 0.0f;
  }
  // One warp step: the logits of its keys and the online update of m, l and the share of O.
  auto consume = [&](int64_t j0, const uint4 (&kraw)[U][Lay::CH], const uint4 (&vraw)[U][Lay::CH]) {
    float s[U][R];
    key_logits<T, DT, U, R, PLAIN>(p, q, rows, count, kraw, j0, j_end, lane, s);
    float vx[U][Lay::CH][Lay::EPL];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c) unpack16<T>(vraw[u][c], vx[u][c]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= count) break;
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = max_nan(mx, s[u][r]);
      const float alpha = weight_to(m[r], mx);
      l[r] *= alpha;
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i) acc[r][c][i] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = j0 + u * Lay::KPW + kofs;
        const float e = weight_to(s[u][r], mx);
        l[r] += e;
        if (j < j_end && sub == 0) sc[r * kSplitKeys + (j - first)] = s[u][r];
        // Keys past j_end have e = 0; their dropout entries lie outside the row (initcheck found
        // the read), so they are not read.
        const float wv = PLAIN || p.dropout == Dropout::None || j >= j_end
                             ? e
                             : returned_prob<float>(p, e, keep_at<PLAIN>(p, rows[r], j));
#pragma unroll
        for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
          for (int i = 0; i < Lay::EPL; ++i) acc[r][c][i] += wv * vx[u][c][i];
      }
      m[r] = mx;
    }
  };
  // Two register buffers: the next step's rows are in flight while this step's are used. (A
  // loop unrolled by two, with no copy of the buffer, ran no faster: bench/NOTES.md.)
  constexpr int64_t kStride = kWarps * kStep;
  uint4 knext[U][Lay::CH], vnext[U][Lay::CH];
  load_rows<T, DT, U>(p.k, k_at, first + warp * kStep, j_end, p.E, lane, true, knext);
  load_rows<T, DT, U>(p.v, v_at, first + warp * kStep, j_end, p.Ev, lane, true, vnext);
  for (int64_t j0 = first + warp * kStep; j0 < j_end; j0 += kStride) {
    uint4 kraw[U][Lay::CH], vraw[U][Lay::CH];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c) kraw[u][c] = knext[u][c], vraw[u][c] = vnext[u][c];
    load_rows<T, DT, U>(p.k, k_at, j0 + kStride, j_end, p.E, lane, true, knext);
    load_rows<T, DT, U>(p.v, v_at, j0 + kStride, j_end, p.Ev, lane, true, vnext);
    consume(j0, kraw, vraw);
  }
  // The warp's key groups merged by shuffles, then each warp's result into shared memory.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= count) break;
#pragma unroll
    for (int o = 16; o >= Lay::LPK; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[r], o), l2 = __shfl_xor_sync(0xffffffffu, l[r], o);
      const float mx = max_nan(m[r], m2), a = weight_to(m[r], mx), b = weight_to(m2, mx);
      l[r] = l[r] * a + l2 * b;
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i)
          acc[r][c][i] = acc[r][c][i] * a + __shfl_xor_sync(0xffffffffu, acc[r][c][i], o) * b;
      m[r] = mx;
    }
    if (kofs == 0) {
#pragma unroll
      for (int c = 0; c < Lay::CH; ++c)
#pragma unroll
        for (int i = 0; i < Lay::EPL; ++i) wacc[(warp * R + r) * DT + (sub + c * Lay::LPK) * Lay::EPL + i] = acc[r][c][i];
    }
    if (lane == 0) {
      wstat[(warp * R + r) * 2] = m[r];
      wstat[(warp * R + r) * 2 + 1] = l[r];
    }
  }
  __syncthreads();
  // The block's (m_b, l_b) and share of O over the warps, and its logits, to the workspace.
  for (int r = 0; r < count; ++r) {
    float mb = neg_inf<float>();
    for (int x = 0; x < kWarps; ++x) mb = max_nan(mb, wstat[(x * R + r) * 2]);
    const int64_t at = (row0 + r) * w.blocks + blk;
    for (int64_t e = threadIdx.x; e < p.Ev; e += kThreads) {
      float o = 0.0f;
      for (int x = 0; x < kWarps; ++x) o += weight_to(wstat[(x * R + r) * 2], mb) * wacc[(x * R + r) * DT + e];
      w.partial[at * p.Ev + e] = o;
    }
    if (threadIdx.x == 0) {
      float lb = 0.0f;
      for (int x = 0; x < kWarps; ++x) lb += weight_to(wstat[(x * R + r) * 2], mb) * wstat[(x * R + r) * 2 + 1];
      w.stats[at * 2] = mb;
      w.stats[at * 2 + 1] = lb;
    }
    float* dst = w.scores + (row0 + r) * w.score_row + first;
    for (int64_t jj = threadIdx.x; jj < n; jj += kThreads) dst[jj] = sc[r * kSplitKeys + jj];
  }
}

// decode_partial's results on tensor cores (fp16/bf16, E = Ev = DT = 64 or 128, PLAIN problems),
// for the CTA's count <= kDecodeMaxRows rows. The products are taken transposed, S^T = K Q^T and
// O^T = V^T P^T: keys and output dimensions are the M side of m16n8k16 and the rows its N side,
// so every accumulator register holds a result (the untransposed form pads 16 rows of M to
// count and carries twice the registers of O). Each warp takes kSplitKeysTc / 4 keys in chunks
// of 16, with the next chunk's rows in flight while one is used (two register buffers). Per
// chunk:
// - A = K: lane (g, t) loads 16 bytes (8 head dimensions) of key rows g and g + 8 for each 32
//   dimensions, straight from global memory. A dot product does not care in which order the
//   dimensions are summed, so those 8 dimensions serve as the A fragments of two k-steps:
//   k-step 2 qq + x reads dimensions 32 qq + 8 t + 4 x + {0, 1} as k = 2t, 2t+1 and + {2, 3} as
//   k = 2t+8, 2t+9; B = Q^T takes the same order (built once).
// - Lane (g, t) gets the logits of keys g and g + 8 for rows 2t and 2t + 1; a row's max is taken
//   over the 8 lanes of one t. P^T as the B operand of O^T = V^T P^T needs row g's keys 2t, 2t+1
//   (and + 8): one movmatrix.trans of the packed (key g; rows 2t, 2t+1) words gives them. P is
//   rounded to T there, as flash attention does.
// - A = V^T: m-tile (z, jp)'s row g stands for dimension 64 z + 8 g + 2 jp, row g + 8 for the
//   one after it. Lane (g, t) loads 16 bytes of the rows of keys 2t, 2t+1, 2t+8, 2t+9 at
//   dimension 64 z + 8 g and pairs them with byte permutes.
// - O^T's accumulators hold rows 2t and 2t + 1, whose rescale factors the lane computed itself.
// 8 + 8 mma a chunk for DT = 128. The online softmax runs in base 2 (logits times log2 e); the
// block's max is stored in natural units, its sum is the same number. Key indices inside the
// block are 32-bit and each lane's row addresses are computed once. Its prototype and the
// measurements that chose this form: tests/gpu/decode_tc_rate.cu (partial_tc_t), bench/NOTES.md.
template <typename T, int DT>
__global__ void __launch_bounds__(kThreads, 2) decode_partial_tc(DevProblem p, DecodeWorkspace w) {
  static_assert(DT == 64 || DT == 128, "registers: O^T takes DT / 4 of them a lane");
  constexpr int R = kDecodeMaxRows;
  static_assert(R <= 8, "rows are the N side (8) of m16n8k16");
  constexpr int kWarpKeys = kSplitKeysTc / kWarps, kChunks = kWarpKeys / 16, QQ = DT / 32, Z = DT / 64;
  constexpr int kPad = 4;  // sc's rows 4 banks apart: a warp's stores (rows 2t, 2t+1; keys g) meet no conflict
  static_assert(kChunks % 2 == 0, "the prefetching loop takes chunks in pairs");
  constexpr float kLog2e = 1.4426950408889634f;
  __shared__ float sc[R][kSplitKeysTc + kPad];  // the block's logits (natural units)
  __shared__ float wstat[kWarps][R][2];         // each warp's (m, l), base 2
  __shared__ __align__(16) float wacc[kWarps][R][DT];  // each warp's share of O (float2 stores)
  const int count = static_cast<int>(w.heads * p.L);
  // 32-bit: the grid is below 2^31 CTAs (grid_x), and a 64-bit division is a long call.
  const unsigned nblocks = static_cast<unsigned>(w.blocks), blk = blockIdx.x % nblocks;
  const int64_t first_lead = w.lead0 + static_cast<int64_t>(blockIdx.x / nblocks) * w.heads;
  const int64_t row0 = (first_lead - w.lead0) * p.L;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int r0 = 2 * t, r1 = 2 * t + 1;  // this lane's rows of S^T and O^T
  // B = Q^T: row g's dimensions in the permuted order (zero for g >= count). Rows of 16 bytes
  // when q's rows allow it (the contiguous and the (B, L, H, E) layouts), else element by element.
  uint32_t qb[2 * QQ][2];
  {
    const int gr = g < count ? g : 0;
    const int64_t lead = first_lead + gr / p.L, r = gr % p.L;
    const T* qrow = reinterpret_cast<const T*>(p.q.data) + lead_off_narrow(p, p.q, lead) + r * p.q.row;
    const bool vec = p.q.col == 1 && reinterpret_cast<uintptr_t>(qrow) % 16 == 0;
#pragma unroll
    for (int qq = 0; qq < QQ; ++qq) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (g < count) {
        if (vec) {
          u = __ldg(reinterpret_cast<const uint4*>(qrow + 32 * qq + 8 * t));
        } else {
          auto at = [&](int i) { return reinterpret_cast<const uint16_t*>(qrow + (32 * qq + 8 * t + i) * p.q.col); };
          u = make_uint4(pack_raw(at(0), at(1)), pack_raw(at(2), at(3)), pack_raw(at(4), at(5)), pack_raw(at(6), at(7)));
        }
      }
      qb[2 * qq][0] = u.x, qb[2 * qq][1] = u.y, qb[2 * qq + 1][0] = u.z, qb[2 * qq + 1][1] = u.w;
    }
  }
  const int64_t first = static_cast<int64_t>(blk) * kSplitKeysTc, wfirst = first + warp * kWarpKeys;
  const int n = static_cast<int>(min(p.S - first, static_cast<int64_t>(kSplitKeysTc)));  // the block's keys
  const int wn = n - warp * kWarpKeys;  // the warp's keys (<= 0: none)
  const int64_t krow = p.k.row, vrow = p.v.row;
  const T* kp = reinterpret_cast<const T*>(p.k.data) + lead_off_narrow(p, p.k, first_lead) + (wfirst + g) * krow + 8 * t;
  const T* vp = reinterpret_cast<const T*>(p.v.data) + lead_off_narrow(p, p.v, first_lead) + (wfirst + 2 * t) * vrow + 8 * g;
  const float scale = static_cast<float>(p.scale);
  auto row16 = [](const T* at, bool ok) {
    return ok ? __ldg(reinterpret_cast<const uint4*>(at)) : make_uint4(0u, 0u, 0u, 0u);
  };
  using KRows = uint4[2][QQ];
  using VRows = uint4[4][Z];
  auto load = [&](KRows& kr, VRows& vr, int chunk) {
    const int c0 = chunk * 16;
    const T* kc = kp + c0 * krow;
    const T* vc = vp + c0 * vrow;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int qq = 0; qq < QQ; ++qq) kr[h][qq] = row16(kc + 8 * h * krow + 32 * qq, c0 + 8 * h + g < wn);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int dk = (i & 1) + (i >> 1) * 8;
#pragma unroll
      for (int z = 0; z < Z; ++z) vr[i][z] = row16(vc + dk * vrow + 64 * z, c0 + 2 * t + dk < wn);
    }
  };
  float m0 = neg_inf<float>(), m1 = neg_inf<float>(), l0 = 0.0f, l1 = 0.0f;  // rows r0, r1; base 2
  float o[Z][4][4];  // O^T: m-tile (z, jp)
#pragma unroll
  for (int z = 0; z < Z; ++z)
#pragma unroll
    for (int jp = 0; jp < 4; ++jp)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[z][jp][c] = 0.0f;
  auto consume = [&](const KRows& kr, const VRows& vr, int chunk) {
    const int c0 = chunk * 16;
    float s[2][4] = {};  // two product chains (x = 0, 1), added after
#pragma unroll
    for (int qq = 0; qq < QQ; ++qq)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const uint4 &k0 = kr[0][qq], &k1 = kr[1][qq];
        const uint32_t a[4] = {x ? k0.z : k0.x, x ? k1.z : k1.x, x ? k0.w : k0.y, x ? k1.w : k1.y};
        mma_16816<T>(s[x], a, qb[2 * qq + x][0], qb[2 * qq + x][1]);
      }
    float x2[4];  // base-2 logits of (key g, row r0), (g, r1), (g + 8, r0), (g + 8, r1)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int kk = c0 + g + (i >> 1) * 8;  // in the warp's keys
      const float logit = (s[0][i] + s[1][i]) * scale;
      x2[i] = kk < wn ? logit * kLog2e : neg_inf<float>();
      const int r = (i & 1) ? r1 : r0;
      if (r < count && kk < wn) sc[r][warp * kWarpKeys + kk] = logit;
    }
    const float mn0 = max_nan(m0, col_max_nan(max_nan(x2[0], x2[2])));
    const float mn1 = max_nan(m1, col_max_nan(max_nan(x2[1], x2[3])));
    const float a0 = weight2_to(m0, mn0), a1 = weight2_to(m1, mn1);
    const float p00 = weight2_to(x2[0], mn0), p01 = weight2_to(x2[1], mn1);
    const float p10 = weight2_to(x2[2], mn0), p11 = weight2_to(x2[3], mn1);
    l0 = l0 * a0 + (p00 + p10);
    l1 = l1 * a1 + (p01 + p11);
    m0 = mn0, m1 = mn1;
#pragma unroll
    for (int z = 0; z < Z; ++z)
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) o[z][jp][0] *= a0, o[z][jp][1] *= a1, o[z][jp][2] *= a0, o[z][jp][3] *= a1;
    const uint32_t b0 = transpose8x8_b16(pack2<T>(p00, p01)), b1 = transpose8x8_b16(pack2<T>(p10, p11));
#pragma unroll
    for (int z = 0; z < Z; ++z)
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        auto word = [&](const uint4& u) { return jp == 0 ? u.x : jp == 1 ? u.y : jp == 2 ? u.z : u.w; };
        const uint32_t v0 = word(vr[0][z]), v1 = word(vr[1][z]), v2 = word(vr[2][z]), v3 = word(vr[3][z]);
        const uint32_t a[4] = {__byte_perm(v0, v1, 0x5410u), __byte_perm(v0, v1, 0x7632u), __byte_perm(v2, v3, 0x5410u),
                               __byte_perm(v2, v3, 0x7632u)};
        mma_16816<T>(o[z][jp], a, b0, b1);
      }
  };
  {
    uint4 ka[2][QQ], va[4][Z], kb[2][QQ], vb[4][Z];
    load(ka, va, 0);
#pragma unroll 1
    for (int chunk = 0; chunk < kChunks; chunk += 2) {
      load(kb, vb, chunk + 1);
      consume(ka, va, chunk);
      if (chunk + 2 < kChunks) load(ka, va, chunk + 2);
      consume(kb, vb, chunk + 1);
    }
  }
  l0 = col_sum(l0), l1 = col_sum(l1);
  if (g == 0) {
    if (r0 < count) wstat[warp][r0][0] = m0, wstat[warp][r0][1] = l0;
    if (r1 < count) wstat[warp][r1][0] = m1, wstat[warp][r1][1] = l1;
  }
#pragma unroll
  for (int z = 0; z < Z; ++z)
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      const int e = 64 * z + 8 * g + 2 * jp;
      if (r0 < count) *reinterpret_cast<float2*>(&wacc[warp][r0][e]) = make_float2(o[z][jp][0], o[z][jp][2]);
      if (r1 < count) *reinterpret_cast<float2*>(&wacc[warp][r1][e]) = make_float2(o[z][jp][1], o[z][jp][3]);
    }
  __syncthreads();
  // The block's (m_b, l_b) and share of O over the warps, and its logits, to the workspace.
  for (int r = 0; r < count; ++r) {
    float mb = neg_inf<float>();
    for (int x = 0; x < kWarps; ++x) mb = max_nan(mb, wstat[x][r][0]);
    auto wt = [&](int x) { return weight2_to(wstat[x][r][0], mb); };
    const int64_t at = (row0 + r) * w.blocks + blk;
    for (int e = threadIdx.x; e < DT; e += kThreads) {
      float acc = 0.0f;
      for (int x = 0; x < kWarps; ++x) acc += wt(x) * wacc[x][r][e];
      w.partial[at * DT + e] = acc;
    }
    if (threadIdx.x == 0) {
      float lb = 0.0f;
      for (int x = 0; x < kWarps; ++x) lb += wt(x) * wstat[x][r][1];
      w.stats[at * 2] = mb * (1.0f / kLog2e);
      w.stats[at * 2 + 1] = lb;
    }
    float* dst = w.scores + (row0 + r) * w.score_row + first;
    for (int jj = threadIdx.x; jj < n; jj += kThreads) dst[jj] = sc[r][jj];
  }
}


// One chunk of heads: the first step (decode_partial or decode_partial_tc), the second
// (finalize.cu) and, when asked, the statistics (stats.cu).
template <typename T, int DT>
void launch_decode(const DevProblem& p, float* workspace, int64_t lead0, int64_t chunk, const StatsTargets* stats,
                   cudaStream_t stream) {
  const DecodeWorkspace w = chunk_workspace(p, workspace, lead0, chunk);
  const int64_t ctas = chunk / w.heads * w.blocks, count = w.heads * p.L;
  // Every grid first, so an oversized problem is refused before any kernel runs. The statistics'
  // grids only when asked (the plain forward keeps its own limits on S).
  const unsigned partial_grid = grid_x(ctas, "decode blocks");
  const DecodeFinalizePlan finalize = decode_finalize_plan(p, chunk);
  const DecodeStatsPlan stats_plan = decode_stats_plan(p, chunk, stats);
  // decode_partial: one row per CTA has kernels of its own (a quarter of the registers).
  auto go = [&](auto kernel, int rows) {
    const size_t smem = sizeof(float) * (count * DT + count * kSplitKeys + kWarps * rows * (2 + DT));
    kernel<<<partial_grid, kThreads, smem, stream>>>(p, w);
  };
  auto tensor_cores = [&] {
    if constexpr (!std::is_same_v<T, float> && DT <= 128) {
      if (tensor_core_partial(p)) {
        decode_partial_tc<T, DT><<<partial_grid, kThreads, 0, stream>>>(p, w);
        return true;
      }
    }
    return false;
  };
  if (!tensor_cores()) {
    if (count == 1) plain(p) ? go(decode_partial<T, DT, 1, true>, 1) : go(decode_partial<T, DT, 1, false>, 1);
    else if (plain(p)) go(decode_partial<T, DT, kDecodeMaxRows, true>, kDecodeMaxRows);
    else go(decode_partial<T, DT, kDecodeMaxRows, false>, kDecodeMaxRows);
  }
  check_launch("decode blocks");
  decode_finalize_launch(p, finalize, workspace, lead0, chunk, stream);
  if (stats_plan.any) decode_stats_launch(p, stats_plan, *stats, workspace, lead0, chunk, stream);
}

template <typename T>
void launch_for_head(const DevProblem& p, float* workspace, int64_t lead0, int64_t chunk, const StatsTargets* stats,
                     cudaStream_t stream) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  if (head <= 64) launch_decode<T, 64>(p, workspace, lead0, chunk, stats, stream);
  else if (head <= 128) launch_decode<T, 128>(p, workspace, lead0, chunk, stats, stream);
  else launch_decode<T, 256>(p, workspace, lead0, chunk, stats, stream);
}

// Workspace floats of one head (chunk_workspace's layout), and how many heads one pass takes.
int64_t workspace_per_lead(const DevProblem& p) {
  const int64_t blocks = (p.S + decode_split_keys(p) - 1) / decode_split_keys(p),
                stats_chunks = (p.S + kStatsKeys - 1) / kStatsKeys;
  return p.L * decode_score_row(p) + p.L * blocks * (p.Ev + 2) + p.L * (stats_chunks + 1);
}
int64_t leads_per_pass(const DevProblem& p) {
  const int64_t heads = decode_heads_per_cta(p);  // whole groups: num_lead is a multiple of it
  return std::max<int64_t>(1, std::min<int64_t>(p.num_lead, kWorkspaceFloats / workspace_per_lead(p)) / heads) * heads;
}

}  // namespace

int64_t decode_split_keys(const DevProblem& p) { return tensor_core_partial(p) ? kSplitKeysTc : kSplitKeys; }

const char* decode_declines(const DevProblem& p) {
  if (p.L > kDecodeMaxRows || p.L == 0) return "more than 4 query rows";
  if (p.S == 0) return "no keys (S = 0)";
  if (p.E == 0) return "head size E = 0";
  if ((p.E > p.Ev ? p.E : p.Ev) > kDecodeMaxHead) return "a head size above 256";
  int elem = 0;
  switch (p.q.dtype) {
    case DType::Float16: case DType::BFloat16: elem = 2; break;
    case DType::Float32: elem = 4; break;
    default: return "inputs not float16, bfloat16 or float32";
  }
  // Rows of K and V move 16 bytes per lane: unit column stride, aligned rows.
  const int vec = 16 / elem;
  if (!rows_vectorizable(p.k, p.lead_ndim, p.E, elem, vec) || !rows_vectorizable(p.v, p.lead_ndim, p.Ev, elem, vec))
    return "rows of k or v not read 16 bytes at a time (unit column stride, 16-byte aligned base and strides)";
  return nullptr;
}

// How many heads of one key head's group a CTA takes: the most that divide the group with
// heads * L <= kDecodeMaxRows (1 without GQA).
int64_t decode_heads_per_cta(const DevProblem& p) {
  const int64_t g = p.k.head_group == p.v.head_group ? p.k.head_group : 1;
  int64_t h = 1;
  for (int64_t d = 1; d <= g; ++d)
    if (g % d == 0 && d * p.L <= kDecodeMaxRows) h = d;
  return h;
}

int64_t decode_workspace_floats(const DevProblem& p) { return leads_per_pass(p) * workspace_per_lead(p); }

void decode_forward(const DevProblem& p, float* workspace, cudaStream_t stream, const StatsTargets* stats) {
  const int64_t chunk_max = leads_per_pass(p);
  for (int64_t lead0 = 0; lead0 < p.num_lead; lead0 += chunk_max) {
    const int64_t chunk = std::min(chunk_max, p.num_lead - lead0);
    switch (p.q.dtype) {
      case DType::Float16: launch_for_head<__half>(p, workspace, lead0, chunk, stats, stream); break;
      case DType::BFloat16: launch_for_head<__nv_bfloat16>(p, workspace, lead0, chunk, stats, stream); break;
      default: launch_for_head<float>(p, workspace, lead0, chunk, stats, stream); break;
    }
  }
}

}  // namespace sdpa_math::cuda
