"""Write the tiny deterministic random-weight Llama served by the harness worker.

Usage (inside the SGLang venv): ``python mkmodel.py OUT_DIR``. Seeded, so the weights are
byte-identical from run to run; vocab 1024 (use token ids < 1024), no tokenizer.
"""

from __future__ import annotations

import sys


def main(out_dir: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: mkmodel.py OUT_DIR")
    main(sys.argv[1])
