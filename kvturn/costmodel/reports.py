"""What a worker's `kvturn` report of one request says, read the one way the router and the planner both read it."""

SHARED_FRACTION = 0.1  # a prefill whose steps computed more than this share of other prompts' tokens was batched
SHARED_SLACK = 16  # ...and more than this many of them (another prompt's last few tokens change little)


def reported_prompt_tokens(report: dict | None) -> int:
    """The prompt tokens a worker's report counts: computed, found in its cache and read from a peer."""
    return sum((report or {}).get(k) or 0 for k in ("prompt_tokens_computed", "prompt_tokens_cached",
                                                    "prompt_tokens_remote"))


def own_read_ms(role: str, timing: dict) -> float:
    """A worker's KV read time, less on P the engine steps that ran before the read was seen done
    (`kv_read_step_ms`: other prompts' work, which the queue model counts) and what its own step's compute covered
    (`kv_read_hidden_ms`, a read posted layer by layer). D's keeps them: its step under way is part of what a
    handoff costs the turn."""
    read_ms = timing.get("kv_read_ms") or 0.0
    if role == "prefill":
        beside = max(timing.get("kv_read_step_ms") or 0.0, 0.0) + max(timing.get("kv_read_hidden_ms") or 0.0, 0.0)
        read_ms -= min(beside, read_ms)
    return read_ms


def shared_steps(report: dict) -> bool:
    """Whether a worker's prefill shared its engine steps with other prompts (a batch): its time then tells
    more about the others than about itself, so neither the compute fit nor the correction learns from it."""
    timing = report.get("timing") or {}
    own = report.get("prompt_tokens_computed") or 0
    return (timing.get("prefill_shared_tokens") or 0) > SHARED_FRACTION * own + SHARED_SLACK
