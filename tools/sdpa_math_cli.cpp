// sdpa_math_cli: runs one attention problem (a built-in default, or the sizes given) on the CPU
// backend and on the float64 reference, and reports the error of O, P and the gradients against
// the reference, and the time of each. Until the Python package exists this is the main job.
//
//   sdpa_math_cli [--batch B] [--heads H] [--kv-heads Hkv] [--L L] [--S S] [--E E]
//                 [--dtype f32|f16|bf16] [--causal] [--dropout P] [--threads N] [--repeat N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sdpa_math/attention.h"
#include "sdpa_math/half.h"

using namespace sdpa_math;

namespace {

struct Options {
  int64_t batch = 2, heads = 8, kv_heads = 8, L = 512, S = 512, E = 64;
  DType dtype = DType::Float32;
  bool causal = false;
  double dropout = 0.0;
  int threads = 0, repeat = 5;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "sdpa_math_cli: %s\nusage: sdpa_math_cli [--batch B] [--heads H] [--kv-heads Hkv] [--L L] [--S S] [--E E]\n"
               "                     [--dtype f32|f16|bf16] [--causal] [--dropout P] [--threads N] [--repeat N]\n",
               why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  bool kv_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    auto integer = [&]() {
      std::string v = value();
      char* end = nullptr;
      long long n = std::strtoll(v.c_str(), &end, 10);
      if (*end || n < 0) usage(("not a non-negative integer: " + a + " " + v).c_str());
      return static_cast<int64_t>(n);
    };
    if (a == "--batch") o.batch = integer();
    else if (a == "--heads") o.heads = integer();
    else if (a == "--kv-heads") { o.kv_heads = integer(); kv_given = true; }
    else if (a == "--L") o.L = integer();
    else if (a == "--S") o.S = integer();
    else if (a == "--E") o.E = integer();
    else if (a == "--threads") o.threads = static_cast<int>(integer());
    else if (a == "--repeat") o.repeat = std::max<int>(1, static_cast<int>(integer()));
    else if (a == "--causal") o.causal = true;
    else if (a == "--dropout") o.dropout = std::atof(value().c_str());
    else if (a == "--dtype") {
      std::string d = value();
      if (d == "f32") o.dtype = DType::Float32;
      else if (d == "f16") o.dtype = DType::Float16;
      else if (d == "bf16") o.dtype = DType::BFloat16;
      else usage(("unknown dtype " + d).c_str());
    } else if (a == "-h" || a == "--help") usage("help");
    else usage(("unknown argument " + a).c_str());
  }
  if (!kv_given) o.kv_heads = o.heads;
  return o;
}

struct Buffer {
  std::vector<unsigned char> bytes;
  TensorView view;
  Buffer(DType dtype, const Shape& shape) : bytes(std::max<int64_t>(shape.numel(), 1) * dtype_size(dtype)) {
    view = contiguous_view(bytes.data(), dtype, shape);
  }
  double at(int64_t n) const {
    switch (view.dtype) {
      case DType::Float64: return reinterpret_cast<const double*>(bytes.data())[n];
      case DType::Float32: return reinterpret_cast<const float*>(bytes.data())[n];
      case DType::Float16: return half_to_float(reinterpret_cast<const uint16_t*>(bytes.data())[n]);
      default: return bfloat16_to_float(reinterpret_cast<const uint16_t*>(bytes.data())[n]);
    }
  }
  void fill_normal(std::mt19937_64& rng) {
    std::normal_distribution<float> normal;
    for (int64_t n = 0; n < view.numel(); ++n) {
      float x = normal(rng);
      switch (view.dtype) {
        case DType::Float32: reinterpret_cast<float*>(bytes.data())[n] = x; break;
        case DType::Float16: reinterpret_cast<uint16_t*>(bytes.data())[n] = float_to_half(x); break;
        default: reinterpret_cast<uint16_t*>(bytes.data())[n] = float_to_bfloat16(x); break;
      }
    }
  }
};

double rel_error(const Buffer& x, const Buffer& ref) {
  double num = 0, den = 0;
  for (int64_t n = 0; n < ref.view.numel(); ++n) {
    const double d = x.at(n) - ref.at(n);
    num += d * d;
    den += ref.at(n) * ref.at(n);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

template <class Fn>
double median_ms(int repeat, Fn&& fn) {
  std::vector<double> t;
  for (int r = 0; r < repeat; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.threads > 0) set_cpu_threads(o.threads);
  std::mt19937_64 rng(2026);
  Buffer q(o.dtype, {o.batch, o.heads, o.L, o.E}), k(o.dtype, {o.batch, o.kv_heads, o.S, o.E}),
      v(o.dtype, {o.batch, o.kv_heads, o.S, o.E});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  ForwardArgs args;
  args.query = q.view;
  args.key = k.view;
  args.value = v.view;
  args.options.is_causal = o.causal;
  args.options.dropout_p = o.dropout;
  args.options.enable_gqa = o.kv_heads != o.heads;
  args.options.seed = 42;
  try {
    const ForwardShapes s = forward_shapes(args);
    Buffer o_cpu(o.dtype, s.output), p_cpu(o.dtype, s.attn_probs), l_cpu(DType::Float32, s.logsumexp);
    Buffer o_ref(DType::Float64, s.output), p_ref(DType::Float64, s.attn_probs), l_ref(DType::Float64, s.logsumexp);
    Buffer dO(o.dtype, s.output), dP(o.dtype, s.attn_probs);
    dO.fill_normal(rng);
    dP.fill_normal(rng);
    std::printf("sdpa_math: B=%lld Hq=%lld Hkv=%lld L=%lld S=%lld E=%lld dtype=%s causal=%d dropout=%g threads=%d\n",
                (long long)o.batch, (long long)o.heads, (long long)o.kv_heads, (long long)o.L, (long long)o.S,
                (long long)o.E, dtype_name(o.dtype), o.causal, o.dropout, cpu_threads());
    const double t_ref = median_ms(1, [&] { forward(Backend::Reference, args, {o_ref.view, p_ref.view, l_ref.view}); });
    const double t_cpu = median_ms(o.repeat, [&] { forward(Backend::Cpu, args, {o_cpu.view, p_cpu.view, l_cpu.view}); });
    std::printf("forward   cpu %9.3f ms   reference %9.3f ms   speedup %7.1fx   rel.err O %.2e  P %.2e\n", t_cpu, t_ref,
                t_ref / t_cpu, rel_error(o_cpu, o_ref), rel_error(p_cpu, p_ref));

    BackwardArgs b;
    b.forward = args;
    b.grad_output = dO.view;
    b.grad_probs = dP.view;
    Buffer gq(o.dtype, q.view.shape), gk(o.dtype, k.view.shape), gv(o.dtype, v.view.shape);
    Buffer rq(DType::Float64, q.view.shape), rk(DType::Float64, k.view.shape), rv(DType::Float64, v.view.shape);
    b.logsumexp = l_ref.view;
    const double tb_ref = median_ms(1, [&] { backward(Backend::Reference, b, {rq.view, rk.view, rv.view, std::nullopt}); });
    b.logsumexp = l_cpu.view;
    const double tb_cpu = median_ms(o.repeat, [&] { backward(Backend::Cpu, b, {gq.view, gk.view, gv.view, std::nullopt}); });
    std::printf("backward  cpu %9.3f ms   reference %9.3f ms   speedup %7.1fx   rel.err dQ %.2e dK %.2e dV %.2e\n", tb_cpu,
                tb_ref, tb_ref / tb_cpu, rel_error(gq, rq), rel_error(gk, rk), rel_error(gv, rv));
  } catch (const Error& e) {
    std::fprintf(stderr, "sdpa_math_cli: %s: %s\n", error_code_name(e.code()), e.what());
    return 1;
  }
  return 0;
}
