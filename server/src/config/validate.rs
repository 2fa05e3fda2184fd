//! The validator: raw → typed, every problem collected with its line.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::Value;
use toml::{
    Spanned,
    de::{DeTable, DeValue, ValueDeserializer},
};

use super::{
    document::{Walk, remove_key},
    raw::*,
    *,
};
use crate::domain::{JsonObject, StopReason, ToolSpec};

mod agents;
mod server;

/// Whether the model API keys must be in the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Secrets {
    Required,
    Optional,
}

pub(super) fn parse_with(
    text: &str,
    path: &Path,
    secrets: Secrets,
    env: &dyn Fn(&str) -> Option<String>,
    checks: &dyn Checks,
) -> Result<(Config, Vec<Problem>), ConfigError> {
    let fail = |problems| ConfigError { file: path.to_owned(), problems };
    let doc = DeTable::parse(text).map_err(|e| {
        let line = e.span().map(|s| line_of(text, s.start));
        fail(vec![Problem { line, field: "(syntax)".into(), message: e.message().trim().to_owned() }])
    })?;
    let mut walk = Walk::default();
    walk.table(doc.get_ref(), &ROOT, "");
    let dir = path.parent().unwrap_or(Path::new("")).to_owned();
    let unknown = std::mem::take(&mut walk.unknown);
    let mut v = Validator {
        text,
        dir,
        secrets,
        env,
        checks,
        walk,
        problems: Vec::new(),
        warnings: Vec::new(),
        left_out: Vec::new(),
    };
    for u in unknown {
        v.problem(Some(u.span), u.field, u.message);
    }
    let raw = v.raw(doc.into_inner());
    let config = v.config(raw);
    if v.problems.is_empty() {
        Ok((config, v.warnings))
    } else {
        v.problems.sort_by_key(|p| p.line.unwrap_or(0));
        Err(fail(v.problems))
    }
}

/// `principals` with every `group:<name>` replaced by its members
/// (`[server.auth.groups]`); the error is an unknown group's name.
fn expand_groups(
    principals: &[String],
    groups: &std::collections::BTreeMap<String, Vec<String>>,
) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for p in principals {
        let members = match p.strip_prefix("group:") {
            Some(group) => groups.get(group).ok_or_else(|| group.to_owned())?.as_slice(),
            None => std::slice::from_ref(p),
        };
        for m in members {
            if !out.contains(m) {
                out.push(m.clone());
            }
        }
    }
    Ok(out)
}

fn unknown_group(name: &str) -> String {
    format!("no group {name:?} in [server.auth.groups]")
}

/// The key a serde "missing field `key`" message names.
fn missing_field(message: &str) -> Option<&str> {
    message.strip_prefix("missing field `")?.split('`').next()
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset).map_or(1, |t| t.matches('\n').count() + 1)
}

struct Validator<'a> {
    text: &'a str,
    /// The config file's directory: relative paths start here.
    dir: PathBuf,
    /// Whether a missing API key is a problem or a warning.
    secrets: Secrets,
    /// Where secrets are looked up (the process environment, normally).
    env: &'a dyn Fn(&str) -> Option<String>,
    /// The checks that need a layer above the config.
    checks: &'a dyn Checks,
    /// Every value's field path and span.
    walk: Walk,
    problems: Vec<Problem>,
    warnings: Vec<Problem>,
    /// Fields whose values were left out for their type (already reported).
    left_out: Vec<String>,
}

/// Whether `field` is `parent` or a field inside it.
fn within(field: &str, parent: &str) -> bool {
    field.strip_prefix(parent).is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// The raw config, its parts typed one by one so that a wrong value in one
/// agent hides nothing in another.
struct Parts {
    raw: RawConfig,
    /// Whether the file has an `agents` key at all.
    has_agents: bool,
    /// Names of agents that did not deserialize (still valid delegation targets).
    broken: HashSet<String>,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn toml_to_json(v: toml::Value) -> Value {
    match v {
        toml::Value::String(s) => Value::String(s),
        toml::Value::Integer(i) => Value::from(i),
        toml::Value::Float(f) => serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number),
        toml::Value::Boolean(b) => Value::Bool(b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.into_iter().map(toml_to_json).collect()),
        toml::Value::Table(t) => Value::Object(t.into_iter().map(|(k, v)| (k, toml_to_json(v))).collect()),
    }
}

fn table_to_object(t: BTreeMap<String, toml::Value>) -> JsonObject {
    t.into_iter().map(|(k, v)| (k, toml_to_json(v))).collect()
}

impl Validator<'_> {
    /// Types the server table and each agent on its own; each failure is a
    /// problem at the path of the value it names.
    fn raw(&mut self, doc: DeTable<'_>) -> Parts {
        let mut parts = Parts { raw: RawConfig::default(), has_agents: false, broken: HashSet::new() };
        for (key, value) in doc {
            match &**key.get_ref() {
                "server" => {
                    if let Some(server) = self.typed(value, "server") {
                        parts.raw.server = server;
                    }
                }
                "sessions" => {
                    if let Some(sessions) = self.typed(value, "sessions") {
                        parts.raw.sessions = sessions;
                    }
                }
                "telemetry" => {
                    if let Some(telemetry) = self.typed(value, "telemetry") {
                        parts.raw.telemetry = telemetry;
                    }
                }
                "agents" => {
                    parts.has_agents = true;
                    let span = value.span();
                    let DeValue::Array(items) = value.into_inner() else {
                        self.problem(Some(span), "agents", "must be an array of tables: [[agents]]");
                        continue;
                    };
                    for (i, item) in items.into_iter().enumerate() {
                        let name = match item.get_ref() {
                            DeValue::Table(t) => t.iter().find_map(|(k, v)| match (&**k.get_ref(), v.get_ref()) {
                                ("name", DeValue::String(s)) => Some(s.to_string()),
                                _ => None,
                            }),
                            _ => None,
                        };
                        match self.agent_table(item, i) {
                            Some(agent) => parts.raw.agents.push(agent),
                            None => parts.broken.extend(name),
                        }
                    }
                }
                _ => {} // reported by the walk
            }
        }
        parts
    }

    /// Types one agent (see [`Self::typed`]); `None` leaves it out.
    fn agent_table(&mut self, item: Spanned<DeValue<'_>>, i: usize) -> Option<RawAgent> {
        self.typed(item, &format!("agents[{i}]"))
    }

    /// Types one table (`server`, an agent, …) found at `at`. A value of
    /// the wrong type is reported and left out (its default applies), and
    /// typing goes on, so that one typo hides none of the table's other
    /// problems. A table that still doesn't type (a required key missing)
    /// is reported and gives `None`; a required key that is missing only
    /// because its wrong value was left out is not reported twice.
    fn typed<T: serde::de::DeserializeOwned>(&mut self, value: Spanned<DeValue<'_>>, at: &str) -> Option<T> {
        let span = value.span();
        let mut value = value.into_inner();
        // The keys left out so far, relative to `at`.
        let mut removed: Vec<String> = Vec::new();
        // Each round reports one problem and removes one key: a table has
        // far fewer keys than this.
        for _ in 0..64 {
            let attempt = T::deserialize(ValueDeserializer::from(Spanned::new(span.clone(), value.clone())));
            let e = match attempt {
                Ok(typed) => return Some(typed),
                Err(e) => e,
            };
            let error_span = e.span().unwrap_or(span.clone());
            let field = self.walk.path_of(&error_span).unwrap_or(at).to_owned();
            let relative =
                if field == at { Some("") } else { field.strip_prefix(at).and_then(|f| f.strip_prefix('.')) };
            let message = e.message().trim();
            // (The span of a missing key's table may name the array that
            // holds it, `hooks` for `hooks[0]`: any removed key of that name
            // below it counts.)
            let said_already = missing_field(message).is_some_and(|key| {
                let parent = relative.unwrap_or("");
                removed.iter().any(|r| r.starts_with(parent) && (r == key || r.ends_with(&format!(".{key}"))))
            });
            if !said_already {
                self.problem(Some(error_span), field.clone(), message);
            }
            let removed_now = match (&mut value, relative) {
                (DeValue::Table(t), Some(relative)) if !relative.is_empty() => remove_key(t, relative),
                _ => false,
            };
            if !removed_now {
                return None;
            }
            removed.extend(relative.map(str::to_owned));
            self.left_out.push(field);
        }
        None
    }

    /// Records a problem; without a span, the line is the field's own. A
    /// value left out for its type was reported as such: nothing more is
    /// said of it (that it is missing, say).
    fn problem(&mut self, span: Option<std::ops::Range<usize>>, field: impl Into<String>, message: impl Into<String>) {
        let field = field.into();
        if self.left_out.iter().any(|f| within(&field, f)) {
            return;
        }
        let line = span.or_else(|| self.walk.span_of(&field)).map(|s| line_of(self.text, s.start));
        self.problems.push(Problem { line, field, message: message.into() });
    }

    /// An endpoint and its TLS table: files read, certificates and key
    /// parsed. `field` is the entry's path (`agents[0].hooks[1]`).
    fn endpoint(&mut self, e: &Spanned<String>, tls: Option<Spanned<RawTls>>, field: &str) -> Option<Tls> {
        if let Err(why) = self.checks.endpoint(e.get_ref()) {
            self.problem(Some(e.span()), format!("{field}.endpoint"), format!("{:?}: {why}", e.get_ref()));
            return None;
        }
        let (span, raw) = match tls {
            Some(t) => (Some(t.span()), Some(t.into_inner())),
            None => (None, None),
        };
        let self_dir = self.dir.clone();
        let mut read = |file: Option<String>, name: &str| {
            let file = file?;
            let path = self.dir.join(&file);
            match std::fs::read_to_string(&path) {
                Ok(pem) => Some(pem),
                Err(err) => {
                    self.problem(span.clone(), format!("{field}.tls.{name}"), format!("cannot read {file:?}: {err}"));
                    None
                }
            }
        };
        let tls = match raw {
            None => None,
            Some(raw) => {
                let path = |f: &Option<String>| f.as_ref().map(|f| self_dir.join(f));
                let files = TlsFiles { ca: path(&raw.ca_file), cert: path(&raw.cert_file), key: path(&raw.key_file) };
                let ca_pem = read(raw.ca_file, "ca_file");
                let cert = read(raw.cert_file, "cert_file");
                let key = read(raw.key_file, "key_file");
                let identity = match (cert, key) {
                    (Some(cert), Some(key)) => Some((cert, key)),
                    (None, None) => None,
                    _ => {
                        self.problem(
                            span.clone(),
                            format!("{field}.tls"),
                            "set both cert_file and key_file, or neither",
                        );
                        None
                    }
                };
                Some(Tls { ca_pem, identity, server_name: raw.server_name, files: Some(files) })
            }
        };
        if let Err(why) = self.checks.endpoint_tls(e.get_ref(), tls.as_ref()) {
            self.problem(span.or(Some(e.span())), format!("{field}.tls"), why);
        }
        tls
    }

    fn positive<T: PartialOrd + Default + Copy>(&mut self, v: &Option<Spanned<T>>, field: &str, default: T) -> T {
        match v {
            Some(s) if *s.get_ref() <= T::default() => {
                self.problem(Some(s.span()), field, "must be at least 1");
                default
            }
            Some(s) => *s.get_ref(),
            None => default,
        }
    }

    fn config(&mut self, parts: Parts) -> Config {
        let raw = parts.raw;
        let server = self.server(raw.server);
        let sessions = self.sessions(raw.sessions);
        let telemetry = self.telemetry(raw.telemetry);
        if !parts.has_agents {
            self.problem(None, "agents", "no agents are defined: add at least one [[agents]] table");
        }
        let mut seen = HashSet::new();
        for (i, a) in raw.agents.iter().enumerate() {
            if !seen.insert(a.name.get_ref().clone()) {
                self.problem(
                    Some(a.name.span()),
                    format!("agents[{i}].name"),
                    format!("duplicate agent name {:?}", a.name.get_ref()),
                );
            }
        }
        let mut names: HashSet<String> = raw.agents.iter().map(|a| a.name.get_ref().clone()).collect();
        names.extend(parts.broken);
        let mut agents = Vec::new();
        let mut spans = Vec::new();
        for (i, a) in raw.agents.into_iter().enumerate() {
            spans.push(a.name.span());
            agents.push(self.agent(i, a, &names, &server));
        }
        self.cycles(&agents, &spans);
        Config { server, sessions, agents, telemetry }
    }

    /// The value of the environment variable `var` names: a secret, never
    /// printed. Unset: a problem for `serve`, a warning for `check-config`.
    fn secret(&mut self, var: &Spanned<String>, field: &str, what: &str) -> String {
        match (self.env)(var.get_ref()) {
            Some(value) if !value.trim().is_empty() => value.trim().to_owned(),
            _ => {
                let message = format!("environment variable {:?} is not set ({what})", var.get_ref());
                self.missing_secret(var.span(), field, message);
                String::new()
            }
        }
    }

    /// A secret not found: a problem for `serve`; for `check-config`,
    /// which needs the value only to serve, a warning.
    fn missing_secret(&mut self, span: std::ops::Range<usize>, field: &str, message: String) {
        match self.secrets {
            Secrets::Required => self.problem(Some(span), field, message),
            Secrets::Optional => {
                let line = Some(line_of(self.text, span.start));
                let message = format!("{message} (serving needs it)");
                self.warnings.push(Problem { line, field: field.to_owned(), message });
            }
        }
    }

    /// The trimmed text of the file `path` names (a secret: never quoted),
    /// or a problem (a warning for check-config, as for [`Self::secret`]).
    fn secret_file(&mut self, path: &Spanned<String>, field: &str) -> String {
        let message = match std::fs::read_to_string(path.get_ref()) {
            Ok(text) if !text.trim().is_empty() => return text.trim().to_owned(),
            Ok(_) => format!("{} is empty (the PostgreSQL connection string)", path.get_ref()),
            Err(e) => format!("cannot read {} (the PostgreSQL connection string): {}", path.get_ref(), e.kind()),
        };
        self.missing_secret(path.span(), field, message);
        String::new()
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}
