"""Seeded number distributions in the format of vLLM's multi-turn benchmark.

    {"distribution": "constant", "value": 10}
    {"distribution": "uniform", "min": 1, "max": 9}
    {"distribution": "lognormal", "average": 100, "median_ratio": 0.8, "max": 500}   (or "mean", "sigma")
    {"distribution": "zipf", "alpha": 1.5, "max": 50}
    {"distribution": "poisson", "alpha": 10, "max": 50}
A bare number means constant.
"""
import math

import numpy as np


def _real(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


class Distribution:
    def __init__(self, spec, name: str = "value", most: float = math.inf):
        """`most`: the largest value a draw may take; a larger one is refused (ValueError), not clipped."""
        if _real(spec):
            spec = {"distribution": "constant", "value": spec}
        if not isinstance(spec, dict) or "distribution" not in spec:
            raise ValueError(f"{name}: expected a finite number or {{'distribution': ...}}, got {spec!r:.80}")
        bad = [k for k, v in spec.items() if k != "distribution" and not _real(v)]
        if bad:
            raise ValueError(f"{name}: {', '.join(map(repr, bad))} must be finite numbers")
        self.kind = spec["distribution"]
        self.spec = spec
        self.name = name
        self.most = most
        self.max = spec.get("max")
        if self.kind == "constant":
            self._check("value")
        elif self.kind == "uniform":
            self._check("min", "max")
            if spec["min"] > spec["max"]:
                raise ValueError(f"{name}: uniform min > max")
        elif self.kind == "lognormal":
            if "average" in spec:
                ratio = spec.get("median_ratio", 0.85)
                if not 0 < ratio <= 1 or spec["average"] <= 0:
                    raise ValueError(f"{name}: median_ratio must lie in (0, 1] and average above 0")
                # median = average * ratio; for a lognormal, mean/median = exp(sigma^2 / 2)
                self.mu = math.log(spec["average"] * ratio)
                self.sigma = math.sqrt(2 * math.log(1 / ratio))
            else:
                self._check("mean", "sigma")
                self.mu, self.sigma = spec["mean"], spec["sigma"]
        elif self.kind in ("zipf", "poisson"):
            self._check("alpha")
            if self.kind == "zipf" and spec["alpha"] <= 1:
                raise ValueError(f"{name}: zipf alpha must be > 1")
        else:
            raise ValueError(f"{name}: unknown distribution {self.kind!r}")

    def _check(self, *keys):
        missing = [k for k in keys if k not in self.spec]
        if missing:
            raise ValueError(f"{self.name}: {self.kind} needs {', '.join(missing)}")

    def sample(self, rng: np.random.Generator, minimum: float = 0) -> float:
        s = self.spec
        if self.kind == "constant":
            value = s["value"]
        elif self.kind == "uniform":
            value = rng.uniform(s["min"], s["max"])
        elif self.kind == "lognormal":
            value = rng.lognormal(self.mu, self.sigma)
        elif self.kind == "zipf":
            value = rng.zipf(s["alpha"])
        else:
            value = rng.poisson(s["alpha"])
        if self.max is not None:
            value = min(value, self.max)
        value = max(value, minimum)
        if not value <= self.most:  # an overflowed lognormal's inf too
            raise ValueError(f"{self.name}: drew {value:g}, more than the {self.most:g} allowed")
        return value

    def sample_int(self, rng: np.random.Generator, minimum: int = 0) -> int:
        return int(round(self.sample(rng, minimum)))
