// The Hopper forward's epilogues of P and O: P's tiles staged in shared memory by stmatrix and
// sent out by TMA stores or (P_COPY) the warpgroup's own stores, O divided by l, and the fill of
// the keys right of a CTA's last tile (causal, or a bool mask's hidden trailing tiles).
#pragma once

#include <type_traits>

#include "forward_sm90_consumer.cuh"

namespace sdpa_math::cuda::sm90::fwd {

// P through shared memory, in three steps both pass-2 loops take: the tile's buffer free (its
// TMA store kPBuffers tiles ago has read it: all but the kPBuffers - 1 most recent bulk groups,
// one a tile, have; P_COPY: the warpgroup's own copy of it is done, which the barrier ensures);
// P = u / l into it by stmatrix (p_to_smem); the tile to global memory while the products run
// (p_tile_out: TMA clips it at L and S; the copy checks both).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::p_buffer_free() {
  if constexpr (!P_COPY) {
    if (p_leader) bulk_wait_read<C::kPBuffers - 1>();
  }
  named_barrier(p_bar, 128);
  FWD_STAMP(trace::kP2PFree);
}

// P = u / l into buffer p_buf, 16 rows x 16 keys (four 8 x 8 matrices) an stmatrix at the
// addresses p_addr, each u pair also handed to `keep` (n2, nb, r, u0, u1) for the products.
// (Natural kernels: s shifted by m first where not raw, see exponent_of.)
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
template <typename Keep>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::p_to_smem(const float (&s)[kBN / 2], bool raw, float mul,
                                                                int p_buf, Keep&& keep) {
  const Exponent e[2] = {exponent_of<kNatural>(raw, mul, m[0], a.scale_log2),
                         exponent_of<kNatural>(raw, mul, m[1], a.scale_log2)};
#pragma unroll
  for (int n2 = 0; n2 < kBN / 16; ++n2) {
    uint32_t pr[4];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int n = 2 * n2 + nb;
        const float u0 = exp_from<false>(s[4 * n + 2 * r], e[r].mul, e[r].off);
        const float u1 = exp_from<false>(s[4 * n + 2 * r + 1], e[r].mul, e[r].off);
        keep(n2, nb, r, u0, u1);
        pr[nb * 2 + r] = pack2<T>(u0 * inv_l[r], u1 * inv_l[r]);
      }
    stmatrix_x4(p_addr[n2 % 4] + (p_buf * (kBN / 64) + n2 / 4) * 64 * 64 * 2, pr[0], pr[1], pr[2], pr[3]);
  }
}

// Rows of P that TMA cannot address (mostly rows not 16-byte aligned: S % 8 != 0, as for most
// prompt lengths) leave the staged tile by the warpgroup's own stores, each warp instruction
// (or pair of them, with 4-byte stores) covering 256 contiguous bytes of one row, where stores
// straight from the registers' fragments wrote 16 bytes in each of 8 rows (markedly slower). The
// copy runs after the warpgroup has issued its next products (p_tile_out only waits for the tile
// to be staged), so that it overlaps them; the tile's buffer is free again once the warpgroup
// has passed its next p_buffer_free.
//
// Lane l takes keys 4 l .. 4 l + 3 (8 bytes, in 64-key block l / 16, chunk (l % 16) / 2 of the
// swizzle); warp w rows w + 4 k, k < 16, whose swizzle row (w + 4 k) % 8 is w or w + 4 in turn,
// so the shared-memory addresses are two values plus constants and the global address steps
// by 4 rows. Four loads (LDS, by shared-window address) are issued before their stores: through
// generic pointers they compiled to generic loads each waited for before its store.
// kW: the store width, 8 (rows 8-byte aligned), 4 (S even) or 2 (odd S: see below).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
template <int kW>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::p_tile_copy(int p_buf, int64_t j0) {
  const int chunk = (lane % 16) / 2;
  const uint32_t block = smem_u32(p_tile + (p_buf * (kBN / 64) + lane / 16) * 64 * 64 + warp * 64 + (lane % 2) * 4);
  // (two scalars, not an array: indexed at run time below, an array went to the stack)
  const uint32_t from_even = block + (chunk ^ warp) * 16, from_odd = block + (chunk ^ warp ^ 4) * 16;
  const int64_t first = i0 + cw * 64 + warp;  // this warp's first row
  const int rows = static_cast<int>(first >= p.L ? 0 : (p.L - first + 3) / 4);  // rows w + 4 k below L
  const int64_t key = j0 + lane * 4;
  if (key >= p.S) return;
  const int in = static_cast<int>(p.S - key < 4 ? p.S - key : 4);  // keys of the piece below S: 4 with 8-byte stores
  char* to = reinterpret_cast<char*>(P + first * p.probs.row + key);
  const int64_t step = 4 * p.probs.row * static_cast<int64_t>(sizeof(T));
  // Odd S: the warp's rows are 4 apart (the step a multiple of 8 bytes) and its keys start at
  // an even key, so all its pieces share one alignment: 4-byte pairs where the rows are 4-byte
  // aligned, else a 2-byte head, one pair and a 2-byte tail. (Four 2-byte stores a piece were
  // about a third slower.)
  const bool shifted = kW == 2 && (reinterpret_cast<uintptr_t>(to) & 2) != 0;
  auto put = [&](uint2 w) {
    if constexpr (kW == 8) {
      *reinterpret_cast<uint2*>(to) = w;
    } else if constexpr (kW == 4) {  // S even: in is 2 or 4
      reinterpret_cast<uint32_t*>(to)[0] = w.x;
      if (in == 4) reinterpret_cast<uint32_t*>(to)[1] = w.y;
    } else if (!shifted) {  // odd S, this warp's rows 4-byte aligned: pairs, a last key alone
      uint16_t* h = reinterpret_cast<uint16_t*>(to);
      if (in >= 2) reinterpret_cast<uint32_t*>(to)[0] = w.x;
      else h[0] = static_cast<uint16_t>(w.x);
      if (in == 4) reinterpret_cast<uint32_t*>(to)[1] = w.y;
      else if (in == 3) h[2] = static_cast<uint16_t>(w.y);
    } else {  // odd S, rows 2 bytes past 4-byte alignment: key 0 alone, keys 1-2 as a pair, key 3
      uint16_t* h = reinterpret_cast<uint16_t*>(to);
      h[0] = static_cast<uint16_t>(w.x);
      if (in >= 3) *reinterpret_cast<uint32_t*>(h + 1) = __funnelshift_r(w.x, w.y, 16);
      else if (in == 2) h[1] = static_cast<uint16_t>(w.x >> 16);
      if (in == 4) h[3] = static_cast<uint16_t>(w.y >> 16);
    }
    to += step;
  };
  if (rows >= 16) {  // all 16 of the warp's rows (every row block but a last partial one)
#pragma unroll
    for (int k0 = 0; k0 < 16; k0 += 4) {
      uint2 w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) w[k] = lds64((k & 1 ? from_odd : from_even) + (k0 + k) * 4 * 64 * 2);  // 4 rows a step
#pragma unroll
      for (int k = 0; k < 4; ++k) put(w[k]);
    }
  } else {
    for (int k = 0; k < rows; ++k) put(lds64((k & 1 ? from_odd : from_even) + k * 4 * 64 * 2));
  }
}

template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::p_tile_copy_out(int p_buf, int64_t j0) {
  if (a.p_vec4)
    p_tile_copy<8>(p_buf, j0);
  else if (a.p_vec2)
    p_tile_copy<4>(p_buf, j0);
  else
    p_tile_copy<2>(p_buf, j0);
}

// The staged tile on its way out: by one thread's TMA stores, or (P_COPY) the warpgroup copies
// it out after issuing its next products.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::p_tile_out(int p_buf, int64_t j0) {
  FWD_STAMP(trace::kP2PStaged);
  if constexpr (P_COPY) {
    named_barrier(p_bar, 128);
  } else {
    fence_proxy_async();
    named_barrier(p_bar, 128);
    if (p_leader) {
#pragma unroll
      for (int b = 0; b < kBN / 64; ++b)
        tma_store_5d(&tm_p, p_tile + (p_buf * (kBN / 64) + b) * 64 * 64, static_cast<int>(j0) + b * 64,
                     static_cast<int>(i0) + cw * 64, cp[0], cp[1], cp[2]);
      bulk_commit();
    }
  }
}

// O = (u V) / l, two columns a store.
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::store_o() {
  T* O = reinterpret_cast<T*>(p.out.data) + lead_off(p, p.out, lead);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row_ok[r]) continue;
    T* o_row = O + row[r] * p.out.row;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + 2 * t;
      if (col < p.Ev)
        *reinterpret_cast<uint32_t*>(o_row + col) = pack2<T>(o[4 * n + 2 * r] * inv_l[r], o[4 * n + 2 * r + 1] * inv_l[r]);
    }
  }
}

// Causal, or the trailing tiles a bool mask hides: the keys right of the last tile are hidden
// from every row of the CTA: zeros, 16 bytes a store where rows allow; NaN in a NaN row
// (prob_of_hidden_key: the math op's softmax of a NaN row is NaN at its hidden keys too). Each
// row's flag comes from the quad that holds it (finish_rows).
template <typename T, int D, MaskKind MASK, bool STATS, bool P_COPY>
SDPA_MATH_D void Consumer<T, D, MASK, STATS, P_COPY>::fill_tail() {
  const int64_t z0 = static_cast<int64_t>(n_tiles) * kBN;
  if (z0 < p.S) {
    named_barrier(barrier_id(NamedBarrier::kTailFill), 256);  // the consumers' row_is_nan writes before their reads
    const int64_t rows = (p.L - i0 < kBM ? p.L - i0 : kBM);
    const int ct = threadIdx.x - 128;
    const uint32_t nan2 = pack2<T>(NAN, NAN);
    if (a.p_vec8) {
      const int64_t chunks = (p.S - z0) / 8;
      for (int64_t idx = ct; idx < rows * chunks; idx += 256) {
        const int64_t r = idx / chunks, c = z0 + (idx % chunks) * 8;
        const uint32_t v = sm.row_is_nan[r] ? nan2 : 0u;
        *reinterpret_cast<uint4*>(P + (i0 + r) * p.probs.row + c) = make_uint4(v, v, v, v);
      }
    } else {
      const int64_t cols = p.S - z0;
      for (int64_t idx = ct; idx < rows * cols; idx += 256) {
        const int64_t r = idx / cols, c = z0 + idx % cols;
        P[(i0 + r) * p.probs.row + c] = from_float<T>(sm.row_is_nan[r] ? NAN : 0.0f);
      }
    }
  }
}

}  // namespace sdpa_math::cuda::sm90::fwd
