//! `llmgw-agent --version`: the crate's version and the commit it was built from, and the
//! commit's fallbacks (a packager's `LLMGW_GIT_COMMIT`, "unknown" without `.git`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[path = "../build_commit.rs"]
mod build_commit;

use std::path::Path;
use std::process::Command;

fn here() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn version_prints_the_crate_version_and_the_commit_built_from() {
    let out = Command::new(env!("CARGO_BIN_EXE_llmgw-agent")).arg("--version").output().expect("spawn");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let want_commit = build_commit::commit(std::env::var("LLMGW_GIT_COMMIT").ok(), here());
    assert_eq!(text.trim(), format!("llmgw-agent {} (commit {want_commit})", env!("CARGO_PKG_VERSION")));
    if std::env::var("LLMGW_GIT_COMMIT").is_err() {
        // Built from this checkout (this test runs from it): the commit is its HEAD, not "unknown".
        if let Some(head) = build_commit::commit_in(here()) {
            assert_eq!(want_commit, head);
            assert!(head.len() == 12 && head.chars().all(|c| c.is_ascii_hexdigit()), "{head}");
        }
    }
}

#[test]
fn the_commit_is_unknown_outside_a_checkout_and_the_packagers_when_given() {
    // A directory outside any git checkout, as an unpacked tarball is.
    let dir = std::env::temp_dir().join(format!("llmgw-version-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let outside = Command::new("git").arg("-C").arg(&dir).args(["rev-parse", "--git-dir"]).output();
    if outside.map(|o| o.status.success()).unwrap_or(false) {
        eprintln!("the temporary directory is inside a git checkout: the tarball case is not checked here");
    } else {
        assert_eq!(build_commit::commit(None, &dir), "unknown");
        assert_eq!(build_commit::commit(Some("  ".into()), &dir), "unknown");
        assert!(build_commit::watched(&dir).is_empty());
    }
    assert_eq!(build_commit::commit(Some("v0.1.0-tarball".into()), &dir), "v0.1.0-tarball");
    std::fs::remove_dir_all(&dir).unwrap();
}
