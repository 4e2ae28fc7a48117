// mpzero_zero_to_fp32: an engine checkpoint as one fp32 state dict file (DeepSpeed's
// zero_to_fp32.py). docs/checkpoints.md, "One fp32 file".
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include <mpzero/torch/zero_to_fp32.hpp>

namespace {

void usage(std::FILE* to) {
  std::fprintf(to,
               "usage: mpzero_zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [--tag TAG]\n"
               "  Reads the checkpoint engine.save_checkpoint wrote in CHECKPOINT_DIR/TAG (TAG: the one\n"
               "  CHECKPOINT_DIR/latest names, by default), at any world size, ZeRO stage and precision,\n"
               "  and writes the module's state dict with every floating tensor in fp32 (the trainable\n"
               "  parameters from the master weights) to OUTPUT_FILE:\n"
               "    *.safetensors  the safetensors format (safetensors.torch.load_file, Hugging Face)\n"
               "    anything else  the format torch.save writes (Python: torch.load(OUTPUT_FILE,\n"
               "                   weights_only=True); C++: torch::pickle_load)\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, out, tag;
  int positional = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (a == "--tag") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mpzero_zero_to_fp32: --tag needs a value, e.g. --tag global_step1000\n");
        usage(stderr);
        return 2;
      }
      tag = argv[++i];
    } else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "mpzero_zero_to_fp32: unknown option %s\n", a.c_str());
      usage(stderr);
      return 2;
    } else if (positional == 0) {
      dir = a, ++positional;
    } else if (positional == 1) {
      out = a, ++positional;
    } else {
      std::fprintf(stderr, "mpzero_zero_to_fp32: one checkpoint directory and one output file, not '%s' too\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  if (positional != 2) {
    usage(stderr);
    return 2;
  }
  try {
    const std::size_t n = mpzero::torch::convert_checkpoint_to_fp32_state_dict(dir, out, tag);
    std::printf("mpzero_zero_to_fp32: wrote %zu tensors to %s\n", n, out.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpzero_zero_to_fp32: %s\n", e.what());
    return 1;
  }
  return 0;
}
