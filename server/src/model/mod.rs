//! The model boundary: one trait, one implementation per provider.
//!
//! - `scripted`: deterministic and offline (the default; tests and demos).
//! - `anthropic`: the Messages API.
//! - `openai`: Chat Completions, as served by OpenAI and compatible servers.

mod anthropic;
mod http;
mod openai;
mod scripted;

use std::sync::Arc;

pub use scripted::Scripted;
use tokio::sync::mpsc;

use crate::{
    config::{ModelConfig, Provider},
    domain::{AssistantReply, ModelRequest},
    scope::Step,
};

/// Why a model request failed. The message never carries request content,
/// nor the API key.
#[derive(Debug, Clone, thiserror::Error)]
#[error("model provider {provider} failed: {message}")]
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
    /// The response could not be understood, or broke off mid-stream.
    InvalidResponse,
}

impl ModelErrorKind {
    /// Its name in metrics and error details.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelErrorKind::Unavailable => "unavailable",
            ModelErrorKind::Unauthenticated => "unauthenticated",
            ModelErrorKind::PermissionDenied => "permission_denied",
            ModelErrorKind::InvalidRequest => "invalid_request",
            ModelErrorKind::InvalidResponse => "invalid_response",
        }
    }
}

/// Where a streaming model sends text as it arrives. Inactive (a no-op)
/// for delegated runs, whose text reaches nobody but their parent.
#[derive(Debug, Clone, Default)]
pub struct DeltaSink(Option<mpsc::UnboundedSender<String>>);

impl DeltaSink {
    /// A sink feeding `tx`.
    pub fn new(tx: mpsc::UnboundedSender<String>) -> Self {
        Self(Some(tx))
    }

    /// Sends a piece of assistant text.
    pub fn send(&self, text: &str) {
        if let Some(tx) = self.0.as_ref().filter(|_| !text.is_empty()) {
            let _ = tx.send(text.to_owned());
        }
    }
}

/// A model: turns a request into the assistant's reply.
#[tonic::async_trait]
pub trait Model: Send + Sync + std::fmt::Debug {
    /// Sends one request for `step` (whose scope's deadline it must not
    /// outlive); streaming models also send text to `deltas` as it arrives.
    /// Dropping the future cancels the request.
    async fn complete(
        &self,
        request: &ModelRequest<'_>,
        step: Step<'_>,
        deltas: DeltaSink,
    ) -> Result<AssistantReply, ModelError>;
}

/// Why a model could not be built.
#[derive(Debug, thiserror::Error)]
#[error("model {label}: {message}")]
pub struct ModelSetupError {
    /// `provider/name`.
    pub label: String,
    /// What failed.
    pub message: String,
}

/// Builds the model an agent's config names.
pub fn build(config: &ModelConfig) -> Result<Arc<dyn Model>, ModelSetupError> {
    Ok(match config {
        ModelConfig::Scripted { script, .. } => Arc::new(Scripted::new(script.clone())),
        ModelConfig::Http(h) => {
            let client = http::HttpModel::new(h.clone())
                .map_err(|message| ModelSetupError { label: config.label(), message })?;
            match h.provider {
                Provider::Anthropic => Arc::new(anthropic::Anthropic(client)),
                Provider::OpenAi => Arc::new(openai::OpenAi(client)),
            }
        }
    })
}
