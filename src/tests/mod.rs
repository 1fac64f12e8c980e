//! The filter's glue, natively: the root and HTTP contexts driven through a fake host.
#![allow(clippy::arithmetic_side_effects)]

use crate::fake::FakeHost;
use crate::host::{Buffer, Headers, Host};
use crate::http::Request;
use crate::Root;
use llmgw_core::feed::{
    Body as Msg, FeedMessage, Replica, ReplicaReset, ReplicaTable, SnapshotChunk, SnapshotComplete,
};
use llmgw_core::hash::{BlockHasher, HashAlgo, RequestExtras};
use prost::Message;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::Action;
use std::rc::Rc;

const A: &str = "127.0.0.1:8001";
const B: &str = "127.0.0.1:8002";
const DEST: &str = "x-gateway-destination-endpoint";
const BS: usize = 4;
const COMPLETIONS: &str = "/v1/completions";

fn config(extra: &str) -> String {
    format!(
        r#"{{{extra}"explain_header":true,"profiles":[
            {{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}},
            {{"name":"off","models":["plain"]}}]}}"#
    )
}

fn keys(tokens: &[u32]) -> Vec<u64> {
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    h.hash_request(tokens, BS, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect()
}

fn replica(id: u32, address: &str, up: bool) -> Replica {
    Replica {
        id,
        name: format!("r{id}"),
        address: address.into(),
        models: vec![],
        up,
        dp_rank: 0,
        hash: None,
        dp_size: 0,
        kv_groups: vec![],
        lora_adapters: vec![],
        mirror_incomplete: false,
    }
}

struct Env {
    host: Rc<FakeHost>,
    root: Root,
    seq: u64,
}

fn env(config: &str) -> Env {
    let host = Rc::new(FakeHost::new().with_config(config));
    let mut root = Root::new(host.clone());
    assert!(root.on_configure(0), "configuration refused");
    Env { host, root, seq: 0 }
}

/// A configured VM whose feed knows A and B, with `on_a` and `on_b` held.
fn synced(extra: &str, on_a: Vec<u64>, on_b: Vec<u64>, up: bool) -> Env {
    synced_with(&config(extra), on_a, on_b, up)
}

/// As [`synced`], with this configuration.
fn synced_with(config: &str, on_a: Vec<u64>, on_b: Vec<u64>, up: bool) -> Env {
    let mut e = env(config);
    e.subscribe();
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, up), replica(1, B, up)] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: on_a }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: on_b }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    e
}

impl Env {
    /// Opens a feed stream (the first tick, or the tick after the backoff).
    fn subscribe(&mut self) -> u32 {
        let before = self.host.streams.borrow().len();
        self.host.now_ns.set(self.host.now_ns.get() + 10_000_000_000);
        self.root.on_tick();
        let streams = self.host.streams.borrow();
        assert_eq!(streams.len(), before + 1, "no stream opened");
        self.seq = 0;
        streams.last().unwrap().0
    }

    fn stream(&self) -> u32 {
        self.host.streams.borrow().last().unwrap().0
    }

    fn feed(&mut self, bodies: Vec<Msg>) {
        let token = self.stream();
        for body in bodies {
            let bytes = FeedMessage { seq: self.seq, body: Some(body) }.encode_to_vec();
            self.seq += 1;
            self.host.set_buffer(Buffer::GrpcReceive, &bytes);
            self.root.on_grpc_stream_message(token, bytes.len());
        }
    }

    /// Sends a request's headers (with a client-chosen destination) and body; returns the
    /// context and the last action.
    fn request(&self, path: &str, body: &[u8]) -> (Request, Action) {
        self.request_with(path, body, &[])
    }

    /// As [`Self::request`], with more client headers.
    fn request_with(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> (Request, Action) {
        self.host.next_request();
        for (k, v) in headers {
            self.host.set_header(Headers::Request, k, Some(v));
        }
        self.host.set_header(Headers::Request, ":path", Some(path));
        self.host.set_header(Headers::Request, DEST, Some("169.254.169.254:80"));
        self.host.set_buffer(Buffer::Request, body);
        let mut ctx = self.root.request();
        let mut action = ctx.on_http_request_headers(3, body.is_empty());
        if !body.is_empty() && action == Action::Pause {
            action = ctx.on_http_request_body(body.len(), true);
        }
        (ctx, action)
    }

    /// Answers the last tokenizer call.
    fn answer(&self, ctx: &mut Request, status: Option<&str>, body: &[u8]) {
        let call = self.host.last_call().expect("a tokenizer call");
        if let Some(s) = status {
            self.host.set_header(Headers::CallResponse, ":status", Some(s));
        }
        self.host.set_buffer(Buffer::CallResponse, body);
        ctx.on_http_call_response(call.token, usize::from(status.is_some()), body.len(), 0);
    }

    fn dest(&self) -> Option<String> {
        self.host.request_header(DEST)
    }

    fn counter(&self, name: &str) -> i64 {
        self.host.counter(name).unwrap_or_else(|| panic!("metric {name} not defined"))
    }
}

fn tokens_body(model: &str, tokens: &[u32]) -> Vec<u8> {
    format!(r#"{{"model":"{model}","prompt":{tokens:?}}}"#).into_bytes()
}

fn tokenize_answer(tokens: &[u32]) -> Vec<u8> {
    format!(r#"{{"count":{},"max_model_len":4096,"tokens":{tokens:?}}}"#, tokens.len()).into_bytes()
}

/// A second worker VM of `e`'s Envoy (same host, so the same shared data), fed the same
/// replicas with `on_a` and `on_b` held.
fn second_vm(e: &Env, on_a: Vec<u64>, on_b: Vec<u64>) -> Env {
    let mut e2 = Env { host: e.host.clone(), root: Root::new(e.host.clone()), seq: 0 };
    assert!(e2.root.on_configure(0));
    e2.subscribe();
    e2.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true), replica(1, B, true)] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: on_a }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: on_b }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    e2
}

/// In-flight requests and prefill tokens as every VM of this Envoy reads them.
fn inflight_at(e: &Env, address: &str) -> (u32, u64) {
    use llmgw_core::flow::InFlightCounts;
    let host: Rc<dyn Host> = e.host.clone();
    let s = crate::gateway_state::Snapshot::read(&host);
    (s.in_flight(address), s.pending_tokens(address))
}

fn hash_settings(seed: &str) -> llmgw_core::feed::HashSettings {
    llmgw_core::feed::HashSettings {
        algo: "sha256_cbor".into(),
        seeded: true,
        seed: seed.into(),
        block_size: BS as u32,
        lookahead_tokens: 0,
    }
}
mod earlier_turns;
mod feed_view;
mod routing;
mod shared_prefix;
mod shared_state;
