//! The events a query streams to its client, made from the run's own
//! values as they happen: converted to the client's messages on the run's
//! task (no copy of the value in between) and checked against the
//! client's message limit before they are queued.

use std::{collections::VecDeque, time::Duration};

use lattice_proto::agent::v1::{self as pb, query_event::Event as PbEvent};
use tokio::sync::mpsc;
use tonic::Status;

use crate::domain::{Block, CallOutcome, ModelRequest, ToolResult};

/// An event of the query larger than one message to the client may be: the
/// query fails rather than send part of its output (the agent loop's
/// [`crate::agent::AgentError::EventTooLarge`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooLarge {
    /// Which event (`assistant`, `tool_result`, `model_request` …).
    pub event: &'static str,
    /// Its encoded size.
    pub bytes: usize,
    /// `server.max_message_bytes`.
    pub limit: usize,
}

/// One event of a run, borrowing what it reports.
#[derive(Debug)]
pub enum Event<'a> {
    /// A model request as sent (after the hooks).
    ModelRequest {
        /// 1-based turn.
        turn: u32,
        /// The request.
        request: &'a ModelRequest<'a>,
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

/// What the response stream carries: an event, or the status that ends it;
/// and when the query begins to finish.
#[derive(Debug)]
pub enum Out {
    /// An event.
    Event(PbEvent),
    /// The query failed.
    Fail(Status),
    /// The query's run is over and it now finishes: its commit (or the
    /// release of its lease), its trace. What it sent last, not yet on its
    /// way, is held back to leave with the result or the failure.
    Finishing,
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
    pub async fn send(&self, event: Event<'_>) -> Result<(), TooLarge> {
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
pub fn sized(event: PbEvent, limit: usize) -> Result<PbEvent, TooLarge> {
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
        _ => Err(TooLarge { event: name, bytes, limit }),
    }
}

/// A query's response stream: its events, then how it ended. A query
/// whose task is gone without a result or a failure (it panicked) ends
/// with INTERNAL, never as a stream that ended OK: a client must not take
/// a query cut short for one that succeeded. After the result the stream
/// still ends only once the task is gone, so a client that sees the end
/// finds everything the query held (its admission, its session) released.
///
/// While the query finishes (from [`Out::Finishing`] to its result or
/// failure: its commit, or the release of its lease, and its trace) the
/// stream yields nothing, so that its last events leave with its result (or
/// its failure) once the session store has answered: one write to the
/// client instead of two, and one wake-up of the client. What the query
/// sent just before (its final reply, queued an instant before) is held
/// back with them. The wait is bounded by the query's deadline.
#[derive(Debug)]
pub struct QueryEvents {
    rx: mpsc::Receiver<Out>,
    /// Received, not yet passed on: what was waiting in the channel when the
    /// stream last looked, at most [`CAPACITY`] (and what the query sends
    /// while it finishes: its result or its failure).
    queue: VecDeque<Result<PbEvent, Status>>,
    /// After [`Out::Finishing`], until the result or the failure.
    holding: bool,
    /// The task let go of its sender.
    closed: bool,
    /// The result or the failure has been passed on.
    ended: bool,
}

/// How many items a query's task may queue on its response stream (the
/// channel's capacity); the stream takes in as many ahead of what it
/// yields, so what a query has queued stays bounded by it.
pub const CAPACITY: usize = 32;

impl QueryEvents {
    /// The stream of what the query's task sends on `rx`, at once (the
    /// service hands it out with [`QueryEvents::after_first`]).
    fn new(rx: mpsc::Receiver<Out>) -> Self {
        Self { rx, queue: VecDeque::new(), holding: false, closed: false, ended: false }
    }

    /// The stream, once the task has sent its first event (or ended), and
    /// is not finishing.
    ///
    /// The response's headers then leave with the first events instead of
    /// on their own: the query's task runs to its first wait (a model or a
    /// tool call, whose request is queued first, or its commit) before the
    /// response is handed to the connection, so the client is sent one
    /// write fewer.
    pub async fn after_first(rx: mpsc::Receiver<Out>) -> Self {
        let mut events = Self::new(rx);
        std::future::poll_fn(|cx| events.poll_ready(cx)).await;
        events
    }

    /// Takes in what the task has sent so far; ready when there is
    /// something to yield (an item, or the end), not held back.
    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        while !self.closed && (self.holding || self.queue.len() < CAPACITY) {
            match self.rx.poll_recv(cx) {
                std::task::Poll::Ready(Some(Out::Finishing)) => self.holding = true,
                std::task::Poll::Ready(Some(Out::Event(event))) => {
                    // The result releases what was held back.
                    self.holding &= !matches!(event, PbEvent::Result(_));
                    self.queue.push_back(Ok(event));
                }
                std::task::Poll::Ready(Some(Out::Fail(status))) => {
                    self.holding = false;
                    self.queue.push_back(Err(status));
                }
                std::task::Poll::Ready(None) => self.closed = true,
                // The task is woken when more comes.
                std::task::Poll::Pending => break,
            }
        }
        // Nothing to yield yet, or held back. (A task gone while holding
        // leaves nothing to wait for.)
        if !self.closed && (self.holding || self.queue.is_empty()) {
            return std::task::Poll::Pending;
        }
        std::task::Poll::Ready(())
    }

    fn item(&mut self, out: Option<Result<PbEvent, Status>>) -> Option<Result<pb::QueryEvent, Status>> {
        Some(match out {
            Some(Ok(event)) => {
                self.ended |= matches!(event, PbEvent::Result(_));
                Ok(pb::QueryEvent { event: Some(event) })
            }
            Some(Err(status)) => {
                self.ended = true;
                Err(status)
            }
            // A closed channel answers `None` from then on.
            None if self.ended => return None,
            None => {
                self.ended = true;
                Err(Status::internal("the query ended without a result"))
            }
        })
    }
}

impl futures_util::Stream for QueryEvents {
    type Item = Result<pb::QueryEvent, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::task::ready!(self.poll_ready(cx));
        let out = self.queue.pop_front();
        std::task::Poll::Ready(self.item(out))
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt as _;

    use super::*;

    fn started() -> Out {
        Out::Event(PbEvent::Started(pb::QueryStarted::default()))
    }

    /// What a client reads of `sent`, from the stream as [`QueryEvents::new`]
    /// and as [`QueryEvents::after_first`] give it (the two must agree).
    async fn drain(sent: Vec<Out>) -> Vec<Result<pb::QueryEvent, tonic::Code>> {
        let mut read = vec![];
        for after_first in [false, true] {
            let (tx, rx) = mpsc::channel(8);
            for out in &sent {
                let out = match out {
                    Out::Event(e) => Out::Event(e.clone()),
                    Out::Fail(s) => Out::Fail(Status::new(s.code(), s.message())),
                    Out::Finishing => Out::Finishing,
                };
                assert!(tx.send(out).await.is_ok(), "the stream's receiver is open");
            }
            drop(tx);
            let events = if after_first { QueryEvents::after_first(rx).await } else { QueryEvents::new(rx) };
            read.push(events.map(|item| item.map_err(|s| s.code())).collect::<Vec<_>>().await);
        }
        assert_eq!(read[0], read[1], "after_first reads as new does");
        read.swap_remove(0)
    }

    /// A task that ended without a result or a failure ends the stream
    /// with INTERNAL; one that sent either ends it there.
    #[tokio::test]
    async fn a_stream_ends_with_the_result_the_failure_or_internal() {
        let cut = drain(vec![started()]).await;
        assert_eq!(cut.len(), 2);
        assert_eq!(cut[1], Err(tonic::Code::Internal));

        let result = Out::Event(PbEvent::Result(pb::FinalResult::default()));
        let ok = drain(vec![started(), result]).await;
        assert_eq!(ok.len(), 2);
        assert!(ok.iter().all(Result::is_ok), "{ok:?}");

        let failed = drain(vec![started(), Out::Fail(Status::aborted("hook"))]).await;
        assert_eq!(failed.len(), 2);
        assert_eq!(failed[1], Err(tonic::Code::Aborted));

        assert_eq!(drain(vec![]).await, vec![Err(tonic::Code::Internal)]);
    }

    /// The stream is handed out once the task has sent its first event,
    /// which it then yields first.
    #[tokio::test]
    async fn the_stream_is_handed_out_with_the_first_event() {
        use futures_util::FutureExt as _;

        let (tx, rx) = mpsc::channel(8);
        let mut waiting = Box::pin(QueryEvents::after_first(rx));
        assert!((&mut waiting).now_or_never().is_none(), "handed out before the task sent anything");
        assert!(tx.send(started()).await.is_ok(), "the stream's receiver is open");
        let mut events = waiting.await;
        let first = events.next().await;
        assert!(matches!(first, Some(Ok(pb::QueryEvent { event: Some(PbEvent::Started(_)) }))), "{first:?}");
        assert!(events.next().now_or_never().is_none(), "ended while the task still held its sender");
    }

    fn assistant() -> Out {
        Out::Event(PbEvent::Assistant(pb::AssistantMessageEvent::default()))
    }

    fn result() -> Out {
        Out::Event(PbEvent::Result(pb::FinalResult::default()))
    }

    /// The names of the events `events` yields now, without waiting.
    fn ready_now(events: &mut QueryEvents) -> Vec<&'static str> {
        use futures_util::FutureExt as _;

        let mut names = vec![];
        while let Some(Some(item)) = events.next().now_or_never() {
            names.push(match item.map(|e| e.event) {
                Ok(Some(PbEvent::Started(_))) => "started",
                Ok(Some(PbEvent::Assistant(_))) => "assistant",
                Ok(Some(PbEvent::Result(_))) => "result",
                Ok(_) => "other",
                Err(_) => "failure",
            });
        }
        names
    }

    /// While the query finishes, the stream yields nothing: what the task
    /// sent just before it began to finish leaves with the result (or the
    /// failure), in order; what it sent earlier and was yielded is not
    /// held back.
    #[tokio::test]
    async fn the_last_events_leave_with_the_result() {
        for end in [result(), Out::Fail(Status::unavailable("store"))] {
            let (tx, rx) = mpsc::channel(8);
            let mut events = QueryEvents::new(rx);
            for out in [started(), assistant(), Out::Finishing] {
                assert!(tx.send(out).await.is_ok(), "the stream's receiver is open");
            }
            assert_eq!(ready_now(&mut events), Vec::<&str>::new(), "held back while the query finishes");
            assert!(tx.send(end).await.is_ok());
            let last = ready_now(&mut events);
            assert!(matches!(last.last(), Some(&"result" | &"failure")), "{last:?}");
            assert_eq!(last[..2], ["started", "assistant"], "in order, with the end");
        }

        // Yielded before the query began to finish: not held back.
        let (tx, rx) = mpsc::channel(8);
        let mut events = QueryEvents::new(rx);
        assert!(tx.send(started()).await.is_ok());
        assert_eq!(ready_now(&mut events), ["started"]);
        assert!(tx.send(assistant()).await.is_ok() && tx.send(Out::Finishing).await.is_ok());
        assert_eq!(ready_now(&mut events), Vec::<&str>::new());
        drop(tx);
        // A task gone while finishing leaves nothing to wait for.
        assert_eq!(ready_now(&mut events), ["assistant", "failure"]);
    }

    /// The stream is handed out once the query is not finishing: a query
    /// whose run ended before its first wait sends its events in one go,
    /// with the response's headers.
    #[tokio::test]
    async fn the_stream_is_handed_out_after_the_finish() {
        use futures_util::FutureExt as _;

        let (tx, rx) = mpsc::channel(8);
        let mut waiting = Box::pin(QueryEvents::after_first(rx));
        for out in [started(), assistant(), Out::Finishing] {
            assert!(tx.send(out).await.is_ok(), "the stream's receiver is open");
        }
        assert!((&mut waiting).now_or_never().is_none(), "handed out while the query finishes");
        assert!(tx.send(result()).await.is_ok());
        let mut events = waiting.await;
        assert_eq!(ready_now(&mut events), ["started", "assistant", "result"]);
    }

    /// After the result, the stream ends when the query's task lets go of
    /// its sender (having released what it held), not before.
    #[tokio::test]
    async fn the_stream_ends_once_the_task_is_gone() {
        use futures_util::FutureExt as _;

        let (tx, rx) = mpsc::channel(8);
        let mut events = QueryEvents::new(rx);
        let sent = tx.send(Out::Event(PbEvent::Result(pb::FinalResult::default()))).await;
        assert!(sent.is_ok(), "the stream's receiver is open");
        assert!(matches!(events.next().await, Some(Ok(_))));
        assert!(events.next().now_or_never().is_none(), "ended while the task still held its sender");
        drop(tx);
        assert!(events.next().await.is_none());
    }
}
