// A communicator whose collectives must never run: the engine's refusals of a
// communicator (the wrong memory space, too many host ranks) are tested with it. Each
// call throws std::logic_error("called").
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include <mpzero/comm/any.hpp>

namespace mpzero::testing {

class unused_communicator final : public comm::communicator_base {
 public:
  unused_communicator(std::string name, int size, bool reads_device)
      : name_(std::move(name)), size_(size), device_(reads_device) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  std::unique_ptr<comm::request_base> iall_reduce(const void*, void*, std::uint64_t, comm::wire_dtype,
                                                  comm::reduce_op) override {
    called();
  }
  std::unique_ptr<comm::request_base> ireduce_scatter_v(const void*, void*, std::span<const std::uint64_t>,
                                                        comm::wire_dtype, comm::reduce_op) override {
    called();
  }
  std::unique_ptr<comm::request_base> iall_gather_v(const void*, std::uint64_t, void*, std::span<const std::uint64_t>,
                                                    comm::wire_dtype) override {
    called();
  }
  std::unique_ptr<comm::request_base> ibroadcast(void*, std::uint64_t, comm::wire_dtype, int) override { called(); }
  void barrier() override { called(); }
  bool reads_device_memory() const override { return device_; }

 private:
  [[noreturn]] static void called() { throw std::logic_error("called"); }
  std::string name_;
  int size_;
  bool device_;
};

}  // namespace mpzero::testing
