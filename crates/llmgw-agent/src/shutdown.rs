//! Stopping: the signals that end the agent and `publish`, and joining their engine threads.

/// The engine threads could not be joined.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct JoinError(#[from] tokio::task::JoinError);

/// Waits, off the runtime's threads, for the engine threads to end.
pub async fn join_threads(threads: Vec<std::thread::JoinHandle<()>>) -> Result<(), JoinError> {
    tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await?;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
