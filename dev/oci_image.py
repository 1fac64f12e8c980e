#!/usr/bin/env python3
"""Write an OCI image archive (an `oci-archive:` tar of an OCI image layout) from files, without
a container daemon, reproducibly: the same inputs give the same bytes, so the same digests.

    oci_image.py --out dist/images/llmgw-agent.oci.tar --ref 0.1.0 \
        --file llmgw-agent=target/.../llmgw-agent:0755 --entrypoint /llmgw-agent --user 65532:65532

One layer (gzip'd tar) holding the given files, owned by 0:0, every timestamp 0 (or
SOURCE_DATE_EPOCH), entries sorted; the config has no `created` date and no history; the archive
itself is a tar with the same rules. Only the standard library is used.

`--wasm-compat` writes the filter's image in the Wasm image specification's "compat" variant,
which Istio's WasmPlugin and Envoy Gateway's Wasm image code source both pull: exactly one
standard `tar+gzip` layer holding `plugin.wasm` at its root, and the manifest annotation
`module.wasm.image/variant: compat`.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def canonical(obj):
    """JSON with sorted keys and no whitespace: one byte string per value."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_bytes(entries, mtime):
    """A tar (PAX) of entries [(name, bytes, mode)], sorted by name, parent directories
    included, owned by 0:0 with no user or group names, every mtime `mtime`."""
    dirs = set()
    for name, _, _ in entries:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    items = [(d, None, 0o755) for d in dirs] + list(entries)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in sorted(items, key=lambda e: e[0]):
            info = tarfile.TarInfo(name)
            info.mtime = mtime
            info.mode = mode
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gzip_bytes(data):
    """gzip with no file name and mtime 0 in its header (the output depends on the input only)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        gz.write(data)
    return buf.getvalue()


def parse_file(spec):
    """PATH_IN_IMAGE=SOURCE[:MODE] (mode in octal, default 0644)."""
    dest, sep, rest = spec.partition("=")
    if not sep or not dest or not rest:
        raise SystemExit(f"--file {spec!r}: expected PATH_IN_IMAGE=SOURCE[:MODE]")
    source, mode = rest, "644"
    head, sep, tail = rest.rpartition(":")
    if sep and head and tail and all(c in "01234567" for c in tail):
        source, mode = head, tail
    mode_bits = int(mode, 8)
    with open(source, "rb") as f:
        return dest.strip("/"), f.read(), mode_bits


def build(args):
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    files = [parse_file(s) for s in args.file]
    if args.wasm_compat and [f[0] for f in files] != ["plugin.wasm"]:
        raise SystemExit("--wasm-compat: the layer holds exactly one file, plugin.wasm")
    layer_tar = tar_bytes(files, mtime)
    layer = gzip_bytes(layer_tar)
    labels = dict(kv.split("=", 1) for kv in args.label)
    image_config = {"Labels": labels} if labels else {}
    if args.entrypoint:
        image_config["Entrypoint"] = [args.entrypoint]
    if args.user:
        image_config["User"] = args.user
    if args.env:
        image_config["Env"] = list(args.env)
    config = canonical(
        {
            "architecture": args.arch,
            "os": args.os,
            "config": image_config,
            "rootfs": {"type": "layers", "diff_ids": [sha256(layer_tar)]},
        }
    )
    manifest_obj = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": sha256(config), "size": len(config)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": sha256(layer), "size": len(layer)}],
    }
    annotations = dict(kv.split("=", 1) for kv in args.annotation)
    if args.wasm_compat:
        annotations["module.wasm.image/variant"] = "compat"
    if annotations:
        manifest_obj["annotations"] = annotations
    manifest = canonical(manifest_obj)
    index = canonical(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": sha256(manifest),
                    "size": len(manifest),
                    "annotations": {"org.opencontainers.image.ref.name": args.ref},
                }
            ],
        }
    )
    blobs = {sha256(b): b for b in (layer, config, manifest)}
    entries = [("oci-layout", canonical({"imageLayoutVersion": "1.0.0"}), 0o644), ("index.json", index, 0o644)]
    entries += [("blobs/sha256/" + d.split(":", 1)[1], b, 0o644) for d, b in blobs.items()]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(tar_bytes(entries, mtime))
    os.replace(tmp, args.out)
    print(f"{args.out}: manifest {sha256(manifest)}, layer {sha256(layer)} ({len(layer)} bytes)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the archive to write (oci-archive: tar of an OCI layout)")
    p.add_argument("--ref", required=True, help="the tag the layout's index names (org.opencontainers.image.ref.name)")
    p.add_argument("--file", action="append", default=[], help="PATH_IN_IMAGE=SOURCE[:MODE], repeated")
    p.add_argument("--entrypoint", help="the image's entrypoint (one path)")
    p.add_argument("--user", help="USER[:GROUP] the image runs as")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE in the image's environment")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE in the image config's labels")
    p.add_argument("--annotation", action="append", default=[], help="KEY=VALUE in the manifest's annotations")
    p.add_argument("--arch", default="amd64")
    p.add_argument("--os", default="linux")
    p.add_argument("--wasm-compat", action="store_true", help="the Wasm image spec's compat variant (plugin.wasm)")
    args = p.parse_args(argv)
    if not args.file:
        p.error("at least one --file")
    build(args)


if __name__ == "__main__":
    sys.exit(main())
