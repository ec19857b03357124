"""Per-request adaptive drafting: a request whose drafts keep failing stops verifying them,
and starts again when its history matches its drafts again, so that speculation never makes
a batch slower than plain decoding.

Each request keeps an exponential moving average of how many of its drafted tokens were
accepted. Below ``pause_below`` it pauses: the drafter still proposes for it (every token
for an n-gram lookup, which costs nothing; every few steps for a model drafter, whose
proposal is a forward), but nothing is verified. Instead its paused drafts are scored against
the tokens the request goes on to produce ("shadow" trials; one opens each time it proposes): a
trial's accepted count is the longest prefix that matches, as a verification would have found
it. A trial whose first ``resume_hits`` tokens match resumes drafting at once; one that fails
earlier moves the average by its accepted fraction, as a verification would, and above
``resume_above`` the request drafts again too. Both thresholds leave a gap, so a request does
not flip every step. As trials overlap, a request whose output starts to copy resumes within
``resume_hits`` tokens.

Asking for two matching tokens, not one, is what keeps free-form text paused: a chat reply
often repeats one token of its history, and with a first-token rule such a hit resumed the
request and bought about two rejected five-token chunks (SmolLM2's mixed batch in
benchmarks/spec_ngram.py: 218 rejected draft rows with that rule, 122 with this one; since
the closed-batch rule in ``SpeculativeDecoder._cannot_shorten``, that batch verifies none).
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
    resume_hits: int = 2  # a paused draft whose first tokens match this far resumes drafting
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

    def shadow(self, request_id: str, drafted: int, accepted: int, final: bool = True) -> bool:
        """A paused request's draft of ``drafted`` tokens matched its next ``accepted`` tokens.
        ``final=False``: the trial is still open (the ``accepted`` tokens so far all matched).
        A trial whose first ``resume_hits`` tokens match resumes the request at once; one that
        failed before that counts ``accepted / drafted`` in the average. Returns whether the
        trial is closed."""
        if drafted <= 0:
            return True
        if accepted >= min(self.resume_hits, drafted):
            self._update(request_id, accepted / drafted)
            self.acceptance[request_id] = max(self.acceptance[request_id], self.resume_above)
            self.paused.discard(request_id)
            return True
        if not final:
            return False
        self._update(request_id, accepted / drafted)
        if self.acceptance[request_id] >= self.resume_above:
            self.paused.discard(request_id)
        return True

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self.trials.pop(request_id, None)
        self.paused.discard(request_id)
