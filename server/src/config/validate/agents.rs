//! The validator's agents: their models, tools, delegates and hooks, and
//! the delegation graph.

use super::*;

impl Validator<'_> {
    pub(super) fn agent(
        &mut self,
        i: usize,
        a: RawAgent,
        agents: &HashSet<String>,
        server: &ServerSettings,
    ) -> AgentDef {
        let at = |f: &str| format!("agents[{i}].{f}");
        let name = a.name.get_ref().clone();
        if !valid_name(&name) {
            self.problem(Some(a.name.span()), at("name"), "must be 1-64 letters, digits, '_' or '-'");
        }
        let model_span = a.model.span();
        let model = self.model(i, a.model.into_inner(), model_span);
        let max_turns = self.positive(&a.max_turns, &at("max_turns"), defaults::MAX_TURNS);
        let parallel_tool_calls =
            self.positive(&a.parallel_tool_calls, &at("parallel_tool_calls"), defaults::PARALLEL_TOOL_CALLS);
        let max_tool_calls_per_turn = self.positive(
            &a.max_tool_calls_per_turn,
            &at("max_tool_calls_per_turn"),
            defaults::MAX_TOOL_CALLS_PER_TURN,
        );

        let mut tool_names: HashSet<String> = HashSet::new();
        let mut tool_sources = Vec::new();
        for (j, t) in a.tools.into_iter().enumerate() {
            let f = at(&format!("tools[{j}]"));
            let tls = self.endpoint(&t.endpoint, t.tls, &f);
            if t.deadline_ms == Some(0) {
                self.problem(Some(t.endpoint.span()), format!("{f}.deadline_ms"), "must be at least 1");
            }
            let declared = t.declare.map(|decls| {
                decls
                    .into_iter()
                    .map(|d| {
                        if !valid_name(&d.name) {
                            self.problem(
                                Some(t.endpoint.span()),
                                format!("{f}.declare.name"),
                                format!("{:?}: must be 1-64 letters, digits, '_' or '-'", d.name),
                            );
                        }
                        if !tool_names.insert(d.name.clone()) {
                            self.problem(
                                Some(t.endpoint.span()),
                                format!("{f}.declare.name"),
                                format!("duplicate tool name {:?}", d.name),
                            );
                        }
                        let mut schema = table_to_object(d.input_schema);
                        schema.entry("type").or_insert_with(|| Value::from("object"));
                        ToolSpec { name: d.name, description: d.description, input_schema: schema }
                    })
                    .collect()
            });
            tool_sources.push(ToolSourceDef {
                endpoint: t.endpoint.into_inner(),
                tls,
                deadline: ms(t.deadline_ms.unwrap_or(defaults::TOOL_DEADLINE_MS).max(1)),
                only: t.only,
                declared,
            });
        }

        let mut delegates = Vec::new();
        for (j, d) in a.delegates.into_iter().enumerate() {
            let f = at(&format!("delegates[{j}].agent"));
            let target = d.agent.get_ref();
            if target == &name {
                self.problem(Some(d.agent.span()), &f, "an agent cannot delegate to itself");
            } else if !agents.contains(target) {
                self.problem(Some(d.agent.span()), &f, format!("no agent named {target:?}"));
            }
            let tool_name = d.tool_name.unwrap_or_else(|| target.clone());
            if !valid_name(&tool_name) || !tool_names.insert(tool_name.clone()) {
                self.problem(Some(d.agent.span()), &f, format!("tool name {tool_name:?} is invalid or already used"));
            }
            delegates.push(DelegateDef {
                agent: d.agent.into_inner(),
                tool_name,
                description: d.description,
                deadline: ms(d.deadline_ms.unwrap_or(defaults::QUERY_DEADLINE_MS).max(1)),
            });
        }

        let mut hook_names = HashSet::new();
        let mut hooks = Vec::new();
        let mut shadows = Vec::new();
        for (j, h) in a.hooks.into_iter().enumerate() {
            let f = |x: &str| at(&format!("hooks[{j}].{x}"));
            if !valid_name(h.name.get_ref()) {
                self.problem(Some(h.name.span()), f("name"), "must be 1-64 letters, digits, '_' or '-'");
            }
            if !hook_names.insert(h.name.get_ref().clone()) {
                self.problem(Some(h.name.span()), f("name"), format!("duplicate hook name {:?}", h.name.get_ref()));
            }
            let tls = self.endpoint(&h.endpoint, h.tls, &at(&format!("hooks[{j}]")));
            let mut events = HookEvents::default();
            for e in h.events.get_ref() {
                let seen = match e.as_str() {
                    "tool_result" => Some(std::mem::replace(&mut events.tool_result, true)),
                    "model_request" => Some(std::mem::replace(&mut events.model_request, true)),
                    _ => None,
                };
                match (e.as_str(), seen) {
                    (_, Some(true)) => {
                        self.problem(Some(h.events.span()), f("events"), format!("event {e:?} is listed twice"))
                    }
                    (_, Some(false)) => {}
                    (other, None) => self.problem(
                        Some(h.events.span()),
                        f("events"),
                        format!("unknown event {other:?} (expected \"tool_result\" or \"model_request\")"),
                    ),
                }
            }
            if h.events.get_ref().is_empty() {
                self.problem(Some(h.events.span()), f("events"), "name at least one event");
            }
            let deadline = match &h.deadline_ms {
                Some(d) if *d.get_ref() == 0 => {
                    self.problem(Some(d.span()), f("deadline_ms"), "must be at least 1");
                    server.hook_default_deadline
                }
                Some(d) if ms(*d.get_ref()) > server.hook_deadline_ceiling => {
                    let ceiling = server.hook_deadline_ceiling.as_millis();
                    let message = format!(
                        "{} ms is above the ceiling of {ceiling} ms (server.hook_deadline_ceiling_ms)",
                        d.get_ref()
                    );
                    self.problem(Some(d.span()), f("deadline_ms"), message);
                    server.hook_deadline_ceiling
                }
                Some(d) => ms(*d.get_ref()),
                None => server.hook_default_deadline,
            };
            let tools = h.tools.map(|t| {
                let span = t.span();
                if t.get_ref().is_empty() {
                    self.problem(Some(span.clone()), f("tools"), "name at least one tool, or leave tools out");
                } else if !events.tool_result {
                    let message = "tools limits OnToolResult calls: this hook's events have no \"tool_result\"";
                    self.problem(Some(span.clone()), f("tools"), message);
                }
                for tool in t.get_ref().iter().filter(|t| !valid_name(t)) {
                    self.problem(Some(span.clone()), f("tools"), format!("{tool:?} is not a tool name"));
                }
                t.into_inner()
            });
            let min_messages = match h.min_messages {
                Some(m) if !events.model_request => {
                    let message =
                        "min_messages limits OnModelRequest calls: this hook's events have no \"model_request\"";
                    self.problem(Some(m.span()), f("min_messages"), message);
                    0
                }
                Some(m) => usize::try_from(*m.get_ref()).unwrap_or(usize::MAX),
                None => 0,
            };
            let shadow_of = h.shadow_of.map(|s| (s.span(), s.into_inner()));
            shadows.push((j, shadow_of.clone(), h.events.span()));
            hooks.push(HookDef {
                name: h.name.into_inner(),
                endpoint: h.endpoint.into_inner(),
                tls,
                events,
                deadline,
                enabled: h.enabled,
                // A shadow hook never aborts a query, so never holds the
                // replica out of rotation either.
                required: h.required && shadow_of.is_none(),
                conditions: MatchConditions { tools, min_messages },
                shadow_of: shadow_of.map(|(_, name)| name),
            });
        }
        // A shadow hook receives what the hook it names receives: that hook
        // must be an enabled, ordinary hook of this agent handling every
        // event the shadow lists, and the shadow takes its conditions.
        for (j, shadow_of, events_span) in shadows {
            let Some((span, primary)) = shadow_of else { continue };
            let f = at(&format!("hooks[{j}].shadow_of"));
            let shadow = &hooks[j];
            let Some(target) = hooks.iter().find(|h| h.name == primary) else {
                self.problem(Some(span), &f, format!("no hook named {primary:?} in this agent"));
                continue;
            };
            if target.name == shadow.name {
                self.problem(Some(span), &f, "a hook cannot shadow itself");
            } else if target.shadow_of.is_some() {
                self.problem(Some(span), &f, format!("{primary:?} is itself a shadow hook"));
            } else if !target.enabled && shadow.enabled {
                self.problem(Some(span), &f, format!("{primary:?} is disabled"));
            } else if (shadow.events.tool_result && !target.events.tool_result)
                || (shadow.events.model_request && !target.events.model_request)
            {
                let message = format!("a shadow hook's events must be among {primary:?}'s");
                self.problem(Some(events_span), at(&format!("hooks[{j}].events")), message);
            } else if shadow.conditions != MatchConditions::default() {
                let message =
                    format!("a shadow hook takes its conditions from {primary:?}: leave tools and min_messages out");
                self.problem(Some(span), &f, message);
            }
        }

        AgentDef {
            name,
            description: a.description,
            system_prompt: a.system_prompt.into(),
            model,
            max_turns,
            parallel_tool_calls,
            max_tool_calls_per_turn,
            permissions: Permissions { allow: a.allow, deny: a.deny },
            tool_sources,
            delegates,
            hooks,
            principals: a.principals.map(|p| {
                expand_groups(&p, &server.auth.groups).unwrap_or_else(|unknown| {
                    self.problem(None, at("principals"), unknown_group(&unknown));
                    Vec::new()
                })
            }),
        }
    }

    pub(super) fn model(&mut self, i: usize, m: RawModel, span: std::ops::Range<usize>) -> ModelConfig {
        let at = |f: &str| format!("agents[{i}].model.{f}");
        let provider = match m.provider.get_ref().as_str() {
            "scripted" => None,
            "anthropic" => Some(Provider::Anthropic),
            "openai" => Some(Provider::OpenAi),
            other => {
                self.problem(
                    Some(m.provider.span()),
                    at("provider"),
                    format!("unknown provider {other:?} (known: \"scripted\", \"anthropic\", \"openai\")"),
                );
                None
            }
        };
        if let Some(provider) = provider {
            return ModelConfig::Http(self.http_model(i, provider, m, span));
        }
        let mut script = Vec::new();
        for (j, t) in m.script.into_iter().enumerate() {
            let stop_reason = match t.stop_reason.as_deref() {
                None => None,
                Some("end_turn") => Some(StopReason::EndTurn),
                Some("tool_use") => Some(StopReason::ToolUse),
                Some("max_tokens") => Some(StopReason::MaxTokens),
                Some("stop_sequence") => Some(StopReason::StopSequence),
                Some(other) => {
                    self.problem(
                        Some(span.clone()),
                        at(&format!("script[{j}].stop_reason")),
                        format!("unknown stop reason {other:?}"),
                    );
                    None
                }
            };
            script.push(ScriptTurn {
                text: t.text,
                tool_calls: t.tool_calls.into_iter().map(|c| (c.name, table_to_object(c.input))).collect(),
                delay: ms(t.delay_ms),
                stop_reason,
            });
        }
        ModelConfig::Scripted { name: if m.name.is_empty() { "default".into() } else { m.name }, script }
    }

    pub(super) fn http_model(
        &mut self,
        i: usize,
        provider: Provider,
        m: RawModel,
        span: std::ops::Range<usize>,
    ) -> HttpModelConfig {
        let at = |f: &str| format!("agents[{i}].model.{f}");
        if m.name.is_empty() {
            self.problem(Some(span.clone()), at("name"), "name the model (e.g. \"claude-sonnet-4-5\" or \"gpt-4o\")");
        }
        if !m.script.is_empty() {
            self.problem(Some(span.clone()), at("script"), "a script is for the scripted provider only");
        }
        let default_base = match provider {
            Provider::Anthropic => "https://api.anthropic.com",
            Provider::OpenAi => "https://api.openai.com",
        };
        let base_url = match &m.base_url {
            Some(b) => {
                let ok = reqwest::Url::parse(b.get_ref())
                    .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
                if !ok {
                    self.problem(
                        Some(b.span()),
                        at("base_url"),
                        format!("{:?} is not an http:// or https:// URL", b.get_ref()),
                    );
                }
                b.get_ref().trim_end_matches('/').to_owned()
            }
            None => default_base.to_owned(),
        };
        let (api_key_env, api_key) = match &m.api_key_env {
            None => {
                self.problem(
                    Some(span.clone()),
                    at("api_key_env"),
                    "name the environment variable that holds the API key",
                );
                (String::new(), String::new())
            }
            Some(var) => (var.get_ref().clone(), self.secret(var, &at("api_key_env"), "the API key")),
        };
        if m.max_tokens == Some(0) || m.deadline_ms == Some(0) {
            self.problem(Some(span.clone()), at("max_tokens / deadline_ms"), "must be at least 1");
        }
        if m.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
            self.problem(Some(span), at("temperature"), "must be between 0 and 2");
        }
        HttpModelConfig {
            provider,
            model: m.name,
            base_url,
            api_key_env,
            api_key,
            max_tokens: m.max_tokens.unwrap_or(defaults::MODEL_MAX_TOKENS).max(1),
            temperature: m.temperature,
            deadline: ms(m.deadline_ms.unwrap_or(defaults::MODEL_DEADLINE_MS).max(1)),
            retries: m.retries.unwrap_or(defaults::MODEL_RETRIES),
            stream: m.stream.unwrap_or(true),
        }
    }

    /// Delegation must form no cycle: a cycle would recurse until the depth
    /// limit on every query, so it is refused here.
    pub(super) fn cycles(&mut self, agents: &[AgentDef], spans: &[std::ops::Range<usize>]) {
        let edges: HashMap<&str, Vec<&str>> =
            agents.iter().map(|a| (a.name.as_str(), a.delegates.iter().map(|d| d.agent.as_str()).collect())).collect();
        for (i, a) in agents.iter().enumerate() {
            // Depth-first search from each agent for a path back to itself.
            let mut stack: Vec<Vec<&str>> = vec![vec![a.name.as_str()]];
            let mut visited = HashSet::new();
            while let Some(path) = stack.pop() {
                let Some(&last) = path.last() else { continue };
                for next in edges.get(last).into_iter().flatten() {
                    if *next == a.name && path.len() > 1 {
                        let cycle = path.join(" -> ") + " -> " + next;
                        self.problem(
                            Some(spans[i].clone()),
                            format!("agents[{i}].delegates"),
                            format!("delegation cycle: {cycle}"),
                        );
                        return;
                    }
                    if visited.insert(*next) {
                        let mut p = path.clone();
                        p.push(next);
                        stack.push(p);
                    }
                }
            }
        }
    }
}
