//! Setting agents up: their models, hook chains and tools (discovered,
//! in the background when their services are late), and their metrics.

use super::*;
use crate::{busy_poll::BusyPoll, peer::Transport};

/// An agent ready to run.
#[derive(Debug)]
pub struct AgentRuntime {
    /// Its definition.
    pub def: AgentDef,
    /// Its model.
    pub model: Arc<dyn Model>,
    /// Its tools, once their services have answered ListTools (set once;
    /// until then the agent is not ready and its queries are UNAVAILABLE).
    pub(super) tools: std::sync::OnceLock<AgentTools>,
    /// Its hook chain.
    pub hooks: HookChain,
    /// Its metrics, made once (nothing is built per call).
    pub metrics: AgentMetrics,
}

impl AgentRuntime {
    /// Its tools, if discovered yet.
    pub fn tools(&self) -> Option<&AgentTools> {
        self.tools.get()
    }

    /// Sets its tools, once discovered, with a call metric for each.
    pub(super) fn set_tools(&self, tools: AgentTools) {
        let metric = |tool: &str| {
            let labels = vec![("agent", self.def.name.clone()), ("tool", tool.to_owned())];
            self.metrics.registry.call_metric(Family::ToolCalls, None, labels, TOOL_OUTCOMES)
        };
        let calls = tools.specs.iter().map(|s| (s.name.clone(), metric(&s.name))).collect();
        let _ = self.metrics.tool_calls.set(calls);
        let _ = self.tools.set(tools);
    }
}

/// An agent's metrics (see [`Metrics::call_metric`]).
#[derive(Debug)]
pub struct AgentMetrics {
    pub(super) registry: Arc<Metrics>,
    /// Queries by final status code, and their duration.
    pub(super) queries: Arc<CallMetric>,
    /// Model requests by outcome, and their duration.
    pub(super) model: Arc<CallMetric>,
    /// Tool calls by tool and outcome, once the tools are known.
    pub(super) tool_calls: std::sync::OnceLock<HashMap<String, Arc<CallMetric>>>,
    /// Calls of tools the agent doesn't have (the model made them up).
    pub(super) unknown_tool: Arc<CallMetric>,
    /// Model tokens, by direction.
    pub(super) tokens: Arc<CallMetric>,
}

/// The codes a query metric counts itself (any other still counts).
pub(super) const QUERY_CODES: &[&str] = &[
    "OK",
    "CANCELLED",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "UNAVAILABLE",
    "INTERNAL",
];
pub(super) const MODEL_OUTCOMES: &[&str] = &[
    "ok",
    "deadline",
    "cancelled",
    "unavailable",
    "unauthenticated",
    "permission_denied",
    "invalid_request",
    "invalid_response",
];
pub(super) const TOOL_OUTCOMES: &[&str] = &["executed", "failed", "blocked", "cancelled"];

impl AgentMetrics {
    pub(super) fn new(registry: Arc<Metrics>, def: &AgentDef) -> Self {
        let agent = || ("agent", def.name.clone());
        let provider = ("provider", def.model.provider().to_owned());
        let unknown = vec![agent(), ("tool", "(unknown)".to_owned())];
        Self {
            queries: registry.call_metric_as(
                Family::Queries,
                Some(Family::QueryDuration),
                vec![agent()],
                "code",
                QUERY_CODES,
            ),
            model: registry.call_metric(
                Family::ModelRequests,
                Some(Family::ModelRequestDuration),
                vec![agent(), provider],
                MODEL_OUTCOMES,
            ),
            tool_calls: std::sync::OnceLock::new(),
            unknown_tool: registry.call_metric(Family::ToolCalls, None, unknown, TOOL_OUTCOMES),
            tokens: registry.call_metric_as(
                Family::ModelTokens,
                None,
                vec![agent(), ("provider", def.model.provider().to_owned())],
                "direction",
                &["input", "output"],
            ),
            registry,
        }
    }

    /// Records a query that ended with `code` after `took`.
    pub fn query(&self, code: tonic::Code, took: Duration) {
        self.queries.record(&self.registry, crate::grpc::code_name(code), took);
    }

    /// Counts a tool call by outcome; a name the agent doesn't have is
    /// counted as `(unknown)`.
    pub(super) fn tool_call(&self, name: &str, outcome: CallOutcome) {
        let metric = self.tool_calls.get().and_then(|m| m.get(name)).unwrap_or(&self.unknown_tool);
        metric.add(&self.registry, outcome_name(outcome));
    }
}

/// Discovers an agent's tools in the background until its services answer,
/// with backoff (the tool services may start after Lattice, as they do in
/// Kubernetes). Ends when the agent is dropped (the server stopped).
pub(super) async fn discover_later(
    agent: std::sync::Weak<AgentRuntime>,
    settings: ServerSettings,
    transport: Transport,
) {
    let mut wait = Duration::from_millis(250);
    loop {
        let Some(runtime) = agent.upgrade() else { return };
        match AgentTools::build(&runtime.def, &settings, &transport).await {
            Ok(tools) => {
                info!(agent = %runtime.def.name, tools = tools.specs.len(), "agent ready: its tools answered");
                runtime.set_tools(tools);
                return;
            }
            Err(e) => {
                warn!(agent = %runtime.def.name, error = %e, retry_ms = wait.as_millis() as u64, "agent not ready yet")
            }
        }
        drop(runtime);
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(10));
    }
}

/// Why the runtime could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// Tools.
    #[error(transparent)]
    Tools(#[from] ToolSetupError),
    /// A model.
    #[error(transparent)]
    Model(#[from] ModelSetupError),
    /// The trace directory.
    #[error("{0}")]
    Trace(String),
    /// A hook endpoint.
    #[error("agent {agent:?}: hook {hook:?}: {reason}")]
    Hook {
        /// The agent.
        agent: String,
        /// The hook.
        hook: String,
        /// What is wrong with its endpoint.
        reason: String,
    },
}

/// All agents, ready to run queries.
#[derive(Debug)]
pub struct Runtime {
    pub(super) agents: HashMap<String, Arc<AgentRuntime>>,
    pub(super) order: Vec<String>,
    /// Server-wide settings.
    pub settings: ServerSettings,
    pub(super) tracer: Tracer,
    /// The server's metrics.
    pub metrics: Arc<Metrics>,
    /// How every peer's connections behave (the busy poller among them).
    transport: Transport,
    /// The busy poller, while a runtime that shares it lives
    /// (`server.busy_poll_us`).
    busy_poll: Option<Arc<BusyPoll>>,
}

/// Every agent of `config`: models, hook channels (lazy), tools (see
/// [`Runtime::build`]).
async fn build_agents(
    config: &Config,
    transport: &Transport,
    metrics: &Arc<Metrics>,
) -> Result<(HashMap<String, Arc<AgentRuntime>>, Vec<String>), SetupError> {
    let mut agents = HashMap::new();
    let mut order = Vec::new();
    for def in &config.agents {
        let server = &config.server;
        let hooks = HookChain::new(&def.name, &def.hooks, server.hook_max_message_bytes, transport, metrics.clone())
            .map_err(|(hook, reason)| SetupError::Hook { agent: def.name.clone(), hook, reason })?;
        // Start-up waits for the tool services up to
        // tool_discovery_timeout; one that hasn't answered by then no
        // longer stops the server: the agent is discovered later.
        let mut tools = None;
        let discover_later_too = match AgentTools::build(def, &config.server, transport).await {
            Ok(found) => {
                tools = Some(found);
                false
            }
            Err(e @ ToolSetupError::Discovery { .. }) => {
                warn!(agent = %def.name, error = %e, "agent not ready: discovering its tools in the background");
                true
            }
            Err(e) => return Err(e.into()),
        };
        let chain: Vec<String> =
            def.hooks.iter().map(|h| format!("{}{}", h.name, if h.enabled { "" } else { " (disabled)" })).collect();
        info!(agent = %def.name, model = %def.model.label(), hooks = %chain.join(", "), "agent set up");
        let runtime = Arc::new(AgentRuntime {
            def: def.clone(),
            model: model::build(&def.model)?,
            tools: std::sync::OnceLock::new(),
            hooks,
            metrics: AgentMetrics::new(metrics.clone(), def),
        });
        if let Some(tools) = tools {
            runtime.set_tools(tools);
        }
        if discover_later_too {
            tokio::spawn(discover_later(Arc::downgrade(&runtime), config.server.clone(), transport.clone()));
        }
        order.push(def.name.clone());
        agents.insert(def.name.clone(), runtime);
    }
    Ok((agents, order))
}

impl Runtime {
    /// Builds every agent: models, hook channels (lazy), tools. Tools to
    /// discover are waited for up to `tool_discovery_timeout`; an agent
    /// whose services haven't answered by then is set up anyway, not ready
    /// (see [`Runtime::ready`]), and discovered in the background.
    /// Endpoints that can't be used are errors here.
    pub async fn build(config: &Config) -> Result<Self, SetupError> {
        let metrics = Arc::new(Metrics::default());
        let s = &config.server;
        let busy_poll = s.busy_poll.map(|budget| Arc::new(BusyPoll::start(budget)));
        if let Some(b) = &busy_poll {
            metrics.gauge(crate::metrics::Family::BusyPollTurns, Vec::new(), b.poller().turns());
        }
        let transport = Transport {
            health_every: s.peer_health_check,
            gather_writes: s.gather_writes,
            poller: busy_poll.as_ref().map(|b| b.poller()),
        };
        let tracer = match &s.trace_dir {
            Some(dir) => Tracer::start(crate::trace::TraceSettings {
                dir: dir.clone(),
                queue_events: s.trace_queue_events,
                max_file_bytes: s.trace_max_file_bytes,
                max_age: s.trace_max_age,
            })
            .map_err(SetupError::Trace)?,
            None => Tracer::off(),
        };
        if let Some(dropped) = tracer.dropped() {
            metrics.gauge(crate::metrics::Family::TraceEventsDropped, vec![], dropped);
        }
        let (agents, order) = build_agents(config, &transport, &metrics).await?;
        Ok(Self { agents, order, settings: config.server.clone(), tracer, metrics, transport, busy_poll })
    }

    /// A runtime for a reloaded `config`: its agents (models, hook chains,
    /// tools) and its server settings, with this one's metrics, trace
    /// writer, busy poller and connection settings (which need a restart to
    /// change; the caller keeps the running values in `config`). Queries
    /// already running keep the runtime they started with.
    pub async fn reconfigured(&self, config: &Config) -> Result<Self, SetupError> {
        let (agents, order) = build_agents(config, &self.transport, &self.metrics).await?;
        Ok(Self {
            agents,
            order,
            settings: config.server.clone(),
            tracer: self.tracer.clone(),
            metrics: self.metrics.clone(),
            transport: self.transport.clone(),
            busy_poll: self.busy_poll.clone(),
        })
    }

    /// How long the busy poller polls at a time, if the runtime polls.
    pub fn busy_poll_budget(&self) -> Option<Duration> {
        self.busy_poll.as_ref().map(|b| b.budget())
    }

    /// The busy poller, if the runtime polls: what a call on its way to
    /// any peer (the session store's among them) marks itself on.
    pub fn poller(&self) -> Option<Arc<crate::busy_poll::Poller>> {
        self.busy_poll.as_ref().map(|b| b.poller())
    }

    /// How the runtime's peers' connections behave.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Whether every agent is ready: its tools discovered, and each of its
    /// required hooks with a ready address. The error says what is not.
    pub fn ready(&self) -> Result<(), String> {
        for agent in self.agents() {
            if agent.tools().is_none() {
                return Err(format!("agent {:?}: tools not discovered yet", agent.def.name));
            }
            agent.hooks.required_ready()?;
        }
        Ok(())
    }

    /// An agent by name.
    pub fn agent(&self, name: &str) -> Option<&Arc<AgentRuntime>> {
        self.agents.get(name)
    }

    /// The agents in config order.
    pub fn agents(&self) -> impl Iterator<Item = &Arc<AgentRuntime>> {
        self.order.iter().filter_map(|n| self.agents.get(n))
    }

    /// The trace sink.
    pub fn tracer(&self) -> &Tracer {
        &self.tracer
    }
}
