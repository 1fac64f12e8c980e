//! `[jetstream.snapshots]`: engines' snapshots kept in a JetStream object-store bucket, so that
//! an agent on the JetStream path starts from a snapshot and the stream's tail instead of the
//! whole stream (see [`crate::jetstream::snapshot_bucket`]).
//!
//! ```toml
//! [jetstream.snapshots]
//! bucket = "llmgw-snapshots"      # created if absent
//! interval_secs = 10              # publish rewrites an engine's object this often, if it changed
//! max_object_bytes = 67108864     # an engine's snapshot larger than this is neither written nor read
//! bucket_max_bytes = 1073741824   # the bucket as a whole
//! ```
//!
//! Its checks are in the configuration's validation.

use serde::Deserialize;

/// The largest snapshot an agent reads, over HTTP from a sidecar or from the bucket (about 28
/// million blocks); a larger one is refused. Here, with the settings it bounds, so that the
/// configuration's checks need nothing from the snapshot code.
pub const MAX_SNAPSHOT_BYTES: u64 = 256 << 20;

/// Where and how often the `publish` sidecars write snapshots, and where agents read them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotBucketConfig {
    #[serde(default = "default_bucket")]
    pub bucket: String,
    #[serde(default = "default_interval")]
    pub interval_secs: u64,
    #[serde(default = "default_object_bytes")]
    pub max_object_bytes: u64,
    #[serde(default = "default_bucket_bytes")]
    pub bucket_max_bytes: i64,
}

fn default_bucket() -> String {
    "llmgw-snapshots".to_owned()
}
fn default_interval() -> u64 {
    10
}
fn default_object_bytes() -> u64 {
    64 << 20
}
fn default_bucket_bytes() -> i64 {
    1 << 30
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const BASE: &str = "[jetstream]\nurl = \"nats://127.0.0.1:4222\"\n[[replicas]]\nname = \"a\"\n\
                        address = \"127.0.0.1:8000\"\nevents = \"jetstream\"\n";

    fn parse(section: &str) -> Result<Config, String> {
        let text = BASE.replace("[[replicas]]", &format!("{section}\n[[replicas]]"));
        Config::parse(&text).map_err(|e| e.to_string())
    }

    #[test]
    fn the_section_turns_snapshots_on_with_defaults_and_refuses_nonsense() {
        assert!(parse("").unwrap_or_else(|e| panic!("{e}")).jetstream.and_then(|j| j.snapshots).is_none());
        let s = parse("[jetstream.snapshots]").ok().and_then(|c| c.jetstream).and_then(|j| j.snapshots);
        let s = s.unwrap_or_else(|| panic!("section parsed"));
        assert_eq!((s.bucket.as_str(), s.interval_secs), ("llmgw-snapshots", 10));
        for (bad, field) in [
            ("bucket = \"a.b\"", "jetstream.snapshots.bucket"),
            ("interval_secs = 0", "jetstream.snapshots.interval_secs"),
            ("max_object_bytes = 10", "jetstream.snapshots.max_object_bytes"),
            ("bucket_max_bytes = 100", "jetstream.snapshots.bucket_max_bytes"),
        ] {
            let e = parse(&format!("[jetstream.snapshots]\n{bad}")).err().unwrap_or_default();
            assert!(e.contains(field), "{bad}: {e}");
        }
    }
}
