"""OpenTelemetry traces, one per turn: the router's span, with the prefill and decode workers' spans as its children
(the router hands them W3C `traceparent` on its calls; a client's own `traceparent` makes the router's span its
child in turn).

Off unless asked: `--otlp-traces-endpoint URL` (vLLM's flag), or the standard OpenTelemetry environment
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`, with `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_*` read by the SDK as usual; `OTEL_SDK_DISABLED=true`
or `OTEL_TRACES_EXPORTER=none` keep it off). Off, no OpenTelemetry module is imported and a turn pays one None check.
Spans go out over OTLP/HTTP (protobuf) in batches, from a thread of the SDK's.
"""
import os
import time

TRACEPARENT = "traceparent"


def wanted(endpoint: str | None, env=os.environ) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


class Tracing:
    """The process's tracer and exporter; made only when traces are wanted (`start` returns None otherwise)."""

    def __init__(self, component: str, endpoint: str | None):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attributes = {"kvturn.component": component}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = f"kvturn-{component}"
        self.provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
        self.tracer = self.provider.get_tracer("kvturn")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def start(cls, component: str, endpoint: str | None = None) -> "Tracing | None":
        return cls(component, endpoint) if wanted(endpoint) else None

    def parent(self, headers):
        """The context a caller's `traceparent` names (none: a new trace)."""
        return self.propagator.extract({TRACEPARENT: headers[TRACEPARENT]}) if TRACEPARENT in headers else None

    def open_span(self, name: str, parent=None, start_time_ns: int | None = None, server: bool = True):
        from opentelemetry.trace import SpanKind
        return self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                                      start_time=start_time_ns)

    def headers_for(self, span) -> dict[str, str]:
        """`traceparent` (and `tracestate`) that make a worker's span a child of `span`."""
        from opentelemetry.trace import set_span_in_context
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        return carrier

    def close(self) -> None:
        """Export what is still queued."""
        self.provider.shutdown()


def end_span(span, attributes: dict, failed: str | None = None, end_time_ns: int | None = None) -> None:
    """Set `attributes` (None values left out, as OpenTelemetry refuses them) and end the span; `failed`: why it
    failed, if it did."""
    from opentelemetry.trace import Status, StatusCode
    span.set_attributes({name: value for name, value in attributes.items() if value is not None})
    if failed:
        span.set_status(Status(StatusCode.ERROR, failed))
    span.end(end_time=end_time_ns)


def wall_ns(perf_counter_s: float) -> int:
    """A time.perf_counter() reading as epoch nanoseconds, which spans carry."""
    return time.time_ns() - int((time.perf_counter() - perf_counter_s) * 1e9)


def seconds(ms) -> float | None:
    return ms / 1e3 if isinstance(ms, (int, float)) else None
