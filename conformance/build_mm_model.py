"""Builds a tiny multimodal (LLaVA-style) model directory from the local text model
(`build_model.py`'s): its tokenizer plus an `<image>` token, a llava config around a one-layer
llama and a one-layer CLIP vision tower (32-pixel images, 16-pixel patches: 4 placeholder
tokens per image), a CLIP image processor and a chat template that renders image parts as
`<image>`. Config and processor files only, built here; nothing is downloaded, and there are
no weights (the conformance executor replaces the forward pass).

    .venv-vllm/bin/python conformance/build_mm_model.py TEXT_MODEL_DIR OUT_DIR
"""

import sys
from pathlib import Path

from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor,
                          PreTrainedTokenizerFast)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'text' %}{{ c['text'] }}{% elif c['type'] in ['image', 'image_url'] %}<image>"
            "{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
            "{% endif %}")


def main(src: Path, out: Path) -> int:
    stamp = (src / "tokenizer.json").read_bytes()
    if (out / ".complete").exists() and (out / ".source").read_bytes() == stamp:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=16, projection_dim=32)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      vision_feature_select_strategy="default", vision_feature_layer=-1)
    cfg.architectures = ["LlavaForConditionalGeneration"]
    cfg.save_pretrained(out)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=16, vision_feature_select_strategy="default",
                   chat_template=TEMPLATE).save_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    (out / ".source").write_bytes(stamp)
    (out / ".complete").write_text("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
