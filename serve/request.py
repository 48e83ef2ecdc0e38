"""A generation request as the engine sees it, and the events it sends back to the HTTP handler.

The engine thread writes; the handler's asyncio loop reads. Events cross threads through
`loop.call_soon_threadsafe`, so the handler simply awaits an asyncio.Queue."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    presence: float = 0.0  # penalties (spec.sampling.penalize): 0, 0 and 1 are off
    frequency: float = 0.0
    repetition: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n: each token's log-probability and its n likeliest alternatives


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token under the target's distribution: its id and log-probability, and the
    likeliest alternatives as (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class Delta:
    text: str
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # the tokens this event adds, when the request asked


@dataclasses.dataclass
class Finished:
    reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass
class Failed:
    message: str


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to generate. A request of n choices is a group: choice 0 carries the others in
    `copies` (same prompt, sampling that differs in seed only) and is the one submitted and
    queued; its prompt is prefilled once and its slot state copied to theirs. The choices of a
    group share one events queue, whose items are (choice, event)."""

    prompt_ids: list[int]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop | None = None  # None: no listener (the engine's own warm-up, tests)
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    events: asyncio.Queue | None = None  # items (choice, event)
    choice: int = 0  # this sequence's index in its group
    copies: tuple = ()  # choice 0 only: the group's other choices (Requests), in order
    # Engine-side progress, written by the engine thread only.
    finished: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self):
        if self.loop is not None and self.events is None:
            self.events = asyncio.Queue()

    def send(self, event) -> None:
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (self.choice, event))
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass
