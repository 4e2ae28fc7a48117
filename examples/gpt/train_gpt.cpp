// train_gpt: which precision configuration should I use, and what does it cost me?
//
// A small GPT (LibTorch C++ modules) is trained as a byte-level causal language model on
// the Debian `fortunes` corpus through the mpzero engine, once per configuration, from the
// same initial weights and the same batches (fixed seed). For each configuration it
// reports steps/s, the measured bytes of model states (on the CPU that is the memory the
// configuration costs; activations are the same for all), the bytes per parameter the
// memory model predicts next to the measured ones, the final and mean training loss and
// the held-out evaluation loss. Output: a table on stdout, summary.csv and results.json
// (with the loss curves and, per configuration, the steps an fp16 overflow skipped:
// skipped_at) in --out; examples/gpt/plot.py draws the PNGs (skipped steps as crosses).
//
//   ./train_gpt                         defaults: a few minutes on 2 CPU cores
//   ./train_gpt --configs bf16,fp16     every stage/offload variant of those precisions
//   ./train_gpt --configs all --steps 500 --out results
//   mpirun -n 2 ./train_gpt             data parallel (when built with MPI; CPU)
//   ./train_gpt --rounds 5              the list 5 times over, for step times on a noisy machine
//   ./train_gpt --device cuda --big     on a GPU (the default --device auto picks one when
//                                       LibTorch sees it and the adapter has CUDA cores)
//
// On a CPU whose LibTorch multiplies bf16 or fp16 matrices far slower than fp32 ones, the
// model's 16-bit products compute in fp32 from the 16-bit values, rounded once to 16 bits
// (--cpu-matmul; see "16-bit matrix products on a CPU" below).
//
// On a GPU the table adds the peak device memory: the CUDA caching allocator's peak
// (activations, gradients until the hooks hand them over, temporaries) plus the device
// bytes mpzero's core holds (model states and reduction buckets: allocated outside
// LibTorch's allocator, so they are added, not seen).
//
// Precisions (--configs names; DeepSpeed keys in make_config):
//   fp32         everything fp32 (no mixed precision)
//   bf16         bf16 parameters and gradients, fp32 master and Adam states (DeepSpeed's bf16)
//   bf16-master  bf16 master weights and gradients, fp32 states (ZeRO stage >= 1)
//   bf16-all     bf16 master and bf16 states, round to nearest (ZeRO stage >= 1)
//   bf16-all-sr  the same with stochastic rounding
//   fp16         fp16 parameters, fp32 master and states, dynamic loss scaling
//   fp16-master  fp16 master weights and gradients, fp32 states, dynamic loss scaling
//                (ZeRO stage >= 1)
//   fp32-ac      fp32 everything, the forward under bf16 autocast (PyTorch AMP)
//   bf16-all-ac  bf16-all with the forward under bf16 autocast: the DeepSpeed blog's
//                low-precision configuration (its baseline, "fp32 master", is bf16)
//   bf16-all-sr-ac  the same with stochastic rounding
//   torch        no mpzero: LibTorch's torch::optim::AdamW in fp32, same hyperparameters
//                and clipping (what the engine costs per step; id "torch")
// each at ZeRO stage 0, 1, 2, 3 and with CPU offload at stages 1-3 (ids: bf16/z2,
// bf16/z3+off, ...). At stage 3 each transformer block's parameters are gathered around
// its forward and backward (mpzero::torch::gathered_forward), and the model is built
// partitioned (mpzero::torch::zero_init): a rank holds its slices of the blocks and the
// block being built, never the whole model. At the end every rank's peak resident
// memory is printed.
#include <ATen/DeviceAccelerator.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <optional>

#include <sys/resource.h>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

#include <mpzero/policy/memory_model.hpp>
#include <mpzero/torch/engine.hpp>
#include <mpzero/torch/lr_schedule.hpp>
#include <mpzero/torch/zero_core.hpp>  // cuda_cores_compiled()
#include <mpzero/torch/zero_to_fp32.hpp>

#include "precision_config.hpp"

#ifdef MPZERO_GPT_MPI
#include <mpi.h>

#include <mpzero/comm/mpi.hpp>
#endif

namespace mt = mpzero::torch;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// ---- 16-bit matrix products on a CPU ------------------------------------------------
//
// LibTorch's CPU kernels in bf16 and fp16 can be far slower than in fp32: its matrix
// products on a CPU without AVX-512, its attention on one with AVX-512 (docs/perf.md,
// "16-bit products on the CPU"). Where the 16-bit kernels are slower (--cpu-matmul auto
// measures each kind of op at start), the model's 16-bit products of that kind compute
// in fp32 from the 16-bit values and round their result once to 16 bits: what a GPU's
// tensor cores do (16-bit inputs, fp32 accumulation), so each configuration still
// trains a 16-bit model. Under autocast the
// inputs are first rounded to the autocast dtype, as autocast would. Only the products
// change (the Linear layers and the output layer: "products"; the attention); every
// other op runs in the model's dtype.
// The kinds of op chosen for (the index into g_cpu_products) and the 16-bit dtypes, with
// their names in results.json (meta.cpu_matmul) and the header line.
enum cpu_op { op_products, op_attention, n_cpu_ops };
constexpr const char* cpu_op_names[n_cpu_ops] = {"products", "attention"};
struct half_dtype {
  const char* name;
  c10::ScalarType type;
};
constexpr half_dtype half_dtypes[] = {{"bf16", torch::kBFloat16}, {"fp16", torch::kHalf}};
constexpr int n_half_dtypes = static_cast<int>(std::size(half_dtypes));

struct cpu_choice {
  bool upcast = false;
  // --cpu-matmul auto: the time of LibTorch's 16-bit kernels over the fp32 path's, for the
  // op's forward and backward (NaN when not measured: a GPU, or a mode given by name).
  double ratio = std::nan("");
};
cpu_choice g_cpu_products[n_cpu_ops][n_half_dtypes];  // set once by run(), before any model is made

// The 16-bit dtype an op of kind `op` on x computes in on the CPU when it is to be
// upcast, else none.
std::optional<c10::ScalarType> upcast_dtype(const torch::Tensor& x, cpu_op op) {
  if (!x.is_cpu()) return std::nullopt;
  auto t = x.scalar_type();
  if (at::autocast::is_autocast_enabled(at::kCPU)) t = at::autocast::get_autocast_dtype(at::kCPU);
  for (int h = 0; h < n_half_dtypes; ++h)
    if (t == half_dtypes[h].type && g_cpu_products[op][h].upcast) return t;
  return std::nullopt;
}

// Autocast off for one upcast product (its inputs are already in the autocast dtype).
struct cpu_autocast_off {
  bool was = at::autocast::is_autocast_enabled(at::kCPU);
  cpu_autocast_off() { at::autocast::set_autocast_enabled(at::kCPU, false); }
  ~cpu_autocast_off() { at::autocast::set_autocast_enabled(at::kCPU, was); }
  cpu_autocast_off(const cpu_autocast_off&) = delete;
  cpu_autocast_off& operator=(const cpu_autocast_off&) = delete;
};

torch::Tensor widened(const torch::Tensor& t, c10::ScalarType half) { return t.to(half).to(torch::kFloat); }

torch::Tensor linear(torch::nn::Linear& m, const torch::Tensor& x) {
  const auto half = upcast_dtype(x, op_products);
  if (!half) return m(x);
  cpu_autocast_off off;
  const auto bias = m->bias.defined() ? widened(m->bias, *half) : torch::Tensor();
  return torch::nn::functional::linear(widened(x, *half), widened(m->weight, *half), bias).to(*half);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const auto half = upcast_dtype(q, op_attention);
  if (!half) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  cpu_autocast_off off;
  return at::scaled_dot_product_attention(widened(q, *half), widened(k, *half), widened(v, *half), {}, 0.0, true)
      .to(*half);
}

// ---- model --------------------------------------------------------------------------

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
  int heads;
  BlockImpl(int dim, int n_heads) : heads(n_heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc = register_module("fc", torch::nn::Linear(dim, 4 * dim));
    out = register_module("out", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto b = x.size(0), t = x.size(1), c = x.size(2);
    auto qkv_ = linear(qkv, ln1(x)).view({b, t, 3, heads, c / heads}).permute({2, 0, 3, 1, 4});
    auto y = causal_attention(qkv_[0], qkv_[1], qkv_[2]);
    x = x + linear(proj, y.transpose(1, 2).reshape({b, t, c}));
    return x + linear(out, torch::gelu(linear(fc, ln2(x))));
  }
};
TORCH_MODULE(Block);

// GPT-2's initialisation of a module as it is built: N(0, 0.02) matrices, zero biases,
// LayerNorm at (1, 0). Returns the module.
template <class M>
M gpt2_init(M m) {
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters()) {
    if (p.value().dim() >= 2) p.value().normal_(0.0, 0.02);
    else if (p.key().find("ln") == std::string::npos) p.value().zero_();
  }
  return m;
}

struct GPTImpl : torch::nn::Module {
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
  // Each block is initialised as it is built and passed through mt::partitioned: under a
  // zero_init scope (stage-3 configurations) a rank then keeps only its slices of it, so
  // no rank ever holds the whole model; otherwise it is kept whole. The values are the
  // same either way.
  GPTImpl(int layers, int dim, int n_heads, int seq) {
    tok = register_module("tok", gpt2_init(torch::nn::Embedding(256, dim)));
    pos = register_module("pos", gpt2_init(torch::nn::Embedding(seq, dim)));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < layers; ++i) blocks->push_back(mt::partitioned(gpt2_init(Block(dim, n_heads))));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    head = register_module("head", gpt2_init(torch::nn::Linear(torch::nn::LinearOptions(dim, 256).bias(false))));
  }
  // Mean cross-entropy of the next byte, in fp32 whatever the parameter dtype.
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& targets) {
    const auto t = idx.size(1);
    auto x = tok(idx) + pos(torch::arange(t, idx.options()));
    // ZeRO-3: each block's parameters are gathered around its forward and its backward
    // only (at other stages, and for the plain-LibTorch run, a plain call).
    for (std::size_t k = 0; k < blocks->size(); ++k) x = mt::gathered_forward(blocks->ptr<BlockImpl>(k), x);
    auto logits = linear(head, ln_f(x)).to(torch::kFloat);
    return torch::nn::functional::cross_entropy(logits.view({-1, 256}), targets.reshape({-1}));
  }
};
TORCH_MODULE(GPT);

// ---- data ---------------------------------------------------------------------------

struct corpus {
  std::vector<std::uint8_t> train, eval;
  std::size_t files = 0, fortunes = 0;
};

// Every fortune file (the .dat indexes and .u8 links left out), '%' separators stripped;
// every 10th fortune goes to the held-out set: deterministic, and both sets see all files.
corpus load_corpus(const fs::path& dir) {
  if (!fs::is_directory(dir))
    throw std::runtime_error("corpus directory " + dir.string() +
                             " does not exist: install Debian's fortunes (apt-get install fortunes) or pass --corpus DIR");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file() || e.is_symlink() || e.path().has_extension()) continue;
    files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  corpus c;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string line, cur;
    auto flush = [&] {
      if (cur.empty()) return;
      auto& dst = (c.fortunes++ % 10 == 9) ? c.eval : c.train;
      dst.insert(dst.end(), cur.begin(), cur.end());
      dst.push_back('\n');
      cur.clear();
    };
    while (std::getline(in, line)) {
      if (line == "%") flush();
      else {
        cur += line;
        cur += '\n';
      }
    }
    flush();
    ++c.files;
  }
  if (c.train.size() < 10'000 || c.eval.size() < 1'000)
    throw std::runtime_error("corpus in " + dir.string() + " is too small (" + std::to_string(c.train.size()) +
                             " training bytes); point --corpus at a directory of fortune files");
  return c;
}

// (inputs, next-byte targets), both [batch, seq] int64.
std::pair<torch::Tensor, torch::Tensor> windows(const std::vector<std::uint8_t>& text,
                                                const std::vector<std::size_t>& starts, int seq) {
  const auto b = static_cast<std::int64_t>(starts.size());
  auto x = torch::empty({b, seq}, torch::kLong), y = torch::empty({b, seq}, torch::kLong);
  auto xa = x.accessor<std::int64_t, 2>(), ya = y.accessor<std::int64_t, 2>();
  for (std::int64_t i = 0; i < b; ++i)
    for (int j = 0; j < seq; ++j) {
      xa[i][j] = text[starts[i] + j];
      ya[i][j] = text[starts[i] + j + 1];
    }
  return {x, y};
}

// ---- configurations -------------------------------------------------------------------

struct run_spec {
  std::string precision;
  int stage;
  bool offload;
  std::string id() const {
    if (precision == "torch") return precision;  // the plain-LibTorch reference: no stage
    return precision + "/z" + std::to_string(stage) + (offload ? "+off" : "");
  }
};

const std::vector<std::string> precisions = {"fp32",        "bf16",    "bf16-master", "bf16-all",      "bf16-all-sr",
                                             "fp16",        "fp16-master", "fp32-ac", "bf16-all-ac", "bf16-all-sr-ac"};

bool needs_zero(const std::string& p) { return p.rfind("bf16-", 0) == 0 || p == "fp16-master"; }  // 16-bit master: stage >= 1

std::vector<run_spec> all_specs() {
  std::vector<run_spec> v{{"torch", 0, false}};
  for (const auto& p : precisions) {
    for (int s = needs_zero(p) ? 1 : 0; s <= 3; ++s) v.push_back({p, s, false});
    for (int s = 1; s <= 3; ++s) v.push_back({p, s, true});
  }
  return v;
}

// The default: every precision once, plus the stages and offload for bf16 and fp16, the
// blog's autocast pair and the plain-LibTorch reference.
const char* default_configs =
    "fp32/z0,bf16/z0,bf16/z1,bf16/z2,bf16/z2+off,bf16/z3,bf16-master/z2,bf16-all/z2,bf16-all/z3,bf16-all-sr/z2,fp16/z0,"
    "fp16/z2,fp16-master/z2,fp32-ac/z0,bf16-all-ac/z2,torch";

std::vector<run_spec> select_specs(const std::string& list) {
  const auto all = all_specs();
  std::vector<run_spec> out;
  auto add = [&](const run_spec& s) {
    if (std::none_of(out.begin(), out.end(), [&](const run_spec& o) { return o.id() == s.id(); })) out.push_back(s);
  };
  std::stringstream ss(list);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    if (tok.empty()) continue;
    bool found = false;
    for (const auto& s : all) {
      if (tok == "all" || tok == s.id() || tok == s.precision) {
        add(s);
        found = true;
      }
    }
    if (!found) {
      std::string ids;
      for (const auto& s : all) {
        ids += ' ';  // appended piecewise: " " + s.id() trips GCC 12's -Wrestrict false positive
        ids += s.id();
      }
      std::string names = "torch";
      for (const auto& p : precisions) names += ", " + p;
      throw std::invalid_argument("--configs: '" + tok + "' is not a configuration; use 'all', a precision (" + names +
                                  ") or one of:" + ids);
    }
  }
  if (out.empty()) throw std::invalid_argument("--configs selects nothing; e.g. --configs bf16/z2,fp16/z2");
  return out;
}

struct options {
  int steps = 200, layers = 2, dim = 64, heads = 4, seq = 64, batch = 16, eval_batches = 16;
  double lr = 3e-3;
  std::uint64_t seed = 1234;
  std::string configs = default_configs, out = "gpt_out", corpus = "/usr/share/games/fortunes";
  std::string device = "auto";  // cpu, cuda, cuda:N or auto
  std::string save;             // --save: a checkpoint and its fp32 export per configuration
  std::uint64_t bucket = mt::zero_config{}.reduce_bucket_size;  // --bucket: zero_optimization.reduce_bucket_size
  std::string cpu_matmul = "auto";  // --cpu-matmul: auto, fp32 or native (16-bit products on a CPU)
  std::string lr_schedule = "constant";  // --lr-schedule: constant or cosine (lr_schedule_json)
  int rounds = 1;  // --rounds: the configuration list is trained this many times, round by round
  // --persistence: zero_optimization.stage3_param_persistence_threshold (stage 3 keeps
  // parameters of at most this many elements whole on every rank)
  std::uint64_t persistence = mt::zero_config{}.stage3_param_persistence_threshold;
};

// --device as a torch::Device: auto is the first CUDA device when LibTorch sees one and
// the engine was built with CUDA cores, else the CPU.
torch::Device resolve_device(const std::string& d) {
  const bool gpu = torch::cuda::is_available(), cores = mt::cuda_cores_compiled();
  if (d == "auto") return gpu && cores ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  torch::Device dev(torch::kCPU);
  try {
    dev = torch::Device(d);
  } catch (const std::exception&) {
    throw std::invalid_argument("--device " + d + ": not a device; use cpu, cuda, cuda:N or auto");
  }
  if (dev.is_cpu()) return dev;
  if (!dev.is_cuda()) throw std::invalid_argument("--device " + d + ": the engine trains on the CPU or CUDA devices");
  if (!gpu) throw std::invalid_argument("--device " + d + ": LibTorch sees no CUDA device here; use --device cpu");
  if (!cores) {
    throw std::invalid_argument("--device " + d + ": this build of the adapter has no CUDA cores (MPZERO_TORCH_CUDA=OFF); "
                                "rebuild with CUDA (scripts/main_gpt.sh does when a GPU is present) or use --device cpu");
  }
  if (!dev.has_index()) dev = torch::Device(torch::kCUDA, 0);
  if (dev.index() >= static_cast<int>(torch::cuda::device_count())) {
    throw std::invalid_argument("--device " + d + ": there are " + std::to_string(torch::cuda::device_count()) +
                                " CUDA device(s)");
  }
  return dev;
}

// --lr-schedule cosine: DeepSpeed's WarmupCosineLR over the run, a linear warmup over
// the first 5% of the steps (at least 2) and a cosine down to 10% of --lr at the last
// step. Null for the constant rate.
json lr_schedule_json(const options& o) {
  if (o.lr_schedule != "cosine") return nullptr;
  return {{"type", "WarmupCosineLR"},
          {"params",
           {{"total_num_steps", o.steps},
            {"warmup_num_steps", std::max(2, o.steps / 20)},
            {"warmup_type", "linear"},
            {"cos_min_ratio", 0.1}}}};
}

json make_config(const run_spec& s, const options& o) {
  json zero = {{"stage", s.stage}};
  zero["reduce_bucket_size"] = o.bucket;
  zero["stage3_param_persistence_threshold"] = o.persistence;
  if (s.offload) zero["offload_optimizer"] = {{"device", "cpu"}};
  json j = {{"train_micro_batch_size_per_gpu", o.batch},
            {"gradient_accumulation_steps", 1},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", o.lr}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.01}}}}},
            {"gradient_clipping", 1.0},
            {"seed", o.seed},
            {"zero_optimization", zero}};
  if (const json sched = lr_schedule_json(o); !sched.is_null()) j["scheduler"] = sched;
  mpzero_gpt::set_precision(j, s.precision, {{"enabled", true}, {"loss_scale", 0}});
  return j;
}

int n_states(mt::optimizer_type t) {
  return t == mt::optimizer_type::adam || t == mt::optimizer_type::adamw ? 2 : 1;
}

// ---- output helpers -------------------------------------------------------------------

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

void usage() {
  std::printf(
      "usage: train_gpt [--steps N] [--layers N] [--dim N] [--heads N] [--seq N] [--batch N] [--lr X]\n"
      "                 [--eval-batches N] [--seed N] [--configs LIST] [--out DIR] [--corpus DIR] [--big]\n"
      "                 [--device auto|cpu|cuda|cuda:N] [--save DIR] [--bucket N] [--rounds N]\n"
      "                 [--persistence N] [--cpu-matmul auto|fp32|native] [--lr-schedule constant|cosine]\n"
      "  --configs: comma-separated ids (bf16/z2, fp16/z1+off), precisions (every variant: fp32, bf16,\n"
      "             bf16-master, bf16-all, bf16-all-sr, fp16, fp16-master; with bf16 autocast: fp32-ac, bf16-all-ac,\n"
      "             bf16-all-sr-ac), 'torch' (plain LibTorch AdamW, no mpzero) or 'all'. The first is\n"
      "             the base the others are compared with (if it does not finish, the first that does).\n"
      "             Default:\n             %s\n"
      "  --big:     6 layers, dim 384, 6 heads, seq 256, batch 32, 2000 steps, lr 1e-3 (later flags override);\n"
      "             meant for a GPU\n"
      "  --device:  where the model trains; auto (default): a CUDA device when there is one and the engine\n"
      "             has CUDA cores, else the CPU\n"
      "  --save:    after training, each mpzero configuration saves its checkpoint to DIR/<id, '/' as '_'>\n"
      "             (engine.save_checkpoint), exports it to one fp32 file beside the shards\n"
      "             (fp32.safetensors, mpzero_zero_to_fp32) and reports the held-out loss of that export\n"
      "             evaluated in fp32 by a fresh model (export_eval_loss in results.json)\n"
      "  --bucket:  zero_optimization.reduce_bucket_size in elements (default DeepSpeed's 500000000); stages 2-3\n"
      "             hold a staging and a receive buffer of up to this many gradient elements (at world size 1\n"
      "             none without offload, where one rank adds straight into the gradient; with offload\n"
      "             the staging buffer only)\n"
      "  --rounds:  train the whole list N times, round by round (A B C A B C ...), and report each\n"
      "             configuration's median steps/s over the rounds and its step time against the base as\n"
      "             the median of the rounds' paired ratios, so that a machine's slow spell hits every\n"
      "             configuration alike (default 1). Losses and memory are the first round's; later rounds\n"
      "             are timed only (and not saved)\n"
      "  --persistence: zero_optimization.stage3_param_persistence_threshold in elements (default\n"
      "             DeepSpeed's 100000): at stage 3, parameters of at most this many elements stay whole on\n"
      "             every rank; the larger ones are partitioned and gathered around each block's forward and\n"
      "             backward (the default model's are all below it: use --big or a smaller threshold)\n"
      "  --cpu-matmul: on a CPU, how the model's bf16 and fp16 matrix products compute: native (LibTorch's\n"
      "             16-bit kernels), fp32 (fp32 products of the 16-bit values, rounded once to 16 bits, as a\n"
      "             GPU's tensor cores do) or auto (default: fp32 for a dtype whose product LibTorch runs more\n"
      "             than 4 times slower than fp32's here, measured at start; LibTorch 2.11 without AVX-512 is\n"
      "             45 times slower). No effect on a GPU\n"
      "  --lr-schedule: constant (default: --lr throughout) or cosine (DeepSpeed's WarmupCosineLR: linear\n"
      "             warmup over the first 5%% of the steps, then a cosine down to 10%% of --lr at the last step;\n"
      "             the 'torch' reference follows the same rates)\n",
      default_configs);
}

options parse_args(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    }
    if (a == "--big") {
      o.steps = 2000, o.layers = 6, o.dim = 384, o.heads = 6, o.seq = 256, o.batch = 32, o.lr = 1e-3;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value (see --help)");
    const std::string v = argv[++i];
    auto integer = [&](int lo) {
      int x = 0;
      std::size_t used = 0;
      try {
        x = std::stoi(v, &used);
      } catch (...) {
        used = 0;
      }
      if (used == 0 || used != v.size()) throw std::invalid_argument(a + " " + v + ": not an integer");
      if (x < lo) throw std::invalid_argument(a + " " + v + ": must be at least " + std::to_string(lo));
      return x;
    };
    // v as a whole number from 0 to 2^64 - 1 (no sign, nothing after it), or nothing.
    auto unsigned64 = [&]() -> std::optional<std::uint64_t> {
      std::size_t used = 0;
      std::uint64_t x = 0;
      try {
        if (!v.empty() && v[0] != '-') x = std::stoull(v, &used);
      } catch (...) {
        used = 0;
      }
      if (used == 0 || used != v.size()) return std::nullopt;
      return x;
    };
    if (a == "--steps") o.steps = integer(2);
    else if (a == "--layers") o.layers = integer(1);
    else if (a == "--dim") o.dim = integer(8);
    else if (a == "--heads") o.heads = integer(1);
    else if (a == "--seq") o.seq = integer(2);
    else if (a == "--batch") o.batch = integer(1);
    else if (a == "--eval-batches") o.eval_batches = integer(1);
    else if (a == "--rounds") o.rounds = integer(1);
    else if (a == "--seed") {  // the engine's seed is 64 bits (docs/config.md)
      const auto s = unsigned64();
      if (!s) throw std::invalid_argument("--seed " + v + ": not an integer from 0 to 18446744073709551615");
      o.seed = *s;
    }
    else if (a == "--lr") {
      std::size_t used = 0;
      try {
        o.lr = std::stod(v, &used);
      } catch (...) {
        used = 0;
      }
      if (used == 0 || used != v.size()) throw std::invalid_argument("--lr " + v + ": not a number");
      if (!(o.lr > 0)) throw std::invalid_argument("--lr " + v + ": must be positive");
    }
    else if (a == "--configs") o.configs = v;
    else if (a == "--cpu-matmul") {
      if (v != "auto" && v != "fp32" && v != "native")
        throw std::invalid_argument("--cpu-matmul " + v + ": not a mode; use auto, fp32 or native");
      o.cpu_matmul = v;
    }
    else if (a == "--lr-schedule") {
      if (v != "constant" && v != "cosine")
        throw std::invalid_argument("--lr-schedule " + v + ": not a schedule; use constant or cosine");
      o.lr_schedule = v;
    }
    else if (a == "--out") o.out = v;
    else if (a == "--corpus") o.corpus = v;
    else if (a == "--device") o.device = v;
    else if (a == "--save") o.save = v;
    else if (a == "--bucket") {
      const auto b = unsigned64();
      if (!b || *b == 0)
        throw std::invalid_argument("--bucket " + v + ": must be a positive whole number of elements (e.g. 50000000)");
      o.bucket = *b;
    }
    else if (a == "--persistence") {
      const auto b = unsigned64();
      if (!b) throw std::invalid_argument("--persistence " + v + ": must be a whole number of elements (e.g. 100000)");
      o.persistence = *b;
    }
    else throw std::invalid_argument("unknown flag " + a + " (see --help)");
  }
  if (o.dim % o.heads != 0)
    throw std::invalid_argument("--dim " + std::to_string(o.dim) + " is not a multiple of --heads " +
                                std::to_string(o.heads));
  return o;
}

struct result {
  run_spec spec;
  std::string describe;
  bool autocast = false;  // the forward ran under torch_autocast (the config says so)
  std::vector<double> losses;
  // --rounds: each round's steps/s (the first round's first); steps_per_s is their median.
  std::vector<double> round_steps_per_s;
  double steps_per_s = 0, steps_per_s_mean = 0, final_loss = 0, mean_loss = 0, eval_loss = 0, loss_scale = 1;
  std::uint64_t skipped = 0, numel = 0, padding = 0, device_bytes = 0, host_bytes = 0;
  std::vector<std::uint64_t> skipped_at;  // the optimizer steps (1-based) an fp16 overflow skipped
  // On a GPU: LibTorch's caching allocator peak, and that plus the core's device bytes.
  std::uint64_t torch_peak_bytes = 0, peak_device_bytes = 0;
  // The most bytes of the core's reduction buffers held at once (engine.memory().peak_buckets;
  // they are freed between steps), beside the states.
  std::uint64_t bucket_bytes = 0;
  // --save: the checkpoint's directory, the save's wall time, and the held-out loss of its
  // fp32 export (rank 0's; NaN elsewhere and without --save).
  std::string checkpoint;
  double save_s = 0, export_eval_loss = std::nan("");
  mpzero::memory_footprint predicted;
  double measured_bpp() const { return static_cast<double>(device_bytes + host_bytes) / static_cast<double>(numel); }
};

// The held-out loss on fixed, evenly spaced windows of the eval text (the same on every
// rank); `eval(x, y)` returns a batch's loss.
template <class Eval>
double evaluate(const options& o, const corpus& data, torch::Device device, Eval&& eval) {
  torch::NoGradGuard ng;
  const std::size_t span = data.eval.size() - static_cast<std::size_t>(o.seq) - 2;
  const std::size_t n = static_cast<std::size_t>(o.eval_batches) * static_cast<std::size_t>(o.batch);
  std::vector<std::size_t> starts(static_cast<std::size_t>(o.batch));
  double sum = 0;
  for (int b = 0; b < o.eval_batches; ++b) {
    for (int i = 0; i < o.batch; ++i) starts[i] = (static_cast<std::size_t>(b) * o.batch + i) * span / n;
    auto [x, y] = windows(data.eval, starts, o.seq);
    sum += eval(x.to(device), y.to(device)).template item<double>();
  }
  return sum / o.eval_batches;
}

// The training loop and the held-out evaluation, the same for the engine and the
// plain-LibTorch reference. `step(x, y)` runs one training step and returns its loss;
// `eval(x, y)` the loss without gradients.
template <class Step, class Eval>
void train_and_evaluate(result& r, const options& o, const corpus& data, mt::any_communicator& comm,
                        torch::Device device, int index, int total, Step&& step, Eval&& eval) {
  const int rank = comm.rank(), world = comm.size();
  // The same batches for every configuration; each rank its own (data parallel).
  std::mt19937_64 gen(o.seed * 1000003ULL + static_cast<std::uint64_t>(rank));
  std::uniform_int_distribution<std::size_t> start(0, data.train.size() - static_cast<std::size_t>(o.seq) - 2);
  std::vector<std::size_t> starts(static_cast<std::size_t>(o.batch));

  const int report_every = std::max(1, o.steps / 50);
  using clock = std::chrono::steady_clock;
  std::vector<double> step_s;  // each step's wall time
  const auto t0 = clock::now();
  for (int i = 0; i < o.steps; ++i) {
    const auto ts = clock::now();
    for (auto& s : starts) s = start(gen);
    auto [x, y] = windows(data.train, starts, o.seq);
    r.losses.push_back(step(x.to(device), y.to(device)).template item<double>());
    step_s.push_back(std::chrono::duration<double>(clock::now() - ts).count());
    if (rank == 0 && ((i + 1) % report_every == 0 || i + 1 == o.steps)) {
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "\r[%d/%d] %-18s step %5d/%d  loss %6.3f  %6.1f steps/s so far   ", index + 1, total,
                   r.spec.id().c_str(), i + 1, o.steps, r.losses.back(), (i + 1) / el);
      std::fflush(stderr);
    }
  }
  // The first step warms up and is left out. The median step time, not the mean: on a
  // shared machine other processes' bursts would otherwise decide the ranking.
  std::vector<double> timed(step_s.begin() + 1, step_s.end());
  r.steps_per_s_mean = static_cast<double>(timed.size()) / std::accumulate(timed.begin(), timed.end(), 0.0);
  std::nth_element(timed.begin(), timed.begin() + static_cast<std::ptrdiff_t>(timed.size() / 2), timed.end());
  r.steps_per_s = 1.0 / timed[timed.size() / 2];
  r.round_steps_per_s = {r.steps_per_s};

  // Every rank trained on its own batches: report the mean over ranks (one collective, at the end).
  if (world > 1) {
    std::vector<float> local(r.losses.begin(), r.losses.end()), sum(local.size());
    comm.all_reduce(local.data(), sum.data(), local.size(), mpzero::comm::reduce_op::sum);
    for (std::size_t i = 0; i < sum.size(); ++i) r.losses[i] = static_cast<double>(sum[i]) / world;
  }
  const auto tail = std::min<std::size_t>(10, r.losses.size());
  r.final_loss = std::accumulate(r.losses.end() - static_cast<std::ptrdiff_t>(tail), r.losses.end(), 0.0) / tail;
  r.mean_loss = std::accumulate(r.losses.begin(), r.losses.end(), 0.0) / r.losses.size();

  r.eval_loss = evaluate(o, data, device, eval);
}

// On a GPU: returns the previous configuration's cached blocks and starts a new peak.
void reset_peak(torch::Device device) {
  if (!device.is_cuda()) return;
  // The caching allocator's per-device state exists only after CUDA's lazy init (which
  // is_available() and device_count() do not trigger): without it the reset throws
  // "Invalid device argument 0: did you call init?".
  at::globalContext().lazyInitDevice(c10::kCUDA);
  at::accelerator::synchronizeDevice(device.index());
  at::accelerator::emptyCache();
  at::accelerator::resetPeakStats(device.index());
}

// A fresh model with the run's initial weights (the same for every configuration); on a
// GPU the allocator's peak is reset first, so each configuration's peak is its own. With
// `partition_for` (stage 3), built partitioned: this rank keeps its slices of each block.
GPT fresh_model(const options& o, torch::Device device, const mt::any_communicator* partition_for = nullptr) {
  reset_peak(device);
  torch::manual_seed(o.seed);
  std::optional<mt::zero_init> scope;
  if (partition_for != nullptr) scope.emplace(*partition_for);
  GPT model(o.layers, o.dim, o.heads, o.seq);
  scope.reset();
  model->to(device);
  return model;
}

// On a GPU: the peak device memory (LibTorch's allocator peak + `outside` bytes it does
// not see). Then the progress line's last word.
void finish(result& r, torch::Device device, std::uint64_t outside, int rank, int index, int total) {
  if (device.is_cuda()) {
    const auto stats = at::accelerator::getDeviceStats(device.index());
    const auto peak = stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
    r.torch_peak_bytes = static_cast<std::uint64_t>(std::max<std::int64_t>(0, peak));
    r.peak_device_bytes = r.torch_peak_bytes + outside;
  }
  if (rank == 0) {
    std::fprintf(stderr, "\r[%d/%d] %-18s done: %.1f steps/s (median), train %.3f, eval %.3f%*s\n", index + 1, total,
                 r.spec.id().c_str(), r.steps_per_s, r.final_loss, r.eval_loss, 20, "");
  }
}

// The reference without mpzero: the same model, batches, AdamW hyperparameters and
// gradient clipping with LibTorch's torch::optim::AdamW in fp32 (gradients averaged over
// ranks by one all-reduce per step). What the engine costs, and whether its fp32 run
// learns alike.
result train_torch(const run_spec& spec, const options& o, const corpus& data, mt::any_communicator comm,
                   torch::Device device, int index, int total) {
  GPT model = fresh_model(o, device);
  const auto params = model->parameters();
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.01));
  const int world = comm.size();
  // --lr-schedule: the engine's own formula (mt::lr_at, from the same JSON), so that this
  // reference follows the rate every mpzero configuration follows: update k uses the rate
  // after k - 1 scheduler steps.
  const json sched = lr_schedule_json(o);
  const mt::scheduler_config schedule =
      sched.is_null() ? mt::scheduler_config{}
                      : mt::parse_config({{"train_micro_batch_size_per_gpu", o.batch}, {"scheduler", sched}}, world)
                            .scheduler;
  std::uint64_t updates = 0;
  result r;
  r.spec = spec;
  r.describe = "LibTorch torch::optim::AdamW, fp32, no mpzero";
  auto step = [&](const torch::Tensor& x, const torch::Tensor& y) {
    opt.zero_grad();
    auto loss = model->forward(x, y);
    loss.backward();
    if (world > 1) {  // average the gradients over the ranks (CPU: train_gpt refuses GPUs at world > 1)
      std::vector<torch::Tensor> grads;
      for (const auto& p : params) grads.push_back(p.grad().reshape({-1}));
      auto flat = torch::cat(grads);
      auto sum = torch::empty_like(flat);
      comm.all_reduce(flat.data_ptr<float>(), sum.data_ptr<float>(), static_cast<std::size_t>(flat.numel()),
                      mpzero::comm::reduce_op::sum);
      sum.div_(world);
      std::int64_t off = 0;
      for (const auto& p : params) {
        p.grad().copy_(sum.slice(0, off, off + p.numel()).view_as(p));
        off += p.numel();
      }
    }
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options()).lr(mt::lr_at(schedule, o.lr, updates++));
    opt.step();
    return loss.detach();
  };
  auto eval = [&](const torch::Tensor& x, const torch::Tensor& y) { return model->forward(x, y); };
  train_and_evaluate(r, o, data, comm, device, index, total, step, eval);

  // Model states as LibTorch holds them: parameters, gradients, AdamW's two moments.
  for (const auto& p : params) {
    r.numel += static_cast<std::uint64_t>(p.numel());
    r.device_bytes += static_cast<std::uint64_t>(p.nbytes() + (p.grad().defined() ? p.grad().nbytes() : 0));
  }
  for (const auto& [key, state] : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
    r.device_bytes += static_cast<std::uint64_t>(s.exp_avg().nbytes() + s.exp_avg_sq().nbytes() +
                                                 (s.max_exp_avg_sq().defined() ? s.max_exp_avg_sq().nbytes() : 0));
  }
  const mpzero::state_layout fp32{mpzero::dtype::fp32, mpzero::dtype::fp32, mpzero::dtype::fp32, mpzero::dtype::fp32, 2};
  r.predicted = mpzero::bytes_per_param(fp32, 0, mpzero::offload_kind::none, world);
  finish(r, device, 0, comm.rank(), index, total);
  return r;
}

// --save: the configuration's checkpoint in <save>/<tag>, its fp32 export beside the
// shards (what mpzero_zero_to_fp32 writes), and the held-out loss of that export,
// evaluated in fp32 by a fresh model that holds only the exported values (rank 0).
void save_and_export(mt::engine<GPT>& engine, result& r, const options& o, const corpus& data,
                     mt::any_communicator& comm, torch::Device device) {
  std::string tag = r.spec.id();
  std::replace(tag.begin(), tag.end(), '/', '_');
  const auto t0 = std::chrono::steady_clock::now();
  engine.save_checkpoint(o.save, tag, {{"config", r.spec.id()}, {"steps", o.steps}, {"eval_loss", r.eval_loss}},
                         /*save_latest=*/false);
  r.save_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.checkpoint = (fs::path(o.save) / tag).string();
  if (comm.rank() != 0) return;
  const auto sd = mt::fp32_state_dict_from_checkpoint(o.save, tag);
  mt::save_state_dict(sd, (fs::path(r.checkpoint) / "fp32.safetensors").string());
  GPT model(o.layers, o.dim, o.heads, o.seq);  // fp32; every value comes from the export
  {
    torch::NoGradGuard ng;
    for (auto& p : model->named_parameters()) p.value().copy_(sd[p.key()]);
    for (auto& b : model->named_buffers()) b.value().copy_(sd[b.key()]);
  }
  model->to(device);
  r.export_eval_loss = evaluate(o, data, device, [&](const torch::Tensor& x, const torch::Tensor& y) {
    return model->forward(x, y);
  });
  std::fprintf(stderr, "%*s saved to %s in %.3f s; its fp32 export's held-out loss %.4f (training's %.4f)\n", 24, "",
               r.checkpoint.c_str(), r.save_s, r.export_eval_loss, r.eval_loss);
}

result train_engine(mt::engine<GPT>& engine, const run_spec& spec, const options& o, const corpus& data,
                    mt::any_communicator comm, torch::Device device, int index, int total);

// Why a configuration has no result: the engine refused it (e.g. a combination this build
// of the adapter does not compile), or its training stopped (e.g. fp16 overflowing at the
// minimum loss scale). Every rank refuses or stops alike.
struct no_result {
  std::string reason;
  bool stopped = false;  // during training, with its progress line still open
};

// nullopt, with `why` filled in, when the configuration has no result.
std::optional<result> train_one(const run_spec& spec, const options& o, const corpus& data, mt::any_communicator comm,
                                torch::Device device, int index, int total, no_result& why) {
  if (spec.precision == "torch") return train_torch(spec, o, data, comm, device, index, total);
  GPT model = fresh_model(o, device, spec.stage == 3 ? &comm : nullptr);
  std::optional<mt::engine<GPT>> made;
  try {
    made.emplace(mt::initialize(model, make_config(spec, o), comm));
  } catch (const std::exception& e) {
    why = {e.what(), false};
    return std::nullopt;
  }
  auto& engine = *made;
  result r;
  try {
    r = train_engine(engine, spec, o, data, comm, device, index, total);
  } catch (const std::exception& e) {
    // A run that stops (an fp16 run whose loss scale fell to its minimum, say) is one
    // result of the comparison, not the end of it: every rank stops alike (the decision
    // is collective), and the next configuration starts from a fresh model.
    why = {std::string("stopped during training: ") + e.what(), true};
    return std::nullopt;
  }
  // After the peak is read: the export's model and evaluation are not training's memory.
  // Not caught: a --save that fails is the user's error to see.
  if (!o.save.empty()) save_and_export(engine, r, o, data, comm, device);
  return r;
}

result train_engine(mt::engine<GPT>& engine, const run_spec& spec, const options& o, const corpus& data,
                    mt::any_communicator comm, torch::Device device, int index, int total) {
  // The engine has replaced the parameters with views of its own buffers and freed the
  // fp32 copy model->to(device) made: start the peak again so that it measures training,
  // not that initialization copy (4 bytes per parameter in every row otherwise).
  reset_peak(device);

  result r;
  r.spec = spec;
  r.describe = engine.describe();
  r.autocast = engine.config().torch_autocast.enabled;
  const auto& cfg = engine.config();
  const mpzero::state_layout layout{cfg.param_dtype(), cfg.master_dtype(), cfg.grad_dtype(), cfg.state_dtype(),
                                    n_states(cfg.optimizer.type)};
  r.predicted = mpzero::bytes_per_param(layout, spec.stage, spec.offload ? mpzero::offload_kind::cpu : mpzero::offload_kind::none,
                                        comm.size());
  if (spec.stage == 3) {
    // The memory model partitions every parameter at stage 3; those at or below the
    // persistence threshold stay whole on every rank, at the end of the flat layout. This
    // rank (0, whose numbers are reported) keeps the partitioned part of its slice,
    // min(N/W, N - persistent) elements, plus all the persistent ones.
    double persistent = 0, n_all = 0;
    for (const auto& p : engine.parameters()) {
      double n = 1;
      for (auto d : engine.parameter_shape(p)) n *= static_cast<double>(d);
      n_all += n;
      if (n > 0 && n <= static_cast<double>(o.persistence)) persistent += n;
    }
    const double slice = n_all / comm.size();
    r.predicted.device_bytes += static_cast<double>(mpzero::size_of(cfg.param_dtype())) *
                                (std::min(slice, n_all - persistent) + persistent - slice) / n_all;
  }
  std::uint64_t calls = 0;
  auto step = [&](const torch::Tensor& x, const torch::Tensor& y) {
    auto loss = engine.forward(x, y);
    engine.backward(loss);  // applies the fp16 loss scale; plain loss.backward() elsewhere
    const std::uint64_t skipped_before = engine.skipped_steps();
    engine.step();
    ++calls;
    if (engine.skipped_steps() > skipped_before) r.skipped_at.push_back(calls);
    return loss.detach();
  };
  // engine.forward: under autocast when the configuration trains with it.
  auto eval = [&](const torch::Tensor& x, const torch::Tensor& y) { return engine.forward(x, y); };
  train_and_evaluate(r, o, data, comm, device, index, total, step, eval);
  r.skipped = engine.skipped_steps();
  r.loss_scale = engine.loss_scale();

  const auto m = engine.memory();
  r.numel = m.model_numel;
  r.padding = m.padding_numel;
  r.device_bytes = m.model_state_bytes();
  r.bucket_bytes = m.peak_buckets;
  r.host_bytes = m.host_model_state_bytes();
  // The core's model states and buckets are allocated outside LibTorch's allocator; the
  // buckets at their peak, during backward and the step.
  finish(r, device, r.device_bytes + m.peak_buckets, comm.rank(), index, total);
  return r;
}

// The median of `v` (the mean of the middle two for an even count).
// NaNs (rounds that did not finish) are left out.
double median(std::vector<double> v) {
  std::erase_if(v, [](double x) { return std::isnan(x); });
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// r's step time against base's, round by round (time_r / time_base - 1 in each round in
// which both ran; the first always did); one value without --rounds.
std::vector<double> step_time_changes(const result& r, const result& base) {
  std::vector<double> out;
  const std::size_t n = std::min(r.round_steps_per_s.size(), base.round_steps_per_s.size());
  for (std::size_t k = 0; k < n; ++k) {
    const double change = base.round_steps_per_s[k] / r.round_steps_per_s[k] - 1.0;
    if (!std::isnan(change)) out.push_back(change);  // both finished that round
  }
  return out;  // not empty: every result has its first round's timing
}

// `first`: the id of the first selected configuration, the intended base.
void print_table(const std::vector<result>& rs, bool gpu, const std::string& first) {
  const auto& b = rs.front();
  std::printf("\n%-18s %8s %6s %10s %10s %8s %9s %8s %8s %8s %8s %7s\n", "config", "steps/s", "speed", "states MiB",
              "host MiB", "B/param", "B/param", "final", "mean", "eval", "eval", "skipped");
  std::printf("%-18s %8s %6s %10s %10s %8s %9s %8s %8s %8s %8s %7s\n", "", "(median)", "", "measured", "(offload)",
              "measured", "predicted", "train", "train", "loss", "vs base", "steps");
  for (const auto& r : rs) {
    std::printf("%-18s %8.1f %5.2fx %10.3f %10.3f %8.2f %9.2f %8.4f %8.4f %8.4f %+8.4f %7llu\n", r.spec.id().c_str(),
                r.steps_per_s, 1.0 / (1.0 + median(step_time_changes(r, b))), (r.device_bytes + r.host_bytes) / 1048576.0,
                r.host_bytes / 1048576.0, r.measured_bpp(), r.predicted.total(), r.final_loss, r.mean_loss,
                r.eval_loss, r.eval_loss - b.eval_loss, static_cast<unsigned long long>(r.skipped));
  }
  if (gpu) {
    std::printf("\n%-18s %12s %12s %10s\n", "config", "peak MiB", "torch peak", "peak");
    std::printf("%-18s %12s %12s %10s\n", "", "(device)", "MiB", "vs base");
    for (const auto& r : rs) {
      std::printf("%-18s %12.1f %12.1f %+9.1f%%\n", r.spec.id().c_str(), r.peak_device_bytes / 1048576.0,
                  r.torch_peak_bytes / 1048576.0,
                  100.0 * (static_cast<double>(r.peak_device_bytes) / static_cast<double>(b.peak_device_bytes) - 1.0));
    }
    std::printf("peak (device): LibTorch's caching-allocator peak + the device bytes mpzero's core holds\n"
                "(model states and buckets, allocated outside LibTorch's allocator).\n");
  }
  std::printf("\nbase = %s. steps/s: 1 / median step time (steps 2..N), with --rounds the median over the\n"
              "rounds; speed relative to base (with --rounds, from the median of the rounds' paired ratios).\n"
              "B/param: bytes of model states (parameters, gradients, master weights, optimizer states) per\n"
              "trainable parameter on this rank, device + host (states MiB includes the offloaded host part);\n"
              "'predicted' is mpzero::bytes_per_param for the engine's dtypes. final train: mean of the last 10\n"
              "steps' losses; losses in nats per byte; eval: held-out fortunes.\n",
              b.spec.id().c_str());
  if (b.spec.id() != first) {
    std::printf("(the first selected configuration, %s, did not finish: %s is the base instead)\n", first.c_str(),
                b.spec.id().c_str());
  }
}

// The DeepSpeed blog's comparison and its targets (docs/perf.md, "Summary"), for whichever
// of its rows ran:
// each all-bf16 configuration against the blog's baseline at the same stage ("fp32
// master", i.e. bf16/zN: bf16 model, fp32 master weights and states). Memory is the
// peak device memory on a GPU and the model states' bytes on the CPU. Targets: >= 45%
// less memory at <= 3% more step time; with stochastic rounding, held-out loss within
// 0.5% of the fp32 run (fp32/z0) after 1000 steps.
json blog_comparison(const std::vector<result>& rs, bool gpu, int steps) {
  auto find = [&](const std::string& id) -> const result* {
    for (const auto& r : rs)
      if (r.spec.id() == id) return &r;
    return nullptr;
  };
  auto memory = [&](const result& r) {
    return static_cast<double>(gpu ? r.peak_device_bytes : r.device_bytes + r.host_bytes);
  };
  const result* fp32 = find("fp32/z0");
  json out = json::array();
  for (int stage = 0; stage <= 3; ++stage) {
    const std::string z = "/z" + std::to_string(stage);
    const result* base = find("bf16" + z);
    if (!base) continue;
    for (const char* p : {"bf16-all-ac", "bf16-all-sr-ac", "bf16-all", "bf16-all-sr"}) {
      const result* r = find(p + z);
      if (!r) continue;
      const std::vector<double> times = step_time_changes(*r, *base);
      json e = {{"id", r->spec.id()},
                {"baseline", base->spec.id()},
                {"memory_change", memory(*r) / memory(*base) - 1.0},
                {"step_time_change", median(times)},
                {"step_time_change_rounds", times},
                {"eval_change_vs_baseline", r->eval_loss / base->eval_loss - 1.0}};
      e["memory_target_met"] = e["memory_change"].get<double>() <= -0.45;
      e["step_time_target_met"] = e["step_time_change"].get<double>() <= 0.03;
      if (r->spec.precision.find("-sr") != std::string::npos && fp32) {
        e["eval_change_vs_fp32"] = r->eval_loss / fp32->eval_loss - 1.0;
        e["eval_target_met"] = e["eval_change_vs_fp32"].get<double>() <= 0.005;
        e["eval_target_steps"] = steps;  // the target is stated for 1000
      }
      out.push_back(e);
    }
  }
  return out;
}

void print_blog_comparison(const json& cmp, bool gpu) {
  if (cmp.empty()) return;
  auto met = [](bool b) { return b ? "met" : "NOT met"; };
  std::printf("\nThe DeepSpeed blog's comparison (targets: %s <= -45%%, step time <= +3%%; with stochastic\n"
              "rounding, held-out loss within +0.5%% of fp32/z0 after 1000 steps):\n",
              gpu ? "peak device memory" : "model-state memory");
  for (const auto& e : cmp) {
    std::printf("  %-18s vs %-8s memory %+6.1f%% (%s), step time %+6.1f%% (%s), eval %+.2f%%", e["id"].get<std::string>().c_str(),
                e["baseline"].get<std::string>().c_str(), 100 * e["memory_change"].get<double>(),
                met(e["memory_target_met"]), 100 * e["step_time_change"].get<double>(), met(e["step_time_target_met"]),
                100 * e["eval_change_vs_baseline"].get<double>());
    if (e.contains("eval_change_vs_fp32")) {
      const int steps = e["eval_target_steps"];
      std::printf("; vs fp32/z0 %+.2f%% (%s%s)", 100 * e["eval_change_vs_fp32"].get<double>(), met(e["eval_target_met"]),
                  steps == 1000 ? "" : (", at " + std::to_string(steps) + " steps").c_str());
    }
    std::printf("\n");
  }
  if (!gpu) {
    std::printf("  (on the CPU memory is the model states' bytes; a GPU's peak adds activations, the same\n"
                "  in both, so its change is smaller: the blog measured -40%%)\n");
  }
}

// Writes `text` to `path` through a temporary file and a rename, so that a run stopped
// midway (a time limit) leaves the previous complete file, never a truncated one.
void write_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    if (!f.flush()) throw std::runtime_error("cannot write " + tmp.string() + ": check --out and the free space");
  }
  fs::rename(tmp, path);
}

// results.json and summary.csv for the configurations done so far (called after each
// one, so a run that is stopped keeps what it finished; meta.configs_done says how far
// it got out of meta.configs_total).
void write_outputs(const std::vector<result>& rs, const std::vector<std::pair<std::string, std::string>>& refused,
                   const json& blog, const options& o, const corpus& data, int world, const std::string& device,
                   std::size_t total) {
  fs::create_directories(o.out);
  json runs = json::array();
  for (const auto& r : rs) {
    runs.push_back({{"id", r.spec.id()},
                    {"precision", r.spec.precision},
                    {"stage", r.spec.stage},
                    {"offload", r.spec.offload},
                    {"describe", r.describe},
                    {"autocast", r.autocast},
                    {"steps_per_s", r.steps_per_s},
                    {"steps_per_s_mean", r.steps_per_s_mean},
                    {"steps_per_s_rounds", r.round_steps_per_s},
                    {"model_numel", r.numel},
                    {"padding_numel", r.padding},
                    {"measured_device_bytes", r.device_bytes},
                    {"measured_host_bytes", r.host_bytes},
                    {"torch_peak_bytes", r.torch_peak_bytes},
                    {"peak_device_bytes", r.peak_device_bytes},
                    {"bucket_bytes", r.bucket_bytes},
                    {"measured_bytes_per_param", r.measured_bpp()},
                    {"predicted_device_bytes_per_param", r.predicted.device_bytes},
                    {"predicted_host_bytes_per_param", r.predicted.host_bytes},
                    {"predicted_bytes_per_param", r.predicted.total()},
                    {"final_train_loss", r.final_loss},
                    {"mean_train_loss", r.mean_loss},
                    {"eval_loss", r.eval_loss},
                    {"skipped_steps", r.skipped},
                    {"skipped_at", r.skipped_at},
                    {"final_loss_scale", r.loss_scale},
                    {"checkpoint", r.checkpoint.empty() ? json(nullptr) : json(r.checkpoint)},
                    {"save_seconds", r.checkpoint.empty() ? json(nullptr) : json(r.save_s)},
                    {"export_eval_loss", std::isnan(r.export_eval_loss) ? json(nullptr) : json(r.export_eval_loss)},
                    {"train_loss", r.losses}});
  }
  json meta = {{"steps", o.steps},   {"layers", o.layers},         {"dim", o.dim},
               {"heads", o.heads},   {"seq", o.seq},               {"batch", o.batch},
               {"lr", o.lr},         {"seed", o.seed},             {"world_size", world},
               {"lr_schedule", lr_schedule_json(o)},
               {"reduce_bucket_size", o.bucket},                   {"rounds", o.rounds},
               {"threads", torch::get_num_threads()},              {"corpus", o.corpus},
               {"train_bytes", data.train.size()},                 {"eval_bytes", data.eval.size()},
               {"fortunes", data.fortunes},                        {"device", device},
               {"configs_done", rs.size() + refused.size()},       {"configs_total", total}};
  if (device.starts_with("cpu")) {
    json& cm = meta["cpu_matmul"] = {{"mode", o.cpu_matmul}};
    for (int h = 0; h < n_half_dtypes; ++h) {
      const std::string name = half_dtypes[h].name;
      for (int op = 0; op < n_cpu_ops; ++op) {
        const cpu_choice& c = g_cpu_products[op][h];
        cm[name][cpu_op_names[op]] = c.upcast ? "fp32" : "native";
        cm[name + "_vs_fp32"][cpu_op_names[op]] = std::isnan(c.ratio) ? json(nullptr) : json(c.ratio);
      }
    }
  }
  json not_run = json::array();
  for (const auto& [id, msg] : refused) not_run.push_back({{"id", id}, {"reason", msg}});
  write_atomically(fs::path(o.out) / "results.json",
                   json{{"meta", meta}, {"runs", runs}, {"not_run", not_run}, {"blog_comparison", blog}}.dump(1) + "\n");

  std::ostringstream csv;
  csv << "id,precision,stage,offload,steps_per_s,model_numel,measured_device_bytes,measured_host_bytes,"
         "measured_bytes_per_param,predicted_bytes_per_param,final_train_loss,mean_train_loss,eval_loss,"
         "skipped_steps,peak_device_bytes,describe\n";
  for (const auto& r : rs) {
    csv << r.spec.id() << "," << r.spec.precision << "," << r.spec.stage << "," << (r.spec.offload ? 1 : 0) << ","
        << fmt("%.3f", r.steps_per_s) << "," << r.numel << "," << r.device_bytes << "," << r.host_bytes << ","
        << fmt("%.4f", r.measured_bpp()) << "," << fmt("%.4f", r.predicted.total()) << ","
        << fmt("%.5f", r.final_loss) << "," << fmt("%.5f", r.mean_loss) << "," << fmt("%.5f", r.eval_loss) << ","
        << r.skipped << "," << r.peak_device_bytes << ",\"" << r.describe << "\"\n";
  }
  write_atomically(fs::path(o.out) / "summary.csv", csv.str());
}

// Creates `dir` and writes a file into it, or throws naming the flag: a wrong --out or
// --save must not surface only after the first configuration has trained.
void check_writable(const std::string& flag, const fs::path& dir, int rank) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::string reason = ec ? ec.message() : std::string();
  if (!ec) {
    const fs::path probe = dir / (".train_gpt_write_test." + std::to_string(rank));
    {
      std::ofstream f(probe, std::ios::trunc);
      if (!(f << "x" && f.flush())) reason = std::error_code(errno, std::generic_category()).message();
    }
    fs::remove(probe, ec);
  }
  if (!reason.empty()) {
    throw std::invalid_argument(flag + " " + dir.string() + ": cannot write there (" + reason +
                                "); pass a directory this user can create and write");
  }
}

// Seconds of one forward and backward of an op of kind `op` (the MLP's first Linear
// layer; the causal attention), its inputs in half_dtypes[h], through the model's own code
// (linear, causal_attention) with the 16-bit path `upcast` chooses: the best of three
// after a warm-up. At the model's shapes, but no smaller than the default model's (a
// smaller op times LibTorch's overheads, not its kernels, and its ratio lands near any
// threshold, so that runs of one recipe could choose differently) and with at most 2048
// rows (a bigger op only takes longer to time).
double op_seconds(cpu_op op, int h, bool upcast, const options& o) {
  const c10::ScalarType t = half_dtypes[h].type;
  const bool saved = g_cpu_products[op][h].upcast;
  g_cpu_products[op][h].upcast = upcast;
  const options d;
  const int heads = o.heads, dim = std::max(o.dim, d.dim / d.heads * heads), seq = std::max(o.seq, d.seq);
  const std::int64_t rows = std::clamp<std::int64_t>(std::int64_t{o.batch} * o.seq, std::int64_t{d.batch} * d.seq, 2048);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  // The inputs draw nothing; the Linear's initial weights do, but fresh_model seeds before
  // every model, so the run's weights do not depend on the probe (fp32 rows are the same
  // bits with every --cpu-matmul, which the smoke test checks).
  auto values = [&](std::int64_t n) { return torch::linspace(-1.0, 1.0, n, f32); };
  torch::nn::Linear fc{nullptr};
  torch::Tensor x, q, k, v;
  {
    torch::NoGradGuard ng;
    if (op == op_products) {
      fc = torch::nn::Linear(dim, 4 * dim);
      fc->to(t);
      x = values(rows * dim).view({rows, dim}).to(t).requires_grad_();
    } else {
      const std::int64_t b = std::max<std::int64_t>(rows / seq, 1), hd = dim / heads;
      q = values(b * heads * seq * hd).view({b, heads, seq, hd}).to(t).requires_grad_();
      k = q.detach().flip(-1).requires_grad_();
      v = q.detach().flip(-2).requires_grad_();
    }
  }
  auto once = [&] {
    const torch::Tensor y = op == op_products ? linear(fc, x) : causal_attention(q, k, v);
    y.to(torch::kFloat).sum().backward();
  };
  once();
  double best = INFINITY;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    once();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  g_cpu_products[op][h].upcast = saved;
  return best;
}

// --cpu-matmul on a CPU: sets g_cpu_products. auto measures, per 16-bit dtype and kind of
// op, LibTorch's 16-bit kernels against the fp32 path and takes the fp32 path where the
// kernels are more than twice as slow; every rank uses the mean ratios over the ranks,
// so that all decide alike (the ratios seen on two CPUs: docs/perf.md, "16-bit products
// on the CPU").
void choose_cpu_products(const options& o, mt::any_communicator comm) {
  if (o.cpu_matmul != "auto") {
    for (auto& row : g_cpu_products)
      for (cpu_choice& c : row) c.upcast = o.cpu_matmul == "fp32";
    return;
  }
  std::vector<float> local, sum(n_cpu_ops * n_half_dtypes);
  for (int op = 0; op < n_cpu_ops; ++op)
    for (int h = 0; h < n_half_dtypes; ++h) {
      const auto kind = static_cast<cpu_op>(op);
      local.push_back(static_cast<float>(op_seconds(kind, h, false, o) / op_seconds(kind, h, true, o)));
    }
  comm.all_reduce(local.data(), sum.data(), local.size(), mpzero::comm::reduce_op::sum);
  constexpr double slower = 2.0;  // the 16-bit kernels' time over the fp32 path's
  for (int op = 0; op < n_cpu_ops; ++op)
    for (int h = 0; h < n_half_dtypes; ++h) {
      cpu_choice& c = g_cpu_products[op][h];
      c.ratio = sum[op * n_half_dtypes + h] / comm.size();
      c.upcast = c.ratio > slower;
    }
}

int run(int argc, char** argv, mt::any_communicator comm) {
  const options o = parse_args(argc, argv);
  if (comm.rank() == 0) check_writable("--out", o.out, 0);
  if (!o.save.empty()) check_writable("--save", o.save, comm.rank());  // every rank writes its shard there
  const auto specs = select_specs(o.configs);
  const corpus data = load_corpus(o.corpus);
  if (static_cast<std::size_t>(o.seq) + 2 >= data.eval.size())
    throw std::invalid_argument("--seq " + std::to_string(o.seq) + " is longer than the held-out text (" +
                                std::to_string(data.eval.size()) + " bytes); use a shorter --seq or a larger corpus");
  const torch::Device device = resolve_device(o.device);
  if (device.is_cuda() && comm.size() > 1) {
    // The engine would need a communicator that reads device memory (NCCL): not set up here.
    throw std::invalid_argument("data parallel training on GPUs is not set up in train_gpt (it would need NCCL); run "
                                "one process, or --device cpu under mpirun");
  }
  if (device.is_cpu()) choose_cpu_products(o, comm);
  const bool root = comm.rank() == 0;
  if (root) {
    std::printf("device: %s\n", device.str().c_str());
    if (device.is_cpu()) {
      // e.g. "bf16 products in LibTorch's 16-bit kernels (0.60x), attention in fp32 from 16-bit values (5.93x)"
      auto said = [&](int h) {
        std::string s = half_dtypes[h].name;
        for (int op = 0; op < n_cpu_ops; ++op) {
          const cpu_choice& c = g_cpu_products[op][h];
          s += std::string(op == 0 ? " " : ", ") + cpu_op_names[op] +
               (c.upcast ? " in fp32 from 16-bit values" : " in LibTorch's 16-bit kernels");
          if (!std::isnan(c.ratio)) s += fmt(" (%.2fx)", c.ratio);
        }
        return s;
      };
      const bool measured = !std::isnan(g_cpu_products[0][0].ratio);
      std::printf("16-bit products (--cpu-matmul %s%s): %s; %s\n", o.cpu_matmul.c_str(),
                  measured ? "; in parentheses LibTorch's 16-bit kernels' time over the fp32 path's, measured here" : "",
                  said(0).c_str(), said(1).c_str());
    }
    // The schedule as the engine is given it (lr_schedule_json), not restated here.
    std::string rate = ", constant";
    if (const json sched = lr_schedule_json(o); !sched.is_null()) {
      const json& sp = sched["params"];
      rate = ", cosine schedule (" + sched["type"].get<std::string>() + ": " + sp["warmup_type"].get<std::string>() +
             " warmup over " + std::to_string(sp["warmup_num_steps"].get<int>()) + " steps, then down to " +
             fmt("%g", 100 * sp["cos_min_ratio"].get<double>()) + "% at step " +
             std::to_string(sp["total_num_steps"].get<int>()) + ")";
    }
    std::printf("GPT: %d layers, dim %d, %d heads, seq %d, batch %d x %d rank(s), %d steps, AdamW lr %g%s\n", o.layers,
                o.dim, o.heads, o.seq, o.batch, comm.size(), o.steps, o.lr, rate.c_str());
    std::printf("corpus: %zu fortunes from %zu files in %s: %zu training bytes, %zu held-out bytes\n", data.fortunes,
                data.files, o.corpus.c_str(), data.train.size(), data.eval.size());
    std::printf("%zu configurations, %d torch threads\n", specs.size(), torch::get_num_threads());
    std::fflush(stdout);  // before the progress lines on stderr
  }
  std::vector<result> rs;
  std::vector<std::pair<std::string, std::string>> refused;  // (id, the engine's message)
  const int total = static_cast<int>(specs.size()) * o.rounds;  // trainings, for the progress line
  for (std::size_t i = 0; i < specs.size(); ++i) {
    no_result why;
    auto r = train_one(specs[i], o, data, comm, device, static_cast<int>(i), total, why);
    if (r) {
      rs.push_back(std::move(*r));
    } else {
      std::string first_line = why.reason.substr(0, why.reason.find('\n'));
      const std::string tail = " Compiled:";  // the list of compiled combinations follows; leave it out
      if (first_line.size() > tail.size() && first_line.ends_with(tail)) first_line.resize(first_line.size() - tail.size());
      refused.emplace_back(specs[i].id(), first_line);
      if (root) {  // a stopped run's progress line is still open
        std::fprintf(stderr, "%s[%zu/%d] %-18s %s: %s\n", why.stopped ? "\n" : "", i + 1, total,
                     specs[i].id().c_str(), why.stopped ? "not finished" : "skipped", first_line.c_str());
      }
    }
    // After every configuration, so that a stopped run keeps what it finished.
    if (root && !rs.empty()) {
      write_outputs(rs, refused, blog_comparison(rs, device.is_cuda(), o.steps), o, data, comm.size(), device.str(),
                    specs.size());
    }
  }
  if (rs.empty()) throw std::runtime_error("no selected configuration finished (see above)");
  // --rounds: the configurations that finished, again, timed only (same seed, same batches;
  // not saved), round by round; a training that stops this time counts as NaN in its round.
  options again = o;
  again.save.clear();
  for (int k = 1; k < o.rounds; ++k) {
    for (result& r : rs) {
      const auto at = std::find_if(specs.begin(), specs.end(), [&](const run_spec& s) { return s.id() == r.spec.id(); });
      const int index = k * static_cast<int>(specs.size()) + static_cast<int>(at - specs.begin());
      no_result why;
      const auto t = train_one(r.spec, again, data, comm, device, index, total, why);
      r.round_steps_per_s.push_back(t ? t->steps_per_s : std::nan(""));
      if (!t && root) {
        std::fprintf(stderr, "%s[%d/%d] %-18s round %d not timed: %s\n", why.stopped ? "\n" : "", index + 1, total,
                     r.spec.id().c_str(), k + 1, why.reason.substr(0, why.reason.find('\n')).c_str());
      }
    }
    for (result& r : rs) r.steps_per_s = median(r.round_steps_per_s);
    if (root) {
      write_outputs(rs, refused, blog_comparison(rs, device.is_cuda(), o.steps), o, data, comm.size(), device.str(),
                    specs.size());
    }
  }
  if (root) {
    print_table(rs, device.is_cuda(), specs.front().id());
    const json blog = blog_comparison(rs, device.is_cuda(), o.steps);
    print_blog_comparison(blog, device.is_cuda());
    if (!refused.empty()) {
      std::printf("\nnot run (the engine refused them) or not finished:\n");
      for (const auto& [id, msg] : refused) std::printf("  %-18s %s\n", id.c_str(), msg.c_str());
    }
    std::printf("wrote %s and %s\n", (fs::path(o.out) / "summary.csv").c_str(), (fs::path(o.out) / "results.json").c_str());
  }
  // Each rank's peak resident memory over the whole run (building the model, initialize,
  // training, evaluation): what a rank must have, measured by the kernel.
  std::vector<float> rss(static_cast<std::size_t>(comm.size()), 0.0f), all(rss.size());
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  rss[static_cast<std::size_t>(comm.rank())] = static_cast<float>(usage.ru_maxrss) / 1024.0f;  // KiB -> MiB
  comm.all_reduce(rss.data(), all.data(), all.size(), mpzero::comm::reduce_op::sum);
  if (root) {
    std::printf("peak resident memory per rank (the whole run):");
    for (std::size_t k = 0; k < all.size(); ++k) std::printf(" %s%.2f GiB", k == 0 ? "" : "| ", all[k] / 1024.0);
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
#ifdef MPZERO_GPT_MPI
    // MPI only under a launcher (mpirun sets these); a plain run is world size 1 without it.
    if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK")) {
      MPI_Init(&argc, &argv);
      int rc = 0;
      try {
        mpzero::comm::mpi_communicator world(MPI_COMM_WORLD);
        rc = run(argc, argv, mt::any_communicator::wrap(world));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "\ntrain_gpt: %s\n", e.what());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      MPI_Finalize();
      return rc;
    }
#endif
    return run(argc, argv, mt::any_communicator{});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\ntrain_gpt: %s\n", e.what());
    return 1;
  }
}
