//! The tokenizer calls' round trips, shared by every worker of this Envoy through proxy-wasm
//! shared data, so that the usual round trip a sibling's wait is weighed against
//! (`llmgw_core::flow::tokenizer_wait`, which keeps the window and its median) is known once the
//! Envoy made a few calls, not once each worker did. Each answered or failed call appends its
//! round trip with compare-and-swap; a decision that needs the median reads the value then (not
//! at every decision).
//!
//! The value is the last `WINDOW` round trips in µs, oldest first, each a little-endian `u32`:
//! 128 bytes.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::FieldReader;
use llmgw_core::flow::tokenizer_wait::RoundTrips;
#[cfg(test)]
use llmgw_core::flow::tokenizer_wait::{MIN_CALLS, WINDOW};

const KEY: &str = "llmgw.tokenizer_times";

fn decode(v: &[u8]) -> RoundTrips {
    RoundTrips::new(FieldReader::new(v).rest_u32s())
}

fn encode(times: &RoundTrips) -> Vec<u8> {
    times.as_us().iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// A tokenizer call answered or failed `us` µs after it was sent. `Err` when the shared value
/// could not be updated.
pub fn observe(host: &dyn Host, us: u64) -> Result<(), SharedKind> {
    let updated = update_shared(host, KEY, |v| {
        let mut times = decode(v);
        times.observe(us);
        Some(encode(&times))
    });
    if updated {
        Ok(())
    } else {
        Err(SharedKind::TokenizerTimes)
    }
}

/// The median of the round trips every worker recorded (µs), once enough were.
pub fn median_us(host: &dyn Host) -> Option<u64> {
    let value = host.shared_data(KEY).and_then(|(v, _)| v)?;
    decode(&value).median_us()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    #[test]
    fn every_workers_calls_count_toward_one_median_of_the_last_window() {
        let host = FakeHost::default();
        for _ in 0..MIN_CALLS - 1 {
            observe(&host, 4_000).unwrap();
        }
        assert_eq!(median_us(&host), None);
        observe(&host, 4_000).unwrap();
        assert_eq!(median_us(&host), Some(4_000));
        // A slow call now and then does not move it; a lasting change turns the window over.
        observe(&host, 900_000).unwrap();
        assert_eq!(median_us(&host), Some(4_000));
        for _ in 0..WINDOW {
            observe(&host, 12_000).unwrap();
        }
        assert_eq!(median_us(&host), Some(12_000));
        let (value, _) = host.shared_data(KEY).unwrap();
        assert_eq!(value.unwrap().len(), 4 * WINDOW);
    }
}
