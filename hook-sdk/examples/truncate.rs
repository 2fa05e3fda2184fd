//! `truncate`: model-request truncation.
//!
//! Keeps the system prompt, the first user message and the last N messages
//! (`--keep-last`, default 6); drops the middle. It never separates a
//! tool_use from its tool_result: when the cut would leave a tool_result
//! without its tool_use, the cut moves one message earlier, so the kept tail
//! always starts with an assistant message and roles keep alternating.
//!
//! The change shapes one request only: Lattice keeps the whole conversation,
//! and the next turn's request is truncated afresh.
//!
//! Run: `cargo run -p lattice-hook-sdk --example truncate -- --listen 127.0.0.1:50072 --keep-last 6`
//! and register it for the `model_request` event.

use std::net::SocketAddr;

use clap::Parser;
use lattice_hook_sdk::{Hook, Message, ModelRequestCall, ModelRequestChange, Role, Status, async_trait};

/// Where the kept tail starts, or `None` when nothing needs dropping.
pub fn cut(messages: &[Message], keep_last: usize) -> Option<usize> {
    let n = messages.len();
    if n <= keep_last + 1 {
        return None;
    }
    let mut start = n - keep_last;
    // The message after the first (a user message) must be an assistant
    // message; a user message here would also hold tool_results whose
    // tool_use is in the message before it.
    if messages[start].role() == Role::User {
        start -= 1;
    }
    (start > 1).then_some(start)
}

/// The hook.
pub struct Truncate {
    /// Messages kept at the end.
    pub keep_last: usize,
}

#[async_trait]
impl Hook for Truncate {
    async fn on_model_request(&self, call: ModelRequestCall) -> Result<ModelRequestChange, Status> {
        let Some(start) = cut(&call.messages, self.keep_last) else { return Ok(ModelRequestChange::keep()) };
        let mut kept = Vec::with_capacity(self.keep_last + 2);
        kept.push(call.messages[0].clone());
        kept.extend_from_slice(&call.messages[start..]);
        tracing::info!(turn = call.context.turn, from = call.messages.len(), to = kept.len(), "truncated");
        Ok(ModelRequestChange::messages(kept))
    }
}

#[derive(Parser)]
struct Args {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:50072")]
    listen: SocketAddr,
    /// Messages kept at the end (besides the first user message).
    #[arg(long, default_value_t = 6)]
    keep_last: usize,
    /// Log lines: text or json.
    #[arg(long, default_value = "text")]
    log_format: lattice_hook_sdk::LogFormat,
}

#[tokio::main]
async fn main() -> Result<(), lattice_hook_sdk::ServeError> {
    let args = Args::parse();
    lattice_hook_sdk::init_logs(args.log_format);
    lattice_hook_sdk::serve(Truncate { keep_last: args.keep_last.max(1) }, args.listen).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use lattice_hook_sdk::{ContentBlock, ToolResultBlock, content_block::Block, proto::agent::v1::ToolUseBlock};

    fn text(role: Role, t: &str) -> Message {
        lattice_hook_sdk::text_message(role, t)
    }
    fn tool_use(id: &str) -> Message {
        let b = Block::ToolUse(ToolUseBlock { id: id.into(), name: "t".into(), input: None });
        Message { role: Role::Assistant as i32, content: vec![ContentBlock { block: Some(b) }] }
    }
    fn tool_result(id: &str) -> Message {
        let b = Block::ToolResult(ToolResultBlock { tool_use_id: id.into(), content: vec![], is_error: false });
        Message { role: Role::User as i32, content: vec![ContentBlock { block: Some(b) }] }
    }

    /// user, (assistant tool_use, user tool_result) × 5, assistant text.
    fn conversation() -> Vec<Message> {
        let mut m = vec![text(Role::User, "first")];
        for i in 0..5 {
            m.push(tool_use(&format!("t{i}")));
            m.push(tool_result(&format!("t{i}")));
        }
        m.push(text(Role::Assistant, "done"));
        m
    }

    fn pairs_intact(kept: &[Message]) -> bool {
        kept.windows(2).all(|w| w[0].role() != w[1].role()) && kept[1].role() == Role::Assistant
    }

    #[tokio::test]
    async fn keeps_first_and_last_without_splitting_pairs() {
        let messages = conversation();
        for keep_last in 1..=10 {
            let call = ModelRequestCall { messages: messages.clone(), ..Default::default() };
            let change = Truncate { keep_last }.on_model_request(call).await.unwrap();
            let Some(kept) = change.messages else { continue };
            assert_eq!(kept[0], messages[0], "the first user message stays");
            assert_eq!(kept.last(), messages.last(), "the tail stays");
            assert!(kept.len() < messages.len());
            assert!(pairs_intact(&kept), "keep_last={keep_last}: {kept:?}");
            assert!(kept.len() <= keep_last + 2);
        }
        assert_eq!(cut(&messages, 20), None);
    }
}
