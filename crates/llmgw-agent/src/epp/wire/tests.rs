use super::*;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::ListValue;

fn meta(ns: &str, key: &str, v: Value) -> Option<Metadata> {
    let mut inner = Struct::default();
    inner.fields.insert(key.to_owned(), v);
    let mut m = Metadata::default();
    m.filter_metadata.insert(ns.to_owned(), inner);
    Some(m)
}

fn list(items: &[&str]) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue {
            values: items.iter().map(|s| string_value((*s).to_owned())).collect(),
        })),
    }
}

#[test]
fn the_subset_hint_is_read_as_a_list_absent_or_empty() {
    let mut req = ProcessingRequest::default();
    assert_eq!(subset_hint(&req), (None, 0), "no hint: the whole pool");
    req.metadata_context = meta(SUBSET_NAMESPACE, SUBSET_KEY, list(&["10.0.0.1:8000", "10.0.0.2:8000"]));
    assert_eq!(subset_hint(&req), (Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()]), 0));
    req.metadata_context = meta(SUBSET_NAMESPACE, SUBSET_KEY, list(&[]));
    assert_eq!(subset_hint(&req), (Some(vec![]), 0), "an empty list: nothing is eligible");
    req.metadata_context = meta(SUBSET_NAMESPACE, SUBSET_KEY, string_value("10.0.0.1:8000, 10.0.0.3:8000".into()));
    assert_eq!(subset_hint(&req).0.map(|v| v.len()), Some(2));
    req.metadata_context = meta("other", SUBSET_KEY, list(&["10.0.0.1:8000"]));
    assert_eq!(subset_hint(&req), (None, 0), "another namespace is not the hint");
}

#[test]
fn a_subset_hint_past_the_limit_is_cut_and_counted() {
    let many: Vec<String> = (0..MAX_SUBSET + 5).map(|i| format!("10.0.{}.{}:8000", i / 256, i % 256)).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    let req =
        ProcessingRequest { metadata_context: meta(SUBSET_NAMESPACE, SUBSET_KEY, list(&refs)), ..Default::default() };
    let (got, dropped) = subset_hint(&req);
    assert_eq!(got.map(|v| v.len()), Some(MAX_SUBSET));
    assert_eq!(dropped, 5);
}

#[test]
fn the_served_endpoint_is_read_from_envoy_lb() {
    let mut req = ProcessingRequest::default();
    assert_eq!(served_endpoint(&req), None);
    req.metadata_context = meta(LB_NAMESPACE, SERVED_KEY, string_value("10.0.0.2:8000".into()));
    assert_eq!(served_endpoint(&req).as_deref(), Some("10.0.0.2:8000"));
}

#[test]
fn a_route_sets_the_header_and_the_metadata_to_the_same_ordered_list() {
    let dest = Destination { endpoints: vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()], dp_rank: None };
    let r = route_headers(&dest);
    let md = r.dynamic_metadata.expect("metadata");
    let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else { panic!("envoy.lb is a struct") };
    let Some(Kind::StringValue(v)) = &lb.fields[DESTINATION_HEADER].kind else { panic!("a string") };
    assert_eq!(v, "10.0.0.1:8000,10.0.0.2:8000");
    let Some(processing_response::Response::RequestHeaders(h)) = r.response else { panic!("a headers answer") };
    let common = h.response.expect("common");
    assert!(common.clear_route_cache);
    let m = common.header_mutation.expect("mutation");
    let dst = m.set_headers.iter().find(|o| o.header.as_ref().unwrap().key == DESTINATION_HEADER).unwrap();
    assert_eq!(dst.header.as_ref().unwrap().raw_value, v.as_bytes(), "the header equals the metadata");
    assert_eq!(dst.append_action, HeaderAppendAction::OverwriteIfExistsOrAdd as i32, "a client's value is replaced");
    assert_eq!(m.remove_headers, vec![DP_RANK_HEADER.to_owned()]);
}

#[test]
fn immediate_answers_carry_their_status() {
    let r = immediate(503, b"{}".to_vec(), "none");
    let Some(processing_response::Response::ImmediateResponse(i)) = r.response else { panic!() };
    assert_eq!(i.status.unwrap().code, 503);
}
