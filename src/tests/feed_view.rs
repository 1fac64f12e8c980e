//! The feed and the view requests are served from: reconnects, gaps, staleness, new roots and VMs.

use super::*;

#[test]
fn after_a_reconnect_the_old_index_serves_until_the_new_snapshot_is_complete() {
    let old: Vec<u32> = (0..16).collect();
    let new: Vec<u32> = (100..116).collect();
    let mut e = synced("", vec![], keys(&old), true);
    let applied = e.counter("llmgw_feed_snapshots_applied_total");
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &old));
    assert_eq!(e.dest().as_deref(), Some(B));
    // The stream closes; the next tick past the backoff resubscribes.
    let token = e.stream();
    e.root.on_grpc_stream_close(token, 14);
    assert_eq!(e.counter("llmgw_feed_disconnects_total"), 1);
    e.subscribe();
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true), replica(1, B, true)] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: keys(&new) }),
    ]);
    // Mid-resync: requests still see the old blocks, not the half-received new ones.
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &old));
    assert_eq!(e.dest().as_deref(), Some(B));
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &new));
    assert_eq!(e.host.samples("llmgw_matched_blocks").last(), Some(&0));
    assert_eq!(e.counter("llmgw_feed_snapshots_applied_total"), applied, "not before the snapshot is complete");
    e.feed(vec![Msg::SnapshotComplete(SnapshotComplete {})]);
    assert_eq!(e.counter("llmgw_feed_snapshots_applied_total"), applied + 1);
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &new));
    assert_eq!(e.dest().as_deref(), Some(A));
    assert_eq!(e.host.samples("llmgw_matched_blocks").last(), Some(&4));
    assert_eq!(e.counter("llmgw_feed_connects_total"), 2);
}

#[test]
fn a_feed_gap_resubscribes_and_keeps_serving() {
    let tokens: Vec<u32> = (0..16).collect();
    let mut e = synced("", vec![], keys(&tokens), true);
    let first = e.stream();
    e.seq += 5;
    e.feed(vec![Msg::Heartbeat(llmgw_core::feed::Heartbeat {})]);
    assert_eq!(e.counter("llmgw_feed_rejected_total"), 1);
    assert_eq!(e.host.cancelled.borrow().as_slice(), &[first]);
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    assert!(e.subscribe() != first);
}

#[test]
fn a_configuration_error_is_refused_and_a_new_one_replaces_the_old_whole() {
    let host = Rc::new(FakeHost::new().with_config(r#"{"profiles":[{"name":"a","models":["m"],"block_size":0}]}"#));
    let mut root = Root::new(host.clone());
    assert!(!root.on_configure(0));
    host.set_buffer(Buffer::PluginConfiguration, config("").as_bytes());
    assert!(root.on_configure(0));
    assert!(host.tick.get().is_some());
    // Reconfigured with another destination header: requests use it at once.
    host.set_buffer(Buffer::PluginConfiguration, config(r#""destination_header":"x-to","#).as_bytes());
    assert!(root.on_configure(0));
    let mut e = Env { host, root, seq: 0 };
    e.subscribe();
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true)] }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    let (_c, _) = e.request(COMPLETIONS, b"");
    assert_eq!(e.host.request_header("x-to").as_deref(), Some(A));
}

#[test]
fn while_the_agent_is_away_loads_then_the_index_go_stale_and_come_back_with_it() {
    use llmgw_core::feed::{LoadReport, ReplicaLoad};
    let tokens: Vec<u32> = (0..32).collect();
    // B holds the prompt but reports a long queue; A is idle.
    let mut e = synced("", vec![], keys(&tokens), true);
    let load = |replica, waiting| ReplicaLoad { replica, running: 0, waiting, kv_cache_usage: 0.0, gpu_blocks: 0 };
    e.feed(vec![Msg::Load(LoadReport { loads: vec![load(0, 0), load(1, 40)] })]);
    let t0 = e.host.now_ns.get();
    let at = |e: &mut Env, ms: u64| {
        e.host.now_ns.set(t0 + ms * 1_000_000);
        e.root.on_tick();
    };
    let go = |e: &Env| {
        let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
        ctx.on_log();
        e.dest()
    };
    at(&mut e, 100);
    assert_eq!(go(&e).as_deref(), Some(A), "B's reported queue outweighs its hit");
    // The agent falls silent. After loads_stale_ms (5 s) B's old queue no longer counts.
    at(&mut e, 5_100);
    assert_eq!(go(&e).as_deref(), Some(B));
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 1);
    // After index_stale_ms (60 s) the index is not credited: the fallback routes, named.
    at(&mut e, 60_100);
    let _ = go(&e);
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.stale"), 1);
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 1);
    // The agent is back: a new stream, its table and snapshot.
    e.subscribe();
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true), replica(1, B, true)] }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: keys(&tokens) }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    e.root.on_tick();
    assert_eq!(go(&e).as_deref(), Some(B));
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 2);
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.stale"), 1);
}

#[test]
fn a_vm_resubscribes_within_the_backoff_cap_however_long_the_agent_was_away() {
    let mut e = synced("", vec![], vec![], true);
    // The agent is gone: every attempt's stream closes at once, for a long outage.
    for _ in 0..20 {
        let token = e.stream();
        e.root.on_grpc_stream_close(token, 14);
        e.subscribe();
    }
    // It is back: the next attempt comes within half a second of the last failure (so the
    // fault suite's target, every VM's index equal to the agent's within 1 s, holds).
    let token = e.stream();
    e.root.on_grpc_stream_close(token, 14);
    let before = e.host.streams.borrow().len();
    e.host.now_ns.set(e.host.now_ns.get() + 500_000_001);
    e.root.on_tick();
    assert_eq!(e.host.streams.borrow().len(), before + 1, "no attempt within 500 ms of the last failure");
}

#[test]
fn a_new_root_context_routes_from_its_first_request_with_the_view_of_another_in_its_vm() {
    // A VM already subscribed (root context 1); a listener change brings root context 2 with
    // another filter configuration, whose own feed has not delivered anything yet.
    let held: Vec<u32> = (0..16).collect();
    let first = synced("", vec![], keys(&held), true);
    let host = first.host.clone();
    host.set_buffer(Buffer::PluginConfiguration, config(r#""tokenizer_cache_ttl_ms":1234,"#).as_bytes());
    let mut second = Root::new(host.clone());
    assert!(second.on_configure(0));
    let e = Env { host, root: second, seq: 0 };
    let (_ctx, action) = e.request(COMPLETIONS, &tokens_body("m", &held));
    assert_eq!(action, Action::Continue);
    assert!(e.host.replies.borrow().is_empty(), "answered instead of routed");
    assert_eq!(e.dest().as_deref(), Some(B), "routed to the replica holding the prefix");
    drop(first);
}

#[test]
fn a_vm_reloaded_after_a_crash_routes_by_load_from_the_replica_table_kept_in_shared_data() {
    // A VM that received the feed's table crashes (all its root contexts are gone); Envoy
    // starts a new VM on the same host, whose feed has delivered nothing yet.
    let first = synced("", vec![], vec![], true);
    let host = first.host.clone();
    drop(first);
    let mut root = Root::new(host.clone());
    assert!(root.on_configure(0));
    let e = Env { host, root, seq: 0 };
    let (_ctx, action) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#);
    assert_eq!(action, Action::Continue);
    assert!(e.host.replies.borrow().is_empty(), "answered instead of routed");
    assert!(e.dest().is_some_and(|d| d == A || d == B), "routed to a replica of the kept table");
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.not_synced"), 1);
}

#[test]
fn a_new_root_context_fed_by_another_agent_starts_from_nothing_of_this_ones() {
    let held: Vec<u32> = (0..16).collect();
    let first = synced("", vec![], keys(&held), true);
    let host = first.host.clone();
    host.set_buffer(Buffer::PluginConfiguration, config(r#""agent_cluster":"other_fleet","#).as_bytes());
    // Neither the view of a live root context of another fleet…
    let mut second = Root::new(host.clone());
    assert!(second.on_configure(0));
    let e = Env { host: host.clone(), root: second, seq: 0 };
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &held));
    assert_eq!(e.host.replies.borrow().last().map(|r| r.status), Some(503), "routed from another fleet's view");
    drop(first);
    // …nor its table kept in shared data.
    let mut third = Root::new(host.clone());
    assert!(third.on_configure(0));
    let e = Env { host, root: third, seq: 0 };
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &held));
    assert_eq!(e.host.replies.borrow().len(), 2, "routed from another fleet's table");
}

#[test]
fn a_view_a_new_vm_or_root_starts_from_is_held_to_its_own_allowlist() {
    let held: Vec<u32> = (0..16).collect();
    // B holds the prompt; the new configuration allows only A's port.
    let first = synced("", vec![], keys(&held), true);
    let host = first.host.clone();
    host.set_buffer(Buffer::PluginConfiguration, config(r#""allowed_destinations":["127.0.0.1:8001"],"#).as_bytes());
    let mut second = Root::new(host.clone());
    assert!(second.on_configure(0));
    let e = Env { host: host.clone(), root: second, seq: 0 };
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &held));
    assert_eq!(e.dest().as_deref(), Some(A), "the other root's view, with its allowlist");
    drop(e);
    drop(first);
    // From the table kept in shared data (a VM reloaded after a crash).
    let mut third = Root::new(host.clone());
    assert!(third.on_configure(0));
    let e = Env { host, root: third, seq: 0 };
    for _ in 0..4 {
        let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &held));
        assert_eq!(e.dest().as_deref(), Some(A), "the kept table, unchecked");
        ctx.on_log();
    }
}
