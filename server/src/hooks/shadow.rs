//! Shadow hooks (`shadow_of = "NAME"`): how a team tries a new version of
//! a hook on real traffic before it rewrites anything.
//!
//! A shadow receives exactly the request hook NAME receives, on the same
//! call, in parallel, in a task of its own: the query never waits for it
//! beyond NAME's own call, its output is never applied, and its failure
//! never aborts the query. When both have answered, Lattice compares their
//! outputs by digest (never by value) and records the agreement: `same`,
//! `different`, or `none` when either failed. A shadow call has its own
//! deadline (`deadline_ms`, never past the query's), TLS and readiness, and
//! is never `required`.
//!
//! Its outcome is counted in `lattice_shadow_hook_calls_total{agent, hook,
//! outcome, agreement}` and added to the query's audit record with the
//! digests of both outputs. A shadow still running when the query's audit
//! record is written is in the metric only.

use super::*;

/// A shadow hook, and the hook whose calls it receives too.
#[derive(Debug, Clone)]
pub(super) struct Shadow {
    pub(super) of: String,
    pub(super) hook: Hook,
}

/// What a shadow call ended with: its output's digest, or its failure's
/// kind.
type Answer = Result<String, &'static str>;

/// The shadow's answer and the shadowed hook's output, as each arrives.
type Sides = (Option<Answer>, Option<Option<String>>);

/// Where a shadow call and the hook it shadows meet: whichever answers
/// second records the comparison. So a shadow that answered before the
/// shadowed hook is in the query's audit record for sure, and one that
/// answers later is recorded then, without the query waiting for it.
struct Meeting {
    sides: std::sync::Mutex<Sides>,
    agent: String,
    hook: String,
    of: String,
    event: HookEvent,
    subject: HookSubject,
    metrics: Arc<Metrics>,
    audit: Option<Arc<crate::audit::Audit>>,
}

impl Meeting {
    fn shadow_answered(&self, answer: Answer) {
        self.answered(|sides| sides.0 = Some(answer));
    }

    fn primary_answered(&self, output: Option<String>) {
        self.answered(|sides| sides.1 = Some(output));
    }

    /// Sets one side; the second to answer records the comparison.
    fn answered(&self, set: impl FnOnce(&mut Sides)) {
        let sides = {
            let mut sides = crate::sync::lock(&self.sides);
            set(&mut sides);
            Self::both(&mut sides)
        };
        if let Some((answer, primary)) = sides {
            self.record(answer, primary);
        }
    }

    /// Both sides, once both have answered (taken: recorded once).
    fn both(sides: &mut Sides) -> Option<(Answer, Option<String>)> {
        if sides.0.is_some() && sides.1.is_some() { Some((sides.0.take()?, sides.1.take()?)) } else { None }
    }

    fn record(&self, answer: Answer, primary: Option<String>) {
        let agreement = match (&answer, &primary) {
            (Ok(ours), Some(theirs)) if ours == theirs => "same",
            (Ok(_), Some(_)) => "different",
            _ => "none",
        };
        let outcome = match &answer {
            Ok(_) => "ok",
            Err(kind) => OUTCOMES.iter().find(|o| *o == kind).copied().unwrap_or("unavailable"),
        };
        let labels = vec![
            ("agent", self.agent.clone()),
            ("hook", self.hook.clone()),
            ("outcome", outcome.to_owned()),
            ("agreement", agreement.to_owned()),
        ];
        self.metrics.count(Family::ShadowHookCalls, labels);
        let (agent, hook, of, event, subject) = (&self.agent, &self.hook, &self.of, self.event, &self.subject);
        debug!(%agent, %hook, shadow_of = %of, %event, %subject, outcome, agreement, "shadow hook compared");
        if let Some(audit) = &self.audit {
            audit.record_shadow(crate::audit::ShadowEntry {
                agent: agent.clone(),
                hook: hook.clone(),
                shadow_of: of.clone(),
                event: event.as_str(),
                subject: subject.audit_text(),
                outcome,
                agreement,
                digest_after: answer.ok(),
                digest_shadowed: primary,
            });
        }
    }
}

/// Tells a started shadow's meeting what the hook it shadows passed on:
/// its output's digest, or `None` when it failed (dropped untold, it says
/// the same).
pub(super) struct Primary(Option<Arc<Meeting>>);

impl Primary {
    pub(super) fn tell(mut self, output: Option<String>) {
        if let Some(meeting) = self.0.take() {
            meeting.primary_answered(output);
        }
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        if let Some(meeting) = self.0.take() {
            meeting.primary_answered(None);
        }
    }
}

/// How a query's values are digested for a shadow's comparison: as its
/// audit record digests them, else with SHA-256.
pub(super) fn digest(step: Step<'_>) -> crate::audit::Digest {
    step.scope.audit.as_ref().map(|a| a.digest.clone()).unwrap_or_default()
}

/// The outcomes a shadow call is counted by.
const OUTCOMES: [&str; 5] = ["ok", "deadline", "unavailable", "status", "invalid_reply"];

impl HookChain {
    /// The shadows of `primary` for `event`.
    fn shadows_of<'a>(&'a self, primary: &'a Hook, event: HookEvent) -> impl Iterator<Item = &'a Shadow> + 'a {
        self.shadows.iter().filter(move |s| {
            s.of == primary.name
                && match event {
                    HookEvent::ToolResult => s.hook.events.tool_result,
                    HookEvent::ModelRequest => s.hook.events.model_request,
                }
        })
    }

    /// Starts `primary`'s OnToolResult shadows with `request` (what
    /// `primary` is sent). `input` is the result they are given: a reply
    /// without a replacement passes it on.
    pub(super) fn shadow_tool_results(
        &self,
        primary: &Hook,
        step: Step<'_>,
        request: &wire::ToolResultRequest,
        input: &Arc<ToolResult>,
        tool_use_id: &str,
    ) -> Vec<Primary> {
        let mut told = Vec::new();
        for shadow in self.shadows_of(primary, HookEvent::ToolResult) {
            let digest = digest(step);
            let (input, id) = (input.clone(), tool_use_id.to_owned());
            let output = move |reply: pb::OnToolResultResponse| match reply.result {
                Some(r) if r.tool_use_id != id => Err(()),
                Some(r) => Ok(digest.tool_result(&ToolResult::from(r))),
                None => Ok(digest.tool_result(&input)),
            };
            let hook = shadow.hook.clone();
            let send = move |req, len| crate::peer::unary(hook.peer, wire::ON_TOOL_RESULT, req, len, hook.max_reply);
            let subject = HookSubject::ToolUse(tool_use_id.to_owned());
            told.push(self.start(shadow, step, HookEvent::ToolResult, subject, request.clone(), send, output));
        }
        told
    }

    /// Starts `primary`'s OnModelRequest shadows with `request` (what
    /// `primary` is sent): `system` and `messages` are what they are given.
    pub(super) fn shadow_model_requests(
        &self,
        primary: &Hook,
        step: Step<'_>,
        request: &wire::ModelRequestRequest,
        system: &str,
        messages: &Arc<Vec<apb::Message>>,
    ) -> Vec<Primary> {
        let mut told = Vec::new();
        for shadow in self.shadows_of(primary, HookEvent::ModelRequest) {
            let digest = digest(step);
            let (system, messages) = (system.to_owned(), messages.clone());
            let output = move |reply: pb::OnModelRequestResponse| {
                let (replaced, new_system) = accept_model_request(reply).map_err(drop)?;
                let messages = match replaced {
                    Some(m) => convert::messages_to_pb(&m),
                    None => (*messages).clone(),
                };
                Ok(digest.model_request_pb(new_system.as_deref().unwrap_or(&system), messages))
            };
            let hook = shadow.hook.clone();
            let send = move |req, len| crate::peer::unary(hook.peer, wire::ON_MODEL_REQUEST, req, len, hook.max_reply);
            let subject = HookSubject::Turn(step.turn);
            told.push(self.start(shadow, step, HookEvent::ModelRequest, subject, request.clone(), send, output));
        }
        told
    }

    /// One shadow call in a task of its own; returns what to tell it of
    /// the primary's output.
    #[allow(clippy::too_many_arguments)]
    fn start<Req, Resp, F, Fut>(
        &self,
        shadow: &Shadow,
        step: Step<'_>,
        event: HookEvent,
        subject: HookSubject,
        message: Req,
        send: F,
        output: impl FnOnce(Resp) -> Result<String, ()> + Send + 'static,
    ) -> Primary
    where
        Req: prost::Message + Send + 'static,
        Resp: Send + 'static,
        F: FnOnce(tonic::Request<Req>, usize) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>> + Send + 'static,
    {
        let deadline = step.scope.deadline.min(Instant::now() + shadow.hook.deadline);
        let bytes = message.encoded_len();
        let too_large = bytes > self.max_message_bytes;
        let meeting = Arc::new(Meeting {
            sides: std::sync::Mutex::new((None, None)),
            agent: self.agent.clone(),
            hook: shadow.hook.name.clone(),
            of: shadow.of.clone(),
            event,
            subject,
            metrics: self.metrics.clone(),
            audit: step.scope.audit.clone(),
        });
        let ours = meeting.clone();
        tokio::spawn(async move {
            let answer: Answer = if too_large {
                // Not sent (what the shadowed hook gets fits the same limit,
                // so this is not expected).
                Err("invalid_reply")
            } else {
                let probe = Probe::default();
                let mut request = tonic::Request::new(message);
                request.extensions_mut().insert(CallDeadline::probed(deadline, probe.clone()));
                match tokio::time::timeout_at(deadline, send(request, bytes)).await {
                    Err(_) => Err("deadline"),
                    Ok(Err(_)) if Instant::now() >= deadline => Err("deadline"),
                    Ok(Err(status)) => Err(call::classify(&status, probe.sent(), deadline).kind()),
                    Ok(Ok(reply)) => output(reply.into_inner()).map_err(|()| "invalid_reply"),
                }
            };
            ours.shadow_answered(answer);
        });
        Primary(Some(meeting))
    }
}
