//! Why a run failed.

use super::*;

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A hook failed: the query is aborted.
    #[error(transparent)]
    Hook(HookError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The query's deadline passed.
    #[error("the query's deadline passed")]
    DeadlineExceeded,
    /// The client went away.
    #[error("the client cancelled the query")]
    Cancelled,
    /// The agent's tools have not been discovered yet.
    #[error("agent {0:?} is not ready: its tool services have not answered ListTools yet")]
    NotReady(String),
    /// The session store failed (lease lost, unreachable, full): nothing
    /// was written.
    #[error(transparent)]
    Store(#[from] crate::session::StoreError),
    /// An event of the query is larger than one message to the client may
    /// be: the query fails rather than send part of its output.
    #[error("the query's {event} event ({bytes} bytes) exceeds the message limit ({limit} bytes)")]
    EventTooLarge {
        /// Which event (`assistant`, `tool_result`, `model_request` …).
        event: &'static str,
        /// Its encoded size.
        bytes: usize,
        /// `server.max_message_bytes`.
        limit: usize,
    },
}

impl From<crate::events::TooLarge> for AgentError {
    fn from(e: crate::events::TooLarge) -> Self {
        AgentError::EventTooLarge { event: e.event, bytes: e.bytes, limit: e.limit }
    }
}

impl From<ChainError> for AgentError {
    fn from(e: ChainError) -> Self {
        match e {
            ChainError::Hook(h) => AgentError::Hook(h),
            ChainError::QueryDeadline => AgentError::DeadlineExceeded,
        }
    }
}
