//! The audit record of a query: which hooks ran on which value, in what
//! order, and what each did to it, provable without the value itself.
//!
//! For every hook call of a query (delegated agents' included), one entry:
//! the agent, hook, event and subject (a `tool_use_id`, or `turn N`), the
//! hook's position in its chain for that event, its outcome, and the
//! SHA-256 of the value it was given and of the value it passed on (hex).
//! `changed` is whether they differ: a redaction shows as a change of hash
//! at the hook that redacted. A hook that failed has no "after": the chain
//! stopped there. The value itself is never part of the record.
//!
//! What is hashed: for a tool result, the protobuf encoding of its
//! `lattice.agent.v1.ToolResultBlock`; for a model request, the encoding of
//! an `OnModelRequestRequest` holding only its `system` and `messages`.
//! Anyone holding a value can recompute its hash.
//!
//! The record is kept only when it has somewhere to go (a trace directory
//! or OpenTelemetry export): then one `audit` event ends the query in the
//! session's trace file, and one `query audit` line is logged in the
//! query's span (an OpenTelemetry span event).

use std::sync::Mutex;

use prost::Message as _;
use serde::Serialize;

use crate::{
    convert,
    domain::{Message, ModelRequest, ToolResult},
};

/// One hook call, audited.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditEntry {
    /// The agent whose chain it is.
    pub agent: String,
    /// The hook.
    pub hook: String,
    /// `tool_result` or `model_request`.
    pub event: &'static str,
    /// The tool_use_id, or `turn N`.
    pub subject: String,
    /// 1-based position in the agent's chain for this event.
    pub position: u32,
    /// `ok`, or the failure's kind.
    pub outcome: &'static str,
    /// Whether the value passed on differs from the value given.
    pub changed: bool,
    /// SHA-256 (hex) of the value given.
    pub sha256_before: String,
    /// SHA-256 (hex) of the value passed on; none when the hook failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256_after: Option<String>,
}

/// A query's audit record, filled as its hooks run.
#[derive(Debug, Default)]
pub struct Audit {
    entries: Mutex<Vec<AuditEntry>>,
}

impl Audit {
    /// Adds one hook call.
    pub fn record(&self, entry: AuditEntry) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.push(entry);
        }
    }

    /// Every entry so far, in the order the calls ended.
    pub fn entries(&self) -> Vec<AuditEntry> {
        self.entries.lock().map(|e| e.clone()).unwrap_or_default()
    }
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest.as_ref().iter().flat_map(|b| [HEX[usize::from(b >> 4)] as char, HEX[usize::from(b & 15)] as char]).collect()
}

/// The hash of a tool result (see the module docs).
pub fn tool_result_digest(result: &ToolResult) -> String {
    sha256_hex(&lattice_proto::agent::v1::ToolResultBlock::from(result).encode_to_vec())
}

/// The hash of a model request's system prompt and messages.
pub fn model_request_digest(request: &ModelRequest) -> String {
    model_request_digest_of(&request.system, &request.messages)
}

fn model_request_digest_of(system: &str, messages: &[Message]) -> String {
    let value = lattice_proto::hooks::v1::OnModelRequestRequest {
        system: system.to_owned(),
        messages: convert::messages_to_pb(messages),
        ..Default::default()
    };
    sha256_hex(&value.encode_to_vec())
}

/// The version of a hook chain's configuration: the first 16 hex digits
/// of the SHA-256 of each enabled hook's name, endpoint, events, deadline
/// and `required`, in order. Two replicas with the same version run the
/// same chain.
pub fn chain_version(hooks: &[crate::config::HookDef]) -> String {
    let mut text = String::new();
    for h in hooks.iter().filter(|h| h.enabled) {
        text += &format!(
            "{}\t{}\t{}{}\t{}\t{}\n",
            h.name,
            h.endpoint,
            if h.events.tool_result { "tool_result," } else { "" },
            if h.events.model_request { "model_request" } else { "" },
            h.deadline.as_millis(),
            h.required
        );
    }
    sha256_hex(text.as_bytes())[..16].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_is_the_standard_one() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn a_changed_result_has_another_digest() {
        let a = ToolResult::text("t1", "ada@example.com", false);
        let b = ToolResult::text("t1", "[REDACTED:email]", false);
        assert_eq!(tool_result_digest(&a), tool_result_digest(&a.clone()));
        assert_ne!(tool_result_digest(&a), tool_result_digest(&b));
    }
}
