"""Finding the request(s) that made an engine step raise, by re-running it without suspects.

A step computes many requests' chunks in one batch, so one poisoned input (an encoder that
raises on one image, a shape bug in one family's path) makes the whole step raise. Rather
than failing everyone, the step's chunks are bisected: each half is run on its own; a half
that succeeds has its results kept, a half that raises is split again, and a single chunk
that still raises is a culprit. With one culprit among N chunks this costs about 2·log2(N)
partial re-runs, paid only when a step fails.

Why re-running is sound (see ``ModelRunner.run``): the scheduler's accounting for the step
already holds for every chunk; a partial run rewrites exactly the KV slots the failed run
may have written, with the same values; encoder outputs stored by the failed run are
reused; a request's runner state advances only when a run that includes it succeeds. A
failure that no single chunk reproduces (the batch as a whole was too large) fails nobody:
every half ran. A fault in every chunk (a broken device) fails them all, as before.
"""

from __future__ import annotations

from vlmd.sched.output import RunnerOutput, SchedulerOutput


def find_culprits(runner, out: SchedulerOutput, first_error: BaseException) -> tuple[RunnerOutput, dict]:
    """Run every chunk of ``out`` that can run; returns their merged output and
    ``{request id: the exception its chunk raised alone}`` for the rest."""
    merged = RunnerOutput()
    culprits: dict[str, BaseException] = {}

    def search(group: list[str], error: BaseException) -> None:
        if len(group) == 1:
            culprits[group[0]] = error
            return
        half = len(group) // 2
        for part in (group[:half], group[half:]):
            try:
                result = runner.run(out, part)
            except Exception as exc:  # this half holds a culprit: narrow it down
                search(part, exc)
            else:
                merged.sampled_token_ids.update(result.sampled_token_ids)
                merged.logprobs.update(result.logprobs)
                merged.grammar_completed.update(result.grammar_completed)
                merged.grammar_rejected.update(result.grammar_rejected)
                merged.encoder_seconds += result.encoder_seconds

    search(list(out.num_scheduled_tokens), first_error)
    return merged, culprits
