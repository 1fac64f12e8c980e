//! Many vLLM-like KV-event publishers in one process (not a test; `bench/scale.py` drives it):
//! `--count` XPUB sockets, each bound on 127.0.0.1 (vLLM binds `tcp://*:PORT`; the agent
//! connects), sending vLLM's live frames `[topic, seq u64 BE, msgpack KVEventBatch]` at a paced
//! rate per publisher.
//!
//! Each batch is what one engine step of a busy replica publishes: `--chains` BlockStored events
//! of `--chain-blocks` blocks each (token ids included, parent unknown = chains from block 0, so
//! the agent re-hashes every block for parity; the hashes are vLLM's `sha256_cbor` with
//! PYTHONHASHSEED=0), and one BlockRemoved evicting the blocks stored `--lag` batches earlier.
//! Payloads come from a ring of `--ring` batches shared by every publisher.
//!
//! With `--nats URL` the batches go to a NATS JetStream stream instead (as `llmgw-agent publish`
//! beside each replica would put them): publisher `i` is the replica at `127.0.{i/256}.{i%256}:8000`,
//! on that address's subject, with its sequence number in the `Llmgw-Seq` header; the stream
//! (the agent's defaults, `--per-subject` batches kept per replica, in the broker's memory with
//! `--memory`) is created first.
//!
//! `--endpoints FILE` receives one endpoint per line once every socket is bound; the sender waits
//! until every socket has a subscriber, then runs `--phases rate:secs,...` (batches per second per
//! publisher; 0 seconds = until `FILE.advance` exists), printing one JSON line when a phase starts
//! and one when it ends.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    clippy::print_stdout
)]

use llmgw_core::hash::{BlockHasher, HashAlgo, RequestExtras};
use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent};
use std::io::Write;
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, d: &str| {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| d.to_owned())
    };
    let count: usize = arg("--count", "256").parse().unwrap();
    let chains: usize = arg("--chains", "2").parse().unwrap();
    let chain_blocks: usize = arg("--chain-blocks", "6").parse().unwrap();
    let ring: usize = arg("--ring", "1024").parse().unwrap();
    let lag: usize = arg("--lag", "512").parse().unwrap();
    let endpoints_file = arg("--endpoints", "endpoints.txt");
    // A phase of 0 seconds lasts until this file appears (the driver then deletes it).
    let advance = format!("{endpoints_file}.advance");
    let phases: Vec<(f64, f64)> = arg("--phases", "100:10")
        .split(',')
        .map(|p| {
            let (r, s) = p.split_once(':').unwrap();
            (r.parse().unwrap(), s.parse().unwrap())
        })
        .collect();

    // The payload ring.
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let per = chains * chain_blocks;
    let mut stored: Vec<Vec<u64>> = Vec::with_capacity(ring);
    let mut events: Vec<Vec<WireEvent>> = Vec::with_capacity(ring);
    for b in 0..ring {
        let mut ev = Vec::new();
        let mut keys = Vec::new();
        for c in 0..chains {
            let first = ((b * chains + c) * chain_blocks * 16) as u32;
            let tokens: Vec<u32> = (0..(chain_blocks * 16) as u32).map(|i| (first + i) % 128_000 + 1).collect();
            let hs: Vec<u64> =
                h.hash_request(&tokens, 16, &RequestExtras::default()).unwrap().iter().map(|x| x.key.0).collect();
            keys.extend_from_slice(&hs);
            ev.push(WireEvent::BlockStored(WireBlockStored {
                block_hashes: hs,
                parent_block_hash: None,
                token_ids: tokens,
                block_size: 16,
                medium: Some("GPU".into()),
                ..Default::default()
            }));
        }
        stored.push(keys);
        events.push(ev);
    }
    let payloads: Vec<Vec<u8>> = (0..ring)
        .map(|b| {
            let mut ev = events[b].clone();
            ev.push(WireEvent::BlockRemoved(WireBlockRemoved {
                block_hashes: stored[(b + ring - lag % ring) % ring].clone(),
                medium: Some("GPU".into()),
                ..Default::default()
            }));
            encode_batch(
                &WireBatch { ts: 1.0, events: ev, data_parallel_rank: Some(0) },
                Encoding::Tagged,
                HashForm::Int,
            )
        })
        .collect();
    let payload_bytes = payloads.iter().map(Vec::len).sum::<usize>() as f64 / ring as f64;

    if let Some(url) = args.iter().position(|a| a == "--nats").and_then(|i| args.get(i + 1)) {
        let per_subject: i64 = arg("--per-subject", "1000").parse().unwrap();
        let memory = args.iter().any(|a| a == "--memory");
        return nats(
            url,
            per_subject,
            memory,
            count,
            &endpoints_file,
            &advance,
            &phases,
            payloads,
            payload_bytes,
            2 * per,
        );
    }
    // At most 1,023 sockets per libzmq context: one context per 500 publishers.
    let ctxs: Vec<zmq::Context> = (0..count.div_ceil(500)).map(|_| zmq::Context::new()).collect();
    let mut socks = Vec::with_capacity(count);
    let mut eps = Vec::with_capacity(count);
    for i in 0..count {
        let s = ctxs[i / 500].socket(zmq::XPUB).unwrap();
        s.set_sndhwm(100_000).unwrap();
        s.set_linger(0).unwrap();
        s.bind("tcp://127.0.0.1:*").unwrap();
        eps.push(s.get_last_endpoint().unwrap().unwrap());
        socks.push(s);
    }
    std::fs::write(&endpoints_file, eps.join("\n") + "\n").unwrap();
    eprintln!("{count} publishers bound; waiting for subscribers");
    let t0 = Instant::now();
    let mut subscribed = vec![false; count];
    while subscribed.iter().any(|s| !s) {
        for (i, s) in socks.iter().enumerate() {
            if !subscribed[i] && s.recv_bytes(zmq::DONTWAIT).is_ok() {
                subscribed[i] = true;
            }
        }
        if t0.elapsed() > Duration::from_secs(120) {
            panic!("only {} of {count} publishers got a subscriber", subscribed.iter().filter(|s| **s).count());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "{{\"event\":\"subscribed\",\"count\":{count},\"secs\":{:.2},\"payload_bytes\":{payload_bytes:.0},\"blocks_per_batch\":{}}}",
        t0.elapsed().as_secs_f64(),
        2 * per
    );
    std::io::stdout().flush().unwrap();

    let topic: &[u8] = b"";
    let mut seq = vec![0u64; count];
    let mut next = 0usize;
    run_phases(count, &advance, &phases, 2 * per as u64, |t, due| {
        while t.sent < due {
            let s = &socks[next];
            let q = seq[next];
            let p = &payloads[(q as usize) % ring];
            match s.send_multipart([topic, &q.to_be_bytes()[..], p.as_slice()], zmq::DONTWAIT) {
                Ok(()) => t.bytes += p.len() as u64,
                Err(_) => t.dropped += 1,
            }
            seq[next] = q + 1;
            next = (next + 1) % count;
            t.sent += 1;
        }
    });
}

/// One phase's counts.
#[derive(Default)]
struct Tally {
    sent: u64,
    bytes: u64,
    dropped: u64,
}

/// Runs the phases (rate per publisher, seconds; 0 s: until the `advance` file exists), each
/// step calling `send` to publish until `sent` reaches the batches due so far, and prints each
/// phase's start and end.
fn run_phases(
    count: usize,
    advance: &str,
    phases: &[(f64, f64)],
    blocks_per_batch: u64,
    mut send: impl FnMut(&mut Tally, u64),
) {
    for (pi, &(rate, secs)) in phases.iter().enumerate() {
        println!("{{\"event\":\"phase_start\",\"phase\":{pi},\"rate\":{rate},\"secs\":{secs}}}");
        std::io::stdout().flush().unwrap();
        let start = Instant::now();
        let mut t = Tally::default();
        loop {
            let e = start.elapsed().as_secs_f64();
            if (secs > 0.0 && e >= secs) || (secs <= 0.0 && std::path::Path::new(advance).exists()) {
                break;
            }
            send(&mut t, (rate * count as f64 * e) as u64);
            std::thread::sleep(Duration::from_micros(500));
        }
        let e = start.elapsed().as_secs_f64();
        let Tally { sent, bytes, dropped } = t;
        println!(
            "{{\"event\":\"phase_end\",\"phase\":{pi},\"rate\":{rate},\"secs\":{e:.3},\"batches\":{sent},\"block_events\":{},\"bytes\":{bytes},\"dropped\":{dropped},\"achieved_rate\":{:.1}}}",
            sent * blocks_per_batch,
            sent as f64 / e / count as f64
        );
        std::io::stdout().flush().unwrap();
    }
}

/// The same phases, each batch published to the replica's JetStream subject (core NATS publish:
/// the stream stores it; no acknowledgement is awaited, as a paced load generator).
#[allow(clippy::too_many_arguments)]
fn nats(
    url: &str,
    per_subject: i64,
    memory: bool,
    count: usize,
    endpoints_file: &str,
    advance: &str,
    phases: &[(f64, f64)],
    payloads: Vec<Vec<u8>>,
    payload_bytes: f64,
    blocks_per_batch: usize,
) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let _in_runtime = rt.enter();
    let js: llmgw_agent::config::JetStreamConfig = toml::from_str(&format!(
        "url = \"{url}\"\nmax_messages_per_subject = {per_subject}\nmemory_storage = {memory}"
    ))
    .unwrap();
    let client = rt.block_on(async_nats::connect(url)).unwrap();
    let ctx = async_nats::jetstream::new(client.clone());
    rt.block_on(ctx.get_or_create_stream(llmgw_agent::jetstream::stream_config(&js))).unwrap();
    let subjects: Vec<String> = (0..count)
        .map(|i| llmgw_agent::jetstream::subject(&js.subject_prefix, &format!("127.0.{}.{}:8000", i >> 8, i & 255), 0))
        .collect();
    std::fs::write(endpoints_file, subjects.join("\n") + "\n").unwrap();
    let payloads: Vec<bytes::Bytes> = payloads.into_iter().map(bytes::Bytes::from).collect();
    let ring = payloads.len();
    println!(
        "{{\"event\":\"subscribed\",\"count\":{count},\"secs\":0,\"payload_bytes\":{payload_bytes:.0},\"blocks_per_batch\":{blocks_per_batch}}}"
    );
    std::io::stdout().flush().unwrap();
    let mut seq = vec![0u64; count];
    let mut next = 0usize;
    run_phases(count, advance, phases, blocks_per_batch as u64, |t, due| {
        rt.block_on(async {
            while t.sent < due {
                let q = seq[next];
                let p = payloads[(q as usize) % ring].clone();
                let len = p.len() as u64;
                let mut h = async_nats::HeaderMap::new();
                h.insert(llmgw_agent::jetstream::SEQ_HEADER, q.to_string().as_str());
                match client.publish_with_headers(subjects[next].clone(), h, p).await {
                    Ok(()) => t.bytes += len,
                    Err(_) => t.dropped += 1,
                }
                seq[next] = q + 1;
                next = (next + 1) % count;
                t.sent += 1;
            }
            let _ = client.flush().await;
        });
    });
}
