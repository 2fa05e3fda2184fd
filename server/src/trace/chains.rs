//! What a session's trace file already holds of its requests, so that a
//! `model_request` line records only what its request adds (see the
//! module docs of `trace`).

use super::*;

/// What the last `model_request` line queued for a session holds of its
/// query's conversation: the next request's line records only what follows
/// the part the two share.
#[derive(Debug, Clone)]
pub(super) struct Chain {
    /// The query whose request it was.
    pub(super) query_id: String,
    /// The line's first `sent` messages are the conversation's first.
    pub(super) sent: usize,
    /// The conversation's first `committed` messages are committed, so
    /// every later query's conversation begins with them.
    pub(super) committed: usize,
    /// The request's tools (held, so that the same list is known by its
    /// address).
    pub(super) tools: Arc<[ToolSpec]>,
    /// The request's system prompt where it was its agent's (held, so that
    /// the same prompt is known by its address); `None` where a hook
    /// replaced it.
    pub(super) system: Option<Arc<str>>,
}

/// What a request's line shares with the session's previous line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sharing {
    /// How many messages that line holds first (0: the line is whole).
    pub(super) kept: usize,
    /// Whether it offered the same tools.
    pub(super) tools: bool,
    /// Whether it had the same system prompt, its agent's.
    pub(super) system: bool,
}

/// Sessions whose chain is known at most; past it they all start over
/// (each session's next request is recorded whole).
pub(super) const CHAINS_KEPT: usize = 65_536;

/// The chains of the sessions this replica traces, shared by the query
/// path (which extends them) and the writer (which ends one when its file
/// could no longer continue it).
#[derive(Debug, Default)]
pub(super) struct Chains(Mutex<HashMap<String, Chain>>);

impl Chains {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Chain>> {
        crate::sync::lock(&self.0)
    }

    /// Records that `query` sends a request whose first `shared` messages
    /// are its conversation's (of which the first `history` are committed
    /// history), offering `tools`, with `system` where its system prompt is
    /// its agent's; returns what the session's previous request line shares
    /// with it.
    pub(super) fn extend(
        &self,
        session: &str,
        query: &str,
        shared: usize,
        history: usize,
        tools: &Arc<[ToolSpec]>,
        system: Option<&Arc<str>>,
    ) -> Sharing {
        let mut chains = self.lock();
        let (kept, committed) = match chains.get(session) {
            Some(c) if c.query_id == query => (c.sent.min(shared), c.committed),
            // Another query's conversation: only the committed part is
            // known to be this one's too.
            Some(c) if c.committed <= history => (c.sent.min(c.committed).min(shared), history),
            _ => (0, history),
        };
        let previous = chains.get(session).filter(|_| kept > 0);
        let same = Sharing {
            kept,
            tools: previous.is_some_and(|c| Arc::ptr_eq(&c.tools, tools)),
            system: previous.and_then(|c| c.system.as_ref()).zip(system).is_some_and(|(a, b)| Arc::ptr_eq(a, b)),
        };
        if chains.len() >= CHAINS_KEPT && !chains.contains_key(session) {
            chains.clear();
        }
        match chains.get_mut(session) {
            Some(c) => {
                if c.query_id != query {
                    c.query_id = query.to_owned();
                }
                c.sent = shared;
                c.committed = committed;
                if !Arc::ptr_eq(&c.tools, tools) {
                    c.tools = tools.clone();
                }
                if !same.system {
                    c.system = system.cloned();
                }
            }
            None => {
                let chain = Chain {
                    query_id: query.to_owned(),
                    sent: shared,
                    committed,
                    tools: tools.clone(),
                    system: system.cloned(),
                };
                chains.insert(session.to_owned(), chain);
            }
        }
        same
    }

    /// `query` committed the first `len` messages of its conversation.
    pub(super) fn committed(&self, session: &str, query: &str, len: usize) {
        if let Some(c) = self.lock().get_mut(session).filter(|c| c.query_id == query) {
            c.committed = len;
        }
    }

    /// The session's next request is recorded whole.
    pub(super) fn end(&self, session: &str) {
        self.lock().remove(session);
    }
}

/// How many of `sent`'s first messages are `conversation`'s first.
pub(super) fn shared_prefix(sent: &[Message], conversation: &[Message]) -> usize {
    if std::ptr::eq(sent.as_ptr(), conversation.as_ptr()) {
        return sent.len().min(conversation.len());
    }
    sent.iter().zip(conversation).take_while(|(a, b)| a == b).count()
}
