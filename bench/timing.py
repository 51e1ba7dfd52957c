"""The timed part of every Python benchmark twin, one definition for all of them."""
import time


def time_steps(step, first, steps):
    """Runs step(first), ..., step(first + steps - 1); returns (final loss, seconds).
    Reading the last loss also waits for the last step."""
    start = time.perf_counter()
    for i in range(steps):
        loss = step(first + i)
    final_loss = loss.item()
    return final_loss, time.perf_counter() - start
