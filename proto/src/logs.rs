//! Log lines that keep peers' bytes out and one event on one line, shared
//! by Lattice and the hook SDK (feature `logs`).
//!
//! - [`from_transport`]: whether an event comes from a crate that handles
//!   peers' bytes below gRPC (h2, hyper, tonic's transport, rustls, …) or
//!   the database client (tokio-postgres, deadpool).
//!   Those crates log what they receive at debug and trace (a GOAWAY's
//!   debug data, protocol errors that quote a frame), so both drop their
//!   events whatever `RUST_LOG` says, unless [`TRANSPORT_OPT_IN`] is `1`.
//! - [`TextFields`]: the text format's fields, with control characters
//!   escaped, so that a value from a peer (an error's text, a tool call's
//!   id) can neither start a line of its own nor act on a terminal.
//! - [`subscriber`]: the subscriber both install, built from those two.

use std::fmt;

use tracing::{
    Metadata,
    field::{Field, Visit},
};
use tracing_subscriber::{
    EnvFilter, Layer,
    field::RecordFields,
    filter,
    fmt::{FormatFields, MakeWriter, format::Writer},
    layer::SubscriberExt,
    registry::LookupSpan,
};

/// The log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// A log subscriber writing to `writer` in `format`: events below `levels`
/// dropped, and those of the transport crates too unless `opted_in` (see
/// [`transport_opted_in`]); colour codes only with `ansi` (a terminal).
///
/// Both filters are global (layers of their own, not per-layer filters), so
/// a callsite they turn off is off for good: `tracing::enabled!` says so,
/// and the h2 and hyper events on every frame cost nothing. (A per-layer
/// filter answers `enabled` with "maybe", which made Lattice's trace writer
/// serialize every event for a log line that was then dropped.)
pub fn subscriber<W>(
    format: Format,
    levels: EnvFilter,
    opted_in: bool,
    ansi: bool,
    writer: W,
) -> impl tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let transport = filter::filter_fn(move |m: &Metadata<'_>| opted_in || !from_transport(m.target()));
    let layer = tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(writer);
    let layer = match format {
        Format::Text => layer.fmt_fields(TextFields).boxed(),
        Format::Json => layer.json().boxed(),
    };
    tracing_subscriber::registry().with(levels).with(transport.boxed()).with(layer)
}

/// What to warn, once logging runs, when [`TRANSPORT_OPT_IN`] is set.
pub const OPTED_IN_WARNING: &str = "LATTICE_LOG_TRANSPORT=1: transport crates may log bytes received from peers";

/// The variable that lets the transport crates' events through.
pub const TRANSPORT_OPT_IN: &str = "LATTICE_LOG_TRANSPORT";

/// Crates that handle peers' bytes below gRPC (targets and their modules),
/// and the PostgreSQL client's: it logs each statement with its parameters
/// (a stored conversation's prompts and tool results) at debug.
const TRANSPORT_TARGETS: &[&str] = &[
    "h2",
    "hyper",
    "hyper_util",
    "tonic",
    "tower",
    "rustls",
    "reqwest",
    "eventsource_stream",
    "tokio_util",
    "want",
    "tokio_postgres",
    "postgres_protocol",
    "postgres_types",
    "deadpool",
    "deadpool_postgres",
    "tokio_postgres_rustls",
];

/// Whether [`TRANSPORT_OPT_IN`] is `1` in this process's environment.
pub fn transport_opted_in() -> bool {
    std::env::var(TRANSPORT_OPT_IN).is_ok_and(|v| v == "1")
}

/// Whether an event comes from a crate that handles peers' bytes: its
/// target is the crate's name, or starts with it and `::` (a module) or
/// `.` (deadpool-postgres's `deadpool.postgres`).
pub fn from_transport(target: &str) -> bool {
    TRANSPORT_TARGETS.iter().any(|t| {
        target.strip_prefix(t).is_some_and(|rest| rest.is_empty() || rest.starts_with("::") || rest.starts_with('.'))
    })
}

/// The text format's fields, written as tracing-subscriber's default
/// writes them (`name=value`, one space between, the message as text; on a
/// terminal, names in italics and `=` dimmed) with its colour codes written
/// as they are rather than through the two styling wrappers it formats for
/// each field, even without colours, which cost more than the field
/// itself: they were a third of what the log line of every query cost.
///
/// And one event stays one line: control characters in the message and in
/// values are escaped (see `Escaping`). Without colours the default
/// escapes terminal controls in the message alone, and with them not even
/// there, so a line break in a `%` value (an error's text from a peer or a
/// model provider) started what read as a log line of its own, and on a
/// terminal an escape sequence in it acted on the terminal.
#[derive(Debug, Clone, Copy, Default)]
pub struct TextFields;

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
