//! A prompt that does not fit in the room left in a replica's KV cache waits there for running
//! requests to end; the prediction counts that wait.

use super::*;

/// Three replicas of 192 blocks whose requests held them 900 ms lately; replica 0 holds the
/// conversation's 60 leading blocks and runs two other conversations of this gateway (170
/// blocks), replicas 1 and 2 one each.
fn crowded() -> Vec<Candidate<'static>> {
    let mut c = fleet(3);
    for (x, (in_flight, held)) in c.iter_mut().zip([(2, 170), (1, 90), (1, 85)]) {
        x.in_flight = in_flight;
        x.pool = Pool { blocks: 192, held, hold_us: 900_000.0, ..Pool::default() };
    }
    c
}

#[test]
fn a_late_turn_that_does_not_fit_in_its_holders_cache_goes_where_it_fits() {
    let w = rated();
    // 1,280 prompt tokens: 80 blocks, 60 of them on replica 0.
    let held = scores(&[60, 0, 0], 80);
    // Replica 0: 320 tokens at 200 µs and two requests at 40 ms (144 ms), but 170 + 80 blocks
    // exceed its 192: the request waits for the first of its two requests to end, a third of a
    // hold (300 ms). Elsewhere it computes all 1,280 tokens besides one request (296 ms).
    let d = ttft(&crowded(), &held, 1280, 7, &w);
    assert_ne!(d.winner, Some(0), "{d:?}");
    assert_eq!((d.predicted_us, d.capacity_wait_us), (Some(296_000), (0, 0)));
    assert_eq!(d.runner_up.map(|(_, us)| us), Some(296_000));
    // Room for it on the holder (100 blocks held there): it stays.
    let mut c = crowded();
    c[0].pool.held = 100;
    let d = ttft(&c, &held, 1280, 7, &w);
    assert_eq!((d.winner, d.predicted_us, d.capacity_wait_us), (Some(0), Some(144_000), (0, 0)));
    // Short holds (answers of a few tokens): a third of 200 ms is less than the recompute
    // elsewhere costs, and the holder keeps it with the wait in its prediction.
    let mut c = crowded();
    c[0].pool.hold_us = 200_000.0;
    let d = ttft(&c, &held, 1280, 7, &w);
    assert_eq!((d.winner, d.capacity_wait_us), (Some(0), (66_666, 0)));
    assert_eq!(d.predicted_us, Some(144_000 + 66_666));
    // Nothing said of the cache's size, or no hold observed yet: nothing is added.
    for unknown in [Pool { blocks: 0, ..crowded()[0].pool }, Pool { hold_us: 0.0, ..crowded()[0].pool }] {
        let mut c = crowded();
        c[0].pool = unknown;
        let d = ttft(&c, &held, 1280, 7, &w);
        assert_eq!((d.winner, d.predicted_us, d.capacity_wait_us), (Some(0), Some(144_000), (0, 0)));
    }
    // A prompt larger than every cache: it fits nowhere, nothing is added.
    let d = ttft(&crowded(), &scores(&[60, 0, 0], 200), 3200, 7, &w);
    assert_eq!((d.winner, d.capacity_wait_us), (Some(0), (0, 0)));
}

#[test]
fn a_new_prefix_goes_where_its_prompt_fits() {
    let w = rated();
    // A new conversation of 80 blocks. Replica 2 runs one request, the others two and three;
    // but that one request holds 150 of replica 2's 192 blocks, and the new prompt would wait
    // there for it to end (half a hold: 450 ms). Replica 1 has room (90 held): 376 ms.
    let mut c = crowded();
    c[1].in_flight = 3;
    c[2].pool.held = 150;
    let none = scores(&[0, 0, 0], 80);
    let d = ttft(&c, &none, 1280, 11, &w);
    // The runner-up, replica 0, would wait a third of a hold behind its two: 336 + 300 ms.
    assert_eq!((d.winner, d.predicted_us, d.runner_up), (Some(1), Some(376_000), Some((0, 636_000))), "{d:?}");
    assert_eq!(d.capacity_wait_us, (0, 300_000));
    // With room there, the fewer requests decide, as without counting blocks.
    c[2].pool.held = 100;
    let d = ttft(&c, &none, 1280, 11, &w);
    assert_eq!((d.winner, d.predicted_us), (Some(2), Some(296_000)), "{d:?}");
}

#[test]
fn blocks_the_engine_reports_beyond_this_gateways_count_against_the_room() {
    let w = rated();
    let held = scores(&[60, 0, 0], 80);
    // This gateway's two requests hold 100 blocks on the holder: 80 more fit in its 192.
    let mut c = crowded();
    c[0].pool.held = 100;
    let d = ttft(&c, &held, 1280, 7, &w);
    assert_eq!((d.winner, d.capacity_wait_us), (Some(0), (0, 0)), "{d:?}");
    // The engine reported 40 more in use than this gateway's requests held then, by one other
    // request (another gateway's, or decoding): 220 blocks. The request waits for the first of
    // three to end, a quarter of a hold (225 ms), and goes where it fits.
    c[0].pool.others = 40;
    c[0].pool.others_running = 1;
    let d = ttft(&c, &held, 1280, 7, &w);
    assert_ne!(d.winner, Some(0), "{d:?}");
    assert_eq!(crate::policy::capacity::wait_us(&c[0], 80), 225_000.0);
    // Other requests alone: none of this gateway's in flight on the holder, which is then
    // predicted at 64 ms and keeps the request; with 170 blocks of two other requests there, it
    // would wait a third of a hold (364 ms) and the request goes where it fits (296 ms).
    let mut c = crowded();
    c[0].in_flight = 0;
    c[0].pool.held = 0;
    let d = ttft(&c, &held, 1280, 7, &w);
    assert_eq!((d.winner, d.predicted_us), (Some(0), Some(64_000)), "{d:?}");
    c[0].pool.others = 170;
    c[0].pool.others_running = 2;
    let d = ttft(&c, &held, 1280, 7, &w);
    assert_eq!((d.winner, d.predicted_us), (Some(1), Some(296_000)), "{d:?}");
    assert_eq!(crate::policy::capacity::wait_us(&c[0], 80), 300_000.0);
}
