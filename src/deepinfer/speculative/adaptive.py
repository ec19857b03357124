"""Per-request adaptive drafting: a request whose drafts keep failing stops verifying them,
and starts again when its history matches its drafts again (issue 16: speculation must
never make a batch slower than plain decoding).

Each request keeps an exponential moving average of how many of its drafted tokens were
accepted. Below ``pause_below`` it pauses: the drafter still proposes for it (an n-gram
lookup costs nothing), but nothing is verified; instead each new token is compared with the
paused draft's first token (a "shadow" trial, free), and the average moves with those
outcomes. Above ``resume_above`` it drafts again. Both thresholds leave a gap, so a request
does not flip every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdaptiveDrafting:
    """The pause/resume state of every request."""

    pause_below: float = 0.25
    resume_above: float = 0.5
    decay: float = 0.5  # weight of the newest outcome in the moving average
    min_trials: int = 2  # verifications before a request may pause
    acceptance: dict[str, float] = field(default_factory=dict)
    trials: dict[str, int] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)

    def drafting(self, request_id: str) -> bool:
        return request_id not in self.paused

    def _update(self, request_id: str, rate: float) -> None:
        old = self.acceptance.get(request_id, 0.5)  # no evidence yet: neutral
        self.acceptance[request_id] = (1 - self.decay) * old + self.decay * rate
        self.trials[request_id] = self.trials.get(request_id, 0) + 1

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        """A drafted chunk was verified: ``accepted`` of ``drafted`` tokens survived."""
        if not drafted:
            return
        self._update(request_id, accepted / drafted)
        if self.trials[request_id] >= self.min_trials and self.acceptance[request_id] < self.pause_below:
            self.paused.add(request_id)

    def shadow(self, request_id: str, hit: bool) -> None:
        """A paused request's draft would have had its first token ``hit`` (right)."""
        self._update(request_id, 1.0 if hit else 0.0)
        if self.acceptance[request_id] >= self.resume_above:
            self.paused.discard(request_id)

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self.trials.pop(request_id, None)
        self.paused.discard(request_id)
