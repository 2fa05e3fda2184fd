//! An agent's tools: remote ToolService clients and delegated agents, the
//! specs offered to the model, and the calls themselves.
//!
//! A remote call never aborts a query: a failed RPC, a deadline or an
//! `is_error` answer becomes an error result that the model reads.

use std::{collections::HashMap, sync::Arc, time::Duration};

use lattice_proto::tools::v1 as pb;
use serde_json::Value;
use tokio::time::Instant;
use tracing::{debug, info};

use crate::{
    config::{AgentDef, ServerSettings},
    convert,
    domain::{JsonObject, ResultSource, ToolErrorKind, ToolFailure, ToolResult, ToolSpec, ToolUse},
    peer::{CallDeadline, Peer},
    scope::Scope,
};

/// Where a tool's calls go.
#[derive(Debug, Clone)]
pub enum Binding {
    /// A remote ToolService.
    Remote {
        /// For logs, GetAgent and the hooks' `source`.
        endpoint: String,
        /// The call's deadline.
        deadline: Duration,
        /// The service's addresses and their readiness (a cheap clone;
        /// every clone shares the connections).
        peer: Peer,
        /// The largest request or reply (`server.tool_max_message_bytes`).
        max_message: usize,
        /// Whether calls use TLS.
        tls: bool,
    },
    /// Another agent, run on a fresh session.
    Agent {
        /// The delegated agent.
        agent: String,
        /// The whole delegated run's deadline.
        deadline: Duration,
    },
}

impl Binding {
    /// "endpoint" or "agent:NAME".
    pub fn target(&self) -> String {
        match self {
            Binding::Remote { endpoint, .. } => endpoint.clone(),
            Binding::Agent { agent, .. } => format!("agent:{agent}"),
        }
    }

    /// The call's deadline.
    pub fn deadline(&self) -> Duration {
        match self {
            Binding::Remote { deadline, .. } | Binding::Agent { deadline, .. } => *deadline,
        }
    }
}

pub use crate::domain::CallOutcome;

/// A tool call's result before the hooks, with what the hooks are told.
#[derive(Debug, Clone)]
pub struct RawResult {
    /// The result block.
    pub result: ToolResult,
    /// Why it did not execute successfully, if so.
    pub error: Option<ToolFailure>,
    /// What produced it.
    pub source: ResultSource,
    /// How the call went.
    pub outcome: CallOutcome,
}

impl RawResult {
    /// A result Lattice makes itself (blocked, unknown, cancelled).
    pub fn lattice(tool_use_id: &str, kind: ToolErrorKind, message: String, outcome: CallOutcome) -> Self {
        Self::failed(tool_use_id, kind, message, ResultSource::Lattice, outcome)
    }

    /// An error result for the model, with what the hooks are told about it.
    pub fn failed(
        tool_use_id: &str,
        kind: ToolErrorKind,
        message: String,
        source: ResultSource,
        outcome: CallOutcome,
    ) -> Self {
        Self {
            result: ToolResult::text(tool_use_id, message.clone(), true),
            error: Some(ToolFailure { kind, message }),
            source,
            outcome,
        }
    }
}

/// An agent's tools.
#[derive(Debug, Clone, Default)]
pub struct AgentTools {
    /// Offered to the model, in config order (each model request shares
    /// them).
    pub specs: Arc<[ToolSpec]>,
    /// Name → where calls go.
    pub bindings: HashMap<String, Binding>,
}

/// Why the tools could not be set up at start-up.
#[derive(Debug, thiserror::Error)]
pub enum ToolSetupError {
    /// ListTools did not answer in time.
    #[error("agent {agent:?}: tool service {endpoint} did not answer ListTools within {timeout_ms} ms: {reason}")]
    Discovery {
        /// The agent.
        agent: String,
        /// The tool service.
        endpoint: String,
        /// The discovery timeout.
        timeout_ms: u64,
        /// The last error.
        reason: String,
    },
    /// Two tools share a name.
    #[error("agent {agent:?}: tool {name:?} is offered twice")]
    Duplicate {
        /// The agent.
        agent: String,
        /// The name.
        name: String,
    },
    /// `only` names a tool the service lacks.
    #[error("agent {agent:?}: tool service {endpoint} has no tool {name:?}")]
    Missing {
        /// The agent.
        agent: String,
        /// The tool service.
        endpoint: String,
        /// The name.
        name: String,
    },
    /// Bad endpoint.
    #[error("agent {agent:?}: endpoint {endpoint}: {reason}")]
    Endpoint {
        /// The agent.
        agent: String,
        /// The endpoint.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// The input schema of a delegated agent's tool.
fn delegate_schema() -> JsonObject {
    let v = serde_json::json!({
        "type": "object",
        "properties": {"prompt": {"type": "string", "description": "The task for the agent."}},
        "required": ["prompt"]
    });
    match v {
        Value::Object(o) => o,
        _ => JsonObject::new(),
    }
}

impl AgentTools {
    /// Connects (lazily) to the agent's tool services and learns their tools:
    /// declared in config, or discovered with ListTools, retried until the
    /// discovery timeout so that tool services may start after Lattice.
    pub async fn build(
        def: &AgentDef,
        settings: &ServerSettings,
        transport: &crate::peer::Transport,
    ) -> Result<Self, ToolSetupError> {
        let mut tools = AgentTools::default();
        for source in &def.tool_sources {
            // Half the call's deadline to connect (see `HookChain::new`).
            let connect_timeout = source.deadline / 2;
            let peer =
                Peer::connect(&source.endpoint, source.tls.as_ref(), connect_timeout, transport).map_err(|reason| {
                    ToolSetupError::Endpoint { agent: def.name.clone(), endpoint: source.endpoint.clone(), reason }
                })?;
            let client = pb::tool_service_client::ToolServiceClient::new(peer.clone())
                .max_decoding_message_size(settings.tool_max_message_bytes)
                .max_encoding_message_size(settings.tool_max_message_bytes);
            let specs = match &source.declared {
                Some(declared) => declared.clone(),
                None => discover(&def.name, &source.endpoint, client.clone(), settings.tool_discovery_timeout).await?,
            };
            if let Some(name) = source.only.iter().flatten().find(|n| !specs.iter().any(|s| &s.name == *n)) {
                return Err(ToolSetupError::Missing {
                    agent: def.name.clone(),
                    endpoint: source.endpoint.clone(),
                    name: name.clone(),
                });
            }
            for spec in specs {
                if source.only.as_ref().is_some_and(|only| !only.contains(&spec.name)) {
                    continue;
                }
                let binding = Binding::Remote {
                    endpoint: source.endpoint.clone(),
                    deadline: source.deadline,
                    peer: peer.clone(),
                    max_message: settings.tool_max_message_bytes,
                    tls: peer.tls,
                };
                tools.add(&def.name, spec, binding)?;
            }
        }
        for d in &def.delegates {
            let spec = ToolSpec {
                name: d.tool_name.clone(),
                description: d.description.clone(),
                input_schema: delegate_schema(),
            };
            tools.add(&def.name, spec, Binding::Agent { agent: d.agent.clone(), deadline: d.deadline })?;
        }
        info!(agent = %def.name, tools = tools.specs.len(), "tools ready");
        Ok(tools)
    }

    fn add(&mut self, agent: &str, spec: ToolSpec, binding: Binding) -> Result<(), ToolSetupError> {
        if self.bindings.contains_key(&spec.name) {
            return Err(ToolSetupError::Duplicate { agent: agent.to_owned(), name: spec.name });
        }
        self.bindings.insert(spec.name.clone(), binding);
        // At set-up only: a list of a few specs, copied to add one.
        self.specs = self.specs.iter().cloned().chain([spec]).collect();
        Ok(())
    }
}

async fn discover(
    agent: &str,
    endpoint: &str,
    mut client: pb::tool_service_client::ToolServiceClient<Peer>,
    timeout: Duration,
) -> Result<Vec<ToolSpec>, ToolSetupError> {
    let give_up = Instant::now() + timeout;
    loop {
        let attempt = tokio::time::timeout_at(give_up, client.list_tools(pb::ListToolsRequest {})).await;
        let reason = match attempt {
            Ok(Ok(reply)) => {
                return Ok(reply
                    .into_inner()
                    .tools
                    .into_iter()
                    .map(|t| ToolSpec {
                        name: t.name,
                        description: t.description,
                        input_schema: convert::from_struct(t.input_schema),
                    })
                    .collect());
            }
            Ok(Err(status)) => format!("status {:?}", status.code()),
            Err(_) => "timed out".to_owned(),
        };
        if Instant::now() + Duration::from_millis(250) >= give_up {
            return Err(ToolSetupError::Discovery {
                agent: agent.to_owned(),
                endpoint: endpoint.to_owned(),
                timeout_ms: timeout.as_millis() as u64,
                reason,
            });
        }
        debug!(%endpoint, %reason, "tool service not ready; retrying ListTools");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `ToolService/CallTool`.
const CALL_TOOL: &str = "/lattice.tools.v1.ToolService/CallTool";

/// Calls a remote tool within `deadline`. Never fails: every failure is an
/// error result for the model. Dropping the future cancels the RPC (the
/// HTTP/2 stream is reset, which the tool service observes).
pub async fn call_remote(
    peer: &Peer,
    max_message: usize,
    endpoint: &str,
    call: &ToolUse,
    scope: &Scope,
    deadline: Instant,
) -> RawResult {
    use ToolErrorKind as K;
    let source = ResultSource::ToolService(endpoint.to_owned());
    let failed =
        |kind: K, message: String| RawResult::failed(&call.id, kind, message, source.clone(), CallOutcome::Failed);
    let budget = deadline.saturating_duration_since(Instant::now());
    if budget.is_zero() {
        return failed(K::Deadline, format!("tool {:?} was not called: no time left", call.name));
    }
    if peer.none() {
        return failed(K::RpcFailed, format!("tool {:?} was not called: its service has no ready address", call.name));
    }
    let message = pb::CallToolRequest {
        tool_use_id: call.id.clone(),
        name: call.name.clone(),
        input: Some(convert::to_struct(&call.input)),
        context: Some(pb::CallContext {
            agent: scope.agent.clone(),
            session_id: scope.session_id.clone(),
            query_id: scope.query_id.clone(),
        }),
    };
    let len = prost::Message::encoded_len(&message);
    if len > max_message {
        let why =
            format!("tool {:?} was not called: its request is {len} bytes, over the limit of {max_message}", call.name);
        return failed(K::RpcFailed, why);
    }
    let mut request = tonic::Request::new(message);
    // The transport sends the time left as grpc-timeout (on a transparent
    // retry too; see `peer`).
    request.extensions_mut().insert(CallDeadline::new(deadline));
    crate::telemetry::inject(&tracing::Span::current(), request.metadata_mut());
    let call_tool = crate::peer::unary::<_, pb::CallToolResponse>(peer.clone(), CALL_TOOL, request, len, max_message);
    match tokio::time::timeout_at(deadline, call_tool).await {
        Err(_) => failed(K::Deadline, format!("tool {:?} did not answer within {} ms", call.name, budget.as_millis())),
        Ok(Err(status)) if status.code() == tonic::Code::Cancelled && crate::peer::at_deadline(deadline) => {
            failed(K::Deadline, format!("tool {:?} did not answer within {} ms", call.name, budget.as_millis()))
        }
        // The tool's own status message is meant for the model (a tool
        // error), so it is passed on; it is a tool result like any other and
        // goes through the hooks before anything sees it.
        Ok(Err(status)) => {
            failed(K::RpcFailed, format!("tool {:?} failed: {:?}: {}", call.name, status.code(), status.message()))
        }
        Ok(Ok(reply)) => {
            let reply = reply.into_inner();
            let content: Vec<String> =
                reply.content.into_iter().filter_map(|c| c.kind.map(|pb::tool_content::Kind::Text(t)| t)).collect();
            let result = ToolResult { tool_use_id: call.id.clone(), content, is_error: reply.is_error };
            let error = reply
                .is_error
                .then(|| ToolFailure { kind: K::ToolError, message: "the tool reported an error".into() });
            RawResult { result, error, source, outcome: CallOutcome::Executed }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_call_path_names_the_contracts_service() {
        let service = lattice_proto::tools::v1::tool_service_server::SERVICE_NAME;
        assert_eq!(super::CALL_TOOL, format!("/{service}/CallTool"));
    }
}
