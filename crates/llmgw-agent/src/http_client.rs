//! A minimal plain-HTTP client: load scraping reads each replica's `/metrics` with it,
//! discovery its `/kv_event_sources`, and the native tokenizer's check posts to its `/tokenize`.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest body read.
const MAX_BODY: u64 = 16 << 20;

/// Why a GET failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("only http:// URLs are supported")]
    UnsupportedUrl,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("timed out")]
    TimedOut,
    #[error("malformed HTTP response")]
    Malformed,
    /// The status line of an answer other than 200.
    #[error("HTTP status {0:?}")]
    Status(String),
}

/// GET `url` (plain http) and return the body of a 200 response.
pub async fn get(url: &str, timeout: Duration) -> Result<String, HttpError> {
    request(url, None, timeout).await
}

/// POST a JSON `body` to `url` (plain http) and return the body of a 200 response.
pub async fn post_json(url: &str, body: &[u8], timeout: Duration) -> Result<String, HttpError> {
    request(url, Some(body), timeout).await
}

async fn request(url: &str, body: Option<&[u8]>, timeout: Duration) -> Result<String, HttpError> {
    let rest = url.strip_prefix("http://").ok_or(HttpError::UnsupportedUrl)?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (rest.get(..i).unwrap_or(rest), rest.get(i..).unwrap_or("/")),
        None => (rest, "/"),
    };
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(hostport).await?;
        let req = match body {
            None => format!(
                "GET {path} HTTP/1.0\r\nHost: {hostport}\r\nAccept: text/plain\r\nUser-Agent: llmgw-agent\r\n\r\n"
            ),
            Some(b) => format!(
                "POST {path} HTTP/1.0\r\nHost: {hostport}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nUser-Agent: llmgw-agent\r\n\r\n",
                b.len()
            ),
        };
        s.write_all(req.as_bytes()).await?;
        if let Some(b) = body {
            s.write_all(b).await?;
        }
        let mut buf = Vec::new();
        s.take(MAX_BODY).read_to_end(&mut buf).await?;
        Ok::<Vec<u8>, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(timeout, fut).await.map_err(|_| HttpError::TimedOut)??;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").ok_or(HttpError::Malformed)?;
    let status = head.lines().next().unwrap_or("");
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(HttpError::Status(status.to_owned()));
    }
    Ok(body.to_owned())
}
