#!/usr/bin/env python3
"""Make a tiny Mixtral with transformers, save it as a Hugging Face folder, and
print its loss on the first batch dtrain will train on.

usage: hf_make_mixtral.py FOLDER TEXT T B

  FOLDER  where save_pretrained writes the model (config.json, model.safetensors)
  TEXT    the training text: its first B x T + 1 bytes, read as token ids,
          are B sequences of T, each position predicting the next byte
  T, B    the context and the batch

Prints the mean cross-entropy of those B x T predictions. Exit 0, or 77 when
this python lacks torch or transformers (the test reports a skip and why).
"""
import sys

SKIP = 77


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    folder, text, T, B = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    try:
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM
    except ImportError as e:
        print(f"skip: {sys.executable} lacks {e.name} (bash .ci/run sets up build/pyvenv)")
        return SKIP
    torch.manual_seed(5)
    config = MixtralConfig(vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
                           tie_word_embeddings=False, sliding_window=None, output_router_logits=False)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():               # weights of 0.3 (not 0.02), a router of 1: every path and choice matters
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(50 if ".gate." in name else 15)
    model.save_pretrained(folder, safe_serialization=True)
    data = open(text, "rb").read()[: B * T + 1]
    ids = torch.tensor(list(data[: B * T]), dtype=torch.long).view(B, T)
    labels = torch.tensor(list(data[1: B * T + 1]), dtype=torch.long).view(B, T)
    for b in range(B):                  # each sequence's last position predicts the byte after it
        labels[b] = torch.tensor(list(data[b * T + 1: b * T + T + 1]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 256), labels.view(-1))
    print(f"{loss.item():.9f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
