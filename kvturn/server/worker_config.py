"""Settings of one worker process."""
from dataclasses import dataclass, field

from kvturn.config import EngineConfig

ROLES = ("prefill", "decode", "both")


@dataclass(slots=True)
class WorkerConfig:
    model_dir: str
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None  # the address peers use to reach this worker's side channel
    served_model_name: str | None = None
    bidirectional: bool = False
    cluster_secret: str | None = None
    side_channel_timeout_s: float = 5.0
    engine: EngineConfig = field(default_factory=EngineConfig)
