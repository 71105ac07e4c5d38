"""What a turn asks of the workers' backend (turn.py's flow calls these hooks): the defaults here do nothing or the
plain thing, and kvturn_workers.py and vllm_workers.py override what their workers need. One object per turn,
holding the turn (`self.turn`) and what the backend keeps about it."""
from yarl import URL

from kvturn.router import fast_json
from kvturn.router.answers import DecodeAnswer, answer_object
from kvturn.router.first_token import FirstToken


class TurnBackend:
    computes_on_decode = False  # the path skips P: D computes the new tokens on the history it retained
    prefill_work_ms = 0.0  # the work the turn is predicted to cost P (workers.WorkerPool.claim)
    decode_work_ms = 0.0  # ...and D
    reports_own_work = False  # the turn's work clock is read (observe_work, report): else an idle one stands in

    def __init__(self, turn):
        self.turn = turn

    async def previous_turn_settled(self) -> None:
        """Wait (the turn's clock paused) for what the conversation's previous turn left running."""

    def choose_path(self) -> None:
        """Decide how the turn goes, once the conversation's entry is looked up."""

    async def verify_reuse(self, prefill_url: str) -> None:
        """Before the first call to a prefill worker: check what of the lease that worker may read."""

    @property
    def reusing(self) -> bool:
        """Whether the next call to a prefill worker hands it the conversation's lease."""
        raise NotImplementedError

    def prefill_body(self, body: dict) -> dict:
        """The prefill call's body from the one-token request, with the `kv_transfer_params` P reads."""
        raise NotImplementedError

    def request(self, url: str, body: dict) -> tuple[str | URL, bytes]:
        """(URL, JSON) of a call to a worker."""
        return url, fast_json.dumps(body)

    async def prefill_read_lease(self) -> None:
        """P has read (or tried to read) the lease."""

    def give_up_reuse(self) -> None:
        """P failed with the lease: the next call recomputes."""
        raise NotImplementedError

    async def count_reuse(self, missed_because: str | None) -> None:
        """P has answered: count what it reused. `missed_because`: why the table held no entry, if it did not."""
        raise NotImplementedError

    def decode_body(self) -> dict:
        """The decode call's body once P has answered."""
        raise NotImplementedError

    def first_token(self) -> FirstToken | None:
        """P's first token, when the router may stream it ahead of D's."""
        return None

    def read_answer(self, content: bytes) -> dict | None:
        """D's whole answer as the JSON object it must be; None if it is anything else."""
        return answer_object(content)

    def read_chunk(self, payload: str) -> dict:
        """One event of D's stream (`data: ` cut off) as its JSON."""
        return fast_json.loads(payload)

    def strip_ids(self, response: dict) -> None:
        """Take out of a response or chunk what the router asked D for itself only."""

    def cached_tokens(self) -> int | None:
        """The prompt tokens this turn did not compute, as the response's usage says them; None: D's own count."""
        return None

    def honest_usage(self, usage) -> None:
        """Put the turn's cached tokens into a usage object of D's (whose own count includes what D read from P)."""
        cached = self.cached_tokens()
        if isinstance(usage, dict) and cached is not None:
            details = usage.get("prompt_tokens_details")
            usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached}

    def reports_on(self, chunk: dict, finish_reason: str | None) -> bool:
        """Whether this chunk of D's stream ends the turn and carries its `kvturn` object."""
        raise NotImplementedError

    async def remember(self, answer: DecodeAnswer) -> None:
        """Keep what D retained for the conversation's next turn, or drop the entry."""
        raise NotImplementedError

    def learn(self, decode: dict | None) -> dict | None:
        """Teach the cost model what the turn cost (`decode`: D's report); returns what the response shows of it."""
        return None

    def report(self, decode: dict | None, decode_url: str, learned: dict | None) -> dict:
        """The response's `kvturn` object."""
        raise NotImplementedError

    def observe_work(self) -> None:
        """The answer is out: count the router's own work on the turn."""
