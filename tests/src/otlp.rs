//! An OTLP/gRPC trace receiver on loopback: what an OpenTelemetry
//! collector would get from Lattice, decoded with the `opentelemetry-proto`
//! types.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{AnyValue, any_value::Value},
};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

/// One exported span, flattened.
#[derive(Debug, Clone)]
pub struct SpanRecord {
    /// `service.name` of its resource.
    pub service: String,
    /// Its name.
    pub name: String,
    /// Trace id, hex.
    pub trace_id: String,
    /// Span id, hex.
    pub span_id: String,
    /// Parent span id, hex ("" for a root).
    pub parent_span_id: String,
    /// Start, in ns since the epoch.
    pub start: u64,
    /// Attributes, as text.
    pub attributes: BTreeMap<String, String>,
    /// Status code (0 unset, 1 ok, 2 error).
    pub status: i32,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[derive(Default, Clone)]
struct Receiver(Arc<Mutex<Vec<SpanRecord>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(&kv.value))
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                spans.push(SpanRecord {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    start: span.start_time_unix_nano,
                    attributes: span.attributes.iter().map(|kv| (kv.key.clone(), text(&kv.value))).collect(),
                    status: span.status.map(|s| s.code).unwrap_or_default(),
                });
            }
        }
        Ok(Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A running receiver; stops when dropped.
pub struct Collector {
    /// `http://127.0.0.1:PORT`: the `otlp_endpoint`.
    pub url: String,
    spans: Arc<Mutex<Vec<SpanRecord>>>,
    _stop: oneshot::Sender<()>,
}

impl Collector {
    /// Starts one on a free loopback port.
    pub async fn start() -> Collector {
        let receiver = Receiver::default();
        let spans = receiver.0.clone();
        let (listener, addr) = crate::bind().await;
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(receiver))
                .serve_with_incoming_shutdown(lattice_server::incoming(listener), async {
                    let _ = stopped.await;
                }),
        );
        Collector { url: format!("http://{addr}"), spans, _stop: stop }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<SpanRecord> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of `trace_id`, once `ready` says they are all there (or
    /// after 10 s, whatever has arrived).
    pub async fn trace(&self, trace_id: &str, ready: impl Fn(&[SpanRecord]) -> bool) -> Vec<SpanRecord> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let spans: Vec<SpanRecord> = self.spans().into_iter().filter(|s| s.trace_id == trace_id).collect();
            if ready(&spans) || Instant::now() > deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
