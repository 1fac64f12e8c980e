//! A minimal plain-HTTP client: load scraping reads each replica's `/metrics` with it,
//! discovery its `/kv_event_sources`, and the native tokenizer's check posts to its `/tokenize`.
//! HTTP/1.0 (a body read to the connection's end), except [`get_http11`] for servers that
//! refuse 1.0 (Envoy's admin answers it 426).

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
    request(url, None, timeout, false).await
}

/// GET `url` as HTTP/1.1 (`Connection: close`, a chunked body decoded) and return the body of
/// a 200 response.
pub async fn get_http11(url: &str, timeout: Duration) -> Result<String, HttpError> {
    request(url, None, timeout, true).await
}

/// POST a JSON `body` to `url` (plain http) and return the body of a 200 response.
pub async fn post_json(url: &str, body: &[u8], timeout: Duration) -> Result<String, HttpError> {
    request(url, Some(body), timeout, false).await
}

/// The length of a response whose head `buf` holds in full and which gives a Content-Length:
/// head, blank line and body; `None` before the head is complete or without that header.
fn message_length(buf: &[u8]) -> Option<usize> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(buf.get(..end)?).ok()?;
    let len = head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case("content-length").then(|| v.trim().parse::<usize>().ok())?
    })?;
    end.checked_add(4)?.checked_add(len)
}

/// A chunked body's data (RFC 9112 7.1); `None` if it is cut short or malformed.
fn dechunk(mut rest: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size_line, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size_line.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
}

async fn request(url: &str, body: Option<&[u8]>, timeout: Duration, http11: bool) -> Result<String, HttpError> {
    let rest = url.strip_prefix("http://").ok_or(HttpError::UnsupportedUrl)?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (rest.get(..i).unwrap_or(rest), rest.get(i..).unwrap_or("/")),
        None => (rest, "/"),
    };
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(hostport).await?;
        let req = match body {
            None if http11 => format!(
                "GET {path} HTTP/1.1\r\nHost: {hostport}\r\nAccept: text/plain\r\nUser-Agent: llmgw-agent\r\nConnection: close\r\n\r\n"
            ),
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
        // Read to the end of the body its Content-Length gives (a server may keep the
        // connection open a while after answering: Envoy waits up to a second for the client to
        // close first), else to the connection's end.
        let mut buf = Vec::new();
        let mut from = s.take(MAX_BODY);
        let mut chunk = vec![0u8; 16 * 1024];
        loop {
            let n = from.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
            if let Some(total) = message_length(&buf) {
                if buf.len() >= total {
                    buf.truncate(total);
                    break;
                }
            }
        }
        Ok::<Vec<u8>, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(timeout, fut).await.map_err(|_| HttpError::TimedOut)??;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").ok_or(HttpError::Malformed)?;
    let status = head.lines().next().unwrap_or("");
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(HttpError::Status(status.to_owned()));
    }
    let chunked = head.lines().skip(1).any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked")
        })
    });
    if chunked {
        return dechunk(body).ok_or(HttpError::Malformed);
    }
    Ok(body.to_owned())
}

#[cfg(test)]
mod tests {
    use super::{dechunk, message_length};

    #[test]
    fn a_response_ends_where_its_content_length_says() {
        assert_eq!(message_length(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel"), Some(43));
        assert_eq!(message_length(b"HTTP/1.1 200 OK\r\ncontent-length:0\r\n\r\n"), Some(37));
        assert_eq!(message_length(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n"), None, "head incomplete");
        assert_eq!(message_length(b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\nbody"), None, "to the end");
        assert_eq!(message_length(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"), None);
        assert_eq!(message_length(b"HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551615\r\n\r\n"), None);
    }

    #[test]
    fn chunked_bodies_are_joined_and_cut_ones_refused() {
        assert_eq!(dechunk("5\r\nhello\r\n7;x=y\r\n, world\r\n0\r\n\r\n").as_deref(), Some("hello, world"));
        assert_eq!(dechunk("0\r\n\r\n").as_deref(), Some(""));
        assert_eq!(dechunk("5\r\nhel"), None);
        assert_eq!(dechunk("zz\r\nhello\r\n0\r\n"), None);
        assert_eq!(dechunk("5\r\nhello"), None);
    }
}
