//! The validator's promise: every problem of a file, each once, at its
//! line, and none invented — whatever mix of mistakes the file holds.

use std::path::Path;

use super::{ConfigError, parse_with_env};

/// The problems of `text` as `line: field` (sorted as reported), with
/// every environment variable unset but `KEY`.
fn problems(text: &str) -> Vec<String> {
    let env = |var: &str| (var == "KEY").then(|| "k".to_owned());
    match parse_with_env(text, Path::new("t.toml"), &env, &crate::CHECKS) {
        Ok(_) => Vec::new(),
        Err(ConfigError { problems, .. }) => {
            problems.iter().map(|p| format!("{}: {}", p.line.unwrap_or(0), p.field)).collect()
        }
    }
}

const AGENT: &str = "[[agents]]\nname = \"a\"\n[agents.model]\nprovider = \"scripted\"\n";

/// A wrongly typed key in `[server]` is reported alone: the rest of the
/// table (its `[server.auth]` above all) is still read, so no "missing"
/// problem is made up for a table that is there.
#[test]
fn a_wrong_type_in_server_hides_nothing_and_invents_nothing() {
    let text = format!("[server]\nhook_deadline_ms = \"1s\"\n[server.auth]\nmode = \"none\"\n{AGENT}");
    assert_eq!(problems(&text), ["2: server.hook_deadline_ms"]);
}

/// Several mistakes in `[server]` and its sub-tables: each is listed once,
/// the checks of values (an address, a ceiling, a zero) beside the type
/// errors.
#[test]
fn every_mistake_in_server_is_listed_once() {
    let text = format!(
        "[server]\nlisten = \"nope\"\nhook_deadline_ms = 20000\nmax_message_bytes = \"big\"\nquery_deadline_ms = 0\n\
         drain_ms = -3\n[server.auth]\nmode = 3\nadmins = \"bob\"\n[server.limits]\nqueries_in_flight = \"x\"\n{AGENT}"
    );
    assert_eq!(
        problems(&text),
        [
            "2: server.listen",
            "3: server.hook_deadline_ms",
            "4: server.max_message_bytes",
            "5: server.query_deadline_ms",
            "6: server.drain_ms",
            "8: server.auth.mode",
            "9: server.auth.admins",
            "11: server.limits.queries_in_flight",
        ]
    );
}

/// `[sessions]` and `[telemetry]` are read key by key too.
#[test]
fn every_mistake_in_sessions_and_telemetry_is_listed_once() {
    let text = format!(
        "[server.auth]\nmode = \"none\"\n[sessions]\nstore = \"disk\"\nlease_ttl_ms = \"long\"\npool_size = -1\n\
         [telemetry]\notlp_endpoint = 5\nsampling_ratio = 2.0\n{AGENT}"
    );
    assert_eq!(
        problems(&text),
        [
            "4: sessions.store",
            "5: sessions.lease_ttl_ms",
            "6: sessions.pool_size",
            "8: telemetry.otlp_endpoint",
            "9: telemetry.sampling_ratio",
        ]
    );
}

/// The connection string comes from one place: an environment variable,
/// or a file that can be read (never quoted in the problem).
#[test]
fn the_connection_string_comes_from_one_place() {
    let dir = std::env::temp_dir().join(format!("lattice-config-url-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("url");
    std::fs::write(&file, "postgres://u:hunter2@db/app\n").unwrap();
    let auth = "[server.auth]\nmode = \"none\"\n[sessions]\n";
    let store = |keys: &str| format!("{auth}store = \"postgres\"\n{keys}\n{AGENT}");
    assert_eq!(problems(&store(&format!("url_file = {file:?}"))), Vec::<String>::new());
    assert_eq!(problems(&store(&format!("url_file = {file:?}\nurl_env = \"KEY\""))), ["5: sessions.url_file"]);
    let missing = dir.join("missing");
    assert_eq!(problems(&store(&format!("url_file = {missing:?}"))), ["5: sessions.url_file"]);
    let memory = format!("{auth}url_file = {file:?}\n{AGENT}");
    assert_eq!(problems(&memory), ["4: sessions.url_file"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// In agents: wrong types, bad values and a hook's mistakes, in two agents
/// at once; a required key of the wrong type is said once (not again as
/// missing).
#[test]
fn every_mistake_in_agents_and_hooks_is_listed_once() {
    let text = "[server.auth]\nmode = \"none\"\n\
        [[agents]]\nname = \"a\"\nmax_turns = \"x\"\n[agents.model]\nprovider = \"scripted\"\n\
        [[agents.hooks]]\nname = \"h\"\nendpoint = \"http://127.0.0.1:1\"\nevents = \"tool_result\"\n\
        [[agents]]\nname = \"b b\"\nmax_turns = 0\nparallel_tool_calls = \"two\"\n[agents.model]\nprovider = \"nope\"\n\
        [[agents.hooks]]\nname = \"h\"\nendpoint = \"ftp://x\"\nevents = [\"tool_result\", \"nope\"]\n\
        deadline_ms = 99999\nrequired = \"yes\"\n";
    assert_eq!(
        problems(text),
        [
            "5: agents[0].max_turns",
            "11: agents[0].hooks[0].events",
            "13: agents[1].name",
            "14: agents[1].max_turns",
            "15: agents[1].parallel_tool_calls",
            "17: agents[1].model.provider",
            "20: agents[1].hooks[0].endpoint",
            "21: agents[1].hooks[0].events",
            "22: agents[1].hooks[0].deadline_ms",
            "23: agents[1].hooks[0].required",
        ]
    );
}

/// A file with one mistake in every table lists each, and a file with
/// none is accepted (the fixture itself is sound).
#[test]
fn one_mistake_in_every_table_gives_one_problem_each() {
    let sound = format!(
        "[server]\nlisten = \"127.0.0.1:1\"\n[server.auth]\nmode = \"none\"\n[sessions]\nstore = \"memory\"\n[telemetry]\nsampling_ratio = 0.5\n{AGENT}"
    );
    assert_eq!(problems(&sound), Vec::<String>::new());
    let broken = sound
        .replace("\"127.0.0.1:1\"", "1")
        .replace("\"none\"", "[]")
        .replace("\"memory\"", "true")
        .replace("0.5", "\"half\"")
        .replace("\"scripted\"", "{}");
    assert_eq!(
        problems(&broken),
        [
            "2: server.listen",
            "4: server.auth.mode",
            "6: sessions.store",
            "8: telemetry.sampling_ratio",
            "12: agents[0].model.provider"
        ]
    );
}

/// A hook entry's match conditions and shadow: each mistake once, at its
/// line; a shadow hook is never required.
#[test]
fn match_conditions_and_shadows_are_checked() {
    let hook = |name: &str, events: &str, extra: &str| {
        format!("[[agents.hooks]]\nname = \"{name}\"\nendpoint = \"http://127.0.0.1:1\"\nevents = [{events}]\n{extra}")
    };
    let text = format!(
        "[server.auth]\nmode = \"none\"\n{AGENT}{}{}{}{}{}{}",
        hook("redact", "\"tool_result\"", "tools = [\"queryDatabase\"]\n"),
        hook("a", "\"model_request\"", "tools = [\"x\"]\n"),
        hook("b", "\"tool_result\"", "tools = []\nmin_messages = 4\n"),
        hook("c", "\"tool_result\"", "shadow_of = \"nobody\"\n"),
        hook("d", "\"tool_result\", \"model_request\"", "shadow_of = \"redact\"\n"),
        hook("e", "\"tool_result\"", "shadow_of = \"redact\"\ntools = [\"y\"]\n"),
    );
    assert_eq!(
        problems(&text),
        [
            "16: agents[0].hooks[1].tools",
            "21: agents[0].hooks[2].tools",
            "22: agents[0].hooks[2].min_messages",
            "27: agents[0].hooks[3].shadow_of",
            "31: agents[0].hooks[4].events",
            "37: agents[0].hooks[5].shadow_of",
        ]
    );
    let fine = format!(
        "[server.auth]\nmode = \"none\"\n{AGENT}{}{}",
        hook("redact", "\"tool_result\"", "tools = [\"queryDatabase\"]\n"),
        hook("redact-v2", "\"tool_result\"", "shadow_of = \"redact\"\n")
    );
    let env = |_: &str| None;
    let config = parse_with_env(&fine, Path::new("t.toml"), &env, &crate::CHECKS).unwrap();
    let hooks = &config.agents[0].hooks;
    assert_eq!((hooks[1].shadow_of.as_deref(), hooks[1].required), (Some("redact"), false));
    assert!(hooks[0].matches_tool("queryDatabase") && !hooks[0].matches_tool("other"));
}
