"""A real worker process driven over HTTP, with the official openai client and raw requests."""
import time

import httpx
import openai
import pytest

from kvturn import launch


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    """(URL, log file) of a worker process."""
    port = launch.free_port()
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    process = launch.start(["worker", "--port", str(port), "--model", str(tiny_model_dir), "--kv-cache-mb", "64",
                            "--max-model-len", "4096", "--served-model-name", "tiny", "--no-calibrate"], log)
    url = f"http://127.0.0.1:{port}"
    launch.wait_healthy(url, process)
    yield url, log
    launch.stop(process)
    assert process.returncode in (0, -15), log.read_text()[-3000:]  # uvicorn re-raises SIGTERM after a clean shutdown


@pytest.fixture(scope="module")
def worker_url(worker):
    return worker[0]


@pytest.fixture
def client(worker_url):
    return openai.OpenAI(base_url=f"{worker_url}/v1", api_key="unused")


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion_non_streaming(client):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 0


def test_streaming_chat_equals_non_streaming(client):
    messages = [{"role": "user", "content": "write a function that adds two numbers"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16


def test_completions_accept_text_and_token_ids(client):
    by_text = client.completions.create(model="tiny", prompt="def main():", max_tokens=6, temperature=0)
    ids = by_text.usage.prompt_tokens
    assert ids > 0
    by_ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
    assert by_ids.usage.prompt_tokens == 4


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "import os\n" * 40
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_streaming_completion_ends_with_done(worker_url):
    with httpx.stream("POST", f"{worker_url}/v1/completions",
                      json={"prompt": "x = 1", "max_tokens": 4, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("body,status,fragment", [
    ("{not json", 400, "malformed JSON"),
    ('{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    ('{"prompt": "x", "max_tokens": -5}', 400, "max_tokens"),
    ('{"prompt": "x", "temperature": 9}', 400, "temperature"),
    ('{"prompt": "x", "max_tokens": 5000}', 400, "maximum context length is 4096"),
    ('{"prompt": [1, 2, 999999]}', 400, "token ids"),
    ('{"prompt": "x", "model": "gpt-9"}', 404, "does not exist"),
    ('{"max_tokens": 3}', 400, "prompt"),
    ('{"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}', 400, "remote_host"),
])
def test_bad_input_gets_an_openai_style_error(worker_url, body, status, fragment):
    response = httpx.post(f"{worker_url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["code"] == status and error["type"]


def test_openai_client_raises_on_unknown_model(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_client_disconnect_mid_stream_frees_its_blocks(worker_url):
    with httpx.stream("POST", f"{worker_url}/v1/completions",
                      json={"prompt": "long story " * 50, "max_tokens": 3000, "stream": True,
                            "ignore_eos": True}) as response:
        lines = response.iter_lines()  # kept referenced: a dropped iterator closes the response
        for _ in range(6):
            next(lines)
        assert metric(worker_url, "kvturn_requests_running") == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(worker_url, "kvturn_requests_running") > 0:
        time.sleep(0.1)
    assert metric(worker_url, "kvturn_requests_running") == 0
    assert metric(worker_url, "kvturn_kv_blocks_used") == 0


def test_a_client_that_leaves_a_whole_answer_early_frees_its_blocks_without_an_error(worker):
    """The worker notices the client left (it checks every 0.5 s while it waits for tokens) and aborts the request;
    closing the request's outputs must wait for that cancellation, or it fails and logs an unhandled error."""
    url, log = worker
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "long story " * 50, "max_tokens": 3000,
                                                  "ignore_eos": True}, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(url, "kvturn_requests_running") > 0:
        time.sleep(0.1)
    assert metric(url, "kvturn_requests_running") == 0 and metric(url, "kvturn_kv_blocks_used") == 0
    assert "unhandled error" not in log.read_text()


def test_metrics_count_tokens_and_ttft(worker_url):
    httpx.post(f"{worker_url}/v1/completions", json={"prompt": "metrics", "max_tokens": 2})
    assert metric(worker_url, "kvturn_prompt_tokens_total") > 0
    assert metric(worker_url, "kvturn_time_to_first_token_seconds_count") > 0
    assert metric(worker_url, "kvturn_kv_blocks_free") > 0
