//! The events a query streams to its client, made from the run's own
//! values as they happen: converted to the client's messages on the run's
//! task (no copy of the value in between) and checked against the
//! client's message limit before they are queued.

use std::time::Duration;

use lattice_proto::agent::v1::{self as pb, query_event::Event as PbEvent};
use tokio::sync::mpsc;
use tonic::Status;

use crate::{
    agent::AgentError,
    domain::{Block, ModelRequest, ToolResult},
    tools::CallOutcome,
};

/// One event of a run, borrowing what it reports.
#[derive(Debug)]
pub enum Event<'a> {
    /// A model request as sent (after the hooks).
    ModelRequest {
        /// 1-based turn.
        turn: u32,
        /// The request.
        request: &'a ModelRequest,
    },
    /// A piece of assistant text as it streams from the model.
    TextDelta {
        /// 1-based turn.
        turn: u32,
        /// The text to append.
        text: String,
    },
    /// The model's reply.
    Assistant {
        /// 1-based turn.
        turn: u32,
        /// Its content.
        content: &'a [Block],
    },
    /// A tool result as the model will see it (after the hooks).
    ToolResult {
        /// 1-based turn.
        turn: u32,
        /// The tool.
        tool_name: &'a str,
        /// The result.
        result: &'a ToolResult,
        /// How the call went.
        outcome: CallOutcome,
        /// Call plus hooks.
        duration: Duration,
    },
}

/// What the response stream carries: an event, or the status that ends it.
#[derive(Debug)]
pub enum Out {
    /// An event.
    Event(PbEvent),
    /// The query failed.
    Fail(Status),
}

/// Where a run's events go: the client's response stream.
#[derive(Debug, Clone)]
pub struct EventTx {
    tx: mpsc::Sender<Out>,
    /// The largest message the client may be sent.
    limit: usize,
}

impl EventTx {
    /// Events into `tx`, each at most `limit` bytes encoded.
    pub fn new(tx: mpsc::Sender<Out>, limit: usize) -> Self {
        Self { tx, limit }
    }

    /// Queues one event (waiting while the client is behind). An event over
    /// the limit fails the query instead of breaking the stream; a client
    /// that went away is noticed by whoever drives the run, so that is not
    /// an error here.
    pub async fn send(&self, event: Event<'_>) -> Result<(), AgentError> {
        let event = sized(to_pb(event), self.limit)?;
        let _ = self.tx.send(Out::Event(event)).await;
        Ok(())
    }
}

fn to_pb(e: Event<'_>) -> PbEvent {
    match e {
        Event::ModelRequest { turn, request } => {
            PbEvent::ModelRequest(pb::ModelRequestEvent { turn, ..request.into() })
        }
        Event::TextDelta { turn, text } => PbEvent::TextDelta(pb::TextDelta { turn, text }),
        Event::Assistant { turn, content } => PbEvent::Assistant(pb::AssistantMessageEvent {
            turn,
            message: Some(pb::Message {
                role: pb::Role::Assistant as i32,
                content: content.iter().map(Into::into).collect(),
            }),
        }),
        Event::ToolResult { turn, tool_name, result, outcome, duration } => PbEvent::ToolResult(pb::ToolResultEvent {
            turn,
            tool_name: tool_name.to_owned(),
            result: Some(result.into()),
            outcome: match outcome {
                CallOutcome::Executed => pb::ToolCallOutcome::Executed,
                CallOutcome::Failed | CallOutcome::Cancelled => pb::ToolCallOutcome::Failed,
                CallOutcome::Blocked => pb::ToolCallOutcome::Blocked,
            } as i32,
            duration_ms: duration.as_millis() as u64,
        }),
    }
}

/// `event`, unless its encoded size is over `limit`.
pub fn sized(event: PbEvent, limit: usize) -> Result<PbEvent, AgentError> {
    let name = match &event {
        PbEvent::Started(_) => "started",
        PbEvent::ModelRequest(_) => "model_request",
        PbEvent::Assistant(_) => "assistant",
        PbEvent::ToolResult(_) => "tool_result",
        PbEvent::Result(_) => "result",
        PbEvent::TextDelta(_) => "text_delta",
    };
    let event = pb::QueryEvent { event: Some(event) };
    let bytes = prost::Message::encoded_len(&event);
    match event.event {
        Some(event) if bytes <= limit => Ok(event),
        _ => Err(AgentError::EventTooLarge { event: name, bytes, limit }),
    }
}
