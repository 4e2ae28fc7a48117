// ZeRO-3: being told, before an operation runs, that it reads a partitioned parameter.
// LibTorch C++ modules have no forward hooks, so a parameter used outside every
// gathered_forward unit is found where every operation passes: the dispatcher's
// observers (at::RecordFunction), which see each operation's inputs before its kernel.
#pragma once

#include <memory>
#include <vector>

namespace c10 {
struct StorageImpl;
}

namespace mpzero::torch::detail {

class use_listener {
 public:
  virtual ~use_listener() = default;
  // Before an operation: the watched storages among its tensor inputs (views included),
  // each once, those that hold data too (an operation that reads several needs them all
  // at once). Runs on the thread of the operation; nothing may throw out of it.
  virtual void before_use(const std::vector<c10::StorageImpl*>& storages) noexcept = 0;
};

// While at least one storage is watched, an observer of every operation on every thread
// looks for inputs whose storage has elements and no data and is watched.
void watch_storage(c10::StorageImpl* s, std::weak_ptr<use_listener> l);
void unwatch_storage(c10::StorageImpl* s);

// While one lives, the operations of this thread are not observed: the engine's own
// (pointing a parameter at a storage, or back at nothing) read no parameter.
class unobserved {
 public:
  unobserved();
  ~unobserved();
  unobserved(const unobserved&) = delete;
  unobserved& operator=(const unobserved&) = delete;

 private:
  bool prev_;
};

}  // namespace mpzero::torch::detail
