// The observer of param_use.hpp. RecordFunction::inputs() asserts, in a unit built
// without NDEBUG, a flag that LibTorch's release build never sets: this unit is always
// built with NDEBUG, and includes nothing else of torch's that an assert would change.
#ifndef NDEBUG
#define NDEBUG
#endif
#include "param_use.hpp"

#include <ATen/record_function.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace mpzero::torch::detail {
namespace {

struct registry {
  std::mutex m;
  std::unordered_map<c10::StorageImpl*, std::weak_ptr<use_listener>> watched;
  std::optional<at::CallbackHandle> handle;
};

registry& reg() {
  static registry r;
  return r;
}

thread_local bool inside = false;  // a listener's own operations are not observed

template <class F>
void for_each_tensor(const at::RecordFunction& fn, F&& f) {
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) f(t);
    } else if (v.isList()) {  // Tensor?[] (index, cat of optionals)
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor()) f(e.toTensor());
    }
  }
}

// A storage with elements and no data: a watched parameter not gathered, or nothing of ours.
c10::StorageImpl* empty_storage(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->numel() == 0) return nullptr;
  c10::StorageImpl* s = impl->unsafe_storage().unsafeGetStorageImpl();
  return s->data() == nullptr ? s : nullptr;
}

std::unique_ptr<at::ObserverContext> on_operation(const at::RecordFunction& fn) {
  if (inside) return nullptr;
  bool any = false;
  for_each_tensor(fn, [&](const at::Tensor& t) { any = any || empty_storage(t) != nullptr; });
  if (!any) return nullptr;
  const unobserved own;
  std::vector<std::pair<std::shared_ptr<use_listener>, std::vector<c10::StorageImpl*>>> calls;
  {
    registry& r = reg();
    std::lock_guard lock(r.m);
    for_each_tensor(fn, [&](const at::Tensor& t) {
      if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return;
      c10::StorageImpl* s = t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
      auto it = r.watched.find(s);
      if (it == r.watched.end()) return;
      auto l = it->second.lock();
      if (!l) return;
      auto c = std::find_if(calls.begin(), calls.end(), [&](const auto& x) { return x.first == l; });
      if (c == calls.end()) c = calls.insert(calls.end(), {l, {}});
      if (std::find(c->second.begin(), c->second.end(), s) == c->second.end()) c->second.push_back(s);
    });
  }
  for (auto& [l, storages] : calls) l->before_use(storages);
  return nullptr;
}

}  // namespace

unobserved::unobserved() : prev_(inside) { inside = true; }
unobserved::~unobserved() { inside = prev_; }

void watch_storage(c10::StorageImpl* s, std::weak_ptr<use_listener> l) {
  registry& r = reg();
  std::lock_guard lock(r.m);
  r.watched[s] = std::move(l);
  if (!r.handle) {
    r.handle = at::addGlobalCallback(
        at::RecordFunctionCallback(on_operation).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
}

void unwatch_storage(c10::StorageImpl* s) {
  registry& r = reg();
  std::lock_guard lock(r.m);
  r.watched.erase(s);
  if (r.watched.empty() && r.handle) {
    at::removeCallback(*r.handle);
    r.handle.reset();
  }
}

}  // namespace mpzero::torch::detail
