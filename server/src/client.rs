//! `lattice query`: runs one query against a server and prints its event
//! stream readably (a grpcurl-free way to try an agent).

use std::{fmt::Write as _, io::Write, time::Duration};

use lattice_proto::agent::v1::{
    self as pb, agent_service_client::AgentServiceClient, content_block::Block, query_event::Event,
};
use tokio_stream::StreamExt;
use tonic_types::StatusExt;

use crate::convert;

/// What to ask.
#[derive(Debug, Clone)]
pub struct QueryArgs {
    /// `http://host:port`.
    pub addr: String,
    /// The agent.
    pub agent: String,
    /// Continue this session.
    pub session: Option<String>,
    /// The prompt.
    pub prompt: String,
    /// Print model requests too.
    pub show_requests: bool,
    /// The query's deadline.
    pub timeout: Duration,
    /// A bearer token to send (`[server.auth] mode = "token"`).
    pub token: Option<String>,
    /// TLS settings for an `https://` address: the CA, a client certificate
    /// (mutual TLS), the name to expect.
    pub tls: Option<crate::peer::Tls>,
}

fn block_text(b: &pb::ContentBlock, indent: &str) -> String {
    match &b.block {
        Some(Block::Text(t)) => format!("{indent}{}", t.text.replace('\n', &format!("\n{indent}"))),
        Some(Block::ToolUse(t)) => {
            let input = serde_json::Value::Object(convert::from_struct(t.input.clone()));
            format!("{indent}tool_use {} {} [{}]", t.name, input, t.id)
        }
        Some(Block::ToolResult(r)) => {
            let text: Vec<&str> = r.content.iter().map(|t| t.text.as_str()).collect();
            // A multi-line result (pretty JSON) keeps its own indentation,
            // under the block's.
            format!(
                "{indent}tool_result [{}]{} {}",
                r.tool_use_id,
                if r.is_error { " (error)" } else { "" },
                text.join("").replace('\n', &format!("\n{indent}  "))
            )
        }
        None => format!("{indent}(empty block)"),
    }
}

/// Why `lattice query` failed.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The server could not be reached; nothing was sent.
    #[error("cannot reach {addr}: {reason}\nhint: {hint}")]
    Connect {
        /// The address as given.
        addr: String,
        /// What went wrong (from the local connection attempt).
        reason: String,
        /// What to check.
        hint: &'static str,
    },
    /// The query ended with an error status (already printed).
    #[error("{}: {}", crate::grpc::code_name(.0.code()), .0.message())]
    Status(tonic::Status),
    /// The token could not be used (never repeated).
    #[error("token: {0}")]
    Token(String),
}

/// How long `lattice query` tries to connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to `addr`, or says why not and what to check.
async fn connect(addr: &str, tls: Option<&crate::peer::Tls>) -> Result<tonic::transport::Channel, QueryError> {
    let fail = |reason: String, hint| QueryError::Connect { addr: addr.to_owned(), reason, hint };
    if !addr.contains("://") {
        return Err(fail(
            "the address has no scheme".into(),
            "write it as a URL, e.g. http://127.0.0.1:50051 (or https:// behind a TLS proxy)",
        ));
    }
    let endpoint = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .map_err(|e| fail(e.to_string(), "write the address as a URL, e.g. http://127.0.0.1:50051"))?
        .connect_timeout(CONNECT_TIMEOUT);
    let https = addr.starts_with("https://");
    let endpoint = match (tls, https) {
        (Some(_), false) => {
            return Err(fail(
                "TLS options given for a plaintext address".into(),
                "write the address as https://host:port",
            ));
        }
        (Some(tls), true) => {
            tls.validate().map_err(|e| fail(e, "check --ca, --cert and --key"))?;
            endpoint
                .tls_config(tls.client_config(None))
                .map_err(|e| fail(crate::peer::error_chain(&e), "check --ca, --cert and --key"))?
        }
        (None, true) => endpoint
            .tls_config(tonic::transport::ClientTlsConfig::new().with_native_roots())
            .map_err(|e| fail(crate::peer::error_chain(&e), "check the system's CA certificates"))?,
        (None, false) => endpoint,
    };
    endpoint.connect().await.map_err(|e| {
        let reason = crate::peer::error_chain(&e);
        let hint = if reason.contains("dns error") || reason.contains("failed to lookup") {
            "the host name does not resolve: check --addr"
        } else if https {
            "is `lattice serve` listening there with [server.tls]? does --ca sign its certificate, and does the \
             certificate name the host of --addr (or --server-name)?"
        } else {
            "is `lattice serve` running and listening there? (see --listen / server.listen)"
        };
        fail(reason, hint)
    })
}

/// Runs the query, printing each event to `out`. Returns `Ok` after a
/// final result; an error status is printed to `out` and returned; a
/// connection failure is returned unprinted.
pub async fn run_query(args: QueryArgs, out: &mut (dyn Write + Send)) -> Result<(), QueryError> {
    let channel = connect(&args.addr, args.tls.as_ref()).await?;
    // Events are as large as the server's `max_message_bytes` allows, which
    // this side doesn't know: no limit of its own (tonic's default is 4 MiB).
    let mut client = AgentServiceClient::new(channel).max_decoding_message_size(usize::MAX);
    let mut request = tonic::Request::new(pb::QueryRequest {
        agent: args.agent,
        session_id: args.session,
        prompt: args.prompt,
        include_model_requests: args.show_requests,
    });
    request.set_timeout(args.timeout);
    if let Some(token) = &args.token {
        let value = format!("Bearer {}", token.trim())
            .parse()
            .map_err(|_| QueryError::Token("the token holds characters a header can't carry".to_owned()))?;
        request.metadata_mut().insert("authorization", value);
    }
    let mut stream = match client.query(request).await {
        Ok(r) => r.into_inner(),
        Err(s) => {
            print_status(out, &s);
            return Err(QueryError::Status(s));
        }
    };
    loop {
        match stream.next().await {
            None => return Ok(()),
            Some(Err(s)) => {
                print_status(out, &s);
                return Err(QueryError::Status(s));
            }
            Some(Ok(ev)) => {
                let mut line = String::new();
                match ev.event {
                    Some(Event::Started(s)) => {
                        let _ = write!(line, "▶ query {} · agent {} · session {}", s.query_id, s.agent, s.session_id);
                    }
                    Some(Event::ModelRequest(r)) => {
                        let _ = writeln!(
                            line,
                            "→ model request (turn {}): {} messages, {} tools",
                            r.turn,
                            r.messages.len(),
                            r.tools.len()
                        );
                        let _ = writeln!(line, "    system: {}", r.system);
                        for m in &r.messages {
                            let role = if m.role == pb::Role::Assistant as i32 { "assistant" } else { "user" };
                            let _ = writeln!(line, "    {role}:");
                            for b in &m.content {
                                let _ = writeln!(line, "{}", block_text(b, "      "));
                            }
                        }
                        line.pop();
                    }
                    Some(Event::TextDelta(_)) => continue,
                    Some(Event::Assistant(a)) => {
                        let _ = writeln!(line, "◆ assistant (turn {}):", a.turn);
                        for b in a.message.iter().flat_map(|m| m.content.iter()) {
                            let _ = writeln!(line, "{}", block_text(b, "    "));
                        }
                        line.pop();
                    }
                    Some(Event::ToolResult(t)) => {
                        let outcome = pb::ToolCallOutcome::try_from(t.outcome).map(|o| o.as_str_name()).unwrap_or("?");
                        let outcome = outcome.trim_start_matches("TOOL_CALL_OUTCOME_").to_lowercase();
                        let r = t.result.unwrap_or_default();
                        let text: Vec<&str> = r.content.iter().map(|c| c.text.as_str()).collect();
                        let _ = write!(
                            line,
                            "◇ tool result {} [{}] ({outcome}{}, {} ms):\n    {}",
                            t.tool_name,
                            r.tool_use_id,
                            if r.is_error { ", is_error" } else { "" },
                            t.duration_ms,
                            text.join("").replace('\n', "\n    ")
                        );
                    }
                    Some(Event::Result(r)) => {
                        let reason = pb::StopReason::try_from(r.stop_reason).map(|o| o.as_str_name()).unwrap_or("?");
                        let u = r.usage.unwrap_or_default();
                        let _ = write!(
                            line,
                            "✔ result ({}, {} turn(s), {} in / {} out tokens):\n    {}",
                            reason.trim_start_matches("STOP_REASON_").to_lowercase(),
                            r.turns,
                            u.input_tokens,
                            u.output_tokens,
                            r.text.replace('\n', "\n    ")
                        );
                    }
                    None => continue,
                }
                let _ = writeln!(out, "{line}");
            }
        }
    }
}

fn print_status(out: &mut (dyn Write + Send), s: &tonic::Status) {
    let _ = writeln!(out, "✘ {}: {}", crate::grpc::code_name(s.code()), s.message());
    if let Some(info) = s.get_details_error_info() {
        let mut meta: Vec<_> = info.metadata.iter().collect();
        meta.sort();
        let meta: Vec<String> = meta.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(out, "    {} ({}) {}", info.reason, info.domain, meta.join(" "));
    }
}
