// The runtime's C++ kernels, loaded by native.py with torch.utils.cpp_extension:
// - decoder_layers: the direct forward's lean decoder layers (direct_forward.py, _lean_layers) as one
//   call. The same ATen operations on the same values in the same order as the Python loop, so the
//   results are bitwise the same; what goes is the interpreter between them (~4 ms of a ~32 ms SmolLM2
//   step on a 2-core CPU). See native_layers.py for when it is used.
// - screen_contenders: the screened head's bound and contender search (greedy_head.py) in two passes
//   over the vocabulary instead of ten tensor-wide operations.
// - proven_argmax: the screened head's proof for one row, reading the contenders' weight rows in place.
// - int8_screen: the screened head's int8 product (greedy_head.py) reading each weight row from memory
//   once for all rows of a tree (torch's int8 product reads the weights once per row), with AVX2 and FMA.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define DRAFTSMITH_X86 1
#endif

at::Tensor stream_linear(const at::Tensor& rows, const at::Tensor& pack);

namespace {

// Per decoder layer, in this order (the projections as transposed views of their weights: what F.linear
// multiplies a bias-free input by).
enum Weight { kInputNorm, kQuery, kKey, kValue, kOutput, kGate, kUp, kDown, kPostNorm, kWeightsPerLayer };
constexpr int64_t kProjections = 7;  // kQuery .. kDown
constexpr int64_t kContenderSpan = 8192;  // tokens per task of screen_contenders
constexpr int64_t kStreamBlock = 16;  // outputs per block of a stream pack (stream_pack): two vectors

// LlamaRMSNorm.forward for a float32 input (its casts are no-ops there).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor variance = x.pow(2).mean({-1}, /*keepdim=*/true);
  return weight * (x * at::rsqrt(variance + eps));
}

// q * cos + rotate_half(q) * sin, with rotate_half's sign moved onto signed_sin (exact).
at::Tensor rotate(const at::Tensor& q, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t half) {
  return (q * cos) + (at::roll(q, {half}, {-1}) * signed_sin);
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

// Columns [start, start + width) of a projection's output (rows, all): a view, no copy.
at::Tensor columns(const at::Tensor& all, int64_t start, int64_t width) { return all.narrow(1, start, width); }

// Whose pack a projection multiplies through (packed_gemm.PackedGemm.kernel; the codes native_layers.py
// passes).
enum PackKind { kMklPack = 0, kOneDnnPack = 1, kStreamPack = 2 };

// A pack's product with `rows` (rows, width), bias-free: MKL's and oneDNN's packs are mkldnn-layout
// tensors, the stream kernel's a float32 one (stream_pack).
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

// Weight rows this far ahead of the ones being summed are requested from memory: the hardware
// prefetcher alone leaves a single core far below the memory's bandwidth on these interleaved rows.
constexpr int64_t kPrefetchRows = 8;

// sums[r * V + i + t] for R rows of x (float32, R x K) and tokens [i, i + T) of q (int8, V x K): float32
// sums of products that are exact (a bfloat16 value times an int8 one needs 15 significant bits).
template <int R, int T>
AVX2 inline void screen_block(const float* x, const int8_t* q, int64_t K, int64_t V, int64_t i, float* sums) {
  // the loops over t and r unrolled, so that the accumulators live in registers at -O2 too
  __m256 acc[T][R];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  const int64_t ahead = std::min(i + kPrefetchRows, V - T);
  for (int64_t k = 0; k < K; k += 8) {
    if ((k & 63) == 0)
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) _mm_prefetch(reinterpret_cast<const char*>(q + (ahead + t) * K + k), _MM_HINT_T0);
    __m256 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (i + t) * K + k));
      const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[t][r] = _mm256_fmadd_ps(w, xv[r], acc[t][r]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[r * V + i + t] = lane_sum(acc[t][r]);
}

// Tokens [begin, end) for R rows, T tokens at a time (R x T accumulators fit the 16 vector registers).
template <int R, int T>
AVX2 void screen_tokens(const float* x, const int8_t* q, int64_t K, int64_t V, int64_t begin, int64_t end,
                        float* sums) {
  int64_t i = begin;
  for (; i + T <= end; i += T) screen_block<R, T>(x, q, K, V, i, sums);
  for (; i < end; ++i) screen_block<R, 1>(x, q, K, V, i, sums);
}

// Tokens [begin, end) for every row: a few tokens at a time, so that after the first group of up to 8
// rows has read their weights from memory, the next groups find them in the L1 cache.
AVX2 void screen_span(const float* x, int64_t rows, const int8_t* q, int64_t K, int64_t V, int64_t begin,
                      int64_t end, float* sums) {
  constexpr int64_t kTokensPerPass = 24;
  for (int64_t first = begin; first < end; first += kTokensPerPass) {
    const int64_t last = std::min(end, first + kTokensPerPass);
    for (int64_t r = 0; r < rows; r += 8) {
      const float* xr = x + r * K;
      float* sr = sums + r * V;
      switch (std::min<int64_t>(8, rows - r)) {
        case 1: screen_tokens<1, 4>(xr, q, K, V, first, last, sr); break;
        case 2: screen_tokens<2, 4>(xr, q, K, V, first, last, sr); break;
        case 3: screen_tokens<3, 3>(xr, q, K, V, first, last, sr); break;
        case 4: screen_tokens<4, 2>(xr, q, K, V, first, last, sr); break;
        case 5: screen_tokens<5, 2>(xr, q, K, V, first, last, sr); break;
        case 6: screen_tokens<6, 2>(xr, q, K, V, first, last, sr); break;
        case 7: screen_tokens<7, 1>(xr, q, K, V, first, last, sr); break;
        default: screen_tokens<8, 1>(xr, q, K, V, first, last, sr); break;
      }
    }
  }
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

// Outputs [o, o + 16) for R rows of x (R x I), over inputs [k0, k1) of their block `w` ([I][16]); the
// sums so far are in y (k0 > 0: stored and reloaded exactly). Asks the L2 cache for the same inputs of
// `later` (a later block), one line per input, so memory streams while the rows are multiplied.
template <int R>
AVX2 inline void stream_tile(const float* x, int64_t I, const float* w, int64_t k0, int64_t k1, const float* later,
                             float* y, int64_t O, int64_t o) {
  __m256 low[R], high[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    low[r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * O + o);
    high[r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * O + o + 8);
  }
  for (int64_t k = k0; k < k1; ++k) {
    if (later != nullptr) _mm_prefetch(reinterpret_cast<const char*>(later + k * kStreamBlock), _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(w + k * kStreamBlock);
    const __m256 w1 = _mm256_loadu_ps(w + k * kStreamBlock + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * I + k);
      low[r] = _mm256_fmadd_ps(w0, xr, low[r]);
      high[r] = _mm256_fmadd_ps(w1, xr, high[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * O + o, low[r]);
    _mm256_storeu_ps(y + r * O + o + 8, high[r]);
  }
}

AVX2 void stream_pass(int64_t rows, const float* x, int64_t I, const float* w, int64_t k0, int64_t k1,
                      const float* later, float* y, int64_t O, int64_t o) {
  switch (rows) {
    case 1: stream_tile<1>(x, I, w, k0, k1, later, y, O, o); break;
    case 2: stream_tile<2>(x, I, w, k0, k1, later, y, O, o); break;
    case 3: stream_tile<3>(x, I, w, k0, k1, later, y, O, o); break;
    case 4: stream_tile<4>(x, I, w, k0, k1, later, y, O, o); break;
    case 5: stream_tile<5>(x, I, w, k0, k1, later, y, O, o); break;
    default: stream_tile<6>(x, I, w, k0, k1, later, y, O, o); break;
  }
}

// Blocks [begin, end) of the pack for every row, a tile of inputs at a time: the first pass of rows
// reads the tile from memory, the others find it in L1. Rows go in passes of equal size (8 rows: two
// of 4), each at most kStreamMaxRowsPerPass.
AVX2 void stream_blocks(const float* x, int64_t rows, const float* pack, int64_t I, int64_t O, int64_t begin,
                        int64_t end, float* y) {
  const int64_t passes = (rows + kStreamMaxRowsPerPass - 1) / kStreamMaxRowsPerPass;
  for (int64_t block = begin; block < end; ++block) {
    const float* w = pack + block * kStreamBlock * I;
    const float* later = block + 1 < end ? w + kStreamBlock * I : nullptr;
    for (int64_t k0 = 0; k0 < I; k0 += kStreamInputsPerTile) {
      const int64_t k1 = std::min(I, k0 + kStreamInputsPerTile);
      for (int64_t pass = 0, r = 0; pass < passes; ++pass) {
        const int64_t here = (rows - r) / (passes - pass);
        stream_pass(here, x + r * I, I, w, k0, k1, pass == 0 ? later : nullptr, y + r * O, O,
                    block * kStreamBlock);
        r += here;
      }
    }
  }
}

// The last O % 16 outputs (stored [I][tail] after the blocks): the same sums, one output at a time
// (std::fma rounds as a vector lane's fused multiply-add does).
AVX2 void stream_tail(const float* x, int64_t rows, const float* pack, int64_t I, int64_t O, float* y) {
  const int64_t first = O / kStreamBlock * kStreamBlock, tail = O - first;
  const float* w = pack + first * I;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < tail; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < I; ++k) sum = std::fma(w[k * tail + j], x[r * I + k], sum);
      y[r * O + first + j] = sum;
    }
}
#undef AVX2
#endif  // DRAFTSMITH_X86

}  // namespace

// Whether int8_screen and stream_linear run on this CPU (an x86-64 one with AVX2 and FMA); elsewhere the
// runtime keeps torch's int8 product and another linear kernel.
bool simd_supported() {
#ifdef DRAFTSMITH_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// The stream pack of a float32 weight (O, I) (see stream_blocks).
at::Tensor stream_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "stream_pack: a float32 (out, in) weight");
  const int64_t O = weight.size(0), I = weight.size(1), full = O / kStreamBlock * kStreamBlock;
  at::Tensor pack = at::empty({O, I}, weight.options().memory_format(at::MemoryFormat::Contiguous));
  pack.narrow(0, 0, full)
      .view({full / kStreamBlock, I, kStreamBlock})
      .copy_(weight.narrow(0, 0, full).reshape({full / kStreamBlock, kStreamBlock, I}).transpose(1, 2));
  pack.narrow(0, full, O - full).view({I, O - full}).copy_(weight.narrow(0, full, O - full).t());
  return pack;
}

// rows (..., I) float32 times the weight packed in `pack` (O, I), bias-free: (..., O). Only where
// simd_supported().
at::Tensor stream_linear(const at::Tensor& rows, const at::Tensor& pack) {
  TORCH_CHECK(simd_supported(), "stream_linear: needs an x86-64 CPU with AVX2 and FMA");
  TORCH_CHECK(pack.dim() == 2 && pack.scalar_type() == at::kFloat && pack.is_contiguous(), "stream_linear: pack");
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.size(-1) == pack.size(1), "stream_linear: rows");
  const int64_t O = pack.size(0), I = pack.size(1), count = rows.numel() / I;
  const at::Tensor x = rows.reshape({count, I}).contiguous();
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = O;
  at::Tensor y = at::empty({count, O}, x.options());
#ifdef DRAFTSMITH_X86
  const float* xp = x.data_ptr<float>();
  const float* pp = pack.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, O / kStreamBlock, 4, [&](int64_t begin, int64_t end) {
    stream_blocks(xp, count, pp, I, O, begin, end, yp);
  });
  stream_tail(xp, count, pp, I, O, yp);
#endif
  return y.view(shape);
}

// What torch._weight_int8pack_mm(input, quantized, scales) computes, as greedy_head.py's bound assumes
// it: a_ri = bfloat16(s_i * sum_k x_rk q_ik), the sum in float32 (any order) of exact products, the
// scale applied after it, rounded to the nearest bfloat16. input (R, K) bfloat16, quantized (V, K) int8
// with K a multiple of 8, scales (V) bfloat16. Only where simd_supported().
at::Tensor int8_screen(const at::Tensor& input, const at::Tensor& quantized, const at::Tensor& scales) {
  TORCH_CHECK(simd_supported(), "int8_screen: needs an x86-64 CPU with AVX2 and FMA");
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kBFloat16, "int8_screen: input");
  TORCH_CHECK(quantized.dim() == 2 && quantized.scalar_type() == at::kChar && quantized.is_contiguous() &&
                  quantized.size(1) == input.size(1) && quantized.size(1) % 8 == 0,
              "int8_screen: quantized");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.size(0) == quantized.size(0),
              "int8_screen: scales");
  const int64_t rows = input.size(0), K = input.size(1), V = quantized.size(0);
  const at::Tensor x = input.to(at::kFloat).contiguous();  // exact
  at::Tensor sums = at::empty({rows, V}, x.options());
  at::Tensor screen = at::empty({rows, V}, input.options());
#ifdef DRAFTSMITH_X86
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = quantized.data_ptr<int8_t>();
  float* sp = sums.data_ptr<float>();
  const at::BFloat16* scale = scales.data_ptr<at::BFloat16>();
  at::BFloat16* out = screen.data_ptr<at::BFloat16>();
  at::parallel_for(0, V, 2048, [&](int64_t begin, int64_t end) {
    screen_span(xp, rows, qp, K, V, begin, end, sp);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = begin; i < end; ++i) out[r * V + i] = at::BFloat16(sp[r * V + i] * static_cast<float>(scale[i]));
  });
#endif
  return screen;
}

// Runs every layer on x (1, rows, width) whose rows sit at cache rows [start, start + rows): each layer's
// key and value rows are written into its preallocated buffer (1, kv_heads, capacity, head_dim) there,
// and attention reads rows [0, start + rows) under `mask` (none: every row is seen; one-token steps).
// `packs` holds kProjections tensors per layer, empty where the projection is not packed, and `kinds`
// each one's PackKind. `fused` holds two tensors per layer, packs of [q; k; v] and [gate; up] stacked
// (empty: separate products) of the kind of q's and gate's packs: oneDNN and the stream kernel compute
// each output column alone, so a stacked product's columns are bitwise the separate products' (checked
// when the pack is made, packed_gemm.PackedGemm.fused_pack). Returns each layer's output.
std::vector<at::Tensor> decoder_layers(
    at::Tensor x, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& packs,
    const std::vector<double>& norm_eps, const at::Tensor& cos, const at::Tensor& signed_sin,
    const std::optional<at::Tensor>& mask, const std::vector<at::Tensor>& key_buffers,
    const std::vector<at::Tensor>& value_buffers, int64_t start, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double scaling, bool grouped, const std::vector<int64_t>& kinds,
    const std::vector<at::Tensor>& fused) {
  const int64_t layers = static_cast<int64_t>(key_buffers.size());
  TORCH_CHECK(weights.size() == static_cast<size_t>(layers * kWeightsPerLayer), "decoder_layers: weights");
  TORCH_CHECK(packs.size() == static_cast<size_t>(layers * kProjections), "decoder_layers: packs");
  TORCH_CHECK(kinds.size() == packs.size(), "decoder_layers: kinds");
  TORCH_CHECK(norm_eps.size() == static_cast<size_t>(layers * 2), "decoder_layers: norm_eps");
  TORCH_CHECK(fused.size() == static_cast<size_t>(layers * 2), "decoder_layers: fused");
  const int64_t rows = x.size(1);
  const int64_t width = x.size(2);
  const int64_t half = head_dim / 2;
  std::vector<at::Tensor> outputs;
  outputs.reserve(layers);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &weights[i * kWeightsPerLayer];
    auto p = [&](Weight projection) -> const at::Tensor& { return packs[i * kProjections + projection - kQuery]; };
    auto kind = [&](Weight projection) -> int64_t { return kinds[i * kProjections + projection - kQuery]; };
    at::Tensor normed = rms_norm(x, w[kInputNorm], norm_eps[2 * i]).view({rows, width});
    at::Tensor query, key, value;
    if (fused[2 * i].numel() > 0) {
      at::Tensor all = packed_product(normed, fused[2 * i], kind(kQuery), w[kQuery]);
      query = columns(all, 0, heads * head_dim);
      key = columns(all, heads * head_dim, kv_heads * head_dim);
      value = columns(all, (heads + kv_heads) * head_dim, kv_heads * head_dim);
    } else {
      query = project(normed, w[kQuery], p(kQuery), kind(kQuery));
      key = project(normed, w[kKey], p(kKey), kind(kKey));
      value = project(normed, w[kValue], p(kValue), kind(kValue));
    }
    query = query.view({1, rows, heads, head_dim}).transpose(1, 2);
    key = key.view({1, rows, kv_heads, head_dim}).transpose(1, 2);
    value = value.view({1, rows, kv_heads, head_dim}).transpose(1, 2);
    query = rotate(query, cos, signed_sin, half);
    key = rotate(key, cos, signed_sin, half);
    key_buffers[i].narrow(2, start, rows).copy_(key);
    value_buffers[i].narrow(2, start, rows).copy_(value);
    at::Tensor keys = key_buffers[i].narrow(2, 0, start + rows);
    at::Tensor values = value_buffers[i].narrow(2, 0, start + rows);
    at::Tensor attended = at::scaled_dot_product_attention(
        query, keys, values, mask, /*dropout_p=*/0.0, /*is_causal=*/false, scaling, grouped);
    attended = attended.transpose(1, 2).contiguous();
    x = x + project(attended.view({rows, -1}), w[kOutput], p(kOutput), kind(kOutput));
    normed = rms_norm(x, w[kPostNorm], norm_eps[2 * i + 1]).view({rows, width});
    at::Tensor gated;
    if (fused[2 * i + 1].numel() > 0) {
      at::Tensor all = packed_product(normed, fused[2 * i + 1], kind(kGate), w[kGate]);
      const int64_t inner = all.size(1) / 2;
      gated = at::silu(columns(all, 0, inner)) * columns(all, inner, inner);
    } else {
      gated = at::silu(project(normed, w[kGate], p(kGate), kind(kGate))) * project(normed, w[kUp], p(kUp), kind(kUp));
    }
    x = x + project(gated, w[kDown], p(kDown), kind(kDown));
    outputs.push_back(x);
  }
  return outputs;
}

// For each row r of the screen (R, V; bfloat16): the bound D_ri = (c_r0 * b_0i + c_r1 * b_1i +
// output * |a_ri|) * safety on how far token i's float32 logit can be from its screened one a_ri
// (GreedyHead.screen_bounds, in float32 as there; the safety factor covers a few roundings more or
// less), the floor max_i (a_ri - D_ri) that some token's logit reaches, and the contenders: tokens with
// a_ri + D_ri >= floor. Returns the floors (R, float32; not finite where the screen was not) and each
// row's contenders (int64, ascending).
std::tuple<at::Tensor, std::vector<at::Tensor>> screen_contenders(
    const at::Tensor& screen, const at::Tensor& row_bounds, const at::Tensor& coefficients, double output,
    double safety) {
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
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16* a = screen.data_ptr<at::BFloat16>() + r * vocab;
    const float c0 = coefficients.data_ptr<float>()[2 * r];
    const float c1 = coefficients.data_ptr<float>()[2 * r + 1];
    auto bound = [&](int64_t i, float value) { return (c0 * b0[i] + c1 * b1[i] + out * std::fabs(value)) * slack; };
    // Spans of the vocabulary on all threads: the maximum and the contenders' order do not depend on
    // how it is split.
    const int64_t spans = (vocab + kContenderSpan - 1) / kContenderSpan;
    auto span_end = [&](int64_t span) { return std::min(vocab, (span + 1) * kContenderSpan); };
    std::vector<float> span_floors(spans, -std::numeric_limits<float>::infinity());
    std::vector<char> span_finite(spans, 1);
    at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
      for (int64_t span = begin; span < end; ++span) {
        float highest = -std::numeric_limits<float>::infinity();
        bool all_finite = true;
        for (int64_t i = span * kContenderSpan; i < span_end(span); ++i) {
          const float value = static_cast<float>(a[i]);
          all_finite = all_finite && std::isfinite(value);
          highest = std::max(highest, value - bound(i, value));
        }
        span_floors[span] = highest;
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
        for (int64_t span = begin; span < end; ++span)
          for (int64_t i = span * kContenderSpan; i < span_end(span); ++i) {
            const float value = static_cast<float>(a[i]);
            if (value + bound(i, value) >= floor) span_found[span].push_back(i);
          }
      });
    std::vector<int64_t> found;
    for (const auto& part : span_found) found.insert(found.end(), part.begin(), part.end());
    contenders.push_back(at::tensor(found, at::kLong));
  }
  return {floors, contenders};
}

// GreedyHead._proven_argmax for one row x (K, float32) and its contenders (int64 token ids) of the float32
// head `weight` (V, K): the contenders' logits and magnitudes sum_k |w_ik x_k| in float64 read straight
// from the weight rows, each one's float32 error bound (gamma32 + 2 gamma64) * magnitude * safety + 1e-30,
// and the best one returned where it beats every other contender by more than both bounds (-1: not
// proven, or a value that is not finite).
int64_t proven_argmax(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& contenders, double gamma32,
                      double gamma64, double safety) {
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
  std::vector<double> logits(count), errors(count);
  int64_t best = -1;
  for (int64_t c = 0; c < count; ++c) {
    TORCH_CHECK(ids[c] >= 0 && ids[c] < V, "proven_argmax: a contender outside the vocabulary");
    const float* w = wp + ids[c] * K;
    double logit = 0.0, magnitude = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double product = static_cast<double>(w[k]) * static_cast<double>(xp[k]);  // exact
      logit += product;
      magnitude += std::fabs(product);
    }
    logits[c] = logit;
    errors[c] = (gamma32 + 2.0 * gamma64) * magnitude * safety + 1e-30;
    if (!std::isfinite(logit) || !std::isfinite(errors[c])) return -1;
    if (best < 0 || logit > logits[best]) best = c;  // the first of equal maxima, as torch's argmax
  }
  if (best < 0) return -1;
  double rivals = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < count; ++c)
    if (c != best) rivals = std::max(rivals, logits[c] + errors[c]);
  return logits[best] - errors[best] > rivals ? ids[best] : -1;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers", &decoder_layers, "The lean path's decoder layers (bitwise the same)");
  m.def("screen_contenders", &screen_contenders, "The screened head's floors and contenders per row");
  m.def("proven_argmax", &proven_argmax, "The screened head's proof for one row (-1: not proven)");
  m.def("simd_supported", &simd_supported, "Whether int8_screen and stream_linear run on this CPU");
  m.def("stream_pack", &stream_pack, "A float32 weight in the stream kernel's layout");
  m.def("stream_linear", &stream_linear, "The stream kernel's product: weights read once for all rows");
  m.def("int8_screen", &int8_screen, "The screened head's int8 product, weights read once for all rows");
}
