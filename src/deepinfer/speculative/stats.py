"""Engine-wide speculative decoding figures: how many tokens were drafted and accepted, how
acceptance falls along the draft, and how well a confidence head predicted it (calibration:
its predicted survival of each draft position against the share that survived)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Engine-wide counters (per-request ones live on the Request)."""

    verify_steps: int = 0  # drafted chunks verified
    drafted: int = 0
    accepted: int = 0
    engine_steps: int = 0  # engine steps that verified at least one drafted chunk
    # per draft position j, over verified chunks: those that verified a draft at j; those whose
    # drafts 0..j were all accepted; those where j was tested (drafts before it accepted);
    # and, where the drafter has a confidence head, the summed predicted survival of drafts
    # 0..j (the product of its per-position confidences) and how many chunks it scored
    position_drafted: list[int] = field(default_factory=list)
    position_survived: list[int] = field(default_factory=list)
    position_tested: list[int] = field(default_factory=list)
    position_predicted: list[float] = field(default_factory=list)
    position_scored: list[int] = field(default_factory=list)

    @property
    def verified_tokens_per_step(self) -> float:
        """Tokens the target checked per such step (anchors + drafts, over all requests)."""
        return (self.drafted + self.verify_steps) / self.engine_steps if self.engine_steps else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified chunk (accepted drafts + the final token)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def record_positions(self, drafted: int, accepted: int, confidences: list[float] | None) -> None:
        """One verified chunk of ``drafted`` drafts of which the first ``accepted`` were kept;
        ``confidences``: the confidence head's per-position scores of its draft (None: none)."""
        grow = drafted - len(self.position_drafted)
        if grow > 0:
            for counts in (
                self.position_drafted,
                self.position_survived,
                self.position_tested,
                self.position_scored,
            ):
                counts.extend([0] * grow)
            self.position_predicted.extend([0.0] * grow)
        survival = 1.0
        for j in range(drafted):
            self.position_drafted[j] += 1
            self.position_survived[j] += j < accepted
            self.position_tested[j] += j <= accepted
            if confidences is not None and j < len(confidences):
                survival *= confidences[j]
                self.position_predicted[j] += survival
                self.position_scored[j] += 1

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft j accepted | the drafts before it were), per position."""
        return [
            s / t if t else 0.0 for s, t in zip(self.position_survived, self.position_tested, strict=True)
        ]

    @property
    def calibration(self) -> list[tuple[float, float]]:
        """Per position: (mean predicted survival, observed survival) over scored chunks;
        empty without a confidence head."""
        if not any(self.position_scored):
            return []
        return [
            (p / n if n else 0.0, s / d if d else 0.0)
            for p, n, s, d in zip(
                self.position_predicted,
                self.position_scored,
                self.position_survived,
                self.position_drafted,
                strict=True,
            )
        ]

    def summary(self) -> dict[str, object]:
        """The figures a report prints: acceptance length, by position, and calibration."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
            "verified_tokens_per_step": round(self.verified_tokens_per_step, 3),
            "acceptance_by_position": [round(a, 3) for a in self.acceptance_by_position],
            "calibration": [(round(p, 3), round(o, 3)) for p, o in self.calibration],
        }

    def report(self, method: str) -> list[str]:
        """Lines for a command's report (``deepinfer generate``, ``deepinfer bench``)."""
        lines = [
            f"speculative ({method}): {self.drafted} drafted, {self.accepted} accepted, "
            f"mean acceptance length {self.mean_acceptance_length:.2f}, "
            f"{self.verified_tokens_per_step:.2f} verified tokens per step"
        ]
        if self.position_drafted:
            rates = " ".join(f"{a:.2f}" for a in self.acceptance_by_position)
            lines.append(f"  acceptance by draft position (given the drafts before it): {rates}")
        if self.calibration:
            pairs = " ".join(f"{p:.2f}/{o:.2f}" for p, o in self.calibration)
            lines.append(f"  confidence head, predicted/observed survival by position: {pairs}")
        return lines
