//! The checks serde cannot make: addresses, endpoints, uniqueness, listener safety. Every
//! error names the field it is about.

use super::engine::{is_loopback_host, offset_port, parse_tcp};
use super::file::{err, Config, ConfigError, Events, HashConfig, JetStreamConfig, Mode, Sources};
use super::snapshot_bucket::SnapshotBucketConfig;
use llmgw_core::hash::BlockHasher;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

impl Config {
    /// Checks everything serde cannot: addresses, endpoints, uniqueness, listener safety.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_hash("hash", &self.hash)?;
        if let Some(t) = &self.tokenizer {
            t.validate().map_err(|(field, message)| err(field, message))?;
        }
        if let Some(e) = &self.epp {
            e.validate().map_err(|(field, message)| err(field, message))?;
        }
        let f = &self.feed;
        match (&f.tls_cert, &f.tls_key) {
            (Some(_), None) => return Err(err("feed.tls_key", "tls_cert needs tls_key")),
            (None, Some(_)) => return Err(err("feed.tls_cert", "tls_key needs tls_cert")),
            _ => {}
        }
        if f.client_ca.is_some() && f.tls_cert.is_none() {
            return Err(err("feed.client_ca", "mutual TLS needs tls_cert and tls_key"));
        }
        if !f.listen.ip().is_loopback() {
            if !f.allow_non_loopback {
                return Err(err(
                    "feed.listen",
                    format!("{} is not a loopback address; set feed.allow_non_loopback = true (or --feed-allow-non-loopback), TLS (tls_cert, tls_key) and a token or client_ca", f.listen),
                ));
            }
            if f.tls_cert.is_none() {
                return Err(err("feed.tls_cert", "a non-loopback feed listener needs TLS (tls_cert and tls_key)"));
            }
            if f.token.as_deref().unwrap_or("").is_empty() && f.client_ca.is_none() {
                return Err(err("feed.token", "a non-loopback feed listener needs a shared token or client_ca"));
            }
        }
        if self.feed.max_queue < 16 {
            return Err(err("feed.max_queue", "must be at least 16"));
        }
        if self.feed.max_subscribers == 0 {
            return Err(err("feed.max_subscribers", "must be at least 1"));
        }
        if self.feed.max_backlog_bytes < 1 << 20 {
            return Err(err("feed.max_backlog_bytes", "must be at least 1 MiB"));
        }
        if !(self.feed.heartbeat_secs > 0.0 && self.feed.heartbeat_secs <= 3600.0) {
            return Err(err("feed.heartbeat_secs", "must be in (0, 3600]"));
        }
        if self.feed.gather_ms > 1000 {
            return Err(err("feed.gather_ms", "must be at most 1000"));
        }
        if self.zmq.rcvhwm < 0 {
            return Err(err("zmq.rcvhwm", "must be >= 0"));
        }
        if self.zmq.max_message_bytes < 1024 {
            return Err(err("zmq.max_message_bytes", "must be at least 1024"));
        }
        if self.zmq.max_queued_bytes < self.zmq.max_message_bytes {
            return Err(err("zmq.max_queued_bytes", "must be at least zmq.max_message_bytes"));
        }
        if self.zmq.reconnect_ivl_max_ms < 0 {
            return Err(err("zmq.reconnect_ivl_max_ms", "must be >= 0"));
        }
        if self.load.interval_ms == 0 {
            return Err(err("load.interval_ms", "must be at least 1"));
        }
        if !(0.0..=1.0).contains(&self.parity.warn_mismatch_ratio) {
            return Err(err("parity.warn_mismatch_ratio", "must be between 0 and 1"));
        }
        let mut names = BTreeSet::new();
        for (i, r) in self.replicas.iter().enumerate() {
            let f = |name: &str| format!("replicas[{i}].{name}");
            if r.name.is_empty() {
                return Err(err(f("name"), "must not be empty"));
            }
            if !names.insert(r.name.as_str()) {
                return Err(err(f("name"), format!("duplicate replica name {:?}", r.name)));
            }
            r.address
                .parse::<SocketAddr>()
                .map_err(|_| err(f("address"), format!("{:?} is not ip:port", r.address)))?;
            if r.dp_ranks == 0 || r.dp_ranks > 1024 {
                return Err(err(f("dp_ranks"), "must be between 1 and 1024"));
            }
            if r.events == Events::Jetstream {
                if self.jetstream.is_none() {
                    return Err(err(f("events"), "events = \"jetstream\" needs a [jetstream] section"));
                }
                if !r.endpoint.is_empty() || r.replay_endpoint.is_some() {
                    return Err(err(f("endpoint"), "a replica with events = \"jetstream\" has no ZMQ endpoints"));
                }
                if let Some(h) = &r.hash {
                    check_hash(&f("hash"), h)?;
                }
                check_metrics_url(&f("metrics_url"), r.metrics_url.as_deref())?;
                if r.snapshot_url.is_some() {
                    return Err(err(
                        f("snapshot_url"),
                        "snapshot_url is for ZMQ events; with events = \"jetstream\" snapshots come from [jetstream.snapshots]",
                    ));
                }
                continue;
            }
            if r.endpoint.is_empty() {
                return Err(err(
                    f("endpoint"),
                    "missing: the replica's ZMQ publisher (tcp://host:port), or events = \"jetstream\"",
                ));
            }
            let (host, port) = parse_tcp(&r.endpoint).map_err(|m| err(f("endpoint"), m.to_string()))?;
            let last = u32::from(port).saturating_add(r.dp_ranks).saturating_sub(1);
            if port == 0 || last > u32::from(u16::MAX) {
                return Err(err(f("endpoint"), "port must be non-zero and port + dp_ranks - 1 must fit in 65535"));
            }
            if r.mode == Mode::Bind && !is_loopback_host(&host) {
                return Err(err(
                    f("endpoint"),
                    format!("bind mode binds a loopback address only, got {host:?} (use tcp://127.0.0.1:PORT)"),
                ));
            }
            if r.mode == Mode::Connect && host == "*" {
                return Err(err(f("endpoint"), "connect mode needs the replica's host, not *"));
            }
            if let Some(rep) = &r.replay_endpoint {
                let (rhost, rport) = parse_tcp(rep).map_err(|m| err(f("replay_endpoint"), m.to_string()))?;
                if rhost == "*" {
                    return Err(err(
                        f("replay_endpoint"),
                        "the agent connects to the replay socket: give the replica's host, not *",
                    ));
                }
                if rport == 0 || u32::from(rport).saturating_add(r.dp_ranks).saturating_sub(1) > u32::from(u16::MAX) {
                    return Err(err(
                        f("replay_endpoint"),
                        "port must be non-zero and port + dp_ranks - 1 must fit in 65535",
                    ));
                }
            }
            if let Some(h) = &r.hash {
                check_hash(&f("hash"), h)?;
            }
            check_metrics_url(&f("metrics_url"), r.metrics_url.as_deref())?;
            if let Some(u) = &r.snapshot_url {
                if !u.starts_with("http://") || u.len() <= "http://".len() {
                    return Err(err(
                        f("snapshot_url"),
                        "must be http://host:port (the publish sidecar's --snapshot-listen)",
                    ));
                }
            }
        }
        for (i, d) in self.discovery.iter().enumerate() {
            let f = |name: &str| format!("discovery[{i}].{name}");
            if d.name.is_empty() || names.contains(d.name.as_str()) {
                return Err(err(f("name"), "must be non-empty and differ from every replica name"));
            }
            if d.dns.is_empty() {
                return Err(err(f("dns"), "must name a host"));
            }
            if d.port == 0 {
                return Err(err(f("port"), "must be non-zero"));
            }
            if d.refresh_ms < 100 {
                return Err(err(f("refresh_ms"), "must be at least 100"));
            }
            if d.dp_ranks == 0 || d.dp_ranks > 1024 {
                return Err(err(f("dp_ranks"), "must be between 1 and 1024"));
            }
            if d.sources == Sources::Static && d.events_port.is_none_or(|p| p == 0) {
                return Err(err(f("events_port"), "sources = \"static\" needs the publisher port"));
            }
            if let Some(h) = &d.hash {
                check_hash(&f("hash"), h)?;
            }
        }
        if let Some(js) = &self.jetstream {
            check_jetstream(js)?;
        }
        // Two engines on one endpoint (or subject) would mix two publishers' sequences.
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        for (i, r) in self.replicas.iter().enumerate() {
            if let (Events::Jetstream, Some(js)) = (r.events, &self.jetstream) {
                for rank in 0..r.dp_ranks {
                    let s = super::engine::subject(&js.subject_prefix, &r.address, rank);
                    if let Some(j) = seen.insert(s.clone(), i) {
                        return Err(err(
                            format!("replicas[{i}].address"),
                            format!("its subject {s} is already replicas[{j}]'s"),
                        ));
                    }
                }
                continue;
            }
            for rank in 0..r.dp_ranks {
                let ep = offset_port(&r.endpoint, rank).unwrap_or_else(|| r.endpoint.clone());
                if let Some(j) = seen.insert(ep.clone(), i) {
                    return Err(err(
                        format!("replicas[{i}].endpoint"),
                        format!("{ep} is already used by replicas[{j}] (data-parallel ranks use port + rank)"),
                    ));
                }
            }
        }
        let engines: u64 = self.replicas.iter().map(|r| u64::from(r.dp_ranks)).sum();
        if engines > 65_535 {
            return Err(err("replicas", "too many engines (replicas x dp_ranks > 65535)"));
        }
        Ok(())
    }
}

fn check_metrics_url(field: &str, u: Option<&str>) -> Result<(), ConfigError> {
    match u {
        Some(u) if !u.is_empty() && !u.starts_with("http://") => {
            Err(err(field, "must start with http:// (or be empty to disable scraping)"))
        }
        _ => Ok(()),
    }
}

fn check_snapshot_bucket(b: &SnapshotBucketConfig) -> Result<(), ConfigError> {
    let name_ok = !b.bucket.is_empty() && b.bucket.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !name_ok {
        return Err(err("jetstream.snapshots.bucket", "letters, digits, '_' and '-' only"));
    }
    if b.interval_secs == 0 || b.interval_secs > 3600 {
        return Err(err("jetstream.snapshots.interval_secs", "must be between 1 and 3600"));
    }
    if b.max_object_bytes < 1 << 10 || b.max_object_bytes > super::MAX_SNAPSHOT_BYTES {
        return Err(err(
            "jetstream.snapshots.max_object_bytes",
            format!("must be between 1024 and {}", super::MAX_SNAPSHOT_BYTES),
        ));
    }
    // An object is rewritten before the old one is deleted: the bucket holds two at once.
    let two = i64::try_from(b.max_object_bytes.saturating_mul(2)).unwrap_or(i64::MAX);
    if b.bucket_max_bytes < two {
        return Err(err("jetstream.snapshots.bucket_max_bytes", "must hold at least two max_object_bytes objects"));
    }
    Ok(())
}

fn check_jetstream(js: &JetStreamConfig) -> Result<(), ConfigError> {
    let (tls, rest) = if let Some(r) = js.url.strip_prefix("tls://") {
        (true, r)
    } else if let Some(r) = js.url.strip_prefix("nats://") {
        (false, r)
    } else {
        return Err(err("jetstream.url", format!("{:?}: must be nats://host:port or tls://host:port", js.url)));
    };
    if rest.contains('@') || rest.contains('/') {
        // A token in the URL would be logged with it: it goes in `token`.
        return Err(err("jetstream.url", "host:port only (credentials go in jetstream.token)"));
    }
    let host = match rest.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0) => h,
        _ => return Err(err("jetstream.url", format!("{:?}: needs host:port", js.url))),
    };
    match (&js.user, &js.password) {
        (Some(u), Some(p)) if !u.is_empty() && !p.is_empty() => {
            if js.token.is_some() {
                return Err(err("jetstream.user", "a token or a user and password, not both"));
            }
        }
        (None, None) => {}
        _ => return Err(err("jetstream.user", "a user needs a password and a password a user, both non-empty")),
    }
    // Off loopback the events (which name every cached block) travel encrypted and to an
    // authenticated broker only.
    if !is_loopback_host(host) {
        if !tls && js.tls_ca.is_none() {
            return Err(err("jetstream.url", "a broker off loopback needs TLS (tls://host:port or tls_ca)"));
        }
        if js.token.as_deref().unwrap_or("").is_empty() && js.user.is_none() {
            return Err(err("jetstream.token", "a broker off loopback needs a token or a user and password"));
        }
    }
    if let Some(s) = &js.snapshots {
        check_snapshot_bucket(s)?;
    }
    if js.max_queued_bytes < 1 << 20 {
        return Err(err("jetstream.max_queued_bytes", "must be at least 1 MiB"));
    }
    let name_ok = !js.stream.is_empty() && js.stream.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !name_ok {
        return Err(err("jetstream.stream", "letters, digits, '_' and '-' only"));
    }
    let prefix_ok = !js.subject_prefix.is_empty()
        && js
            .subject_prefix
            .split('.')
            .all(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'));
    if !prefix_ok {
        return Err(err("jetstream.subject_prefix", "dot-separated tokens of letters, digits, '_' and '-'"));
    }
    if js.max_messages_per_subject < 1 {
        return Err(err("jetstream.max_messages_per_subject", "must be at least 1"));
    }
    if js.max_bytes == 0 || js.max_bytes < -1 {
        return Err(err("jetstream.max_bytes", "must be positive, or -1 for no limit"));
    }
    Ok(())
}

fn check_hash(field: &str, h: &HashConfig) -> Result<(), ConfigError> {
    // A seed still to be read (vllm-args, publish) is a seed all the same: its value does not
    // change which algorithms may be used.
    let seed = h.seed.as_deref().or(h.seed_deferred().then_some("0"));
    BlockHasher::new(h.algo, seed).map_err(|e| err(format!("{field}.seed"), e.to_string()))?;
    if h.block_size == 0 {
        return Err(err(format!("{field}.block_size"), "must be at least 1"));
    }
    let max = llmgw_core::hash::MAX_LOOKAHEAD;
    if usize::try_from(h.lookahead_tokens).map_or(true, |l| l > max) {
        return Err(err(format!("{field}.lookahead_tokens"), format!("must be at most {max}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::file::tests::{error_of, OK};
    use super::*;

    const TLS: &str = "tls_cert = \"c.pem\"\ntls_key = \"k.pem\"\n";

    #[test]
    fn semantic_errors_name_the_field() {
        let cases = [
            (OK.replace("algo = \"sha256_cbor\"", "algo = \"md5\""), "hash.algo"),
            (OK.replace("address = \"127.0.0.1:8001\"", "address = \"replica-b\""), "replicas[1].address"),
            (OK.replace("name = \"b\"", "name = \"a\""), "replicas[1].name"),
            (OK.replace("tcp://127.0.0.1:6000", "tcp://10.1.2.3:6000"), "replicas[1].endpoint"),
            (OK.replace("tcp://127.0.0.1:5557", "ipc:///tmp/x"), "replicas[0].endpoint"),
            (OK.replace("tcp://127.0.0.1:5558", "tcp://*:5558"), "replicas[0].replay_endpoint"),
            (OK.replace("dp_ranks = 2", "dp_ranks = 0"), "replicas[0].dp_ranks"),
            // Rank 1 of replica a is on 5558; b may not use it.
            (OK.replace("tcp://127.0.0.1:6000", "tcp://127.0.0.1:5558"), "replicas[1].endpoint"),
            (OK.replace("tcp://127.0.0.1:5557", "tcp://127.0.0.1:65535"), "replicas[0].endpoint"),
            (format!("[feed]\nlisten = \"0.0.0.0:7070\"\n{OK}"), "feed.listen"),
            (
                format!("[feed]\nlisten = \"0.0.0.0:7070\"\nallow_non_loopback = true\ntoken = \"s\"\n{OK}"),
                "feed.tls_cert",
            ),
            (format!("[feed]\nlisten = \"0.0.0.0:7070\"\nallow_non_loopback = true\n{TLS}{OK}"), "feed.token"),
            (format!("[feed]\ntls_cert = \"c.pem\"\n{OK}"), "feed.tls_key"),
            (format!("[feed]\nclient_ca = \"ca.pem\"\n{OK}"), "feed.client_ca"),
        ];
        for (text, field) in cases {
            let e = error_of(&text);
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().starts_with(field), "{e}");
        }
        // Off loopback: TLS, and a token or mutual TLS.
        let ok = format!("[feed]\nlisten = \"0.0.0.0:7070\"\nallow_non_loopback = true\ntoken = \"s\"\n{TLS}{OK}");
        assert!(Config::parse(&ok).is_ok());
        let ok =
            format!("[feed]\nlisten = \"0.0.0.0:7070\"\nallow_non_loopback = true\nclient_ca = \"ca.pem\"\n{TLS}{OK}");
        assert!(Config::parse(&ok).is_ok());
    }

    #[test]
    fn jetstream_replicas_need_the_section_no_zmq_endpoints_and_a_safe_broker() {
        let js = "[jetstream]\nurl = \"nats://127.0.0.1:4222\"\n";
        let rep = "[[replicas]]\nname = \"j\"\naddress = \"127.0.0.1:8009\"\nevents = \"jetstream\"\n";
        let cfg = Config::parse(&format!("{js}{OK}{rep}")).unwrap();
        let e = cfg.engines();
        assert_eq!(e.last().and_then(|e| e.source.subject()), Some("llmgw.kv.127_0_0_1_8009.0"));
        assert!(e.first().is_some_and(|e| e.source.subject().is_none()));
        let cases = [
            (format!("{OK}{rep}"), "replicas[2].events"),
            (format!("{js}{OK}{rep}endpoint = \"tcp://127.0.0.1:7000\"\n"), "replicas[2].endpoint"),
            // Two replicas on one address would share a subject.
            (format!("{js}{OK}{rep}{}", rep.replace("\"j\"", "\"k\"")), "replicas[3].address"),
            (format!("[jetstream]\nurl = \"http://127.0.0.1:4222\"\n{OK}"), "jetstream.url"),
            (format!("[jetstream]\nurl = \"nats://127.0.0.1\"\n{OK}"), "jetstream.url"),
            (format!("[jetstream]\nurl = \"nats://10.0.0.9:4222\"\ntoken = \"t\"\n{OK}"), "jetstream.url"),
            (format!("[jetstream]\nurl = \"tls://10.0.0.9:4222\"\n{OK}"), "jetstream.token"),
            (format!("{js}stream = \"a.b\"\n{OK}"), "jetstream.stream"),
            (format!("{js}subject_prefix = \"a..b\"\n{OK}"), "jetstream.subject_prefix"),
            (format!("{js}subject_prefix = \"a.>\"\n{OK}"), "jetstream.subject_prefix"),
            (format!("{js}max_messages_per_subject = 0\n{OK}"), "jetstream.max_messages_per_subject"),
            (format!("[jetstream]\nurl = \"nats://tok@127.0.0.1:4222\"\n{OK}"), "jetstream.url"),
            (format!("{js}{OK}{rep}metrics_url = \"ftp://x\"\n"), "replicas[2].metrics_url"),
            (format!("{js}{OK}{rep}snapshot_url = \"http://127.0.0.1:9100\"\n"), "replicas[2].snapshot_url"),
            (format!("{OK}snapshot_url = \"https://x\"\n"), "replicas[1].snapshot_url"),
        ];
        for (text, field) in cases {
            let e = error_of(&text);
            assert_eq!(e.field, field, "{e}");
        }
        let ok = format!("[jetstream]\nurl = \"tls://10.0.0.9:4222\"\ntoken = \"t\"\n{OK}");
        assert!(Config::parse(&ok).is_ok());
    }

    #[test]
    fn a_publisher_may_bring_its_own_user_and_password_instead_of_the_token() {
        let js = "[jetstream]\nurl = \"tls://10.0.0.9:4222\"\n";
        let ok = format!("{js}user = \"pub-a\"\npassword = \"s\"\n{OK}");
        let cfg = Config::parse(&ok).unwrap();
        assert_eq!(cfg.jetstream.as_ref().and_then(|j| j.user.as_deref()), Some("pub-a"));
        for (extra, field) in [
            ("user = \"pub-a\"\n", "jetstream.user"),
            ("password = \"s\"\n", "jetstream.user"),
            ("user = \"\"\npassword = \"s\"\n", "jetstream.user"),
            ("token = \"t\"\nuser = \"pub-a\"\npassword = \"s\"\n", "jetstream.user"),
            ("token = \"t\"\nmax_queued_bytes = 1024\n", "jetstream.max_queued_bytes"),
        ] {
            assert_eq!(error_of(&format!("{js}{extra}{OK}")).field, field, "{extra}");
        }
    }

    #[test]
    fn the_receive_queue_is_bounded_in_bytes_whatever_the_message_count_limit() {
        let cfg = Config::parse(OK).unwrap();
        // Defaults: 1 GiB over 4 MiB messages.
        assert_eq!(cfg.zmq.receive_hwm(), 256);
        let mut z = cfg.zmq.clone();
        z.rcvhwm = 100;
        assert_eq!(z.receive_hwm(), 100);
        z.rcvhwm = 0;
        z.max_message_bytes = 16 << 20;
        z.max_queued_bytes = 64 << 20;
        assert_eq!(z.receive_hwm(), 4);
        let e = error_of(&format!("[zmq]\nmax_message_bytes = 2097152\nmax_queued_bytes = 1048576\n{OK}"));
        assert_eq!(e.field, "zmq.max_queued_bytes", "{e}");
    }
}
