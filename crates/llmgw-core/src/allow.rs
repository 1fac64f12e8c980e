//! Where the filter may send a request: the destinations the replica table names are checked
//! against a configured allowlist of networks and ports before any of them is routable, so a
//! compromised agent (or anyone who can impersonate its feed) cannot make Envoy's
//! `ORIGINAL_DST` cluster forward clients' prompts to an address of its choosing.
//!
//! An entry is a network in CIDR notation (a bare address is a /32 or /128), optionally
//! followed by a port or an inclusive port range: `10.0.0.0/8`, `10.1.2.3:8000`,
//! `10.0.0.0/8:8000-8010`, `[fd00::/8]:8000`, `fd00::/8`. Networks are parsed by `ipnet`.

use ipnet::IpNet;
use std::net::{IpAddr, SocketAddr};

/// Networks the filter routes to when the configuration names none: loopback, the private
/// IPv4 ranges (RFC 1918), carrier-grade NAT space (some clusters' pod networks), IPv6 unique
/// local and link-local addresses. Any port.
pub const DEFAULT: &[&str] = &[
    "127.0.0.0/8",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "::1/128",
    "fc00::/7",
    "fe80::/10",
];

/// Cloud instance-metadata and host-agent addresses, never routed to whatever the allowlist
/// says (no replica serves there, and a forged replica table naming one would hand clients'
/// requests, or the filter's tokenizer calls, to the node's credentials service): AWS
/// (169.254.169.254, its IPv6 `fd00:ec2::254` inside the default unique-local range, ECS's
/// 169.254.170.2), Google Cloud's IPv6 `fd20:ce::254`, Alibaba Cloud's 100.100.100.200 (inside
/// the default carrier-grade NAT range), Azure's 168.63.129.16.
pub const NEVER: &[&str] = &[
    "169.254.169.254/32",
    "169.254.170.2/32",
    "fd00:ec2::254/128",
    "fd20:ce::254/128",
    "100.100.100.200/32",
    "168.63.129.16/32",
];

/// At most this many entries (each destination is checked against every one).
pub const MAX_ENTRIES: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    net: IpNet,
    ports: (u16, u16),
}

/// A compiled allowlist.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allowlist {
    entries: Vec<Entry>,
    /// [`NEVER`], compiled.
    never: Vec<IpNet>,
}

fn parse_ports(s: &str) -> Result<(u16, u16), String> {
    let port = |p: &str| p.parse::<u16>().map_err(|_| format!("`{p}` is not a port (0-65535)"));
    match s.split_once('-') {
        Some((lo, hi)) => {
            let (lo, hi) = (port(lo)?, port(hi)?);
            if lo > hi {
                return Err(format!("port range `{s}` is empty"));
            }
            Ok((lo, hi))
        }
        None => port(s).map(|p| (p, p)),
    }
}

fn parse_net(s: &str) -> Result<IpNet, String> {
    if s.contains('/') {
        s.parse::<IpNet>().map(|n| n.trunc()).map_err(|_| format!("`{s}` is not a network in CIDR notation"))
    } else {
        s.parse::<IpAddr>().map(IpNet::from).map_err(|_| format!("`{s}` is not an IP address or network"))
    }
}

fn parse_entry(s: &str) -> Result<Entry, String> {
    let s = s.trim();
    let any = (0, u16::MAX);
    // `[net]:ports` (IPv6 with ports), `net:ports` (IPv4 with ports), else a bare network.
    if let Some(rest) = s.strip_prefix('[') {
        let (net, after) = rest.split_once(']').ok_or_else(|| format!("`{s}`: `[` without `]`"))?;
        let ports = match after {
            "" => any,
            p => parse_ports(p.strip_prefix(':').ok_or_else(|| format!("`{s}`: expected `:PORT` after `]`"))?)?,
        };
        return Ok(Entry { net: parse_net(net)?, ports });
    }
    match s.split_once(':') {
        // One colon: IPv4 with ports. More: a bare IPv6 network.
        Some((net, ports)) if !ports.contains(':') => Ok(Entry { net: parse_net(net)?, ports: parse_ports(ports)? }),
        _ => Ok(Entry { net: parse_net(s)?, ports: any }),
    }
}

/// The address form a replica's destination has (`IP:PORT`, IPv6 in brackets), IPv4-mapped
/// IPv6 addresses read as IPv4.
fn socket(address: &str) -> Option<(IpAddr, u16)> {
    let a = address.parse::<SocketAddr>().ok()?;
    let ip = match a.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    Some((ip, a.port()))
}

impl Allowlist {
    /// Compiles `entries`; the error names the offending entry by its position.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Allowlist, (usize, String)> {
        if entries.len() > MAX_ENTRIES {
            return Err((MAX_ENTRIES, format!("at most {MAX_ENTRIES} entries")));
        }
        let entries = entries
            .iter()
            .enumerate()
            .map(|(i, e)| parse_entry(e.as_ref()).map_err(|m| (i, m)))
            .collect::<Result<Vec<_>, _>>()?;
        let never = NEVER.iter().filter_map(|n| parse_net(n).ok()).collect();
        Ok(Allowlist { entries, never })
    }

    /// The default networks ([`DEFAULT`]).
    pub fn default_networks() -> Allowlist {
        Allowlist::parse(DEFAULT).unwrap_or_default()
    }

    /// Whether `address` (`IP:PORT`) is a destination the filter may route to. Anything that
    /// is not a literal socket address (a host name, garbage) is refused.
    pub fn allows(&self, address: &str) -> bool {
        let Some((ip, port)) = socket(address) else { return false };
        if self.never.iter().any(|n| n.contains(&ip)) {
            return false;
        }
        self.entries.iter().any(|e| e.net.contains(&ip) && e.ports.0 <= port && port <= e.ports.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(e: &[&str]) -> Allowlist {
        Allowlist::parse(e).unwrap()
    }

    #[test]
    fn networks_and_ports() {
        let a = list(&["10.0.0.0/8:8000-8010", "192.168.1.7", "[fd00::/8]:9000", "2001:db8::/32"]);
        assert!(a.allows("10.1.2.3:8000") && a.allows("10.1.2.3:8010"));
        assert!(!a.allows("10.1.2.3:8011") && !a.allows("11.0.0.1:8000"));
        assert!(a.allows("192.168.1.7:1") && !a.allows("192.168.1.8:1"));
        assert!(a.allows("[fd12::1]:9000") && !a.allows("[fd12::1]:9001"));
        assert!(a.allows("[2001:db8::5]:80"));
        // IPv4-mapped IPv6 is the IPv4 address.
        assert!(a.allows("[::ffff:10.0.0.1]:8005"));
        // Not a socket address: refused.
        for bad in ["", "localhost:8000", "10.1.2.3", "10.1.2.3:99999", "http://10.1.2.3:8000"] {
            assert!(!a.allows(bad), "{bad}");
        }
    }

    #[test]
    fn the_default_allows_private_networks_only() {
        let a = Allowlist::default_networks();
        assert_eq!(a.entries.len(), DEFAULT.len());
        for ok in ["127.0.0.1:8000", "10.244.3.9:8000", "172.20.0.4:8000", "192.168.0.2:80", "[fd00::3]:8000"] {
            assert!(a.allows(ok), "{ok}");
        }
        for no in ["8.8.8.8:53", "169.254.169.254:80", "[2606:4700::1]:443", "172.32.0.1:8000"] {
            assert!(!a.allows(no), "{no}");
        }
    }

    #[test]
    fn cloud_metadata_addresses_are_never_routed_to_whatever_the_list_allows() {
        let everything = list(&["0.0.0.0/0", "::/0"]);
        assert!(everything.allows("8.8.8.8:53") && everything.allows("[2606:4700::1]:443"));
        for no in [
            "169.254.169.254:80",
            "[fd00:ec2::254]:80",
            "[::ffff:169.254.169.254]:80",
            "[fd20:ce::254]:80",
            "100.100.100.200:80",
            "168.63.129.16:80",
            "169.254.170.2:80",
        ] {
            assert!(!everything.allows(no), "{no}");
            assert!(!Allowlist::default_networks().allows(no), "{no}");
        }
        // Their neighbours in the default ranges stay routable.
        let d = Allowlist::default_networks();
        assert!(d.allows("[fd00:ec2::253]:8000") && d.allows("100.100.100.201:8000"));
    }

    #[test]
    fn bad_entries_are_named() {
        for (e, want) in [
            (vec!["10.0.0.0/33"], "CIDR"),
            (vec!["10.0.0.0/8", "x"], "IP address"),
            (vec!["10.0.0.0/8:9-1"], "empty"),
            (vec!["10.0.0.0/8:http"], "not a port"),
            (vec!["[fd00::/8"], "without"),
            (vec!["[fd00::/8]9000"], "expected"),
        ] {
            let (_, m) = Allowlist::parse(&e).unwrap_err();
            assert!(m.contains(want), "{e:?}: {m}");
        }
        assert_eq!(Allowlist::parse(&["1.2.3.4", "nope"]).unwrap_err().0, 1);
        assert!(Allowlist::parse(&vec!["1.2.3.4"; MAX_ENTRIES + 1]).is_err());
    }
}
