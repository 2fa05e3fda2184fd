//! OpenTelemetry: a query is one trace, exported over OTLP/gRPC.
//!
//! On when `[telemetry] otlp_endpoint` is set, or when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is
//! (`OTEL_SDK_DISABLED=true` turns it off either way). The other `OTEL_*`
//! variables apply as the OpenTelemetry SDK reads them (`OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, …); the
//! config's keys win over them.
//!
//! The spans are tracing spans on the target [`SPAN_TARGET`], exported by
//! `tracing-opentelemetry`: `query` → `turn` → `hook` (each OnModelRequest
//! call), `model_request`, `tool_call` → `hook` (each OnToolResult call).
//! Their attributes are names, counts, sizes, codes and outcomes, never a
//! payload. Each hook call, tool call and model HTTP request carries the
//! W3C `traceparent` of its span, so the services' own spans join the
//! trace; a client's `traceparent` on `Query` makes the query part of the
//! client's trace.
//!
//! Off, nothing here costs more than a relaxed atomic load per call.

pub use crate::config::TelemetrySettings;

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::{
    global,
    propagation::{Extractor, Injector},
    trace::TracerProvider as _,
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::{
    Resource,
    propagation::TraceContextPropagator,
    trace::{Sampler, SdkTracerProvider},
};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The target of the spans that are exported; `lattice serve` enables it
/// at debug level when telemetry is on, whatever `RUST_LOG` says.
pub const SPAN_TARGET: &str = "lattice::otel";

impl TelemetrySettings {
    /// Whether spans are exported: an endpoint in the config or in the
    /// environment, and the SDK not disabled.
    pub fn enabled(&self, env: &dyn Fn(&str) -> Option<String>) -> bool {
        let set = |v: &str| env(v).is_some_and(|v| !v.trim().is_empty());
        let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        !disabled
            && (self.otlp_endpoint.is_some()
                || set("OTEL_EXPORTER_OTLP_ENDPOINT")
                || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (and trace context propagated).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Flushes the spans still queued when dropped (at shutdown).
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// Starts the exporter; returns the tracer for the `tracing` layer and the
/// guard that flushes at shutdown. Needs a Tokio runtime (the exporter's
/// gRPC channel lives on it).
pub fn start(settings: &TelemetrySettings) -> Result<(opentelemetry_sdk::trace::Tracer, Telemetry), String> {
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic();
    if let Some(endpoint) = &settings.otlp_endpoint {
        exporter = exporter.with_endpoint(endpoint.clone());
    }
    let exporter = exporter.build().map_err(|e| format!("OTLP exporter: {e}"))?;
    let service_name = settings
        .service_name
        .clone()
        .or_else(|| std::env::var("OTEL_SERVICE_NAME").ok().filter(|s| !s.trim().is_empty()))
        .unwrap_or_else(|| "lattice".to_owned());
    let resource = Resource::builder()
        .with_service_name(service_name)
        .with_attribute(opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    let mut provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource);
    if let Some(ratio) = settings.sampling_ratio {
        provider = provider.with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio))));
    }
    let provider = provider.build();
    let tracer = provider.tracer("lattice");
    global::set_text_map_propagator(TraceContextPropagator::new());
    ENABLED.store(true, Ordering::Relaxed);
    Ok((tracer, Telemetry { provider }))
}

struct MetadataCarrier<'a>(&'a mut MetadataMap);

impl Injector for MetadataCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value.as_str())) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataView<'a>(&'a MetadataMap);

impl Extractor for MetadataView<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct HeaderCarrier<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(key.as_bytes()), http::HeaderValue::from_str(&value)) {
            self.0.insert(k, v);
        }
    }
}

/// Adds `span`'s `traceparent` to an outgoing gRPC request.
pub fn inject(span: &tracing::Span, metadata: &mut MetadataMap) {
    if enabled() {
        let cx = span.context();
        global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetadataCarrier(metadata)));
    }
}

/// Adds the current span's `traceparent` to an outgoing HTTP request.
pub fn inject_headers(headers: &mut http::HeaderMap) {
    if enabled() {
        let cx = tracing::Span::current().context();
        global::get_text_map_propagator(|p| p.inject_context(&cx, &mut HeaderCarrier(headers)));
    }
}

/// The trace an incoming request's `traceparent` names, if any.
pub fn incoming(metadata: &MetadataMap) -> Option<opentelemetry::Context> {
    (enabled() && metadata.contains_key("traceparent"))
        .then(|| global::get_text_map_propagator(|p| p.extract(&MetadataView(metadata))))
}

/// Makes `span` a child of `parent` (from [`incoming`]).
pub fn set_parent(span: &tracing::Span, parent: Option<opentelemetry::Context>) {
    if let Some(cx) = parent {
        let _ = span.set_parent(cx);
    }
}
