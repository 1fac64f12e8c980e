"""NetworkPolicy semantics for the manifest tests: whether the policies of a namespace let a pod
reach another on a port (ingress rules only, matchLabels selectors, as the shipped policies use)."""

from __future__ import annotations


def selected(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admitted(policies: list[dict], pod_labels: dict, namespace: str, labels: dict, port: int) -> bool:
    """Whether NetworkPolicies `policies` (of the replicas' namespace) let a pod (namespace,
    labels) reach a replica pod (pod_labels) on `port`; a pod no policy selects is open."""
    mine = [p for p in policies if selected(p["spec"]["podSelector"], pod_labels)]
    if not mine:
        return True
    for pol in mine:
        home = pol["metadata"]["namespace"]
        for rule in pol["spec"].get("ingress", []):
            # A rule without ports admits every port; one without peers, every pod.
            if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
                continue
            if not rule.get("from"):
                return True
            for peer in rule["from"]:
                ns_ok = (selected(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
                         if "namespaceSelector" in peer else namespace == home)
                if ns_ok and selected(peer.get("podSelector", {}), labels):
                    return True
    return False
