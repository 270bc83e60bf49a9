#!/usr/bin/env python3
"""Open a dtrain checkpoint folder with the tools its model's users have, and
check that they compute what dtrain computes.

usage: hf_load_check.py FOLDER INPUT DIMS LOGITS [ADAPTER]

  FOLDER  a checkpoint folder (model.safetensors, optimizer.safetensors, config.json)
  INPUT   the model's input as raw little-endian float32: token ids, or images (N, C, H, W)
  DIMS    its shape, e.g. 2x16 or 2x3x16x16
  LOGITS  what dtrain's forward gave on it, raw float32
  ADAPTER a LoRA checkpoint folder of a run on FOLDER's weights: PEFT's
          PeftModel.from_pretrained(model, ADAPTER) wraps the model first

gpt and llama folders go through transformers' AutoModelForCausalLM.from_pretrained
(the folder as it is), vit through timm (create_model from config.json's
model_args, then load_state_dict(strict=True)), the mlp through a plain torch
module of the names config.json gives (load_state_dict(strict=True)). The
weights file must say "format": "pt" and hold weights alone.

Exit 0 when the logits agree, 1 when they do not or the folder does not load,
77 when this python lacks torch, safetensors, transformers or timm (the test
reports a skip and why).
"""
import json
import os
import sys

SKIP = 77


def main():
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    folder, input_path, dims, logits_path = sys.argv[1:5]
    adapter = sys.argv[5] if len(sys.argv) == 6 else None
    try:
        import numpy as np
        import torch
        from safetensors import safe_open
        from safetensors.torch import load_file
    except ImportError as e:
        print(f"skip: {sys.executable} lacks {e.name} (bash .ci/run sets up build/pyvenv)")
        return SKIP

    weights = os.path.join(folder, "model.safetensors")
    with safe_open(weights, "pt") as f:
        meta = f.metadata() or {}
        names = list(f.keys())
    if meta.get("format") != "pt":
        print(f"{weights}: metadata format is {meta.get('format')!r}, not 'pt'")
        return 1
    stray = [n for n in names if n.startswith(("optimizer.", "exp_avg", "momentum_buffer"))]
    if stray:
        print(f"{weights} holds optimizer tensors: {stray[:3]}")
        return 1
    moments = load_file(os.path.join(folder, "optimizer.safetensors"))
    if not moments or any(n.split(".", 1)[1] not in names for n in moments):
        print("optimizer.safetensors does not name the model's parameters")
        return 1

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    shape = [int(d) for d in dims.split("x")]
    x = torch.from_numpy(np.fromfile(input_path, dtype="<f4").reshape(shape).copy())
    want = torch.from_numpy(np.fromfile(logits_path, dtype="<f4").copy())
    torch.manual_seed(0)

    if "model_type" in config:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as e:
            print(f"skip: {sys.executable} lacks {e.name} (bash .ci/run sets up build/pyvenv)")
            return SKIP
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", torch_dtype=torch.float32)
        how = f"transformers {type(model).__name__}.from_pretrained"
        if adapter:
            try:
                from peft import PeftModel
            except ImportError as e:
                print(f"skip: {sys.executable} lacks {e.name} (bash .ci/run sets up build/pyvenv)")
                return SKIP
            model = PeftModel.from_pretrained(model, adapter)
            how += f" + peft PeftModel.from_pretrained ({sum(p.numel() for n, p in model.named_parameters() if 'lora_' in n)} adapter values)"
        with torch.no_grad():
            got = model(x.round().long()).logits
    elif "architecture" in config:
        try:
            import timm
        except ImportError as e:
            print(f"skip: {sys.executable} lacks {e.name} (bash .ci/run sets up build/pyvenv)")
            return SKIP
        model = timm.create_model(config["architecture"], pretrained=False, **config["model_args"])
        model.load_state_dict(load_file(weights), strict=True)
        how = f"timm {type(model).__name__} load_state_dict(strict=True)"
        with torch.no_grad():
            got = model.eval()(x)
    elif config.get("dtrain_model") == "mlp":
        layers = config["num_hidden_layers"] + 1
        widths = [config["in_features"]] + [config["hidden_size"]] * config["num_hidden_layers"] + [config["num_classes"]]

        class MLP(torch.nn.Module):
            def __init__(self):
                super().__init__()
                for i in range(layers):
                    setattr(self, f"fc{i + 1}", torch.nn.Linear(widths[i], widths[i + 1]))

            def forward(self, images):
                h = images.flatten(1)
                for i in range(layers):
                    h = getattr(self, f"fc{i + 1}")(h)
                    if i + 1 < layers:
                        h = torch.nn.functional.gelu(h)
                return h

        model = MLP()
        model.load_state_dict(load_file(weights), strict=True)
        how = "torch MLP load_state_dict(strict=True)"
        with torch.no_grad():
            got = model(x)
    else:
        print(f"{folder}/config.json names no model this check knows: {sorted(config)[:6]}")
        return 1

    got = got.float().flatten()
    if got.numel() != want.numel():
        print(f"{how}: {got.numel()} logits, dtrain gave {want.numel()}")
        return 1
    diff = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    verdict = "ok" if diff <= 1e-5 * scale else "MISMATCH"
    print(f"{verdict}: {how}: max |torch - dtrain| = {diff:.3g} over {want.numel()} logits (largest {scale:.3g})")
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
