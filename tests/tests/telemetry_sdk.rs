//! A hook written with `lattice-hook-sdk` (feature `opentelemetry`) that
//! exports its own spans continues the query's trace: its `hook_call` span
//! is a child of Lattice's `hook` span. (A file of its own: the hook's
//! exporter is this test process's global tracing subscriber.)

use lattice_hook_sdk::{Hook, Status, ToolResultBlock, ToolResultCall};
use lattice_tests::{
    Lattice, cfg,
    otlp::Collector,
    tool::{ToolDef, ToolServer},
};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use tokio::sync::oneshot;
use tracing_subscriber::layer::SubscriberExt;

/// Logs inside the call (which the SDK's span wraps) and replaces the text.
struct Clean;

#[lattice_hook_sdk::async_trait]
impl Hook for Clean {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        assert!(call.trace.is_some(), "Lattice sends the trace context");
        tracing::info!("cleaning");
        Ok(Some(call.replace_text("clean")))
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_sdk_hook_continues_the_query_trace() {
    let collector = Collector::start().await;
    // The hook author's set-up: an OTLP exporter behind tracing.
    let exporter =
        opentelemetry_otlp::SpanExporter::builder().with_tonic().with_endpoint(collector.url.clone()).build().unwrap();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_span_processor(
            opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter)
                .with_batch_config(
                    opentelemetry_sdk::trace::BatchConfigBuilder::default()
                        .with_scheduled_delay(std::time::Duration::from_millis(100))
                        .build(),
                )
                .build(),
        )
        .with_resource(opentelemetry_sdk::Resource::builder().with_service_name("clean-hook").build())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("clean-hook")))
        .with(tracing_subscriber::filter::Targets::new().with_target("lattice_hook_sdk", tracing::Level::INFO));
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let (listener, addr) = lattice_tests::bind().await;
    let (_stop, stopped) = oneshot::channel::<()>();
    let server = lattice_hook_sdk::Server::new(Clean).drain(std::time::Duration::ZERO);
    tokio::spawn(server.serve_on(listener, async {
        let _ = stopped.await;
    }));
    let tools = ToolServer::start(vec![ToolDef::new("t", "raw")]).await;
    let config = format!("[telemetry]\notlp_endpoint = {:?}\n", collector.url)
        + &cfg::agent("x", "")
        + &cfg::turn("go", &["t"])
        + &cfg::turn("saw {{last_tool_result}}", &[])
        + &cfg::tools(&tools.url, 2000)
        + &cfg::hook("clean", &format!("http://{addr}"), &["tool_result"], 2000);
    let lattice = Lattice::spawn(&config, &[("OTEL_BSP_SCHEDULE_DELAY", "100")]).await;
    assert_eq!(lattice.query("x", "go").await.expect_ok().text, "saw clean");

    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let (hook_call, lattice_hook) = loop {
        let spans = collector.spans();
        let call = spans.iter().find(|s| s.name == "hook_call" && s.service == "clean-hook").cloned();
        let ours = spans.iter().find(|s| s.name == "hook" && s.service == "lattice").cloned();
        if let (Some(c), Some(h)) = (call, ours) {
            break (c, h);
        }
        assert!(std::time::Instant::now() < deadline, "spans: {spans:#?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(hook_call.trace_id, lattice_hook.trace_id, "one trace");
    assert_eq!(hook_call.parent_span_id, lattice_hook.span_id, "the hook's span is a child of Lattice's");
    assert_eq!(hook_call.attributes.get("rpc").map(String::as_str), Some("OnToolResult"));
    let _ = provider.shutdown();
}
