// The fp32 path (gemm_path.cuh): cuBLAS products and two row kernels.
//
// Row-major matrices are handed to cuBLAS (column-major) as their transposes: C = A B becomes
// C^T = B^T A^T, so each call below names the row-major product it computes.
#include "gemm_path.cuh"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "launch.cuh"

namespace sdpa_math::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per query row
constexpr unsigned kFullWarp = 0xffffffffu;

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(ErrorCode::CudaFailure, std::string(what) + ": " + cublasGetStatusString(status));
}

// cuBLAS handles (not thread-safe): a thread holds one per device while it lives, bound to the
// call's stream and set to no workspace on each call (one handle used on different streams would
// otherwise share its workspace across them). When the thread ends its handles go back to a process-wide pool,
// and the next thread takes them from there, so threads that come and go (a thread pool
// resized, one thread per request) reuse handles instead of leaking one each. Handles are never
// destroyed: at process exit the CUDA runtime may be gone before a destructor runs.
class HandlePool {
 public:
  static HandlePool& instance() {
    static HandlePool* pool = new HandlePool;  // never destroyed, see above
    return *pool;
  }
  cublasHandle_t take(int device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (static_cast<int>(free_.size()) > device && !free_[device].empty()) {
        cublasHandle_t h = free_[device].back();
        free_[device].pop_back();
        return h;
      }
    }
    cublasHandle_t h = nullptr;
    check_cublas(cublasCreate(&h), "creating a cuBLAS handle");
    created_.fetch_add(1);
    return h;
  }
  void give_back(int device, cublasHandle_t h) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (static_cast<int>(free_.size()) <= device) free_.resize(device + 1);
    free_[device].push_back(h);
  }
  int64_t created() const { return created_.load(); }

 private:
  std::mutex mutex_;
  std::vector<std::vector<cublasHandle_t>> free_;  // by device
  std::atomic<int64_t> created_{0};
};

// A thread's handles, by device, returned to the pool when the thread ends.
struct ThreadHandles {
  std::vector<cublasHandle_t> by_device;
  ~ThreadHandles() {
    for (size_t d = 0; d < by_device.size(); ++d)
      if (by_device[d]) HandlePool::instance().give_back(static_cast<int>(d), by_device[d]);
  }
};

cublasHandle_t handle_on(cudaStream_t stream) {
  thread_local ThreadHandles mine;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (static_cast<int>(mine.by_device.size()) <= device) mine.by_device.resize(device + 1, nullptr);
  if (!mine.by_device[device]) mine.by_device[device] = HandlePool::instance().take(device);
  check_cublas(cublasSetStream(mine.by_device[device], stream), "binding the cuBLAS handle to the stream");
  // cublasSetStream gives the handle cuBLAS's default workspace back every time: take it away
  // again after each one (as PyTorch does), or calls on different streams would share it.
  check_cublas(cublasSetWorkspace(mine.by_device[device], nullptr, 0), "setting the cuBLAS workspace");
  return mine.by_device[device];
}

// A matrix operand as the batched products read it: the stride between batches and the leading
// dimension, in elements; batch < 0 when cuBLAS cannot read it.
struct Mat {
  const float* data = nullptr;
  int64_t ld = 0, batch = -1;
};

// The batched products' view of the problem: `batches` key heads, each with `rows` = G L query
// rows (the G query heads that read it, one after another).
struct Layout {
  int64_t group = 1, batches = 0, rows = 0;
  Mat q, k, v, out, probs, grad_out;
};

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

__host__ __device__ const float* fp32(const DevOperand& op) { return reinterpret_cast<const float*>(op.data); }

// The stride between consecutive heads of `op` when its offset is that stride times the lead
// index divided by `group` for every lead index (one stride on the flattened heads), else -1.
int64_t head_stride(const DevProblem& p, const DevOperand& op, int64_t group) {
  const int64_t stride = p.num_lead / group > 1 ? lead_off(p, op, group) : 0;
  int64_t unit = 1;  // the lead index of one step along dim d
  for (int d = p.lead_ndim - 1; d >= 0; --d) {
    const bool last = d == p.lead_ndim - 1;
    const int64_t extent = last ? p.lead_shape[d] / group : p.lead_shape[d];
    if (extent > 1 && op.lead[d] != (last ? stride : unit / group * stride)) return -1;
    unit *= p.lead_shape[d];
  }
  return stride;
}

// fp32 rows of `width` elements with unit column stride (any stride when width is 1).
bool fp32_rows(const DevOperand& op, int64_t width) {
  return op.data != nullptr && op.dtype == DType::Float32 && (op.col == 1 || width == 1);
}

// A query-side operand (Q, O, P, dO: L rows per head) with each key head's G query heads
// stacked into one matrix of G L rows. With one row per head its row stride means nothing (the
// core may give 0): the stacked heads are then the rows.
Mat query_side(const DevProblem& p, const DevOperand& op, int64_t group, int64_t width) {
  if (!fp32_rows(op, width)) return {};
  const int64_t head = head_stride(p, op, 1);
  const int64_t ld = p.L == 1 ? (group > 1 ? head : width) : op.row;
  if (head < 0 || ld < width || ld > kIntMax || (group > 1 && head != p.L * ld)) return {};
  return {fp32(op), ld, head * group};
}

// A key-side operand (K, V: S rows per key head).
Mat key_side(const DevProblem& p, const DevOperand& op, int64_t group, int64_t width) {
  if (!fp32_rows(op, width)) return {};
  const int64_t head = head_stride(p, op, group);
  const int64_t ld = p.S == 1 ? width : op.row;
  if (head < 0 || ld < width || ld > kIntMax) return {};
  return {fp32(op), ld, head};
}

// Q, K, V and P (and O when `with_out`) as batched matrices.
bool layout_of(const DevProblem& p, bool with_out, Layout& lay) {
  if (p.num_lead * p.L == 0 || p.S == 0 || p.E == 0 || p.Ev == 0) return false;
  lay.group = p.k.head_group;
  if (p.v.head_group != lay.group || p.num_lead % lay.group != 0) return false;
  lay.batches = p.num_lead / lay.group;
  lay.rows = lay.group * p.L;
  if (lay.rows > kIntMax || p.S > kIntMax || p.E > kIntMax || p.Ev > kIntMax || lay.batches > kIntMax) return false;
  lay.q = query_side(p, p.q, lay.group, p.E);
  lay.probs = query_side(p, p.probs, lay.group, p.S);
  lay.out = with_out ? query_side(p, p.out, lay.group, p.Ev) : Mat{nullptr, 0, 0};
  lay.k = key_side(p, p.k, lay.group, p.E);
  lay.v = key_side(p, p.v, lay.group, p.Ev);
  return lay.q.batch >= 0 && lay.probs.batch >= 0 && lay.out.batch >= 0 && lay.k.batch >= 0 && lay.v.batch >= 0;
}

// C = alpha op(A) op(B) for every batch, all row-major: the column-major call computes
// C^T = op(B)^T op(A)^T. m x n is C's shape, k the inner size; a_t (b_t): A (B) is stored
// transposed, i.e. the product reads it as its transpose.
void batched(cublasHandle_t h, int64_t m, int64_t n, int64_t k, float alpha, Mat A, bool a_t, Mat B, bool b_t,
             float* C, int64_t ldc, int64_t c_stride, int64_t batches, const char* what) {
  const float zero = 0.0f;
  check_cublas(cublasSgemmStridedBatched(h, b_t ? CUBLAS_OP_T : CUBLAS_OP_N, a_t ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha,
                                         B.data, static_cast<int>(B.ld), B.batch, A.data,
                                         static_cast<int>(A.ld), A.batch, &zero, C, static_cast<int>(ldc),
                                         c_stride, static_cast<int>(batches)),
               what);
}

// The row's (max, sum of exp) from every lane's, the same on every lane (lane 0's combination:
// the butterfly's order differs between lanes and so could its rounding).
__device__ void warp_lse(float& m, float& l) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(kFullWarp, m, offset), l2 = __shfl_xor_sync(kFullWarp, l, offset);
    lse_combine<float>(m, l, m2, l2);
  }
  m = __shfl_sync(kFullWarp, m, 0);
  l = __shfl_sync(kFullWarp, l, 0);
}

__device__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullWarp, x, offset);
  return __shfl_sync(kFullWarp, x, 0);
}

// Row (lead, i) of P holds q_i . k_j; it becomes the probabilities the contract returns (mask,
// causal, softmax, dropout), and lse is stored. Two reads of the row and one write.
__global__ void __launch_bounds__(32 * kRowsPerBlock) softmax_rows(DevProblem p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.num_lead * p.L) return;
  const int lane = threadIdx.x % 32;
  const int64_t lead = row / p.L, i = row % p.L;
  float* scores = reinterpret_cast<float*>(p.probs.data) + lead_off(p, p.probs, lead) + i * p.probs.row;
  const int64_t m_at = p.mask.data ? lead_off(p, p.mask, lead) : 0;
  const int64_t d_at = p.dmask.data ? lead_off(p, p.dmask, lead) : 0;
  const int64_t visible = p.causal ? (i + 1 < p.S ? i + 1 : p.S) : p.S;
  float m = neg_inf<float>(), l = 0.0f;
  for (int64_t j = lane; j < visible; j += 32) lse_combine<float>(m, l, masked_logit<float>(p, scores[j], m_at, i, j), 1.0f);
  warp_lse(m, l);
  for (int64_t j = lane; j < p.S; j += 32) {
    float prob = prob_of_hidden_key<float>(l);
    if (j < visible)
      prob = returned_prob<float>(p, prob_from_max_sum<float>(masked_logit<float>(p, scores[j], m_at, i, j), m, l),
                                  keep_of<float>(p, d_at, lead, i, j));
    scores[j] = prob;
  }
  if (lane == 0)
    store_elem<float>(p.lse.dtype, p.lse.data, lead_off(p, p.lse, lead) + i * p.lse.row, lse_from_max_sum<float>(m, l));
}

// Without dropout: row (lead, i) of `d` (L S per head, packed) holds dO_i . v_j; it becomes
// dS = A (dA - rowsum(A dA)) with A the saved P and dA = dO V^T + dP (contract §11).
__global__ void __launch_bounds__(32 * kRowsPerBlock) softmax_grad_rows(DevProblem p, float* d) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.num_lead * p.L) return;
  const int lane = threadIdx.x % 32;
  const int64_t lead = row / p.L, i = row % p.L;
  const float* a = fp32(p.probs) + lead_off(p, p.probs, lead) + i * p.probs.row;
  float* ds = d + row * p.S;
  const int64_t gp_at = p.grad_probs.data ? lead_off(p, p.grad_probs, lead) + i * p.grad_probs.row : 0;
  auto grad_a = [&](int64_t j) {
    const float dp = p.grad_probs.data ? load_elem<float>(p.grad_probs.dtype, p.grad_probs.data, gp_at + j * p.grad_probs.col)
                                       : 0.0f;
    return grad_softmax<float>(p, ds[j], dp, 1.0f);
  };
  float delta = 0.0f;
  for (int64_t j = lane; j < p.S; j += 32) delta += a[j] * grad_a(j);
  delta = warp_sum(delta);
  for (int64_t j = lane; j < p.S; j += 32) ds[j] = a[j] * (grad_a(j) - delta);
}

unsigned row_blocks(const DevProblem& p) {
  return grid_x((p.num_lead * p.L + kRowsPerBlock - 1) / kRowsPerBlock, "fp32 softmax rows");
}

// A requested gradient the products can write outright: fp32, contiguous, one row per (head,
// row) of its operand (no broadcast beyond GQA's, which the stacked batches sum).
bool writable(const std::optional<TensorView>& g, const core::Operand& op, int64_t rows_per_batch, int64_t width,
              int64_t batches) {
  return !g || (g->dtype == DType::Float32 && g->is_contiguous() &&
                op.own_shape.numel() == batches * rows_per_batch * width);
}

}  // namespace

namespace {
constexpr const char* kLayoutDecline =
    "not float32 q, k, v, O and P with unit column stride and heads evenly spaced in memory";

// The plan asked gemm_*_declines first; a layout refused here is a fault of this file.
void check_planned(bool ok) {
  if (!ok) throw Error(ErrorCode::CudaFailure, "the fp32 cuBLAS path ran on a problem it declines");
}

// The layout and why the backward does not take the problem (nullptr: it does).
const char* backward_layout(const core::Problem& cp, const DevProblem& p, const BackwardOutputs& out, Layout& lay) {
  // With dropout A is not the saved P (it has zeros where A has none): the generic path
  // recomputes it. A mask's gradient is the generic path's too.
  if (p.dropout != Dropout::None) return "dropout";
  if (out.grad_attn_mask) return "a mask gradient is asked for";
  if (p.probs.data == nullptr) return "no saved P";
  if (!layout_of(p, false, lay)) return kLayoutDecline;
  if (p.grad_out.data && (lay.grad_out = query_side(p, p.grad_out, lay.group, p.Ev)).batch < 0)
    return "dO's heads not evenly spaced in memory";
  if (!writable(out.grad_query, cp.query, lay.rows, p.E, lay.batches) ||
      !writable(out.grad_key, cp.key, p.S, p.E, lay.batches) || !writable(out.grad_value, cp.value, p.S, p.Ev, lay.batches))
    return "a requested gradient not float32, contiguous and of its input's own heads";
  return nullptr;
}
}  // namespace

const char* gemm_forward_declines(const DevProblem& p) {
  Layout lay;
  return layout_of(p, true, lay) ? nullptr : kLayoutDecline;
}

const char* gemm_backward_declines(const core::Problem& cp, const DevProblem& p, const BackwardOutputs& out) {
  Layout lay;
  return backward_layout(cp, p, out, lay);
}

void gemm_forward(const DevProblem& p, cudaStream_t stream) {
  Layout lay;
  check_planned(layout_of(p, true, lay));
  const unsigned rows_grid = row_blocks(p);  // refused before cuBLAS writes into P
  cublasHandle_t h = handle_on(stream);
  float* probs = reinterpret_cast<float*>(p.probs.data);
  // P <- Q K^T (raw dot products: the row kernel applies the scale, as every path does).
  batched(h, lay.rows, p.S, p.E, 1.0f, lay.q, false, lay.k, true, probs, lay.probs.ld, lay.probs.batch, lay.batches,
          "cuBLAS Q K^T");
  softmax_rows<<<rows_grid, 32 * kRowsPerBlock, 0, stream>>>(p);
  check_launch("fp32 softmax rows");
  // O = P V (times c for an explicit dropout mask: output_factor).
  batched(h, lay.rows, p.Ev, p.S, output_factor<float>(p), lay.probs, false, lay.v, false,
          reinterpret_cast<float*>(p.out.data), lay.out.ld, lay.out.batch, lay.batches, "cuBLAS P V");
}

void gemm_backward(const core::Problem& cp, const DevProblem& p, const BackwardOutputs& out,
                   const std::function<float*(int64_t)>& scratch, cudaStream_t stream) {
  Layout lay;
  check_planned(backward_layout(cp, p, out, lay) == nullptr);
  const bool has_dO = p.grad_out.data != nullptr;

  cublasHandle_t h = handle_on(stream);
  const int64_t d_stride = lay.rows * p.S;
  float* d = scratch(p.num_lead * p.L * p.S);
  // D <- dO V^T, then dS in place.
  if (has_dO) batched(h, lay.rows, p.S, p.Ev, 1.0f, lay.grad_out, false, lay.v, true, d, p.S, d_stride, lay.batches, "cuBLAS dO V^T");
  else check_cuda(cudaMemsetAsync(d, 0, sizeof(float) * p.num_lead * p.L * p.S, stream), "clearing dA");
  softmax_grad_rows<<<row_blocks(p), 32 * kRowsPerBlock, 0, stream>>>(p, d);
  check_launch("fp32 softmax gradient rows");
  const Mat dS{d, p.S, d_stride};
  const float scale = static_cast<float>(p.scale);
  if (out.grad_query)  // dQ = scale dS K
    batched(h, lay.rows, p.E, p.S, scale, dS, false, lay.k, false, static_cast<float*>(out.grad_query->data), p.E,
            lay.rows * p.E, lay.batches, "cuBLAS dS K");
  if (out.grad_key)  // dK = scale dS^T Q, summed over the batch's G query heads
    batched(h, p.S, p.E, lay.rows, scale, dS, true, lay.q, false, static_cast<float*>(out.grad_key->data), p.E, p.S * p.E,
            lay.batches, "cuBLAS dS^T Q");
  if (out.grad_value) {  // dV = P^T dO
    float* dv = static_cast<float*>(out.grad_value->data);
    if (has_dO)
      batched(h, p.S, p.Ev, lay.rows, 1.0f, lay.probs, true, lay.grad_out, false, dv, p.Ev, p.S * p.Ev, lay.batches,
              "cuBLAS P^T dO");
    else check_cuda(cudaMemsetAsync(dv, 0, sizeof(float) * out.grad_value->numel(), stream), "clearing dV");
  }
}

int64_t cublas_handles_created() { return HandlePool::instance().created(); }

}  // namespace sdpa_math::cuda
