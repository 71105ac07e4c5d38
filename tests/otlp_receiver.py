"""A real OTLP/HTTP trace receiver for the tests: an HTTP server on loopback that decodes what exporters POST to
/v1/traces (protobuf ExportTraceServiceRequest, opentelemetry-proto's classes) and keeps every span, as a collector
would receive them."""
import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class OTLPReceiver:
    def __init__(self):
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append({"name": span.name, "service": resource.get("service.name"),
                                  "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                                  "parent_span_id": span.parent_span_id.hex() or None,
                                  "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                                  "status": span.status.code,
                                  "attributes": {a.key: _value(a.value) for a in span.attributes},
                                  "events": [(e.name, {a.key: _value(a.value) for a in e.attributes})
                                             for e in span.events]})
        with self._lock:
            self.spans.extend(spans)

    def received(self) -> list[dict]:
        with self._lock:
            return list(self.spans)

    def __enter__(self) -> "OTLPReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
