#include "mixprec/amp/flush_denormal.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

namespace mixprec::amp {

bool set_flush_denormal(bool on) {
  if (!at::globalContext().setFlushDenormal(on)) return false;
  // One index per thread with a grain of 1: each thread of the pool runs one and sets its own
  // mode (the calling thread is one of them, and was set above in any case).
  at::parallel_for(0, at::get_num_threads(), 1,
                   [on](int64_t, int64_t) { at::globalContext().setFlushDenormal(on); });
  return true;
}

}  // namespace mixprec::amp
