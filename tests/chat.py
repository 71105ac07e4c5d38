"""A multi-turn chat client for the integration tests."""
import json

import httpx

SYSTEM = "You are a careful coding agent. Follow the plan, run the tools, report results. " * 12
TOOL_RESULTS = ["ls -la: 14 files, tests/ src/ docs/", "pytest: 3 failed, 41 passed",
                "git diff: 2 files changed, 10 insertions", "make build: ok in 12 s", "curl /health: 200 ok"]


def user_message(turn: int) -> dict:
    return {"role": "user", "content": f"Tool result {turn}: {TOOL_RESULTS[turn % len(TOOL_RESULTS)]}. Next step?"}


def send(url: str, messages: list[dict], conversation_id: str | None, stream: bool, max_tokens: int = 16,
         extra: dict | None = None) -> dict:
    """One turn; returns {text, usage, kvturn} whether streamed or not."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            **(extra or {})}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        response.raise_for_status()
        result = response.json()
        return {"text": result["choices"][0]["message"]["content"], "usage": result["usage"],
                "kvturn": result.get("kvturn"), "kv_transfer_params": result.get("kv_transfer_params")}
    text, usage, kvturn, kv = [], None, None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            kvturn = chunk.get("kvturn") or kvturn
            kv = chunk.get("kv_transfer_params") or kv
            for choice in chunk.get("choices") or []:
                text.append(choice["delta"].get("content") or "")
    return {"text": "".join(text), "usage": usage, "kvturn": kvturn, "kv_transfer_params": kv}


def conversation(url: str, turns: int, conversation_id: str | None = "conv-1", start: list[dict] | None = None):
    """Run `turns` turns, alternating non-streaming and streaming; returns (messages, results)."""
    messages = list(start) if start else [{"role": "system", "content": SYSTEM}]
    results = []
    for turn in range(turns):
        messages.append(user_message(turn))
        result = send(url, messages, conversation_id, stream=turn % 2 == 1)
        results.append(result)
        messages.append({"role": "assistant", "content": result["text"]})
    return messages, results


def metric(url: str, name: str, labels: str = "") -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name + labels)
