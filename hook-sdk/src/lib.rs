//! Write Lattice hook services in Rust.
//!
//! A hook sees, and may replace, what a Lattice agent sends to its model:
//! each tool result on its way back ([`Hook::on_tool_result`]) and each model
//! request before it is sent ([`Hook::on_model_request`]). Both default to
//! "keep", so a hook implements only what it needs.
//!
//! ```no_run
//! use lattice_hook_sdk::{Hook, ToolResultCall, ToolResultBlock, Status};
//!
//! struct Shout;
//!
//! #[lattice_hook_sdk::async_trait]
//! impl Hook for Shout {
//!     async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
//!         Ok(Some(call.replace_text(call.text().to_uppercase())))
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     lattice_hook_sdk::serve(Shout, "127.0.0.1:50071".parse()?).await?;
//!     Ok(())
//! }
//! ```
//!
//! A hook whose work per call is small costs less on one thread
//! (`#[tokio::main(flavor = "current_thread")]`): each call stays on the
//! thread that reads it. One that spends milliseconds of CPU on a call keeps
//! the default runtime, so that other calls go on meanwhile (the README's
//! "A hook's runtime" has the figures).
//!
//! Several hooks can run in one service, in order, each seeing the previous
//! one's output: [`Chain`]. [`Server`] sets TLS (with
//! [`Tls::require_client_ca`], mutual TLS), the drain period and the
//! message limit, and serves on an address or a bound listener. Lattice itself calls the hooks registered for an
//! agent in order, within strict deadlines, and aborts the query when any
//! call fails: returning an error `Status` from a hook is how a hook refuses
//! to let a value through.
#![warn(missing_docs)]

mod calls;
mod serve;

pub use calls::*;
pub use serve::*;

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use lattice_proto::hooks::v1::{
    self as pb,
    hook_service_server::{HookService, HookServiceServer},
};
use tokio::net::TcpListener;
use tracing::Instrument;

pub use lattice_proto::agent::v1::{ContentBlock, Message, Role, TextBlock, ToolResultBlock, ToolSpec, content_block};
pub use lattice_proto::hooks::v1::{HookContext, ResultSource, SourceKind, ToolError, ToolErrorKind};
pub use serde_json::{Map as JsonMap, Value as JsonValue};

/// How [`init_logs`] writes log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (fields as plain values; each line inside
    /// a call carries its `hook_call` span, with the query's `trace_id`).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is not a log format: text or json")),
        }
    }
}

/// Logs to stderr in `format`, levels from `RUST_LOG` (default `info`),
/// as `--log-format text|json` in the examples. Does nothing if a global
/// subscriber is already set.
///
/// The rules of Lattice's own logs hold: the transport crates (h2, hyper,
/// tonic's transport, rustls, …), which log bytes a peer sent at debug and
/// trace, log nothing whatever `RUST_LOG` says unless
/// `LATTICE_LOG_TRANSPORT=1`; in text, control characters in messages and
/// values are escaped, so that a value from a request (a tool call's id)
/// can neither start a line of its own nor act on a terminal; and text is
/// coloured only on a terminal.
#[cfg(feature = "logs")]
pub fn init_logs(format: LogFormat) {
    use lattice_proto::logs::{Format, OPTED_IN_WARNING, subscriber, transport_opted_in};
    use tracing_subscriber::{EnvFilter, util::SubscriberInitExt};
    let levels = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let opted_in = transport_opted_in();
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let format = match format {
        LogFormat::Text => Format::Text,
        LogFormat::Json => Format::Json,
    };
    let _ = subscriber(format, levels, opted_in, ansi, std::io::stderr).try_init();
    if opted_in {
        tracing::warn!("{OPTED_IN_WARNING}");
    }
}

pub use tonic::{Code, Status, async_trait};

/// The generated contract, for anything the re-exports above don't cover.
pub use lattice_proto as proto;

/// A hook. Both methods default to keeping the value unchanged.
///
/// Return `Err(status)` to refuse: Lattice then aborts the query and the
/// value is never sent on. Register the hook in Lattice's config for the
/// events it implements.
#[async_trait]
pub trait Hook: Send + Sync + 'static {
    /// A tool result on its way to the model. `Ok(None)` keeps it;
    /// `Ok(Some(r))` replaces it (`r.tool_use_id` must stay the same;
    /// `is_error` may change either way).
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        let _ = call;
        Ok(None)
    }

    /// A model request about to be sent. The change applies to this one
    /// request; Lattice's stored conversation is not changed.
    async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        let _ = call;
        Ok(ModelRequestChange::keep())
    }
}

#[async_trait]
impl<H: Hook + ?Sized> Hook for Arc<H> {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        (**self).on_tool_result(call).await
    }
    async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        (**self).on_model_request(call).await
    }
}

/// Several hooks in one service, called in order; each sees the previous
/// one's output, and the first error stops the chain.
#[derive(Default)]
pub struct Chain {
    hooks: Vec<Box<dyn Hook>>,
}

impl Chain {
    /// An empty chain (keeps everything).
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a hook.
    pub fn then(mut self, hook: impl Hook) -> Self {
        self.hooks.push(Box::new(hook));
        self
    }
}

#[async_trait]
impl Hook for Chain {
    async fn on_tool_result(&self, mut call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        let mut replaced = false;
        for hook in &self.hooks {
            if let Some(r) = hook.on_tool_result(call.clone()).await? {
                call.result = r;
                replaced = true;
            }
        }
        Ok(replaced.then_some(call.result))
    }

    async fn on_model_request(&self, mut call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        let mut total = ModelRequestChange::keep();
        for hook in &self.hooks {
            let change = hook.on_model_request(call.clone()).await?;
            if let Some(s) = change.system {
                call.system = s.clone();
                total.system = Some(s);
            }
            if let Some(m) = change.messages {
                call.messages = m.clone();
                total.messages = Some(m);
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Append(&'static str);

    #[async_trait]
    impl Hook for Append {
        async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
            Ok(Some(call.replace_text(format!("{}{}", call.text(), self.0))))
        }
        async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
            Ok(ModelRequestChange::system(format!("{}{}", call.system, self.0)))
        }
    }

    struct Keep;
    #[async_trait]
    impl Hook for Keep {}

    #[test]
    fn traceparent_is_parsed_strictly() {
        let t = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(
            (t.trace_id.as_str(), t.parent_span_id.as_str(), t.sampled),
            ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", true)
        );
        assert_eq!(t.header(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
        assert!(!TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap().sampled);
    }

    fn call(text: &str) -> ToolResultCall {
        ToolResultCall {
            tool_use_id: "t1".into(),
            result: ToolResultBlock {
                tool_use_id: "t1".into(),
                content: vec![TextBlock { text: text.into() }],
                is_error: false,
            },
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_chain_folds_in_order_and_keeps_when_nobody_replaces() {
        let chain = Chain::new().then(Append("a")).then(Keep).then(Append("b"));
        let out = chain.on_tool_result(call("x")).await.unwrap().unwrap();
        assert_eq!(text_of(&out), "xab");
        let req = ModelRequestCall { system: "s".into(), ..Default::default() };
        assert_eq!(chain.on_model_request(req).await.unwrap().system.as_deref(), Some("sab"));

        let keep = Chain::new().then(Keep).then(Keep);
        assert_eq!(keep.on_tool_result(call("x")).await.unwrap(), None);
        assert!(keep.on_model_request(ModelRequestCall::default()).await.unwrap().is_keep());
    }

    /// The wire request becomes the SDK's call: the input as JSON, the
    /// result present even when the request left it out.
    #[test]
    fn a_wire_request_becomes_a_call_with_json_input() {
        use prost_types::{Struct, Value, value::Kind};
        let field = |k: Kind| Value { kind: Some(k) };
        let mut nested = Struct::default();
        nested.fields.insert("deep".into(), field(Kind::BoolValue(true)));
        let mut input = Struct::default();
        input.fields.insert("city".into(), field(Kind::StringValue("Paris".into())));
        input.fields.insert("n".into(), field(Kind::NumberValue(2.5)));
        input.fields.insert("nested".into(), field(Kind::StructValue(nested)));
        let wire = pb::OnToolResultRequest { tool_use_id: "t1".into(), input: Some(input), ..Default::default() };
        let call = ToolResultCall::from(wire);
        assert_eq!(
            JsonValue::Object(call.input),
            serde_json::json!({"city": "Paris", "n": 2.5, "nested": {"deep": true}})
        );
        assert_eq!(call.result, ToolResultBlock::default());
        let m = text_message(Role::Assistant, "hi");
        assert_eq!(m.role(), Role::Assistant);
    }
}
