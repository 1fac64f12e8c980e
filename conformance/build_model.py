#!/usr/bin/env python3
"""Builds the tiny local model directory the conformance suite serves with the real vLLM:
a llama-style config.json and a byte-level BPE tokenizer trained here on generated text,
with a chat template. No weights: the suite's executor replaces the forward pass.
Usage: build_model.py OUT_DIR  (idempotent: skips when OUT_DIR/.complete matches this file)"""

import hashlib
import json
import random
import sys
from pathlib import Path

VOCAB = 2048
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus():
    rng = random.Random(1)
    words = ["the", "cache", "block", "prefix", "replica", "router", "token", "prompt", "engine", "event",
             "system", "user", "assistant", "hello", "world", "shared", "request", "answer", "question"]
    for _ in range(4000):
        yield " ".join(rng.choice(words) if rng.random() < 0.7 else f"w{rng.randrange(5000)}"
                       for _ in range(rng.randrange(5, 30)))


def main() -> int:
    out = Path(sys.argv[1])
    stamp = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    if (out / ".complete").exists() and (out / ".complete").read_text() == stamp:
        return 0
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "bos_token_id": bos, "eos_token_id": tok.token_to_id("</s>"), "torch_dtype": "float32",
        "tie_word_embeddings": False}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": tok.token_to_id("</s>")}))
    (out / ".complete").write_text(stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
