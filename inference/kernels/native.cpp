// The runtime's C++ kernels, loaded by native.py with torch.utils.cpp_extension:
// - decoder_layers: the direct forward's lean decoder layers (direct_forward.py, _lean_layers) as one
//   call. The same ATen operations on the same values in the same order as the Python loop, so the
//   results are bitwise the same; what goes is the interpreter between them (~4 ms of a ~32 ms SmolLM2
//   step on a 2-core CPU). See native_layers.py for when it is used.
// - screen_contenders: the screened head's bound and contender search (greedy_head.py) in two passes
//   over the vocabulary instead of ten tensor-wide operations.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

// Per decoder layer, in this order (the projections as transposed views of their weights: what F.linear
// multiplies a bias-free input by).
enum Weight { kInputNorm, kQuery, kKey, kValue, kOutput, kGate, kUp, kDown, kPostNorm, kWeightsPerLayer };
constexpr int64_t kProjections = 7;  // kQuery .. kDown

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

// One projection of `rows` (rows, width): through its pack where one is given (non-empty; oneDNN's or
// MKL's as `onednn` says: both are mkldnn-layout tensors), else F.linear's product for a bias-free input
// (mm with the transposed weight).
at::Tensor project(const at::Tensor& rows, const at::Tensor& transposed, const at::Tensor& pack, bool onednn) {
  if (pack.numel() == 0) return at::mm(rows, transposed);
  if (onednn) return onednn_packed_linear(rows, pack);
  return mkl_packed_linear(rows, pack, transposed.t());
}

}  // namespace

// Runs every layer on x (1, rows, width) whose rows sit at cache rows [start, start + rows): each layer's
// key and value rows are written into its preallocated buffer (1, kv_heads, capacity, head_dim) there,
// and attention reads rows [0, start + rows) under `mask` (none: every row is seen; one-token steps).
// `packs` holds kProjections tensors per layer, empty where the projection is not packed, and `onednn`
// says per projection whether its pack is oneDNN's (else MKL's). `fused` holds two tensors per layer,
// oneDNN packs of [q; k; v] and [gate; up] stacked (empty: separate products): oneDNN computes each
// output column alone, so a stacked product's columns are bitwise the separate products' (checked when
// the pack is made, packed_gemm.PackedGemm.fused_pack). Returns each layer's output.
std::vector<at::Tensor> decoder_layers(
    at::Tensor x, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& packs,
    const std::vector<double>& norm_eps, const at::Tensor& cos, const at::Tensor& signed_sin,
    const std::optional<at::Tensor>& mask, const std::vector<at::Tensor>& key_buffers,
    const std::vector<at::Tensor>& value_buffers, int64_t start, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double scaling, bool grouped, const std::vector<bool>& onednn,
    const std::vector<at::Tensor>& fused) {
  const int64_t layers = static_cast<int64_t>(key_buffers.size());
  TORCH_CHECK(weights.size() == static_cast<size_t>(layers * kWeightsPerLayer), "decoder_layers: weights");
  TORCH_CHECK(packs.size() == static_cast<size_t>(layers * kProjections), "decoder_layers: packs");
  TORCH_CHECK(onednn.size() == packs.size(), "decoder_layers: onednn");
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
    auto dnn = [&](Weight projection) -> bool { return onednn[i * kProjections + projection - kQuery]; };
    at::Tensor normed = rms_norm(x, w[kInputNorm], norm_eps[2 * i]).view({rows, width});
    at::Tensor query, key, value;
    if (fused[2 * i].numel() > 0) {
      at::Tensor all = onednn_packed_linear(normed, fused[2 * i]);
      query = columns(all, 0, heads * head_dim);
      key = columns(all, heads * head_dim, kv_heads * head_dim);
      value = columns(all, (heads + kv_heads) * head_dim, kv_heads * head_dim);
    } else {
      query = project(normed, w[kQuery], p(kQuery), dnn(kQuery));
      key = project(normed, w[kKey], p(kKey), dnn(kKey));
      value = project(normed, w[kValue], p(kValue), dnn(kValue));
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
    x = x + project(attended.view({rows, -1}), w[kOutput], p(kOutput), dnn(kOutput));
    normed = rms_norm(x, w[kPostNorm], norm_eps[2 * i + 1]).view({rows, width});
    at::Tensor gated;
    if (fused[2 * i + 1].numel() > 0) {
      at::Tensor all = onednn_packed_linear(normed, fused[2 * i + 1]);
      const int64_t inner = all.size(1) / 2;
      gated = at::silu(columns(all, 0, inner)) * columns(all, inner, inner);
    } else {
      gated = at::silu(project(normed, w[kGate], p(kGate), dnn(kGate))) * project(normed, w[kUp], p(kUp), dnn(kUp));
    }
    x = x + project(gated, w[kDown], p(kDown), dnn(kDown));
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
    float floor = -std::numeric_limits<float>::infinity();
    bool finite = true;
    for (int64_t i = 0; i < vocab; ++i) {
      const float value = static_cast<float>(a[i]);
      finite = finite && std::isfinite(value);
      floor = std::max(floor, value - bound(i, value));
    }
    if (!finite) floor = std::numeric_limits<float>::quiet_NaN();
    floors.data_ptr<float>()[r] = floor;
    std::vector<int64_t> found;
    for (int64_t i = 0; finite && i < vocab; ++i) {
      const float value = static_cast<float>(a[i]);
      if (value + bound(i, value) >= floor) found.push_back(i);
    }
    contenders.push_back(at::tensor(found, at::kLong));
  }
  return {floors, contenders};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers", &decoder_layers, "The lean path's decoder layers (bitwise the same)");
  m.def("screen_contenders", &screen_contenders, "The screened head's floors and contenders per row");
}
