//! The server's layers, checked: its modules import only from their own
//! layer or the ones below, and no two modules import each other, however
//! indirectly (a parent and its own children aside: each top-level module
//! counts as one). A new module must be given a layer here.
//!
//! Read from the source as text: every `crate::…` path outside comments
//! and test code names the module it comes from.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// From the bottom up (see ARCHITECTURE: the data flow's layers).
const LAYERS: &[(&str, &[&str])] = &[
    // Types and settings every layer speaks: the conversation, the config
    // (raw → validated; checks that read files injected), gRPC names,
    // metrics and telemetry's plumbing, following files that change, locks.
    ("core", &["grpc", "domain", "convert", "config", "metrics", "telemetry", "reload", "sync"]),
    // Reaching peers: one HTTP/2 client for hooks and tools, its batching
    // and polling, TLS material.
    ("transport", &["busy_poll", "peer", "tls"]),
    // Running an agent: the loop, the hook chain, tools, models, sessions,
    // traces, the audit record, the events a query streams.
    ("runtime", &["scope", "audit", "events", "hooks", "tools", "model", "session", "trace", "agent"]),
    // The gRPC service: requests in, the one error → status mapping out,
    // who may call, limits, health, dry runs.
    ("service", &["status", "auth", "limits", "health", "dryrun", "service", "reconfig"]),
    // What the binary adds: the CLI's commands and logging.
    ("binary", &["client", "hookcheck", "example_tools", "logging"]),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, modules)| modules.contains(&module))
}

/// The top-level module a file belongs to (`None`: the crate root, or test
/// code).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?.trim_end_matches(".rs").to_owned();
    let test_file = rel.file_stem().is_some_and(|s| s == "tests") || rel.components().any(|c| c.as_os_str() == "tests");
    (!matches!(first.as_str(), "lib" | "main") && !test_file).then_some(first)
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without comments and without its test module (which
/// by the crate's habit comes last).
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines().map(|l| l.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

/// Every module named after `crate::`: `crate::a::…`, and each item of
/// `crate::{a, b::c, …}`.
fn imports(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Items at depth 1, split by commas.
            let (mut depth, mut item_start, mut end) = (1, 0, group.len());
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = i;
                            break;
                        }
                    }
                    ',' if depth == 1 => {
                        found.insert(ident(group[item_start..i].trim()));
                        item_start = i + 1;
                    }
                    _ => {}
                }
            }
            found.insert(ident(group[item_start..end].trim()));
        } else {
            found.insert(ident(rest));
        }
    }
    found.retain(|m| !m.is_empty() && m != "self");
    found
}

#[test]
fn modules_import_only_downward_and_never_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut modules = BTreeSet::new();
    for file in &all {
        let Some(module) = module_of(&src, file) else { continue };
        modules.insert(module.clone());
        let text = std::fs::read_to_string(file).unwrap();
        let to = edges.entry(module.clone()).or_default();
        to.extend(imports(&code(&text)).into_iter().filter(|m| *m != module));
    }
    let mut problems = Vec::new();
    for m in &modules {
        if layer_of(m).is_none() {
            problems.push(format!("module `{m}` has no layer: add it to LAYERS in server/tests/layers.rs"));
        }
    }
    for (from, tos) in &edges {
        for to in tos {
            if !modules.contains(to) {
                continue; // an item of the crate root (`crate::CHECKS`)
            }
            if let (Some(a), Some(b)) = (layer_of(from), layer_of(to))
                && b > a
            {
                problems.push(format!(
                    "`{from}` ({}) imports `{to}` ({}): a layer never names one above it",
                    LAYERS[a].0, LAYERS[b].0
                ));
            }
        }
    }
    // Circles: a module that reaches itself.
    for start in &modules {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    problems.push(format!("an import circle: {} → {start}", path.join(" → ")));
                    stack.clear();
                    break;
                }
                if seen.insert(next.clone()) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    problems.sort();
    problems.dedup();
    assert!(problems.is_empty(), "the server's layers are broken:\n  {}", problems.join("\n  "));
}

/// The parser sees grouped, nested and inline imports, and nothing in
/// comments.
#[test]
fn imports_are_read_from_groups_paths_and_not_comments() {
    let text = "use crate::{\n    agent::AgentError,\n    domain::{Block, Message},\n    grpc,\n};\n\
                // crate::service is only a comment\nfn f() { crate::status::code_name(); }\n";
    let found: Vec<String> = imports(&code(text)).into_iter().collect();
    assert_eq!(found, ["agent", "domain", "grpc", "status"]);
}
