//! The one mapping from errors to gRPC statuses.
//!
//! Clients get a short message that never holds content, plus
//! machine-readable details (`google.rpc.ErrorInfo`, domain `lattice.dev`).

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{
    agent::AgentError,
    hooks::{HookError, HookFailure, HookSubject},
    model::{ModelError, ModelErrorKind},
    session::StoreError,
};

/// The ErrorInfo domain of every Lattice error.
pub const DOMAIN: &str = "lattice.dev";
pub use crate::grpc::code_name;

/// ErrorInfo reason of a hook failure.
pub const HOOK_FAILED: &str = "HOOK_FAILED";
/// ErrorInfo reason of a model failure.
pub const MODEL_FAILED: &str = "MODEL_FAILED";
/// ErrorInfo reason of a commit whose outcome the store could not tell in
/// time (status `UNKNOWN`): the turn may be stored.
pub const COMMIT_OUTCOME_UNKNOWN: &str = "COMMIT_OUTCOME_UNKNOWN";

/// The most characters of client input an error message repeats.
const ECHO_CHARS: usize = 64;

/// Client input for a log field: a plain value, control characters
/// escaped (no line of its own in a text log), cut to `ECHO_CHARS`
/// characters with a final "…".
pub fn log_value(input: &str) -> String {
    let mut out: String = input.chars().take(ECHO_CHARS).flat_map(char::escape_default).collect();
    if input.chars().nth(ECHO_CHARS).is_some() {
        out.push('…');
    }
    out
}

/// Client input for an error message: quoted, and cut to `ECHO_CHARS`
/// characters (a status message rides in an HTTP/2 header, which clients
/// refuse past a few kilobytes).
pub fn echo(input: &str) -> String {
    match input.char_indices().nth(ECHO_CHARS) {
        None => format!("{input:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &input[..cut], input.len()),
    }
}

/// The status a failed query ends with.
pub fn agent_error(e: &AgentError) -> Status {
    match e {
        AgentError::Hook(h) => hook_error(h),
        AgentError::Model(m) => model_error(m),
        AgentError::DeadlineExceeded => Status::deadline_exceeded("the query's deadline passed"),
        AgentError::Cancelled => Status::cancelled("the query was cancelled"),
        AgentError::Store(s) => store_error(s),
        AgentError::NotReady(_) => Status::unavailable(e.to_string()),
        AgentError::EventTooLarge { .. } => Status::resource_exhausted(format!(
            "{e}; nothing was stored (raise server.max_message_bytes, or query without include_model_requests)"
        )),
    }
}

/// ABORTED + ErrorInfo(HOOK_FAILED) with hook, event, subject and kind.
pub fn hook_error(e: &HookError) -> Status {
    let mut meta = HashMap::from([
        ("agent".to_owned(), e.agent.clone()),
        ("hook".to_owned(), e.hook.clone()),
        ("event".to_owned(), e.event.as_str().to_owned()),
        ("kind".to_owned(), e.failure.kind().to_owned()),
    ]);
    match &e.subject {
        HookSubject::ToolUse(id) => meta.insert("tool_use_id".into(), id.clone()),
        HookSubject::Turn(t) => meta.insert("turn".into(), t.to_string()),
    };
    if let HookFailure::Status(code) = &e.failure {
        meta.insert("code".into(), code_name(*code).to_owned());
    }
    Status::with_error_details(Code::Aborted, e.to_string(), ErrorDetails::with_error_info(HOOK_FAILED, DOMAIN, meta))
}

fn model_error(e: &ModelError) -> Status {
    let code = match e.kind {
        ModelErrorKind::Unavailable => Code::Unavailable,
        ModelErrorKind::Unauthenticated => Code::Unauthenticated,
        ModelErrorKind::PermissionDenied => Code::PermissionDenied,
        ModelErrorKind::InvalidRequest => Code::FailedPrecondition,
        ModelErrorKind::InvalidResponse => Code::Internal,
    };
    let meta = HashMap::from([("provider".to_owned(), e.provider.clone())]);
    Status::with_error_details(code, e.to_string(), ErrorDetails::with_error_info(MODEL_FAILED, DOMAIN, meta))
}

/// Session store errors.
pub fn store_error(e: &StoreError) -> Status {
    match e {
        StoreError::NotFound => Status::not_found("session not found"),
        StoreError::Busy => Status::failed_precondition("another query is running in this session"),
        StoreError::LeaseLost => Status::aborted(e.to_string()),
        StoreError::Full(_) => Status::resource_exhausted(format!("{e}; retry later, or delete sessions")),
        StoreError::Unavailable(_) => Status::unavailable(e.to_string()),
        StoreError::Deadline => Status::deadline_exceeded(e.to_string()),
        // The one failure after which the turn may be stored: a retry would
        // run the tools again. The client reads the session to know.
        StoreError::CommitOutcomeUnknown => Status::with_error_details(
            Code::Unknown,
            e.to_string(),
            ErrorDetails::with_error_info(COMMIT_OUTCOME_UNKNOWN, DOMAIN, HashMap::new()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::HookEvent;

    /// Every store failure but one says nothing was stored; the one that
    /// can't say is UNKNOWN with a reason a client can act on.
    #[test]
    fn store_errors_map_to_what_is_stored() {
        assert_eq!(store_error(&StoreError::Unavailable("postgres")).code(), Code::Unavailable);
        assert_eq!(store_error(&StoreError::Deadline).code(), Code::DeadlineExceeded);
        assert_eq!(store_error(&StoreError::LeaseLost).code(), Code::Aborted);
        let unknown = store_error(&StoreError::CommitOutcomeUnknown);
        assert_eq!(unknown.code(), Code::Unknown);
        let info = unknown.get_details_error_info().expect("error info");
        assert_eq!((info.reason.as_str(), info.domain.as_str()), (COMMIT_OUTCOME_UNKNOWN, DOMAIN));
    }

    #[test]
    fn logged_input_is_plain_escaped_and_bounded() {
        assert_eq!(log_value("support"), "support");
        assert_eq!(log_value("a\nb"), "a\\nb");
        let long = log_value(&"x".repeat(500));
        assert!(long.ends_with('…') && long.chars().count() == 65, "{long}");
    }

    #[test]
    fn echoed_input_is_quoted_and_bounded() {
        assert_eq!(echo("support"), "\"support\"");
        let long = "é".repeat(10_000);
        let echoed = echo(&long);
        assert!(echoed.chars().count() < 100, "{echoed}");
        assert!(echoed.ends_with("… (20000 bytes)"), "{echoed}");
    }

    #[test]
    fn hook_errors_abort_with_error_info() {
        let e = HookError {
            agent: "a".into(),
            hook: "redact".into(),
            event: HookEvent::ToolResult,
            subject: HookSubject::ToolUse("toolu_1".into()),
            failure: HookFailure::Status(Code::Unimplemented),
        };
        let s = hook_error(&e);
        assert_eq!(s.code(), Code::Aborted);
        let info = s.get_details_error_info().expect("error info");
        assert_eq!(info.reason, HOOK_FAILED);
        assert_eq!(info.metadata["hook"], "redact");
        assert_eq!(info.metadata["event"], "tool_result");
        assert_eq!(info.metadata["tool_use_id"], "toolu_1");
        assert_eq!(info.metadata["kind"], "status");
        assert_eq!(info.metadata["code"], "UNIMPLEMENTED");
        for (e, code) in
            [(AgentError::DeadlineExceeded, Code::DeadlineExceeded), (AgentError::Cancelled, Code::Cancelled)]
        {
            assert_eq!(agent_error(&e).code(), code);
        }
    }
}
