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


def time_trainer(model, dataset, warmup, steps, **training_args):
    """transformers' Trainer on `dataset`, its steps after `warmup` timed by a callback (its own
    runtime includes its setup and the warm-up); returns (training loss, seconds). The keyword
    arguments say the precision, batch size, optimizer and schedule; logging, saving and the
    progress bar are off, as in the C++ twins (bench/timed_steps.h)."""
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                Clock.start = time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=warmup + steps, logging_strategy="no",
                                 save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                                 **training_args)
        result = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Clock()]).train()
    return result.training_loss, time.perf_counter() - Clock.start
