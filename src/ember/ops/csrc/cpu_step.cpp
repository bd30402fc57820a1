// An eager CPU decode step's layers as one C++ call (`ember.engine.cpu_step`): the ops the module path runs for one
// row (Ember's GEMVs, norms and rope + attention kernels through the dispatcher, ATen for the rest), in its order
// and with its operands, so the same values, without ~60 us of Python a layer.
//
// `DecodeLayers(tensors, program, reals)` reads a layer program built in Python (`cpu_step._Program`): ints that
// name kernels, count operands and index `tensors` (-1: None), and the floats (eps, scales) in `reals`.
// `run(x, cos, sin, local_cos, local_sin, positions)`: one row of a static cache -> the final norm's row (1, E);
// `run_paged(x, cos, sin, local_cos, local_sin, slot_mapping, decode_slots, positions)`: a paged cache's decode
// rows, one token each -> (N, E).

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "library.h"

namespace {

#define EMBER_STRINGIFY2(x) #x
#define EMBER_STRINGIFY(x) EMBER_STRINGIFY2(x)

using OptTensor = std::optional<at::Tensor>;

template <typename F>
c10::TypedOperatorHandle<F> handle(const char* name) {
  const std::string full = std::string(EMBER_STRINGIFY(EMBER_CPU_NAMESPACE)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(full.c_str(), "").typed<F>();
}

using Int4F32 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&);
using Int4Dot = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using Int8F32 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&,
                           const OptTensor&, const OptTensor&);
using HighBitsF32 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                               const OptTensor&, const OptTensor&, const OptTensor&);
using Int8Dyn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double, double);
using AddRmsNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                      double);
using RopeAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, double, int64_t);
using RopeWrite = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&);
using PagedAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, double, int64_t);

// The kernels' handles, found once (the ops are registered when the library loads).
struct Ops {
  c10::TypedOperatorHandle<Int4F32> int4_f32 = handle<Int4F32>("int4_gemv_f32");
  c10::TypedOperatorHandle<Int4Dot> int4_dot = handle<Int4Dot>("int4_gemv");
  c10::TypedOperatorHandle<Int8F32> int8_f32 = handle<Int8F32>("int8_gemv_f32");
  c10::TypedOperatorHandle<HighBitsF32> int5_f32 = handle<HighBitsF32>("int5_gemv_f32");
  c10::TypedOperatorHandle<HighBitsF32> int6_f32 = handle<HighBitsF32>("int6_gemv_f32");
  c10::TypedOperatorHandle<Int8Dyn> int8_dyn = handle<Int8Dyn>("int8_gemv");
  c10::TypedOperatorHandle<RmsNorm> rms_norm = handle<RmsNorm>("rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = handle<AddRmsNorm>("add_rms_norm");
  c10::TypedOperatorHandle<RopeAttention> rope_attention = handle<RopeAttention>("rope_decode_attention");
  c10::TypedOperatorHandle<RopeWrite> rope_write = handle<RopeWrite>("rope_write");
  c10::TypedOperatorHandle<PagedAttention> paged_attention = handle<PagedAttention>("paged_decode_attention");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// The program's kernel names (`cpu_step.KERNELS`, in this order).
enum Kernel : int64_t { kLinear, kInt4F32, kInt4Dot, kInt8F32, kInt5F32, kInt6F32, kInt8Dyn };
enum Act : int64_t { kSilu, kGeluTanh, kGelu };
enum Placement : int64_t { kPre, kSandwich, kPost };
enum QkNorm : int64_t { kNoQkNorm, kHead, kFull };

class Reader {
 public:
  Reader(const std::vector<at::Tensor>& t, const std::vector<int64_t>& p, const std::vector<double>& r)
      : t_(t), p_(p), r_(r) {}
  int64_t next() {
    TORCH_CHECK(i_ < p_.size(), "decode program ends early at ", i_);
    return p_[i_++];
  }
  double real() {
    TORCH_CHECK(j_ < r_.size(), "decode program's reals end early at ", j_);
    return r_[j_++];
  }
  OptTensor maybe() {
    const int64_t k = next();
    if (k < 0) return std::nullopt;
    TORCH_CHECK(k < static_cast<int64_t>(t_.size()), "decode program names tensor ", k, " of ", t_.size());
    return t_[k];
  }
  at::Tensor tensor() {
    OptTensor t = maybe();
    TORCH_CHECK(t.has_value(), "decode program gives None where a tensor is needed");
    return *t;
  }
  bool done() const { return i_ == p_.size() && j_ == r_.size(); }

 private:
  const std::vector<at::Tensor>& t_;
  const std::vector<int64_t>& p_;
  const std::vector<double>& r_;
  size_t i_ = 0, j_ = 0;
};

// One kernel call x -> op(x, operands...): operands are tensors (or None) and ints, in the op's order.
struct Call {
  int64_t kernel = kLinear;
  std::vector<std::variant<OptTensor, int64_t>> operands;

  explicit Call(Reader& r) : kernel(r.next()) {
    TORCH_CHECK(kernel >= kLinear && kernel <= kInt8Dyn, "unknown kernel ", kernel, " in a decode program");
    const int64_t n = r.next();
    for (int64_t a = 0; a < n; ++a) {
      if (r.next() == 0) {
        operands.emplace_back(r.maybe());
      } else {
        operands.emplace_back(r.next());
      }
    }
  }
  const at::Tensor& t(size_t a) const {
    const auto& o = std::get<OptTensor>(operands.at(a));
    TORCH_CHECK(o.has_value(), "kernel ", kernel, " operand ", a, " is None");
    return *o;
  }
  const OptTensor& opt(size_t a) const { return std::get<OptTensor>(operands.at(a)); }
  int64_t i(size_t a) const { return std::get<int64_t>(operands.at(a)); }

  at::Tensor operator()(const at::Tensor& x) const {
    const Ops& o = ops();
    switch (kernel) {
      case kLinear:
        return at::linear(x, t(0), opt(1));
      case kInt4F32:
        return o.int4_f32.call(x, t(0), t(1), i(2), opt(3));
      case kInt4Dot:
        return o.int4_dot.call(x, t(0), t(1), i(2));
      case kInt8F32:
        return o.int8_f32.call(x, t(0), t(1), i(2), opt(3), opt(4), opt(5));
      case kInt5F32:
        return o.int5_f32.call(x, t(0), t(1), t(2), i(3), opt(4), opt(5), opt(6));
      case kInt6F32:
        return o.int6_f32.call(x, t(0), t(1), t(2), i(3), opt(4), opt(5), opt(6));
      default:
        return o.int8_dyn.call(x, t(0), t(1));
    }
  }
};

// A projection: its parts' outputs side by side (a joined projection), then its bias added.
struct Projection {
  std::vector<Call> parts;
  OptTensor bias;

  explicit Projection(Reader& r) {
    const int64_t n = r.next();
    for (int64_t p = 0; p < n; ++p) parts.emplace_back(r);
    bias = r.maybe();
  }
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    if (parts.size() == 1) {
      y = parts[0](x);
    } else {
      std::vector<at::Tensor> ys;
      for (const Call& c : parts) ys.push_back(c(x));
      y = at::cat(ys, -1);
    }
    return bias ? y + *bias : y;
  }
};

struct Norm {
  at::Tensor weight;
  double eps = 0, offset = 0;

  Norm() = default;
  explicit Norm(Reader& r) : weight(r.tensor()), eps(r.real()), offset(r.real()) {}
  at::Tensor operator()(const at::Tensor& x) const { return ops().rms_norm.call(x, weight, eps, offset); }
  std::tuple<at::Tensor, at::Tensor> add(const at::Tensor& x, const at::Tensor& delta) const {
    return ops().add_rms_norm.call(x, delta, weight, eps, offset);
  }
};

// What a step's layers share: the rope tables of its rows (local ones for sliding-window layers where the model
// has them) and where its keys and values go: a static cache's positions, or a paged cache's slots.
struct Step {
  at::Tensor cos, sin, local_cos, local_sin;
  at::Tensor positions;  // (N,): each row's position
  bool paged = false;
  at::Tensor slot_mapping, decode_slots;  // paged: (N,) slots this step writes, (N, S) the slots each row reads
};

struct Layer {
  int64_t H, K, D, qk_norm, window, act;
  bool local;
  double scale, m;
  Norm q_norm, k_norm, input, post, pre_ff, post_ff;
  at::Tensor k_cache, v_cache;
  std::optional<Projection> qkv, o, gate_up, down;

  Layer(Reader& r, int64_t placement) {
    H = r.next(), K = r.next(), D = r.next(), qk_norm = r.next(), window = r.next(), act = r.next();
    local = r.next() != 0;
    scale = r.real(), m = r.real();
    if (qk_norm != kNoQkNorm) q_norm = Norm(r), k_norm = Norm(r);
    if (placement != kPost) input = Norm(r);
    post = Norm(r);
    if (placement == kSandwich) pre_ff = Norm(r);
    if (placement != kPre) post_ff = Norm(r);
    k_cache = r.tensor(), v_cache = r.tensor();
    qkv.emplace(r), o.emplace(r), gate_up.emplace(r), down.emplace(r);
  }

  // Attention of the normed rows n (N, E), this step's k and v cached, through the output projection.
  at::Tensor attend(const at::Tensor& n, const Step& step) const {
    const int64_t N = n.size(0);
    const at::Tensor& cos = local ? step.local_cos : step.cos;
    const at::Tensor& sin = local ? step.local_sin : step.sin;
    auto parts = (*qkv)(n).split_with_sizes({H * D, K * D, K * D}, -1);
    at::Tensor q = parts[0], k = parts[1], v = parts[2];
    if (qk_norm == kFull) q = q_norm(q), k = k_norm(k);
    q = q.view({N, H, D}), k = k.view({N, K, D}), v = v.view({N, K, D});
    if (qk_norm == kHead) q = q_norm(q), k = k_norm(k);
    at::Tensor out;  // (N, H, D)
    if (step.paged) {
      const at::Tensor roped = ops().rope_write.call(q, k, v, cos, sin, k_cache, v_cache, step.slot_mapping);
      out = ops().paged_attention.call(roped, k_cache, v_cache, step.decode_slots, step.positions, scale, window);
    } else {
      out = ops().rope_attention.call(q, k, v, cos, sin, k_cache, v_cache, step.positions, scale, window);
    }
    return (*o)(out.view({N, H * D}));
  }

  at::Tensor mlp(const at::Tensor& n) const {
    auto halves = (*gate_up)(n).chunk(2, -1);
    at::Tensor a = act == kSilu ? at::silu(halves[0]) : at::gelu(halves[0], act == kGeluTanh ? "tanh" : "none");
    return (*down)(a * halves[1]);
  }
};

class DecodeLayers : public torch::CustomClassHolder {
 public:
  DecodeLayers(std::vector<at::Tensor> tensors, std::vector<int64_t> program, std::vector<double> reals) {
    Reader r(tensors, program, reals);
    placement_ = r.next();
    TORCH_CHECK(placement_ >= kPre && placement_ <= kPost, "unknown norm placement ", placement_);
    const int64_t n = r.next();
    final_ = Norm(r);
    for (int64_t l = 0; l < n; ++l) layers_.emplace_back(r, placement_);
    TORCH_CHECK(r.done(), "decode program has more than its layers");
  }

  // One row of a static cache (B = 1): x (1, E) at positions (1,).
  at::Tensor run(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor local_cos, at::Tensor local_sin,
                 at::Tensor positions) const {
    return layers(x, Step{cos, sin, local_cos, local_sin, positions});
  }

  // A paged cache's decode rows, one token each: x (N, E), written at slot_mapping (N,), each row attending
  // over decode_slots (N, S) up to its position (N,).
  at::Tensor run_paged(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor local_cos, at::Tensor local_sin,
                       at::Tensor slot_mapping, at::Tensor decode_slots, at::Tensor positions) const {
    return layers(x, Step{cos, sin, local_cos, local_sin, positions, true, slot_mapping, decode_slots});
  }

 private:
  at::Tensor layers(const at::Tensor& x, const Step& step) const {
    at::Tensor h = x, delta;
    for (const Layer& L : layers_) {
      if (placement_ == kPre) {  // each add done by the norm after it (`DecoderLayer.forward_pre`)
        at::Tensor n;
        if (delta.defined()) {
          std::tie(h, n) = L.input.add(h, delta);
        } else {
          n = L.input(h);
        }
        at::Tensor a = L.attend(n, step);
        std::tie(h, n) = L.post.add(h, L.m != 1.0 ? a * L.m : a);
        at::Tensor f = L.mlp(n);
        delta = L.m != 1.0 ? f * L.m : f;
      } else if (placement_ == kSandwich) {
        h = h + L.post(L.attend(L.input(h), step));
        h = h + L.post_ff(L.mlp(L.pre_ff(h)));
      } else {
        h = h + L.post(L.attend(h, step));
        h = h + L.post_ff(L.mlp(h));
      }
    }
    if (placement_ == kPre && delta.defined()) return std::get<1>(final_.add(h, delta));
    return final_(h);
  }

  int64_t placement_ = kPre;
  Norm final_;
  std::vector<Layer> layers_;
};

}  // namespace

EMBER_LIBRARY_FRAGMENT(EMBER_CPU_NAMESPACE, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("run", &DecodeLayers::run)
      .def("run_paged", &DecodeLayers::run_paged);
}
