//! The agent's plain-HTTP client: load scraping reads each replica's `/metrics` with it,
//! discovery its `/kv_event_sources`, the doctor its probes, and the picker and the native
//! tokenizer's check post to `/tokenize`. One HTTP/1.1 request per connection over hyper
//! (`Connection: close`), so a server or sidecar proxy that refuses HTTP/1.0 (Envoy does by
//! default, Istio's sidecars with it) answers, and the answer ends where its framing says —
//! not when a server that lingers before closing finally does. Bodies are bounded.

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::header::{ACCEPT, CONNECTION, CONTENT_TYPE, HOST, USER_AGENT};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use std::time::Duration;

/// Largest body read.
const MAX_BODY: usize = 16 << 20;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("only http:// URLs are supported")]
    UnsupportedUrl,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("timed out")]
    TimedOut,
    /// An answer that is not HTTP, cut short, or over the body limit.
    #[error("malformed HTTP response: {0}")]
    Malformed(String),
    /// The status line of an answer other than 200 (`HTTP/1.1 404 Not Found`).
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
    let uri: hyper::Uri = url.parse().map_err(|_| HttpError::UnsupportedUrl)?;
    if uri.scheme_str() != Some("http") {
        return Err(HttpError::UnsupportedUrl);
    }
    let authority = uri.authority().ok_or(HttpError::UnsupportedUrl)?.as_str().to_owned();
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let mut req = Request::builder()
        .uri(path)
        .header(HOST, authority.as_str())
        .header(USER_AGENT, "llmgw-agent")
        .header(CONNECTION, "close");
    req = match body {
        Some(_) => req.method(Method::POST).header(CONTENT_TYPE, "application/json"),
        None => req.method(Method::GET).header(ACCEPT, "text/plain"),
    };
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body.unwrap_or_default())))
        .map_err(|e| HttpError::Malformed(e.to_string()))?;
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(authority.as_str()).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(malformed)?;
        // The connection is driven beside the exchange and dropped with it.
        let answer = async {
            let resp = sender.send_request(req).await.map_err(malformed)?;
            let (head, body) = resp.into_parts();
            if head.status != hyper::StatusCode::OK {
                return Err(HttpError::Status(format!("{:?} {}", head.version, head.status)));
            }
            let bytes =
                Limited::new(body, MAX_BODY).collect().await.map_err(|e| HttpError::Malformed(e.to_string()))?;
            Ok(String::from_utf8_lossy(&bytes.to_bytes()).into_owned())
        };
        tokio::pin!(conn, answer);
        tokio::select! {
            biased;
            got = &mut answer => got,
            // The connection ends once the answer is in (`Connection: close`) or on an error,
            // which the answer then reports; what it read is still to be collected.
            _ = &mut conn => answer.await,
        }
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| HttpError::TimedOut)?
}

fn malformed(e: hyper::Error) -> HttpError {
    match std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>()) {
        Some(io) => HttpError::Io(std::io::Error::new(io.kind(), e.to_string())),
        None => HttpError::Malformed(e.to_string()),
    }
}

/// A loopback HTTP server for tests, the agent's replicas and tokenizers in small.
#[cfg(test)]
pub(crate) mod test_server {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The request heads a server read, in order.
    pub(crate) type Heads = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

    /// A server answering every connection with `answer(head)` once it has read the request
    /// head (and a body of Content-Length), then holding the connection open for `linger`.
    /// Its URL (`http://addr`), and the heads it read.
    pub(crate) async fn serve(
        answer: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static,
        linger: std::time::Duration,
    ) -> (String, Heads) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let heads = Heads::default();
        let seen = heads.clone();
        let answer = std::sync::Arc::new(answer);
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else { return };
                let (seen, answer) = (seen.clone(), answer.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let head = loop {
                        let n = s.read(&mut chunk).await.unwrap_or(0);
                        buf.extend_from_slice(&chunk[..n]);
                        let text = String::from_utf8_lossy(&buf).to_string();
                        if let Some((head, body)) = text.split_once("\r\n\r\n") {
                            let len = head
                                .lines()
                                .find_map(|l| {
                                    l.to_ascii_lowercase()
                                        .strip_prefix("content-length:")
                                        .map(|v| v.trim().parse().unwrap())
                                })
                                .unwrap_or(0);
                            if body.len() >= len || n == 0 {
                                break head.to_owned();
                            }
                        } else if n == 0 {
                            return;
                        }
                    };
                    let reply = answer(&head);
                    seen.lock().unwrap().push(head);
                    let _ = s.write_all(&reply).await;
                    tokio::time::sleep(linger).await;
                });
            }
        });
        (format!("http://{addr}"), heads)
    }
}

#[cfg(test)]
mod tests {
    use super::test_server::{serve, Heads};
    use super::{get, post_json, HttpError};
    use std::time::Duration;

    /// A server answering every connection with `answer`, but an HTTP/1.0 request with 426
    /// (as Envoy does unless told to accept it).
    async fn server(answer: &'static [u8], linger: Duration) -> (String, Heads) {
        let answer = move |head: &str| -> Vec<u8> {
            if head.lines().next().is_some_and(|l| l.ends_with("HTTP/1.0")) {
                b"HTTP/1.1 426 Upgrade Required\r\ncontent-length: 0\r\n\r\n".to_vec()
            } else {
                answer.to_vec()
            }
        };
        serve(answer, linger).await
    }

    #[tokio::test]
    async fn a_server_refusing_http_1_0_is_answered_and_a_lingering_one_is_not_waited_for() {
        let (url, _) = server(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", Duration::from_secs(30)).await;
        // Read to the end of what the answer frames: the server holds the connection 30 s.
        let got = get(&format!("{url}/metrics"), Duration::from_secs(10)).await;
        assert_eq!(got.unwrap(), "hello");
        let got = post_json(&format!("{url}/tokenize"), br#"{"prompt":"x"}"#, Duration::from_secs(10)).await;
        assert_eq!(got.unwrap(), "hello");
    }

    #[tokio::test]
    async fn chunked_bodies_are_joined_and_statuses_other_than_200_say_their_line() {
        let (url, _) = server(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(get(&url, Duration::from_secs(10)).await.unwrap(), "hello world");
        let (url, heads) =
            server(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n", Duration::ZERO).await;
        match get(&url, Duration::from_secs(10)).await {
            Err(HttpError::Status(line)) => assert_eq!(line, "HTTP/1.1 503 Service Unavailable"),
            other => panic!("{other:?}"),
        }
        let head = heads.lock().unwrap().pop().unwrap();
        assert!(head.starts_with("GET / HTTP/1.1\r\n"), "{head}");
        assert!(head.to_ascii_lowercase().contains("host: 127.0.0.1:"), "{head}");
    }

    #[tokio::test]
    async fn a_cut_answer_a_silent_server_and_a_bad_url_fail_plainly() {
        let (url, _) = server(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\nshort", Duration::ZERO).await;
        assert!(matches!(get(&url, Duration::from_secs(10)).await, Err(HttpError::Malformed(_))));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        assert!(matches!(get(&url, Duration::from_millis(200)).await, Err(HttpError::TimedOut)));
        assert!(matches!(get("https://example.test/", Duration::from_secs(1)).await, Err(HttpError::UnsupportedUrl)));
    }
}
