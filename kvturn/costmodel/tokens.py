"""How many tokens a turn's prompt makes, estimated before any worker has tokenized it: from the bytes of its
messages, or from the text the router counted with the model's tokenizer plus what the chat template adds. Each
estimate learns from the decode worker's count of the real prompt."""
from kvturn.costmodel.fits import Mean, Typical

# What a byte of chat messages can make: a byte-level BPE token covers a byte or more, and a message adds a few
# template tokens. A rate outside this is not a history that grew (an id reused for another, compacted history).
TOKENS_PER_BYTE = (0.02, 1.5)
MIN_ADDED_BYTES = 32  # fewer added bytes say more about the template than about the text
# Tokens a turn adds beyond the text of its new messages (counted with --tokenizer): their template, the answer's
# end and the generation prompt, and the answer tokenized otherwise when resent. An overhead outside the bound is
# not a history that grew by those messages.
ADDED_OVERHEAD_PRIOR = 8.0
ADDED_OVERHEAD_BOUND = 1024
# A whole prompt counted so: its chat template's tokens per message (role markers, separators; a system prompt the
# template adds by itself spread over the messages). More than the bound a message is not a template.
TEMPLATE_TOKENS_PRIOR = 5.0
TEMPLATE_TOKENS_BOUND = 256


class TokenEstimator:
    def __init__(self):
        self.tokens_per_char = Mean(0.3)
        # Tokens a byte of the messages added since the conversation's last turn makes: what the new turn computes
        # is a small difference of large counts, so it is estimated from the added bytes alone (see prompt_tokens).
        self.added_tokens_per_byte = Mean(0.3)
        # With the model's tokenizer the router counts the new messages' text itself; what it cannot count (their
        # template, the answer tokenized otherwise) is this, per turn.
        self.added_overhead_tokens = Typical(ADDED_OVERHEAD_PRIOR)
        self.template_tokens_per_message = Typical(TEMPLATE_TOKENS_PRIOR)  # ...and a whole prompt's, per message

    def prompt_tokens(self, prompt_bytes: int, known_bytes: int = 0, known_tokens: int = 0) -> int:
        """The prompt's tokens, estimated from the bytes of its messages. `known_bytes` of them (the history up to
        the last answer) are known to make `known_tokens` (the decode worker's count): only the rest is estimated,
        so that a conversation whose text tokenizes unlike the average does not misjudge its new tokens."""
        if known_tokens and prompt_bytes >= known_bytes:
            # Until a turn on top of a lease has been measured, the whole prompts' rate stands in for the prior.
            added = self.added_tokens_per_byte
            per_byte = added.value if added.values else self.tokens_per_char.value
            return known_tokens + round((prompt_bytes - known_bytes) * per_byte)
        return round(prompt_bytes * self.tokens_per_char.value)

    def added_tokens(self, counted: int) -> int:
        """The tokens a turn adds to its history, from the tokens of its new messages' text (`counted`)."""
        return max(counted + round(self.added_overhead_tokens.value), 0)

    def observe_added(self, added_tokens: int, counted: int) -> None:
        """Learn from a turn whose new messages' text made `counted` tokens that it added `added_tokens` in all
        (the decode worker's count of the prompt beyond the lease's tokens)."""
        if abs(added_tokens - counted) <= ADDED_OVERHEAD_BOUND:
            self.added_overhead_tokens.add(added_tokens - counted)

    def templated_tokens(self, counted: int, messages: int) -> int:
        """A whole prompt's tokens, from the tokens of its messages' text (`counted`) and how many there are."""
        return counted + round(messages * self.template_tokens_per_message.value)

    def observe_template(self, prompt_tokens: int, counted: int, messages: int) -> None:
        """Learn from a whole prompt of `messages` messages whose text made `counted` tokens that it made
        `prompt_tokens` (the decode worker's count) once templated."""
        if messages and 0 <= prompt_tokens - counted <= TEMPLATE_TOKENS_BOUND * messages:
            self.template_tokens_per_message.add((prompt_tokens - counted) / messages)

    def observe_prompt(self, prompt_bytes: int, prompt_tokens: int, known_bytes: int = 0,
                       known_tokens: int = 0) -> None:
        """Learn from a turn's real prompt tokens (the decode worker's count) what its bytes make."""
        low, high = TOKENS_PER_BYTE
        if prompt_bytes and prompt_tokens and low <= prompt_tokens / prompt_bytes <= high:
            self.tokens_per_char.add(prompt_tokens / prompt_bytes)
        added_bytes, added_tokens = prompt_bytes - known_bytes, prompt_tokens - known_tokens
        if known_tokens and added_bytes >= MIN_ADDED_BYTES and low <= added_tokens / added_bytes <= high:
            self.added_tokens_per_byte.add(added_tokens / added_bytes)
