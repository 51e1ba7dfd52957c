#pragma once

namespace mixprec::amp {

/// torch.set_flush_denormal(mode) for the calling thread and for every thread of LibTorch's
/// intra-op (OpenMP) pool. On, the CPU treats subnormal floats (fp32 below ~1.2e-38) as 0 in and
/// out of its SSE/AVX operations (FTZ and DAZ). LibTorch's own call sets the calling thread
/// only, and threads copy the mode from the thread that starts them, so the pool, once running,
/// would keep the old mode. (In a mixprec built without OpenMP, with clang for instance, it
/// sets the calling thread and the threads started after it only.) Returns false, and changes
/// nothing, where the CPU has no such mode.
///
/// Why: AdamW's first moment decays by beta1 each step where a gradient is exactly 0 (a dead
/// ReLU unit, an embedding row no batch uses) and is subnormal after some 20 such steps from
/// 1e-37, 800 from 1e-3; each operation on it then takes the CPU's slow path. On the digits MLP
/// this costs LibTorch's fused AdamW, PyTorch's loop and mixprec's alike, 30-57% of the steps/s
/// from step ~1000 on (docs/speed.md). What it changes: subnormal results are 0 (such moments
/// reach 0 some 150 steps earlier; their updates were far below any parameter's last bit). Off by
/// default, as in PyTorch.
bool set_flush_denormal(bool on);

}  // namespace mixprec::amp
