"""A distribution the engine thread adds to and a metrics scrape reads (each NIXL read's time and bytes, exported as
vLLM's `vllm:nixl_xfer_time_seconds` and `vllm:nixl_bytes_transferred`), without a metrics library in the KV
connector."""

READ_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
READ_BYTES_BOUNDS = tuple(float(2 ** p) for p in range(16, 33, 2))  # 64 KiB to 4 GiB


class Buckets:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # observations at or under each bound: Prometheus's cumulative buckets
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, int]]:
        """(upper bound, cumulative count) pairs, +Inf last, as HistogramMetricFamily takes them."""
        return [(repr(bound), count) for bound, count in zip(self.bounds, self.counts)] + [("+Inf", self.count)]
