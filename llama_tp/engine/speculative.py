"""Speculative decoding under tensor parallelism: draft k tokens, check them in one forward.

Each speculative step (`decoder.Decoder`, for a batch of one sequence whose
settings ask for drafts) lets the drafter (`engine/drafters.py`) propose tokens
d_1..d_n (n <= k) after the pending token y; the target model scores
[y, d_1, ..., d_n] in one sharded forward, so the collective round of its
layers (2 all-reduces per layer) is paid once for up to n + 1 tokens.

Acceptance is coupled through the key schedule: the sampler draws the token at
each checked position exactly as a plain step would there (same settings, same
key, `sampling.token_key(seed, n)`), and d_i is kept while it equals that
draw. The first draw that differs is the target's own token. So the output is
token for token the plain output, greedy or sampled (with top-p, min-p, top-k
too), on any rank count, and the acceptance of a point-mass draft (prompt
lookup) is p(d), as in the classic rejection rule. A draft model samples its
drafts with the same keys, so it proposes the target's draw whenever the two
models agree on it. Both caches step back to the kept tokens (`caches.rewind`; a layer
kind that cannot, a recurrent state, is refused in one line naming it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    """What speculative decoding did for one sequence (`Response.speculative`)."""

    drafted: int = 0  # tokens proposed by the drafter
    accepted: int = 0  # of those, kept by the target
    target_forwards: int = 0  # checking forwards of the target (decode steps)
    generated: int = 0  # tokens produced by those forwards (kept drafts and the target's)
    collectives: int = 0  # collective rounds made while drafting and checking

    def record(self, drafted: int, accepted: int, collectives: int) -> None:
        """One speculative step: `drafted` proposed, `accepted` kept."""
        self.drafted += drafted
        self.accepted += accepted
        self.target_forwards += 1
        self.generated += accepted + 1
        self.collectives += collectives

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def collectives_per_token(self) -> float:
        return self.collectives / self.generated if self.generated else 0.0

    def summary(self) -> str:
        return (
            f"acceptance {100 * self.acceptance_rate:.1f}% ({self.accepted}/{self.drafted} "
            f"drafted), {self.tokens_per_forward:.2f} tokens per target forward, "
            f"{self.collectives_per_token:.1f} collective rounds per token"
        )

    def to_dict(self) -> dict[str, float]:
        d = dict(self.__dict__)
        d.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_forward=self.tokens_per_forward,
            collectives_per_token=self.collectives_per_token,
        )
        return d
