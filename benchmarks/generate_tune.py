#!/usr/bin/env python
"""The documented way to tune a language model for generate(), run as a user would (issue 28, item 1).

Builds transformers' LlamaForCausalLM at Llama-3-8B dims (benchmarks/e2e_model.py's `8b`; --tiny: its tiny
dims, for the CPU) with random weights, converts it, and calls

    model.tune_for_hardware(device=..., batch_size=[...], seq_len=[...], max_new_tokens=N,
                            generate_kwargs={"cache_implementation": "static"}, db=..., trials=..., timeout_s=...)

then prints the census of op calls by source (tuned, nearest, twin, default) of the workload before the tune
and after the winners loaded, per op, and writes it to DIR/generate_tune.json. Export the table with
`python -m tuner export --device <class> --db URL --out DIR` (benchmarks/gpu.sh generate-tune does both).

    python benchmarks/generate_tune.py --batches 1,8 --prompts 512 --new-tokens 128 --db sqlite:///t.db --out DIR
    python benchmarks/generate_tune.py --tiny --device cpu --db sqlite:////tmp/t.db --out DIR      # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]  # benchmarks/kernels.py
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ops_adv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", default="512")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--timeout", type=float, help="seconds for the whole tune (opsadv-tune --timeout)")
    ap.add_argument("--db", required=True)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_model", ROOT / "benchmarks" / "e2e_model.py")
    e2e = importlib.util.module_from_spec(spec)
    sys.modules["e2e_model"] = e2e
    spec.loader.exec_module(e2e)
    dev = torch.device(args.device)
    ints = [int(x) for x in args.batches.split(",")], [int(x) for x in args.prompts.split(",")]
    size = "tiny" if args.tiny else "8b"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = e2e.build_decoder("llama", argparse.Namespace(size=size, layers=args.layers), dev, dtype,
                              max(ints[1]) + args.new_tokens + 64)
    model.generation_config.eos_token_id = None
    model = ops_adv.convert_model(model)
    t0 = time.perf_counter()
    out = model.tune_for_hardware(device=str(dev), batch_size=ints[0], seq_len=ints[1], max_new_tokens=args.new_tokens,
                                  generate_kwargs={"cache_implementation": "static"}, db=args.db, trials=args.trials,
                                  timeout_s=args.timeout)
    wall = time.perf_counter() - t0
    rows = out.pop("winners")
    print(f"tune_for_hardware: {out['problems']} problems, {len(rows)} winners, {wall:.0f} s")
    print(f"census before the tune: {out['census_before']}")
    print(f"census after:           {out.get('census_after')}")
    print(out.get("census", ""))
    ours = [r for r in rows if isinstance(r, dict) and r.get("impl") and r.get("vendor_impl") and r["impl"] != r["vendor_impl"]]
    print(f"{len(ours)} of {len(rows)} winners are not the vendor's")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "generate_tune.json").write_text(json.dumps(
            {"args": vars(args), "wall_s": wall, **out, "winners": rows}, indent=1, default=str))
    after = out.get("census_after") or {}
    return 0 if after and after.get("tuned") == sum(after.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
