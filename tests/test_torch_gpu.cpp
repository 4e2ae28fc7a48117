// The LibTorch engine on CUDA parameters ([gpu]): the cuda_backend cores against the
// host cores on the same gradients (bit for bit), a model trained on both devices,
// stream ordering when torch works on another stream, fp16's scaling rule, NCCL (mpzero's
// communicator and c10d's ProcessGroupNCCL) at world size 1 (one GPU: NCCL refuses two
// ranks on one device). The [torch] cases run anywhere: what a build without a GPU can
// say about the CUDA path (the compiled table, the errors).
#include <ATen/autocast_mode.h>
#include <ATen/cuda/Sleep.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/torch.h>
// LibTorch's logging defines CHECK (glog style); the tests mean Catch's.
#undef CHECK
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <mpzero/comm/nccl.cuh>
#include <mpzero/torch/engine.hpp>
#include <mpzero/torch/process_group.hpp>
#include <mpzero/torch/zero_core.hpp>

#include "support/unused_communicator.hpp"

#include "../examples/gpt/precision_config.hpp"

namespace mt = mpzero::torch;
using json = nlohmann::json;
using torch::Tensor;

namespace {

// "w<k>", appended piecewise ("w" + std::to_string(k) trips GCC 12's false -Wrestrict).
std::string w_name(std::size_t k) {
  std::string s = "w";
  s += std::to_string(k);
  return s;
}

void require_gpu() {
  if (!torch::cuda::is_available()) FAIL("no CUDA device visible to LibTorch: [gpu] tests need one (ctest -L gpu)");
  REQUIRE(mt::cuda_cores_compiled());
}

// DeepSpeed config of a precision configuration (the names of examples/gpt).
json config(const std::string& prec, int stage, bool offload, json extra = json::object()) {
  json zero = {{"stage", stage}, {"reduce_bucket_size", 3000}};
  if (offload) {
    zero["offload_optimizer"] = {{"device", "cpu"}, {"pin_memory", true}};
    zero["sub_group_size"] = 5000;  // several sub-groups: uploads overlap the host step
  }
  json j = {{"train_micro_batch_size_per_gpu", 4},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.01}}}}},
            {"zero_optimization", zero},
            {"seed", 1234}};
  mpzero_gpt::set_precision(j, prec, {{"enabled", true}, {"initial_scale_power", 8}});
  j.merge_patch(extra);
  return j;
}

// Parameters of awkward sizes whose gradients torch computes exactly on any device:
// loss = sum_k (w_k * c_k).sum() has d loss / d w_k = c_k (times the loss scale, a
// power of two), with no reduction whose order could differ between devices.
struct LinearFormImpl : torch::nn::Module {
  std::vector<Tensor> ws;
  explicit LinearFormImpl(const std::vector<std::int64_t>& sizes = {1, 7, 300, 4099, 65537}) {
    torch::manual_seed(7);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      ws.push_back(register_parameter(w_name(k), torch::randn({sizes[k]}) * 0.5));
    }
  }
  Tensor forward(const std::vector<Tensor>& cs) {
    Tensor loss = torch::zeros({}, ws[0].options().dtype(torch::kFloat));
    for (std::size_t k = 0; k < ws.size(); ++k) loss = loss + (ws[k] * cs[k]).sum().to(torch::kFloat);
    return loss;
  }
};
TORCH_MODULE(LinearForm);

std::vector<Tensor> coefficients(const LinearForm& m, int step, torch::Device device) {
  auto gen = at::detail::createCPUGenerator(1000 + static_cast<std::uint64_t>(step));
  std::vector<Tensor> cs;
  for (const auto& w : m->ws) {
    cs.push_back((torch::randn(w.sizes(), gen) * 0.25).to(device, w.scalar_type()));
  }
  return cs;
}

// Bitwise equality of two tensors (moved to the CPU).
void check_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  INFO(what);
  REQUIRE(a.sizes() == b.sizes());
  REQUIRE(a.scalar_type() == b.scalar_type());
  const Tensor x = a.detach().cpu().contiguous(), y = b.detach().cpu().contiguous();
  const auto n = static_cast<std::size_t>(x.numel() * x.element_size());
  const bool same = std::memcmp(x.data_ptr(), y.data_ptr(), n) == 0;
  if (!same) {
    const Tensor d = (x.to(torch::kDouble) - y.to(torch::kDouble)).abs();
    INFO("max |difference| " << d.max().item<double>() << " at " << d.argmax().item<std::int64_t>());
    CHECK(same);
  }
}

using run = std::tuple<std::string, int, bool, json>;  // precision, stage, offload, config patch

// The configurations the CPU/CUDA bit-identity test runs. The CUDA table has every row
// of the host table; these cover each policy, each stage, offload, fp32 gradient
// accumulation of a bf16 model and Adam with L2 decay (adam_w_mode false).
std::vector<run> bit_identity_runs() {
  const json none = json::object();
  const json l2 = {{"optimizer", {{"type", "Adam"}, {"params", {{"adam_w_mode", false}}}}}};
  const json fp32_grads = {{"data_types", {{"grad_accum_dtype", "fp32"}}}};
  return {{"fp32", 0, false, none},        {"fp32", 1, false, none},         {"fp32", 2, false, none},
          {"fp32", 2, true, none},         {"fp32", 2, false, l2},           {"bf16", 0, false, none},
          {"bf16", 2, false, none},        {"bf16", 1, true, none},          {"bf16", 2, true, l2},
          {"bf16", 2, false, fp32_grads},  {"bf16-master", 2, false, none},  {"bf16-all", 1, false, none},
          {"bf16-all", 2, true, none},     {"bf16-all-sr", 2, false, none},  {"bf16-all-sr", 2, true, none},
          {"bf16-all-sr", 1, false, l2},   {"fp16", 0, false, none},         {"fp16", 2, false, none},
          {"fp16-master", 1, false, none}, {"fp16-master", 2, true, none},   {"fp16-master", 2, false, l2}};
}

// A c10d ProcessGroup with a NCCL backend at world size 1 (as init_process_group("nccl")
// builds it: the NCCL Backend registered for CUDA tensors and made the default).
c10::intrusive_ptr<c10d::ProcessGroup> nccl_group() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, 0, 1);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, 0, 1);
  pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  return pg;
}

}  // namespace

TEST_CASE("gpu: the engine on CUDA parameters updates them bit for bit as on the CPU", "[gpu][torch]") {
  require_gpu();
  const auto [prec, stage, offload, extra] = GENERATE(from_range(bit_identity_runs()));
  INFO(prec << ", stage " << stage << (offload ? ", offload" : "") << " " << extra.dump());
  const json cfg = config(prec, stage, offload, extra);
  LinearForm host_model, dev_model;
  dev_model->to(torch::kCUDA);
  auto host = mt::initialize(host_model, cfg);
  auto dev = mt::initialize(dev_model, cfg);
  REQUIRE(dev.describe().find("CUDA") != std::string::npos);
  for (const auto& p : dev.parameters()) REQUIRE(p.device().is_cuda());

  for (int step = 0; step < 4; ++step) {
    host.backward(host(coefficients(host_model, step, torch::kCPU)));
    dev.backward(dev(coefficients(dev_model, step, torch::kCUDA)));
    host.step();
    dev.step();
    INFO("step " << step);
    CHECK(dev.last_step_report().skipped == host.last_step_report().skipped);
    CHECK(dev.loss_scale() == host.loss_scale());
    CHECK(dev.global_grad_norm() == Approx(host.global_grad_norm()).epsilon(1e-6));
  }
  const auto hm = host.master_weights(), dm = dev.master_weights();
  for (std::size_t k = 0; k < hm.size(); ++k) {
    CHECK(dm[k].device().is_cuda());
    check_bits(dm[k], hm[k], "master weights of w" + std::to_string(k));
    check_bits(dev.parameters()[k], host.parameters()[k], "parameter w" + std::to_string(k));
  }
  // Accounting: the same model states, on the device (the host part with offload).
  CHECK(dev.memory().model_state_bytes() == host.memory().model_state_bytes());
  CHECK(dev.memory().host_model_state_bytes() == host.memory().host_model_state_bytes());
}

namespace {

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  MlpImpl() {
    torch::manual_seed(11);
    a = register_module("a", torch::nn::Linear(32, 64));
    b = register_module("b", torch::nn::Linear(64, 4));
  }
  Tensor forward(const Tensor& x, const Tensor& y) {
    return torch::mse_loss(b(torch::tanh(a(x))).to(torch::kFloat), y);
  }
};
TORCH_MODULE(Mlp);

// Mlp with each layer a ZeRO-3 unit (mpzero::torch::gathered_forward).
struct UnitMlpImpl : MlpImpl {
  Tensor forward(const Tensor& x, const Tensor& y) {
    Tensor h = torch::tanh(mt::gathered_forward(a, x));
    return torch::mse_loss(mt::gathered_forward(b, h).to(torch::kFloat), y);
  }
};
TORCH_MODULE(UnitMlp);

std::pair<Tensor, Tensor> batch(int step, torch::Device device, torch::ScalarType dt) {
  auto gen = at::detail::createCPUGenerator(500 + static_cast<std::uint64_t>(step));
  Tensor x = torch::randn({16, 32}, gen), y = torch::randn({16, 4}, gen);
  return {x.to(device, dt), y.to(device)};
}

}  // namespace

TEST_CASE("gpu: a model trained through the engine on CUDA follows the CPU engine", "[gpu][torch]") {
  require_gpu();
  // Different matmul kernels: close, not equal. TF32 would loosen fp32 to ~1e-3.
  at::globalContext().setAllowTF32CuBLAS(false);
  const auto [prec, stage] = GENERATE(values<std::tuple<std::string, int>>({{"fp32", 0}, {"fp32", 2}, {"bf16", 2}}));
  INFO(prec << ", stage " << stage);
  const auto dt = prec == "fp32" ? torch::kFloat : torch::kBFloat16;
  const json cfg = config(prec, stage, false, {{"gradient_clipping", 1.0}});
  Mlp host_model, dev_model;
  dev_model->to(torch::kCUDA);
  auto host = mt::initialize(host_model, cfg);
  auto dev = mt::initialize(dev_model, cfg);
  double last_host = 0, last_dev = 0;
  for (int step = 0; step < 10; ++step) {
    auto [hx, hy] = batch(step, torch::kCPU, dt);
    auto [dx, dy] = batch(step, torch::kCUDA, dt);
    Tensor hl = host(hx, hy), dl = dev(dx, dy);
    hl.backward();  // plain autograd: the hooks run ZeRO on the device
    dl.backward();
    host.step();
    dev.step();
    last_host = hl.item<double>();
    last_dev = dl.item<double>();
  }
  CHECK(dev.global_steps() == 10);
  CHECK(dev.epilogues() == 10);
  // bf16 parameters: one bf16 ulp (2^-8 relative) per step at worst, a few steps deep.
  const double tol = prec == "fp32" ? 1e-4 : 3e-2;
  CHECK(last_dev == Approx(last_host).epsilon(tol));
  for (std::size_t k = 0; k < host.parameters().size(); ++k) {
    INFO(host.parameter_names()[k]);
    const Tensor h = host.parameters()[k].to(torch::kFloat), d = dev.parameters()[k].cpu().to(torch::kFloat);
    CHECK(torch::allclose(d, h, tol, tol));
  }
}

TEST_CASE("gpu: ZeRO-3 on CUDA parameters trains bit for bit as stage 2", "[gpu][torch]") {
  require_gpu();
  const auto [prec, offload] = GENERATE(values<std::tuple<std::string, bool>>({{"fp32", false}, {"bf16", false},
                                                                              {"bf16-all", true}}));
  INFO(prec << (offload ? ", offload" : ""));
  const auto dt = prec == "fp32" ? torch::kFloat : torch::kBFloat16;
  const json patch = {{"zero_optimization", {{"stage3_param_persistence_threshold", 0}}}};
  UnitMlp m2, m3;
  m2->to(torch::kCUDA);
  m3->to(torch::kCUDA);
  auto z2 = mt::initialize(m2, config(prec, 2, offload, patch));
  auto z3 = mt::initialize(m3, config(prec, 3, offload, patch));
  for (const auto& p : z3.parameters()) CHECK(p.numel() == 0);  // partitioned between steps
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = batch(step, torch::kCUDA, dt);
    Tensor l2 = z2(x, y), l3 = z3(x, y);
    l2.backward();
    l3.backward();
    z2.step();
    z3.step();
    INFO("step " << step);
    REQUIRE(l2.item<float>() == l3.item<float>());
    CHECK(z3.gathered_numel() == 0);
  }
  const auto w2 = z2.master_weights(), w3 = z3.master_weights();
  for (std::size_t k = 0; k < w2.size(); ++k) check_bits(w3[k], w2[k], "master weight " + z2.parameter_names()[k]);
}

TEST_CASE("gpu: backward and step on another stream are ordered with the engine's", "[gpu][torch][hooks]") {
  require_gpu();
  const int stage = GENERATE(0, 2);
  const json cfg = config("fp32", stage, false);
  LinearForm a, b;
  a->to(torch::kCUDA);
  b->to(torch::kCUDA);
  auto ea = mt::initialize(a, cfg);  // made on the default stream: its core runs there
  auto eb = mt::initialize(b, cfg);
  const c10::Device dev(c10::kCUDA, c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
  const c10::Stream side = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStreamFromGlobalPool(dev);
  for (int step = 0; step < 3; ++step) {
    {
      // The side stream stalls (about 0.1 s) after the inputs exist and before the
      // forward, so every gradient kernel lands behind the stall: a core that read the
      // gradients without waiting for the side stream would read them unwritten.
      c10::StreamGuard guard(side);
      const auto cs = coefficients(a, step, torch::kCUDA);
      at::cuda::sleep(200'000'000);
      ea.backward(ea(cs));
      ea.step();
    }
    eb.backward(eb(coefficients(b, step, torch::kCUDA)));
    eb.step();
  }
  for (std::size_t k = 0; k < ea.parameters().size(); ++k) {
    check_bits(ea.parameters()[k], eb.parameters()[k], w_name(k) + ", stage " + std::to_string(stage));
  }
}

TEST_CASE("gpu: a forward on another stream right after step() sees the uploaded parameters", "[gpu][torch][hooks]") {
  require_gpu();
  // One parameter of 2^26 elements (256 MB), CPU offload in one sub-group: step() returns
  // while the updated parameters' upload (pinned, about 10 ms) still runs on the engine's
  // copy stream. A clone queued on the side stream at once reads them half-written unless
  // step() ordered the side stream after that upload.
  const std::int64_t n = std::int64_t{1} << 26;
  json cfg = config("fp32", 1, true);
  cfg["zero_optimization"]["sub_group_size"] = n;
  cfg["zero_optimization"]["reduce_bucket_size"] = n;
  LinearForm m(std::vector<std::int64_t>{n});
  m->to(torch::kCUDA);
  auto e = mt::initialize(m, cfg);
  const c10::Device dev(c10::kCUDA, c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
  const c10::Stream side = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStreamFromGlobalPool(dev);
  for (int step = 0; step < 2; ++step) {
    const auto cs = coefficients(m, step, torch::kCUDA);
    torch::cuda::synchronize();
    Tensor snap;
    {
      c10::StreamGuard guard(side);
      e.backward(e(cs));
      e.step();
      snap = e.parameters()[0].clone();
    }
    torch::cuda::synchronize();
    check_bits(snap, e.parameters()[0], "the side stream's copy after step " + std::to_string(step + 1));
  }
}

TEST_CASE("gpu: a gradient's memory stays the engine's until it has read it (backward on another stream)",
          "[gpu][torch][hooks]") {
  require_gpu();
  // Eight parameters of 2^20 elements: torch drops each gradient once the engine has taken
  // it, and the caching allocator would give that block to the next gradient of the same
  // size on the side stream at once. The engine's stream (the default one) is kept busy
  // (about 0.2 s), so its reads of the gradients queue behind that: without record_stream
  // w_k would read c_{k+1}'s values.
  const int stage = GENERATE(0, 2);
  LinearForm m(std::vector<std::int64_t>(8, std::int64_t{1} << 20));
  m->to(torch::kCUDA);
  auto e = mt::initialize(m, config("fp32", stage, false));
  const auto cs = coefficients(m, 0, torch::kCUDA);
  torch::cuda::synchronize();
  const c10::Device dev(c10::kCUDA, c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
  const c10::Stream side = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStreamFromGlobalPool(dev);
  {
    c10::StreamGuard busy(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDefaultStream(dev));
    at::cuda::sleep(400'000'000);
  }
  {
    c10::StreamGuard guard(side);
    e.backward(e(cs));
  }
  for (std::size_t k = 0; k < cs.size(); ++k) {
    check_bits(e.full_grad(m->ws[k]), cs[k], w_name(k) + ", stage " + std::to_string(stage));
  }
}

namespace {
struct TinyImpl : torch::nn::Module {
  torch::nn::Linear l{nullptr};
  TinyImpl() { l = register_module("l", torch::nn::Linear(32, 4)); }
  Tensor forward(const Tensor& x) { return l(x); }
};
TORCH_MODULE(Tiny);
}  // namespace

TEST_CASE("gpu: torch_autocast runs the forward under CUDA autocast, not the CPU's", "[gpu][torch]") {
  require_gpu();
  Tiny m;
  m->to(torch::kCUDA);
  auto e = mt::initialize(m, config("fp32-ac", 2, false));
  const Tensor x = torch::randn({8, 32}, torch::kCUDA);
  const Tensor y = e(x);
  CHECK(y.scalar_type() == torch::kBFloat16);  // fp32 here would mean autocast was set for the CPU
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCUDA));  // restored after the forward
  CHECK(m->forward(x).scalar_type() == torch::kFloat);        // outside the engine: no autocast
  // Linear is on the default lower_precision_safe_modules list: its gradients travel in bf16.
  CHECK(e.comm_dtype(m->l->weight) == mpzero::dtype::bf16);
  e.backward(y.to(torch::kFloat).pow(2).sum());
  e.step();
  CHECK(e.global_steps() == 1);
  CHECK(torch::isfinite(m->l->weight).all().item<bool>());
}

TEST_CASE("gpu: fp16 on CUDA without loss scaling is an error, not garbage", "[gpu][torch]") {
  require_gpu();
  LinearForm m;
  m->to(torch::kCUDA);
  auto e = mt::initialize(m, config("fp16", 2, false));
  Tensor loss = e(coefficients(m, 0, torch::kCUDA));
  REQUIRE_THROWS_WITH(loss.backward(), Catch::Contains("Loss scaling is required"));
  // The engine goes on: a scaled backward works afterwards.
  e.zero_grad();
  e.backward(e(coefficients(m, 0, torch::kCUDA)));
  e.step();
  CHECK(e.global_steps() == 1);
}

TEST_CASE("gpu: NCCL as the engine's communicator (mpzero's and c10d's), world size 1", "[gpu][torch]") {
  require_gpu();
  const int stage = GENERATE(1, 2);
  const json cfg = config("bf16", stage, false);
  LinearForm ref_model, nccl_model, pg_model;
  for (auto* m : {&ref_model, &nccl_model, &pg_model}) (*m)->to(torch::kCUDA);
  auto ref = mt::initialize(ref_model, cfg);  // local communicator

  mpzero::comm::nccl_communicator nccl;  // standalone, world size 1
  auto en = mt::initialize(nccl_model, cfg, nccl);

  auto ep = mt::initialize(pg_model, cfg, mt::process_group_communicator(nccl_group()));
  CHECK(ep.describe().find("CUDA") != std::string::npos);

  for (int step = 0; step < 3; ++step) {
    for (auto* e : {&ref, &en, &ep}) {
      auto& m = e == &ref ? ref_model : e == &en ? nccl_model : pg_model;
      e->backward((*e)(coefficients(m, step, torch::kCUDA)));
      e->step();
    }
  }
  for (std::size_t k = 0; k < ref.parameters().size(); ++k) {
    check_bits(en.parameters()[k], ref.parameters()[k], "mpzero NCCL, w" + std::to_string(k));
    check_bits(ep.parameters()[k], ref.parameters()[k], "ProcessGroupNCCL, w" + std::to_string(k));
  }
}

TEST_CASE("gpu: the ProcessGroup communicator moves device buffers", "[gpu][torch]") {
  require_gpu();
  auto comm = mt::process_group_communicator(nccl_group());
  CHECK(comm.name().find("cuda") != std::string::npos);
  auto opts = torch::TensorOptions().device(torch::kCUDA);
  const Tensor src = torch::arange(1, 11, opts.dtype(torch::kFloat));
  // all_reduce out of place, bf16 (through fp32), reduce_scatter_v, all_gather_v, broadcast.
  Tensor out = torch::zeros_like(src);
  comm.all_reduce(src.data_ptr<float>(), out.data_ptr<float>(), 10, mpzero::comm::reduce_op::sum);
  CHECK(torch::equal(out, src));
  const Tensor hb = src.to(torch::kBFloat16);
  Tensor ob = torch::zeros_like(hb);
  comm.all_reduce(static_cast<const mpzero::bf16*>(hb.data_ptr()), static_cast<mpzero::bf16*>(ob.data_ptr()), 10,
                  mpzero::comm::reduce_op::max);
  CHECK(torch::equal(ob, hb));
  const std::uint64_t counts[] = {10};
  Tensor rs = torch::zeros_like(src);
  comm.reduce_scatter_v(src.data_ptr<float>(), rs.data_ptr<float>(), counts, mpzero::comm::reduce_op::sum);
  CHECK(torch::equal(rs, src));
  Tensor ag = torch::zeros_like(src);
  comm.all_gather_v(src.data_ptr<float>(), 10, ag.data_ptr<float>(), counts);
  CHECK(torch::equal(ag, src));
  Tensor bc = src.clone();
  comm.broadcast(bc.data_ptr<float>(), 10, 0);
  CHECK(torch::equal(bc, src));
}

// ---- what a build says about its CUDA path, with or without a GPU ------------------------

TEST_CASE("torch: the compiled cores list CUDA ones exactly when they are built", "[torch]") {
  const auto cores = mt::compiled_cores();
  const auto n_cuda = std::count_if(cores.begin(), cores.end(), [](const mt::core_spec& s) {
    return s.device == mt::core_device::cuda;
  });
  CHECK((n_cuda > 0) == mt::cuda_cores_compiled());
  if (!mt::cuda_cores_compiled()) return;
  // CPU and CUDA parameters get the same choices: every host row has its CUDA twin.
  std::size_t n_cpu = 0;
  for (const auto& s : cores) {
    if (s.device != mt::core_device::cpu) continue;
    ++n_cpu;
    auto twin = s;
    twin.device = mt::core_device::cuda;
    INFO(s.describe());
    CHECK(std::find(cores.begin(), cores.end(), twin) != cores.end());
  }
  CHECK(static_cast<std::size_t>(n_cuda) == n_cpu);
  // Among them, the precision configurations examples/gpt compares (fp16 master weights
  // included), with every optimizer, stages 0-2, offload at 1-2.
  auto has = [&](mpzero::dtype p, mpzero::dtype m, mpzero::dtype g, mpzero::dtype st, bool sr, int stage, bool off,
                 mt::optimizer_type opt) {
    mt::core_spec s{p, m, g, st, sr, opt, stage, off, mt::core_device::cuda};
    return std::find(cores.begin(), cores.end(), s) != cores.end();
  };
  using mpzero::dtype;
  for (auto opt : {mt::optimizer_type::adam, mt::optimizer_type::adamw, mt::optimizer_type::sgd, mt::optimizer_type::lion})
    for (int stage : {0, 1, 2}) {
      INFO("stage " << stage << ", " << mt::optimizer_name(opt));
      CHECK(has(dtype::fp32, dtype::fp32, dtype::fp32, dtype::fp32, false, stage, false, opt));
      CHECK(has(dtype::bf16, dtype::fp32, dtype::bf16, dtype::fp32, false, stage, false, opt));
      CHECK(has(dtype::bf16, dtype::fp32, dtype::fp32, dtype::fp32, false, stage, false, opt));
      CHECK(has(dtype::bf16, dtype::bf16, dtype::bf16, dtype::fp32, false, stage, false, opt));
      CHECK(has(dtype::bf16, dtype::bf16, dtype::bf16, dtype::bf16, false, stage, false, opt));
      CHECK(has(dtype::bf16, dtype::bf16, dtype::bf16, dtype::bf16, true, stage, false, opt));
      CHECK(has(dtype::fp16, dtype::fp32, dtype::fp16, dtype::fp32, false, stage, false, opt));
      CHECK(has(dtype::fp16, dtype::fp16, dtype::fp16, dtype::fp32, false, stage, stage > 0, opt));
      CHECK(has(dtype::bf16, dtype::bf16, dtype::bf16, dtype::bf16, true, stage, stage > 0, opt));
    }
}

TEST_CASE("torch: every configuration of the CUDA bit-identity test is valid and compiled", "[torch]") {
  // Checked on the CPU, so that a GPU session does not spend its time on a config error:
  // each row makes a CPU engine of the intended kind, and its CUDA twin is compiled.
  const auto cores = mt::compiled_cores();
  for (const auto& [prec, stage, offload, extra] : bit_identity_runs()) {
    INFO(prec << ", stage " << stage << (offload ? ", offload" : "") << " " << extra.dump());
    LinearForm m;
    auto e = mt::initialize(m, config(prec, stage, offload, extra));
    const std::string d = e.describe();
    CHECK_THAT(d, Catch::Contains("ZeRO stage " + std::to_string(stage)));
    CHECK(offload == (d.find("CPU offload") != std::string::npos));
    CHECK(extra.contains("optimizer") == (d.find("AdamW") == std::string::npos));
    if (extra.contains("data_types")) CHECK_THAT(d, Catch::Contains("grad fp32"));
    if (mt::cuda_cores_compiled()) {
      auto spec = std::find_if(cores.begin(), cores.end(), [&](const mt::core_spec& s) {
        return s.device == mt::core_device::cpu && s.describe() == d;
      });
      REQUIRE(spec != cores.end());
      auto twin = *spec;
      twin.device = mt::core_device::cuda;
      CHECK(std::find(cores.begin(), cores.end(), twin) != cores.end());
    }
  }
}

TEST_CASE("torch: a CUDA configuration the engine cannot run names itself", "[torch]") {
  // A precision no named policy has is refused before any CUDA call (no GPU needed).
  mt::core_spec s;
  s.param = s.master = s.grad = mpzero::dtype::bf16;
  s.state = mpzero::dtype::fp32;
  s.stochastic_rounding = true;
  s.optimizer = mt::optimizer_type::lion;
  s.device = mt::core_device::cuda;
  const std::uint64_t numels[] = {4};
  try {
    (void)mt::make_zero_core(s, {}, numels, {}, {});
    FAIL("make_zero_core accepted a precision no named policy has");
  } catch (const mt::config_error& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("Lion, ZeRO stage 0, CUDA") && Catch::Contains("none of the named policies"));
  }
  // A named one on a build without the CUDA cores: the build is named.
  if (!mt::cuda_cores_compiled()) {
    mt::core_spec ok;
    ok.device = mt::core_device::cuda;
    CHECK_THROWS_WITH(mt::make_zero_core(ok, {}, numels, {}, {}),
                      Catch::Contains("no CUDA cores") && Catch::Contains("MPZERO_TORCH_CUDA"));
  }
}

TEST_CASE("torch: which communicators take device memory; CUDA cores refuse host ones of several ranks", "[torch]") {
  // The default (world size 1) and any wrapped host communicator move host memory; NCCL
  // orders itself on CUDA streams, which is what marks a device communicator.
  CHECK_FALSE(mt::any_communicator{}.base().reads_device_memory());
  CHECK(mt::any_communicator{}.name() == "local");
  mpzero::comm::local_communicator local;
  CHECK_FALSE(mt::any_communicator::wrap(local, "local").base().reads_device_memory());
  // A communicator that can order itself after a CUDA stream is a device one, whether
  // wrapped or owned (the CUDA cores' world-size-1 communicator is owned this way).
  struct ordered_local : mpzero::comm::local_communicator {
    void wait_for(CUstream_st*) {}
  };
  auto owned = mt::any_communicator::own(ordered_local{}, "ordered");
  CHECK(owned.base().reads_device_memory());
  CHECK(owned.name() == "ordered");
  CHECK(owned.wait_for_stream(nullptr));
  STATIC_REQUIRE(mpzero::comm::stream_ordered<mpzero::comm::nccl_communicator>);
  // A host core with a device communicator: refused by name, with what to do.
  {
    mt::core_spec cpu;
    cpu.stage = 2;
    cpu.device = mt::core_device::cpu;
    const std::uint64_t n4[] = {4};
    REQUIRE_THROWS_MATCHES(mt::make_zero_core(cpu, owned, n4, {}, {}), mt::config_error,
                           Catch::Matchers::Predicate<mt::config_error>([](const mt::config_error& e) {
                             const std::string w = e.what();
                             return w.find("parameters are on the CPU, but the communicator 'ordered' reads device "
                                           "memory") != std::string::npos &&
                                    w.find("model->to(torch::kCUDA)") != std::string::npos &&
                                    w.find("process_group_communicator(group, torch::kCPU)") != std::string::npos;
                           }));
  }
  if (!mt::cuda_cores_compiled()) return;
  // A CUDA core with a host communicator of two ranks: refused before anything touches
  // a device (so this runs without a GPU), naming the communicator and what to use.
  mt::core_spec s;
  s.stage = 2;
  s.device = mt::core_device::cuda;
  const std::uint64_t numels[] = {4};
  mt::any_communicator two(std::make_shared<mpzero::testing::unused_communicator>("two host ranks", 2, false));
  REQUIRE_THROWS_MATCHES(mt::make_zero_core(s, two, numels, {}, {}), mt::config_error,
                         Catch::Matchers::Predicate<mt::config_error>([](const mt::config_error& e) {
                           const std::string w = e.what();
                           return w.find("'two host ranks' (2 ranks) moves host memory") != std::string::npos &&
                                  w.find("nccl_communicator") != std::string::npos &&
                                  w.find("process_group_communicator") != std::string::npos;
                         }));
}

TEST_CASE("torch: parameters on a device the engine cannot manage are refused by name", "[torch]") {
  struct TwoImpl : torch::nn::Module {
    Tensor a, b;
    TwoImpl() {
      a = register_parameter("a", torch::ones({3}));
      b = register_parameter("b", torch::empty({2}, torch::TensorOptions().device(torch::kMeta)));
    }
  };
  auto m = std::make_shared<TwoImpl>();
  const json cfg = config("fp32", 0, false);
  REQUIRE_THROWS_WITH(mt::initialize(m, cfg), Catch::Contains("parameter 'b' is on meta") &&
                                                  Catch::Contains("CPU or CUDA parameters"));
  // Nothing was re-pointed: the model is as it was.
  CHECK(torch::equal(m->a, torch::ones({3})));
  CHECK(m->a.device().is_cpu());
}

TEST_CASE("torch: any_communicator hands a CUDA stream to a communicator that can wait for it", "[torch]") {
  // The CUDA core orders each collective after its stream's queued work through
  // any_communicator::wait_for_stream: on the device where the communicator has
  // wait_for(cudaStream_t) (mpzero's NCCL), else by a host synchronization (false).
  static_assert(requires(mpzero::comm::nccl_communicator& c, cudaStream_t s) { c.wait_for(s); },
                "mpzero's NCCL communicator must keep wait_for(cudaStream_t), which the adapter forwards to");
  struct recording : mpzero::comm::local_communicator {
    std::vector<cudaStream_t> seen;
    void wait_for(cudaStream_t s) { seen.push_back(s); }
  };
  const auto stream = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x5eed});  // never dereferenced
  recording r;
  auto wrapped = mt::any_communicator::wrap(r, "recording");
  CHECK(wrapped.wait_for_stream(stream));
  REQUIRE(r.seen.size() == 1);
  CHECK(r.seen[0] == stream);

  mpzero::comm::local_communicator plain;
  CHECK_FALSE(mt::any_communicator::wrap(plain, "local").wait_for_stream(stream));
  CHECK_FALSE(mt::any_communicator{}.wait_for_stream(stream));
  // A c10d group orders its own stream against torch's current one; the core's
  // stream is synchronized instead.
  auto group = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 0, 1);
  CHECK_FALSE(mt::process_group_communicator(group, torch::kCPU).wait_for_stream(stream));
}
