//! Log set-up: `RUST_LOG` picks levels, and the transport crates never log.
//!
//! h2, hyper, tonic's transport and rustls log what they receive from a peer
//! at debug and trace: a GOAWAY frame's debug data, PING payloads, protocol
//! errors that quote them. A hook may echo the value it was given there, and
//! a tool's frames may carry its raw output, a pre-hook value. So events
//! from those crates are dropped whatever `RUST_LOG` says, at every level;
//! Lattice's own events say which hook or tool failed and how, by kind and
//! code.
//!
//! For frame-level debugging of a connection, `LATTICE_LOG_TRANSPORT=1`
//! lets those events through (still filtered by `RUST_LOG`). It exposes
//! bytes peers sent, which may hold unredacted tool output: use it only on
//! a deployment whose data may be seen, and never leave it on.

use tracing::Metadata;
use tracing_subscriber::{EnvFilter, Layer, filter, layer::SubscriberExt, util::SubscriberInitExt};

/// The variable that lets the transport crates' events through.
pub const TRANSPORT_OPT_IN: &str = "LATTICE_LOG_TRANSPORT";

/// Crates that handle peers' bytes below gRPC (targets and their modules).
const TRANSPORT_TARGETS: &[&str] =
    &["h2", "hyper", "hyper_util", "tonic", "tower", "rustls", "reqwest", "eventsource_stream", "tokio_util", "want"];

/// Whether an event comes from a crate that handles peers' bytes.
pub fn from_transport(target: &str) -> bool {
    TRANSPORT_TARGETS
        .iter()
        .any(|t| target.strip_prefix(t).is_some_and(|rest| rest.is_empty() || rest.starts_with("::")))
}

/// The log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber: levels from `RUST_LOG` (default `info`),
/// to stderr, with the transport crates dropped unless opted in.
pub fn init(format: Format) {
    init_with(format, None);
}

/// [`init`], with the spans of [`crate::telemetry::SPAN_TARGET`] exported
/// to `tracer` (and enabled at debug, whatever `RUST_LOG` says).
pub fn init_with(format: Format, tracer: Option<opentelemetry_sdk::trace::Tracer>) {
    let mut levels = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if tracer.is_some()
        && let Ok(directive) = format!("{}=debug", crate::telemetry::SPAN_TARGET).parse()
    {
        levels = levels.add_directive(directive);
    }
    let opted_in = std::env::var(TRANSPORT_OPT_IN).is_ok_and(|v| v == "1");
    let otel = tracer.map(|t| tracing_opentelemetry::layer().with_tracer(t));
    // Colours only where a person reads them: a log file or a container's
    // log would get escape codes in every line.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = subscriber(format, levels, opted_in, ansi, std::io::stderr).with(otel).try_init();
    if opted_in {
        tracing::warn!("{TRANSPORT_OPT_IN}=1: transport crates may log bytes received from peers");
    }
}

/// The subscriber `init` installs, writing to `writer`.
///
/// Both filters are global (layers of their own, not per-layer filters), so
/// a callsite they turn off is off for good: `tracing::enabled!` says so,
/// and the h2 and hyper events on every frame cost nothing. (A per-layer
/// filter answers `enabled` with "maybe", which made the trace writer
/// serialize every event for a log line that was then dropped.)
fn subscriber<W>(
    format: Format,
    levels: EnvFilter,
    opted_in: bool,
    ansi: bool,
    writer: W,
) -> impl tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let transport = filter::filter_fn(move |m: &Metadata<'_>| opted_in || !from_transport(m.target()));
    let layer = tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(writer);
    let layer = match format {
        Format::Text => layer.boxed(),
        Format::Json => layer.json().boxed(),
    };
    tracing_subscriber::registry().with(levels).with(transport.boxed()).with(layer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_crates_and_their_modules_are_recognised() {
        for t in ["h2", "h2::proto::connection", "hyper::client", "hyper_util::client::legacy", "tonic::transport"] {
            assert!(from_transport(t), "{t}");
        }
        for t in ["lattice_server::hooks", "lattice::trace", "h2o", "tonicity", "towers"] {
            assert!(!from_transport(t), "{t}");
        }
    }

    #[test]
    fn a_level_that_is_off_is_off_for_enabled_too() {
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let sink = lines.clone();
        let writer = move || Sink(sink.clone());
        let s = subscriber(Format::Text, EnvFilter::new("info"), false, false, writer);
        tracing::subscriber::with_default(s, || {
            // What `Tracer::emit` asks before it serializes anything.
            assert!(!tracing::enabled!(target: "lattice::trace", tracing::Level::DEBUG));
            assert!(tracing::enabled!(target: "lattice::trace", tracing::Level::INFO));
            assert!(!tracing::enabled!(target: "h2::codec", tracing::Level::ERROR));
            tracing::info!(target: "h2::codec", "from the transport");
            tracing::info!(target: "lattice_server::hooks", "ours");
        });
        let text = String::from_utf8(lines.lock().unwrap().clone()).unwrap();
        assert!(text.contains("ours"), "{text}");
        assert!(!text.contains("from the transport"), "{text}");

        // No level lets the transport crates through without the opt-in.
        let sink = lines.clone();
        let s = subscriber(Format::Text, EnvFilter::new("trace"), false, false, move || Sink(sink.clone()));
        tracing::subscriber::with_default(s, || {
            assert!(!tracing::enabled!(target: "h2::proto", tracing::Level::TRACE));
            tracing::trace!(target: "hyper::proto", "frame bytes");
            tracing::trace!(target: "lattice_server::peer", "ours at trace");
        });
        let text = String::from_utf8(lines.lock().unwrap().clone()).unwrap();
        assert!(text.contains("ours at trace"), "{text}");
        assert!(!text.contains("frame bytes"), "{text}");
    }

    /// Text lines written anywhere but a terminal carry no colour codes
    /// (they are read from files and container logs), and do on one.
    #[test]
    fn text_lines_are_coloured_only_for_a_terminal() {
        let lines = |ansi| {
            let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
            let sink = lines.clone();
            let s = subscriber(Format::Text, EnvFilter::new("info"), false, ansi, move || Sink(sink.clone()));
            tracing::subscriber::with_default(s, || tracing::info!(elapsed_ms = 3, "hook answered"));
            let text = lines.lock().unwrap().clone();
            String::from_utf8(text).unwrap()
        };
        let plain = lines(false);
        assert!(plain.contains("hook answered"), "{plain}");
        assert!(!plain.contains('\u{1b}'), "{plain:?}");
        assert!(lines(true).contains('\u{1b}'));
    }

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
