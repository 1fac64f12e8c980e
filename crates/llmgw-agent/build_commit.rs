//! The git commit a build is made from, for `llmgw-agent --version`. Shared by the build script
//! (`build.rs`) and its test (`tests/version.rs`), so what the test checks is what the build runs.
//!
//! In order: `LLMGW_GIT_COMMIT` from the environment (a packager building from a tarball sets
//! it), else `git rev-parse` in the crate's directory, else "unknown" (a tarball without `.git`,
//! or no git installed). It names the commit checked out, not uncommitted changes.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs git in `dir`; its trimmed stdout if it succeeded and printed something.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").arg("-C").arg(dir).args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}

/// The commit checked out where `dir` is (12 hex digits); `None` outside a git checkout.
pub fn commit_in(dir: &Path) -> Option<String> {
    git(dir, &["rev-parse", "--short=12", "HEAD"])
}

/// The commit to print: the environment's `LLMGW_GIT_COMMIT` if set and not empty, else
/// [`commit_in`] `dir`, else "unknown".
pub fn commit(env: Option<String>, dir: &Path) -> String {
    match env.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()) {
        Some(c) => c,
        None => commit_in(dir).unwrap_or_else(|| "unknown".to_owned()),
    }
}

/// The files whose change moves HEAD (HEAD itself, the branch it names, packed refs), for
/// `cargo:rerun-if-changed`; only those that exist.
pub fn watched(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let abs = |p: String| {
        let p = PathBuf::from(p);
        if p.is_absolute() {
            p
        } else {
            dir.join(p)
        }
    };
    if let Some(git_dir) = git(dir, &["rev-parse", "--git-dir"]).map(abs) {
        out.push(git_dir.join("HEAD"));
    }
    if let Some(common) = git(dir, &["rev-parse", "--git-common-dir"]).map(abs) {
        out.push(common.join("packed-refs"));
        if let Some(branch) = git(dir, &["symbolic-ref", "-q", "HEAD"]) {
            out.push(common.join(branch));
        }
    }
    out.retain(|p| p.exists());
    out
}
