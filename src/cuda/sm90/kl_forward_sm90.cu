// kl_to's forward rows on Hopper (fp16/bf16) without P and without r K: per query row i of the
// student's logits x = scale q kᵀ and a reference map r of P's shape,
//   KL_i = Σ_j r_ij log r_ij − scale Σ_j r_ij (q_i · k_j) + R_i lse_i,   R_i = Σ_j r_ij,
// 0 for a row with R_i = 0 and +inf for one whose r has mass on a key the top-left causal mask
// hides (the definition kl_rows has; attention.h).
//
// One CTA takes 128 query rows of one lead index; a producer warp streams key tiles of 128 keys
// (K's rows and the reference's [128 rows][128 keys] tile) through TMA into a ring of stages, and
// each of two consumer warpgroups forms S = Q_w Kᵀ for its 64 rows with wgmma (Q loaded once, in
// shared memory) and folds the reference's tile into three running sums a row: Σ r log2 r, Σ r s
// and Σ r. So the reference is read once, from DRAM, and the product r K that the general path
// (kl_rows) needs as its own GEMM over the reference is never formed: that path reads the
// reference twice (once for r K, once for kl_rows), this kernel once.
//
// Causal: key tiles wholly right of a warpgroup's rows skip the product (their r must still be
// read: mass there makes the KL +inf), and the producer loads no K for tiles no row of the CTA
// sees.
//
// What limits it: it is faster than r K + kl_rows but still well above the time its memory
// traffic needs (bench/NOTES.md has the measurements). Nsight Compute showed one CTA an SM (225
// KiB of shared memory), two warps a scheduler, DRAM far from its peak and "long scoreboard" as
// the largest stall, which we read as waiting for the tile's barrier. Cutting the fold's
// instructions by more than half gained only about a tenth, so the issue rate is not the limit;
// the depth of the load pipeline at one CTA an SM is the likely one. Ways on, not tried: more
// loads in flight (smaller key tiles with more stages, or K and the reference in separate rings)
// and more than two warps a scheduler.
#include <cudaTypedefs.h>

#include <cstdint>
#include <type_traits>

#include "../../core/kl_row.h"
#include "../launch.cuh"
#include "../mma.cuh"
#include "hopper.cuh"
#include "sm90.cuh"
#include "tensor_maps.cuh"

namespace sdpa_math::cuda::sm90 {
namespace {

constexpr int kRows = 128;      // query rows per CTA (64 per consumer warpgroup)
constexpr int kBN = 128;        // keys per step

// Shared memory (every block 1024-byte aligned, 128-byte swizzle, [rows][64] column blocks): Q of
// the CTA's rows (D / 64 blocks of [128][64]); a ring of stages, each K's 128 rows (D / 64 blocks)
// and the reference's tile (two blocks of [128 rows][64 keys]); the barriers. Three stages fit
// at D = 128 (225 KiB of the 227 an SM gives a CTA), four at D = 64.
template <int D>
struct Tiles {
  static constexpr int kStages = D == 64 ? 4 : 3;
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kKBytes = kBN * D * 2;
  static constexpr int kRefBytes = kRows * kBN * 2;
  static constexpr int kStageBytes = kKBytes + kRefBytes;
  static constexpr int kBarriers = 2 * kStages + 1;
  static constexpr size_t kSmem = 1024 + kQBytes + kStages * kStageBytes + 8 * kBarriers;
};

struct Args {
  MapCoords q, k, ref;
  int64_t q_blocks;  // ceil(L / 128)
  int k_tiles;       // ceil(S / 128)
  float scale;
  DevOperand kl, row_sum;  // fp32 rows shaped like the lse
};

// log2 x in one MUFU instruction (lg2.approx.ftz; without .ftz the compiler wraps it in ~8
// instructions of subnormal scaling).
SDPA_MATH_D float log2_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Which keys of a tile a warpgroup's rows see: all of them (ALL), those left of each row's
// causal diagonal (DIAGONAL: columns < seen[r]), or none (HIDDEN: no product was formed).
enum class Keys { All, Diagonal, Hidden };

// Folds one reference tile into a warpgroup's running row sums, two partial sums a row (one per
// element of a pair, for independent chains): sum += x; h += x log2(x + 1e-30), which is x log2 x
// to within 1e-28 absolute (0 log 0 = 0 with no select; a negative entry below -1e-30 gives NaN,
// as log x does, while one in (-1e-30, 0), which only bf16 holds, is taken as 0); xs += x s on
// the keys the row sees (on a diagonal tile a hidden key adds 0 · s, NaN if s is not finite,
// where the reference skips it); hid += x on those it does not. About six
// instructions an element on the tiles every row sees (an earlier fold with a select per element
// everywhere and a min and a max for the log's domain took about fifteen, and was slower).
// `at` is this thread's byte address of pair (row warp*16 + g, 16-byte chunk 0 of block 0) in
// the warpgroup's swizzled tile (swizzled_row_at, hopper.cuh), so chunk n of its row is at
// swizzled_chunk(at, n). That holds only while every tile starts on a 1024-byte boundary.
static_assert(Tiles<64>::kQBytes % 1024 == 0 && Tiles<64>::kStageBytes % 1024 == 0 && Tiles<64>::kKBytes % 1024 == 0 &&
                  Tiles<128>::kQBytes % 1024 == 0 && Tiles<128>::kStageBytes % 1024 == 0 &&
                  Tiles<128>::kKBytes % 1024 == 0 && (kRows * 128) % 1024 == 0,
              "kl_forward's tiles must start on 1024-byte boundaries (the 128-byte swizzle's period)");
struct RowSums {
  float h[2][2] = {}, xs[2][2] = {}, sum[2][2] = {}, hid[2] = {};
};
template <typename T, Keys KEYS>
SDPA_MATH_D void fold_tile(uint32_t at, const float (&s)[64], const int (&seen)[2], int t, RowSums& a) {
#pragma unroll
  for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t addr = swizzled_chunk(at, n % 8) + (n / 8) * (kRows * 128) + r * (8 * 128);
      const float2 x2 = unpack2<T>(lds32(addr));
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = e ? x2.y : x2.x;
        a.sum[r][e] += x;
        a.h[r][e] = fmaf(x, log2_ftz(x + 1e-30f), a.h[r][e]);
        if constexpr (KEYS == Keys::All) {
          a.xs[r][e] = fmaf(x, s[4 * n + 2 * r + e], a.xs[r][e]);
        } else if constexpr (KEYS == Keys::Diagonal) {  // selects around the products' registers
          const bool in = 8 * n + 2 * t + e < seen[r];
          a.xs[r][e] = fmaf(in ? x : 0.0f, s[4 * n + 2 * r + e], a.xs[r][e]);
          a.hid[r] += in ? 0.0f : x;
        } else {
          a.hid[r] += x;
        }
      }
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    kl_forward_sm90(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_ref, const DevProblem p, const Args a) {
  using C = Tiles<D>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* sQ = reinterpret_cast<T*>(base);
  unsigned char* stages = base + C::kQBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + C::kStages * C::kStageBytes);
  uint64_t* empty = full + C::kStages;
  uint64_t* q_full = empty + C::kStages;
  auto stage_k = [&](int st) { return reinterpret_cast<T*>(stages + st * C::kStageBytes); };
  auto stage_ref = [&](int st) { return reinterpret_cast<T*>(stages + st * C::kStageBytes + C::kKBytes); };

  // Lead-major order: neighbouring CTAs read one head's K from L2.
  const int64_t lead = blockIdx.x / a.q_blocks;
  const int64_t i0 = (blockIdx.x % a.q_blocks) * kRows;
  // The last real row of the CTA; causal key tiles past it are seen by none of its rows.
  const int64_t i_last = (i0 + kRows < p.L ? i0 + kRows : p.L) - 1;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    mbar_init(q_full, 1);
    fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // producer
    regs_release<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_ref);
      int c[3];
      map_coords(a.q, lead, c);
      mbar_arrive_expect_tx(q_full, C::kQBytes);
#pragma unroll
      for (int b = 0; b < D / 64; ++b) tma_load_5d(sQ + b * kRows * 64, &tm_q, q_full, b * 64, static_cast<int>(i0), c[0], c[1], c[2]);
      int ck[3], cr[3];
      map_coords(a.k, lead, ck);
      map_coords(a.ref, lead, cr);
      // The reference is read once: it should not push K (read by every row block of the head) out of L2.
      const uint64_t stream_once = l2_policy_evict_first();
      for (int kt = 0; kt < a.k_tiles; ++kt) {
        const int st = kt % C::kStages;
        const int j0 = kt * kBN;
        mbar_wait(&empty[st], ((kt / C::kStages) & 1) ^ 1);  // the first use finds it free
        const bool need_k = !p.causal || j0 <= i_last;
        mbar_arrive_expect_tx(&full[st], C::kRefBytes + (need_k ? C::kKBytes : 0));
        if (need_k) {
#pragma unroll
          for (int b = 0; b < D / 64; ++b) tma_load_5d(stage_k(st) + b * kBN * 64, &tm_k, &full[st], b * 64, j0, ck[0], ck[1], ck[2]);
        }
#pragma unroll
        for (int b = 0; b < kBN / 64; ++b)
          tma_load_5d(stage_ref(st) + b * kRows * 64, &tm_ref, &full[st], j0 + b * 64, static_cast<int>(i0), cr[0], cr[1],
                      cr[2], stream_once);
      }
    }
    return;
  }

  // Consumers: warpgroup cw owns rows i0 + 64 cw .. + 63; in its 64 x 128 tiles this thread holds
  // rows warp * 16 + g and + 8, keys 8n + 2t and + 1 (n < 16).
  regs_claim<kConsumerRegs>();
  const int cw = wg - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int64_t iw = i0 + cw * 64;  // the warpgroup's first row
  const int64_t w_last = iw + 63 < p.L - 1 ? iw + 63 : p.L - 1;
  const T* q_rows = sQ + cw * 64 * 64;
  const uint32_t at_in_tile = cw * 64 * 128 + swizzled_row_at(warp * 16 + g, t);
  RowSums acc;
  mbar_wait(q_full, 0);

  // Tiles 0 .. n_all - 1 are seen whole by every row of the warpgroup, n_all .. n_seen - 1 in
  // part (the causal diagonal), the rest by none: they get no product, only the fold's check
  // for mass. Three loops, not a branch in one: ptxas serialises every wgmma of a kernel where a
  // path it cannot prove uniform chooses between readers of the products' registers (C7518).
  const int n_seen = p.causal ? static_cast<int>(w_last / kBN + 1 < a.k_tiles ? w_last / kBN + 1 : a.k_tiles) : a.k_tiles;
  const int n_all = p.causal ? static_cast<int>((iw + 1) / kBN < n_seen ? (iw + 1) / kBN : n_seen) : a.k_tiles;
  float s[64];
  // Waits for tile kt and forms S = Q_w Kᵀ in s. Not overlapped with the previous tile's fold
  // inside a warpgroup (the other warpgroup's work fills the gap): two accumulators and five
  // inlined copies of the fold made the instruction cache stall the warps (Nsight Compute's "no
  // instruction" stall became a large share of each instruction's cycles) and left one load in
  // flight, not two.
  auto product = [&](int kt) {
    const int st = kt % C::kStages;
    mbar_wait(&full[st], (kt / C::kStages) & 1);
    const T* k_rows = stage_k(st);
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int b = kk / 4, off = (kk % 4) * 16;
      Wgmma<T, kBN>::template ss<0, 0>(s, desc_sw128(q_rows + b * kRows * 64 + off, 16, 1024),
                                       desc_sw128(k_rows + b * kBN * 64 + off, 16, 1024), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
  };
  // Folds tile kt and frees its stage.
  auto fold = [&](int kt, auto keys) {
    const int st = kt % C::kStages;
    int seen[2];  // keys this thread's rows see: the tile's columns < seen[r]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t lim = iw + warp * 16 + g + 8 * r - static_cast<int64_t>(kt) * kBN + 1;
      seen[r] = static_cast<int>(lim < 0 ? 0 : lim > kBN ? kBN : lim);
    }
    fold_tile<T, decltype(keys)::value>(smem_u32(stage_ref(st)) + at_in_tile, s, seen, t, acc);
    __syncwarp();  // every lane's reads of the stage done before the warp frees it
    if (lane == 0) mbar_arrive(&empty[st]);
  };
  for (int kt = 0; kt < n_all; ++kt) {
    product(kt);
    fold(kt, std::integral_constant<Keys, Keys::All>{});
  }
  for (int kt = n_all; kt < n_seen; ++kt) {
    product(kt);
    fold(kt, std::integral_constant<Keys, Keys::Diagonal>{});
  }
  for (int kt = n_seen; kt < a.k_tiles; ++kt) {
    mbar_wait(&full[kt % C::kStages], (kt / C::kStages) & 1);
    fold(kt, std::integral_constant<Keys, Keys::Hidden>{});
  }

  const float ln2 = 0.69314718055994530942f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float h_r = quad_sum(acc.h[r][0] + acc.h[r][1]), xs_r = quad_sum(acc.xs[r][0] + acc.xs[r][1]),
                sum_r = quad_sum(acc.sum[r][0] + acc.sum[r][1]), hid_r = quad_sum(acc.hid[r]);
    const int64_t i = iw + warp * 16 + g + 8 * r;
    if (t != 0 || i >= p.L) continue;
    const float lse = reinterpret_cast<const float*>(p.lse.data)[lead_off(p, p.lse, lead) + i * p.lse.row];
    reinterpret_cast<float*>(a.kl.data)[lead_off(p, a.kl, lead) + i * a.kl.row] =
        core::kl_of_row(h_r * ln2, a.scale * xs_r, sum_r, lse, hid_r);
    reinterpret_cast<float*>(a.row_sum.data)[lead_off(p, a.row_sum, lead) + i * a.row_sum.row] = sum_r;
  }
}

template <typename T, int D>
void launch(const CUtensorMap (&maps)[3], const DevProblem& p, const Args& a, cudaStream_t stream) {
  const unsigned grid = grid_x(p.num_lead * a.q_blocks, "sm90 KL forward");
  const auto kernel = &kl_forward_sm90<T, D>;
  set_smem_limit(reinterpret_cast<const void*>(kernel), Tiles<D>::kSmem);
  kernel<<<grid, kThreads, Tiles<D>::kSmem, stream>>>(maps[0], maps[1], maps[2], p, a);
  check_launch("sm90 KL forward");
}

// The three maps (q, k, the reference); false when TMA cannot address one.
bool kl_forward_maps(const DevProblem& p, const DevOperand& reference, CUtensorMap (&maps)[3], Args& a) {
  return make_map(&maps[0], p, p.q, p.L, p.E, kRows, a.q) && make_map(&maps[1], p, p.k, p.S, p.E, kBN, a.k) &&
         make_map(&maps[2], p, reference, p.L, p.S, kRows, a.ref);
}

}  // namespace

const char* kl_inputs_decline(const DevProblem& p, DType reference) {
  if (p.q.dtype != DType::Float16 && p.q.dtype != DType::BFloat16) return "the inputs are not float16 or bfloat16";
  if (p.dropout != Dropout::None || p.mask.data != nullptr) return "there is dropout or a mask";
  if (reference != p.q.dtype) return "the reference map's dtype is not the inputs'";
  if (p.E <= 0 || p.E > 128 || p.E % 8 != 0) return "the head size is not a multiple of 8 up to 128";
  if (!device_supported()) return "the device is not a Hopper GPU (or SDPA_MATH_SM90=0)";
  return nullptr;
}

const char* kl_forward_conditions_decline(const DevProblem& p, const DevOperand& reference, const KlRowsOut& out) {
  if (const char* why = kl_inputs_decline(p, reference.dtype)) return why;
  if (p.lse.dtype != DType::Float32 || out.kl.dtype != DType::Float32 || out.row_sum.dtype != DType::Float32)
    return "the lse or the outputs are not float32";
  if (!(p.L > 0 && p.S > 0 && p.L <= 2147483647LL && p.S <= 2147483647LL - kBN)) return "L or S is 0 or above 2^31";
  return nullptr;
}

const char* kl_forward_declines(const DevProblem& p, const DevOperand& reference, const KlRowsOut& out) {
  if (const char* why = kl_forward_conditions_decline(p, reference, out)) return why;
  CUtensorMap maps[3];
  Args a{};
  if (!kl_forward_maps(p, reference, maps, a)) return kKlForwardTmaDecline;
  return nullptr;
}

bool kl_forward(const DevProblem& p, const DevOperand& reference, const KlRowsOut& out, cudaStream_t stream) {
  CUtensorMap maps[3] = {};
  Args a{};
  if (!kl_forward_maps(p, reference, maps, a)) return false;
  a.q_blocks = (p.L + kRows - 1) / kRows;
  a.k_tiles = static_cast<int>((p.S + kBN - 1) / kBN);
  a.scale = static_cast<float>(p.scale);
  a.kl = out.kl;
  a.row_sum = out.row_sum;
  const bool half = p.q.dtype == DType::Float16;
  if (padded_head(p.E) == 64) half ? launch<__half, 64>(maps, p, a, stream) : launch<__nv_bfloat16, 64>(maps, p, a, stream);
  else half ? launch<__half, 128>(maps, p, a, stream) : launch<__nv_bfloat16, 128>(maps, p, a, stream);
  return true;
}

}  // namespace sdpa_math::cuda::sm90
