// The whole decoder stack of a Llama-family model for one CPU forward, in one call, with its
// kin's quirks (ModelConfig.stack_shaped): Qwen3's and OLMo 2's q/k norms, OLMo 2's post-norms,
// sliding windows (Mistral; Gemma's interleaved with global layers, with or without a window
// pool), Gemma 2/3's sandwich norms of 1 + weight, GELU gates, soft-cap and local RoPE base.
//
// A batch-1 decode step of SmolLM2 is ~300 small operations (per layer: two RMSNorms, four
// linears, RoPE, the paged attention, SiLU * up, the residual adds). Launched one by one
// from Python, each paid the interpreter, torch's Python binding and the dispatcher, ~4.6 ms
// of a step whose weights stream in ~18 ms (fp32), ~3 ms (int4): for quantized weights the
// overhead was the larger part. Here the layers run in C++, calling the very same kernels in
// the same order (the project's ops through the dispatcher, torch's int4 kernel through
// ATen), so the result is bit for bit that of the Python path (tests/model/
// test_decoder_layers.py holds both to it): only the per-op overhead goes.
//
// Each linear layer is described by a kind and three optional tensors (see ``Kind``); the
// Python side (``decoder_stack.py``) builds the lists once from the model's modules and only
// takes this path for row counts at which every linear would run the kernel named here
// (cpu_gemv's kernels, oneDNN's packed GEMM, int8's decode-then-GEMM past its crossover,
// torch's int4 kernel below its dense crossover).

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

// How a linear layer multiplies (its three tensors a, b, bias):
enum Kind : int64_t {
  kDense = 0,         // plain weight of x's dtype: up to ``group`` rows gemv_dense(x, a = weight, bias),
                      // above them oneDNN's linear on b = its pre-packed copy (cpu_linear.PackedLinear)
  kInt8 = 1,          // up to ``group`` rows gemv_int8(x as bf16, a = int8 codes, b = bf16 scales), above
                      // them linear(x as bf16, int8_dequantize(a, b)) (Int8Linear's dense path); back
                      // to x's dtype, + bias
  kInt4Torch = 2,     // torch's _weight_int4pack_mm_for_cpu(x as bf16, a = packed, group, b = scales/zeros)
  kInt4Gemv = 3,      // gemv_int4(x as bf16, a = packed, b = scales/zeros, group)
};
constexpr int64_t kSlots = 3;  // tensors per linear in the weight list: a, b, bias
constexpr int64_t kLinears = 4;  // qkv, o, gate_up, down

// Where the norms sit (layers/decoder.py): before each block (Llama), on each block's output
// (OLMo 2), or both (Gemma's sandwich, four norms a layer).
enum NormLayout : int64_t { kPreNorm = 0, kPostNorm = 1, kSandwich = 2 };
// The MLP's gate activation (GatedMLP.act).
enum Act : int64_t { kSilu = 0, kGeluTanh = 1 };

using OptT = std::optional<at::Tensor>;

// The project's kernels, looked up once (they are registered by the other sources of this
// library; the dispatcher call is ~1 us, the Python one it replaces ~15-40 us).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&)> gemv_dense;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> gemv_int8;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> int8_dequantize;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)> gemv_int4;
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&)> rotary;
  c10::TypedOperatorHandle<void(const at::Tensor&, at::Tensor)> silu_mul;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, double, OptT, at::Tensor)> rms_norm;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const OptT&,
                                const OptT&, const OptT&, int64_t, double, const OptT&)>
      paged_attention;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                                const at::Tensor&, const OptT&, const OptT&, const OptT&, int64_t, double, const OptT&)>
      paged_attention_quant;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      auto find = [&](const char* name) { return d.findSchemaOrThrow(name, ""); };
      return Ops{
          find("radixserve_cpu::gemv_dense").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&)>(),
          find("radixserve_cpu::gemv_int8")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(),
          find("radixserve_cpu::int8_dequantize").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>(),
          find("radixserve_cpu::gemv_int4")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>(),
          find("radixserve_cpu::rotary_").typed<void(at::Tensor, const at::Tensor&, const at::Tensor&)>(),
          find("radixserve_cpu::silu_mul").typed<void(const at::Tensor&, at::Tensor)>(),
          find("radixserve_cpu::rms_norm")
              .typed<void(const at::Tensor&, const at::Tensor&, double, OptT, at::Tensor)>(),
          find("radixserve_cpu::paged_attention")
              .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const OptT&,
                          const OptT&, const OptT&, int64_t, double, const OptT&)>(),
          find("radixserve_cpu::paged_attention_quant")
              .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                          const at::Tensor&, const OptT&, const OptT&, const OptT&, int64_t, double, const OptT&)>(),
      };
    }();
    return ops;
  }
};

// The rows a oneDNN GEMM of ``m`` rows runs at: cpu_linear.onednn_rows (tests hold the two
// equal). oneDNN builds a kernel for every new row count (~2 ms per layer shape here, ~10 ms
// a prefill of SmolLM2), so the rows are padded to at most 16 counts per power of two.
int64_t onednn_rows(int64_t m) {
  int64_t below = 1;  // the largest power of two under m
  while (below * 2 < m) below *= 2;
  const int64_t step = std::max<int64_t>(8, below / 16);
  return (m + step - 1) / step * step;
}

// torch's mkldnn::_linear_pointwise(x, packed, bias, "none", [], ""): called boxed, its C++
// signature being torch's internal business.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const OptT& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  c10::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One linear layer over ``xt``, the first ``t`` rows of ``x``, as the model's module would run
// it at that row count; ``t`` rows out. oneDNN multiplies all of ``x``'s rows: onednn_rows(t),
// the rows past ``t`` zero (see decoder_layers: the inputs are allocated so, not copied).
at::Tensor linear(const Ops& ops, const at::Tensor& x, const at::Tensor& xt, int64_t t, int64_t kind, const OptT& a,
                  const OptT& b, const OptT& bias, int64_t group) {
  if (kind == kDense) {
    if (t <= group) return ops.gemv_dense.call(xt, *a, bias);
    TORCH_CHECK(x.size(0) == onednn_rows(t), "a oneDNN linear's input must have onednn_rows(t) rows");
    return onednn_linear(x, *b, bias).narrow(0, 0, t);
  }
  // Quantized layers multiply bf16 activations and come back to x's dtype (QuantizedLinear.forward).
  const at::Tensor xq = xt.to(at::kBFloat16);
  at::Tensor y;
  switch (kind) {
    case kInt8:
      y = t <= group ? ops.gemv_int8.call(xq.contiguous(), *a, *b) : at::linear(xq, ops.int8_dequantize.call(*a, *b));
      break;
    case kInt4Torch: y = at::_weight_int4pack_mm_for_cpu(xq, *a, group, *b); break;
    case kInt4Gemv: y = ops.gemv_int4.call(xq.contiguous(), *a, *b, group); break;
    default: TORCH_CHECK(false, "unknown linear kind ", kind);
  }
  y = y.to(x.scalar_type());
  return bias.has_value() ? y + bias->to(x.scalar_type()) : y;
}

// Heads [first, first + n) of a contiguous [t, heads, d] tensor: the view qkv.narrow(1, first,
// n) is, made in one dispatched call instead of narrow's three (narrow, slice, as_strided).
// A batch-1 step makes four such views in each of SmolLM2's 30 layers.
at::Tensor heads(const at::Tensor& qkv, int64_t first, int64_t n) {
  const int64_t d = qkv.size(2);
  return qkv.as_strided({qkv.size(0), n, d}, {qkv.stride(0), d, 1}, qkv.storage_offset() + first * d);
}

// Gemma's RMSNorm of ``x`` (OffsetRMSNorm.forward): normalized in float32 and scaled there by
// ``scale`` (float32 1 + weight, formed as that forward forms it), then cast back.
at::Tensor offset_norm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  return at::rms_norm(x.to(at::kFloat), {scale.size(0)}, scale, eps).to(x.scalar_type());
}

// A q or k RMSNorm written back in place into the fused projection (Attention._norm_qk's
// ``x.copy_(norm.forward(x))``), op for op as the norm's forward (layers/norm.py) runs on that
// view, so the bits are the per-layer path's. Gemma's (``plus_one``): offset_norm. Otherwise as
// RMSNorm.forward: a 2-D contiguous view of the weight's dtype (OLMo 2's whole-projection norm
// of a single row) through the project's rms_norm kernel; any other view (Qwen3's [t, heads,
// d], OLMo 2's rows of a wider projection) through torch: float32 input through at::rms_norm
// with the weight; 16-bit input normalized in float32, cast back, then scaled by the weight.
void qk_norm_(const Ops& ops, const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one) {
  if (plus_one) {
    x.copy_(offset_norm(x, weight, eps));
    return;
  }
  if (x.dim() == 2 && x.is_contiguous() && x.scalar_type() == weight.scalar_type()) {
    at::Tensor out = at::empty_like(x);
    ops.rms_norm.call(x, weight, eps, std::nullopt, out);
    x.copy_(out);
    return;
  }
  const std::vector<int64_t> shape{weight.size(0)};
  if (x.scalar_type() == at::kFloat) {
    x.copy_(at::rms_norm(x, shape, weight, eps));
  } else {
    x.copy_(weight * at::rms_norm(x.to(at::kFloat), shape, std::nullopt, eps).to(x.scalar_type()));
  }
}

// A LoRA adapter's delta on one linear's output ``y``, columns from ``lo``: (x a^T) b^T by the
// GEMV kernel, added in place, as model/lora's LoraDelta.apply computes it (the same bits as
// the per-layer path). No adapter on this linear: ``a`` is empty.
void add_lora(const Ops& ops, const at::Tensor& x, const at::Tensor& y, const OptT& a, const OptT& b, int64_t lo) {
  if (!a.has_value()) return;
  const at::Tensor delta = ops.gemv_dense.call(ops.gemv_dense.call(x, *a, std::nullopt), *b, std::nullopt);
  y.narrow(1, lo, delta.size(1)).add_(delta);
}

// Every layer over the batch's rows, ``h`` ([T, hidden], the embeddings) updated in place to
// the last layer's output (before the final norm). Per layer l: norms[2l], norms[2l + 1]
// (input and post-attention RMSNorm weights; see norm_layout); linear j (qkv, o, gate_up, down) of layer l has
// kind kinds[4l + j], group size groups[4l + j] and tensors weights[3(4l + j) ..][a, b, bias];
// KV pages k_pages[l], v_pages[l]. rope: cos, sin ([T, 1, D] float32), then, where the
// sliding layers rotate with a base of their own (Gemma 3), their cos and sin: windowed layers
// take those. act: the MLP's gate activation (Act). plans: attention plans, eight
// index tensors each (native.AttentionPlan's fields, in order), and slots[p], where plan p's
// layers store the rows' K/V; layer l attends through plan layer_plans[l] over its last
// windows[l] keys (0: all of them). The global layers share one plan; each sliding window
// has its own (no shared pages, each sequence's pages from the first its window reaches),
// with the window pool's slots where its layers' KV lives there (engine/window_view.py).
// Empty layer_plans and windows: every layer plan 0, no window. softcap: the attention
// scores' soft-cap (Gemma 2; 0: none), every layer's. k_scales, v_scales: empty (unquantized
// pages), or every layer's KV scales, its pages then int8, int4 or fp8 codes (paged_attention_quant:
// the rows stored quantized, each chunk of keys decoded as the per-layer path's kernel does).
// qk_norms: empty, or per layer the q and k norm weights, applied before RoPE: over each head
// (qk_norm_mode 1, Qwen3, Gemma 3) or over the whole q and k projections (2, OLMo 2).
// norm_layout kPostNorm: OLMo 2's (PostNormDecoderLayer): no input norm, the blocks' outputs
// normalized before each residual add; norms[2l], norms[2l + 1] are then the post-attention
// and post-feedforward norms. kSandwich: Gemma's (SandwichDecoderLayer), four norms a layer:
// norms[4l ..] the input, post-attention, pre-feedforward and post-feedforward norms.
// norm_plus_one: every norm (q/k norms too) is Gemma's, its weight given as float32 1 + weight
// (offset_norm); only with the sandwich layout. lora, lora_cols: empty, or one LoRA adapter's
// A and B for every linear (none where it leaves that one alone) and the first column its
// delta adds to (add_lora): the adapter of every row of the step.
void decoder_layers(at::Tensor h, at::TensorList norms, at::TensorList qk_norms, int64_t qk_norm_mode,
                    int64_t norm_layout, bool norm_plus_one, double eps, at::IntArrayRef kinds,
                    at::IntArrayRef groups, const c10::List<OptT>& weights, at::TensorList rope, int64_t act_kind,
                    int64_t num_q_heads, int64_t num_kv_heads, at::TensorList k_pages, at::TensorList v_pages,
                    at::TensorList plans, at::TensorList slots, at::IntArrayRef layer_plans, at::IntArrayRef windows,
                    double sm_scale, double softcap, at::TensorList k_scales, at::TensorList v_scales,
                    const c10::List<OptT>& lora, at::IntArrayRef lora_cols) {
  const int64_t layers = static_cast<int64_t>(k_pages.size());
  const bool quantized = !k_scales.empty();
  TORCH_CHECK(static_cast<int64_t>(k_scales.size()) == (quantized ? layers : 0) && v_scales.size() == k_scales.size(),
              "k_scales and v_scales must both be empty or hold every layer's scales");
  TORCH_CHECK(norm_layout >= kPreNorm && norm_layout <= kSandwich, "norm_layout must be 0 (pre), 1 (post) or 2 (sandwich)");
  TORCH_CHECK(!norm_plus_one || norm_layout == kSandwich, "1 + weight norms only in the sandwich layout");
  TORCH_CHECK(act_kind == kSilu || act_kind == kGeluTanh, "act must be 0 (SiLU) or 1 (GELU, tanh)");
  TORCH_CHECK(rope.size() == 2 || rope.size() == 4, "rope must hold cos and sin, then optionally the local ones");
  const int64_t norms_per_layer = norm_layout == kSandwich ? 4 : 2;
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.device().is_cpu(), "h must be a contiguous [T, hidden] CPU tensor");
  TORCH_CHECK(static_cast<int64_t>(v_pages.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == norms_per_layer * layers &&
                  static_cast<int64_t>(kinds.size()) == kLinears * layers &&
                  static_cast<int64_t>(groups.size()) == kLinears * layers &&
                  static_cast<int64_t>(weights.size()) == kSlots * kLinears * layers,
              "per-layer lists must have the layout's 2 or 4 norms, 4 kinds, 4 group sizes and 12 weights per layer");
  const int64_t num_plans = static_cast<int64_t>(slots.size());
  TORCH_CHECK(num_plans >= 1 && static_cast<int64_t>(plans.size()) == 8 * num_plans,
              "plans must hold 8 index tensors for each of the slots' plans");
  TORCH_CHECK(layer_plans.empty() || static_cast<int64_t>(layer_plans.size()) == layers,
              "layer_plans must name every layer's plan, or be empty");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == layers,
              "windows must give every layer's window, or be empty");
  for (const int64_t p : layer_plans) TORCH_CHECK(p >= 0 && p < num_plans, "layer plan ", p, " out of range");
  TORCH_CHECK((lora.empty() && lora_cols.empty()) || (static_cast<int64_t>(lora.size()) == 2 * kLinears * layers &&
                                                      static_cast<int64_t>(lora_cols.size()) == kLinears * layers),
              "lora must hold an A and a B (or none) and lora_cols a first column for every linear, or be empty");
  TORCH_CHECK(qk_norm_mode >= 0 && qk_norm_mode <= 2, "qk_norm_mode must be 0 (none), 1 (heads) or 2 (projection)");
  TORCH_CHECK(static_cast<int64_t>(qk_norms.size()) == (qk_norm_mode == 0 ? 0 : 2 * layers),
              "qk_norms must hold a q and a k norm weight per layer, and only with a qk_norm_mode");
  const Ops& ops = Ops::get();
  const int64_t t = h.size(0);
  // The head size: the pages' rows, but for int4 pages (uint8), which pack two codes a byte.
  const int64_t d = k_pages.empty() ? 0 : k_pages[0].size(3) * (k_pages[0].scalar_type() == at::kByte ? 2 : 1);
  const int64_t n_qk = num_q_heads + num_kv_heads;
  // The linears' inputs, one buffer each for all layers (each layer overwrites its first t
  // rows). Where a dense layer multiplies through oneDNN they have onednn_rows(t) rows, the
  // rest zero: padding by copying each input cost ~4 ms of a 300-token bf16 prefill.
  bool onednn = false;
  for (int64_t i = 0; i < kLinears * layers; ++i) onednn |= kinds[i] == kDense && t > groups[i];
  const int64_t rows = onednn ? onednn_rows(t) : t;
  auto buffer = [&](int64_t cols) {
    at::Tensor buf = at::empty({rows, cols}, h.options());
    if (rows > t) buf.narrow(0, t, rows - t).zero_();
    return buf;
  };
  // The buffers' first t rows (the buffers themselves where they have no more): views made
  // once, not per layer. Each narrow is three dispatched calls; these, the heads() views and
  // the residual add folded into the next norm make a layer ~3 us shorter (a 30-layer model
  // with weights in cache: 0.89-0.91 against 0.96-1.00 ms a bf16 batch-1 step).
  auto first_rows = [&](const at::Tensor& buf) { return rows > t ? buf.narrow(0, 0, t) : buf; };
  const at::Tensor x = buffer(h.size(1));  // each block's input: a norm's output, or h (post-norms)
  const at::Tensor xt = first_rows(x);
  const at::Tensor attn = buffer(num_q_heads * d);
  const at::Tensor attn_t = first_rows(attn);
  const at::Tensor attn_heads = attn_t.view({t, num_q_heads, d});
  at::Tensor act, act_t;  // act(gate) * up, sized by the first gate_up
  at::Tensor down;  // the previous layer's MLP output, not yet added to h (pre-norm layout)
  // A block's input or output normalized into a new tensor (the norm's forward of it, no
  // residual): Gemma's through torch, RMSNorm's through the project's kernel.
  auto normed = [&](const at::Tensor& y, const at::Tensor& weight) {
    if (norm_plus_one) return offset_norm(y, weight, eps);
    at::Tensor out = at::empty_like(y);
    ops.rms_norm.call(y, weight, eps, std::nullopt, out);
    return out;
  };
  for (int64_t l = 0; l < layers; ++l) {
    auto lin = [&](const at::Tensor& in, const at::Tensor& in_t, int64_t j) {
      const int64_t i = kLinears * l + j;
      const int64_t w = kSlots * i;
      at::Tensor y = linear(ops, in, in_t, t, kinds[i], weights.get(w), weights.get(w + 1), weights.get(w + 2), groups[i]);
      if (!lora.empty()) add_lora(ops, in_t, y, lora.get(2 * i), lora.get(2 * i + 1), lora_cols[i]);
      return y;
    };
    // Attention over xt: qkv, the q/k norms, RoPE on q and k together, store + attend, o_proj.
    auto attention = [&] {
      const at::Tensor qkv = lin(x, xt, 0).view({t, n_qk + num_kv_heads, d});
      if (qk_norm_mode == 1) {
        qk_norm_(ops, heads(qkv, 0, num_q_heads), qk_norms[2 * l], eps, norm_plus_one);
        qk_norm_(ops, heads(qkv, num_q_heads, num_kv_heads), qk_norms[2 * l + 1], eps, norm_plus_one);
      } else if (qk_norm_mode == 2) {
        const at::Tensor flat = qkv.view({t, (n_qk + num_kv_heads) * d});
        qk_norm_(ops, flat.narrow(1, 0, num_q_heads * d), qk_norms[2 * l], eps, norm_plus_one);
        qk_norm_(ops, flat.narrow(1, num_q_heads * d, num_kv_heads * d), qk_norms[2 * l + 1], eps, norm_plus_one);
      }
      const int64_t window = windows.empty() ? 0 : windows[l];
      const int64_t r = window > 0 && rope.size() == 4 ? 2 : 0;  // the sliding layers' own RoPE
      ops.rotary.call(heads(qkv, 0, n_qk), rope[r], rope[r + 1]);
      const int64_t p = layer_plans.empty() ? 0 : layer_plans[l];
      const at::TensorList plan = plans.slice(8 * p, 8);
      const at::Tensor q = heads(qkv, 0, num_q_heads), k = heads(qkv, num_q_heads, num_kv_heads);
      const at::Tensor v = heads(qkv, n_qk, num_kv_heads);
      if (quantized) {
        ops.paged_attention_quant.call(q, k_pages[l], v_pages[l], attn_heads, plan[0], plan[1], plan[2], plan[3],
                                       plan[4], plan[5], plan[6], plan[7], sm_scale, k_scales[l], v_scales[l], k, v,
                                       slots[p], window, softcap, OptT{});
      } else {
        ops.paged_attention.call(q, k_pages[l], v_pages[l], attn_heads, plan[0], plan[1], plan[2], plan[3], plan[4],
                                 plan[5], plan[6], plan[7], sm_scale, k, v, slots[p], window, softcap, OptT{});
      }
      return lin(attn, attn_t, 1);
    };
    // The MLP over xt: gate_up, act(gate) * up, down. GELU as GatedMLP runs it (torch's gelu
    // of the gate's view, times up in place), written straight into the down input.
    auto mlp = [&] {
      const at::Tensor gate_up = lin(x, xt, 2);
      const int64_t n = gate_up.size(1) / 2;
      if (!act.defined() || act.size(1) != n) {
        act = buffer(n);
        act_t = first_rows(act);
      }
      if (act_kind == kGeluTanh) {
        at::gelu_out(act_t, gate_up.narrow(1, 0, n), "tanh");
        act_t.mul_(gate_up.narrow(1, n, n));
      } else {
        ops.silu_mul.call(gate_up, act_t);
      }
      return lin(act, act_t, 3);
    };
    if (norm_layout == kSandwich) {  // h += norm(attn(norm(h))); h += norm(mlp(norm(h)))
      xt.copy_(normed(h, norms[4 * l]));
      h.add_(normed(attention(), norms[4 * l + 1]));
      xt.copy_(normed(h, norms[4 * l + 2]));
      h.add_(normed(mlp(), norms[4 * l + 3]));
      continue;
    }
    if (norm_layout == kPostNorm) {  // h += norm(attn(h)); h += norm(mlp(h))
      xt.copy_(h);
      h.add_(normed(attention(), norms[2 * l]));
      xt.copy_(h);
      h.add_(normed(mlp(), norms[2 * l + 1]));
      continue;
    }
    // Pre-norm: the input norm (h += the previous layer's MLP output first, in the same pass:
    // the bits of h.add_ then the norm), attention; h += a and its norm in one pass, the MLP.
    if (down.defined()) {
      ops.rms_norm.call(down, norms[2 * l], eps, h, xt);
    } else {
      ops.rms_norm.call(h, norms[2 * l], eps, std::nullopt, xt);
    }
    const at::Tensor a = attention();
    ops.rms_norm.call(a, norms[2 * l + 1], eps, h, xt);
    down = mlp();
  }
  if (down.defined()) h.add_(down);  // the last layer's MLP output (the final norm is the caller's)
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "decoder_layers(Tensor(a!) h, Tensor[] norms, Tensor[] qk_norms, int qk_norm_mode, int norm_layout, "
      "bool norm_plus_one, float eps, int[] kinds, int[] groups, Tensor?[] weights, Tensor[] rope, int act, "
      "int num_q_heads, int num_kv_heads, Tensor(b!)[] k_pages, Tensor(c!)[] v_pages, "
      "Tensor[] plans, Tensor[] slots, int[] layer_plans, int[] windows, float sm_scale, float softcap, "
      "Tensor(d!)[] k_scales, Tensor(e!)[] v_scales, Tensor?[] lora, int[] lora_cols) -> ()");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &decoder_layers);
  // The oneDNN-packed weights are MkldnnCPU tensors, which decide the dispatch key.
  m.impl("decoder_layers", c10::DispatchKey::MkldnnCPU, &decoder_layers);
  m.def("onednn_rows(int m) -> int", &onednn_rows);
}
