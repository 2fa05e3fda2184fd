//! `AgentService/TestHooks`: a dry run of an agent's hook chain on a value
//! the caller gives. The real hooks run, in order, through the same code
//! as a query's; no model or tool is called and no session is touched.

use std::time::Duration;

use lattice_proto::agent::v1::{self as pb, test_hooks_request::Value};
use tokio::time::Instant;
use tonic::Status;

use crate::{
    agent::Runtime,
    convert,
    domain::{ModelRequest, ResultSource, ToolErrorKind, ToolFailure, ToolResult, validate_conversation},
    hooks::{ChainError, HookFailure, Observed, ToolCallView},
    scope::{Scope, Step},
    status,
    tools::Binding,
};

/// Runs the dry run within `budget`.
pub async fn test_hooks(
    runtime: &Runtime,
    req: pb::TestHooksRequest,
    budget: Duration,
) -> Result<pb::TestHooksResponse, Status> {
    let agent = runtime
        .agent(&req.agent)
        .ok_or_else(|| Status::not_found(format!("no agent named {}", status::echo(&req.agent))))?;
    let scope = Scope {
        agent: agent.def.name.clone(),
        // No session: the hooks can tell a dry run by the empty id.
        session_id: String::new(),
        query_id: uuid::Uuid::new_v4().to_string(),
        deadline: Instant::now() + budget,
        // A dry run reports each hook's output itself.
        audit: None,
    };
    let mut response = pb::TestHooksResponse::default();
    match req.value {
        None => return Err(Status::invalid_argument("give a tool_result or a model_request to run the hooks on")),
        Some(Value::ToolResult(t)) => {
            let result = t.result.ok_or_else(|| Status::invalid_argument("tool_result.result is required"))?;
            if result.tool_use_id.is_empty() {
                return Err(Status::invalid_argument("tool_result.result.tool_use_id is required"));
            }
            let result = ToolResult::from(result);
            let source = match agent.tools().and_then(|tools| tools.bindings.get(&t.tool_name)) {
                Some(Binding::Remote { endpoint, .. }) => ResultSource::ToolService(endpoint.clone()),
                Some(Binding::Agent { agent, .. }) => ResultSource::DelegatedAgent(agent.clone()),
                None => ResultSource::Lattice,
            };
            let error = result.is_error.then(|| ToolFailure {
                kind: ToolErrorKind::ToolError,
                message: "the tool answered is_error".to_owned(),
            });
            let (input, id) = (convert::from_struct(t.input), result.tool_use_id.clone());
            let call = ToolCallView { tool_name: &t.tool_name, tool_use_id: &id, input: &input, error, source };
            let steps = &mut response.steps;
            let mut observe = |o: Observed<'_, ToolResult>| {
                let mut step = step_of(&o);
                if let Ok(value) = o.outcome {
                    step.tool_result = Some(value.into());
                }
                steps.push(step);
            };
            let step = Step { scope: &scope, turn: 1 };
            let ran = agent.hooks.on_tool_result_observed(step, &call, result, Some(&mut observe)).await;
            if let Ok(value) = ran {
                response.completed = true;
                response.tool_result = Some((&value).into());
            }
        }
        Some(Value::ModelRequest(m)) => {
            let messages = convert::messages_from_pb(m.messages)
                .map_err(|e| Status::invalid_argument(format!("model_request.messages: {}", e.0)))?;
            if messages.is_empty() {
                return Err(Status::invalid_argument("model_request.messages must not be empty"));
            }
            validate_conversation(&messages)
                .map_err(|why| Status::invalid_argument(format!("model_request.messages: {why}")))?;
            let tools = agent.tools().map(|t| t.specs.clone()).unwrap_or_default();
            let request = ModelRequest { system: m.system.into(), messages: messages.into(), tools };
            let steps = &mut response.steps;
            let mut observe = |o: Observed<'_, ModelRequest<'_>>| {
                let mut step = step_of(&o);
                if let Ok(value) = o.outcome {
                    step.system = value.system.to_string();
                    step.messages = convert::messages_to_pb(&value.messages);
                }
                steps.push(step);
            };
            let turn = m.turn.max(1);
            let step = Step { scope: &scope, turn };
            let ran = agent.hooks.on_model_request_observed(step, request, Some(&mut observe)).await;
            if let Ok(value) = ran {
                response.completed = true;
                response.system = value.system.into_owned();
                response.messages = convert::messages_to_pb(&value.messages);
            }
        }
    }
    Ok(response)
}

/// A step's report, without its output.
fn step_of<V>(o: &Observed<'_, V>) -> pb::HookStep {
    let failure = o.outcome.as_ref().err().map(|e| match e {
        ChainError::Hook(h) => pb::HookStepFailure {
            kind: h.failure.kind().to_owned(),
            code: match &h.failure {
                HookFailure::Status(code) => status::code_name(*code).to_owned(),
                _ => String::new(),
            },
            message: h.to_string(),
        },
        ChainError::QueryDeadline => pb::HookStepFailure {
            kind: "deadline".to_owned(),
            code: String::new(),
            message: "the dry run's deadline passed during the hook call".to_owned(),
        },
    });
    pb::HookStep {
        hook: o.hook.to_owned(),
        not_matched: !o.matched,
        replaced: o.replaced,
        changed: o.changed,
        latency_ms: o.took.as_secs_f64() * 1000.0,
        failure,
        ..Default::default()
    }
}
