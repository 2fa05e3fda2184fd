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

pub use lattice_proto::logs::{Format, TRANSPORT_OPT_IN, from_transport};
use lattice_proto::logs::{OPTED_IN_WARNING, subscriber, transport_opted_in};
use tracing_subscriber::{EnvFilter, layer::SubscriberExt, util::SubscriberInitExt};

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
    let opted_in = transport_opted_in();
    let otel = tracer.map(|t| tracing_opentelemetry::layer().with_tracer(t));
    // Colours only where a person reads them: a log file or a container's
    // log would get escape codes in every line.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = subscriber(format, levels, opted_in, ansi, std::io::stderr).with(otel).try_init();
    if opted_in {
        tracing::warn!("{OPTED_IN_WARNING}");
    }
}

#[cfg(test)]
mod tests {
    use std::fmt;

    use super::{capture::*, *};

    #[test]
    fn transport_crates_and_their_modules_are_recognised() {
        for t in [
            "h2",
            "h2::proto::connection",
            "hyper::client",
            "hyper_util::client::legacy",
            "tonic::transport",
            "tokio_postgres::query",
            // deadpool-postgres names its target with a dot.
            "deadpool.postgres",
        ] {
            assert!(from_transport(t), "{t}");
        }
        for t in ["lattice_server::hooks", "lattice::trace", "h2o", "tonicity", "towers", "deadpools"] {
            assert!(!from_transport(t), "{t}");
        }
    }

    #[test]
    fn a_level_that_is_off_is_off_for_enabled_too() {
        let text = captured(text("info", false), || {
            // What `Tracer::emit` asks before it serializes anything.
            assert!(!tracing::enabled!(target: "lattice::trace", tracing::Level::DEBUG));
            assert!(tracing::enabled!(target: "lattice::trace", tracing::Level::INFO));
            assert!(!tracing::enabled!(target: "h2::codec", tracing::Level::ERROR));
            tracing::info!(target: "h2::codec", "from the transport");
            tracing::info!(target: "lattice_server::hooks", "ours");
        });
        assert!(text.contains("ours"), "{text}");
        assert!(!text.contains("from the transport"), "{text}");

        // No level lets the transport crates through without the opt-in.
        let text = captured(self::text("trace", false), || {
            assert!(!tracing::enabled!(target: "h2::proto", tracing::Level::TRACE));
            tracing::trace!(target: "hyper::proto", "frame bytes");
            tracing::trace!(target: "lattice_server::peer", "ours at trace");
        });
        assert!(text.contains("ours at trace"), "{text}");
        assert!(!text.contains("frame bytes"), "{text}");
    }

    /// Text lines written anywhere but a terminal carry no colour codes
    /// (they are read from files and container logs), and do on one.
    #[test]
    fn text_lines_are_coloured_only_for_a_terminal() {
        let lines = |ansi| captured(text("info", ansi), || tracing::info!(elapsed_ms = 3, "hook answered"));
        let plain = lines(false);
        assert!(plain.contains("hook answered"), "{plain}");
        assert!(!plain.contains('\u{1b}'), "{plain:?}");
        assert!(lines(true).contains('\u{1b}'));
    }

    /// The text format's fields read exactly as tracing-subscriber's
    /// default writes them, with colours and without, wherever the default keeps an
    /// event on one line (see the next test): every kind of value, the
    /// message, escapes, errors with their sources, `r#` and `log.` names,
    /// fields recorded after a span was made, spans in spans.
    #[test]
    fn plain_fields_read_as_the_default_fields() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "outer \u{1b}[1m failure")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let emit = || {
            let span = tracing::info_span!(
                "query",
                otel.kind = "server",
                agent = %"x",
                session_id = %"ab\"c",
                budget_ms = 120_000u64,
                outcome = tracing::field::Empty,
            );
            let _entered = span.enter();
            span.record("outcome", "OK");
            tracing::info!(turns = 2, input_tokens = 260u64, elapsed_ms = 4, "query succeeded");
            tracing::info_span!("hook", hook = %"redact", r#type = "t").in_scope(|| {
                tracing::warn!(
                    code = "ABORTED",
                    error = %"a \"quoted\"\t thing",
                    kind = ?Some(3),
                    flag = true,
                    neg = -5i64,
                    ratio = 0.5f64,
                    "hook failed"
                );
                tracing::info!("escapes \u{1b}[31m red {} \u{9b}", "x\u{7}");
                tracing::info!(text = "a\u{1b}[0m\t", empty = "", "m");
                tracing::info!(log.target = "left out", after = 1, "log fields");
                tracing::info!(a = 1);
                let err = Outer(std::io::Error::other("inner \u{1b} cause"));
                tracing::error!(error = &err as &(dyn std::error::Error + 'static), "with sources");
            });
            tracing::info_span!("empty").in_scope(|| tracing::info!("in a span without fields"));
        };
        let read = |ours: bool, ansi: bool| {
            let logged = if ours {
                captured(text("info", ansi), emit)
            } else {
                let default = |w| {
                    let layer = tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(w);
                    tracing_subscriber::registry().with(EnvFilter::new("info")).with(layer)
                };
                captured(default, emit)
            };
            // Each line without its timestamp.
            logged.lines().map(|l| l.split_once(' ').map_or(l, |(_, rest)| rest).to_owned()).collect::<Vec<_>>()
        };
        let (plain, default) = (read(true, false), read(false, false));
        assert_eq!(plain, default);
        assert_eq!(plain.len(), 8, "one line per event: {plain:#?}");
        assert!(plain.iter().all(|l| !l.contains('\u{1b}')), "{plain:#?}");
        // And with colours, as on a terminal.
        let (coloured, default) = (read(true, true), read(false, true));
        assert_eq!(coloured, default);
        assert_eq!(coloured.len(), 8, "one line per event: {coloured:#?}");
        assert!(coloured.iter().all(|l| l.contains("\u{1b}[")), "{coloured:#?}");
    }

    /// One event is one line: a line break or another control character
    /// in a value or in the message is escaped, so no text a peer or a
    /// model provider puts in an error can start what reads as a log line
    /// of its own.
    /// With colours too (on a terminal, where an escape sequence in a
    /// value would act on the terminal itself): the colour codes are the
    /// subscriber's own, around names and `=`, never a value's.
    #[test]
    fn one_event_is_one_line_whatever_its_values_hold() {
        for ansi in [false, true] {
            let text = captured(text("info", ansi), || {
                let forged = "bad\n2026-01-01T00:00:00.000000Z  INFO forged\r\u{1b}[2K\u{0}";
                tracing::warn!(error = %forged, code = "x", "query failed: {}", "two\nlines");
                let err = std::io::Error::other("disk\nfull");
                tracing::warn!(error = &err as &(dyn std::error::Error + 'static), "trace not written");
            });
            assert_eq!(text.lines().count(), 2, "one line per event: {text:?}");
            let (name, eq) = if ansi { ("\u{1b}[3merror\u{1b}[0m", "\u{1b}[2m=\u{1b}[0m") } else { ("error", "=") };
            let forged = format!(r"{name}{eq}bad\n2026-01-01T00:00:00.000000Z  INFO forged\r\x1b[2K\x00");
            assert!(text.contains(&forged), "{text:?}");
            assert!(text.contains(r"query failed: two\nlines"), "{text:?}");
            assert!(text.contains(&format!(r"trace not written {name}{eq}disk\nfull")), "{text:?}");
            // Every escape sequence is one of the subscriber's styles.
            let styles = ["[0m", "[1m", "[2m", "[3m", "[32m", "[33m", "[34m", "[35m", "[31m"];
            for seq in text.split('\u{1b}').skip(1) {
                assert!(styles.iter().any(|s| seq.starts_with(s)), "{seq:?} in {text:?}");
            }
        }
    }
}

/// What code under test logs, through Lattice's own subscriber.
#[cfg(test)]
pub(crate) mod capture {
    use super::*;

    /// Where the captured subscribers write.
    #[derive(Clone, Default)]
    pub(crate) struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Lines {
        type Writer = Sink;

        fn make_writer(&'a self) -> Sink {
            Sink(self.0.clone())
        }
    }

    /// What `emit` logs through the subscriber `make` builds on a writer.
    pub(crate) fn captured<S>(make: impl FnOnce(Lines) -> S, emit: impl FnOnce()) -> String
    where
        S: tracing::Subscriber + Send + Sync + 'static,
    {
        let lines = Lines::default();
        tracing::subscriber::with_default(make(lines.clone()), emit);
        let bytes = lines.0.lock().map(|l| l.clone()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Lattice's subscriber in text at `levels`, with colours or not.
    pub(crate) fn text(levels: &str, ansi: bool) -> impl FnOnce(Lines) -> Box<dyn tracing::Subscriber + Send + Sync> {
        let levels = EnvFilter::new(levels);
        move |w| Box::new(subscriber(Format::Text, levels, false, ansi, w))
    }

    pub(crate) struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

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
