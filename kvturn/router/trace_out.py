"""`kvturn router --trace-out FILE`: one JSON line per finished turn, the traffic record `kvturn plan` reads:

    {"timestamp": ..., "conversation_id": "public:3f2a...", "prompt_tokens": 5120, "output_tokens": 48,
     "finished": ...}

`timestamp` is when the router received the turn, `finished` when its answer ended (epoch seconds). The
conversation is the router's scoped digest of the id, never what the client sent. Lines go through a queue to a
logging thread that writes the file, so a turn never waits on the disk.
"""
import json
import logging
import logging.handlers
import queue
import time

from kvturn.costmodel.reports import reported_prompt_tokens


class TraceOut:
    def __init__(self, path: str | None):
        self.listener: logging.handlers.QueueListener | None = None
        if path is None:
            return
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        lines: queue.SimpleQueue = queue.SimpleQueue()
        self.logger = logging.Logger("kvturn.trace")  # outside the logging tree: no other handler sees the lines
        self.logger.addHandler(logging.handlers.QueueHandler(lines))
        self.listener = logging.handlers.QueueListener(lines, handler)
        self.listener.start()

    def record(self, turn, decode: dict | None) -> None:
        """A finished turn, from the router's Turn and the decode worker's report of the request."""
        if self.listener is None or turn.key is None or not decode:
            return
        now = time.time()
        prompt = reported_prompt_tokens(decode)
        if prompt < 1:
            return  # a report without its prompt's counts: a line `kvturn plan` would refuse, so none
        line = {"timestamp": round(now - (time.perf_counter() - turn.started), 6), "conversation_id": turn.key,
                "prompt_tokens": prompt, "output_tokens": decode.get("completion_tokens") or 1,
                "finished": round(now, 6)}
        self.logger.info(json.dumps(line, separators=(",", ":")))

    def close(self) -> None:
        if self.listener is not None:
            self.listener.stop()  # writes what is queued
            for handler in self.listener.handlers:
                handler.close()
