//! Engines whose mirror the agent marks incomplete: named in the explain header, counted.

use super::{body, keys, replica, routed, router, A, B, COMPLETIONS};
use crate::feed::{Body as Msg, FeedMessage, Replica, ReplicaTable};
use crate::flow::Router;
use crate::policy::Outcome;

#[test]
fn the_explain_header_names_incomplete_engines_and_the_report_counts_them() {
    let tokens: Vec<u32> = (0..32).collect();
    let mut r = router(r#""explain_header":true,"#, keys(&tokens), true);
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let table = |r: &mut Router, seq: u64, incomplete: [bool; 2]| {
        let replicas = [A, B]
            .iter()
            .zip(incomplete)
            .enumerate()
            .map(|(id, (a, inc))| Replica { mirror_incomplete: inc, ..replica(id as u32, a, true) })
            .collect();
        r.feed.apply(&FeedMessage { seq, body: Some(Msg::Replicas(ReplicaTable { replicas })) }).unwrap();
    };
    table(&mut r, 3, [true, false]);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    // B's hit is real: it still wins; A is named.
    assert_eq!((got.address.as_str(), got.report.outcome, got.report.saw_incomplete), (B, Some(Outcome::Exact), true));
    assert!(got
        .explain("vm1")
        .starts_with(&format!("outcome=exact; replica={B}; matched=8/8; incomplete={A}; vm=vm1")));
    table(&mut r, 4, [true, true]);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert!(got.explain("vm1").contains(&format!("; incomplete={A},{B}; ")), "{}", got.explain("vm1"));
    // Complete again: nothing said, nothing counted.
    table(&mut r, 5, [false, false]);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert!(!got.report.saw_incomplete);
    assert!(!got.explain("vm1").contains("incomplete"), "{}", got.explain("vm1"));
}
