"""A stand-in for a kvturn worker's side channel, as an attacker (or a broken peer) would run it.

`python tests/fake_peer.py PORT CONFIG LOG` serves GET /kv/agent and POST /kv/lease/{acquire,release} on
127.0.0.1:PORT and appends every request it receives (method, path, headers, body) to LOG as one JSON line.
CONFIG is a JSON file, read again on every request so a test can change the script between requests:

    {"agent": {"upstream": URL, "secret": S}      proxy a real worker's agent info (a NIXL handshake works)
            | {"status": 200, "raw": TEXT},       or answer this text
     "leases": {HANDLE: {"status": 200, "json": ANY} | {"status": 200, "raw": TEXT}},
     "health": {"status": 200, "json": ANY}}      answer GET /health so (as a worker a router probes)

An acquire for a handle the script does not name gets a 404, as a real worker answers for an unknown lease.
"""
import json
import subprocess
import sys
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SECRET_HEADER = "X-Kvturn-Cluster-Secret"


class FakePeer:
    """The test's handle on one fake peer process."""
    script = __file__  # the server it runs: `python SCRIPT PORT CONFIG LOG [ARGS...]` (tests/fake_vllm.py too)

    def __init__(self, port: int, workdir: Path, *args: str):
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.config_path = workdir / f"fake-peer-{port}.json"
        self.log_path = workdir / f"fake-peer-{port}.log"
        self.configure({})
        self.log_path.write_text("")
        self.process = subprocess.Popen([sys.executable, self.script, str(port), str(self.config_path),
                                         str(self.log_path), *args], start_new_session=True)

    def wait_listening(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"fake peer on {self.port} exited with {self.process.returncode}")
            try:
                urllib.request.urlopen(f"http://{self.address}/ready", timeout=1).read()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"fake peer on {self.port} did not start")

    def configure(self, script: dict) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(script))
        tmp.replace(self.config_path)

    def requests(self) -> list[dict]:
        """Every request received since the last `clear`, oldest first."""
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line]

    def clear(self) -> None:
        self.log_path.write_text("")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def serve(port: int, config_path: Path, log_path: Path) -> None:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, status: int, text: str, content_type: str = "application/json") -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def record(self, body: bytes) -> None:
            entry = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()),
                     "body": body.decode(errors="replace")}
            with open(log_path, "a") as log:
                log.write(json.dumps(entry) + "\n")

        def reply(self, spec: dict) -> None:
            if "json" in spec:
                self.answer(spec.get("status", 200), json.dumps(spec["json"]))
            else:
                self.answer(spec.get("status", 200), spec.get("raw", ""), "text/plain")

        def do_GET(self):
            if self.path == "/ready":  # the harness's own probe, not a peer's request
                return self.answer(200, "{}")
            self.record(b"")
            script = json.loads(config_path.read_text())
            if self.path == "/health" and "health" in script:
                return self.reply(script["health"])
            agent = script.get("agent")
            if self.path != "/kv/agent" or agent is None:
                return self.answer(404, json.dumps({"error": {"message": "no such route"}}))
            if "upstream" in agent:
                request = urllib.request.Request(agent["upstream"] + "/kv/agent",
                                                 headers={SECRET_HEADER: agent["secret"]})
                with urllib.request.urlopen(request, timeout=10) as upstream:
                    return self.answer(200, upstream.read().decode())
            self.reply(agent)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.record(body)
            script = json.loads(config_path.read_text())
            if self.path == "/kv/lease/release":
                return self.answer(200, json.dumps({"released": True}))
            if self.path != "/kv/lease/acquire":
                return self.answer(404, json.dumps({"error": {"message": "no such route"}}))
            try:
                handle = json.loads(body).get("handle")
            except ValueError:
                handle = None
            spec = script.get("leases", {}).get(handle)
            if spec is None:
                return self.answer(404, json.dumps({"error": {"message": "no live lease"}}))
            self.reply(spec)

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
