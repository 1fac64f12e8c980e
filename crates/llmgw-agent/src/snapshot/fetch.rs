//! The agent's side: one blocking `GET` of a sidecar's snapshot, from an engine's thread (its
//! live batches wait in the subscription meanwhile, as the join needs).

use super::{Snapshot, INCOMPLETE_HEADER, SEQ_HEADER};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

pub use crate::config::MAX_SNAPSHOT_BYTES;

/// Why no snapshot came (the reason is a metric label).
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("only http://host:port URLs are supported")]
    Url,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("timed out")]
    TimedOut,
    #[error("answer larger than {MAX_SNAPSHOT_BYTES} bytes")]
    TooLarge,
    #[error("malformed answer")]
    Malformed,
    #[error("HTTP status {0}")]
    Status(String),
}

impl FetchError {
    /// A metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            FetchError::Url => "url",
            FetchError::Io(_) => "io",
            FetchError::TimedOut => "timeout",
            FetchError::TooLarge => "too_large",
            FetchError::Malformed => "malformed",
            FetchError::Status(_) => "status",
        }
    }
}

/// The URL of one rank's snapshot at a sidecar's base URL.
pub fn rank_url(base: &str, dp_rank: u32) -> String {
    format!("{}/snapshot?dp_rank={dp_rank}", base.trim_end_matches('/'))
}

/// GETs a snapshot, the whole exchange within `timeout`.
pub fn fetch(url: &str, timeout: Duration) -> Result<Snapshot, FetchError> {
    let rest = url.strip_prefix("http://").ok_or(FetchError::Url)?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (rest.get(..i).unwrap_or(rest), rest.get(i..).unwrap_or("/")),
        None => (rest, "/"),
    };
    let deadline = Instant::now().checked_add(timeout).ok_or(FetchError::TimedOut)?;
    let addr = hostport.to_socket_addrs()?.next().ok_or(FetchError::Url)?;
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    let left = || deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()).ok_or(FetchError::TimedOut);
    s.set_write_timeout(Some(left()?))?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {hostport}\r\nUser-Agent: llmgw-agent\r\n\r\n").as_bytes())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 64 << 10];
    loop {
        s.set_read_timeout(Some(left()?))?;
        let n = match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(FetchError::TimedOut)
            }
            Err(e) => return Err(e.into()),
        };
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        if u64::try_from(buf.len()).unwrap_or(u64::MAX) > MAX_SNAPSHOT_BYTES.saturating_add(64 << 10) {
            return Err(FetchError::TooLarge);
        }
    }
    parse(&buf)
}

/// An HTTP/1.x answer into a snapshot.
fn parse(buf: &[u8]) -> Result<Snapshot, FetchError> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").ok_or(FetchError::Malformed)?;
    let head = std::str::from_utf8(buf.get(..end).ok_or(FetchError::Malformed)?).map_err(|_| FetchError::Malformed)?;
    let body = buf.get(end.saturating_add(4)..).ok_or(FetchError::Malformed)?;
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(FetchError::Status(status.to_owned()));
    }
    let (mut seq, mut incomplete_from) = (None, None);
    for line in lines {
        let Some((k, v)) = line.split_once(':') else { continue };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case(SEQ_HEADER) {
            seq = Some(v.parse().map_err(|_| FetchError::Malformed)?);
        } else if k.eq_ignore_ascii_case(INCOMPLETE_HEADER) {
            incomplete_from = Some(v.parse().map_err(|_| FetchError::Malformed)?);
        }
    }
    if u64::try_from(body.len()).unwrap_or(u64::MAX) > MAX_SNAPSHOT_BYTES {
        return Err(FetchError::TooLarge);
    }
    Ok(Snapshot { seq: seq.ok_or(FetchError::Malformed)?, incomplete_from, payload: body.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_with_their_sequence_and_refused_without_it() {
        let ok = b"HTTP/1.1 200 OK\r\nX-Llmgw-Snapshot-Seq: 41\r\nx-llmgw-snapshot-incomplete-from: 7\r\n\r\n\x93\x00";
        let s = parse(ok).expect("parses");
        assert_eq!((s.seq, s.incomplete_from, s.payload.as_slice()), (41, Some(7), &b"\x93\x00"[..]));
        assert!(matches!(parse(b"HTTP/1.1 200 OK\r\n\r\nxx"), Err(FetchError::Malformed)));
        assert!(matches!(parse(b"HTTP/1.1 429 Too Many\r\n\r\n"), Err(FetchError::Status(_))));
        assert_eq!(rank_url("http://h:1/", 2), "http://h:1/snapshot?dp_rank=2");
    }
}
