//! One hook RPC: its deadline and size limits, the check of its reply, and
//! how each way it can fail is classified, counted and logged (by kind and
//! code, never with the hook's own words).

use super::*;

impl HookChain {
    /// One hook RPC within its budget, and the check of its reply by
    /// `accept`. Every way it can go wrong becomes a [`ChainError`], counted
    /// and logged by kind and code: never with the hook's status message.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn call<Req, Resp, T, F, Fut>(
        &self,
        hook: &Hook,
        step: Step<'_>,
        event: HookEvent,
        subject: HookSubject,
        message: Req,
        send: F,
        accept: impl FnOnce(Resp) -> Result<T, String>,
    ) -> Result<T, ChainError>
    where
        Req: prost::Message,
        // The request and its encoded length (measured once, here).
        F: FnOnce(tonic::Request<Req>, usize) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let started = Instant::now();
        let hook_deadline = started + hook.deadline;
        // Whose deadline ends the call: the hook's own, or the query's.
        let cut_by_query = step.scope.deadline < hook_deadline;
        let call_deadline = step.scope.deadline.min(hook_deadline);
        // Counted however the call ends, dropped mid-flight included.
        let record = hook.metrics[event.index()].start(&self.metrics, call_deadline);
        // One span per call at debug (the metrics keep the numbers);
        // `outcome` and `elapsed_ms` are recorded when it ends.
        let span = debug_span!(
            target: crate::telemetry::SPAN_TARGET,
            "hook",
            otel.kind = "client",
            agent = %self.agent,
            hook = %hook.name,
            event = %event,
            subject = %subject,
            budget_ms = tracing::field::Empty,
            request_bytes = tracing::field::Empty,
            outcome = tracing::field::Empty,
            elapsed_ms = tracing::field::Empty,
        );
        let budget = call_deadline.saturating_duration_since(started);
        let bytes = message.encoded_len();
        let mut cause: Option<String> = None;
        let failure = if bytes > self.max_message_bytes {
            HookFailure::RequestTooLarge { bytes, limit: self.max_message_bytes }
        } else if budget.is_zero() {
            HookFailure::Deadline
        } else if hook.peer.none() {
            HookFailure::Unavailable
        } else {
            span.record("budget_ms", budget.as_millis() as u64).record("request_bytes", bytes as u64);
            let probe = Probe::default();
            let mut request = tonic::Request::new(message);
            // The transport sends the time left as grpc-timeout (on a
            // transparent retry too; see `peer`).
            request.extensions_mut().insert(CallDeadline::probed(call_deadline, probe.clone()));
            crate::telemetry::inject(&span, request.metadata_mut());
            match tokio::time::timeout_at(call_deadline, send(request, bytes)).instrument(span.clone()).await {
                Err(_elapsed) => HookFailure::Deadline,
                // Whatever ends the call once its deadline has come (a hook
                // that enforces grpc-timeout may reset the stream at the same
                // instant) ends it by the deadline.
                Ok(Err(_)) if Instant::now() >= call_deadline => HookFailure::Deadline,
                Ok(Err(status)) => {
                    // A transport failure's cause, from error types alone
                    // (a status the hook sent has no source).
                    cause = std::error::Error::source(&status).map(crate::peer::transport_cause);
                    classify(&status, probe.sent(), call_deadline)
                }
                Ok(Ok(reply)) => match accept(reply.into_inner()) {
                    Ok(value) => {
                        let elapsed_ms = started.elapsed().as_millis() as u64;
                        record.finish("ok");
                        span.record("outcome", "ok").record("elapsed_ms", elapsed_ms);
                        debug!(parent: &span, elapsed_ms, "hook answered");
                        return Ok(value);
                    }
                    Err(why) => HookFailure::InvalidReply(why),
                },
            }
        };
        let elapsed_ms = started.elapsed().as_millis() as u64;
        record.finish(failure.kind());
        span.record("outcome", failure.kind()).record("elapsed_ms", elapsed_ms);
        if failure == HookFailure::Deadline && cut_by_query {
            debug!(parent: &span, elapsed_ms, "the query's deadline passed during the hook call");
            return Err(ChainError::QueryDeadline);
        }
        let (agent, name, endpoint) = (&self.agent, &hook.name, &hook.endpoint);
        let cause = cause.unwrap_or_default();
        match &failure {
            HookFailure::RequestTooLarge { bytes, limit } => {
                warn!(parent: &span, %agent, hook = %name, %endpoint, %event, %subject, kind = failure.kind(), bytes, limit, "hook not called: the request is too large");
            }
            HookFailure::Status(code) => {
                warn!(parent: &span, %agent, hook = %name, %endpoint, %event, %subject, kind = failure.kind(), code = code_name(*code), %cause, elapsed_ms, "hook failed");
            }
            _ => {
                warn!(parent: &span, %agent, hook = %name, %endpoint, %event, %subject, kind = failure.kind(), %cause, elapsed_ms, "hook failed")
            }
        }
        Err(self.error(hook, event, subject, failure).into())
    }
}

/// Decides how a failed call failed, from the error's structure and what the
/// hook sent on the wire (`sent`: the `grpc-status` it sent, see
/// [`transport`]), never from the status message:
/// - the hook sent this very non-OK code: `Status(code)` (DEADLINE_EXCEEDED
///   or CANCELLED sent as the call's deadline passes is `Deadline`);
/// - the call raised it from an error below gRPC (it carries a source: an
///   I/O, hyper or h2 error): `Unavailable`;
/// - the reply's reader (`peer::unary`, which reads a reply as tonic's
///   client does) raised it, with no status from the hook: the reply broke
///   the protocol (does not decode, too large, ends early, no message):
///   `InvalidReply`; except UNAVAILABLE, inferred from an HTTP 429 or
///   502/503/504 without a gRPC status (a proxy with no backend).
pub(super) fn classify(status: &tonic::Status, sent: Option<i32>, call_deadline: Instant) -> HookFailure {
    let code = status.code();
    let by_hook = sent == Some(code as i32) && code != Code::Ok && std::error::Error::source(status).is_none();
    if by_hook {
        let at_deadline = crate::peer::at_deadline(call_deadline);
        return match code {
            Code::DeadlineExceeded | Code::Cancelled if at_deadline => HookFailure::Deadline,
            code => HookFailure::Status(code),
        };
    }
    if std::error::Error::source(status).is_some() || code == Code::Unavailable {
        return HookFailure::Unavailable;
    }
    let why = match code {
        Code::OutOfRange | Code::ResourceExhausted => "the reply exceeds the size limit",
        _ => "the reply is not a valid gRPC reply of the contract",
    };
    HookFailure::InvalidReply(why.into())
}
