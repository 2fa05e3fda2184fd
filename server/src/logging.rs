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

use std::fmt;

use tracing::{
    Metadata,
    field::{Field, Visit},
};
use tracing_subscriber::{
    EnvFilter, Layer,
    field::RecordFields,
    filter,
    fmt::{FormatFields, format::Writer},
    layer::SubscriberExt,
    util::SubscriberInitExt,
};

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
        Format::Text => layer.fmt_fields(TextFields).boxed(),
        Format::Json => layer.json().boxed(),
    };
    tracing_subscriber::registry().with(levels).with(transport.boxed()).with(layer)
}

/// The text format's fields, written as tracing-subscriber's default
/// writes them (`name=value`, one space between, the message as text; on a
/// terminal, names in italics and `=` dimmed) with its colour codes written
/// as they are rather than through the two styling wrappers it formats for
/// each field, even without colours, which cost more than the field
/// itself: they were a third of what the log line of every query cost.
///
/// And one event stays one line: control characters in the message and in
/// values are escaped (see [`Escaping`]). Without colours the default
/// escapes terminal controls in the message alone, and with them not even
/// there, so a line break in a `%` value (an error's text from a peer or a
/// model provider) started what read as a log line of its own, and on a
/// terminal an escape sequence in it acted on the terminal.
#[derive(Debug)]
struct TextFields;

impl<'w> FormatFields<'w> for TextFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> fmt::Result {
        let ansi = writer.has_ansi_escapes();
        let mut visitor = TextVisitor { writer, ansi, is_empty: true, result: Ok(()) };
        fields.record(&mut visitor);
        visitor.result
    }
}

/// Writes through, escaping control characters: the terminal controls as
/// tracing-subscriber escapes them in messages (`\x1b`, `\u{9b}`), line
/// breaks as `\n` and `\r`, the rest of C0 as `\xNN`. Tabs are kept.
struct Escaping<'a, 'w>(&'a mut Writer<'w>);

impl fmt::Write for Escaping<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut rest = s;
        while let Some((i, c)) = rest.char_indices().find(|&(_, c)| c != '\t' && c.is_control()) {
            self.0.write_str(&rest[..i])?;
            match c {
                '\n' => self.0.write_str("\\n")?,
                '\r' => self.0.write_str("\\r")?,
                c if u32::from(c) < 0x80 => write!(self.0, "\\x{:02x}", u32::from(c))?,
                c => write!(self.0, "\\u{{{:x}}}", u32::from(c))?,
            }
            rest = &rest[i + c.len_utf8()..];
        }
        self.0.write_str(rest)
    }
}

/// An error's sources, outermost first: `[a, b]`.
struct Sources<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Sources<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        let mut next = Some(self.0);
        let mut first = true;
        while let Some(error) = next {
            if !std::mem::take(&mut first) {
                f.write_str(", ")?;
            }
            write!(f, "{error}")?;
            next = error.source();
        }
        f.write_str("]")
    }
}

struct TextVisitor<'w> {
    writer: Writer<'w>,
    /// Colours: the writer is a terminal's.
    ansi: bool,
    /// Nothing has been written yet (no space before the next field).
    is_empty: bool,
    result: fmt::Result,
}

/// `name=`, or `name.sources=` for an error's sources; on a terminal with
/// the default's colour codes (each part in italics, `=` dimmed).
fn label(w: &mut Writer<'_>, ansi: bool, name: &str, sources: bool) -> fmt::Result {
    if !ansi {
        w.write_str(name)?;
        return w.write_str(if sources { ".sources=" } else { "=" });
    }
    w.write_str("\x1b[3m")?;
    w.write_str(name)?;
    w.write_str("\x1b[0m")?;
    if sources {
        w.write_str("\x1b[3m.sources\x1b[0m")?;
    }
    w.write_str("\x1b[2m=\x1b[0m")
}

impl TextVisitor<'_> {
    /// Writes one field (`name=`, unless it is the message) and its value,
    /// escaped; for an error, then its sources.
    fn write(
        &mut self,
        name: Option<&str>,
        value: fmt::Arguments<'_>,
        sources: Option<(&str, &(dyn std::error::Error + 'static))>,
    ) {
        if self.result.is_err() {
            return;
        }
        let space = if std::mem::take(&mut self.is_empty) { "" } else { " " };
        let (w, ansi) = (&mut self.writer, self.ansi);
        self.result = (|| {
            w.write_str(space)?;
            if let Some(name) = name {
                label(w, ansi, name, false)?;
            }
            fmt::Write::write_fmt(&mut Escaping(w), value)?;
            if let Some((name, source)) = sources {
                // As the default writes it: `error=… error.sources=[…, …]`.
                w.write_str(" ")?;
                label(w, ansi, name, true)?;
                fmt::Write::write_fmt(&mut Escaping(w), format_args!("{}", Sources(source)))?;
            }
            Ok(())
        })();
    }
}

impl Visit for TextVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.write(None, format_args!("{value}"), None);
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let name = field.name();
        let shown = Some(name.strip_prefix("r#").unwrap_or(name));
        self.write(shown, format_args!("{value}"), value.source().map(|source| (name, source)));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        match field.name() {
            // `log` records' metadata, which the default leaves out too.
            name if name.starts_with("log.") => {}
            "message" => self.write(None, format_args!("{value:?}"), None),
            name => self.write(Some(name.strip_prefix("r#").unwrap_or(name)), format_args!("{value:?}"), None),
        }
    }
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

    /// Where the captured subscribers write.
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Lines {
        type Writer = Sink;

        fn make_writer(&'a self) -> Sink {
            Sink(self.0.clone())
        }
    }

    /// What `emit` logs through the subscriber `make` builds on a writer.
    fn captured<S>(make: impl FnOnce(Lines) -> S, emit: impl FnOnce()) -> String
    where
        S: tracing::Subscriber + Send + Sync + 'static,
    {
        let lines = Lines::default();
        tracing::subscriber::with_default(make(lines.clone()), emit);
        let bytes = lines.0.lock().map(|l| l.clone()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Lattice's subscriber in text at `levels`, with colours or not.
    fn text(levels: &str, ansi: bool) -> impl FnOnce(Lines) -> Box<dyn tracing::Subscriber + Send + Sync> {
        let levels = EnvFilter::new(levels);
        move |w| Box::new(subscriber(Format::Text, levels, false, ansi, w))
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
