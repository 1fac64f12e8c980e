//! The agent's top-level modules import one another without a circle: a module the hub imports
//! (counters, configuration) never imports the hub, and an event source imports the ingest seam,
//! never the other way round. Read from the `crate::` paths of the shipped code (tests left out).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The code above a file's test module, without comments.
fn shipped(text: &str) -> String {
    let end = text.find("#[cfg(test)]").unwrap_or(text.len());
    text.get(..end).unwrap_or(text).lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    s.get(..end).unwrap_or("")
}

/// The top-level modules named after `crate::` (`crate::a::X`, `crate::{a::X, b}`).
fn named_modules(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = code.get(at.saturating_add("crate::".len())..).unwrap_or("");
        if let Some(group) = rest.strip_prefix('{') {
            let group = group.get(..group.find('}').unwrap_or(group.len())).unwrap_or("");
            out.extend(group.split(',').map(|item| ident(item.trim()).to_owned()));
        } else {
            out.insert(ident(rest).to_owned());
        }
    }
    out.remove("");
    out
}

/// A circle in `edges`, if any (as the modules along it).
fn circle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut c = path.split_off(i);
            c.push(m.to_owned());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges.keys().find_map(|m| visit(m, edges, &mut Vec::new(), &mut done))
}

#[test]
fn the_agents_modules_import_one_another_without_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let module_of = |p: &Path| {
        let rel = p.strip_prefix(&src).ok()?;
        let first = rel.components().next()?.as_os_str().to_str()?;
        Some(first.trim_end_matches(".rs").to_owned())
    };
    let modules: BTreeSet<String> = files.iter().filter_map(|p| module_of(p)).collect();
    assert!(modules.contains("hub") && modules.contains("ingest"), "modules read: {modules:?}");
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(m) = module_of(f) else { continue };
        // The crate root and the binary's files name every module; a test module's own file
        // (`tests.rs`, `*_tests.rs`) is test code.
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if matches!(m.as_str(), "lib" | "main" | "tools") || name == "tests.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        let code = shipped(&std::fs::read_to_string(f).unwrap_or_default());
        let named: Vec<String> = named_modules(&code).into_iter().filter(|n| *n != m && modules.contains(n)).collect();
        edges.entry(m).or_default().extend(named);
    }
    assert!(edges.get("hub").is_some_and(|e| e.contains("counters")), "edges read: {edges:?}");
    assert_eq!(circle(&edges), None, "an import circle between the agent's modules; edges: {edges:?}");
}

#[test]
fn a_circle_is_found() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
        ("b".to_owned(), BTreeSet::from(["c".to_owned()])),
        ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
    ]
    .into();
    assert_eq!(circle(&edges), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    assert_eq!(named_modules("use crate::{hub::Hub, seq};\nlet x = crate::config::subject(a);"), {
        BTreeSet::from(["hub".to_owned(), "seq".to_owned(), "config".to_owned()])
    });
}
