// The lean path's one-row decoder layers (direct_forward.py, _lean_layers) as one C++ call.
//
// The same ATen operations on the same values in the same order as the Python loop, so the results are
// bitwise the same; what goes is the interpreter between them (~5 ms of a ~32 ms SmolLM2 step on a
// 2-core CPU). Loaded by native_layers.py with torch.utils.cpp_extension; see that module for when it
// is used.
#include <torch/extension.h>

#include <vector>

namespace {

// Per decoder layer, in this order (the projections as transposed views of their weights, which is what
// F.linear multiplies a one-row input by).
enum Weight { kInputNorm, kQuery, kKey, kValue, kOutput, kGate, kUp, kDown, kPostNorm, kWeightsPerLayer };

// LlamaRMSNorm.forward for a float32 input (its casts are no-ops there).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor variance = x.pow(2).mean({-1}, /*keepdim=*/true);
  return weight * (x * at::rsqrt(variance + eps));
}

// q * cos + rotate_half(q) * sin, with rotate_half's sign moved onto signed_sin (exact).
at::Tensor rotate(const at::Tensor& q, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t half) {
  return (q * cos) + (at::roll(q, {half}, {-1}) * signed_sin);
}

}  // namespace

// Runs every layer on x (1, 1, width) at cache row `start`: each layer's key and value row is written
// into its preallocated buffer (batch 1, kv_heads, capacity, head_dim) at `start`, and attention reads
// rows [0, start]. Returns each layer's output.
std::vector<at::Tensor> one_row_layers(
    at::Tensor x, const std::vector<at::Tensor>& weights, const std::vector<double>& norm_eps,
    const at::Tensor& cos, const at::Tensor& signed_sin, const std::vector<at::Tensor>& key_buffers,
    const std::vector<at::Tensor>& value_buffers, int64_t start, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double scaling) {
  const int64_t layers = static_cast<int64_t>(key_buffers.size());
  TORCH_CHECK(weights.size() == static_cast<size_t>(layers * kWeightsPerLayer), "one_row_layers: weights");
  TORCH_CHECK(norm_eps.size() == static_cast<size_t>(layers * 2), "one_row_layers: norm_eps");
  const int64_t width = x.size(2);
  const int64_t half = head_dim / 2;
  const bool grouped = heads != kv_heads;
  std::vector<at::Tensor> outputs;
  outputs.reserve(layers);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &weights[i * kWeightsPerLayer];
    at::Tensor row = rms_norm(x, w[kInputNorm], norm_eps[2 * i]).view({1, width});
    at::Tensor query = at::mm(row, w[kQuery]).view({1, 1, heads, head_dim}).transpose(1, 2);
    at::Tensor key = at::mm(row, w[kKey]).view({1, 1, kv_heads, head_dim}).transpose(1, 2);
    at::Tensor value = at::mm(row, w[kValue]).view({1, 1, kv_heads, head_dim}).transpose(1, 2);
    query = rotate(query, cos, signed_sin, half);
    key = rotate(key, cos, signed_sin, half);
    key_buffers[i].narrow(2, start, 1).copy_(key);
    value_buffers[i].narrow(2, start, 1).copy_(value);
    at::Tensor keys = key_buffers[i].narrow(2, 0, start + 1);
    at::Tensor values = value_buffers[i].narrow(2, 0, start + 1);
    at::Tensor attended = at::scaled_dot_product_attention(
        query, keys, values, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/false, scaling, grouped);
    attended = attended.transpose(1, 2).contiguous();
    x = x + at::mm(attended.view({1, -1}), w[kOutput]);
    row = rms_norm(x, w[kPostNorm], norm_eps[2 * i + 1]).view({1, width});
    x = x + at::mm(at::silu(at::mm(row, w[kGate])) * at::mm(row, w[kUp]), w[kDown]);
    outputs.push_back(x);
  }
  return outputs;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("one_row_layers", &one_row_layers, "The lean path's one-row decoder layers (bitwise the same)");
}
