"""Start a worker on the embedded model and hold a short multi-turn chat, printing TTFT per turn."""
import json
import time

import httpx

from kvturn import launch
from kvturn.model.make_model import default_model_dir

def main() -> None:
    model_dir = default_model_dir()
    port = launch.free_port()
    url = f"http://127.0.0.1:{port}"
    worker = launch.start(["worker", "--port", str(port), "--model", str(model_dir)])
    try:
        launch.wait_healthy(url, worker)
        messages = [{"role": "system", "content": "You are a coding agent. " * 40}]
        with httpx.Client(timeout=120) as client:
            for turn in range(1, 6):
                messages.append({"role": "user", "content": f"Step {turn}: run the tests and report. " * 10})
                sent = time.perf_counter()
                ttft, text = None, []
                with client.stream("POST", f"{url}/v1/chat/completions", json={
                        "messages": messages, "max_tokens": 32, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue

                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for choice in chunk.get("choices", []):
                            if choice["delta"].get("content"):
                                ttft = ttft or time.perf_counter() - sent
                                text.append(choice["delta"]["content"])
                messages.append({"role": "assistant", "content": "".join(text)})
                print(f"turn {turn}: prompt {usage['prompt_tokens']:5d} tokens, cached "
                      f"{usage['prompt_tokens_details']['cached_tokens']:5d}, TTFT {ttft * 1e3:7.1f} ms")
    finally:
        launch.stop(worker)

if __name__ == "__main__":
    main()
