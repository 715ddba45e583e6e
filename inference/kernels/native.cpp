// The runtime's C++ kernels, loaded by native.py with torch.utils.cpp_extension:
// - decoder_layers: the direct forward's lean decoder layers (direct_forward.py, _lean_layers) as one
//   call, bitwise the Python loop: its reductions through the same ATen calls, everything exact element
//   by element in plain loops (no interpreter and no ATen call between them). See native_layers.py for
//   when it is used.
// - drafter_layer: a feature drafter's one decoder layer (EAGLE, EAGLE-3) from its attention input and
//   residual, with decoder_layers' attention and MLP blocks (native_drafter.py).
// - attend: attention computing every row from its query and the keys it sees alone (row-invariant);
//   attention.py registers it with transformers for the model's own forwards.
// - stream_linear: the stream kernel's product (packed_gemm.py), the weights read once for all rows, with
//   AVX2 and FMA or, where the CPU has it, AVX-512 (the same floats).
// - screen_contenders: the screened head's bound and contender search (greedy_head.py) in two passes
//   over the vocabulary instead of ten tensor-wide operations.
// - proven_argmax: the screened head's proof for one row, reading the contenders' weight rows in place
//   (a flat row's many contenders split between threads, each one's sums the same).
// - int16_screen: the screened head's int8 product (greedy_head.py) for rows rounded to 16-bit integers,
//   reading each weight row from memory once for all rows of a tree, summed exactly with AVX2, AVX-512 VNNI
//   or AMX tiles (the same integers on each).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>
#include <ATen/ops/sum_cpu_dispatch.h>
#include <ATen/record_function.h>
#include <torch/extension.h>

#ifdef __linux__
#include <dlfcn.h>
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define DRAFTSMITH_X86 1
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

at::Tensor stream_linear(const at::Tensor& rows, const at::Tensor& pack, const std::string& isa = "auto");

namespace {

// Per decoder layer, in this order (the projections as transposed views of their weights: what F.linear
// multiplies a bias-free input by).
enum Weight { kInputNorm, kQuery, kKey, kValue, kOutput, kGate, kUp, kDown, kPostNorm, kWeightsPerLayer };
constexpr int64_t kProjections = 7;  // kQuery .. kDown
constexpr int64_t kContenderSpan = 8192;  // tokens per task of screen_contenders
constexpr int64_t kSeenKeysGrain = 32768;  // mask entries per task of attend's seen-key lists
// The screened head's largest 16-bit input (screen_inputs): 127 * 256 + 127, so that every input is two signed
// bytes for AMX's tile products (tile_digits).
constexpr int64_t kScreenTop = 127 * 256 + 127;
constexpr int64_t kProofGrain = 2048;  // contenders per task of proven_argmax (fewer: one thread)
constexpr int64_t kStreamBlock = 16;  // outputs per block of a stream pack (stream_pack): two vectors
constexpr int64_t kCodeGroup = 32;  // inputs sharing a step (and a 4-bit pack's offset) in a code pack (group_pack)
constexpr int64_t kCodeGroupBytes = 2 * kStreamBlock * sizeof(float) + kCodeGroup * kStreamBlock / 2;
constexpr int64_t kByteGroupBytes = kStreamBlock * sizeof(float) + kCodeGroup * kStreamBlock;  // byte_pack

// The glue between a layer's products computes what the Python loop's ATen calls compute, element by
// element, in plain loops: each element's product, sum or quotient is one IEEE float32 operation whatever
// the loop's vector width (native.py builds with -ffp-contract=off, so a * b + c * d stays three roundings
// as ATen's mul, mul and add are), so the results are bitwise the same without ~50 small calls per layer.

// The glue's tensors are float32 on the CPU, its ATen calls CPU kernels: called directly (at::cpu::, and
// this allocation), the same kernels without the dispatcher's and autograd's layers, which a forward would
// otherwise cross a few hundred times.
at::Tensor float_empty(at::IntArrayRef sizes) { return at::detail::empty_cpu(sizes, at::kFloat); }

// ATen's float32 sum over the last dimension of a contiguous row of n values (cascade_sum in ATen's
// SumKernel.cpp, its vectorized_inner_sum), replicated for `lanes`, its Vectorized<float>::size() (16 where
// ATen runs its AVX-512 kernels, 8 for AVX2; 1: its scalar path, for rows shorter than a vector): four
// interleaved vectors of partial sums, folded every 16 of them into three more levels, the levels folded into
// the first vector and the other three into it, then the values past the last whole vector and the lanes in
// order, added to the zeroed output. Each addition is one IEEE float32 addition in ATen's order, so the sum
// is bitwise ATen's; which lane count ATen uses is checked against at::cpu::sum (aten_sum_lanes).
float aten_row_sum(const float* x, int64_t n, int lanes) {
  constexpr int kMaxLanes = 16, kInterleaved = 4, kLevels = 4;
  const int64_t vectors = n / lanes, steps = vectors / kInterleaved;
  int64_t ceil_log2 = 1;  // ATen's utils::CeilLog2
  while (steps > 2 && (int64_t(1) << ceil_log2) < steps) ++ceil_log2;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / kLevels), level_step = int64_t(1) << level_power;
  float acc[kLevels][kInterleaved][kMaxLanes] = {};
  auto add = [lanes](float* into, const float* v) {
    for (int l = 0; l < lanes; ++l) into[l] += v[l];
  };
  int64_t i = 0;
  while (i + level_step <= steps) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kInterleaved; ++k) add(acc[0][k], x + (i * kInterleaved + k) * lanes);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kInterleaved; ++k) {
        add(acc[j][k], acc[j - 1][k]);
        std::fill_n(acc[j - 1][k], lanes, 0.0f);
      }
      if ((i & ((level_step - 1) << (j * level_power))) != 0) break;
    }
  }
  for (; i < steps; ++i)
    for (int k = 0; k < kInterleaved; ++k) add(acc[0][k], x + (i * kInterleaved + k) * lanes);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kInterleaved; ++k) add(acc[0][k], acc[j][k]);
  for (int64_t v = steps * kInterleaved; v < vectors; ++v) add(acc[0][0], x + v * lanes);
  for (int k = 1; k < kInterleaved; ++k) add(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t e = vectors * lanes; e < n; ++e) total += x[e];
  for (int l = 0; l < lanes; ++l) total += acc[0][0][l];
  return 0.0f + total;
}

// Random float32 values of varied magnitudes for checking a copy of an ATen kernel, from a generator of their
// own: torch's default one, which a user seeds for sampling, is left where it was.
at::Tensor probe_values(at::IntArrayRef sizes, double spread) {
  const at::Generator own = at::detail::createCPUGenerator(20261207);
  return (at::randn(sizes, own) * at::exp(spread * at::randn(sizes, own))).contiguous();
}

// The lane count with which aten_row_sum gives at::cpu::sum's floats for rows of `width` on this machine (0:
// none does, at::cpu::sum stays), found once per width on rows of random magnitudes.
int aten_sum_lanes(int64_t width) {
  static std::mutex lock;
  static std::vector<std::pair<int64_t, int>> found;
  const std::lock_guard<std::mutex> guard(lock);
  for (const auto& [w, lanes] : found)
    if (w == width) return lanes;
  const at::Tensor rows = probe_values({64, width}, 4.0);
  const at::Tensor sums = at::cpu::sum(rows, {-1}, /*keepdim=*/false).contiguous();
  int chosen = 0;
  for (const int lanes : {16, 8}) {
    const int effective = width < lanes ? 1 : lanes;
    bool same = true;
    for (int64_t r = 0; r < 64 && same; ++r)
      same = aten_row_sum(rows.data_ptr<float>() + r * width, width, effective) == sums.data_ptr<float>()[r];
    if (same) {
      chosen = effective;
      break;
    }
  }
  found.emplace_back(width, chosen);
  return chosen;
}

// Each row's rsqrt(mean(x * x) + eps) of contiguous float32 rows (..., width), as an RMSNorm computes it: the
// mean's sum is ATen's (aten_row_sum: its summation order is the reference's; at::cpu::sum itself where the
// replica was not found to match); the squares, the division by width (what ATen's mean does after that
// sum: a float32 true division), the epsilon's addition and the reciprocal square root (1 / sqrt, each
// correctly rounded, as ATen's rsqrt) are exact replicas.
std::vector<float> inverse_rms(const at::Tensor& in, double eps) {
  const int64_t width = in.size(-1), rows = in.numel() / width;
  const float* xp = in.data_ptr<float>();
  std::vector<float> squares(rows * width), var(rows);
  for (int64_t i = 0; i < rows * width; ++i) squares[i] = xp[i] * xp[i];
  const int lanes = aten_sum_lanes(width);
  if (lanes > 0) {
    for (int64_t r = 0; r < rows; ++r) var[r] = aten_row_sum(squares.data() + r * width, width, lanes);
  } else {
    const at::Tensor sums =
        at::cpu::sum(at::from_blob(squares.data(), {rows, width}, at::kFloat), {-1}, /*keepdim=*/false).contiguous();
    std::copy_n(sums.data_ptr<float>(), rows, var.begin());
  }
  const float count = static_cast<float>(width), epsilon = static_cast<float>(eps);
  std::vector<float> inverse(rows);
  for (int64_t r = 0; r < rows; ++r) inverse[r] = 1.0f / std::sqrt(var[r] / count + epsilon);
  return inverse;
}

// An RMSNorm of float32 rows (..., width) by a per-column `scale`, its two products exact replicas in the
// model's order: Llama's scale * (x * inverse), Gemma's (x * inverse) * scale (`scale_last`, the scale its
// 1 + weight). Returns (rows, width).
at::Tensor scaled_norm(const at::Tensor& rows, const at::Tensor& scale, double eps, bool scale_last) {
  const at::Tensor in = rows.contiguous(), factor = scale.contiguous();
  const int64_t width = in.size(-1), n = in.numel() / width;
  const std::vector<float> inverse = inverse_rms(in, eps);
  const float* xp = in.data_ptr<float>();
  const float* f = factor.data_ptr<float>();
  at::Tensor out = float_empty({n, width});
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < width; ++j)
      o[r * width + j] = scale_last ? (xp[r * width + j] * inverse[r]) * f[j] : f[j] * (xp[r * width + j] * inverse[r]);
  return out;
}

// LlamaRMSNorm.forward of float32 x (1, rows, width): weight * (x * rsqrt(mean(x * x) + eps)).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return scaled_norm(x, weight, eps, /*scale_last=*/false);
}

// a + b, both (rows, width) float32 (b contiguous, a any dense layout the caller made contiguous):
// the residual connection, as a new tensor (the caller keeps every layer's output).
at::Tensor add_rows(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor left = a.contiguous(), right = b.contiguous();
  at::Tensor out = float_empty(left.sizes());
  const float* l = left.data_ptr<float>();
  const float* r = right.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < left.numel(); ++i) o[i] = l[i] + r[i];
  return out;
}

// Columns of a projection's rows as the glue reads them: the rows' first value and their stride.
struct Columns {
  at::Tensor rows;  // keeps the product alive
  const float* first = nullptr;
  int64_t stride = 0;
  Columns() = default;
  Columns(const at::Tensor& all, int64_t start)
      : rows(all), first(all.data_ptr<float>() + start), stride(all.stride(0)) {}
  // these columns (`width` of them) as a contiguous (rows, width) tensor: a copy where they are not
  at::Tensor dense(int64_t width) const { return rows.narrow(1, first - rows.data_ptr<float>(), width).contiguous(); }
};

// Each row's heads rotated by that row's rotary embedding: q * cos + rotate_half(q) * sin, with
// rotate_half's sign moved onto signed_sin (exact), written head h of row r to to + h * head_stride +
// r * row_stride. cos and signed_sin: (rows, head_dim).
void rotate_into(const Columns& from, int64_t rows, int64_t heads, int64_t head_dim, const float* cos,
                 const float* signed_sin, float* to, int64_t head_stride, int64_t row_stride) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * head_dim;
    const float* s = signed_sin + r * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = from.first + r * from.stride + h * head_dim;
      float* out = to + h * head_stride + r * row_stride;
      for (int64_t d = 0; d < half; ++d) out[d] = q[d] * c[d] + q[d + half] * s[d];
      for (int64_t d = half; d < head_dim; ++d) out[d] = q[d] * c[d] + q[d - half] * s[d];
    }
  }
}

// Each row's heads copied where rotate_into places them.
void copy_into(const Columns& from, int64_t rows, int64_t heads, int64_t head_dim, float* to, int64_t head_stride,
               int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      std::copy_n(from.first + r * from.stride + h * head_dim, head_dim, to + h * head_stride + r * row_stride);
}

// The gated MLPs' activations: Llama's SiLU, Gemma-3's GELU with the tanh approximation.
enum class Activation { kSilu, kGeluTanh };

// ATen's SiLU of n contiguous floats (silu_kernel: x / (1 + exp(-x)), vectors of Vectorized<float>::exp, which
// is SLEEF's 1-ulp expf, two vectors a step, the values past the last whole step through std::exp),
// replicated with SLEEF's own functions from libtorch (looked up at run time: a torch without them keeps
// ATen's SiLU) for 16 or 8 lanes, whichever ATen runs here (silu_lanes). Each value is one expf and IEEE
// operations in ATen's order, so the result is bitwise ATen's.
constexpr int64_t kSiluReplicaMax = 32768;  // at::internal::GRAIN_SIZE: ATen splits more between threads
#ifdef DRAFTSMITH_X86
using ExpLanes16 = __m512 (*)(__m512);
using ExpLanes8 = __m256 (*)(__m256);

template <typename F>
F sleef_function(const char* name) {
#ifdef __linux__
  void* found = dlsym(RTLD_DEFAULT, name);
  if (found == nullptr) {  // libtorch loaded with local symbols: ask the library itself (already loaded)
    void* library = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (library != nullptr) found = dlsym(library, name);
  }
  return reinterpret_cast<F>(found);
#else
  return nullptr;
#endif
}

__attribute__((target("avx512f"))) void silu_16(const float* x, int64_t n, float* out, ExpLanes16 exp16) {
  const int64_t whole = n / 32 * 32;
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 negated = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign));
    _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(one, exp16(negated))));
  }
  for (int64_t i = whole; i < n; ++i) out[i] = x[i] / (1.0f + std::exp(-x[i]));
}

__attribute__((target("avx2,fma"))) void silu_8(const float* x, int64_t n, float* out, ExpLanes8 exp8) {
  const int64_t whole = n / 16 * 16;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_xor_ps(v, sign)))));
  }
  for (int64_t i = whole; i < n; ++i) out[i] = x[i] / (1.0f + std::exp(-x[i]));
}

// The SiLU replica for this machine: silu_16 or silu_8 bound to its SLEEF function, the first that gives
// at::cpu::silu's floats on random values of several lengths (found once), and its lanes; none (lanes 0)
// where neither does.
struct SiluReplica {
  int lanes = 0;
  std::function<void(const float*, int64_t, float*)> run;
};

const SiluReplica& silu_replica() {
  static const SiluReplica replica = [] {
    const auto exp16 = sleef_function<ExpLanes16>("Sleef_expf16_u10");
    const auto exp8 = sleef_function<ExpLanes8>("Sleef_expf8_u10");
    std::vector<SiluReplica> candidates;
    if (__builtin_cpu_supports("avx512f") && exp16 != nullptr)
      candidates.push_back({16, [exp16](const float* x, int64_t n, float* out) { silu_16(x, n, out, exp16); }});
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && exp8 != nullptr)
      candidates.push_back({8, [exp8](const float* x, int64_t n, float* out) { silu_8(x, n, out, exp8); }});
    for (const SiluReplica& candidate : candidates) {
      // lengths whose last whole steps differ between 16 and 8 lanes (which values take std::exp), and longer ones
      std::vector<int64_t> lengths = {1536, 1000, 5};
      for (int64_t n = 16; n < 48; ++n) lengths.push_back(n);
      bool same = true;
      for (const int64_t n : lengths) {
        const at::Tensor x = probe_values({n}, 1.5), reference = at::cpu::silu(x);
        std::vector<float> got(n);
        candidate.run(x.data_ptr<float>(), n, got.data());
        same = same && std::memcmp(got.data(), reference.data_ptr<float>(), n * sizeof(float)) == 0;
      }
      if (same) return candidate;
    }
    return SiluReplica{};
  }();
  return replica;
}
#endif

// ATen's SiLU of gate (rows, inner) with unit column stride into out (rows, inner) through silu_replica, as
// ATen's loop runs it (a contiguous gate as one run of values, else row by row, each with its own tail);
// false (nothing written) where the replica does not serve.
bool replicated_silu(const at::Tensor& gate, float* out) {
#ifdef DRAFTSMITH_X86
  const int64_t rows = gate.size(0), inner = gate.size(1);
  if (rows * inner > kSiluReplicaMax || gate.stride(1) != 1) return false;
  const SiluReplica& silu = silu_replica();
  if (silu.lanes == 0) return false;
  const float* g = gate.data_ptr<float>();
  if (gate.is_contiguous()) {
    silu.run(g, rows * inner, out);
  } else {
    for (int64_t r = 0; r < rows; ++r) silu.run(g + r * gate.stride(0), inner, out + r * inner);
  }
  return true;
#else
  return false;
#endif
}

// act(gate) of gate (rows, inner) with unit column stride into out (rows, inner): ATen's (its exp or tanh is
// the reference's: replicated_silu where it serves, else ATen's kernel).
void activate(const at::Tensor& gate, Activation act, float* out) {
  if (act == Activation::kSilu && replicated_silu(gate, out)) return;
  const at::Tensor activated = (act == Activation::kSilu ? at::cpu::silu(gate) : at::cpu::gelu(gate, "tanh")).contiguous();
  std::copy_n(activated.data_ptr<float>(), activated.numel(), out);
}

// act(gate) * up, gate (rows, inner) with unit column stride, up that many columns: activate's values, the
// product an exact replica.
at::Tensor gated_product(const at::Tensor& gate, const Columns& up, Activation act) {
  const int64_t rows = gate.size(0), inner = gate.size(1);
  at::Tensor out = float_empty({rows, inner});
  float* o = out.data_ptr<float>();
  activate(gate, act, o);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < inner; ++j) o[r * inner + j] *= up.first[r * up.stride + j];
  return out;
}

// PackedLinear.forward while its MKL pack for these rows is active: MKL's packed GEMM.
at::Tensor mkl_packed_linear(const at::Tensor& rows, const at::Tensor& pack, const at::Tensor& weight) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t)>();
  return op.call(rows, pack, weight, std::nullopt, rows.size(0));
}

// PackedLinear.forward while its oneDNN pack is active: oneDNN's prepacked linear, bias-free.
at::Tensor onednn_packed_linear(const at::Tensor& rows, const at::Tensor& pack) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{rows, pack, c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Whose pack a projection multiplies through (packed_gemm.PackedGemm.kernel; the codes native_layers.py
// passes).
enum PackKind { kMklPack = 0, kOneDnnPack = 1, kStreamPack = 2 };

// A pack's product with `rows` (rows, width), bias-free: MKL's and oneDNN's packs are mkldnn-layout
// tensors, the stream kernel's a float32 or bfloat16 one (stream_pack).
at::Tensor packed_product(const at::Tensor& rows, const at::Tensor& pack, int64_t kind, const at::Tensor& transposed) {
  if (kind == kOneDnnPack) return onednn_packed_linear(rows, pack);
  if (kind == kStreamPack) return stream_linear(rows, pack);
  return mkl_packed_linear(rows, pack, transposed.t());
}

// One projection of `rows` (rows, width): through its pack where one is given (non-empty), else
// F.linear's product for a bias-free input (mm with the transposed weight).
at::Tensor project(const at::Tensor& rows, const at::Tensor& transposed, const at::Tensor& pack, int64_t kind) {
  if (pack.numel() == 0) return at::mm(rows, transposed);
  return packed_product(rows, pack, kind, transposed);
}

#ifdef DRAFTSMITH_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Weight rows this far ahead of the ones being summed are requested from memory, into the core's L2: the
// hardware prefetcher alone leaves a single core far below the memory's bandwidth on these interleaved
// rows, and a request only one block ahead (into L1) keeps too few lines in flight to cover the latency.
constexpr int64_t kPrefetchRows = 64;
constexpr auto kPrefetchHint = _MM_HINT_T1;

// The screen kernels' order of work, shared by their instruction sets: tokens [begin, end) for every row, a
// few tokens at a time, so that after the first group of up to 8 rows has read their weights from memory,
// the next groups find them in the L1 cache; within a group, T tokens a block (Kernel::kTokens[R]: R x T
// accumulators fit the kernel's vector registers). Kernel::block<R, T> sums one block.
template <class Kernel, int R, class X, class S>
void screen_tokens(const X* x, const int8_t* q, int64_t K, int64_t V, int64_t begin, int64_t end, S* sums) {
  constexpr int T = Kernel::kTokens[R];
  int64_t i = begin;
  for (; i + T <= end; i += T) Kernel::template block<R, T>(x, q, K, V, i, sums);
  for (; i < end; ++i) Kernel::template block<R, 1>(x, q, K, V, i, sums);
}

template <class Kernel, class X, class S>
void screen_rows(const X* x, int64_t rows, const int8_t* q, int64_t K, int64_t V, int64_t begin, int64_t end,
                 S* sums) {
  constexpr int64_t kTokensPerPass = 24;
  for (int64_t first = begin; first < end; first += kTokensPerPass) {
    const int64_t last = std::min(end, first + kTokensPerPass);
    for (int64_t r = 0; r < rows; r += 8) {
      const X* xr = x + r * K;
      S* sr = sums + r * V;
      switch (std::min<int64_t>(8, rows - r)) {
        case 1: screen_tokens<Kernel, 1>(xr, q, K, V, first, last, sr); break;
        case 2: screen_tokens<Kernel, 2>(xr, q, K, V, first, last, sr); break;
        case 3: screen_tokens<Kernel, 3>(xr, q, K, V, first, last, sr); break;
        case 4: screen_tokens<Kernel, 4>(xr, q, K, V, first, last, sr); break;
        case 5: screen_tokens<Kernel, 5>(xr, q, K, V, first, last, sr); break;
        case 6: screen_tokens<Kernel, 6>(xr, q, K, V, first, last, sr); break;
        case 7: screen_tokens<Kernel, 7>(xr, q, K, V, first, last, sr); break;
        default: screen_tokens<Kernel, 8>(xr, q, K, V, first, last, sr); break;
      }
    }
  }
}

#define AVX512 __attribute__((target("avx512f")))
#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// sums[r * V + i + t] = sum_k x_rk q_(i+t)k for R rows of x (int16, R x K, K a multiple of 32) and tokens
// [i, i + T) of q (int8, V x K): exact int32 sums (the caller keeps sum_k |x_rk| 127 below 2^31), each
// instruction adding 32 products (vpdpwssd: two int16 products a lane), the int8 weights widened to int16
// on the way in.
template <int R, int T>
AVX512VNNI inline void vnni_block(const int16_t* x, const int8_t* q, int64_t K, int64_t V, int64_t i, int32_t* sums) {
  __m512i acc[T][R];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_si512();
  const int64_t ahead = std::min(i + kPrefetchRows, V - T);
  for (int64_t k = 0; k < K; k += 32) {
    if ((k & 63) == 0)
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) _mm_prefetch(reinterpret_cast<const char*>(q + (ahead + t) * K + k), kPrefetchHint);
    __m512i xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(x + r * K + k);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (i + t) * K + k)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_dpwssd_epi32(acc[t][r], w, xv[r]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[r * V + i + t] = _mm512_reduce_add_epi32(acc[t][r]);
}

// vnni_block with AVX2 (any CPU the kernels run on): the same exact int32 sums, each instruction multiplying
// 16 int16 pairs and adding neighbours into 8 lanes (vpmaddwd), then added to the sums (vpaddd).
AVX2 inline int32_t lane_sum_epi32(__m256i v) {
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i pairs = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
  return _mm_cvtsi128_si32(_mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 1)));
}

template <int R, int T>
AVX2 inline void madd_block(const int16_t* x, const int8_t* q, int64_t K, int64_t V, int64_t i, int32_t* sums) {
  __m256i acc[T][R];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_si256();
  const int64_t ahead = std::min(i + kPrefetchRows, V - T);
  for (int64_t k = 0; k < K; k += 16) {
    if ((k & 63) == 0)
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) _mm_prefetch(reinterpret_cast<const char*>(q + (ahead + t) * K + k), kPrefetchHint);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (i + t) * K + k)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * K + k));
        acc[t][r] = _mm256_add_epi32(acc[t][r], _mm256_madd_epi16(w, xv));
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[r * V + i + t] = lane_sum_epi32(acc[t][r]);
}

// The screen kernels for screen_rows: exact int32 sums with AVX2 and with AVX-512 VNNI (more tokens a block
// where there are 32 vector registers).
struct MaddScreen {
  static constexpr int kTokens[9] = {0, 4, 4, 3, 2, 2, 2, 1, 1};
  template <int R, int T>
  AVX2 static void block(const int16_t* x, const int8_t* q, int64_t K, int64_t V, int64_t i, int32_t* sums) {
    madd_block<R, T>(x, q, K, V, i, sums);
  }
};

struct VnniScreen {
  static constexpr int kTokens[9] = {0, 8, 6, 4, 4, 3, 3, 2, 2};
  template <int R, int T>
  AVX512VNNI static void block(const int16_t* x, const int8_t* q, int64_t K, int64_t V, int64_t i, int32_t* sums) {
    vnni_block<R, T>(x, q, K, V, i, sums);
  }
};

// ---- the screen's exact sums on AMX tiles ----
// int16_screen's int32 sums from AMX's int8 tile products (Intel since Sapphire Rapids): each 16-bit input
// x = 256 h + l is two signed bytes (greedy_head.py keeps |x| <= 32639, so l = ((x + 128) mod 256) - 128 and
// h = (x - l) / 256 lie in -128..127), and a tile product of 16 tokens' weights (64 inputs each, read from the
// weight rows in place) with the digits of up to 8 rows (16 columns: h of row r in column 2r, l in 2r + 1)
// sums every token's products with both digits exactly in int32; 256 H + L is then the same integer the VNNI
// kernel sums, so the screen's floats are too. One product does the multiply-adds of 32 VNNI instructions in
// about the time of one, so the screen of many rows is bound by reading the weights, not by multiplying them;
// at a few rows, where reading bounds VNNI too, the tiles' loads read them slower (int16_screen's tiles_from).
constexpr int64_t kTileInputs = 64;   // a tile row's bytes: a token's inputs per product
constexpr int64_t kTileTokens = 16;   // a tile's rows
constexpr int64_t kTileScreenRows = 8;  // screen rows per product: two digits each, a tile's 16 columns
constexpr int64_t kTileDigitBytes = kTileTokens * kTileTokens * 4;  // one product's digit tile (16 x 64 bytes)
constexpr int64_t kTilesAhead = 8;    // token tiles ahead whose weights are asked for (into L2) as tiles are read

// rows [r0, r0 + 8) of x (int16, R x K; absent rows zero) as AMX's right-hand tiles, one per 64 inputs: byte
// (kk, 4 n + j) of tile c is digit n of input 64 c + 4 kk + j.
// Returns false where a value lies past 32639 (its h would be 128): the VNNI kernel sums such rows.
bool tile_digits(const int16_t* x, int64_t rows, int64_t K, int64_t r0, int8_t* out) {
  std::fill_n(out, K / kTileInputs * kTileDigitBytes, int8_t{0});
  for (int64_t r = r0; r < std::min(rows, r0 + kTileScreenRows); ++r)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t value = x[r * K + k], low = ((value + 128) & 255) - 128, high = (value - low) / 256;
      if (high > 127) return false;
      int8_t* at = out + k / kTileInputs * kTileDigitBytes + (k % kTileInputs) / 4 * 64 + 2 * (r - r0) * 4 + k % 4;
      at[0] = static_cast<int8_t>(high);
      at[4] = static_cast<int8_t>(low);
    }
  return true;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

#define AMX_INT8 __attribute__((target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")))

// `tiles` tiles of 16 tokens from `first` summed with one pass of digits (tile_digits, K / 64 tiles), four
// tiles side by side (tiles 0-3 accumulate, 4 holds the digits, 5 and 6 the weights), into sums[r * V + token]
// for rows [r0, r0 + live).
AMX_INT8 void tile_screen_pass(const int8_t* digits, const int8_t* q, int64_t K, int64_t V, int64_t first,
                               int64_t tiles, int64_t r0, int64_t live, int32_t* sums) {
  alignas(64) int32_t out[4][kTileTokens][kTileTokens];
  const int64_t chunks = K / kTileInputs, last_ahead = V - kTileTokens;
  auto ask_ahead = [&](int64_t token, int64_t c) {
    const int64_t ahead = std::min(token + kTilesAhead * kTileTokens, last_ahead);
    for (int64_t u = 0; u < kTileTokens; ++u)
      _mm_prefetch(reinterpret_cast<const char*>(q + (ahead + u) * K + c * kTileInputs), _MM_HINT_T1);
  };
  for (int64_t t = 0; t < tiles; t += 4) {
    const int64_t here = std::min<int64_t>(4, tiles - t), token = first + t * kTileTokens;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      const int8_t* w = q + token * K + c * kTileInputs;
      _tile_loadd(4, digits + c * kTileDigitBytes, 64);
      _tile_loadd(5, w, K);
      _tile_dpbssd(0, 5, 4);
      ask_ahead(token, c);
      if (here > 1) {
        _tile_loadd(6, w + kTileTokens * K, K);
        _tile_dpbssd(1, 6, 4);
        ask_ahead(token + kTileTokens, c);
      }
      if (here > 2) {
        _tile_loadd(5, w + 2 * kTileTokens * K, K);
        _tile_dpbssd(2, 5, 4);
        ask_ahead(token + 2 * kTileTokens, c);
      }
      if (here > 3) {
        _tile_loadd(6, w + 3 * kTileTokens * K, K);
        _tile_dpbssd(3, 6, 4);
        ask_ahead(token + 3 * kTileTokens, c);
      }
    }
    _tile_stored(0, out[0], 64);
    _tile_stored(1, out[1], 64);
    _tile_stored(2, out[2], 64);
    _tile_stored(3, out[3], 64);
    for (int64_t b = 0; b < here; ++b)
      for (int64_t u = 0; u < kTileTokens; ++u)
        for (int64_t r = 0; r < live; ++r) {
          const int64_t total = 256 * static_cast<int64_t>(out[b][u][2 * r]) + out[b][u][2 * r + 1];
          sums[(r0 + r) * V + token + b * kTileTokens + u] = static_cast<int32_t>(total);  // exact: |total| < 2^31
        }
  }
}

// int16_screen's floats for tokens [begin, end) of one row: bfloat16((float(sum) * x_scale) * scale_i), rounded
// to nearest even as c10::BFloat16 rounds (a NaN becomes 0x7FC0), 16 tokens at a time.
AVX512 void screen_floats(const int32_t* sums, float x_scale, const at::BFloat16* scales, int64_t begin, int64_t end,
                          at::BFloat16* out) {
  const __m512 row = _mm512_set1_ps(x_scale);
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512i scale_bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + i)));
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(scale_bits, 16));
    const __m512 value = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums + i)), row), scale);
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), one), half);
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(rounded));
  }
  for (; i < end; ++i) out[i] = at::BFloat16(static_cast<float>(sums[i]) * x_scale * static_cast<float>(scales[i]));
}

// The screen's sums for tokens [begin, end) and every row: whole tiles of 16 tokens on AMX (`digits`: one
// tile_digits pass per 8 rows), the last few tokens through the VNNI kernel (the same integers).
AMX_INT8 void tile_screen_rows(const int16_t* x, const int8_t* digits, int64_t rows, const int8_t* q, int64_t K,
                               int64_t V, int64_t begin, int64_t end, int32_t* sums) {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = kTileTokens;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
  const int64_t tiles = (end - begin) / kTileTokens, passes = (rows + kTileScreenRows - 1) / kTileScreenRows;
  constexpr int64_t kTilesPerStretch = 16;  // a stretch of tokens all passes sum while its weights are in L2
  for (int64_t t = 0; t < tiles; t += kTilesPerStretch)
    for (int64_t pass = 0; pass < passes; ++pass)
      tile_screen_pass(digits + pass * (K / kTileInputs) * kTileDigitBytes, q, K, V, begin + t * kTileTokens,
                       std::min(kTilesPerStretch, tiles - t), pass * kTileScreenRows,
                       std::min(kTileScreenRows, rows - pass * kTileScreenRows), sums);
  _tile_release();
  screen_rows<VnniScreen>(x, rows, q, K, V, begin + tiles * kTileTokens, end, sums);
}

// ---- the stream linear kernel ----
// A stream pack has the weight's shape (O, I): its first O / 16 * 16 outputs in blocks of 16, each
// stored input by input ([I][16]: the 16 outputs' weights for input 0, then for input 1, ...), the last
// O % 16 outputs the same way ([I][O % 16]). A block is read front to back. Every output is summed
// input by input from zero, one fused multiply-add per input (lane j of a vector is output j's sum), so
// it is the same float whichever rows come with it, however rows are grouped into passes and however
// the blocks are split between threads.
constexpr int64_t kStreamInputsPerTile = 128;  // a tile's 8 KB of a block stay in L1 across row passes
constexpr int64_t kStreamMaxRowsPerPass = 6;   // 2 x 6 accumulators, 2 weight vectors, 1 broadcast
constexpr int64_t kStreamWideRows = 2;  // the most rows two blocks a tile take: 2 x 2 x 2 sums, 4 weights, 1 broadcast

// A pack holds float32 weights, or bfloat16 ones where every weight is a bfloat16 value (stream_pack):
// those are widened to float32 exactly (their bits shifted up 16) as they are read, so both packs give
// the same floats, and the bfloat16 one streams half the bytes (a drafter exported in bfloat16).
using Bfloat16Bits = uint16_t;

inline float widen(float w) { return w; }
inline float widen(Bfloat16Bits w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

AVX2 inline __m256 widen8(const float* w) { return _mm256_loadu_ps(w); }
AVX2 inline __m256 widen8(const Bfloat16Bits* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Outputs [o, o + 16 B) (B neighbouring blocks) for R rows of x (R x I), over inputs [k0, k1) of their
// blocks from `w` ([I][16] each); the sums so far are in y (k0 > 0: stored and reloaded exactly). Asks the
// L2 cache for the same inputs of the blocks from `later`, one line per input and block, so memory streams
// while the rows are multiplied.
template <int R, int B, typename W>
AVX2 inline void stream_tile(const float* x, int64_t I, const W* w, int64_t k0, int64_t k1, const W* later,
                             float* y, int64_t O, int64_t o) {
  __m256 low[B][R], high[B][R];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* sums = y + r * O + o + b * kStreamBlock;
      low[b][r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums);
      high[b][r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + 8);
    }
  for (int64_t k = k0; k < k1; ++k) {
    __m256 w0[B], w1[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const W* block = w + b * kStreamBlock * I + k * kStreamBlock;
      if (later != nullptr)
        _mm_prefetch(reinterpret_cast<const char*>(later + b * kStreamBlock * I + k * kStreamBlock), _MM_HINT_T1);
      w0[b] = widen8(block);
      w1[b] = widen8(block + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * I + k);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) {
        low[b][r] = _mm256_fmadd_ps(w0[b], xr, low[b][r]);
        high[b][r] = _mm256_fmadd_ps(w1[b], xr, high[b][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * O + o + b * kStreamBlock, low[b][r]);
      _mm256_storeu_ps(y + r * O + o + b * kStreamBlock + 8, high[b][r]);
    }
}

// f(std::integral_constant<int, R>{}) for R = rows, from 1 to Max (more rows: Max): a pass's row count as
// the template argument its tile is compiled for.
template <int Max, int R = 1, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R == Max)
    f(std::integral_constant<int, R>{});
  else if (rows <= R)
    f(std::integral_constant<int, R>{});
  else
    with_rows<Max, R + 1>(rows, f);
}

template <int B, typename W>
AVX2 void stream_pass(int64_t rows, const float* x, int64_t I, const W* w, int64_t k0, int64_t k1, const W* later,
                      float* y, int64_t O, int64_t o) {
  with_rows<6>(rows, [&](auto r) { stream_tile<decltype(r)::value, B>(x, I, w, k0, k1, later, y, O, o); });
}

// The same sums with AVX-512, which doubles the multiply-adds a cycle where the CPU has two 512-bit
// units: a block's 16 outputs are one vector, and B neighbouring blocks go together so that even one
// row keeps B independent chains of fused multiply-adds in flight. Lane j of a block's vector is output
// j's sum, input by input from zero, one fused multiply-add per input: the floats of stream_tile.
AVX512 inline __m512 widen16(const float* w) { return _mm512_loadu_ps(w); }
AVX512 inline __m512 widen16(const Bfloat16Bits* w) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// A tile's sums of B blocks for R rows (outputs o.. of y's rows, O apart): zero at a tile's first inputs,
// else what the tile before stored (exactly); and stored back.
template <int R, int B>
AVX512 inline void load_sums_512(__m512 (&acc)[B][R], bool first, const float* y, int64_t O, int64_t o) {
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      acc[b][r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * O + o + b * kStreamBlock);
}

template <int R, int B>
AVX512 inline void store_sums_512(const __m512 (&acc)[B][R], float* y, int64_t O, int64_t o) {
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * O + o + b * kStreamBlock, acc[b][r]);
}

// Input k's multiply-adds: each row's x[r * I + k] times each block's weights, into its sums.
template <int R, int B>
AVX512 inline void add_products_512(__m512 (&acc)[B][R], const __m512 (&weights)[B], const float* x, int64_t I,
                                    int64_t k) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 xr = _mm512_set1_ps(x[r * I + k]);
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) acc[b][r] = _mm512_fmadd_ps(weights[b], xr, acc[b][r]);
  }
}

template <int R, int B, typename W>
AVX512 inline void stream_tile_512(const float* x, int64_t I, const W* w, int64_t k0, int64_t k1, const W* later,
                                   float* y, int64_t O, int64_t o) {
  __m512 acc[B][R];
  load_sums_512<R, B>(acc, k0 == 0, y, O, o);
  for (int64_t k = k0; k < k1; ++k) {
    if (later != nullptr) {
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(later + b * kStreamBlock * I + k * kStreamBlock), _MM_HINT_T1);
    }
    __m512 wv[B];
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) wv[b] = widen16(w + b * kStreamBlock * I + k * kStreamBlock);
    add_products_512<R, B>(acc, wv, x, I, k);
  }
  store_sums_512<R, B>(acc, y, O, o);
}

// Blocks a tile of stream_blocks_512 sums at once: four where a pass holds a few rows (more independent
// chains of multiply-adds and more of the pack in flight, which a memory-bound pass of one row needs),
// two for more rows (that many accumulators per block still fit the registers).
constexpr int64_t kStream512WideBlocks = 4;
constexpr int64_t kStream512WideRows = 4;  // the most rows that take four blocks a tile
constexpr int64_t kStream512Registers = 24;  // accumulators a pass may hold: blocks x rows

template <int B, typename W>
AVX512 void stream_pass_512(int64_t rows, const float* x, int64_t I, const W* w, int64_t k0, int64_t k1,
                            const W* later, float* y, int64_t O, int64_t o) {
  with_rows<12>(rows, [&](auto r) { stream_tile_512<decltype(r)::value, B>(x, I, w, k0, k1, later, y, O, o); });
}

// One pass of `rows` rows over a tile of B blocks: AVX-512's (stream_pass_512) where `Wide`, else AVX2's.
template <bool Wide, int B, typename W>
void stream_pass_of(int64_t rows, const float* x, int64_t I, const W* w, int64_t k0, int64_t k1, const W* later,
                    float* y, int64_t O, int64_t o) {
  if constexpr (Wide)
    stream_pass_512<B>(rows, x, I, w, k0, k1, later, y, O, o);
  else
    stream_pass<B>(rows, x, I, w, k0, k1, later, y, O, o);
}

// Blocks [begin, end) of the pack for every row, B blocks a tile (the last ones alone), a tile of inputs
// at a time: the first pass of rows reads the tile from memory, the others find it in L1. Rows go in
// passes of equal size (8 rows: two of 4), each at most max_rows (the accumulators, the weight vectors
// and a broadcast stay in the registers).
template <bool Wide, int B, typename W>
void stream_tiles(const float* x, int64_t rows, int64_t max_rows, const W* pack, int64_t I, int64_t O, int64_t begin,
                  int64_t end, float* y) {
  const int64_t passes = (rows + max_rows - 1) / max_rows;
  for (int64_t block = begin; block < end;) {
    const int64_t blocks = end - block >= B ? B : 1;
    const W* w = pack + block * kStreamBlock * I;
    const W* later = block + 2 * blocks <= end ? w + blocks * kStreamBlock * I : nullptr;
    for (int64_t k0 = 0; k0 < I; k0 += kStreamInputsPerTile) {
      const int64_t k1 = std::min(I, k0 + kStreamInputsPerTile);
      for (int64_t pass = 0, r = 0; pass < passes; ++pass) {
        const int64_t here = (rows - r) / (passes - pass);
        const W* ahead = pass == 0 ? later : nullptr;
        if (blocks == B)
          stream_pass_of<Wide, B>(here, x + r * I, I, w, k0, k1, ahead, y + r * O, O, block * kStreamBlock);
        else
          stream_pass_of<Wide, 1>(here, x + r * I, I, w, k0, k1, ahead, y + r * O, O, block * kStreamBlock);
        r += here;
      }
    }
    block += blocks;
  }
}

// AVX2: two blocks a tile for up to kStreamWideRows rows (more chains of multiply-adds and more of the pack in
// flight, which a memory-bound pass needs), one for more (their accumulators fill the 16 registers).
// AVX-512: four blocks for up to kStream512WideRows rows, two for more. Which way blocks are grouped
// changes no sum (each lane's is its output's, input by input).
template <typename W>
void stream_blocks(const float* x, int64_t rows, const W* pack, int64_t I, int64_t O, int64_t begin, int64_t end,
                   float* y) {
  if (rows <= kStreamWideRows)
    stream_tiles<false, 2>(x, rows, kStreamWideRows, pack, I, O, begin, end, y);
  else
    stream_tiles<false, 1>(x, rows, kStreamMaxRowsPerPass, pack, I, O, begin, end, y);
}

template <typename W>
void stream_blocks_512(const float* x, int64_t rows, const W* pack, int64_t I, int64_t O, int64_t begin, int64_t end,
                       float* y) {
  constexpr int64_t wide = kStream512WideBlocks;
  if (rows <= kStream512WideRows)
    stream_tiles<true, wide>(x, rows, kStream512Registers / wide, pack, I, O, begin, end, y);
  else
    stream_tiles<true, 2>(x, rows, kStream512Registers / 2, pack, I, O, begin, end, y);
}

// The last O % 16 outputs (stored [I][tail] after the blocks): the same sums, one output at a time
// (std::fma rounds as a vector lane's fused multiply-add does).
template <typename W>
AVX2 void stream_tail(const float* x, int64_t rows, const W* pack, int64_t I, int64_t O, float* y) {
  const int64_t first = O / kStreamBlock * kStreamBlock, tail = O - first;
  const W* w = pack + first * I;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < tail; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < I; ++k) sum = std::fma(widen(w[k * tail + j]), x[r * I + k], sum);
      y[r * O + first + j] = sum;
    }
}

// ---- exact 4-bit and 8-bit codes ----
// Weights dequantised from a 4-bit block format (GGUF's Q4_1, as the embedded target's) are, in every
// group of 32 neighbouring inputs of an output, w = fl(fl(d * q) + m) for codes q in 0..15 and one float16
// step d and offset m per group. stream_pack finds such weights (code_pack, every weight rebuilt bit for
// bit, else the float32 or bfloat16 pack) and stores the codes with each group's d and m; the kernel
// rebuilds each weight as one fused multiply-add d * q + m (d * q has at most 11 + 4 significant bits, so
// it is exact in float32 and fusing rounds once, as the sum alone does) before the same fused multiply-add
// input by input: the floats of the float32 pack, from 0.75 bytes a weight instead of 4.
// A code pack is uint8 (O / 16, I / 32 * kCodeGroupBytes): per block of 16 outputs and group of 32
// inputs, the 16 outputs' d and m (float32), then per pair of inputs (k, k + 1) 16 bytes, byte j holding
// output j's code for k in its low half and for k + 1 in its high half.
constexpr int64_t kCodeGroupsPerTile = 4;  // a tile's 1.5 KB of a block stay in L1 across row passes
constexpr int64_t kCode512WideRows = 2;    // the most rows four blocks a tile take (4 x 2 sums, 8 steps, offsets)
constexpr int64_t kCode512MaxRowsPerPass = 8;  // two blocks: 2 x 8 sums, 2 x 2 steps and offsets
constexpr int64_t kCodeMaxRowsPerPass = 8;     // AVX2: 8 sums (one half block), a step's weights, broadcasts
constexpr int kCodeSums256 = 8;                // AVX2: the sums a tile holds (code_half_tile)

// Asks the L2 cache for line `pair` of group g of B blocks from `later` (block_bytes apart), as stream_tile
// does: a group's lines one a pair over its first pairs, not all at its start (which stalls the loads the
// pairs wait for: 15% of a one-row pass on this project's Intel VM).
template <int B, int64_t GroupBytes = kCodeGroupBytes>
inline void prefetch_group_line(const uint8_t* later, int64_t block_bytes, int64_t g, int64_t pair) {
  if (later == nullptr || pair * 64 >= GroupBytes) return;
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b)
    _mm_prefetch(reinterpret_cast<const char*>(later + b * block_bytes + g * GroupBytes + pair * 64), _MM_HINT_T1);
}

// The 4-bit codes' tiles (code_tiles' Format).
struct FourBitCodes {
  static constexpr int64_t kGroupBytes = kCodeGroupBytes;

  // A pair's weights of one block. Each code becomes its float by a table lookup on the shuffle port
  // (_mm512_permutexvar_ps reads an index's low 4 bits alone, so neither half of a byte needs masking)
  // rather than a conversion on the port the multiply-adds take. The bytes are widened once: the high
  // halves are the widened bytes shifted (one operation instead of a shift and a second widening on the
  // shuffle port, which rebuilding the weights keeps busy even for one row).
  AVX512 static void weights_512(const uint8_t* pair, __m512 d, __m512 m, __m512* first, __m512* second) {
    const __m512 floats = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i codes0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
    const __m512i codes1 = _mm512_srli_epi32(codes0, 4);
    *first = _mm512_fmadd_ps(d, _mm512_permutexvar_ps(codes0, floats), m);
    *second = _mm512_fmadd_ps(d, _mm512_permutexvar_ps(codes1, floats), m);
  }

  // stream_tile_512's sums for a 4-bit code pack: groups [g0, g1) of B neighbouring blocks (`w`: the first
  // block's bytes, `block_bytes` apart), R rows of x (R x I).
  template <int R, int B>
  AVX512 static void tile_512(const float* x, int64_t I, const uint8_t* w, int64_t block_bytes, int64_t g0,
                              int64_t g1, const uint8_t* later, float* y, int64_t O, int64_t o) {
    __m512 acc[B][R];
    load_sums_512<R, B>(acc, g0 == 0, y, O, o);
    for (int64_t g = g0; g < g1; ++g) {
      __m512 d[B], m[B];
      const uint8_t* codes[B];
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b) {
        const uint8_t* group = w + b * block_bytes + g * kCodeGroupBytes;
        d[b] = _mm512_loadu_ps(reinterpret_cast<const float*>(group));
        m[b] = _mm512_loadu_ps(reinterpret_cast<const float*>(group) + kStreamBlock);
        codes[b] = group + 2 * kStreamBlock * sizeof(float);
      }
      const float* xk = x + g * kCodeGroup;
      for (int64_t pair = 0; pair < kCodeGroup / 2; ++pair) {
        prefetch_group_line<B>(later, block_bytes, g, pair);
        __m512 first[B], second[B];
#pragma GCC unroll 16
        for (int b = 0; b < B; ++b) weights_512(codes[b] + pair * kStreamBlock, d[b], m[b], &first[b], &second[b]);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512 x0 = _mm512_set1_ps(xk[r * I + 2 * pair]), x1 = _mm512_set1_ps(xk[r * I + 2 * pair + 1]);
#pragma GCC unroll 16
          for (int b = 0; b < B; ++b)
            acc[b][r] = _mm512_fmadd_ps(second[b], x1, _mm512_fmadd_ps(first[b], x0, acc[b][r]));
        }
      }
    }
    store_sums_512<R, B>(acc, y, O, o);
  }

  // The AVX2 tiles' weights (code_half_tile): inputs 2 pair and 2 pair + 1 of outputs [8 half, 8 half + 8)
  // of a block, from its group (d, m, then the codes), as weights_512 rebuilds them. A byte's high code needs
  // no mask once the byte is widened to 32 bits.
  static constexpr int kInputsPerStep = 2;
  static constexpr int64_t kStepsPerGroup = kCodeGroup / 2;

  AVX2 static void half_step(const uint8_t* group, int64_t pair, int half, __m256 (&w)[kInputsPerStep]) {
    const float* steps = reinterpret_cast<const float*>(group);
    const __m256 d = _mm256_loadu_ps(steps + 8 * half), m = _mm256_loadu_ps(steps + kStreamBlock + 8 * half);
    const uint8_t* bytes = group + 2 * kStreamBlock * sizeof(float) + pair * kStreamBlock + 8 * half;
    const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(0x0F))), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(codes, 4)), m);
  }
};

// The 8-bit codes' weights (GGUF's Q8_0, as the embedded target's tied head): w = d * q for q in -128..127
// and one float16 step d per 32 inputs of an output, exact in float32 (at most 11 + 8 significant bits).
// A byte pack is int8 (O / 16, I / 32 * kByteGroupBytes): per block of 16 outputs and group of 32 inputs,
// the 16 outputs' d (float32), then per input 16 bytes, byte j output j's code. 1.125 bytes a weight.
struct ByteCodes {
  static constexpr int64_t kGroupBytes = kByteGroupBytes;

  template <int R, int B>
  AVX512 static void tile_512(const float* x, int64_t I, const uint8_t* w, int64_t block_bytes, int64_t g0,
                              int64_t g1, const uint8_t* later, float* y, int64_t O, int64_t o) {
    __m512 acc[B][R];
    load_sums_512<R, B>(acc, g0 == 0, y, O, o);
    for (int64_t g = g0; g < g1; ++g) {
      __m512 d[B];
      const uint8_t* codes[B];
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b) {
        const uint8_t* group = w + b * block_bytes + g * kByteGroupBytes;
        d[b] = _mm512_loadu_ps(reinterpret_cast<const float*>(group));
        codes[b] = group + kStreamBlock * sizeof(float);
      }
      const float* xk = x + g * kCodeGroup;
      for (int64_t k = 0; k < kCodeGroup; ++k) {
        prefetch_group_line<B, kByteGroupBytes>(later, block_bytes, g, k);
        __m512 weights[B];
#pragma GCC unroll 16
        for (int b = 0; b < B; ++b) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[b] + k * kStreamBlock));
          weights[b] = _mm512_mul_ps(d[b], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
        }
        add_products_512<R, B>(acc, weights, xk, I, k);
      }
    }
    store_sums_512<R, B>(acc, y, O, o);
  }

  // The AVX2 tiles' weights (code_half_tile): input k of outputs [8 half, 8 half + 8) of a block.
  static constexpr int kInputsPerStep = 1;
  static constexpr int64_t kStepsPerGroup = kCodeGroup;

  AVX2 static void half_step(const uint8_t* group, int64_t k, int half, __m256 (&w)[kInputsPerStep]) {
    const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(group) + 8 * half);
    const uint8_t* bytes = group + kStreamBlock * sizeof(float) + k * kStreamBlock + 8 * half;
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
    w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
  }
};

// An AVX2 tile of a code pack: groups [g0, g1) of B neighbouring blocks for R rows, H halves of each block
// (8 outputs, one vector) from `half0`. Each step's weights of a half are rebuilt once and multiplied into
// every row's sums at once, so more rows cost only their multiply-adds; B x H x R sums stay within 8 of the
// 16 registers (the rest hold a step's weights and broadcasts), and 8 independent chains of multiply-adds
// hide their latency even for one row. Lane j's sum is output j's, input by input: the AVX-512 floats.
template <class Format, int R, int B, int H>
AVX2 void code_half_tile(const float* x, int64_t I, const uint8_t* w, int64_t block_bytes, int64_t g0, int64_t g1,
                         const uint8_t* later, float* y, int64_t O, int64_t o, int half0) {
  constexpr int n = Format::kInputsPerStep;
  __m256 acc[B][H][R];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* sums = y + r * O + o + b * kStreamBlock + 8 * (half0 + h);
        acc[b][h][r] = g0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums);
      }
  for (int64_t g = g0; g < g1; ++g) {
    const float* xk = x + g * kCodeGroup;
    for (int64_t step = 0; step < Format::kStepsPerGroup; ++step) {
      if (half0 == 0) prefetch_group_line<B, Format::kGroupBytes>(later, block_bytes, g, step);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h) {
          __m256 weights[n];
          Format::half_step(w + b * block_bytes + g * Format::kGroupBytes, step, half0 + h, weights);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int j = 0; j < n; ++j)
              acc[b][h][r] = _mm256_fmadd_ps(weights[j], _mm256_broadcast_ss(xk + r * I + n * step + j), acc[b][h][r]);
        }
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * O + o + b * kStreamBlock + 8 * (half0 + h), acc[b][h][r]);
}

// code_half_tile over whole blocks: both halves together where B x 2 x R sums fit, else one half after the
// other (the second finds the tile's codes in L1 and rebuilds the other half's weights: each weight once).
template <class Format, int R, int B>
AVX2 void code_tile_256(const float* x, int64_t I, const uint8_t* w, int64_t block_bytes, int64_t g0, int64_t g1,
                        const uint8_t* later, float* y, int64_t O, int64_t o) {
  if constexpr (B * 2 * R <= kCodeSums256) {
    code_half_tile<Format, R, B, 2>(x, I, w, block_bytes, g0, g1, later, y, O, o, 0);
  } else {
    code_half_tile<Format, R, B, 1>(x, I, w, block_bytes, g0, g1, later, y, O, o, 0);
    code_half_tile<Format, R, B, 1>(x, I, w, block_bytes, g0, g1, nullptr, y, O, o, 1);
  }
}

template <typename Format, bool Wide, int B>
void code_pass(int64_t rows, const float* x, int64_t I, const uint8_t* w, int64_t block_bytes, int64_t g0, int64_t g1,
               const uint8_t* later, float* y, int64_t O, int64_t o) {
  if constexpr (Wide)
    with_rows<kCode512MaxRowsPerPass>(rows, [&](auto r) {
      Format::template tile_512<decltype(r)::value, B>(x, I, w, block_bytes, g0, g1, later, y, O, o);
    });
  else
    with_rows<kCodeMaxRowsPerPass>(rows, [&](auto r) {
      code_tile_256<Format, decltype(r)::value, B>(x, I, w, block_bytes, g0, g1, later, y, O, o);
    });
}

// stream_tiles for a code pack: blocks [begin, end), B a tile (the last ones alone), kCodeGroupsPerTile
// groups of inputs at a time, rows in passes of equal size of at most max_rows.
template <typename Format, bool Wide, int B>
void code_tiles(const float* x, int64_t rows, int64_t max_rows, const uint8_t* pack, int64_t I, int64_t O,
                int64_t begin, int64_t end, float* y) {
  const int64_t groups = I / kCodeGroup, block_bytes = groups * Format::kGroupBytes;
  const int64_t passes = (rows + max_rows - 1) / max_rows;
  for (int64_t block = begin; block < end;) {
    const int64_t blocks = end - block >= B ? B : 1;
    const uint8_t* w = pack + block * block_bytes;
    const uint8_t* later = block + 2 * blocks <= end ? w + blocks * block_bytes : nullptr;
    for (int64_t g0 = 0; g0 < groups; g0 += kCodeGroupsPerTile) {
      const int64_t g1 = std::min(groups, g0 + kCodeGroupsPerTile);
      for (int64_t pass = 0, r = 0; pass < passes; ++pass) {
        const int64_t here = (rows - r) / (passes - pass);
        const uint8_t* ahead = pass == 0 ? later : nullptr;
        const int64_t o = block * kStreamBlock;
        if (blocks == B)
          code_pass<Format, Wide, B>(here, x + r * I, I, w, block_bytes, g0, g1, ahead, y + r * O, O, o);
        else
          code_pass<Format, Wide, 1>(here, x + r * I, I, w, block_bytes, g0, g1, ahead, y + r * O, O, o);
        r += here;
      }
    }
    block += blocks;
  }
}

// AVX-512: four blocks a tile for up to kCode512WideRows rows, two for more. AVX2: four blocks for one row, two
// for two, one for more (code_half_tile's 8 sums).
template <typename Format>
void code_blocks(bool wide, const float* x, int64_t rows, const uint8_t* pack, int64_t I, int64_t O, int64_t begin,
                 int64_t end, float* y) {
  if (!wide && rows == 1)
    code_tiles<Format, false, 4>(x, rows, 1, pack, I, O, begin, end, y);
  else if (!wide && rows == 2)
    code_tiles<Format, false, 2>(x, rows, 2, pack, I, O, begin, end, y);
  else if (!wide)
    code_tiles<Format, false, 1>(x, rows, kCodeMaxRowsPerPass, pack, I, O, begin, end, y);
  else if (rows <= kCode512WideRows)
    code_tiles<Format, true, 4>(x, rows, kCode512WideRows, pack, I, O, begin, end, y);
  else
    code_tiles<Format, true, 2>(x, rows, kCode512MaxRowsPerPass, pack, I, O, begin, end, y);
}

// e^x for x <= 0 (softmax's shifted scores), lane by lane: Cephes' expf (range reduction by ln 2 in
// two parts, a degree-5 polynomial), within a few ulp of the exact value. A lane's result depends on
// that lane alone, so a score's weight is the same in any vector of scores.
AVX2 inline __m256 exp_lanes(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// The sums of four accumulators: accumulator t's is ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of
// its lanes l, whichever slot it takes.
AVX2 inline __m128 four_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

constexpr int64_t kAheadKeys = 32;  // how far ahead of the keys and values in use the next ones are asked for

// Asks the L1 cache for the `floats` floats from `row` (a key's or a value's), a line at a time.
inline void prefetch_row(const float* row, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}
constexpr int64_t kAttendKeys = 4;  // keys whose dot products with a query are summed side by side
alignas(32) const float kZeroRow[256] = {};  // the key of an empty slot in a block of keys

// Scores q_i . k * scaling of G queries (one row's heads that share a K/V head) with the keys `seen`,
// into scores + i * room; returns each query's maximum in top. A key's dot product with a query is
// summed in one fixed order (four_sums over head_dim's 8-lane vectors, then its last head_dim % 8
// products in order) whatever block and slot the key takes and whichever queries run beside it.
template <int G>
AVX2 void group_scores(const float* const* q, const float* keys, int64_t key_stride, const int32_t* seen,
                       int64_t count, int64_t head_dim, float scaling, float* scores, int64_t room, float* top) {
  const int64_t vectors = head_dim / 8;
  __m128 best[G];  // each query's running maximum, lane by lane
  for (int i = 0; i < G; ++i) best[i] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < count; j0 += kAttendKeys) {
    const float* k[kAttendKeys];
    for (int64_t t = 0; t < kAttendKeys; ++t) k[t] = j0 + t < count ? keys + seen[j0 + t] * key_stride : kZeroRow;
    __m256 acc[G][kAttendKeys];
    for (int i = 0; i < G; ++i)
      for (int64_t t = 0; t < kAttendKeys; ++t) acc[i][t] = _mm256_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      __m256 kv[kAttendKeys];
      for (int64_t t = 0; t < kAttendKeys; ++t) kv[t] = _mm256_loadu_ps(k[t] + 8 * v);
      for (int i = 0; i < G; ++i) {
        const __m256 qv = _mm256_loadu_ps(q[i] + 8 * v);
        for (int64_t t = 0; t < kAttendKeys; ++t) acc[i][t] = _mm256_fmadd_ps(qv, kv[t], acc[i][t]);
      }
    }
    const int64_t here = std::min(kAttendKeys, count - j0);
    const __m128 live = _mm_castsi128_ps(_mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(here)), _mm_setr_epi32(0, 1, 2, 3)));
    for (int i = 0; i < G; ++i) {
      __m128 dots = four_sums(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      if (vectors * 8 < head_dim) {  // the last head_dim % 8 products, in order
        alignas(16) float sums[kAttendKeys];
        _mm_store_ps(sums, dots);
        for (int64_t t = 0; t < here; ++t)
          for (int64_t d = vectors * 8; d < head_dim; ++d) sums[t] = std::fma(q[i][d], k[t][d], sums[t]);
        dots = _mm_load_ps(sums);
      }
      const __m128 scaled = _mm_mul_ps(dots, _mm_set1_ps(scaling));
      _mm_storeu_ps(scores + i * room + j0, scaled);  // room holds a block past count
      best[i] = _mm_max_ps(best[i], _mm_blendv_ps(_mm_set1_ps(-std::numeric_limits<float>::infinity()), scaled, live));
    }
  }
  for (int i = 0; i < G; ++i) {
    __m128 m = _mm_max_ps(best[i], _mm_movehl_ps(best[i], best[i]));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    top[i] = _mm_cvtss_f32(m);
  }
}

// Each query's scores turned into softmax weights in place (e^(score - top), by exp_lanes, 8 at a time;
// a vector's lanes past count are left out) and their sum (8 lane sums over the keys in order, then
// lane_sum).
AVX2 float softmax_weights(float* scores, int64_t count, float top) {
  const int64_t padded = (count + 7) / 8 * 8;
  for (int64_t j = count; j < padded; ++j) scores[j] = top;
  const __m256 shift = _mm256_set1_ps(top);
  for (int64_t j = 0; j < padded; j += 8)
    _mm256_storeu_ps(scores + j, exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift)));
  for (int64_t j = count; j < padded; ++j) scores[j] = 0.0f;
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(scores + j));
  return lane_sum(total);
}

// acc_i[8c .. 8c + 8C) = sum over the keys, in order, of weight_ij * value_j (acc_i = acc + i *
// head_dim), for the C vectors from c: one fused multiply-add per key and lane, the same for any G.
template <int G, int C>
AVX2 void group_values(const float* weights, int64_t room, const float* values, int64_t value_stride,
                       const int32_t* seen, int64_t count, int64_t c, int64_t head_dim, float* acc_out) {
  __m256 acc[G][C];
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < C; ++u) acc[i][u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const float* value = values + seen[j] * value_stride + 8 * c;
    __m256 vv[C];
    for (int u = 0; u < C; ++u) vv[u] = _mm256_loadu_ps(value + 8 * u);
    for (int i = 0; i < G; ++i) {
      const __m256 weight = _mm256_set1_ps(weights[i * room + j]);
      for (int u = 0; u < C; ++u) acc[i][u] = _mm256_fmadd_ps(weight, vv[u], acc[i][u]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < C; ++u) _mm256_storeu_ps(acc_out + i * head_dim + 8 * (c + u), acc[i][u]);
}

// group_values with AVX-512 for the 16-lane vectors [c, c + C) of a head (2C of group_values' vectors), so
// that a head of 64 takes one pass over the keys: each lane's sum is the same fused multiply-adds in the
// same order as in group_values.
template <int G, int C>
AVX512 void group_values_512(const float* weights, int64_t room, const float* values, int64_t value_stride,
                             const int32_t* seen, int64_t count, int64_t c, int64_t head_dim, float* acc_out) {
  __m512 acc[G][C];
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < C; ++u) acc[i][u] = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    if (j + kAheadKeys < count) prefetch_row(values + seen[j + kAheadKeys] * value_stride + 16 * c, 16 * C);
    const float* value = values + seen[j] * value_stride + 16 * c;
    __m512 vv[C];
    for (int u = 0; u < C; ++u) vv[u] = _mm512_loadu_ps(value + 16 * u);
    for (int i = 0; i < G; ++i) {
      const __m512 weight = _mm512_set1_ps(weights[i * room + j]);
      for (int u = 0; u < C; ++u) acc[i][u] = _mm512_fmadd_ps(weight, vv[u], acc[i][u]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < C; ++u) _mm512_storeu_ps(acc_out + i * head_dim + 16 * (c + u), acc[i][u]);
}

// The 16-lane vectors of a head's weighted values through group_values_512, four at a time; returns how
// many 8-lane vectors that covered.
template <int G>
AVX512 int64_t wide_values(const float* weights, int64_t room, const float* values, int64_t value_stride,
                           const int32_t* seen, int64_t count, int64_t head_dim, float* acc) {
  const int64_t blocks = head_dim / 16;
  int64_t c = 0;
  for (; c + 4 <= blocks; c += 4)
    group_values_512<G, 4>(weights, room, values, value_stride, seen, count, c, head_dim, acc);
  for (; c < blocks; ++c) group_values_512<G, 1>(weights, room, values, value_stride, seen, count, c, head_dim, acc);
  return 2 * blocks;
}

constexpr int64_t kWideKeys = 8;  // keys per block of group_scores_512

// _mm256_hadd_ps's sums for 512-bit vectors: in each 128-bit lane, [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
AVX512 inline __m512 pair_sums(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// four_sums of two queries at once: a_t holds query A's accumulator for key t in lanes 0-7 and query B's
// in lanes 8-15; returns A's four sums in lanes 0-3 and B's in lanes 4-7, each added as four_sums adds it.
AVX512 inline __m256 four_sums_pair(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 h = pair_sums(pair_sums(a0, a1), pair_sums(a2, a3));  // 128-bit lanes: A 0-3, A 4-7, B 0-3, B 4-7
  const __m512 low = _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 high = _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(3, 1, 3, 1));
  return _mm512_castps512_ps256(_mm512_add_ps(low, high));
}

// group_scores with AVX-512 for G of 2 to 4 queries, kWideKeys keys a block: the queries go in pairs, one
// per 256-bit half of a vector, and each key's 8-lane vector is broadcast to both halves, so every half
// accumulates what group_scores' accumulator does and four_sums_pair adds as four_sums does: the same
// floats. An odd G's last pair repeats its query.
template <int G>
AVX512 void group_scores_512(const float* const* q, const float* keys, int64_t key_stride, const int32_t* seen,
                             int64_t count, int64_t head_dim, float scaling, float* scores, int64_t room, float* top) {
  constexpr int P = (G + 1) / 2;
  const int64_t vectors = head_dim / 8;
  alignas(64) float pairs[P][2 * 256];  // pair p's vector v at 16 * v: query 2p's lanes, then its partner's
  for (int p = 0; p < P; ++p)
    for (int64_t v = 0; v < vectors; ++v) {
      std::copy_n(q[2 * p] + 8 * v, 8, pairs[p] + 16 * v);
      std::copy_n(q[std::min(2 * p + 1, G - 1)] + 8 * v, 8, pairs[p] + 16 * v + 8);
    }
  __m256 best[G];  // each query's running maximum, lane by lane
  for (int i = 0; i < G; ++i) best[i] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < count; j0 += kWideKeys) {
    const float* k[kWideKeys];
    for (int64_t t = 0; t < kWideKeys; ++t) k[t] = j0 + t < count ? keys + seen[j0 + t] * key_stride : kZeroRow;
    for (int64_t t = 0; t < kWideKeys && j0 + kAheadKeys + t < count; ++t)
      prefetch_row(keys + seen[j0 + kAheadKeys + t] * key_stride, head_dim);
    __m512 acc[P][kWideKeys];
    for (int p = 0; p < P; ++p)
      for (int64_t t = 0; t < kWideKeys; ++t) acc[p][t] = _mm512_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      __m512 qv[P];
      for (int p = 0; p < P; ++p) qv[p] = _mm512_load_ps(pairs[p] + 16 * v);
      for (int64_t t = 0; t < kWideKeys; ++t) {
        const __m512 kv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(k[t] + 8 * v))));
        for (int p = 0; p < P; ++p) acc[p][t] = _mm512_fmadd_ps(qv[p], kv, acc[p][t]);
      }
    }
    const int64_t here = std::min(kWideKeys, count - j0);
    const __m256 live = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(here)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
#pragma GCC unroll 2  // the accumulators stay in registers
    for (int p = 0; p < P; ++p) {
      const __m256 first = four_sums_pair(acc[p][0], acc[p][1], acc[p][2], acc[p][3]);
      const __m256 second = four_sums_pair(acc[p][4], acc[p][5], acc[p][6], acc[p][7]);
      for (int half = 0; half < 2 && 2 * p + half < G; ++half) {
        const int i = 2 * p + half;
        __m256 dots = half == 0 ? _mm256_permute2f128_ps(first, second, 0x20)
                                : _mm256_permute2f128_ps(first, second, 0x31);
        if (vectors * 8 < head_dim) {  // the last head_dim % 8 products, in order
          alignas(32) float sums[kWideKeys];
          _mm256_store_ps(sums, dots);
          for (int64_t t = 0; t < here; ++t)
            for (int64_t d = vectors * 8; d < head_dim; ++d) sums[t] = std::fma(q[i][d], k[t][d], sums[t]);
          dots = _mm256_load_ps(sums);
        }
        const __m256 scaled = _mm256_mul_ps(dots, _mm256_set1_ps(scaling));
        _mm256_storeu_ps(scores + i * room + j0, scaled);  // room holds a block past count
        const __m256 none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        best[i] = _mm256_max_ps(best[i], _mm256_blendv_ps(none, scaled, live));
      }
    }
  }
  for (int i = 0; i < G; ++i) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(best[i]), _mm256_extractf128_ps(best[i], 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    top[i] = _mm_cvtss_f32(m);
  }
}

// The attention of G queries of one row that read the same K/V head, over the keys `seen` (count of
// them, ascending): the sum of each query's softmax weights e^(score - its top score) (sum[i]) and its
// weighted sum of the values (acc + i * head_dim). Every step computes each query alone (group_scores,
// softmax_weights, group_values), so the result depends on its query and keys only. `scores`: G * room
// floats, room >= count rounded up to 8, plus 8.
template <int G>
AVX2 void attend_group_simd(const float* const* q, const float* keys, int64_t key_stride, const float* values,
                            int64_t value_stride, const int32_t* seen, int64_t count, int64_t head_dim, float scaling,
                            float* scores, int64_t room, float* sum, float* acc, bool wide) {
  float top[G];
  if (wide && G > 1)  // a lone query would fill half of each vector: group_scores is as fast
    group_scores_512<G>(q, keys, key_stride, seen, count, head_dim, scaling, scores, room, top);
  else
    group_scores<G>(q, keys, key_stride, seen, count, head_dim, scaling, scores, room, top);
  for (int i = 0; i < G; ++i) sum[i] = softmax_weights(scores + i * room, count, top[i]);
  const int64_t vectors = head_dim / 8;
  constexpr int C = G >= 3 ? 2 : 4;  // value vectors per pass over the keys: the G * C accumulators, C value
                                     // vectors and a weight stay in the 16 vector registers
  int64_t c = wide ? wide_values<G>(scores, room, values, value_stride, seen, count, head_dim, acc) : 0;
  for (; c + C <= vectors; c += C) group_values<G, C>(scores, room, values, value_stride, seen, count, c, head_dim, acc);
  for (; c < vectors; ++c) group_values<G, 1>(scores, room, values, value_stride, seen, count, c, head_dim, acc);
  for (int i = 0; i < G; ++i)
    for (int64_t d = vectors * 8; d < head_dim; ++d) {
      float total = 0.0f;
      for (int64_t j = 0; j < count; ++j) total = std::fma(scores[i * room + j], values[seen[j] * value_stride + d], total);
      acc[i * head_dim + d] = total;
    }
}

// attend_group_simd for any number of queries, four or fewer at a time (which ones run together
// changes no result).
AVX2 void attend_queries_simd(const float* const* q, int64_t queries, const float* keys, int64_t key_stride,
                              const float* values, int64_t value_stride, const int32_t* seen, int64_t count,
                              int64_t head_dim, float scaling, float* scores, int64_t room, float* sum, float* acc,
                              bool wide) {
  for (int64_t i = 0; i < queries;) {
    const int64_t here = std::min<int64_t>(queries - i, 4);
    float* a = acc + i * head_dim;
    if (here == 4) attend_group_simd<4>(q + i, keys, key_stride, values, value_stride, seen, count, head_dim, scaling, scores, room, sum + i, a, wide);
    if (here == 3) attend_group_simd<3>(q + i, keys, key_stride, values, value_stride, seen, count, head_dim, scaling, scores, room, sum + i, a, wide);
    if (here == 2) attend_group_simd<2>(q + i, keys, key_stride, values, value_stride, seen, count, head_dim, scaling, scores, room, sum + i, a, wide);
    if (here == 1) attend_group_simd<1>(q + i, keys, key_stride, values, value_stride, seen, count, head_dim, scaling, scores, room, sum + i, a, wide);
    i += here;
  }
}
#undef AVX2
#endif  // DRAFTSMITH_X86

// attend_queries_simd without vectors (CPUs without AVX2 and FMA): the same steps for each query alone,
// each sum in key order.
void attend_queries_scalar(const float* const* q, int64_t queries, const float* keys, int64_t key_stride,
                           const float* values, int64_t value_stride, const int32_t* seen, int64_t count,
                           int64_t head_dim, float scaling, float* scores, float* sum, float* acc) {
  for (int64_t i = 0; i < queries; ++i) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) {
      const float* k = keys + seen[j] * key_stride;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot = std::fma(q[i][d], k[d], dot);
      scores[j] = dot * scaling;
      top = std::max(top, scores[j]);
    }
    sum[i] = 0.0f;
    for (int64_t j = 0; j < count; ++j) sum[i] += scores[j] = std::exp(scores[j] - top);
    float* a = acc + i * head_dim;
    std::fill_n(a, head_dim, 0.0f);
    for (int64_t j = 0; j < count; ++j)
      for (int64_t d = 0; d < head_dim; ++d) a[d] = std::fma(scores[j], values[seen[j] * value_stride + d], a[d]);
  }
}

// Each query's output: its weighted sum of the values divided by the sum of its weights.
void divide_rows(int64_t queries, int64_t head_dim, const float* sums, const float* accs, float* const* out) {
  for (int64_t i = 0; i < queries; ++i)
    for (int64_t d = 0; d < head_dim; ++d) out[i][d] = accs[i * head_dim + d] / sums[i];
}

// The keys query row r (of rows, over `length` keys) of batch b and head h sees, ascending, into `seen`;
// returns how many. mask: none (every key, or with `causal` the first length - rows + r + 1), else
// (batch or 1, heads or 1, rows, length) as `mask_strides` reads it, bool (true: seen) or float (0: seen;
// -inf or the dtype's lowest: not).
int64_t seen_keys(const at::Tensor* mask, const int64_t* mask_strides, bool causal, int64_t b, int64_t h, int64_t r,
                  int64_t rows, int64_t length, int32_t* seen) {
  int64_t count = 0;
  if (mask == nullptr) {
    const int64_t last = causal ? length - rows + r + 1 : length;
    for (int64_t j = 0; j < last; ++j) seen[count++] = static_cast<int32_t>(j);
    return count;
  }
  const int64_t offset = b * mask_strides[0] + h * mask_strides[1] + r * mask_strides[2];
  if (mask->scalar_type() == at::kBool) {
    const bool* m = mask->data_ptr<bool>() + offset;
    for (int64_t j = 0; j < length; ++j)
      if (m[j * mask_strides[3]]) seen[count++] = static_cast<int32_t>(j);
    return count;
  }
  const float* m = mask->data_ptr<float>() + offset;
  for (int64_t j = 0; j < length; ++j) {
    const float bias = m[j * mask_strides[3]];
    TORCH_CHECK(bias == 0.0f || bias < -1e30f, "attend: an additive mask holds only 0 (seen) and -inf or the lowest float");
    if (bias == 0.0f) seen[count++] = static_cast<int32_t>(j);
  }
  return count;
}

}  // namespace

// Whether int16_screen and stream_linear run on this CPU (an x86-64 one with AVX2 and FMA); elsewhere the
// runtime keeps torch's int8 product and another linear kernel.
bool simd_supported() {
#ifdef DRAFTSMITH_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// Uninitialised tensors carved from 2 MB-aligned mappings of at least kHugeChunk bytes, which the
// kernel is asked to back with transparent huge pages (Linux, where they are enabled or "madvise"): a
// forward streams ~0.5 GB of packs, and with 4 KB pages every 4 KB of that stream needs its own address
// translation. Packs made one after the other share a mapping, so few huge pages are left part-used; a
// mapping goes when its last tensor and the allocator have let go of it; a tensor of kHugeChunk bytes or
// more gets a mapping of its own.
#ifdef __linux__
struct HugeMapping {
  void* base;
  size_t bytes;
  size_t used = 0;
  ~HugeMapping() { munmap(base, bytes); }
};

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kHugeChunk = size_t(64) << 20;

std::shared_ptr<HugeMapping> map_huge(size_t bytes) {
  bytes = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* mapped = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(mapped);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(mapped, aligned - start);
  if (start + kHugePage > aligned) munmap(reinterpret_cast<void*>(aligned + bytes), start + kHugePage - aligned);
  void* base = reinterpret_cast<void*>(aligned);
  madvise(base, bytes, MADV_HUGEPAGE);  // advice only: ordinary pages where it is not taken
  return std::shared_ptr<HugeMapping>(new HugeMapping{base, bytes});
}
#endif

at::Tensor huge_page_empty(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
#ifdef __linux__
  static std::mutex lock;
  static std::shared_ptr<HugeMapping> current;
  int64_t count = 1;
  for (int64_t size : shape) count *= size;
  const size_t bytes = (std::max<int64_t>(count, 1) * at::elementSize(dtype) + 63) / 64 * 64;
  std::lock_guard<std::mutex> guard(lock);
  std::shared_ptr<HugeMapping> holder;
  if (bytes >= kHugeChunk) {  // a mapping of its own, gone with the tensor
    holder = map_huge(bytes);
  } else {
    if (current == nullptr || current->used + bytes > current->bytes) current = map_huge(kHugeChunk);
    holder = current;
  }
  if (holder == nullptr) return at::empty(shape, options);
  void* data = static_cast<char*>(holder->base) + holder->used;
  holder->used += bytes;
  return torch::from_blob(data, shape, [holder](void*) mutable { holder.reset(); }, options);
#else
  return at::empty(shape, options);
#endif
}

namespace {

// Whether the 32 weights w are fl(fl(d * q) + m) for codes q in 0..15, m their least and d a float16 value
// near (greatest - least) / 15 (how a Q4_1 block is dequantised): then d, m and the codes are set.
bool affine_codes(const float* w, float* d, float* m, uint8_t* codes) {
  float least = w[0], greatest = w[0];
  for (int64_t i = 1; i < kCodeGroup; ++i) {
    least = std::min(least, w[i]);
    greatest = std::max(greatest, w[i]);
  }
  if (!std::isfinite(least) || !std::isfinite(greatest)) return false;
  const uint16_t nearest = c10::Half((greatest - least) / 15.0f).x;
  for (const int offset : {0, 1, -1, 2, -2}) {
    const float step = static_cast<float>(c10::Half(static_cast<uint16_t>(nearest + offset), c10::Half::from_bits()));
    if (!std::isfinite(step) || step < 0.0f) continue;
    bool exact = true;
    for (int64_t i = 0; i < kCodeGroup && exact; ++i) {
      const float code = step > 0.0f ? std::nearbyint((w[i] - least) / step) : 0.0f;
      codes[i] = static_cast<uint8_t>(std::clamp(code, 0.0f, 15.0f));
      const float product = step * static_cast<float>(codes[i]);
      const float rebuilt = product + least;
      exact = std::memcmp(&rebuilt, &w[i], sizeof rebuilt) == 0;
    }
    if (exact) {
      *d = step;
      *m = least;
      return true;
    }
  }
  return false;
}

// Whether the 32 weights w are d * q for codes q in -128..127 and d a float16 value near their greatest
// magnitude / 127 (how a Q8_0 block is dequantised): then d and the codes are set.
bool scaled_codes(const float* w, float* d, int8_t* codes) {
  float greatest = 0.0f;
  for (int64_t i = 0; i < kCodeGroup; ++i) greatest = std::max(greatest, std::fabs(w[i]));
  if (!std::isfinite(greatest)) return false;
  const uint16_t nearest = c10::Half(greatest / 127.0f).x;
  for (const int offset : {0, 1, -1, 2, -2}) {
    const float step = static_cast<float>(c10::Half(static_cast<uint16_t>(nearest + offset), c10::Half::from_bits()));
    if (!std::isfinite(step) || step < 0.0f) continue;
    bool exact = true;
    for (int64_t i = 0; i < kCodeGroup && exact; ++i) {
      const float code = step > 0.0f ? std::nearbyint(w[i] / step) : 0.0f;
      codes[i] = static_cast<int8_t>(std::clamp(code, -128.0f, 127.0f));
      const float rebuilt = step * static_cast<float>(codes[i]);
      exact = std::memcmp(&rebuilt, &w[i], sizeof rebuilt) == 0;
    }
    if (exact) {
      *d = step;
      return true;
    }
  }
  return false;
}

// A code pack of a float32 weight (O, I) as `dtype` with `group_bytes` a group (see kCodeGroup and
// kByteGroupBytes), or an undefined tensor where a weight is not so rebuilt (or O is not a multiple of 16,
// or I of 32). encode(w, group, j) writes output j's step(s) and codes for the 32 weights w into the
// group's bytes, or returns false.
template <typename Encode>
at::Tensor group_pack(const at::Tensor& weight, int64_t group_bytes, at::ScalarType dtype, Encode encode) {
  const int64_t O = weight.size(0), I = weight.size(1);
  if (O % kStreamBlock != 0 || I % kCodeGroup != 0) return at::Tensor();
  const at::Tensor values = weight.contiguous();
  const float* wp = values.data_ptr<float>();
  const int64_t groups = I / kCodeGroup;
  at::Tensor staged = at::empty({O / kStreamBlock, groups * group_bytes}, at::kByte);
  uint8_t* sp = staged.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, O / kStreamBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end && exact.load(std::memory_order_relaxed); ++block)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < kStreamBlock; ++j)
          if (!encode(wp + (block * kStreamBlock + j) * I + g * kCodeGroup, sp + (block * groups + g) * group_bytes, j)) {
            exact = false;
            return;
          }
  });
  if (!exact) return at::Tensor();
  at::Tensor pack = huge_page_empty({O / kStreamBlock, groups * group_bytes}, dtype);
  return pack.copy_(staged.view(dtype));
}

// The 4-bit code pack (see kCodeGroup), or an undefined tensor.
at::Tensor code_pack(const at::Tensor& weight) {
  return group_pack(weight, kCodeGroupBytes, at::kByte, [](const float* w, uint8_t* group, int64_t j) {
    float* steps = reinterpret_cast<float*>(group);
    uint8_t codes[kCodeGroup];
    if (!affine_codes(w, &steps[j], &steps[kStreamBlock + j], codes)) return false;
    uint8_t* pairs = group + 2 * kStreamBlock * sizeof(float);
    for (int64_t pair = 0; pair < kCodeGroup / 2; ++pair)
      pairs[pair * kStreamBlock + j] = static_cast<uint8_t>(codes[2 * pair] | (codes[2 * pair + 1] << 4));
    return true;
  });
}

// The 8-bit code pack (see kByteGroupBytes), or an undefined tensor.
at::Tensor byte_pack(const at::Tensor& weight) {
  return group_pack(weight, kByteGroupBytes, at::kChar, [](const float* w, uint8_t* group, int64_t j) {
    float* steps = reinterpret_cast<float*>(group);
    int8_t codes[kCodeGroup];
    if (!scaled_codes(w, &steps[j], codes)) return false;
    uint8_t* bytes = group + kStreamBlock * sizeof(float);
    for (int64_t k = 0; k < kCodeGroup; ++k) bytes[k * kStreamBlock + j] = static_cast<uint8_t>(codes[k]);
    return true;
  });
}

}  // namespace

// The stream pack of a float32 weight (O, I) (see stream_blocks): with `narrow`, 4-bit codes where they
// rebuild every weight (code_pack; with `codes`), else bfloat16 where every weight is a bfloat16 value
// (bit for bit: -0 and +0 kept apart), else float32.
at::Tensor stream_pack(const at::Tensor& weight, bool narrow, bool codes) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "stream_pack: a float32 (out, in) weight");
  if (narrow && codes) {
    for (const auto& pack_of : {code_pack, byte_pack}) {
      const at::Tensor coded = pack_of(weight);
      if (coded.defined()) return coded;
    }
  }
  const int64_t O = weight.size(0), I = weight.size(1), full = O / kStreamBlock * kStreamBlock;
  const at::Tensor halves = weight.to(at::kBFloat16);
  const bool exact = narrow && at::equal(halves.view(at::kShort).to(at::kInt).bitwise_left_shift(16),
                                         weight.contiguous().view(at::kInt));
  const at::Tensor values = exact ? halves : weight;
  at::Tensor pack = huge_page_empty({O, I}, values.scalar_type());
  pack.narrow(0, 0, full)
      .view({full / kStreamBlock, I, kStreamBlock})
      .copy_(values.narrow(0, 0, full).reshape({full / kStreamBlock, kStreamBlock, I}).transpose(1, 2));
  pack.narrow(0, full, O - full).view({I, O - full}).copy_(values.narrow(0, full, O - full).t());
  return pack;
}

// The instruction set "auto" takes in every kernel (set_isa): kNoChoice until the runtime has timed the paths
// on this CPU (linear_choice.py) or been told one (DRAFTSMITH_ISA, a test), then kAvx2 or kAvx512.
constexpr int kNoChoice = -1, kAvx2 = 0, kAvx512 = 1;
std::atomic<int> chosen_isa{kNoChoice};

// The widest instruction set DRAFTSMITH_MAX_CPU_ISA (read once, as oneDNN's ONEDNN_MAX_CPU_ISA) lets the
// kernels take: "avx2", "avx512" (no AMX tiles) or "amx" (the default: no cap).
const std::string& isa_cap() {
  static const std::string cap = [] {
    const std::string value = std::getenv("DRAFTSMITH_MAX_CPU_ISA") ? std::getenv("DRAFTSMITH_MAX_CPU_ISA") : "";
    if (value == "avx2" || value == "avx512" || value == "amx") return value;
    if (!value.empty())
      TORCH_WARN("DRAFTSMITH_MAX_CPU_ISA=", value, " is neither avx2, avx512 nor amx; ignored (the kernels take ",
                 "the widest instructions this CPU has)");
    return std::string("amx");
  }();
  return cap;
}

// Whether this CPU runs the AVX-512 kernels and DRAFTSMITH_MAX_CPU_ISA does not cap them at AVX2.
bool avx512_allowed() {
#ifdef DRAFTSMITH_X86
  return __builtin_cpu_supports("avx512f") && isa_cap() != "avx2";
#else
  return false;
#endif
}

// Whether this CPU has AVX-512's byte/word instructions and VNNI, which the screen's VNNI sums take (Intel since
// Cascade Lake, AMD since Zen 4).
bool cpu_has_vnni() {
#ifdef DRAFTSMITH_X86
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// Whether the screen's sums take AVX-512 VNNI here with isa "auto": the AVX-512 kernels allowed, and VNNI.
bool vnni_supported() { return simd_supported() && avx512_allowed() && cpu_has_vnni(); }

// Whether the screen's sums may run on AMX tiles: a CPU with AMX-TILE and AMX-INT8 (CPUID leaf 7), Linux
// granting this process the tiles' state (asked once), the VNNI screen's instructions, and no cap below "amx".
bool amx_allowed() {
#if defined(DRAFTSMITH_X86) && defined(__linux__)
  static const bool granted = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted && isa_cap() == "amx" && cpu_has_vnni();
#else
  return false;
#endif
}

// Whether a kernel (`what`: stream_linear, int16_screen, screen_contenders, proven_argmax, attend) runs its
// AVX-512 code: `isa` "auto" (the path set_isa chose, else AVX-512 where avx512_allowed()), "avx2", "avx512"
// or "amx" (AVX-512, and the screen's sums on AMX tiles: screen_tiles). The choice is speed only: the stream
// kernel's floats are the same either way, the screen's integer sums are exact, the contender search and the
// attention compute the same floats, and the proof's float64 sums are of the same exact products (its bound
// holds in any order).
bool wide_vectors(const std::string& isa, const char* what) {
  TORCH_CHECK(isa == "auto" || isa == "avx2" || isa == "avx512" || isa == "amx", what,
              ": isa 'auto', 'avx2', 'avx512' or 'amx', not '", isa, "'");
#ifdef DRAFTSMITH_X86
  TORCH_CHECK(__builtin_cpu_supports("avx512f") || isa == "avx2" || isa == "auto", what, ": this CPU has no AVX-512F");
  TORCH_CHECK(isa != "amx" || amx_allowed(), what, ": AMX tiles do not run here (",
              isa_cap() == "amx" ? "this CPU or OS has none" : "DRAFTSMITH_MAX_CPU_ISA caps them", ")");
  if (isa != "auto") return isa != "avx2";
  const int chosen = chosen_isa.load(std::memory_order_relaxed);
  return chosen == kNoChoice ? avx512_allowed() : chosen == kAvx512;
#else
  return false;
#endif
}

// The instruction sets whose kernels run here, narrowest first: what set_isa takes.
std::vector<std::string> isas_available() {
  if (!simd_supported()) return {};
  if (!avx512_allowed()) return {"avx2"};
  return {"avx2", "avx512"};
}

// The path "auto" takes from now on in every kernel, process-wide ("auto": no choice, AVX-512 where allowed).
void set_isa(const std::string& isa) {
  if (isa == "auto") {
    chosen_isa = kNoChoice;
    return;
  }
  const std::vector<std::string> paths = isas_available();
  std::string runs;
  for (const std::string& path : paths) runs += (runs.empty() ? "" : ", ") + path;
  TORCH_CHECK(std::find(paths.begin(), paths.end(), isa) != paths.end(), "set_isa: '", isa,
              "' does not run on this CPU (it runs: ", runs.empty() ? "none" : runs, ")");
  chosen_isa = isa == "avx512" ? kAvx512 : kAvx2;
}

// The path "auto" takes now: "avx2" or "avx512" ("none" off x86-64 or without AVX2 and FMA).
std::string isa_in_use() {
  if (!simd_supported()) return "none";
  return wide_vectors("auto", "isa_in_use") ? "avx512" : "avx2";
}

// rows (..., I) float32 times the weight packed in `pack` (O, I), bias-free: (..., O). Only where
// simd_supported().
at::Tensor stream_linear(const at::Tensor& rows, const at::Tensor& pack, const std::string& isa) {
  RECORD_FUNCTION("draftsmith::stream_linear", std::vector<c10::IValue>());  // named in bench-tree --profile
  TORCH_CHECK(simd_supported(), "stream_linear: needs an x86-64 CPU with AVX2 and FMA");
  const bool nibbles = pack.scalar_type() == at::kByte, bytes = pack.scalar_type() == at::kChar;
  const int64_t group_bytes = nibbles ? kCodeGroupBytes : kByteGroupBytes;
  TORCH_CHECK(pack.dim() == 2 && (pack.scalar_type() == at::kFloat || pack.scalar_type() == at::kBFloat16 || nibbles || bytes) &&
                  pack.is_contiguous() && (!(nibbles || bytes) || pack.size(1) % group_bytes == 0),
              "stream_linear: pack");
  const int64_t O = nibbles || bytes ? pack.size(0) * kStreamBlock : pack.size(0);
  const int64_t I = nibbles || bytes ? pack.size(1) / group_bytes * kCodeGroup : pack.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.size(-1) == I, "stream_linear: rows");
  const int64_t count = rows.numel() / I;
  // the layers' products pass contiguous (rows, I) matrices: no reshape and no view back, two calls less
  const bool flat = rows.dim() == 2 && rows.is_contiguous();
  const at::Tensor x = flat ? rows : rows.reshape({count, I}).contiguous();
  at::Tensor y = float_empty({count, O});
#ifdef DRAFTSMITH_X86
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool wide = wide_vectors(isa, "stream_linear");
  auto product = [&](auto* pp) {
    at::parallel_for(0, O / kStreamBlock, 4, [&](int64_t begin, int64_t end) {
      if (wide)
        stream_blocks_512(xp, count, pp, I, O, begin, end, yp);
      else
        stream_blocks(xp, count, pp, I, O, begin, end, yp);
    });
    stream_tail(xp, count, pp, I, O, yp);
  };
  if (nibbles || bytes)
    at::parallel_for(0, O / kStreamBlock, 4, [&](int64_t begin, int64_t end) {
      const uint8_t* pp = static_cast<const uint8_t*>(pack.data_ptr());
      if (nibbles)
        code_blocks<FourBitCodes>(wide, xp, count, pp, I, O, begin, end, yp);
      else
        code_blocks<ByteCodes>(wide, xp, count, pp, I, O, begin, end, yp);
    });
  else if (pack.scalar_type() == at::kBFloat16)
    product(reinterpret_cast<const Bfloat16Bits*>(pack.data_ptr<at::BFloat16>()));
  else
    product(pack.data_ptr<float>());
#endif
  if (flat) return y;
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = O;
  return y.view(shape);
}

// Whether int16_screen's sums take AVX-512 VNNI for `isa`.
bool vnni_sums(const std::string& isa) { return wide_vectors(isa, "int16_screen") && cpu_has_vnni(); }

// Whether int16_screen sums `rows` rows on AMX tiles for `isa`: "amx" (any rows), or "auto" where the AVX-512
// path is taken, amx_allowed() and rows >= tiles_from > 0. The tiles sum the same integers as VNNI, so which
// runs is speed alone: reading the weights bounds both at a few rows, where the tiles read them slower, and
// VNNI's multiply-adds bound it past that (the row count the tiles win from is timed per machine:
// context.py's tiles_from).
bool screen_tiles(const std::string& isa, int64_t rows, int64_t tiles_from) {
  const bool wide = vnni_sums(isa);
  return isa == "amx" || (isa == "auto" && wide && tiles_from > 0 && rows >= tiles_from && amx_allowed());
}

// Whether int16_screen runs on this CPU: wherever the kernels run (AVX2 and FMA); its sums take VNNI where
// `isa` takes the AVX-512 path and the CPU has AVX-512 VNNI (Intel since Cascade Lake, AMD since Zen 4), AVX2's
// vpmaddwd elsewhere, and AMX tiles where screen_tiles says so: the same integers on every path.
bool int16_screen_available(const std::string& isa) {
  wide_vectors(isa, "int16_screen");  // checks isa
  return simd_supported();
}

// The screened head's product for 16-bit integer rows: a_ri = bfloat16((float(S_ri) * x_scales_r) * s_i) with
// S_ri = sum_k x_rk q_ik exact in int32 (greedy_head.py picks |x| so that it cannot overflow) and each
// product after it rounded to float32; S summed by VNNI, or on AMX tiles where screen_tiles says so, K is a
// multiple of 64 and every |x| is at most kScreenTop. input (R, K) int16, x_scales (R) float32, quantized
// (V, K) int8 with K a multiple of 32, scales (V) bfloat16. Only where int16_screen_available(isa).
at::Tensor int16_screen(const at::Tensor& input, const at::Tensor& x_scales, const at::Tensor& quantized,
                        const at::Tensor& scales, const std::string& isa, int64_t tiles_from) {
  RECORD_FUNCTION("draftsmith::int16_screen", std::vector<c10::IValue>());  // named in bench-tree --profile
  TORCH_CHECK(int16_screen_available(isa), "int16_screen: needs an x86-64 CPU with AVX2 and FMA");
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kShort, "int16_screen: input");
  TORCH_CHECK(x_scales.dim() == 1 && x_scales.scalar_type() == at::kFloat && x_scales.size(0) == input.size(0),
              "int16_screen: x_scales");
  TORCH_CHECK(quantized.dim() == 2 && quantized.scalar_type() == at::kChar && quantized.is_contiguous() &&
                  quantized.size(1) == input.size(1) && quantized.size(1) % 32 == 0,
              "int16_screen: quantized");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.size(0) == quantized.size(0),
              "int16_screen: scales");
  const int64_t rows = input.size(0), K = input.size(1), V = quantized.size(0);
  const at::Tensor x = input.contiguous(), row_scales = x_scales.contiguous();
  at::Tensor sums = at::empty({rows, V}, x.options().dtype(at::kInt));
  at::Tensor screen = at::empty({rows, V}, x.options().dtype(at::kBFloat16));
#ifdef DRAFTSMITH_X86
  const int16_t* xp = x.data_ptr<int16_t>();
  const float* xs = row_scales.data_ptr<float>();
  const int8_t* qp = quantized.data_ptr<int8_t>();
  int32_t* sp = sums.data_ptr<int32_t>();
  const at::BFloat16* scale = scales.data_ptr<at::BFloat16>();
  at::BFloat16* out = screen.data_ptr<at::BFloat16>();
  bool tiles = K % kTileInputs == 0 && screen_tiles(isa, rows, tiles_from);
  std::vector<int8_t> digits;
  if (tiles) {
    const int64_t pass_bytes = K / kTileInputs * kTileDigitBytes;
    digits.resize((rows + kTileScreenRows - 1) / kTileScreenRows * pass_bytes);
    for (int64_t r0 = 0; r0 < rows && tiles; r0 += kTileScreenRows)
      tiles = tile_digits(xp, rows, K, r0, digits.data() + r0 / kTileScreenRows * pass_bytes);
  }
  const bool vnni = vnni_sums(isa), wide = wide_vectors(isa, "int16_screen");
  at::parallel_for(0, V, 2048, [&](int64_t begin, int64_t end) {
    if (tiles)
      tile_screen_rows(xp, digits.data(), rows, qp, K, V, begin, end, sp);
    else if (vnni)
      screen_rows<VnniScreen>(xp, rows, qp, K, V, begin, end, sp);
    else
      screen_rows<MaddScreen>(xp, rows, qp, K, V, begin, end, sp);
    for (int64_t r = 0; r < rows; ++r)
      if (wide)
        screen_floats(sp + r * V, xs[r], scale, begin, end, out + r * V);
      else
        for (int64_t i = begin; i < end; ++i)
          out[r * V + i] = at::BFloat16(static_cast<float>(sp[r * V + i]) * xs[r] * static_cast<float>(scale[i]));
  });
#endif
  return screen;
}

// A float32 4-d tensor's data as attend reads it: its first three strides (the last is 1).
struct Strided {
  const float* data;
  int64_t stride[3];
  const float* at(int64_t i, int64_t j, int64_t l) const { return data + i * stride[0] + j * stride[1] + l * stride[2]; }
};

Strided strided(const at::Tensor& t) { return {t.data_ptr<float>(), {t.stride(0), t.stride(1), t.stride(2)}}; }

// One attend call's inputs and output, and its work split into items: one per row and K/V head (the
// query heads reading it share the keys they see), or per row and head where the mask differs between
// heads.
struct AttendProblem {
  Strided q, k, v;  // (batch, heads, rows, head_dim), (batch, kv_heads, length or more, head_dim) twice
  const at::Tensor* mask;  // read as mask_strides say (0 where broadcast), its first `length` keys; or null
  int64_t mask_strides[4];
  bool causal;
  float scaling;
  bool simd;
  int64_t batch, heads, rows, head_dim, kv_heads, length;
  bool wide = false;  // the scores and weighted values with AVX-512 (the same floats)
  float* out = nullptr;  // (batch, rows, heads, head_dim)
  int64_t groups = heads / kv_heads;
  int64_t together = groups;  // set_together
  int64_t chunks = 1;  // items per K/V head and row: its query heads `together` at a time

  // Items of up to `together` query heads of one K/V head each (the last of a K/V head's may have
  // fewer): which heads share an item changes no result, since each query is computed alone.
  void set_together(int64_t heads_per_item) {
    together = heads_per_item;
    chunks = (groups + together - 1) / together;
  }

  bool mask_heads_differ() const { return mask_strides[1] != 0; }
  // Items go head by head, every row of a head in turn: a thread's consecutive items read the same K/V
  // head, which then stays in its core's cache instead of being fetched again for every row.
  int64_t items() const { return batch * kv_heads * chunks * rows; }
  int64_t b(int64_t item) const { return item / (rows * kv_heads * chunks); }
  int64_t r(int64_t item) const { return item % rows; }
  int64_t first(int64_t item) const {
    const int64_t chunk = item / rows % (kv_heads * chunks);
    return chunk / chunks * groups + chunk % chunks * together;
  }
  // the item's query heads: first(item) onwards
  int64_t heads_of(int64_t item) const { return std::min(together, (first(item) / groups + 1) * groups - first(item)); }
  // Whether every head of a row sees the same keys, listed once per row by list_seen_rows.
  bool seen_per_row() const { return mask != nullptr && !mask_heads_differ(); }

  // Every row's seen keys (seen_per_row), each row's list at row * length in `seen` and its length in
  // `counts`, so an item reads its row's list instead of scanning the mask again for every head.
  void list_seen_rows(std::vector<int32_t>& seen, std::vector<int64_t>& counts) const {
    seen.resize(batch * rows * length);
    counts.resize(batch * rows);
    // a tree's few rows scan a few thousand mask entries, less than a parallel region's start and end cost
    const int64_t rows_per_task = std::max<int64_t>(1, kSeenKeysGrain / std::max<int64_t>(length, 1));
    at::parallel_for(0, batch * rows, rows_per_task, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        counts[i] =
            seen_keys(mask, mask_strides, causal, i / rows, 0, i % rows, rows, length, seen.data() + i * length);
    });
  }

  // the item's seen keys into `seen`; how many
  int64_t seen(int64_t item, int32_t* seen) const {
    return seen_keys(mask, mask_strides, causal, b(item), first(item), r(item), rows, length, seen);
  }
  const float* query(int64_t item, int64_t i) const { return q.at(b(item), first(item) + i, r(item)); }
  // the item's attention over the keys seen[0, count): each query's sum of weights and weighted sum of
  // the values
  void weigh(int64_t item, const int32_t* seen, int64_t count, float* scores, int64_t room, float* sum,
             float* acc) const {
    const int64_t together = heads_of(item);
    std::vector<const float*> queries(together);
    for (int64_t i = 0; i < together; ++i) queries[i] = query(item, i);
    const int64_t kv = first(item) / groups;
    const float* key = k.at(b(item), kv, 0);
    const float* value = v.at(b(item), kv, 0);
#ifdef DRAFTSMITH_X86
    if (simd) {
      attend_queries_simd(queries.data(), together, key, k.stride[2], value, v.stride[2], seen, count, head_dim,
                          scaling, scores, room, sum, acc, wide);
      return;
    }
#endif
    attend_queries_scalar(queries.data(), together, key, k.stride[2], value, v.stride[2], seen, count, head_dim,
                          scaling, scores, sum, acc);
  }
  // the item's outputs from what weigh() computed
  void finish(int64_t item, const float* sums, const float* accs) const {
    const int64_t together = heads_of(item);
    std::vector<float*> outs(together);
    for (int64_t i = 0; i < together; ++i) outs[i] = out + ((b(item) * rows + r(item)) * heads + first(item) + i) * head_dim;
    divide_rows(together, head_dim, sums, accs, outs.data());
  }
};

// attend's work on its problem, problem.out written.
static void solve(AttendProblem& problem, const std::string& isa) {
  problem.wide = problem.simd && wide_vectors(isa, "attend");
  const int64_t batch = problem.batch, rows = problem.rows, kv_heads = problem.kv_heads, length = problem.length;
  const int64_t head_dim = problem.head_dim;
  // a K/V head's query heads share an item and read each key once, unless the mask differs between
  // heads; where that leaves too few items to keep every thread busy (one row), they share it in chunks
  const int64_t per_kv_head = (2 * at::get_num_threads() + batch * rows * kv_heads - 1) / (batch * rows * kv_heads);
  problem.set_together(problem.mask_heads_differ() ? 1 : (problem.groups + per_kv_head - 1) / per_kv_head);
  const int64_t together = problem.together, room = (length + 7) / 8 * 8 + 8;
  std::vector<int32_t> row_seen;
  std::vector<int64_t> row_counts;
  if (problem.seen_per_row()) problem.list_seen_rows(row_seen, row_counts);
  at::parallel_for(0, problem.items(), 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> own(row_seen.empty() ? length : 0);
    std::vector<float> scores(together * room), sums(together), accs(together * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = problem.b(item) * rows + problem.r(item);
      const int32_t* seen = row_seen.empty() ? own.data() : row_seen.data() + row * length;
      const int64_t count = row_seen.empty() ? problem.seen(item, own.data()) : row_counts[row];
      problem.weigh(item, seen, count, scores.data(), room, sums.data(), accs.data());
      problem.finish(item, sums.data(), accs.data());
    }
  });
}

// softmax(q k^T * scaling + mask) v for query (batch, heads, rows, head_dim), keys and values (batch,
// kv_heads, length, head_dim) (heads a multiple of kv_heads: query head h reads K/V head h / (heads /
// kv_heads)), mask as seen_keys reads it (broadcast over batch and heads where its size there is 1).
// Returns (batch, rows, heads, head_dim), contiguous: the layout transformers' attention functions
// return. Each row and head is computed from its query and the keys it sees alone (attend_group_simd),
// so a row's result is bitwise the same alone, among other rows, and under any mask that lets it see
// the same keys: what makes a tree's rows compute exactly what plain steps compute.
at::Tensor attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                  const std::optional<at::Tensor>& mask, double scaling, bool causal, const std::string& isa) {
  RECORD_FUNCTION("draftsmith::attend", std::vector<c10::IValue>());  // named in bench-tree --profile
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "attend: 4-d query, keys and values");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "attend: float32");
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), head_dim = query.size(3);
  const int64_t kv_heads = keys.size(1), length = keys.size(2);
  TORCH_CHECK(keys.size(0) == batch && values.sizes() == keys.sizes() && keys.size(3) == head_dim, "attend: keys, values");
  TORCH_CHECK(heads % kv_heads == 0 && head_dim <= 256, "attend: heads a multiple of kv_heads, head_dim <= 256");
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  const at::Tensor k = keys.stride(3) == 1 ? keys : keys.contiguous();
  const at::Tensor v = values.stride(3) == 1 ? values : values.contiguous();
  at::Tensor m;
  int64_t mask_strides[4] = {0, 0, 0, 0};
  if (mask.has_value()) {
    m = *mask;
    TORCH_CHECK(m.dim() == 4 && m.size(2) == rows && m.size(3) == length &&
                    (m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat),
                "attend: a bool or float32 mask (batch or 1, heads or 1, rows, keys)");
    m = m.expand({batch, heads, rows, length});
    for (int i = 0; i < 4; ++i) mask_strides[i] = m.stride(i);
  }
  AttendProblem problem{strided(q), strided(k), strided(v), mask.has_value() ? &m : nullptr,
                        {mask_strides[0], mask_strides[1], mask_strides[2], mask_strides[3]},
                        causal, static_cast<float>(scaling), simd_supported(), batch, heads, rows, head_dim,
                        kv_heads, length};
  at::Tensor out = at::empty({batch, rows, heads, head_dim}, q.options());
  problem.out = out.data_ptr<float>();
  solve(problem, isa);
  return out;
}

namespace {

// One layer's packs as decoder_layers and drafter_layer receive them: kProjections packs (empty: not
// packed) and their PackKinds from kQuery on, and the two stacked packs ([q; k; v], [gate; up]; empty:
// separate products).
struct LayerPacks {
  const at::Tensor* packs;
  const int64_t* kinds;
  const at::Tensor* fused;
  const at::Tensor& pack(Weight projection) const { return packs[projection - kQuery]; }
  int64_t kind(Weight projection) const { return kinds[projection - kQuery]; }
  at::Tensor product(const at::Tensor& rows, const at::Tensor* w, Weight projection) const {
    return project(rows, w[projection], pack(projection), kind(projection));
  }
};

struct AttentionShape {
  int64_t heads, kv_heads, head_dim;
  double scaling;
  bool grouped, rows_attention;
};

// What a layer's attention reads besides its weights: its rotary factors (rows, head_dim), its mask (none:
// every cached key), its cache buffers (1, kv_heads, capacity, head_dim) and the first row this forward
// writes there.
struct AttentionInputs {
  const at::Tensor& cosines;
  const at::Tensor& sines;
  const std::optional<at::Tensor>& mask;
  const at::Tensor& keys_buffer;
  const at::Tensor& values_buffer;
  int64_t start;
};

// attend on the rotated query rows (1, rows, heads, head_dim) over the cache buffers' first `length` rows
// under the input's mask (its first `length` keys; broadcast where its size is 1): (rows, heads * head_dim).
at::Tensor attend_cached(const at::Tensor& rotated, int64_t rows, int64_t length, const AttentionShape& shape,
                         const AttentionInputs& in) {
  RECORD_FUNCTION("draftsmith::attend", std::vector<c10::IValue>());  // named in bench-tree --profile, as attend
  const int64_t heads = shape.heads, head_dim = shape.head_dim;
  const at::Tensor& keys = in.keys_buffer;
  const at::Tensor& values = in.values_buffer;
  int64_t mask_strides[4] = {0, 0, 0, 0};
  const at::Tensor* mask = in.mask.has_value() ? &*in.mask : nullptr;
  if (mask != nullptr) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(0) == 1 && (mask->size(1) == 1 || mask->size(1) == heads) &&
                    mask->size(2) == rows && mask->size(3) >= length &&
                    (mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat),
                "decoder layers: a bool or float32 mask (1, heads or 1, rows, keys)");
    for (int i = 0; i < 4; ++i) mask_strides[i] = mask->size(i) == 1 ? 0 : mask->stride(i);
  }
  // the query as (batch, heads, rows, head_dim) reads the rotated rows' memory
  const Strided query{rotated.data_ptr<float>(), {rows * heads * head_dim, head_dim, heads * head_dim}};
  AttendProblem problem{query, strided(keys), strided(values), mask,
                        {mask_strides[0], mask_strides[1], mask_strides[2], mask_strides[3]},
                        /*causal=*/false, static_cast<float>(shape.scaling), simd_supported(), 1, heads, rows,
                        head_dim, shape.kv_heads, length};
  at::Tensor out = float_empty({rows, heads * head_dim});
  problem.out = out.data_ptr<float>();
  solve(problem, "auto");
  return out;
}

// A layer's q, k and v products of its normed input (rows, in), each with unit column stride: the stacked
// pack's output read in place where there is one (no views cut from it: a forward makes hundreds of these
// products), else three products.
struct QueryKeyValue {
  Columns query, key, value;
};

QueryKeyValue qkv_products(const at::Tensor& normed, const at::Tensor* w, const LayerPacks& packs,
                           const AttentionShape& shape) {
  const int64_t q_width = shape.heads * shape.head_dim, kv_width = shape.kv_heads * shape.head_dim;
  if (packs.fused[0].numel() == 0)
    return {Columns(packs.product(normed, w, kQuery).contiguous(), 0),
            Columns(packs.product(normed, w, kKey).contiguous(), 0),
            Columns(packs.product(normed, w, kValue).contiguous(), 0)};
  const at::Tensor all = packed_product(normed, packs.fused[0], packs.kind(kQuery), w[kQuery]).contiguous();
  return {Columns(all, 0), Columns(all, q_width), Columns(all, q_width + kv_width)};
}

// The rotary embedding of a forward's query and key rows, its key and value rows written into the cache
// buffers at [start, start + rows), and attention over rows [0, start + rows) under the mask (cut to those
// keys, as rows_attention_forward cuts it): (rows, heads * head_dim), contiguous. The row-invariant
// attention reads the buffers and the mask in place (attend's work without the views it would take).
at::Tensor attend_new_rows(const Columns& query, const Columns& key, const Columns& value, int64_t rows,
                           const AttentionShape& shape, const AttentionInputs& in) {
  const int64_t heads = shape.heads, kv_heads = shape.kv_heads, head_dim = shape.head_dim;
  const float* cos = in.cosines.data_ptr<float>();
  const float* sin = in.sines.data_ptr<float>();
  // the query as ATen's q * cos + roll(q) * sin lays it out: (1, rows, heads, head_dim) in memory
  at::Tensor rotated = float_empty({1, rows, heads, head_dim});
  rotate_into(query, rows, heads, head_dim, cos, sin, rotated.data_ptr<float>(), head_dim, heads * head_dim);
  TORCH_CHECK(in.keys_buffer.stride(3) == 1 && in.values_buffer.stride(3) == 1, "decoder layers: cache buffers");
  rotate_into(key, rows, kv_heads, head_dim, cos, sin,
              in.keys_buffer.data_ptr<float>() + in.start * in.keys_buffer.stride(2), in.keys_buffer.stride(1),
              in.keys_buffer.stride(2));
  copy_into(value, rows, kv_heads, head_dim, in.values_buffer.data_ptr<float>() + in.start * in.values_buffer.stride(2),
            in.values_buffer.stride(1), in.values_buffer.stride(2));
  const int64_t length = in.start + rows;
  if (shape.rows_attention) return attend_cached(rotated, rows, length, shape, in);
  const at::Tensor keys = in.keys_buffer.narrow(2, 0, length), values = in.values_buffer.narrow(2, 0, length);
  std::optional<at::Tensor> mask = in.mask;
  if (mask.has_value()) mask = mask->narrow(3, 0, length);
  return at::scaled_dot_product_attention(rotated.transpose(1, 2), keys, values, mask, /*dropout_p=*/0.0,
                                          /*is_causal=*/false, shape.scaling, shape.grouped)
      .transpose(1, 2)
      .reshape({rows, heads * head_dim});
}

// A layer's attention block on its normed input (rows, in): the q, k and v products, then attend_new_rows
// and the output projection: (rows, width).
at::Tensor attention_block(const at::Tensor& normed, const at::Tensor* w, const LayerPacks& packs,
                           const AttentionShape& shape, const AttentionInputs& in) {
  const int64_t rows = normed.size(0);
  const QueryKeyValue qkv = qkv_products(normed, w, packs, shape);
  return packs.product(attend_new_rows(qkv.query, qkv.key, qkv.value, rows, shape, in), w, kOutput);
}

// A layer's gated MLP on its normed input (rows, width): down(act(gate(x)) * up(x)).
at::Tensor mlp_block(const at::Tensor& normed, const at::Tensor* w, const LayerPacks& packs,
                     Activation act = Activation::kSilu) {
  at::Tensor gated;
  if (packs.fused[1].numel() > 0) {
    const at::Tensor all = packed_product(normed, packs.fused[1], packs.kind(kGate), w[kGate]).contiguous();
    const int64_t inner = all.size(1) / 2;
    // the gate columns as narrow would cut them, without its view bookkeeping
    const at::Tensor gate = at::from_blob(all.data_ptr<float>(), {all.size(0), inner}, {all.stride(0), 1}, all.options());
    gated = gated_product(gate, Columns(all, inner), act);
  } else {
    gated = gated_product(packs.product(normed, w, kGate), Columns(packs.product(normed, w, kUp), 0), act);
  }
  return packs.product(gated, w, kDown);
}

}  // namespace

// Runs every layer on x (1, rows, width) whose rows sit at cache rows [start, start + rows): each layer's
// key and value rows are written into its preallocated buffer (1, kv_heads, capacity, head_dim) there,
// and attention reads rows [0, start + rows) under `mask` (none: every row is seen; one-token steps).
// `packs` holds kProjections tensors per layer, empty where the projection is not packed, and `kinds`
// each one's PackKind. `fused` holds two tensors per layer, packs of [q; k; v] and [gate; up] stacked
// (empty: separate products) of the kind of q's and gate's packs: oneDNN and the stream kernel compute
// each output column alone, so a stacked product's columns are bitwise the separate products' (checked
// when the pack is made, packed_gemm.PackedGemm.fused_pack). Attention is `attend`'s where
// `rows_attention`, else SDPA's as transformers' wrapper calls it. Returns each layer's output.
std::vector<at::Tensor> decoder_layers(
    at::Tensor x, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& packs,
    const std::vector<double>& norm_eps, const at::Tensor& cos, const at::Tensor& signed_sin,
    const std::optional<at::Tensor>& mask, const std::vector<at::Tensor>& key_buffers,
    const std::vector<at::Tensor>& value_buffers, int64_t start, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double scaling, bool grouped, const std::vector<int64_t>& kinds,
    const std::vector<at::Tensor>& fused, bool rows_attention) {
  RECORD_FUNCTION("draftsmith::decoder_layers", std::vector<c10::IValue>());  // named in bench-tree --profile
  // the layers' plain loops record no gradient, so their ATen calls need not build a graph either
  const at::NoGradGuard no_gradient;
  const int64_t layers = static_cast<int64_t>(key_buffers.size());
  TORCH_CHECK(weights.size() == static_cast<size_t>(layers * kWeightsPerLayer), "decoder_layers: weights");
  TORCH_CHECK(packs.size() == static_cast<size_t>(layers * kProjections), "decoder_layers: packs");
  TORCH_CHECK(kinds.size() == packs.size(), "decoder_layers: kinds");
  TORCH_CHECK(norm_eps.size() == static_cast<size_t>(layers * 2), "decoder_layers: norm_eps");
  TORCH_CHECK(fused.size() == static_cast<size_t>(layers * 2), "decoder_layers: fused");
  const int64_t rows = x.size(1);
  const at::Tensor cosines = cos.contiguous(), sines = signed_sin.contiguous();  // (1, 1, rows, head_dim)
  TORCH_CHECK(cosines.numel() == rows * head_dim && sines.numel() == rows * head_dim, "decoder_layers: cos, sin");
  const AttentionShape shape{heads, kv_heads, head_dim, scaling, grouped, rows_attention};
  std::vector<at::Tensor> outputs;
  outputs.reserve(layers);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &weights[i * kWeightsPerLayer];
    const LayerPacks layer_packs{&packs[i * kProjections], &kinds[i * kProjections], &fused[2 * i]};
    at::Tensor normed = rms_norm(x, w[kInputNorm], norm_eps[2 * i]);
    const AttentionInputs inputs{cosines, sines, mask, key_buffers[i], value_buffers[i], start};
    x = add_rows(x, attention_block(normed, w, layer_packs, shape, inputs));
    normed = rms_norm(x, w[kPostNorm], norm_eps[2 * i + 1]);
    x = add_rows(x, mlp_block(normed, w, layer_packs));
    outputs.push_back(x);
  }
  return outputs;
}

namespace {

// Gemma-3's per-layer weights as gemma_layers receives them: the Llama layer's slots for the seven
// projections (kQuery .. kDown, transposed views), then each RMSNorm's 1 + weight (GemmaDirectForward's
// factors: the same floats its forward computes).
enum GemmaWeight {
  kGemmaInputNorm = kInputNorm,
  kGemmaPostAttentionNorm = kPostNorm,
  kGemmaPreFeedforwardNorm,
  kGemmaPostFeedforwardNorm,
  kGemmaQueryNorm,
  kGemmaKeyNorm,
  kGemmaWeightsPerLayer
};
enum GemmaEps { kEpsInput, kEpsPostAttention, kEpsPreFeedforward, kEpsPostFeedforward, kEpsQuery, kEpsKey, kGemmaEps };

// Gemma3RMSNorm.forward of float32 rows (n, width): (x * rsqrt(mean(x * x) + eps)) * factor, in that order.
at::Tensor gemma_norm(const at::Tensor& rows, const at::Tensor& factor, double eps) {
  return scaled_norm(rows, factor, eps, /*scale_last=*/true);
}

// A Gemma-3 layer's attention block on its normed input (rows, width): q, k and v, the QK-norms per head,
// then attend_new_rows and the output projection: (rows, width), before the post-attention norm.
at::Tensor gemma_attention(const at::Tensor& normed, const at::Tensor* w, const double* eps, const LayerPacks& packs,
                           const AttentionShape& shape, const AttentionInputs& in) {
  const int64_t rows = normed.size(0), heads = shape.heads, kv_heads = shape.kv_heads, head_dim = shape.head_dim;
  const QueryKeyValue qkv = qkv_products(normed, w, packs, shape);
  // each head's norm over its head_dim values: rows x heads rows of head_dim, in the products' order
  const at::Tensor query =
      gemma_norm(qkv.query.dense(heads * head_dim).view({rows * heads, head_dim}), w[kGemmaQueryNorm], eps[kEpsQuery]);
  const at::Tensor key =
      gemma_norm(qkv.key.dense(kv_heads * head_dim).view({rows * kv_heads, head_dim}), w[kGemmaKeyNorm], eps[kEpsKey]);
  const at::Tensor attended =
      attend_new_rows(Columns(query.view({rows, heads * head_dim}), 0), Columns(key.view({rows, kv_heads * head_dim}), 0),
                      qkv.value, rows, shape, in);
  return packs.product(attended, w, kOutput);
}

}  // namespace

// gemma_forward.py's _gemma_layers in one call (the rows-invariant attention's forwards), bitwise the same:
// every layer on x (1, rows, width) whose rows sit at cache rows [start, start + rows). `weights` holds
// kGemmaWeightsPerLayer tensors per layer (GemmaWeight), `eps` kGemmaEps per layer (GemmaEps); `packs`,
// `kinds` and `fused` as decoder_layers takes them; per layer its rotary factors (`cosines`, `sines`:
// (1, 1, rows, head_dim), the sign of rotate_half on the sines) and its mask (none: every cached key).
// Returns each layer's output.
std::vector<at::Tensor> gemma_layers(at::Tensor x, const std::vector<at::Tensor>& weights,
                                     const std::vector<double>& eps, const std::vector<at::Tensor>& packs,
                                     const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& fused,
                                     const std::vector<at::Tensor>& cosines, const std::vector<at::Tensor>& sines,
                                     const std::vector<std::optional<at::Tensor>>& masks,
                                     const std::vector<at::Tensor>& key_buffers,
                                     const std::vector<at::Tensor>& value_buffers, int64_t start,
                                     const std::vector<int64_t>& shape, double scaling) {
  RECORD_FUNCTION("draftsmith::gemma_layers", std::vector<c10::IValue>());  // named in bench-tree --profile
  const at::NoGradGuard no_gradient;  // as decoder_layers
  const int64_t layers = static_cast<int64_t>(key_buffers.size());
  TORCH_CHECK(weights.size() == static_cast<size_t>(layers * kGemmaWeightsPerLayer), "gemma_layers: weights");
  TORCH_CHECK(eps.size() == static_cast<size_t>(layers * kGemmaEps), "gemma_layers: eps");
  TORCH_CHECK(packs.size() == static_cast<size_t>(layers * kProjections) && kinds.size() == packs.size(),
              "gemma_layers: packs");
  TORCH_CHECK(fused.size() == static_cast<size_t>(layers * 2), "gemma_layers: fused");
  TORCH_CHECK(cosines.size() == static_cast<size_t>(layers) && sines.size() == cosines.size() &&
                  masks.size() == cosines.size() && value_buffers.size() == key_buffers.size(),
              "gemma_layers: per-layer inputs");
  TORCH_CHECK(shape.size() == 3, "gemma_layers: shape (heads, kv_heads, head_dim)");
  const int64_t rows = x.size(1), width = x.size(2), head_dim = shape[2];
  TORCH_CHECK(rows == 1 || std::all_of(masks.begin(), masks.end(), [](const auto& m) { return m.has_value(); }),
              "gemma_layers: several rows need a mask in every layer");
  const AttentionShape attention_shape{shape[0], shape[1], head_dim, scaling, true, true};
  std::vector<at::Tensor> outputs;
  outputs.reserve(layers);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &weights[i * kGemmaWeightsPerLayer];
    const double* e = &eps[i * kGemmaEps];
    const LayerPacks layer_packs{&packs[i * kProjections], &kinds[i * kProjections], &fused[2 * i]};
    const at::Tensor cos = cosines[i].contiguous(), sin = sines[i].contiguous();
    TORCH_CHECK(cos.numel() == rows * head_dim && sin.numel() == rows * head_dim, "gemma_layers: cos, sin");
    const AttentionInputs inputs{cos, sin, masks[i], key_buffers[i], value_buffers[i], start};
    at::Tensor normed = gemma_norm(x.view({rows, width}), w[kGemmaInputNorm], e[kEpsInput]);
    const at::Tensor attended = gemma_attention(normed, w, e, layer_packs, attention_shape, inputs);
    x = add_rows(x, gemma_norm(attended, w[kGemmaPostAttentionNorm], e[kEpsPostAttention]).view({1, rows, width}));
    normed = gemma_norm(x.view({rows, width}), w[kGemmaPreFeedforwardNorm], e[kEpsPreFeedforward]);
    const at::Tensor mlp = mlp_block(normed, w, layer_packs, Activation::kGeluTanh);
    x = add_rows(x, gemma_norm(mlp, w[kGemmaPostFeedforwardNorm], e[kEpsPostFeedforward]).view({1, rows, width}));
    outputs.push_back(x);
  }
  return outputs;
}

// A feature drafter's decoder layer (EAGLE's, EAGLE-3's) given its attention input (1, rows, in), already
// normed or fused as the drafter makes it, and the residual (1, rows, width) that input's attention adds
// to: returns (residual + attention, the MLP's output on the post-attention norm of that), which the
// drafter combines itself (partial alignment's MLP is two features wide). The weights are decoder_layers'
// nine of one layer (the input norm's is not read); the key and value rows go into the buffers at
// [start, start + rows), and attention through `attend` reads rows [0, start + rows) under `mask`.
std::vector<at::Tensor> drafter_layer(
    const at::Tensor& attention_input, const at::Tensor& residual, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& packs, const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& fused,
    double post_norm_eps, const at::Tensor& cos, const at::Tensor& signed_sin, const std::optional<at::Tensor>& mask,
    const at::Tensor& key_buffer, const at::Tensor& value_buffer, int64_t start, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double scaling) {
  RECORD_FUNCTION("draftsmith::drafter_layer", std::vector<c10::IValue>());
  const at::NoGradGuard no_gradient;  // as decoder_layers
  TORCH_CHECK(weights.size() == static_cast<size_t>(kWeightsPerLayer), "drafter_layer: weights");
  TORCH_CHECK(packs.size() == static_cast<size_t>(kProjections) && kinds.size() == packs.size(),
              "drafter_layer: packs");
  TORCH_CHECK(fused.size() == 2, "drafter_layer: fused");
  TORCH_CHECK(attention_input.dim() == 3 && residual.dim() == 3 && attention_input.size(1) == residual.size(1),
              "drafter_layer: attention input and residual (1, rows, width)");
  TORCH_CHECK(attention_input.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat,
              "drafter_layer: float32");
  const int64_t rows = attention_input.size(1);
  const at::Tensor cosines = cos.contiguous(), sines = signed_sin.contiguous();
  TORCH_CHECK(cosines.numel() == rows * head_dim && sines.numel() == rows * head_dim, "drafter_layer: cos, sin");
  const AttentionShape shape{heads, kv_heads, head_dim, scaling, /*grouped=*/heads != kv_heads,
                             /*rows_attention=*/true};
  const LayerPacks layer_packs{packs.data(), kinds.data(), fused.data()};
  const at::Tensor input = attention_input.reshape({rows, attention_input.size(2)}).contiguous();
  const AttentionInputs inputs{cosines, sines, mask, key_buffer, value_buffer, start};
  at::Tensor after = add_rows(residual, attention_block(input, weights.data(), layer_packs, shape, inputs));
  const at::Tensor normed = rms_norm(after, weights[kPostNorm], post_norm_eps);
  return {after, mlp_block(normed, weights.data(), layer_packs)};
}

// One drafting forward of an EAGLE-3 drafter (no feature sampler, no partial alignment) and its head, as
// Eagle3Model.forward, Eagle3Model.logits and the drafter's log_softmax and topk compute them, in one call:
// `hidden` (rows, in) is fused by `fc` first where `fc_transposed` is given (the target's layer states),
// else it is the fed-back feature; the layer reads [input_norm(embeds), hidden_norm(hidden)] and adds its
// attention to hidden_norm(hidden) (norm_before_residual); the feature is that plus its MLP. The head
// (final norm, lm_head) runs on the last `logit_rows` rows only. `layer` holds drafter_layer's arguments
// after its attention input and residual. Returns (features (rows, h), the top_k log-probabilities and
// their columns per logit row).
std::vector<at::Tensor> eagle3_step(const at::Tensor& embeds, const at::Tensor& hidden, const at::Tensor& fc_transposed,
                                    const at::Tensor& fc_pack, int64_t fc_kind, const at::Tensor& hidden_norm,
                                    const at::Tensor& input_norm, double norm_eps, const at::Tensor& final_norm,
                                    const at::Tensor& head_transposed, const at::Tensor& head_pack, int64_t head_kind,
                                    int64_t logit_rows, int64_t top_k, const std::vector<at::Tensor>& weights,
                                    const std::vector<at::Tensor>& packs, const std::vector<int64_t>& kinds,
                                    const std::vector<at::Tensor>& fused, double post_norm_eps, const at::Tensor& cos,
                                    const at::Tensor& signed_sin, const std::optional<at::Tensor>& mask,
                                    const at::Tensor& key_buffer, const at::Tensor& value_buffer, int64_t start,
                                    int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling) {
  RECORD_FUNCTION("draftsmith::eagle3_step", std::vector<c10::IValue>());
  TORCH_CHECK(embeds.dim() == 2 && hidden.dim() == 2 && embeds.size(0) == hidden.size(0), "eagle3_step: (rows, width)");
  const int64_t rows = embeds.size(0);
  TORCH_CHECK(logit_rows >= 1 && logit_rows <= rows && top_k >= 1, "eagle3_step: logit_rows, top_k");
  const at::Tensor state = fc_transposed.numel() > 0 ? project(hidden.contiguous(), fc_transposed, fc_pack, fc_kind)
                                                     : hidden.contiguous();
  const at::Tensor residual = rms_norm(state.unsqueeze(0), hidden_norm, norm_eps);
  const at::Tensor input = at::cat({rms_norm(embeds.unsqueeze(0), input_norm, norm_eps), residual}, 1);
  const std::vector<at::Tensor> layer =
      drafter_layer(input.unsqueeze(0), residual.unsqueeze(0), weights, packs, kinds, fused, post_norm_eps, cos,
                    signed_sin, mask, key_buffer, value_buffer, start, heads, kv_heads, head_dim, scaling);
  const at::Tensor features = add_rows(layer[0].view({rows, -1}), layer[1].view({rows, -1}));
  const at::Tensor last = features.narrow(0, rows - logit_rows, logit_rows).unsqueeze(0);
  const at::Tensor logits = project(rms_norm(last, final_norm, norm_eps), head_transposed, head_pack, head_kind);
  const auto top = at::topk(at::log_softmax(logits, -1), std::min(top_k, logits.size(1)));
  return {features, std::get<0>(top), std::get<1>(top)};
}

// The bound of screen_contenders for tokens of one row: (c0 * b0_i + c1 * b1_i + out * |a_i|) * slack,
// each operation rounded to float32 on its own (no fused multiply-add), whatever the code's vector width.
struct ContenderBound {
  const at::BFloat16* a;
  const float* b0;
  const float* b1;
  float c0, c1, out, slack;

  float at(int64_t i, float value) const { return (c0 * b0[i] + c1 * b1[i] + out * std::fabs(value)) * slack; }
};

// max_i (a_i - bound_i) over tokens [begin, end), and whether every a_i there is finite.
float scalar_floor(const ContenderBound& row, int64_t begin, int64_t end, bool* finite) {
  float highest = -std::numeric_limits<float>::infinity();
  for (int64_t i = begin; i < end; ++i) {
    const float value = static_cast<float>(row.a[i]);
    *finite = *finite && std::isfinite(value);
    highest = std::max(highest, value - row.at(i, value));
  }
  return highest;
}

// The tokens of [begin, end) with a_i + bound_i >= floor, in order.
void scalar_contenders(const ContenderBound& row, int64_t begin, int64_t end, float floor, std::vector<int64_t>* found) {
  for (int64_t i = begin; i < end; ++i) {
    const float value = static_cast<float>(row.a[i]);
    if (value + row.at(i, value) >= floor) found->push_back(i);
  }
}

#ifdef DRAFTSMITH_X86
// 16 tokens' screened values (bfloat16 to float32: the 16 bits above 16 zero bits, exact).
AVX512 inline __m512 bfloat16_lanes(const at::BFloat16* a) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

AVX512 inline __m512 bound_lanes(const ContenderBound& row, int64_t i, __m512 value) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(value), _mm512_set1_epi32(0x7fffffff)));
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(row.c0), _mm512_loadu_ps(row.b0 + i)),
                                                 _mm512_mul_ps(_mm512_set1_ps(row.c1), _mm512_loadu_ps(row.b1 + i))),
                                   _mm512_mul_ps(_mm512_set1_ps(row.out), magnitude));
  return _mm512_mul_ps(sum, _mm512_set1_ps(row.slack));
}

// scalar_floor 16 tokens at a time (the same floats; the maximum does not depend on the order).
AVX512 float wide_floor(const ContenderBound& row, int64_t begin, int64_t end, bool* finite) {
  __m512 highest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 special = 0;  // lanes that held an infinity or NaN
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 value = bfloat16_lanes(row.a + i);
    special |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(value), exponent), exponent);
    highest = _mm512_max_ps(_mm512_sub_ps(value, bound_lanes(row, i, value)), highest);  // a NaN loses, as in std::max
  }
  *finite = *finite && special == 0;
  return std::max(_mm512_reduce_max_ps(highest), scalar_floor(row, i, end, finite));
}

// scalar_contenders 16 tokens at a time.
AVX512 void wide_contenders(const ContenderBound& row, int64_t begin, int64_t end, float floor,
                            std::vector<int64_t>* found) {
  const __m512 bar = _mm512_set1_ps(floor);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 value = bfloat16_lanes(row.a + i);
    for (__mmask16 hits = _mm512_cmp_ps_mask(_mm512_add_ps(value, bound_lanes(row, i, value)), bar, _CMP_GE_OQ);
         hits != 0; hits &= hits - 1)
      found->push_back(i + __builtin_ctz(hits));
  }
  scalar_contenders(row, i, end, floor, found);
}
#endif

// For each row r of the screen (R, V; bfloat16): the bound D_ri = (c_r0 * b_0i + c_r1 * b_1i +
// output * |a_ri|) * safety on how far token i's float32 logit can be from its screened one a_ri
// (GreedyHead.screen_bounds, in float32 as there; the safety factor covers a few roundings more or
// less), the floor max_i (a_ri - D_ri) that some token's logit reaches, and the contenders: tokens with
// a_ri + D_ri >= floor. Returns the floors (R, float32; not finite where the screen was not) and each
// row's contenders (int64, ascending).
std::tuple<at::Tensor, std::vector<at::Tensor>> screen_contenders(
    const at::Tensor& screen, const at::Tensor& row_bounds, const at::Tensor& coefficients, double output,
    double safety, const std::string& isa) {
  RECORD_FUNCTION("draftsmith::screen_contenders", std::vector<c10::IValue>());  // named in bench-tree --profile
  TORCH_CHECK(screen.dim() == 2 && screen.scalar_type() == at::kBFloat16 && screen.is_contiguous(),
              "screen_contenders: screen");
  TORCH_CHECK(row_bounds.scalar_type() == at::kFloat && row_bounds.is_contiguous(), "screen_contenders: row_bounds");
  TORCH_CHECK(coefficients.scalar_type() == at::kFloat && coefficients.is_contiguous(),
              "screen_contenders: coefficients");
  const int64_t rows = screen.size(0);
  const int64_t vocab = screen.size(1);
  TORCH_CHECK(row_bounds.size(0) == 2 && row_bounds.size(1) == vocab, "screen_contenders: row_bounds shape");
  const float out = static_cast<float>(output);
  const float slack = static_cast<float>(safety);
  const float* b0 = row_bounds.data_ptr<float>();
  const float* b1 = b0 + vocab;
  at::Tensor floors = at::empty({rows}, row_bounds.options());
  std::vector<at::Tensor> contenders;
  const bool wide = wide_vectors(isa, "screen_contenders");
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = coefficients.data_ptr<float>() + 2 * r;
    const ContenderBound row{screen.data_ptr<at::BFloat16>() + r * vocab, b0, b1, c[0], c[1], out, slack};
    // Spans of the vocabulary on all threads: the maximum and the contenders' order do not depend on
    // how it is split.
    const int64_t spans = (vocab + kContenderSpan - 1) / kContenderSpan;
    auto span_end = [&](int64_t span) { return std::min(vocab, (span + 1) * kContenderSpan); };
    std::vector<float> span_floors(spans, -std::numeric_limits<float>::infinity());
    std::vector<char> span_finite(spans, 1);
    at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
      for (int64_t span = begin; span < end; ++span) {
        bool all_finite = true;
        const int64_t first = span * kContenderSpan, last = span_end(span);
#ifdef DRAFTSMITH_X86
        span_floors[span] = wide ? wide_floor(row, first, last, &all_finite) : scalar_floor(row, first, last, &all_finite);
#else
        span_floors[span] = scalar_floor(row, first, last, &all_finite);
#endif
        span_finite[span] = all_finite;
      }
    });
    float floor = *std::max_element(span_floors.begin(), span_floors.end());
    const bool finite = std::all_of(span_finite.begin(), span_finite.end(), [](char ok) { return ok != 0; });
    if (!finite) floor = std::numeric_limits<float>::quiet_NaN();
    floors.data_ptr<float>()[r] = floor;
    std::vector<std::vector<int64_t>> span_found(spans);
    if (finite)
      at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
        for (int64_t span = begin; span < end; ++span) {
          const int64_t first = span * kContenderSpan, last = span_end(span);
#ifdef DRAFTSMITH_X86
          if (wide) {
            wide_contenders(row, first, last, floor, &span_found[span]);
            continue;
          }
#endif
          scalar_contenders(row, first, last, floor, &span_found[span]);
        }
      });
    std::vector<int64_t> found;
    for (const auto& part : span_found) found.insert(found.end(), part.begin(), part.end());
    contenders.push_back(at::tensor(found, at::kLong));
  }
  return {floors, contenders};
}

// A contender's logit sum_k w_k x_k and magnitude sum_k |w_k x_k| in float64, from exact products (the
// bound proven_argmax applies holds for float64 sums in any order).
void contender_sums(const float* w, const float* x, int64_t K, double* logit, double* magnitude) {
  for (int64_t k = 0; k < K; ++k) {
    const double product = static_cast<double>(w[k]) * static_cast<double>(x[k]);  // exact
    *logit += product;
    *magnitude += std::fabs(product);
  }
}

#ifdef DRAFTSMITH_X86
// contender_sums eight products at a time.
AVX512 void wide_contender_sums(const float* w, const float* x, int64_t K, double* logit, double* magnitude) {
  __m512d sums = _mm512_setzero_pd(), sizes = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m512d product =
        _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(w + k)), _mm512_cvtps_pd(_mm256_loadu_ps(x + k)));
    sums = _mm512_add_pd(sums, product);
    sizes = _mm512_add_pd(sizes, _mm512_abs_pd(product));
  }
  *logit = _mm512_reduce_add_pd(sums);
  *magnitude = _mm512_reduce_add_pd(sizes);
  contender_sums(w + k, x + k, K - k, logit, magnitude);
}
#endif

// GreedyHead._proven_argmax for one row x (K, float32) and its contenders (int64 token ids) of the float32
// head `weight` (V, K): the contenders' logits and magnitudes sum_k |w_ik x_k| in float64 read straight
// from the weight rows, each one's float32 error bound (gamma32 + 2 gamma64) * magnitude * safety + 1e-30,
// and the best one returned where it beats every other contender by more than both bounds (-1: not
// proven, or a value that is not finite).
int64_t proven_argmax(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& contenders, double gamma32,
                      double gamma64, double safety, const std::string& isa) {
  RECORD_FUNCTION("draftsmith::proven_argmax", std::vector<c10::IValue>());  // named in bench-tree --profile
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(), "proven_argmax: x");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(0),
              "proven_argmax: weight");
  TORCH_CHECK(contenders.dim() == 1 && contenders.scalar_type() == at::kLong && contenders.is_contiguous(),
              "proven_argmax: contenders");
  const int64_t count = contenders.size(0), K = x.size(0), V = weight.size(0);
  const int64_t* ids = contenders.data_ptr<int64_t>();
  if (count == 1) return ids[0];
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const bool wide = wide_vectors(isa, "proven_argmax");
  for (int64_t c = 0; c < count; ++c)
    TORCH_CHECK(ids[c] >= 0 && ids[c] < V, "proven_argmax: a contender outside the vocabulary");
  std::vector<double> logits(count), errors(count);
  // each contender's sums alone, whichever thread computes them (a flat row has tens of thousands)
  at::parallel_for(0, count, kProofGrain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double logit = 0.0, magnitude = 0.0;
#ifdef DRAFTSMITH_X86
      if (wide)
        wide_contender_sums(wp + ids[c] * K, xp, K, &logit, &magnitude);
      else
#endif
        contender_sums(wp + ids[c] * K, xp, K, &logit, &magnitude);
      logits[c] = logit;
      errors[c] = (gamma32 + 2.0 * gamma64) * magnitude * safety + 1e-30;
    }
  });
  int64_t best = -1;
  for (int64_t c = 0; c < count; ++c) {
    if (!std::isfinite(logits[c]) || !std::isfinite(errors[c])) return -1;
    if (best < 0 || logits[c] > logits[best]) best = c;  // the first of equal maxima, as torch's argmax
  }
  if (best < 0) return -1;
  double rivals = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < count; ++c)
    if (c != best) rivals = std::max(rivals, logits[c] + errors[c]);
  return logits[best] - errors[best] > rivals ? ids[best] : -1;
}

namespace {

// GreedyHead._int16_rows for a finite row x (K): the largest integer magnitude `top`, the row's scale
// max |x_k| / top (float32, at least the smallest normal float) and x_k / scale rounded half to even and
// clamped to [-top, top], as torch.round and clamp_ compute them.
float int16_row(const float* x, int64_t K, float top, int16_t* out) {
  float largest = 0.0f;
  for (int64_t k = 0; k < K; ++k) largest = std::max(largest, std::fabs(x[k]));
  const float scale = std::max(largest / top, std::numeric_limits<float>::min());
  for (int64_t k = 0; k < K; ++k) out[k] = static_cast<int16_t>(std::clamp(std::nearbyint(x[k] / scale), -top, top));
  return scale;
}

// GreedyHead._coefficients for one row: its norm and the norm of its rounding to the screen's integers
// (times scale), in float64 as there (another summation order than torch's norm moves them by a few
// float64 roundings, which the safety factor covers), scaled by `safety` and rounded to float32.
void row_coefficients(const float* x, const int16_t* integers, float scale, int64_t K, double gamma32,
                      double fp32_unit, double safety, float* out) {
  double squares = 0.0, rounded_squares = 0.0, error_squares = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const double exact = x[k], rounded = static_cast<double>(integers[k]) * static_cast<double>(scale);
    squares += exact * exact;
    rounded_squares += rounded * rounded;
    error_squares += (exact - rounded) * (exact - rounded);
  }
  const double norm = std::sqrt(squares), rounded_norm = std::sqrt(rounded_squares);
  const double accumulation = (gamma32 + fp32_unit) * rounded_norm + gamma32 * norm;
  out[0] = static_cast<float>(norm * safety);
  out[1] = static_cast<float>((std::sqrt(error_squares) + accumulation) * safety);
}

}  // namespace

// GreedyHead._int16_rows and _coefficients for float32 rows (R, K): the 16-bit integer rows (R, K), their
// scales (R) and the bounds' coefficients (R, 2); a row with a value that is not finite gets zeros and the
// smallest scale (its screen is of zeros; the float32 head decides it).
std::tuple<at::Tensor, at::Tensor, at::Tensor> screen_inputs(const at::Tensor& rows, double gamma32, double fp32_unit,
                                                             double safety) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat, "screen_inputs: rows (R, K) float32");
  const at::Tensor x = rows.contiguous();
  const int64_t R = x.size(0), K = x.size(1);
  const float top = static_cast<float>(std::min<int64_t>(kScreenTop, 2147483647 / (127 * K)));
  at::Tensor integers = at::zeros({R, K}, x.options().dtype(at::kShort));
  at::Tensor scales = at::full({R}, std::numeric_limits<float>::min(), x.options());
  at::Tensor coefficients = at::zeros({R, 2}, x.options());
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * K;
    if (!std::all_of(row, row + K, [](float v) { return std::isfinite(v); })) continue;
    int16_t* ints = integers.data_ptr<int16_t>() + r * K;
    const float scale = int16_row(row, K, top, ints);
    scales.data_ptr<float>()[r] = scale;
    row_coefficients(row, ints, scale, K, gamma32, fp32_unit, safety, coefficients.data_ptr<float>() + 2 * r);
  }
  return {integers, scales, coefficients};
}

// GreedyHead.__call__ for float32 rows (R, K) where int16_screen runs for `isa`, in one call: the screen's
// inputs, the VNNI screen, the contenders and each row's proof. Returns each row's proven token, -1 where
// the float32 head must decide (a value that is not finite, or a proof that does not settle). The Python
// calls it replaces cost more than the screen's arithmetic on a small model, on one thread while the
// other waited.
at::Tensor greedy_tokens(const at::Tensor& rows, const at::Tensor& quantized, const at::Tensor& scales,
                         const at::Tensor& row_bounds, const at::Tensor& weight, double gamma32, double gamma64,
                         double fp32_unit, double output, double safety, const std::string& isa, int64_t tiles_from) {
  RECORD_FUNCTION("draftsmith::greedy_tokens", std::vector<c10::IValue>());  // named in bench-tree --profile
  const at::Tensor x = rows.contiguous();
  const auto [integers, row_scales, coefficients] = screen_inputs(x, gamma32, fp32_unit, safety);
  const at::Tensor screen = int16_screen(integers, row_scales, quantized, scales, isa, tiles_from);
  const auto [floors, contenders] = screen_contenders(screen, row_bounds, coefficients, output, safety, isa);
  const at::Tensor finite = at::isfinite(x).all(1).logical_and(at::isfinite(floors)).contiguous();
  at::Tensor tokens = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  for (int64_t r = 0; r < x.size(0); ++r)
    tokens.data_ptr<int64_t>()[r] = finite.data_ptr<bool>()[r]
                                        ? proven_argmax(x[r], weight, contenders[r], gamma32, gamma64, safety, isa)
                                        : -1;
  return tokens;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "silu_lanes",
      []() {
#ifdef DRAFTSMITH_X86
        return silu_replica().lanes;
#else
        return 0;
#endif
      },
      "The lanes of the layers' SiLU replica (0: ATen's SiLU serves)");
  m.def(
      "silu",
      [](const at::Tensor& gate) {
        TORCH_CHECK(gate.dim() == 2 && gate.scalar_type() == at::kFloat && gate.stride(1) == 1, "silu: float32 rows");
        at::Tensor out = float_empty({gate.size(0), gate.size(1)});
        activate(gate, Activation::kSilu, out.data_ptr<float>());
        return out;
      },
      "SiLU of float32 rows as the C++ layers compute it (bitwise ATen's)");
  m.def("norm_sum_lanes", &aten_sum_lanes,
        "The lane count with which the norms' sums replicate ATen's for rows of this width (0: ATen's sum serves)");
  m.def(
      "rms_norm", [](const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm(x, weight, eps).view(x.sizes()); },
      "LlamaRMSNorm.forward of float32 rows (bitwise the same)");
  m.def("decoder_layers", &decoder_layers, "The lean path's decoder layers (bitwise the same)");
  m.def("gemma_layers", &gemma_layers, "Gemma-3's lean decoder layers (bitwise the same)");
  m.def("drafter_layer", &drafter_layer, "A feature drafter's decoder layer from its attention input and residual");
  m.def("eagle3_step", &eagle3_step, "An EAGLE-3 drafter's forward and its head's top_k log-probabilities");
  m.def("screen_contenders", &screen_contenders, "The screened head's floors and contenders per row",
        py::arg("screen"), py::arg("row_bounds"), py::arg("coefficients"), py::arg("output"), py::arg("safety"),
        py::arg("isa") = "auto");
  m.def("proven_argmax", &proven_argmax, "The screened head's proof for one row (-1: not proven)", py::arg("x"),
        py::arg("weight"), py::arg("contenders"), py::arg("gamma32"), py::arg("gamma64"), py::arg("safety"),
        py::arg("isa") = "auto");
  m.def("simd_supported", &simd_supported, "Whether int16_screen and stream_linear run on this CPU");
  m.def("isas_available", &isas_available, "The instruction sets whose kernels run on this CPU, narrowest first");
  m.def("set_isa", &set_isa, "The instruction set every kernel's isa='auto' takes from now on", py::arg("isa"));
  m.def("isa_in_use", &isa_in_use, "The instruction set isa='auto' takes now");
  m.def("huge_page_empty", &huge_page_empty, "An uninitialised tensor in memory backed by huge pages where the OS gives them",
        py::arg("shape"), py::arg("dtype") = at::kFloat);
  m.def("stream_pack", &stream_pack, "A float32 weight in the stream kernel's layout (4-bit codes or bfloat16 where exact)",
        py::arg("weight"), py::arg("narrow") = true, py::arg("codes") = true);
  m.def("stream_linear", &stream_linear, "The stream kernel's product: weights read once for all rows",
        py::arg("rows"), py::arg("pack"), py::arg("isa") = "auto");
  m.def("attend", &attend, "Attention whose every row is computed alone (row-invariant)", py::arg("query"),
        py::arg("keys"), py::arg("values"), py::arg("mask"), py::arg("scaling"), py::arg("causal"),
        py::arg("isa") = "auto");
  m.def("amx_available", &amx_allowed, "Whether the screen's sums run on AMX tiles here (isa 'amx')");
  m.def("vnni_available", &vnni_supported, "Whether the screen's sums take AVX-512 VNNI here (isa 'avx512')");
  m.def("int16_screen_available", &int16_screen_available, "Whether int16_screen runs on this CPU",
        py::arg("isa") = "auto");
  m.def("greedy_tokens", &greedy_tokens, "The screened head's proven tokens for float32 rows (-1: the float32 head decides)",
        py::arg("rows"), py::arg("quantized"), py::arg("scales"), py::arg("row_bounds"), py::arg("weight"),
        py::arg("gamma32"), py::arg("gamma64"), py::arg("fp32_unit"), py::arg("output"), py::arg("safety"),
        py::arg("isa") = "auto", py::arg("tiles_from") = 0);
  m.def("screen_inputs", &screen_inputs, "The screened head's 16-bit integer rows, their scales and the bounds' coefficients",
        py::arg("rows"), py::arg("gamma32"), py::arg("fp32_unit"), py::arg("safety"));
  m.def("int16_screen", &int16_screen,
        "The screened head's product for 16-bit integer rows (exact sums: VNNI, or AMX tiles from tiles_from rows)",
        py::arg("input"), py::arg("x_scales"), py::arg("quantized"), py::arg("scales"), py::arg("isa") = "auto",
        py::arg("tiles_from") = 0);
}
