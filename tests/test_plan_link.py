"""A plan's link between hosts: a read costs at least its bytes at the link's rate plus a round trip, never less
than the calibration measured."""
from dataclasses import dataclass, field

from kvturn.plan import link
from kvturn.plan.sim import Deployment


@dataclass
class Measured:
    """The two figures of a calibration a read's price needs (plain inputs)."""
    kv_bytes_per_token: float = 4096.0
    read_ms_per_mib: dict = field(default_factory=lambda: {"d_to_p": 0.1, "p_to_d": 0.2})

    def read_ms(self, tokens: int, direction: str) -> float:
        return tokens * self.kv_bytes_per_token / 2**20 * self.read_ms_per_mib[direction]


def test_a_slow_link_prices_a_read_by_its_bytes_and_round_trip():
    ten_gbit = Deployment(link_bits_per_s=10e9, link_delay_s=50e-6, link_read_fixed_ms=1.0)
    tokens = 2560  # 10 MiB of KV
    expected = 10 * 2**20 * 8 / 10e9 * 1e3 + 0.1 + 1.0
    assert abs(link.read_ms(Measured(), ten_gbit, tokens, "d_to_p") - expected) < 1e-9
    assert link.read_ms(Measured(), ten_gbit, 0, "d_to_p") == 0.0


def test_without_a_link_or_on_a_faster_one_the_calibration_stands():
    measured = Measured()
    assert link.read_ms(measured, Deployment(), 2560, "p_to_d") == measured.read_ms(2560, "p_to_d")
    fast = Deployment(link_bits_per_s=1e13)
    assert link.read_ms(measured, fast, 2560, "d_to_p") == measured.read_ms(2560, "d_to_p")
    assert link.read_ms_per_mib(measured, fast) == measured.read_ms_per_mib
    assert link.read_ms_per_mib(measured, Deployment(link_bits_per_s=1e9))["d_to_p"] > 8.0
