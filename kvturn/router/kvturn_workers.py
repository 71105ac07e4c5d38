"""A turn's backend on kvturn's own workers: the path it takes, computing on the decode worker among them
(turn_costs.py); the decode worker's lease record handed to P as D returned it, HMAC binding included, and kept
for the next turn; P's first token streamed ahead of D's stream (first_token.py); the cost model taught what the
turn cost."""
from kvturn import costmodel
from kvturn.kv_transfer import policy
from kvturn.kv_transfer.params import BadKVParams, KVTransferParams
from kvturn.router.answers import DecodeAnswer
from kvturn.router.conversations import Conversation
from kvturn.router.first_token import FirstToken
from kvturn.router.keys import message_size
from kvturn.router.lease_check import LEASE_ENDED, still_held
from kvturn.router.turn_backend import TurnBackend
from kvturn.router.turn_costs import TurnCosts
from kvturn.router.vllm_backend import KVTURN

LEASE_GONE = (policy.LEASE_UNKNOWN, policy.EXPIRED, policy.EPOCH_MISMATCH, policy.LEASE_ENDED)  # D let it go
NEW_PROMPT = {"do_remote_decode": True, "do_remote_prefill": False}  # P computes it all and pins it for D


class KvturnWorkers(TurnBackend):
    def __init__(self, turn):
        super().__init__(turn)
        self.costs = TurnCosts(turn)
        self.lease: dict | None = None  # the conversation's lease, handed to P until P fails with it
        self.withdrawn = False  # D said it had let the lease go: not handed to P

    def choose_path(self) -> None:
        entry = self.turn.entry
        path = self.costs.choose().path
        self.lease = entry.kv_params if entry is not None and path == costmodel.PULL else None

    async def verify_reuse(self, prefill_url: str) -> None:
        """Ask D whether it still holds the lease (lease_check.py): one it let go is withdrawn, never handed to P."""
        turn = self.turn
        holder = turn.router.decode.find(turn.entry.decode_url) if self.lease is not None else None
        if holder is None or holder.backend != KVTURN or turn.key is None:
            return  # the secret goes only to a decode worker of our own rotation
        handle = self.lease.get("handle") if isinstance(self.lease, dict) else None
        if await turn.waiting(still_held(turn.router, holder.url, handle, turn.key)) is False:
            self.lease, self.withdrawn = None, True
            await turn.router.table.drop(turn.key)

    @property
    def computes_on_decode(self) -> bool:
        return self.costs.choice.path == costmodel.COMPUTE_ON_DECODE

    @property
    def prefill_work_ms(self) -> float:
        return self.costs.choice.work_ms

    @property
    def decode_work_ms(self) -> float:
        return self.costs.choice.work_ms if self.computes_on_decode else 0.0

    @property
    def reusing(self) -> bool:
        return self.lease is not None

    def prefill_body(self, body: dict) -> dict:
        lease = self.lease
        body["kv_transfer_params"] = KVTransferParams.parse(lease).for_next_prefill() if lease else dict(NEW_PROMPT)
        if self.turn.key is not None:
            body["conversation_id"] = self.turn.key
        return body

    def give_up_reuse(self) -> None:
        self.lease = None

    async def count_reuse(self, missed_because: str | None) -> None:
        """P reports what it reused; a lease its holder let go leaves no entry behind."""
        turn = self.turn
        p_kvturn = turn.prefill.setdefault("kvturn", {})
        if missed_because and p_kvturn.get("reuse") is None:
            p_kvturn["reuse"] = missed_because  # the lease ended before this turn came
        elif self.withdrawn and p_kvturn.get("reuse") is None:
            p_kvturn["reuse"] = LEASE_ENDED
        reuse = p_kvturn.get("reuse")
        turn.router.metrics.reuse.labels(str(reuse)).inc()
        if turn.entry is not None and reuse in LEASE_GONE:
            await turn.router.table.drop(turn.key)  # nothing left to read there; keep no stale entry

    def decode_body(self) -> dict:
        """P's params for D, with what P's own prefix cache held of the prompt (D weighs the lease it keeps by it)."""
        kv = self.turn.prefill.get("kv_transfer_params")
        cached = (self.turn.prefill.get("kvturn") or {}).get("prompt_tokens_cached")
        if isinstance(kv, dict) and isinstance(cached, int) and cached >= 0:
            kv = {**kv, "prefill_cached_tokens": cached}
        return {**self.turn.body, "kv_transfer_params": kv}

    def first_token(self) -> FirstToken | None:
        turn = self.turn
        first = FirstToken.from_prefill(turn.body, turn.prefill, turn.chat) if turn.prefill else None
        decoders = turn.router.decode.healthy()
        if first is not None and decoders and all(w.backend == KVTURN for w in decoders):  # vLLM samples its own
            return first
        return None

    def cached_tokens(self) -> int | None:
        """P's account when P computed the prompt (its prefix-cache hits and the history read from D's lease); on
        the decode worker's path, D's own (its cache), which its usage says already."""
        prefill = self.turn.prefill.get("kvturn")
        if self.computes_on_decode or not isinstance(prefill, dict):
            return None
        return int(prefill.get("prompt_tokens_cached") or 0) + int(prefill.get("prompt_tokens_remote") or 0)

    def reports_on(self, chunk: dict, finish_reason: str | None) -> bool:
        return "kvturn" in chunk  # D's report of the request, on its last chunk

    async def remember(self, answer: DecodeAnswer) -> None:
        """Keep D's lease (with the bytes of the history it holds, for the next turn's estimate); without one, the
        old lease is superseded or gone."""
        turn = self.turn
        if turn.key is None:
            return
        try:
            params = KVTransferParams.parse(answer.kv)
        except BadKVParams:
            params = KVTransferParams()
        if params.handle:
            text = answer.text or ""
            answered = turn.prompt_size + (len(text) if turn.body.get("messages") is None else
                                           message_size({"role": "assistant", "content": text}))
            await turn.router.table.put(Conversation(turn.key, answer.decode_url, answer.kv, 0.0, turn.order,
                                                     history_bytes=answered))
        else:
            await turn.router.table.drop(turn.key)
        await turn.remember_answer(answer.text)

    def learn(self, decode: dict | None) -> dict:
        return self.costs.learn(decode)

    def report(self, decode: dict | None, decode_url: str, learned: dict | None) -> dict:
        """One timing breakdown for the turn, from P's and D's own accounts."""
        turn = self.turn
        prefill = turn.prefill.get("kvturn") or {}
        p_timing, d_timing = prefill.get("timing", {}), (decode or {}).get("timing", {})
        return {
            "conversation_id": turn.conversation.client_id if turn.conversation else None,
            "prefill_worker": turn.prefill_url,
            "decode_worker": decode_url,
            "reuse": prefill.get("reuse"),
            "kv_tier": prefill.get("kv_tier"),  # which tier of D's P read the history from (pool or host)
            "first_token_from": turn.first_token_from,
            "prompt_tokens_computed_prefill": prefill.get("prompt_tokens_computed"),
            "prompt_tokens_from_decode": prefill.get("prompt_tokens_remote"),
            "prompt_tokens_cached_prefill": prefill.get("prompt_tokens_cached"),
            "prompt_tokens_cached_prefill_host": prefill.get("prompt_tokens_cached_host"),  # of them, P's host tier
            "bytes_d_to_p": prefill.get("kv_read_bytes", 0),
            "bytes_p_to_d": (decode or {}).get("kv_read_bytes", 0),
            "timing": {
                "prefill_request_ms": turn.prefill_round_trip_s * 1e3,
                "queue_ms": p_timing.get("queue_ms"),
                "d_to_p_read_ms": p_timing.get("kv_read_ms"),
                "d_to_p_read_step_ms": p_timing.get("kv_read_step_ms"),  # of it, P's steps for other prompts
                "d_to_p_read_hidden_ms": p_timing.get("kv_read_hidden_ms"),  # of it, under P's own compute
                "prefill_compute_ms": p_timing.get("prefill_compute_ms"),
                "p_to_d_read_ms": d_timing.get("kv_read_ms"),
                "decode_ttft_ms": d_timing.get("ttft_ms"),
            },
            "path": learned,
            "decode": decode,
            "prefill_timing": p_timing,
        }
