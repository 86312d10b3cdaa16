"""The executor: the engine thread's only way to the model.

``EngineCore`` hands each step's ``SchedulerOutput`` to an executor (``apply_schedule``,
then ``run``) and gets the step's ``RunnerOutput`` back; what the front end reads about the model (encoder forwards) comes
through it too. Two executors:
- :class:`InProcessExecutor`: one rank, the runner in this process; a direct call.
- :class:`vlmd.engine.multiproc_executor.MultiprocExecutor`: N tensor-parallel ranks, rank 0
  in this process, ranks 1..N-1 in their own processes (this host or others), each with its
  own runner holding its shard of the weights and of the KV cache.

``failure`` is None while the model can run; once a rank is lost it names the rank and the
cause, every later ``run`` raises :class:`RankFailure`, and the server ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from vlmd.sched.output import RunnerOutput, SchedulerOutput


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung or fell out of step: the model cannot run any more."""


class Executor(Protocol):
    """What ``EngineCore`` calls, mirroring the runner: ``apply_schedule`` once per
    SchedulerOutput, then ``run`` over all its chunks (or, after a failure, subsets of them:
    engine/isolation.py)."""

    failure: str | None

    def apply_schedule(self, out: SchedulerOutput) -> None: ...

    def run(self, out: SchedulerOutput, request_ids: list[str]) -> RunnerOutput: ...

    @property
    def encoder_outputs(self) -> dict: ...  # rank 0's, by identifier (every rank holds the same)

    @property
    def device(self): ...  # rank 0's runner's torch.device, which the engine thread makes current

    @property
    def num_encoder_forwards(self) -> int: ...

    @property
    def num_encoder_calls(self) -> int: ...  # encoder invocations: one per modality per step that encodes

    @property
    def decode_steps(self) -> dict[str, int]: ...  # steps of decodes alone, by path ("fused", "modules")

    def on_failure(self, callback: Callable[[str], None]) -> None: ...

    # Optional (one rank only): the encoder outputs of items, for an encoder-only server.
    # def encode_items(self, items: list[MultiModalItem]) -> list[torch.Tensor]: ...
    # Optional (one rank only): a decoded window's tokens aligned to its audio (word timestamps).
    # def align_tokens(self, item, token_ids, first_row, num_frames) -> np.ndarray: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """One rank: the runner is called directly, on the engine thread."""

    failure: str | None = None

    def __init__(self, runner):
        self.runner = runner
        # The runner's own bound methods: no wrapper frame on the hot path.
        self.apply_schedule = runner.apply_schedule
        self.run = runner.run
        self.encode_items = runner.encode_items
        self.align_tokens = runner.align_tokens

    @property
    def encoder_outputs(self) -> dict:
        return self.runner.encoder_outputs

    @property
    def device(self):
        return self.runner.device

    @property
    def num_encoder_forwards(self) -> int:
        return self.runner.num_encoder_forwards

    @property
    def num_encoder_calls(self) -> int:
        return self.runner.num_encoder_calls

    @property
    def decode_steps(self) -> dict[str, int]:
        return dict(self.runner.attention.decode_steps)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Nothing to lose: one process, whose own errors are the engine's."""

    def shutdown(self) -> None:
        pass
