"""A calibration from running workers (`kvturn plan --calibration URL`), so a user plans from the cluster they run
with no bench run: each worker's steps in service (GET /kv/steps, for cluster members only: it tells when other
clients' requests ran and how long they were), fitted as a bench run's are (fit.step_fits); and from GET
/kv/calibration the KV bytes a token takes and the worker's reads from peers so far, for the read time each way
(a prefill worker's reads are decode-to-prefill, a decode worker's the other way).

No worker measures a turn's time outside compute and transfer (the router, HTTP, tokenizing): such a calibration
has none, and the plan's verdict says its TTFTs leave it out. Every reply is checked as a peer's: a worker that
answers nonsense is named in the error, a step that is not a plausible one is left out (step_samples.parse_step)."""
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from kvturn.kv_transfer.params import SECRET_HEADER
from kvturn.plan import step_samples
from kvturn.plan.calibration import Calibration, CalibrationError, read_rates, step_fits, with_halves
from kvturn.plan.rows import number_within

TIMEOUT_S = 30.0
MAX_REPLY_BYTES = 64 * 2**20  # /kv/steps keeps 20,000 steps by default, ~3 MB of JSON
READ_DIRECTION = {"prefill": "d_to_p", "decode": "p_to_d"}  # what a worker of the role reads from its peers
MAX_BYTES_PER_TOKEN = 2.0**30


def is_url(source) -> bool:
    return isinstance(source, str) and source.startswith(("http://", "https://"))


@dataclass(slots=True)
class WorkerReply:
    url: str
    role: str
    kv_bytes_per_token: float
    read_bytes: int
    read_seconds: float
    steps: list[step_samples.Step]


def _get(client: httpx.Client, url: str, path: str, **request) -> dict:
    """The JSON object a worker answers at GET `path`, read up to MAX_REPLY_BYTES, or a CalibrationError naming it."""
    try:
        with client.stream("GET", f"{url}{path}", **request) as response:
            if response.status_code == 403:
                raise CalibrationError(f"{url}: {path} is for cluster members: give the cluster's secret "
                                       "(--cluster-secret or KVTURN_CLUSTER_SECRET)")
            if response.status_code != 200:
                raise CalibrationError(f"{url}: not a kvturn worker (GET {path} answered {response.status_code})")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_REPLY_BYTES:
                    raise CalibrationError(f"{url}: GET {path} answered more than {MAX_REPLY_BYTES:,} bytes")
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL is no HTTPError
        raise CalibrationError(f"{url}: cannot reach the worker ({type(exc).__name__}: {exc})") from None
    try:
        reply = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        reply = None
    if not isinstance(reply, dict):
        raise CalibrationError(f"{url}: GET {path} answered something other than a JSON object")
    return reply


def fetch(client: httpx.Client, url: str, secret: str | None) -> WorkerReply:
    """One worker's calibration and steps in service, checked."""
    about = _get(client, url, "/kv/calibration")
    role, per_token, reads = about.get("role"), about.get("kv_bytes_per_token"), about.get("kv_reads")
    if role not in step_samples.ROLES:
        raise CalibrationError(f"{url}: /kv/calibration names no worker role ({', '.join(step_samples.ROLES)})")
    if not number_within(per_token, 1.0, MAX_BYTES_PER_TOKEN) or not isinstance(reads, dict):
        raise CalibrationError(f"{url}: /kv/calibration says no KV bytes per token or reads (a kvturn worker "
                               "older than kvturn plan's URLs?)")
    read_bytes, read_seconds = reads.get("bytes"), reads.get("seconds")
    if type(read_bytes) is not int or not 0 <= read_bytes < 2**63 or not number_within(read_seconds, 0.0, 1e9):
        raise CalibrationError(f"{url}: /kv/calibration's kv_reads must have whole bytes and seconds, none negative")
    # Of the reads' time, the worker's own steps that ran before it saw them done (a read is seen between steps):
    # the read itself is the rest, as the bench's fit takes reads no step overlapped (absent from older workers)
    step_seconds = reads.get("step_seconds", 0.0)
    if not number_within(step_seconds, 0.0, read_seconds):
        raise CalibrationError(f"{url}: /kv/calibration's kv_reads step_seconds must be a number from 0 to its "
                               "seconds")
    read_seconds -= step_seconds
    headers = {SECRET_HEADER: secret} if secret else {}
    served = _get(client, url, "/kv/steps", params={"since": 0}, headers=headers)
    raw = served.get("steps")
    if served.get("role") != role or not isinstance(raw, list):
        raise CalibrationError(f"{url}: /kv/steps answered no steps of its {role} worker")
    steps = step_samples.leg_steps({"worker_steps": {role: raw}}).get(step_samples.ROLES[role], [])
    return WorkerReply(url, role, float(per_token), read_bytes, float(read_seconds), steps)


def _ms_per_mib(replies: list[WorkerReply], direction: str) -> float | None:
    reading = [r for r in replies if READ_DIRECTION.get(r.role) == direction and r.read_bytes > 0]
    mib = sum(r.read_bytes for r in reading) / 2**20
    return sum(r.read_seconds for r in reading) * 1e3 / mib if mib > 0 else None


def by_host(replies: list[WorkerReply]) -> list[dict[str, list[step_samples.Step]]]:
    """Each host's workers' steps by kind, as a bench leg's: D's decode steps count P's prompt steps beside them as
    contention only where they share the host."""
    hosts: dict[str, dict[str, list]] = {}
    for reply in replies:
        kinds = hosts.setdefault(urlsplit(reply.url).hostname or reply.url, {})
        kinds.setdefault(step_samples.ROLES[reply.role], []).extend(reply.steps)
    return [{kind: sorted(steps, key=lambda s: s.start_s) for kind, steps in kinds.items()}
            for kinds in hosts.values()]


def fitted(urls: list[str], secret: str | None, client: httpx.Client | None = None) -> Calibration:
    """A calibration fitted to the workers at `urls` (at least one prefill and one decode worker that
    have served turns, one of them having read KV from a peer)."""
    own = client is None
    client = client or httpx.Client(timeout=TIMEOUT_S)
    try:
        # a worker given twice would count its steps twice
        replies = [fetch(client, url, secret) for url in dict.fromkeys(url.rstrip("/") for url in urls)]
    finally:
        if own:
            client.close()
    roles = {r.role for r in replies}
    if not {"prefill", "decode"} <= roles:
        raise CalibrationError(f"give a prefill and a decode worker's URL (got {', '.join(sorted(roles))})")
    sizes = {r.kv_bytes_per_token for r in replies}
    if len(sizes) > 1:
        raise CalibrationError(f"the workers' KV takes {', '.join(f'{s:g}' for s in sorted(sizes))} bytes a token: "
                               "not one model and dtype")
    reads = read_rates(_ms_per_mib(replies, "d_to_p"), _ms_per_mib(replies, "p_to_d"))
    hosts = by_host(replies)

    def fit_half(half: int | None) -> dict:
        fits = step_fits(hosts, half)
        return {**fits, "read_ms_per_mib": reads, "kv_bytes_per_token": next(iter(sizes)),
                "samples": {"workers": len(replies), **fits["samples"]}}
    return with_halves(fit_half, ", ".join(r.url for r in replies))
