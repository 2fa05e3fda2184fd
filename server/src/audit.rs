//! The audit record of a query: which hooks ran on which value, in what
//! order, and what each did to it, provable without the value itself.
//!
//! For every hook call of a query (delegated agents' included), one entry:
//! the agent, hook, event and subject (a `tool_use_id`, or `turn N`), the
//! hook's position in its chain for that event, its outcome, and the digest
//! of the value it was given and of the value it passed on (hex).
//! `changed` is whether they differ: a redaction shows as a change of
//! digest at the hook that redacted. A hook that failed has no "after": the
//! chain stopped there. The value itself is never part of the record.
//!
//! What is digested: for a tool result, the protobuf encoding of its
//! `lattice.agent.v1.ToolResultBlock`; for a model request, the encoding of
//! an `OnModelRequestRequest` holding only its `system` and `messages`.
//! The digest is SHA-256, which anyone holding a value can recompute — and
//! anyone reading the record can test guesses against, which matters for a
//! value with few possibilities (a PIN, a short account number). With
//! `server.audit_key_env` it is HMAC-SHA256 under that key instead: only
//! whoever holds the key can check a value against the record.
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
    domain::{ModelRequest, ToolResult},
};

/// One hook call, audited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
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
    /// The digest (hex) of the value given.
    pub digest_before: String,
    /// The digest (hex) of the value passed on; none when the hook failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest_after: Option<String>,
}

/// How values are digested: SHA-256, or HMAC-SHA256 under a key.
/// One shadow hook call (see `hooks::shadow`): never applied; its output
/// compared with the shadowed hook's by digest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ShadowEntry {
    /// The agent whose chain it is.
    pub agent: String,
    /// The shadow hook.
    pub hook: String,
    /// The hook it shadows.
    pub shadow_of: String,
    /// `tool_result` or `model_request`.
    pub event: &'static str,
    /// The tool_use_id, or `turn N`.
    pub subject: String,
    /// `ok`, or the failure's kind.
    pub outcome: &'static str,
    /// `same`, `different`, or `none` (either failed).
    pub agreement: &'static str,
    /// The digest of the shadow's output; none when it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest_after: Option<String>,
    /// The digest of the shadowed hook's output; none when it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest_shadowed: Option<String>,
}

#[derive(Clone, Default)]
pub struct Digest {
    key: Option<ring::hmac::Key>,
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.algorithm())
    }
}

impl Digest {
    /// HMAC-SHA256 under `key`.
    pub fn keyed(key: &[u8]) -> Digest {
        Digest { key: Some(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key)) }
    }

    /// `sha256` or `hmac-sha256`.
    pub fn algorithm(&self) -> &'static str {
        if self.key.is_some() { "hmac-sha256" } else { "sha256" }
    }

    fn hex(&self, bytes: &[u8]) -> String {
        match &self.key {
            Some(key) => hex(ring::hmac::sign(key, bytes).as_ref()),
            None => sha256_hex(bytes),
        }
    }

    /// The digest of a tool result (see the module docs).
    pub fn tool_result(&self, result: &ToolResult) -> String {
        self.hex(&lattice_proto::agent::v1::ToolResultBlock::from(result).encode_to_vec())
    }

    /// The digest of a model request's system prompt and messages.
    pub fn model_request(&self, request: &ModelRequest<'_>) -> String {
        self.model_request_pb(&request.system, convert::messages_to_pb(&request.messages))
    }

    /// [`Digest::model_request`] of a system prompt and messages already
    /// in protobuf.
    pub fn model_request_pb(&self, system: &str, messages: Vec<lattice_proto::agent::v1::Message>) -> String {
        let value = lattice_proto::hooks::v1::OnModelRequestRequest {
            system: system.to_owned(),
            messages,
            ..Default::default()
        };
        self.hex(&value.encode_to_vec())
    }
}

/// A query's audit record, filled as its hooks run.
#[derive(Debug, Default)]
pub struct Audit {
    /// How its values are digested.
    pub digest: Digest,
    entries: Mutex<Vec<AuditEntry>>,
    shadows: Mutex<Vec<ShadowEntry>>,
}

impl Audit {
    /// An empty record whose values are digested with `digest`.
    pub fn new(digest: Digest) -> Audit {
        Audit { digest, entries: Mutex::default(), shadows: Mutex::default() }
    }

    /// Adds one hook call.
    pub fn record(&self, entry: AuditEntry) {
        crate::sync::lock(&self.entries).push(entry);
    }

    /// Every entry so far, in the order the calls ended.
    pub fn entries(&self) -> Vec<AuditEntry> {
        crate::sync::lock(&self.entries).clone()
    }

    /// Adds one shadow hook call.
    pub fn record_shadow(&self, entry: ShadowEntry) {
        crate::sync::lock(&self.shadows).push(entry);
    }

    /// Every shadow hook call that has ended so far.
    pub fn shadow_entries(&self) -> Vec<ShadowEntry> {
        crate::sync::lock(&self.shadows).clone()
    }
}

fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    bytes.iter().flat_map(|b| [HEX[usize::from(b >> 4)] as char, HEX[usize::from(b & 15)] as char]).collect()
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
}

/// The version of a hook chain's configuration: the first 16 hex digits
/// of the SHA-256 of each enabled hook's name, endpoint, events, deadline,
/// `required`, match conditions and shadowed hook, in order. Two replicas
/// with the same version run the same chain.
pub fn chain_version(hooks: &[crate::config::HookDef]) -> String {
    let mut text = String::new();
    for h in hooks.iter().filter(|h| h.enabled) {
        text += &format!(
            "{}\t{}\t{}{}\t{}\t{}",
            h.name,
            h.endpoint,
            if h.events.tool_result { "tool_result," } else { "" },
            if h.events.model_request { "model_request" } else { "" },
            h.deadline.as_millis(),
            h.required
        );
        // Added only when set: a chain without them keeps its version.
        if let Some(tools) = &h.conditions.tools {
            text += &format!("\ttools={}", tools.join(","));
        }
        if h.conditions.min_messages > 0 {
            text += &format!("\tmin_messages={}", h.conditions.min_messages);
        }
        if let Some(primary) = &h.shadow_of {
            text += &format!("\tshadow_of={primary}");
        }
        text += "\n";
    }
    sha256_hex(text.as_bytes())[..16].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic while the record was held loses no entry, before or after.
    #[test]
    fn a_poisoned_record_keeps_every_entry() {
        let audit = std::sync::Arc::new(Audit::default());
        audit.record(AuditEntry::default());
        let held = audit.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.entries.lock();
            panic!("a panic while the record is held");
        })
        .join();
        assert!(audit.entries.is_poisoned());
        audit.record(AuditEntry::default());
        assert_eq!(audit.entries().len(), 2);
    }

    #[test]
    fn sha256_is_the_standard_one() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn a_changed_result_has_another_digest_and_a_key_changes_every_digest() {
        let a = ToolResult::text("t1", "ada@example.com", false);
        let b = ToolResult::text("t1", "[REDACTED:email]", false);
        let (plain, keyed) = (Digest::default(), Digest::keyed(b"k"));
        assert_eq!(plain.tool_result(&a), plain.tool_result(&a.clone()));
        assert_ne!(plain.tool_result(&a), plain.tool_result(&b));
        assert_ne!(plain.tool_result(&a), keyed.tool_result(&a));
        assert_eq!(keyed.tool_result(&a), keyed.tool_result(&a.clone()));
        // RFC 4231 test case 2.
        let hmac = Digest::keyed(b"Jefe").hex(b"what do ya want for nothing?");
        assert_eq!(hmac, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }
}
