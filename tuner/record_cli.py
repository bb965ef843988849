"""`opsadv-record`: the problems a transformers model's `generate()` meets, as a shapes file for `opsadv-tune`.

    opsadv-record --model DIR_OR_CONFIG --device cuda --dtype bf16 --batch-sizes 1,8 --prompt-lens 512,4096 \\
                  --new-tokens 128 --cache static --out shapes.json
    opsadv-tune --device h200 --shapes shapes.json

The model is built from its config with random weights (only the shapes matter; nothing is downloaded),
converted with `ops_adv.convert_model`, and `generate()` runs eagerly once per batch size x prompt length x
padding, greedy, exactly --new-tokens tokens: the prefill and every decode step, with the caches generate
makes. It is `model.tune_for_hardware(max_new_tokens=...)` split in two, for tuning on another machine or later.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
          "fp32": "float32", "float32": "float32", "float": "float32"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())[:300]}\n")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, not {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, not {text!r}")
    return vals


def _config(spec: str):
    from transformers import AutoConfig

    if os.path.isdir(spec) or spec.endswith(".json"):
        if not os.path.exists(spec):
            raise SystemExit(f"opsadv-record: error: {spec} does not exist; give a model folder (with config.json) or a config.json")
        path = spec if os.path.isdir(spec) else os.path.dirname(os.path.abspath(spec))
        if not os.path.isdir(spec):
            with open(spec) as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"opsadv-record: error: {spec} is not JSON ({e.msg}, line {e.lineno})") from None
            if "model_type" not in data:
                raise SystemExit(f"opsadv-record: error: {spec} has no model_type; give a transformers config.json")
            return AutoConfig.for_model(**data)
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise SystemExit(f"opsadv-record: error: cannot read a transformers config in {path}: {' '.join(str(e).split())[:200]}") from None
    raise SystemExit(f"opsadv-record: error: {spec} is neither a folder nor a .json file; give a model folder (with "
                     "config.json) or a config.json (nothing is downloaded)")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="opsadv-record", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model folder with config.json, or a config.json")
    ap.add_argument("--out", required=True, help="the shapes file to write (JSON, for opsadv-tune --shapes)")
    ap.add_argument("--device", default="cuda", help="where to run it (default cuda)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="the model's dtype (default bf16)")
    ap.add_argument("--batch-sizes", type=_ints, default=[1], help="comma-separated (default 1)")
    ap.add_argument("--prompt-lens", type=_ints, default=[128], help="prompt lengths, comma-separated (default 128)")
    ap.add_argument("--new-tokens", type=_ints, default=[128], help="max_new_tokens, one value (default 128)")
    ap.add_argument("--padding", default="none,left", help="none (all-ones mask) and/or left (left padding); default both")
    ap.add_argument("--cache", default=None, help="cache_implementation for generate (e.g. static; default: the model's)")
    args = ap.parse_args(argv)
    if len(args.new_tokens) != 1:
        ap.error("--new-tokens takes one value")
    padding = [p.strip() for p in args.padding.split(",") if p.strip()]
    try:
        import torch
        import transformers  # noqa: F401  (installed: one line if not)
    except ImportError as e:
        print(f"opsadv-record: error: {e.name} is not installed; pip install transformers", file=sys.stderr)
        return 2
    import ops_adv
    from kernel_space import OpsAdvError
    from ops_adv.models.record import record_generate

    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("opsadv-record: error: --device cuda but no CUDA device is visible; use --device cpu", file=sys.stderr)
            return 2
    except RuntimeError as e:
        print(f"opsadv-record: error: --device {args.device}: {e}", file=sys.stderr)
        return 2
    try:
        config = _config(args.model)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPES[args.dtype]))
    except ValueError as e:
        print(f"opsadv-record: error: {config.model_type} is not a causal language model transformers can build "
              f"({' '.join(str(e).split())[:160]})", file=sys.stderr)
        return 2
    model = ops_adv.convert_model(model.to(device).eval())
    kw = {"cache_implementation": args.cache} if args.cache else {}
    try:
        rec = record_generate(model, args.out, batch_sizes=args.batch_sizes, prompt_lens=args.prompt_lens,
                              max_new_tokens=args.new_tokens[0], padding=padding, device=device, generate_kwargs=kw)
    except OpsAdvError as e:
        print(f"opsadv-record: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"opsadv-record: error: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    shapes = rec.shapes()
    print(f"{sum(map(len, shapes.values()))} problems ({', '.join(f'{op} {len(v)}' for op, v in sorted(shapes.items()))}) "
          f"written to {args.out}")
    print(f"next: opsadv-tune --device <class> --ops {','.join(sorted(shapes))} --shapes {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
