"""Single-stream decode: ``kvchat ask`` against ``mlx_lm generate`` on the same folder,
alternating, each in a fresh process. Prints JSON."""

import json
import re
import subprocess
import sys

from kvchat.engine.models.model import load_model

model, tokens = sys.argv[1], sys.argv[2]
folder = str(load_model(model).path)
prompt = "Tell me a long story about a lighthouse keeper and the ships she watched."
ask = [sys.executable, "-c", "from kvchat.cli import main; main()", "ask", "--model", model]
gen = [sys.executable, "-m", "mlx_lm", "generate", "--model", folder, "--temp", "0"]
rows = []
for _ in range(3):
    r = subprocess.run(
        [*ask, "--max-tokens", tokens, "--json", prompt], capture_output=True, text=True
    )
    try:
        d = json.loads(r.stdout)
        rows.append(
            {
                "who": "kvchat ask",
                "tokens": d["generated_tokens"],
                "tps": d["gen_tps"],
                "ttft_s": d["ttft_s"],
            }
        )
    except (ValueError, KeyError):
        rows.append({"who": "kvchat ask", "error": (r.stdout + r.stderr)[-800:]})
    r = subprocess.run(
        [*gen, "--max-tokens", tokens, "--prompt", prompt], capture_output=True, text=True
    )
    m = re.search(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", r.stdout)
    p = re.search(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", r.stdout)
    if m:
        rows.append(
            {
                "who": "mlx_lm generate",
                "tokens": int(m[1]),
                "tps": float(m[2]),
                "prompt": p and p.group(0),
            }
        )
    else:
        rows.append({"who": "mlx_lm generate", "error": (r.stdout + r.stderr)[-800:]})
    print(json.dumps(rows[-2:]), file=sys.stderr, flush=True)
print(json.dumps({"folder": folder, "rows": rows}, indent=1))
