#pragma once

namespace mixprec::amp {

/// torch.set_flush_denormal(mode) for the calling thread and its OpenMP pool, LibTorch's
/// intra-op threads (call it from the thread that trains): on, the CPU treats subnormal floats
/// as 0 in and out of its SSE/AVX operations (FTZ and DAZ). LibTorch's own call sets the calling
/// thread only, and a running pool keeps its threads' mode. Returns false, changing nothing,
/// where the CPU has no such mode. Off by default, as in PyTorch.
///
/// Why: AdamW's moments of gradients that stay 0 (dead ReLU units, unused embedding rows) decay
/// into subnormals, where every op takes the CPU's slow path (docs/speed.md).
bool set_flush_denormal(bool on);

}  // namespace mixprec::amp
