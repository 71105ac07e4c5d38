"""The link between hosts in a plan (`kvturn plan --link RATE:DELAY`): a KV read costs at least its bytes at the
link's rate plus a round trip of its delay and the fixed cost a read pays over it, never less than the calibration
measured on its own hardware (one host's shared memory, or the link it ran on). The compute stays the
calibration's: another machine's compute the plan cannot know."""


def read_ms(calibration, deployment, tokens: int, direction: str) -> float:
    measured = calibration.read_ms(tokens, direction)
    if not deployment.link_bits_per_s or tokens <= 0:
        return measured
    over_link = tokens * calibration.kv_bytes_per_token * 8 / deployment.link_bits_per_s * 1e3
    return max(measured, over_link) + 2 * deployment.link_delay_s * 1e3 + deployment.link_read_fixed_ms


def read_ms_per_mib(calibration, deployment) -> dict[str, float]:
    """The read rates the router's cost model starts from: the calibration's, or the link's where slower."""
    rates = dict(calibration.read_ms_per_mib)
    if deployment.link_bits_per_s:
        per_mib = 2**20 * 8 / deployment.link_bits_per_s * 1e3
        rates = {direction: max(ms, per_mib) for direction, ms in rates.items()}
    return rates
