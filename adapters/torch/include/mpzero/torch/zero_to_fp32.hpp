// mpzero::torch: an engine checkpoint as one fp32 state dict, for inference, export or
// fine-tuning elsewhere (DeepSpeed's zero_to_fp32). One process, no engine, no model,
// no communicator: it reads what engine.save_checkpoint wrote at any world size, ZeRO
// stage and precision configuration.
//
//   auto sd = mpzero::torch::fp32_state_dict_from_checkpoint("ckpt");        // tag from ckpt/latest
//   for (const auto& item : sd) ...                                   // item.key(), item.value()
//   mpzero::torch::save_state_dict(sd, "model.safetensors");  // or in one call:
//   mpzero::torch::convert_checkpoint_to_fp32_state_dict("ckpt", "model.safetensors");
//
// The command-line tool `mpzero_zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [--tag TAG]` does
// the same (docs/checkpoints.md).
#pragma once

#include <cstddef>
#include <string>

#include <torch/torch.h>

namespace mpzero::torch {

// The module's state dict as saved in <checkpoint_dir>/<tag> (tag: the one named in
// <checkpoint_dir>/latest when empty), by name in the module's order (parameters, then
// buffers). The trainable parameters are the master weights in fp32 (the fp32 master
// where the precision configuration kept one, else the parameters, which were then the
// master); every name of a tied weight gets that same tensor. Frozen parameters and
// buffers are their saved values, bf16 and fp16 ones converted (exactly) to fp32; others
// keep their dtype. Tensors are on the CPU. Host memory: about 4 bytes per parameter,
// plus model_states.pt's tensors while it is read.
// Throws mpzero::invalid_argument naming the file and the fix for a missing tag, a
// missing, truncated or corrupt file, or files of different saves.
::torch::OrderedDict<std::string, ::torch::Tensor> fp32_state_dict_from_checkpoint(const std::string& checkpoint_dir,
                                                                                   const std::string& tag = "");

// Writes a state dict (tensors on any device) to output_file: in the safetensors format
// when the name ends in ".safetensors" (safetensors.torch.load_file, Hugging Face), else
// in the format torch.save writes (torch::pickle_load in C++; in Python a plain
// torch.load(file, weights_only=True): the dictionary carries no TorchScript type tag).
// Both stream the tensors to the file one at a time, without a serialized copy in memory
// (a CUDA tensor goes through one host copy at a time; the .pt file records its device,
// as torch.save does, and safetensors has none). The file is written beside its
// name and renamed into place: whole or absent. Returns the number of tensors written.
std::size_t save_state_dict(const ::torch::OrderedDict<std::string, ::torch::Tensor>& state_dict,
                            const std::string& output_file);

// save_state_dict(fp32_state_dict_from_checkpoint(checkpoint_dir, tag), output_file).
std::size_t convert_checkpoint_to_fp32_state_dict(const std::string& checkpoint_dir, const std::string& output_file,
                                                  const std::string& tag = "");

}  // namespace mpzero::torch
