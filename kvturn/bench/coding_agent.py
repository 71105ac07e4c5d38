"""A coding agent's sessions, shaped like the public coding-agent traces (Codex on SWE-bench Pro: median 33 turns,
context growing from ~12k to ~80k tokens, think time median 5.2 s and p99 81 s; Claude Code traces up to 100k)
and scaled to what one machine serves: ~20 turns, a context that starts near 1/8 of its final size and grows by a
tool result a turn (most of 100-2,000 tokens, some of 4-8k: a whole file, a test log), answers of 50-400 tokens,
and heavy-tailed think times between turns.

Every token count is given for a context of `full_context_tokens` and scales with the largest context asked for
(`kvturn bench --max-prompt-tokens`), so a small cap keeps the shape (turns, growth, tail) at smaller sizes; a
turn that would still overflow the cap ends its session.
"""
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from kvturn.bench.workload import Conversation, TextSource, Turn

# what the chat template adds around each message, and how much a text may re-tokenize longer than drawn
MESSAGE_OVERHEAD_TOKENS = 8
RETOKENIZE_MARGIN = 1.1
MIN_SCALED_TOKENS = 8


@dataclass(frozen=True, slots=True)
class CodingAgentShape:
    turns: int = 20
    full_context_tokens: int = 32768  # the context the token counts below are written for
    start_tokens: int = 4096  # system prompt (tools, repository summary) and the task
    tool_result_tokens: tuple[int, int] = (100, 2000)  # most turns; log-uniform, small results commoner
    large_tool_result_tokens: tuple[int, int] = (4000, 8000)
    large_tool_result_share: float = 0.1
    answer_tokens: tuple[int, int] = (50, 400)
    think_median_s: float = 5.2
    think_p99_s: float = 81.0
    think_max_s: float = 300.0  # one gap at most (the decode lease outlives it by default)


@dataclass(frozen=True, slots=True)
class PlannedTurn:
    user_tokens: int
    answer_tokens: int
    gap_s: float


def think_time_sigma(median_s: float, p99_s: float) -> float:
    """The lognormal's sigma whose median and 99th percentile are these."""
    return math.log(p99_s / median_s) / NormalDist().inv_cdf(0.99)


def plan_session(shape: CodingAgentShape, rng: np.random.Generator, max_context_tokens: int) -> list[PlannedTurn]:
    """One session's turns as token counts and gaps (no text): turn 0 is the task, every later one a tool result.
    Prompt plus answer of every turn stays within `max_context_tokens`, counting template and re-tokenizing."""
    scale = max_context_tokens / shape.full_context_tokens
    answer_scale = min(scale, 1.0)  # answers are decode work, never longer than the traces'
    sigma = think_time_sigma(shape.think_median_s, shape.think_p99_s)
    turns, context = [], 0
    for index in range(shape.turns):
        if index == 0:
            user = shape.start_tokens * scale
        elif rng.random() < shape.large_tool_result_share:
            user = rng.uniform(*shape.large_tool_result_tokens) * scale
        else:
            low, high = shape.tool_result_tokens
            user = math.exp(rng.uniform(math.log(low), math.log(high))) * scale
        answer = rng.uniform(*shape.answer_tokens) * answer_scale
        gap = 0.0 if index == 0 else min(float(rng.lognormal(math.log(shape.think_median_s), sigma)),
                                         shape.think_max_s)
        planned = PlannedTurn(max(int(user), MIN_SCALED_TOKENS), max(int(answer), MIN_SCALED_TOKENS), gap)
        context += planned.user_tokens + planned.answer_tokens
        if context * RETOKENIZE_MARGIN + MESSAGE_OVERHEAD_TOKENS * 2 * (index + 1) > max_context_tokens:
            break
        turns.append(planned)
    return turns


def prompt_tokens(turns: list[PlannedTurn]) -> list[int]:
    """The prompt each turn sends, in drawn tokens: every earlier turn and answer, and its own text."""
    prompts, context = [], 0
    for turn in turns:
        prompts.append(context + turn.user_tokens)
        context += turn.user_tokens + turn.answer_tokens
    return prompts


def coding_agent(source: TextSource, seed: int, max_context_tokens: int, sessions: int,
                 shape: CodingAgentShape = CodingAgentShape()) -> list[Conversation]:
    """`sessions` coding-agent conversations; the task is the system prompt, tool results the user turns."""
    rng = np.random.default_rng(seed)
    conversations = []
    for i in range(sessions):
        planned = plan_session(shape, rng, max_context_tokens)
        if not planned:
            raise ValueError(f"a coding-agent session does not fit in {max_context_tokens} tokens")
        conv = Conversation(f"coding-{seed}-{i}", source.text(rng, planned[0].user_tokens))
        conv.turns.append(Turn("Begin with the failing test.", planned[0].answer_tokens))
        for turn in planned[1:]:
            conv.turns.append(Turn(source.text(rng, turn.user_tokens), turn.answer_tokens, turn.gap_s))
        conversations.append(conv)
    return conversations
