// The views of mpzero's plans (spans into their storage) are deleted on temporaries: a
// range-for over a temporary plan's buckets would read freed memory (a fault
// AddressSanitizer finds). Compiled twice: as is, where every view
// is taken from a variable, it must compile; with MPZERO_VIEW_OF_TEMPORARY it must fail
// to, naming the deleted accessor.
#include <mpzero/multi_tensor/plan.hpp>
#include <mpzero/partition/bucket_plan.hpp>
#include <mpzero/partition/flat_layout.hpp>

#include <cstdint>
#include <vector>

std::uint64_t total() {
  const std::vector<std::uint64_t> numels = {3, 5, 7};
  std::uint64_t sum = 0;
#ifdef MPZERO_VIEW_OF_TEMPORARY
  for (const mpzero::bucket& b : mpzero::bucket_plan(mpzero::flat_layout(numels, 2), 4).buckets())
    sum += b.range.size();
#else
  const mpzero::bucket_plan buckets(mpzero::flat_layout(numels, 2), 4);
  for (const mpzero::bucket& b : buckets.buckets()) sum += b.range.size();
  const mpzero::multi_tensor_plan chunks(numels);
  for (const mpzero::chunk& c : chunks.chunks()) sum += c.size;
#endif
  return sum;
}
