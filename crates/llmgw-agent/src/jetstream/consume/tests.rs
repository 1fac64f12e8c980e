//! Tests of `consume.rs`.

use super::*;
use crate::config::subject;
use crate::hub::fixtures::{batch, stored};
use crate::hub::Health;
use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch};

fn payload(hashes: Vec<u64>) -> Vec<u8> {
    let w = WireBatch { ts: 1.0, events: vec![stored(hashes)], data_parallel_rank: None };
    encode_batch(&w, Encoding::Tagged, HashForm::Int)
}

fn setup() -> (Arc<Hub>, StreamIngest) {
    let cfg = Config::parse(
        "[jetstream]\nurl = \"nats://127.0.0.1:4222\"\n\
             [[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nevents = \"jetstream\"\n\
             [[replicas]]\nname = \"b\"\naddress = \"127.0.0.1:8001\"\nendpoint = \"tcp://127.0.0.1:5557\"\n",
    )
    .unwrap();
    let engines = cfg.engines();
    let hub = Hub::new(engines.clone(), 4096, 1 << 20);
    for e in &engines {
        hub.state().set_health(e.id as usize, Health::Publisher, true, "test");
    }
    (hub, StreamIngest::new(&engines))
}

#[test]
fn a_pull_asks_for_no_more_bytes_than_the_queue_holds() {
    // 1 GiB over the broker's default 1 MiB payload: the client's own batch (500) binds.
    assert_eq!(pull_batch(1 << 30, 1 << 20), 500);
    // 256 MiB over 8 MiB messages: 32 messages in flight at most, 256 MiB.
    assert_eq!(pull_batch(256 << 20, 8 << 20), 32);
    // A payload past the whole queue still reads one message at a time.
    assert_eq!(pull_batch(1 << 20, 64 << 20), 1);
    assert_eq!(pull_batch(1 << 20, 0), 500);
}

#[test]
fn subjects_are_derived_from_the_address_and_rank() {
    assert_eq!(subject("llmgw.kv", "10.0.0.5:8000", 0), "llmgw.kv.10_0_0_5_8000.0");
    assert_eq!(subject("p", "[fd00::1]:80", 2), "p._fd00__1__80.2");
}

#[test]
fn only_jetstream_engines_have_subjects() {
    let (_hub, ingest) = setup();
    assert_eq!(ingest.engines().collect::<Vec<_>>(), vec![0]);
}

#[test]
fn batches_apply_in_sequence_and_a_restart_or_hole_resets_the_mirror() {
    let (hub, mut ingest) = setup();
    let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
    let mut st = hub.state();
    ingest.on_message(&mut st, &subj, Some("0"), &payload(vec![1, 2]));
    ingest.on_message(&mut st, &subj, Some("1"), &payload(vec![3]));
    assert_eq!(st.engines[0].mirror.len(), 3);
    assert!(st.engines[0].counters.resets.is_empty());
    // A hole: batch 2 never reached the stream. What the mirror held may be wrong: reset.
    ingest.on_message(&mut st, &subj, Some("3"), &payload(vec![4]));
    assert_eq!(st.engines[0].counters.resets.get("gap_unrepaired"), Some(&1));
    assert_eq!(st.engines[0].counters.gaps, 1);
    assert_eq!(st.engines[0].mirror.len(), 1);
    // The sequence going back: the engine restarted, its cache is empty.
    ingest.on_message(&mut st, &subj, Some("0"), &payload(vec![9]));
    assert_eq!(st.engines[0].counters.resets.get("restart"), Some(&1));
    assert_eq!(st.engines[0].mirror.len(), 1);
    let _ = batch(vec![]);
}

#[test]
fn unknown_subjects_and_missing_sequence_headers_are_counted_not_applied() {
    let (hub, mut ingest) = setup();
    let mut st = hub.state();
    ingest.on_message(&mut st, "llmgw.kv.nobody.0", Some("0"), &payload(vec![1]));
    let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
    ingest.on_message(&mut st, &subj, None, &payload(vec![1]));
    ingest.on_message(&mut st, &subj, Some("x"), &payload(vec![1]));
    assert_eq!(st.jetstream.unknown_subject, 1);
    assert_eq!(st.jetstream.bad_header, 2);
    assert_eq!(st.jetstream.messages, 3);
    assert_eq!(st.engines[0].mirror.len(), 0);
    assert_eq!(st.engines[0].counters.skipped.get("bad_seq"), Some(&2));
}

#[test]
fn a_mirror_started_clean_is_rebuilt_by_reading_the_stream_again_for_it_alone() {
    let (hub, mut ingest) = setup();
    ingest.watch(&hub);
    let mut pos = Position::default();
    // Before anything was applied the first read starts at the stream's start anyway.
    hub.state().engines[0].rebuild.store(true, Ordering::SeqCst);
    assert!(!ask_rebuilds(&mut ingest, &mut pos, &hub));
    assert!(pos.catch_up.is_none());
    pos.last = Some(41);
    assert!(!ask_rebuilds(&mut ingest, &mut pos, &hub));
    // The replica came back up (its mirror clean): read again up to 41, for engine 0 only.
    let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
    ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![1]));
    hub.state().set_health(0, Health::Publisher, false, "test");
    hub.state().set_health(0, Health::Publisher, true, "test");
    assert!(ask_rebuilds(&mut ingest, &mut pos, &hub));
    assert_eq!(pos.catch_up, Some((41, HashSet::from([0]))));
    // Its sequence position was forgotten: batch 0 read again applies without a reset.
    ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![1]));
    assert!(!hub.state().engines[0].counters.resets.contains_key("restart"));
    assert_eq!(hub.state().engines[0].mirror.len(), 1);
}

#[test]
fn a_batch_that_reached_the_clean_mirror_before_the_rebuild_is_not_counted_twice() {
    let (hub, mut ingest) = setup();
    ingest.watch(&hub);
    let mut pos = Position { last: Some(0), ..Position::default() };
    let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
    let removal = |hashes: Vec<u64>| {
        let w = WireBatch { ts: 1.0, events: vec![crate::hub::fixtures::removed(hashes)], data_parallel_rank: None };
        encode_batch(&w, Encoding::Tagged, HashForm::Int)
    };
    ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![1]));
    // Down (its blocks leave), up again (a rebuild asked for); batch 1 reaches the clean
    // mirror before the consumer takes the request.
    hub.state().set_health(0, Health::Publisher, false, "test");
    hub.state().set_health(0, Health::Publisher, true, "test");
    ingest.on_message(&mut hub.state(), &subj, Some("1"), &payload(vec![2]));
    pos.last = Some(1);
    assert!(ask_rebuilds(&mut ingest, &mut pos, &hub));
    // The catch-up reads 0 and 1 again; then the engine removes block 2 once.
    ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![1]));
    ingest.on_message(&mut hub.state(), &subj, Some("1"), &payload(vec![2]));
    ingest.on_message(&mut hub.state(), &subj, Some("2"), &removal(vec![2]));
    assert_eq!(hub.state().engines[0].mirror.len(), 1, "block 2 is gone, not held by a second count");
    assert_eq!(hub.state().engines[0].counters.resets.get("rebuild"), Some(&1));
}

#[test]
fn a_catch_up_applies_only_the_rebuilding_engines_messages_until_it_ends() {
    let mut pos = Position { last: Some(10), catch_up: Some((10, HashSet::from([1]))) };
    assert!(!pos.admit(Some(3), Some(0)), "engine 0 has it already");
    assert!(pos.admit(Some(4), Some(1)), "engine 1 is rebuilding");
    assert!(!pos.admit(Some(5), None), "no engine");
    assert!(pos.admit(Some(10), Some(1)));
    assert_eq!(pos.last, Some(10));
    // Past where it ends: every engine again, and the position moves on.
    assert!(pos.admit(Some(11), Some(0)));
    assert_eq!(pos.catch_up, None);
    assert_eq!(pos.last, Some(11));
}

fn loaded(seq: u64, stream_seq: u64, hashes: Vec<u64>) -> Loaded {
    let meta = super::super::snapshot_bucket::ObjectMeta {
        seq,
        incomplete_from: None,
        stream: "LLMGW_KV".to_owned(),
        stream_created_ns: 1,
        stream_seq,
    };
    Loaded { meta, batch: EventBatch::decode(&payload(hashes)).unwrap() }
}

#[test]
fn a_snapshot_join_is_batch_s_and_the_engines_messages_up_to_its_stream_sequence_are_dropped() {
    let (hub, mut ingest) = setup();
    let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
    assert_eq!(ingest.unknown(), vec![(0, subj.clone())]);
    ingest.join_snapshot(&mut hub.state(), 0, loaded(7, 100, vec![1, 2]));
    assert!(ingest.unknown().is_empty());
    {
        let st = hub.state();
        assert_eq!((st.engines[0].mirror.len(), st.engines[0].counters.snapshot_joins), (2, 1));
    }
    // Up to the snapshot's stream sequence: held already. After it: batch 8 follows 7.
    assert!(ingest.covered(Some(0), Some(100)));
    assert!(!ingest.covered(None, Some(100)) && !ingest.covered(Some(0), None));
    assert!(!ingest.covered(Some(0), Some(101)));
    ingest.on_message(&mut hub.state(), &subj, Some("8"), &payload(vec![3]));
    let st = hub.state();
    assert_eq!(st.engines[0].mirror.len(), 3);
    assert!(st.engines[0].counters.resets.is_empty() && st.engines[0].incomplete_from.is_none());
}

#[test]
fn after_a_snapshot_join_a_sequence_going_back_is_an_engine_restart() {
    let (hub, mut ingest) = setup();
    let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
    ingest.join_snapshot(&mut hub.state(), 0, loaded(7, 100, vec![1, 2]));
    assert!(!ingest.covered(Some(0), Some(101)));
    ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![9]));
    let st = hub.state();
    assert_eq!(st.engines[0].counters.resets.get("restart"), Some(&1));
    assert_eq!(st.engines[0].mirror.len(), 1);
}

#[test]
fn the_stream_is_read_from_after_the_earliest_snapshot_and_a_catch_up_never_skips_the_others() {
    let at = |p: consumer::DeliverPolicy| match p {
        consumer::DeliverPolicy::ByStartSequence { start_sequence } => Some(start_sequence),
        _ => None,
    };
    let first = Position::default();
    assert_eq!(at(start_policy(&first, None)), None, "no snapshot: from the start");
    assert_eq!(at(start_policy(&first, Some(40))), Some(41));
    let resumed = Position { last: Some(50), catch_up: None };
    assert_eq!(at(start_policy(&resumed, Some(40))), Some(51), "after what was applied");
    // Rebuilding engine 1 from a snapshot at 60 while the others applied up to 50: from 51.
    let catch_up = Position { last: Some(50), catch_up: Some((50, HashSet::from([1]))) };
    assert_eq!(at(start_policy(&catch_up, Some(60))), Some(51));
    assert_eq!(at(start_policy(&catch_up, Some(30))), Some(31));
    assert_eq!(at(start_policy(&catch_up, None)), None);
}

#[test]
fn a_first_message_past_zero_starts_the_mirror_there() {
    // A stream that no longer retains an engine's first batches (max_messages_per_subject):
    // the mirror starts from the oldest retained one, as after an unfilled replay.
    let (hub, mut ingest) = setup();
    let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
    let mut st = hub.state();
    ingest.on_message(&mut st, &subj, Some("5"), &payload(vec![1, 2]));
    assert_eq!(st.engines[0].mirror.len(), 2);
    assert_eq!(st.engines[0].counters.resets.get("initial_unrepaired"), Some(&1));
    // It says so: blocks stored before batch 5 are unknown.
    assert_eq!(st.engines[0].incomplete_from, Some(5));
    assert_eq!(st.engines[0].counters.incomplete_starts, 1);
}
