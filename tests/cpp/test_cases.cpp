#include "test_cases.h"

#include <cmath>
#include <limits>
#include <sstream>

namespace sdpa_math::testing {
namespace {

const char* dtype_tag(DType d) {
  switch (d) {
    case DType::Float16: return "f16";
    case DType::BFloat16: return "bf16";
    case DType::Float32: return "f32";
    default: return "f64";
  }
}
const char* mask_tag(MaskKind m) {
  switch (m) {
    case MaskKind::None: return "";
    case MaskKind::FloatFull: return "_mfloat";
    case MaskKind::FloatKeyPadding: return "_mfloatpad";
    case MaskKind::FloatPerHead: return "_mfloathead";
    case MaskKind::Float2D: return "_mfloat2d";
    case MaskKind::BoolFull: return "_mbool";
    case MaskKind::BoolKeyPadding: return "_mboolpad";
    case MaskKind::BoolFullyMaskedRows: return "_mboolrows";
    case MaskKind::FloatNegInfRows: return "_mneginf";
    case MaskKind::FloatMinRows: return "_mfmin";
  }
  return "";
}
const char* dropout_tag(DropoutKind d) {
  switch (d) {
    case DropoutKind::None: return "";
    case DropoutKind::ExplicitBool: return "_dmask";
    case DropoutKind::ExplicitFloat: return "_dmaskf";
    case DropoutKind::Random: return "_drandom";
  }
  return "";
}

std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

std::string Case::name() const {
  std::ostringstream s;
  s << dtype_tag(dtype) << "_b";
  for (size_t i = 0; i < batch.size(); ++i) s << (i ? "x" : "") << batch[i];
  if (!kv_batch.empty()) {
    s << "_kvb";
    for (size_t i = 0; i < kv_batch.size(); ++i) s << (i ? "x" : "") << kv_batch[i];
  }
  s << "_h" << hq;
  if (hkv != hq) s << "kv" << hkv;
  s << "_L" << L << "_S" << S << "_E" << E;
  if (Ev != E) s << "_Ev" << Ev;
  s << mask_tag(mask) << (causal ? "_causal" : "") << dropout_tag(dropout) << (gqa ? "_gqa" : "");
  if (layout != Layout::Contiguous) s << "_" << layout_name(layout);
  if (out_layout != Layout::Contiguous) s << "_out" << layout_name(out_layout);
  if (scale) s << "_scaled";
  s << "_s" << seed;
  return s.str();
}

Built build(const Case& c) {
  std::mt19937_64 rng(c.seed * 7919 + 17);
  Built b;
  std::vector<int64_t> qh = c.hq > 0 ? std::vector<int64_t>{c.hq} : std::vector<int64_t>{};
  std::vector<int64_t> kh = c.hq > 0 ? std::vector<int64_t>{c.hkv} : std::vector<int64_t>{};
  const std::vector<int64_t>& kvb = c.kv_batch.empty() ? c.batch : c.kv_batch;
  b.q = random_tensor(rng, c.dtype, make_shape(concat(concat(c.batch, qh), {c.L, c.E})), c.layout);
  b.k = random_tensor(rng, c.dtype, make_shape(concat(concat(kvb, kh), {c.S, c.E})), c.layout);
  b.v = random_tensor(rng, c.dtype, make_shape(concat(concat(kvb, kh), {c.S, c.Ev})), c.layout);
  b.args.query = b.q.view;
  b.args.key = b.k.view;
  b.args.value = b.v.view;
  // The broadcast batch dims, for masks of the full shape.
  std::vector<int64_t> bb = c.batch.size() >= kvb.size() ? c.batch : kvb;
  for (size_t d = 1; d <= std::min(c.batch.size(), kvb.size()); ++d)
    bb[bb.size() - d] = std::max(c.batch[c.batch.size() - d], kvb[kvb.size() - d]);
  const std::vector<int64_t> full = concat(concat(bb, qh), {c.L, c.S});
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);

  auto fill = [&](DType dtype, const std::vector<int64_t>& shape, auto&& value_at) {
    Tensor t = empty_tensor(dtype, make_shape(shape), c.layout);
    std::vector<double> vals(t.view.numel());
    const int64_t cols = shape.back(), rows = shape.size() >= 2 ? shape[shape.size() - 2] : 1;
    for (int64_t n = 0; n < static_cast<int64_t>(vals.size()); ++n) vals[n] = value_at((n / cols) % rows, n % cols);
    write(t.view, vals);
    return t;
  };
  const DType fdt = c.dtype;
  std::vector<int64_t> pad_shape = concat(concat(bb, c.hq > 0 ? std::vector<int64_t>{1} : std::vector<int64_t>{}), {1, c.S});
  bool has_mask = true;
  switch (c.mask) {
    case MaskKind::None: has_mask = false; break;
    case MaskKind::FloatFull: b.mask = fill(fdt, full, [&](int64_t, int64_t) { return normal(rng); }); break;
    case MaskKind::FloatKeyPadding:
      b.mask = fill(fdt, pad_shape, [&](int64_t, int64_t j) { return j + 2 > c.S ? -1e4 : normal(rng); });
      break;
    case MaskKind::FloatPerHead:
      b.mask = fill(DType::Float32, {std::max<int64_t>(c.hq, 1), 1, c.S}, [&](int64_t, int64_t) { return normal(rng); });
      break;
    case MaskKind::Float2D: b.mask = fill(fdt, {c.L, c.S}, [&](int64_t, int64_t) { return 2 * normal(rng); }); break;
    case MaskKind::BoolFull: b.mask = fill(DType::Bool, full, [&](int64_t, int64_t) { return uni(rng) < 0.7 ? 1.0 : 0.0; }); break;
    case MaskKind::BoolKeyPadding:
      b.mask = fill(DType::Bool, pad_shape, [&](int64_t, int64_t j) { return j < std::max<int64_t>(1, c.S - 3) ? 1.0 : 0.0; });
      break;
    case MaskKind::BoolFullyMaskedRows:
      b.mask = fill(DType::Bool, {c.L, c.S}, [&](int64_t i, int64_t) { return i % 3 == 1 ? 0.0 : (uni(rng) < 0.7 ? 1.0 : 0.0); });
      break;
    case MaskKind::FloatNegInfRows:
      b.mask = fill(fdt, {c.L, c.S}, [&](int64_t i, int64_t) { return i % 3 == 1 || uni(rng) < 0.2 ? neg_inf : normal(rng); });
      break;
    case MaskKind::FloatMinRows:
      b.mask = fill(DType::Float32, {c.L, c.S},
                    [&](int64_t i, int64_t) { return i % 3 == 1 ? static_cast<double>(std::numeric_limits<float>::lowest()) : normal(rng); });
      break;
  }
  if (has_mask) b.args.attn_mask = b.mask.view;
  switch (c.dropout) {
    case DropoutKind::None: break;
    case DropoutKind::ExplicitBool:
      b.dmask = fill(DType::Bool, full, [&](int64_t, int64_t) { return uni(rng) < 1 - c.dropout_p ? 1.0 : 0.0; });
      b.args.dropout_mask = b.dmask.view;
      break;
    case DropoutKind::ExplicitFloat:
      b.dmask = fill(fdt, {c.L, c.S}, [&](int64_t, int64_t) { return uni(rng) < 1 - c.dropout_p ? 1.0 : 0.0; });
      b.args.dropout_mask = b.dmask.view;
      break;
    case DropoutKind::Random: break;
  }
  AttentionOptions& o = b.args.options;
  o.dropout_p = c.dropout == DropoutKind::None ? 0.0 : c.dropout_p;
  o.is_causal = c.causal;
  o.enable_gqa = c.gqa;
  o.scale = c.scale;
  o.seed = 0x5eed0000ull + c.seed;
  o.offset = 4 * c.seed + 1;  // not a multiple of 4: exercises the Philox lane arithmetic
  return b;
}

std::vector<Case> forward_cases() {
  std::vector<Case> cases;
  const DType dtypes[3] = {DType::Float32, DType::Float16, DType::BFloat16};
  const int64_t head_dims[8] = {1, 8, 48, 64, 80, 96, 128, 256};
  uint64_t seed = 1;
  auto add = [&](Case c) {
    c.seed = seed++;
    cases.push_back(c);
  };
  for (DType dt : dtypes) {
    // Sequence lengths: L < S, L = S, L > S over {1, 7, 64, 100, 257, 1024}, head dims cycling.
    const int64_t LS[][2] = {{1, 1},   {1, 7},     {7, 1},    {7, 7},     {7, 64},   {64, 7},    {64, 64},
                             {64, 100}, {100, 64}, {100, 257}, {257, 100}, {257, 257}, {1, 1024}, {1024, 7},
                             {7, 1024}, {257, 1024}};
    int h = 0;
    for (auto& ls : LS) {
      Case c;
      c.dtype = dt;
      c.batch = {1};
      c.hq = c.hkv = ls[0] * ls[1] >= 64 * 1024 ? 1 : 2;
      c.L = ls[0];
      c.S = ls[1];
      c.E = c.Ev = head_dims[h++ % 8];
      if (c.L * c.S * c.E > 4'000'000) c.E = c.Ev = 64;
      add(c);
    }
    // Every head dim at one shape.
    for (int64_t e : head_dims) {
      Case c;
      c.dtype = dt;
      c.batch = {2};
      c.L = 33;
      c.S = 70;
      c.E = c.Ev = e;
      add(c);
    }
    // Masks.
    for (MaskKind m : {MaskKind::FloatFull, MaskKind::FloatKeyPadding, MaskKind::FloatPerHead, MaskKind::Float2D,
                       MaskKind::BoolFull, MaskKind::BoolKeyPadding, MaskKind::BoolFullyMaskedRows,
                       MaskKind::FloatNegInfRows, MaskKind::FloatMinRows}) {
      Case c;
      c.dtype = dt;
      c.batch = {2};
      c.hq = c.hkv = 3;
      c.L = 20;
      c.S = 45;
      c.E = c.Ev = 64;
      c.mask = m;
      add(c);
    }
    // Causal, top-left aligned, L < S, L = S, L > S (and a block-sized L).
    for (auto ls : std::vector<std::pair<int64_t, int64_t>>{{7, 64}, {64, 64}, {100, 7}, {257, 257}, {1, 100}, {130, 200}}) {
      Case c;
      c.dtype = dt;
      c.batch = {1};
      c.L = ls.first;
      c.S = ls.second;
      c.E = c.Ev = 64;
      c.causal = true;
      add(c);
    }
    // Dropout, both rules, with masks and causal.
    for (DropoutKind d : {DropoutKind::ExplicitBool, DropoutKind::ExplicitFloat, DropoutKind::Random}) {
      for (int variant = 0; variant < 3; ++variant) {
        Case c;
        c.dtype = dt;
        c.batch = {2};
        c.L = 37;
        c.S = 53;
        c.E = c.Ev = 48;
        c.dropout = d;
        if (variant == 1) c.mask = MaskKind::BoolFullyMaskedRows;
        if (variant == 2) c.causal = true;
        c.dropout_p = variant == 0 ? 0.1 : 0.5;
        add(c);
      }
    }
    // GQA ratios 1, 2, 4, 8, and a single key/value head broadcast without enable_gqa.
    for (int64_t ratio : {1, 2, 4, 8}) {
      Case c;
      c.dtype = dt;
      c.batch = {2};
      c.hq = 8;
      c.hkv = 8 / ratio;
      c.gqa = true;
      c.L = 19;
      c.S = 40;
      c.E = c.Ev = 64;
      if (ratio == 4) c.mask = MaskKind::BoolKeyPadding;
      add(c);
    }
    {
      Case c;
      c.dtype = dt;
      c.batch = {2};
      c.hq = 4;
      c.hkv = 1;
      c.L = 9;
      c.S = 31;
      c.E = c.Ev = 32;
      add(c);
    }
    // Batch dims: none (3-D), none and no heads (2-D), one, two, and broadcast between q and k/v.
    for (int variant = 0; variant < 5; ++variant) {
      Case c;
      c.dtype = dt;
      c.L = 11;
      c.S = 23;
      c.E = c.Ev = 16;
      if (variant == 0) c.batch = {};
      if (variant == 1) { c.batch = {}; c.hq = c.hkv = 0; }
      if (variant == 2) c.batch = {3};
      if (variant == 3) { c.batch = {2, 3}; c.mask = MaskKind::FloatKeyPadding; }
      if (variant == 4) { c.batch = {1, 3}; c.kv_batch = {2, 1}; c.mask = MaskKind::BoolFull; }
      add(c);
    }
    // Non-contiguous inputs and outputs.
    for (Layout in : {Layout::Transposed, Layout::Sliced, Layout::HeadsMiddle}) {
      Case c;
      c.dtype = dt;
      c.batch = {2};
      c.hq = c.hkv = 3;
      c.L = 17;
      c.S = 29;
      c.E = c.Ev = 24;
      c.layout = in;
      c.out_layout = in == Layout::Sliced ? Layout::Sliced : Layout::HeadsMiddle;
      c.mask = MaskKind::FloatFull;
      c.dropout = in == Layout::Transposed ? DropoutKind::ExplicitBool : DropoutKind::None;
      add(c);
    }
    // Ev != E, and an explicit (negative) scale.
    for (auto e : std::vector<std::pair<int64_t, int64_t>>{{64, 32}, {32, 128}, {80, 8}}) {
      Case c;
      c.dtype = dt;
      c.batch = {2};
      c.L = 21;
      c.S = 66;
      c.E = e.first;
      c.Ev = e.second;
      add(c);
    }
    {
      Case c;
      c.dtype = dt;
      c.batch = {1};
      c.L = 12;
      c.S = 12;
      c.E = c.Ev = 16;
      c.scale = -0.3;
      add(c);
    }
  }
  return cases;
}

std::vector<Case> backward_cases() {
  std::vector<Case> cases;
  uint64_t seed = 1000;
  auto add = [&](Case c) {
    c.seed = seed++;
    cases.push_back(c);
  };
  for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
    Case base;
    base.dtype = dt;
    base.batch = {2};
    base.hq = base.hkv = 2;
    base.L = 23;
    base.S = 41;
    base.E = base.Ev = 32;
    add(base);
    Case c = base;
    c.mask = MaskKind::FloatKeyPadding;
    add(c);
    c = base;
    c.mask = MaskKind::FloatFull;
    add(c);
    c = base;
    c.mask = MaskKind::BoolFullyMaskedRows;
    add(c);
    c = base;
    c.causal = true;
    c.L = 70;
    c.S = 50;
    add(c);
    c = base;
    c.hq = 8;
    c.hkv = 2;
    c.gqa = true;
    add(c);
    c = base;
    c.dropout = DropoutKind::ExplicitBool;
    c.mask = MaskKind::Float2D;
    add(c);
    c = base;
    c.dropout = DropoutKind::Random;
    c.causal = true;
    add(c);
    c = base;
    c.batch = {1, 3};
    c.kv_batch = {2, 1};
    c.layout = Layout::Transposed;
    c.E = 48;
    c.Ev = 16;
    add(c);
    c = base;
    c.L = 130;
    c.S = 300;
    c.E = c.Ev = 64;
    c.mask = MaskKind::FloatPerHead;
    add(c);  // several row blocks per head, heads enough for a thread to take whole heads
    c.batch = {1};
    c.hq = c.hkv = 1;
    add(c);  // one head of several row blocks: threads share it and add dK, dV under the lock
  }
  return cases;
}

}  // namespace sdpa_math::testing
