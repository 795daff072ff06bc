"""What a load run sends and when: Poisson send times, deadlines drawn from a mix, the image order.

Every draw comes from one seeded numpy Generator per concern (arrivals, deadlines, images), so two runs
with the same seed send the same images with the same deadlines whatever their rates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DeadlineMix:
    """Deadlines (ms) and the probability of each; a single deadline is a mix of one."""

    deadlines_ms: tuple[float, ...]
    probabilities: tuple[float, ...]

    @classmethod
    def single(cls, deadline_ms: float) -> DeadlineMix:
        return cls((float(deadline_ms),), (1.0,))

    @classmethod
    def parse(cls, text: str) -> DeadlineMix:
        """`"3:0.3,10:0.5,50:0.2"`: deadline_ms:probability pairs whose probabilities sum to 1."""
        deadlines, probs = [], []
        for item in text.split(","):
            value, sep, prob = item.partition(":")
            try:
                if not sep:
                    raise ValueError
                deadlines.append(float(value))
                probs.append(float(prob))
            except ValueError:
                raise ValueError(f"deadline mix item {item!r} is not deadline_ms:probability") from None
        if min(deadlines) <= 0 or min(probs) < 0:
            raise ValueError(f"deadline mix {text!r}: deadlines must be > 0 and probabilities >= 0")
        if abs(sum(probs) - 1) > 1e-6:
            raise ValueError(f"deadline mix {text!r}: probabilities sum to {sum(probs):g}, not 1")
        return cls(tuple(deadlines), tuple(probs))

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(np.asarray(self.deadlines_ms), size=n, p=np.asarray(self.probabilities))

    def __str__(self) -> str:
        if len(self.deadlines_ms) == 1:
            return f"{self.deadlines_ms[0]:g} ms"
        return ", ".join(f"{d:g} ms: {p:.0%}" for d, p in zip(self.deadlines_ms, self.probabilities, strict=True))


def poisson_offsets(rate: float, requests: int, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from the start) of a Poisson process at `rate`/s: at most `requests`, all before `duration_s`.

    Inter-arrival gaps are exponential with mean 1/rate; the first request leaves after the first gap.
    """
    if rate <= 0 or requests < 1 or duration_s <= 0:
        raise ValueError(f"need rate > 0, requests >= 1, duration > 0 (got {rate}, {requests}, {duration_s})")
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=requests))
    return offsets[offsets < duration_s]


@dataclass(frozen=True)
class Workload:
    """Per request i: the test image to send (index into the split) and its deadline."""

    images: np.ndarray  # int, indices into the test split
    deadlines_ms: np.ndarray


def make_workload(n: int, n_images: int, mix: DeadlineMix, seed: int) -> Workload:
    """`n` requests over a seeded permutation of the images (cycled when n exceeds them)."""
    order = image_order(n_images, seed)
    return Workload(order[np.arange(n) % n_images], mix.draw(n, np.random.default_rng([seed, 2])))


def image_order(n_images: int, seed: int) -> np.ndarray:
    """The order in which a run with `seed` sends the test images (the oracle bound recomputes it)."""
    return np.random.default_rng([seed, 1]).permutation(n_images)


def arrival_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, 3])
