"""The worker's tokenizer under prompts too long for any context: found too long piece by piece, never wrongly, and
tokenized on several threads at once with the same ids as on one."""
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvturn.model.tokenizer import COUNT_PIECE_CHARS, ChatTokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "kvturn", "prefill", "decode", "lease", "  tensor", "\n\nrouter"]


def words(count: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> ChatTokenizer:
    return ChatTokenizer(tiny_model_dir)


@pytest.mark.parametrize("text", [words(25_000), "=" * 70_000, "x" * 70_000, words(15_000) + "<|im_end|>" * 9])
def test_a_text_is_never_found_too_long_for_the_tokens_it_makes(tokenizer, text):
    tokens = len(tokenizer.encode(text))
    assert not tokenizer.exceeds(text, tokens)
    assert tokenizer.exceeds(text, tokens // 2)


def test_a_text_far_too_long_is_found_so_from_its_first_pieces(tokenizer, monkeypatch):
    seen = []
    ids = tokenizer._ids
    monkeypatch.setattr(tokenizer, "_ids", lambda text: seen.append(len(text)) or ids(text))
    assert tokenizer.exceeds("alpha beta gamma " * 600_000, 16_384)  # 10 MB
    assert sum(seen) <= 4 * COUNT_PIECE_CHARS  # 16k tokens of these words fill ~2.5 pieces


def test_prompts_tokenized_on_several_threads_at_once_get_the_ids_of_one(tokenizer):
    texts = [f"<|im_start|>user\n{words(2_000, seed)}<|im_end|>" for seed in range(8)] * 4
    alone = [ChatTokenizer.encode(tokenizer, text) for text in texts]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(tokenizer.encode, texts)) == alone
