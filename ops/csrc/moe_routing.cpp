// The MoE layer's routing, gather and combine on the CPU: the compiled implementation of the
// torch.ops.ds_optimus routing ops (ops/routing.py states what each computes; its plain PyTorch
// functions of the same names are the reference these agree with).
//
// Every function is one pass over its rows, split over threads by rows (at::parallel_for), with the
// inner loops over the hidden dimension written so that the compiler vectorises them. Sums visit
// their terms in a fixed order and are accumulated in float32 (float64 for float64 data), so
// results do not depend on the thread count. Built with -ffp-contract=off: a multiply and an add
// round separately, as they do in the reference.

// The ATen pieces used and pybind11's tensor casters, not <torch/extension.h> (all of libtorch's C++
// API): the build takes half the time, once per environment and at every install.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

// A new output tensor. Large ones are fresh pages from the kernel each time (glibc maps blocks of more
// than 32 MiB anew on every allocation), and faulting in 4 KiB pages costs more than the kernels'
// own work: where transparent huge pages are allowed on request ("madvise", the usual setting), ask
// for them, which makes the first touch several times cheaper. A hint only: ignored where refused.
at::Tensor fresh(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t end = begin + out.nbytes();
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (out.nbytes() >= (size_t(8) << 20) && last > first) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return out;
}

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

// Half types to and from float. bfloat16 is the upper half of a float32: widening is a shift, and
// narrowing rounds to nearest even as c10::BFloat16 does (NaN to the canonical quiet NaN), written
// without branches so that loops over it vectorise.
inline float widen(float v) { return v; }
inline double widen(double v) { return v; }
inline float widen(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float widen(at::Half v) { return static_cast<float>(v); }

template <typename T, typename A> inline T narrow(A v) { return static_cast<T>(v); }
template <> inline at::BFloat16 narrow<at::BFloat16, float>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  at::BFloat16 out;
  out.x = static_cast<uint16_t>(v != v ? 0x7FC0u : rounded);
  return out;
}

// Rows split over threads, about `bytes_per_task` of data each.
inline int64_t grain(int64_t row_bytes, int64_t bytes_per_task = 1 << 16) {
  return std::max<int64_t>(1, bytes_per_task / std::max<int64_t>(row_bytes, 1));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D CPU tensor");
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), name,
              " must be a contiguous int64 CPU tensor");
}

}  // namespace

// Counting sort of the slots by expert: per-chunk histograms, an exclusive prefix over (expert,
// chunk), then each chunk places its slots in order. Stable; no atomics on the positions.
std::tuple<at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& ids_in, int64_t num_experts) {
  TORCH_CHECK(ids_in.device().is_cpu() && !ids_in.is_floating_point(), "route: ids must be an integer CPU tensor");
  TORCH_CHECK(num_experts > 0, "route: num_experts must be positive");
  const at::Tensor ids = ids_in.reshape(-1).to(at::kLong).contiguous();
  const int64_t slots = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), slots / 4096));
  const int64_t per_chunk = (slots + chunks - 1) / chunks;
  std::vector<int64_t> hist(chunks * num_experts, 0);
  std::atomic<bool> bad{false};
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      int64_t* h = hist.data() + c * num_experts;
      for (int64_t i = c * per_chunk, end = std::min(slots, (c + 1) * per_chunk); i < end; ++i) {
        const int64_t e = id[i];
        if (e < 0 || e >= num_experts) { bad = true; continue; }
        ++h[e];
      }
    }
  });
  TORCH_CHECK(!bad, "route: an expert id is outside [0, ", num_experts, ")");
  at::Tensor counts = at::zeros({num_experts}, ids.options());
  int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> start(chunks * num_experts);
  int64_t position = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t before = position;
    for (int64_t c = 0; c < chunks; ++c) {
      start[c * num_experts + e] = position;
      position += hist[c * num_experts + e];
    }
    count[e] = position - before;
  }
  at::Tensor order = at::empty({slots}, ids.options());
  at::Tensor inverse = at::empty({slots}, ids.options());
  int64_t* ord = order.data_ptr<int64_t>();
  int64_t* inv = inverse.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      std::vector<int64_t> next(start.begin() + c * num_experts, start.begin() + (c + 1) * num_experts);
      for (int64_t i = c * per_chunk, end = std::min(slots, (c + 1) * per_chunk); i < end; ++i) {
        const int64_t p = next[id[i]]++;
        ord[p] = i;
        inv[i] = p;
      }
    }
  });
  return {order, inverse, counts};
}

namespace {

template <typename T, typename W>
void gather_rows(const T* x, const int64_t* index, const W* weight, T* out, int64_t rows, int64_t sources,
                 int64_t hidden, std::atomic<bool>& bad) {
  using A = typename Acc<T>::type;
  at::parallel_for(0, rows, grain(hidden * sizeof(T)), [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t r = index[p];
      if (r < 0 || r >= sources) { bad = true; continue; }
      const T* src = x + r * hidden;
      T* dst = out + p * hidden;
      if (weight == nullptr) {
        std::memcpy(dst, src, hidden * sizeof(T));
        continue;
      }
      const A w = static_cast<A>(widen(weight[p]));
      for (int64_t h = 0; h < hidden; ++h) dst[h] = narrow<T, A>(static_cast<A>(widen(src[h])) * w);
    }
  });
}

template <typename T, typename W>
void combine_rows(const T* src, const int64_t* table, const W* weight, T* out, int64_t rows, int64_t depth,
                  int64_t sources, int64_t hidden, std::atomic<bool>& bad) {
  using A = typename Acc<T>::type;
  at::parallel_for(0, rows, grain(depth * hidden * sizeof(T)), [&](int64_t first, int64_t last) {
    std::vector<A> acc(hidden);
    for (int64_t r = first; r < last; ++r) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t j = 0; j < depth; ++j) {
        const int64_t p = table[r * depth + j];
        if (p < 0) continue;
        if (p >= sources) { bad = true; continue; }
        const T* row = src + p * hidden;
        if (weight == nullptr) {
          for (int64_t h = 0; h < hidden; ++h) acc[h] += static_cast<A>(widen(row[h]));
        } else {
          const A w = static_cast<A>(widen(weight[p]));
          for (int64_t h = 0; h < hidden; ++h) acc[h] += static_cast<A>(widen(row[h])) * w;
        }
      }
      T* dst = out + r * hidden;
      for (int64_t h = 0; h < hidden; ++h) dst[h] = narrow<T, A>(acc[h]);
    }
  });
}

// A dot product in kLanes independent partial sums (which vectorise: a single running sum cannot be
// reordered without -ffast-math), added together in a fixed order at the end.
constexpr int64_t kLanes = 16;

template <typename T, typename A>
inline A dot(const T* a, const T* b, int64_t n) {
  A lanes[kLanes] = {};
  int64_t h = 0;
  for (; h + kLanes <= n; h += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<A>(widen(a[h + l])) * static_cast<A>(widen(b[h + l]));
  }
  A tail = 0;  // its own sum: indexing `lanes` with a variable here would keep it out of registers
  for (; h < n; ++h) tail += static_cast<A>(widen(a[h])) * static_cast<A>(widen(b[h]));
  A sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum + tail;
}

// One pass over the gathered gradient rows: the (weighted) rows and, when asked, their dot products
// with `src`'s rows (the routing weights' gradient).
template <typename T, typename W>
void combine_rows_backward(const T* grad, const T* src, const int64_t* row_of, const W* weight, T* out,
                           typename Acc<T>::type* dots, int64_t rows, int64_t sources, int64_t hidden,
                           std::atomic<bool>& bad) {
  using A = typename Acc<T>::type;
  at::parallel_for(0, rows, grain(2 * hidden * sizeof(T)), [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t r = row_of[p];
      if (r < 0 || r >= sources) { bad = true; continue; }
      const T* g = grad + r * hidden;
      T* dst = out + p * hidden;
      if (dots != nullptr) dots[p] = dot<T, A>(src + p * hidden, g, hidden);
      if (weight == nullptr) {
        std::memcpy(dst, g, hidden * sizeof(T));
      } else {
        const A w = static_cast<A>(widen(weight[p]));
        for (int64_t h = 0; h < hidden; ++h) dst[h] = narrow<T, A>(static_cast<A>(widen(g[h])) * w);
      }
    }
  });
}

// Calls f(T{}, W{}) with the data type of `data` and the weight type of `weight` (float when absent).
template <typename F>
void dispatch(const at::Tensor& data, const std::optional<at::Tensor>& weight, F&& f) {
  const at::ScalarType wt = weight.has_value() ? weight->scalar_type() : data.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, data.scalar_type(), "ds_optimus_routing", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, wt, "ds_optimus_routing", [&] { f(T{}, scalar_t{}); });
  });
}

template <typename W>
const W* weight_ptr(const std::optional<at::Tensor>& weight) {
  return weight.has_value() ? weight->data_ptr<W>() : nullptr;
}

std::optional<at::Tensor> contiguous_weight(const std::optional<at::Tensor>& weight, int64_t rows, const char* name) {
  if (!weight.has_value()) return weight;
  TORCH_CHECK(weight->device().is_cpu() && weight->dim() == 1 && weight->numel() == rows, name,
              ": weight must be a CPU tensor of ", rows, " elements");
  return weight->contiguous();
}

}  // namespace

at::Tensor gather(const at::Tensor& x, const at::Tensor& index, const std::optional<at::Tensor>& weight_in) {
  check_rows(x, "gather: x");
  check_index(index, "gather: index");
  const int64_t rows = index.numel(), hidden = x.size(1);
  const auto weight = contiguous_weight(weight_in, rows, "gather");
  at::Tensor out = fresh({rows, hidden}, x.options());
  std::atomic<bool> bad{false};
  dispatch(x, weight, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    gather_rows<T, W>(x.data_ptr<T>(), index.data_ptr<int64_t>(), weight_ptr<W>(weight), out.data_ptr<T>(), rows,
                      x.size(0), hidden, bad);
  });
  TORCH_CHECK(!bad, "gather: an index is outside [0, ", x.size(0), ")");
  return out;
}

at::Tensor combine(const at::Tensor& src, const at::Tensor& table, const std::optional<at::Tensor>& weight_in) {
  check_rows(src, "combine: src");
  TORCH_CHECK(table.dim() == 2, "combine: table must be 2-D");
  check_index(table, "combine: table");
  const int64_t rows = table.size(0), depth = table.size(1), hidden = src.size(1);
  const auto weight = contiguous_weight(weight_in, src.size(0), "combine");
  at::Tensor out = fresh({rows, hidden}, src.options());
  std::atomic<bool> bad{false};
  dispatch(src, weight, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    combine_rows<T, W>(src.data_ptr<T>(), table.data_ptr<int64_t>(), weight_ptr<W>(weight), out.data_ptr<T>(), rows,
                       depth, src.size(0), hidden, bad);
  });
  TORCH_CHECK(!bad, "combine: a table entry is outside [-1, ", src.size(0), ")");
  return out;
}

std::tuple<at::Tensor, at::Tensor> combine_backward(const at::Tensor& grad, const at::Tensor& src,
                                                    const at::Tensor& row_of,
                                                    const std::optional<at::Tensor>& weight_in,
                                                    bool need_weight_grad) {
  check_rows(grad, "combine_backward: grad");
  check_index(row_of, "combine_backward: row_of");
  const int64_t rows = row_of.numel(), hidden = grad.size(1);
  const auto weight = contiguous_weight(weight_in, rows, "combine_backward");
  const auto acc_type = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor out = fresh({rows, hidden}, grad.options());
  at::Tensor dots = at::empty({need_weight_grad ? rows : 0}, grad.options().dtype(acc_type));
  if (need_weight_grad) {
    check_rows(src, "combine_backward: src");
    TORCH_CHECK(src.size(0) == rows && src.size(1) == hidden && src.scalar_type() == grad.scalar_type(),
                "combine_backward: src must match the gathered rows");
  }
  std::atomic<bool> bad{false};
  dispatch(grad, weight, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    using A = typename Acc<T>::type;
    combine_rows_backward<T, W>(grad.data_ptr<T>(), need_weight_grad ? src.data_ptr<T>() : nullptr,
                                row_of.data_ptr<int64_t>(), weight_ptr<W>(weight), out.data_ptr<T>(),
                                need_weight_grad ? dots.data_ptr<A>() : nullptr, rows, grad.size(0), hidden, bad);
  });
  TORCH_CHECK(!bad, "combine_backward: a row is outside [0, ", grad.size(0), ")");
  return {out, dots};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_optimus: the MoE layer's routing, gather and combine on the CPU";
  m.def("route", &route, "slots sorted by expert: (order, inverse, counts)");
  m.def("gather", &gather, "rows x[index[p]], optionally weighted");
  m.def("combine", &combine, "row r = sum_j weight[table[r, j]] * src[table[r, j]], float32 sums");
  m.def("combine_backward", &combine_backward, "(weight[p] * grad[row_of[p]], dot(src[p], grad[row_of[p]]))");
}
