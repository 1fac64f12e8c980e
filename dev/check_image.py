#!/usr/bin/env python3
"""Checks on an image `./build.sh image check` unpacked (standard library only).

    check_image.py agent INSPECT_JSON UMOCI_BUNDLE VERSION
        skopeo's view of the agent's image: linux/amd64, its version label, no creation date;
        umoci's bundle: runs /usr/local/bin/llmgw-agent as 65532; the root file system holds the
        agent and llmgw.wasm and nothing else (an empty base); the agent is a static executable
        (no ELF interpreter).
    check_image.py filter OCI_LAYOUT ROOTFS VERSION
        the Wasm image specification's "compat" variant, as Istio and Envoy Gateway pull it: one
        manifest tagged VERSION, exactly one tar+gzip layer, the variant annotation, and a root
        file system of plugin.wasm alone, a WebAssembly module.
"""

import json
import os
import struct
import sys

LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_MAGIC = b"\0asm\x01\0\0\0"


def fail(msg):
    sys.exit(f"check_image: {msg}")


def files_under(root):
    out = set()
    for d, _, fs in os.walk(root):
        for f in fs:
            out.add(os.path.relpath(os.path.join(d, f), root))
    return out


def elf_interpreter(path):
    """The PT_INTERP segment's presence in a 64-bit little-endian ELF file."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            fail(f"{path}: not a 64-bit little-endian ELF file")
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    types = [struct.unpack_from("<I", table, i * phentsize)[0] for i in range(phnum)]
    return 3 in types  # PT_INTERP


def agent(inspect_path, bundle, version):
    info = json.load(open(inspect_path))
    if (info.get("Os"), info.get("Architecture")) != ("linux", "amd64"):
        fail(f"agent image platform {info.get('Os')}/{info.get('Architecture')}, expected linux/amd64")
    if (info.get("Labels") or {}).get("org.opencontainers.image.version") != version:
        fail(f"agent image labels {info.get('Labels')}: no version {version}")
    if info.get("Created"):
        fail(f"agent image has a creation date {info['Created']} (digests would change with it)")
    runtime = json.load(open(os.path.join(bundle, "config.json")))
    proc = runtime["process"]
    if proc["args"][:1] != ["/usr/local/bin/llmgw-agent"] or proc["user"]["uid"] != 65532:
        fail(f"agent image runs {proc['args']} as uid {proc['user']['uid']}")
    rootfs = os.path.join(bundle, "rootfs")
    found = files_under(rootfs)
    if found != {"usr/local/bin/llmgw-agent", "usr/share/llmgw/llmgw.wasm"}:
        fail(f"agent image root file system holds {sorted(found)}")
    if elf_interpreter(os.path.join(rootfs, "usr/local/bin/llmgw-agent")):
        fail("the agent in the image is dynamically linked (it names an ELF interpreter)")
    print(f"ok: agent image linux/amd64, static, {len(found)} files, runs as 65532")


def blob(layout, digest):
    algo, hexd = digest.split(":", 1)
    return open(os.path.join(layout, "blobs", algo, hexd), "rb").read()


def filter_image(layout, rootfs, version):
    index = json.load(open(os.path.join(layout, "index.json")))
    refs = [m for m in index["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == version]
    if len(refs) != 1:
        fail(f"filter layout: {len(refs)} manifests tagged {version}")
    manifest = json.loads(blob(layout, refs[0]["digest"]))
    layers = manifest.get("layers", [])
    if len(layers) != 1 or layers[0]["mediaType"] != LAYER:
        fail(f"filter image layers {layers}: the compat variant has exactly one {LAYER}")
    if manifest.get("annotations", {}).get("module.wasm.image/variant") != "compat":
        fail("filter image: no module.wasm.image/variant=compat annotation")
    found = files_under(rootfs)
    if found != {"plugin.wasm"}:
        fail(f"filter image layer holds {sorted(found)}, expected plugin.wasm alone")
    with open(os.path.join(rootfs, "plugin.wasm"), "rb") as f:
        if f.read(8) != WASM_MAGIC:
            fail("plugin.wasm is not a WebAssembly module")
    print(f"ok: filter image in the Wasm compat layout, manifest {refs[0]['digest']}")


def main(argv):
    if len(argv) != 5 or argv[1] not in ("agent", "filter"):
        sys.exit(__doc__)
    if argv[1] == "agent":
        agent(argv[2], argv[3], argv[4])
    else:
        filter_image(argv[2], argv[3], argv[4])


if __name__ == "__main__":
    main(sys.argv)
