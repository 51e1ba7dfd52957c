#include "mixprec/amp/flush_denormal.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#if __has_include(<c10/util/ParallelGuard.h>)
#include <c10/util/ParallelGuard.h>
#endif

namespace mixprec::amp {
namespace {

// In at::parallel_for's body (its serial path too), or in an OpenMP region.
bool in_parallel_region() {
#if __has_include(<c10/util/ParallelGuard.h>)
  if (c10::ParallelGuard::is_enabled()) return true;
#endif
  return at::in_parallel_region();
}

}  // namespace

bool set_flush_denormal(bool on) {
  TORCH_CHECK(!in_parallel_region(),
              "set_flush_denormal: called in a parallel region, where it would reach one thread");
  if (!at::globalContext().setFlushDenormal(on)) return false;
#ifdef _OPENMP
#pragma omp parallel
  {  // each thread of the pool sets its own; threads it starts later copy the caller's
    at::globalContext().setFlushDenormal(on);
  }
#endif
  return true;
}

}  // namespace mixprec::amp
