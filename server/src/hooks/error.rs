//! What a hook call can end as: the events, what a failure concerns, and
//! the failures' kinds, decided from what happened on the wire.

use std::fmt;

use tonic::Code;

use crate::grpc::code_name;

/// The two hook events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookEvent {
    /// OnToolResult.
    ToolResult,
    /// OnModelRequest.
    ModelRequest,
}

impl HookEvent {
    pub(super) fn index(self) -> usize {
        match self {
            HookEvent::ToolResult => 0,
            HookEvent::ModelRequest => 1,
        }
    }

    /// The name used in config, errors and metadata.
    pub fn as_str(self) -> &'static str {
        match self {
            HookEvent::ToolResult => "tool_result",
            HookEvent::ModelRequest => "model_request",
        }
    }
}

impl fmt::Display for HookEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a failed hook call was about: a tool result or a turn's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookSubject {
    /// The tool_use_id of the result.
    ToolUse(String),
    /// The 1-based turn of the model request.
    Turn(u32),
}

impl HookSubject {
    /// As the audit record writes it: the tool_use_id, or "turn N".
    pub(super) fn audit_text(&self) -> String {
        match self {
            HookSubject::ToolUse(id) => id.clone(),
            HookSubject::Turn(t) => format!("turn {t}"),
        }
    }
}

/// How a hook call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookFailure {
    /// It did not answer within its own deadline (or answered
    /// DEADLINE_EXCEEDED / CANCELLED as that deadline passed).
    Deadline,
    /// The call failed below gRPC: no address, connection refused, reset or
    /// closed, broken HTTP/2. The hook sent no status.
    Unavailable,
    /// The hook answered with this non-OK status (it sent it).
    Status(Code),
    /// Its reply was invalid: it does not decode, is too large, breaks the
    /// gRPC protocol, or is a replacement that breaks the contract. The
    /// reason names ids and positions, never content.
    InvalidReply(String),
    /// It was not called: the request is larger than the hook message limit.
    /// Not the hook's doing, but the value could not pass the chain.
    RequestTooLarge {
        /// The request's encoded size.
        bytes: usize,
        /// `server.hook_max_message_bytes`.
        limit: usize,
    },
}

impl HookFailure {
    /// The `kind` value in the ErrorInfo metadata.
    pub fn kind(&self) -> &'static str {
        match self {
            HookFailure::Deadline => "deadline",
            HookFailure::Unavailable => "unavailable",
            HookFailure::Status(_) => "status",
            HookFailure::InvalidReply(_) => "invalid_reply",
            HookFailure::RequestTooLarge { .. } => "request_too_large",
        }
    }
}

impl fmt::Display for HookFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookFailure::Deadline => f.write_str("deadline exceeded"),
            HookFailure::Unavailable => f.write_str("unavailable"),
            // What gRPC servers answer to a request over their receive
            // limit (tonic: OUT_OF_RANGE; grpc-go, Python: RESOURCE_EXHAUSTED).
            HookFailure::Status(c @ (Code::OutOfRange | Code::ResourceExhausted)) => write!(
                f,
                "returned status {}: the hook may have refused the request as larger than its message limit \
                 (the Rust SDK's is LATTICE_HOOK_MAX_MESSAGE_BYTES)",
                code_name(*c)
            ),
            HookFailure::Status(c) => write!(f, "returned status {}", code_name(*c)),
            HookFailure::InvalidReply(why) => write!(f, "invalid reply: {why}"),
            HookFailure::RequestTooLarge { bytes, limit } => {
                write!(f, "the request ({bytes} bytes) exceeds the hook message limit ({limit} bytes)")
            }
        }
    }
}

/// A hook call failed. Aborts the query, always.
///
/// Its text names the agent, hook, event, subject and failure kind. It never
/// holds content, nor the hook's own status message (which could echo it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookError {
    /// The agent whose chain failed.
    pub agent: String,
    /// The hook's name.
    pub hook: String,
    /// The event.
    pub event: HookEvent,
    /// Which result or turn.
    pub subject: HookSubject,
    /// What went wrong.
    pub failure: HookFailure,
}

impl fmt::Display for HookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (agent, hook, event, subject) = (&self.agent, &self.hook, self.event, &self.subject);
        match &self.failure {
            // Not the hook's failure: it was never called.
            HookFailure::RequestTooLarge { .. } => {
                write!(f, "hook {hook:?} of agent {agent:?} was not called on {event} ({subject}): {}", self.failure)
            }
            failure => write!(f, "hook {hook:?} of agent {agent:?} failed on {event} ({subject}): {failure}"),
        }
    }
}

impl std::error::Error for HookError {}

/// Why a hook chain did not produce a value. Either way the query ends and
/// the value goes nowhere.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// A hook failed: the query is aborted (ABORTED + HOOK_FAILED).
    #[error(transparent)]
    Hook(#[from] HookError),
    /// The query's own deadline passed while a hook worked within it
    /// (DEADLINE_EXCEEDED, as anywhere else in the query).
    #[error("the query's deadline passed during a hook call")]
    QueryDeadline,
}

impl fmt::Display for HookSubject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookSubject::ToolUse(id) => write!(f, "tool_use_id {id}"),
            HookSubject::Turn(t) => write!(f, "turn {t}"),
        }
    }
}
