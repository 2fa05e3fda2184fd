//! The model boundary: one trait, one implementation per provider.

mod scripted;

use std::sync::Arc;

pub use scripted::Scripted;

use crate::{
    config::ModelConfig,
    domain::{AssistantReply, ModelRequest},
};

/// Where a model request comes from (for ids, logs and echo).
#[derive(Debug, Clone)]
pub struct ModelContext {
    /// The agent.
    pub agent: String,
    /// The query's id.
    pub query_id: String,
    /// 1-based turn.
    pub turn: u32,
}

/// Why a model request failed. The message never carries request content.
#[derive(Debug, Clone, thiserror::Error)]
#[error("model {provider} failed ({kind:?}): {message}")]
pub struct ModelError {
    /// Which provider.
    pub provider: String,
    /// The kind of failure (decides the client's status code).
    pub kind: ModelErrorKind,
    /// What happened, without content.
    pub message: String,
}

/// Kinds of model failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelErrorKind {
    /// Unreachable, 5xx, overloaded, rate limited beyond the retry budget.
    Unavailable,
    /// The key was refused.
    Unauthenticated,
    /// The key may not do this.
    PermissionDenied,
    /// The provider refused the request as invalid.
    InvalidRequest,
    /// The response could not be understood.
    InvalidResponse,
}

/// A model: turns a request into the assistant's reply.
#[tonic::async_trait]
pub trait Model: Send + Sync + std::fmt::Debug {
    /// Sends one request. Dropping the future cancels it.
    async fn complete(&self, request: &ModelRequest, ctx: &ModelContext) -> Result<AssistantReply, ModelError>;
}

/// Builds the model an agent's config names.
pub fn build(config: &ModelConfig) -> Arc<dyn Model> {
    match config {
        ModelConfig::Scripted { script, .. } => Arc::new(Scripted::new(script.clone())),
    }
}
