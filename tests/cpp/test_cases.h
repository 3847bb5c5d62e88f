// The space of attention problems the tests draw from, and how one is built into tensors.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "test_util.h"

namespace sdpa_math::testing {

enum class MaskKind {
  None,
  FloatFull,            // float, the full (*batch, Hq, L, S) shape
  FloatKeyPadding,      // float, (*batch, 1, 1, S)
  FloatPerHead,         // float32, (Hq, 1, S): broadcast over batch and rows
  Float2D,              // float, (L, S)
  BoolFull,             // bool, full shape
  BoolKeyPadding,       // bool, (*batch, 1, 1, S), trailing keys masked out
  BoolFullyMaskedRows,  // bool, (L, S), every third row all False
  FloatNegInfRows,      // float, (L, S), some -inf, every third row all -inf
  FloatMinRows,         // float32, (L, S), every third row float32's lowest (not fully masked)
};
enum class DropoutKind { None, ExplicitBool, ExplicitFloat, Random };

struct Case {
  DType dtype = DType::Float32;
  std::vector<int64_t> batch;     // leading batch dims of query (and of key/value unless kv_batch)
  std::vector<int64_t> kv_batch;  // when set: key/value batch dims (broadcast against query's)
  int64_t hq = 2, hkv = 2;        // hq = 0: no head dim
  int64_t L = 7, S = 7, E = 8, Ev = 8;
  MaskKind mask = MaskKind::None;
  bool causal = false;
  DropoutKind dropout = DropoutKind::None;
  double dropout_p = 0.25;
  bool gqa = false;
  Layout layout = Layout::Contiguous;      // of query, key, value and masks
  Layout out_layout = Layout::Contiguous;  // of O and P
  std::optional<double> scale;
  uint64_t seed = 1;
  std::string name() const;
};

// gtest prints parameters with this: the case's name instead of its bytes.
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

struct Built {
  Tensor q, k, v, mask, dmask;
  ForwardArgs args;
};
Built build(const Case& c);

// The seeded forward cases (CPU against the reference) and backward cases.
std::vector<Case> forward_cases();
std::vector<Case> backward_cases();

}  // namespace sdpa_math::testing
