"""A turn on kvturn's workers as the cost model sees it: before, what it knows of the turn (its prompt's estimated
tokens, the lease, the workers' load) and the path it picks; after, what the turn really cost, to learn from."""
from kvturn import costmodel
from kvturn.costmodel.reports import own_read_ms, reported_prompt_tokens, shared_steps
from kvturn.router import keys, lease_tier
from kvturn.router.first_token import may_send_ahead


class TurnCosts:
    def __init__(self, turn):
        self.turn = turn
        self.choice: costmodel.PathChoice | None = None
        # Tokens of the text of the messages the estimate counted (text_tokens): those sent after the answer the
        # lease holds, or all of them when there is no lease.
        self.counted_tokens: int | None = None

    def choose(self) -> costmodel.PathChoice:
        router = self.turn.router
        self.choice = costmodel.choose(router.costs, self.view(), router.config.path_policy,
                                       router.config.stall_weight)
        router.costs.chosen(self.choice.path)
        router.metrics.paths.labels(self.choice.path).inc()
        return self.choice

    def view(self) -> costmodel.TurnView:
        """What the path policy needs to know of this turn, from the table and the workers' load."""
        turn = self.turn
        router, entry = turn.router, turn.entry
        retained, running, available, decode_backlog, step_ms = 0, 0, False, 0.0, 0.0
        if entry is not None:
            retained = int(entry.kv_params.get("remote_num_tokens") or 0)
            holder = router.decode.find(entry.decode_url)
            if holder is not None:
                running, decode_backlog, step_ms = holder.in_flight, holder.backlog_ms(), holder.step_ms
                available = holder.healthy and holder.in_flight < router.config.max_in_flight_per_decode
        prefill = turn.pick_prefill()
        tier = lease_tier.guess(entry, router.decode.find(entry.decode_url) if entry else None)
        cached = router.prefix_memory.expected_cached(turn.key, prefill.url) if prefill else 0
        return costmodel.TurnView(self.estimated_prompt_tokens(), retained, running, available,
                                  prefill.in_flight if prefill else 0, prefill.backlog_ms() if prefill else 0.0,
                                  decode_backlog, may_send_ahead(turn.body, turn.chat), step_ms, retained_tier=tier,
                                  prefill_cached_tokens=cached)

    def estimated_prompt_tokens(self) -> int:
        """The prompt's tokens: counted with the model's tokenizer where the router has it (--tokenizer) and the
        text is short enough, the rest estimated from the bytes (costmodel.tokens.TokenEstimator.prompt_tokens)."""
        turn = self.turn
        prompt, messages, costs = turn.body.get("prompt"), turn.body.get("messages"), turn.router.costs
        if isinstance(prompt, list):
            return len(prompt)
        if isinstance(prompt, str) and turn.router.tokenizer is not None and len(prompt) <= keys.MAX_COUNTED_BYTES:
            if len(prompt.encode("utf-8", "surrogatepass")) <= keys.MAX_COUNTED_BYTES:
                return turn.router.tokenizer.count(prompt)  # a completion's prompt has no template
        known_bytes, known_tokens = self.known_history()
        if known_tokens:
            added = keys.added_since(messages, turn.entry.order)
            self.counted_tokens = self.text_tokens(added, turn.prompt_size - known_bytes)
            if self.counted_tokens is not None:
                return known_tokens + costs.tokens.added_tokens(self.counted_tokens)
        elif isinstance(messages, list):
            self.counted_tokens = self.text_tokens(messages, turn.prompt_size)
            if self.counted_tokens is not None:
                return costs.tokens.templated_tokens(self.counted_tokens, len(messages))
        return costs.tokens.prompt_tokens(turn.prompt_size, known_bytes, known_tokens)

    def text_tokens(self, messages: list | None, size: int) -> int | None:
        """Tokens of the text of `messages` (`size` bytes), counted with the model's tokenizer; None without one,
        or when keys.countable_texts finds them not worth counting here."""
        texts = keys.countable_texts(messages, size)
        counts = self.turn.router.text_tokens
        if counts is None or texts is None:
            return None
        return sum(counts.count(text, self.turn.key) for text in texts)

    def known_history(self) -> tuple[int, int]:
        """(bytes, tokens) of the history whose KV the conversation's lease holds; (0, 0) if none is known."""
        entry = self.turn.entry
        if entry is None or not entry.history_bytes:
            return 0, 0
        return entry.history_bytes, int(entry.kv_params.get("remote_num_tokens") or 0)

    def learn(self, decode: dict | None) -> dict:
        """Teach the cost model what this turn cost (`decode`: D's report), and describe the path for the
        response."""
        turn, choice = self.turn, self.choice
        costs = turn.router.costs
        prefill = turn.prefill.get("kvturn") or {}
        for role, report in (("prefill", prefill), ("decode", decode or {})):
            costs.observe_prefill(role, report)
        if prefill:
            cached = int(prefill.get("prompt_tokens_cached") or 0)
            turn.router.prefix_memory.observe(turn.key, turn.prefill_url, cached + int(
                prefill.get("prompt_tokens_computed") or 0) + int(prefill.get("prompt_tokens_remote") or 0), cached)
        d_timing, p_timing = (decode or {}).get("timing", {}), prefill.get("timing", {})
        if turn.first_token_at is not None:
            actual = (turn.first_token_at - turn.started) * 1e3
        else:
            actual = turn.prefill_round_trip_s * 1e3 + (d_timing.get("ttft_ms") or 0.0)
        timed = {"prefill": p_timing}  # what the TTFT holds: D's part too, unless P's first token went ahead
        if turn.first_token_from != "prefill":
            timed["decode"] = d_timing
        explained = sum((t.get("prefill_compute_ms") or 0.0) + own_read_ms(role, t) for role, t in timed.items())
        shared = any(shared_steps(report) for report in (prefill, decode or {}))
        costs.observe_turn(choice, actual, explained, shared)
        if turn.prefill_round_trip_s:
            costs.prefill_request_ms.add(turn.prefill_round_trip_s * 1e3)
        prompt_tokens = reported_prompt_tokens(decode)
        known_bytes, known_tokens = self.known_history()
        costs.tokens.observe_prompt(turn.prompt_size, prompt_tokens, known_bytes, known_tokens)
        if self.counted_tokens is not None and prompt_tokens:
            if known_tokens:
                costs.tokens.observe_added(prompt_tokens - known_tokens, self.counted_tokens)
            else:
                costs.tokens.observe_template(prompt_tokens, self.counted_tokens, len(turn.body["messages"]))
        costs.observe_reuse(known_tokens, (decode or {}).get("prompt_tokens_cached") or 0)
        predicted = choice.predicted_ms[choice.path]
        if actual > 0:
            turn.router.metrics.prediction_error.labels(choice.path).observe(abs(predicted - actual) / actual)
        return {"chosen": choice.path, "policy": turn.router.config.path_policy,
                "predicted_ttft_ms": {p: round(ms, 2) for p, ms in choice.predicted_ms.items()},
                "predicted_queue_ms": round(choice.estimate.queue_ms, 2),
                "predicted_tokens_computed": choice.estimate.tokens_computed,
                "actual_ttft_ms": round(actual, 2), "other_ms": round(max(actual - explained, 0.0), 2),
                "stall_ms": round(choice.stall_ms, 2)}
