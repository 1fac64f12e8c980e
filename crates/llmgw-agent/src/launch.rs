//! `llmgw-agent launch -- vllm serve MODEL ...`: runs one vLLM replica under the agent with the
//! flags and environment that match the agent's configuration, restarts it when it exits (its
//! blocks leave the index at once), and forwards SIGTERM/SIGINT to it on shutdown.

use crate::config::Config;
use crate::hub::Hub;
use rustix::process::{kill_process, Pid, Signal};
use std::sync::Arc;
use std::time::Duration;
use tokio::process::{Child, Command};
use tracing::{info, warn};

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Index of the replica in the configuration.
    pub replica: usize,
    /// The command, e.g. `vllm serve MODEL --port 8000`; the matching flags are appended.
    pub command: Vec<String>,
    /// How long to wait for the child after forwarding a signal before killing it.
    pub stop_timeout: Duration,
}

/// Why the replica cannot be launched or supervised.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("no such replica")]
    NoSuchReplica,
    #[error("launch needs a command after --, e.g. -- vllm serve MODEL")]
    NoCommand,
    #[error("empty command")]
    EmptyCommand,
    #[error("cannot start {program}: {source}")]
    Start { program: String, source: std::io::Error },
    #[error("{0}")]
    Wait(std::io::Error),
}

/// Environment variables as (name, value).
pub type Env = Vec<(String, String)>;

/// The full command line and environment for the child.
pub fn command_line(cfg: &Config, spec: &LaunchSpec) -> Result<(Vec<String>, Env), LaunchError> {
    let r = cfg.replicas.get(spec.replica).ok_or(LaunchError::NoSuchReplica)?;
    if spec.command.is_empty() {
        return Err(LaunchError::NoCommand);
    }
    let extra = crate::vllm::for_replica(cfg, r, &crate::vllm::Options::default());
    let mut argv = spec.command.clone();
    argv.extend(extra.args);
    Ok((argv, extra.env))
}

/// Words that make a flag's value secret wherever they are in its name, in any case
/// (`--api-key`, `--hf-token`, `--ssl-keyfile-password`, `--client-secret`): its value never
/// reaches a log. Some harmless values are hidden too (`--max-num-batched-tokens`).
const SECRET_WORDS: [&str; 4] = ["key", "token", "password", "secret"];

fn is_secret_flag(arg: &str) -> bool {
    let name = arg.to_ascii_lowercase();
    name.starts_with('-') && SECRET_WORDS.iter().any(|w| name.contains(w))
}

/// The command line as it may be logged: the value of each secret flag (`--api-key K` or
/// `--api-key=K`) replaced by `<redacted>`. A secret flag followed by another flag (`--...`)
/// takes no value: that flag is shown.
pub fn redacted(argv: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(argv.len());
    let mut hide_next = false;
    for a in argv {
        if std::mem::take(&mut hide_next) && !a.starts_with("--") {
            out.push("<redacted>".to_owned());
            continue;
        }
        match a.split_once('=') {
            Some((flag, _)) if is_secret_flag(flag) => out.push(format!("{flag}=<redacted>")),
            _ => {
                hide_next = is_secret_flag(a);
                out.push(a.clone());
            }
        }
    }
    out
}

fn spawn(argv: &[String], env: &[(String, String)]) -> Result<Child, LaunchError> {
    let (prog, args) = argv.split_first().ok_or(LaunchError::EmptyCommand)?;
    let mut c = Command::new(prog);
    c.args(args).envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str()))).kill_on_drop(true);
    c.spawn().map_err(|source| LaunchError::Start { program: prog.clone(), source })
}

/// Sends `sig` to the child. Its pid cannot have been reused: `Child::id` is `None` once the
/// child has been reaped.
fn signal(child: &Child, sig: Signal) {
    let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()).and_then(Pid::from_raw) else { return };
    if let Err(e) = kill_process(pid, sig) {
        warn!(pid = pid.as_raw_pid(), error = %e, "cannot signal vLLM");
    }
}

/// Runs and restarts the child until `shutdown` fires; then forwards SIGTERM and waits.
pub async fn supervise(
    cfg: Config,
    spec: LaunchSpec,
    hub: Arc<Hub>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<(), LaunchError> {
    let (argv, env) = command_line(&cfg, &spec)?;
    let name = cfg.replicas.get(spec.replica).map(|r| r.name.clone()).unwrap_or_default();
    let engines: Vec<usize> =
        hub.state().engines.iter().enumerate().filter(|(_, e)| e.spec.replica == name).map(|(i, _)| i).collect();
    let mut backoff = Duration::from_secs(1);
    loop {
        // The environment by name only: PYTHONHASHSEED may be a deployment's secret.
        let env_names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        info!(replica = %name, command = ?redacted(&argv), env = ?env_names, "starting vLLM");
        let mut child = spawn(&argv, &env)?;
        let started = tokio::time::Instant::now();
        let exited = tokio::select! {
            status = child.wait() => Some(status),
            _ = shutdown.wait_for(|v| *v) => None,
        };
        let Some(status) = exited else {
            info!(replica = %name, "forwarding SIGTERM to vLLM");
            signal(&child, Signal::TERM);
            match tokio::time::timeout(spec.stop_timeout, child.wait()).await {
                Ok(status) => info!(replica = %name, status = ?status, "vLLM stopped"),
                Err(_) => {
                    warn!(replica = %name, "vLLM did not stop in time; killing it");
                    let _ = child.kill().await;
                }
            }
            return Ok(());
        };
        let status = status.map_err(LaunchError::Wait)?;
        warn!(replica = %name, %status, "vLLM exited; its blocks leave the index and it is restarted");
        {
            let mut st = hub.state();
            for &i in &engines {
                st.reset(i, "engine_exited");
            }
        }
        if started.elapsed() > Duration::from_secs(60) {
            backoff = Duration::from_secs(1);
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait_for(|v| *v) => return Ok(()),
        }
        backoff = backoff.saturating_mul(2).min(Duration::from_secs(30));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_redacted_from_the_logged_command_line() {
        let argv: Vec<String> = ["vllm", "serve", "m", "--api-key", "s3cret", "--port", "8000", "--hf-token=hf_x"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let shown = redacted(&argv).join(" ");
        assert_eq!(shown, "vllm serve m --api-key <redacted> --port 8000 --hf-token=<redacted>");
        assert!(!shown.contains("s3cret") && !shown.contains("hf_x"));
    }

    #[test]
    fn any_flag_naming_a_key_token_password_or_secret_is_redacted() {
        let argv: Vec<String> = [
            "vllm",
            "serve",
            "my-model",
            "--ssl-keyfile-password",
            "pw1",
            "--client-secret=cs2",
            "--OPENAI_API_KEY",
            "ak3",
            "--auth-token=",
            "--port",
            "8000",
            "--skip-tokenizer-init",
            "--host",
            "127.0.0.1",
            "--service-password=a=b",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let shown = redacted(&argv).join(" ");
        assert_eq!(
            shown,
            "vllm serve my-model --ssl-keyfile-password <redacted> --client-secret=<redacted> --OPENAI_API_KEY \
             <redacted> --auth-token=<redacted> --port 8000 --skip-tokenizer-init --host 127.0.0.1 \
             --service-password=<redacted>"
        );
        for secret in ["pw1", "cs2", "ak3", "a=b"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
    }

    #[test]
    fn appends_matching_flags() {
        let cfg = Config::parse(
            "[hash]\nseed = \"0\"\n[[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nmode = \"bind\"\nendpoint = \"tcp://127.0.0.1:5557\"\nreplay_endpoint = \"tcp://127.0.0.1:5558\"\n",
        )
        .unwrap();
        let spec = LaunchSpec {
            replica: 0,
            command: vec!["vllm".into(), "serve".into(), "m".into()],
            stop_timeout: Duration::from_secs(1),
        };
        let (argv, env) = command_line(&cfg, &spec).unwrap();
        assert_eq!(argv[..4], ["vllm", "serve", "m", "--enable-prefix-caching"]);
        assert!(argv.iter().any(|a| a.contains(r#""endpoint":"tcp://127.0.0.1:5557""#)));
        assert!(argv.iter().any(|a| a.contains(r#""replay_endpoint":"tcp://127.0.0.1:5558""#)));
        assert_eq!(env, vec![("PYTHONHASHSEED".to_owned(), "0".to_owned())]);
        let empty = LaunchSpec { command: vec![], ..spec };
        assert!(command_line(&cfg, &empty).is_err());
    }

    #[tokio::test]
    async fn shutdown_signal_reaches_the_child() {
        use std::os::unix::process::ExitStatusExt;
        let mut child = spawn(&["sleep".to_owned(), "30".to_owned()], &[]).unwrap();
        signal(&child, Signal::TERM);
        let status = tokio::time::timeout(Duration::from_secs(5), child.wait()).await.unwrap().unwrap();
        assert_eq!(status.signal(), Some(15), "{status}");
        // Reaped: there is no pid left to signal, and nothing else can be hit.
        signal(&child, Signal::TERM);
    }
}
