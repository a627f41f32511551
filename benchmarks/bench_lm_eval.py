"""lm-evaluation-harness against `longserve serve` and against HF transformers, on the same weights.

Runs the local task benchmarks/lm_eval/longserve_mc.yaml (50 multiple-choice questions, no hub)
twice: `--model local-completions` against a LongServe server (loglikelihood over HTTP: echo,
logprobs=1, max_tokens=1), and `--model hf` on the same GGUF (transformers dequantizes it
itself), both CPU fp32. Prints both accuracies and the largest per-(question, choice)
loglikelihood difference; exits 1 if it exceeds --tolerance.

lm-eval is heavy (datasets, evaluate, scikit-learn, ...): install it in a venv of its own
    python -m venv --system-site-packages /tmp/lmeval-venv && /tmp/lmeval-venv/bin/pip install "lm-eval[api]"
    python benchmarks/bench_lm_eval.py --lm-eval /tmp/lmeval-venv/bin/lm_eval
(run from the repository root).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from bench_serving import start_server  # noqa: E402

from longserve.engine.executor import free_port  # noqa: E402
from longserve.models.builtin import resolve_model  # noqa: E402

TASK = "longserve_mc"


def tokenizer_folder(gguf: str, folder: str) -> str:
    """An HF tokenizer folder made from the GGUF's metadata (lm-eval needs one locally)."""
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(folder)
    return folder


def lm_eval(exe: str, model: str, model_args: str, out: str) -> dict:
    """Run one lm-eval; returns {(doc_id, choice): loglikelihood} and the accuracies."""
    cmd = [exe, "--model", model, "--model_args", model_args, "--tasks", TASK, "--include_path",
           "benchmarks/lm_eval", "--batch_size", "1", "--log_samples", "--output_path", out]
    if model == "hf":
        cmd += ["--device", "cpu"]
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, check=True, env=env)
    [samples] = glob.glob(f"{out}/**/samples_{TASK}_*.jsonl", recursive=True)
    [results] = glob.glob(f"{out}/**/results_*.json", recursive=True)
    lls = {}
    for line in open(samples):
        doc = json.loads(line)
        for i, resp in enumerate(doc["filtered_resps"]):
            lls[(doc["doc_id"], i)] = float(resp[0])
    metrics = json.load(open(results))["results"][TASK]
    return dict(lls=lls, acc=metrics["acc,none"], acc_norm=metrics["acc_norm,none"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable")
    p.add_argument("--model", default="smollm2", help="a .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tolerance", type=float, default=1e-3)
    args = p.parse_args()
    gguf = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer_folder(gguf, f"{tmp}/tokenizer")
        port = free_port()
        with open(f"{tmp}/server.log", "w") as log:
            server = start_server([gguf, "--served-model-name", "smollm2", "--device", "cpu",
                                   "--dtype", "float32"], port, 300, log)
            try:
                ours = lm_eval(args.lm_eval, "local-completions",
                               f"model=smollm2,base_url=http://127.0.0.1:{port}/v1/completions,"
                               f"tokenizer={tok},tokenized_requests=False,num_concurrent=1,max_retries=1",
                               f"{tmp}/local")
            finally:
                server.terminate()
                server.wait(60)
        hf = lm_eval(args.lm_eval, "hf", f"pretrained={os.path.dirname(gguf)},gguf_file="
                     f"{os.path.basename(gguf)},tokenizer={tok},dtype=float32", f"{tmp}/hf")
    assert ours["lls"].keys() == hf["lls"].keys()
    diff = max(abs(ours["lls"][k] - hf["lls"][k]) for k in hf["lls"])
    print(f"\n| lm-eval {TASK} (50 questions, {len(hf['lls'])} choices) | acc | acc_norm |\n|---|---|---|")
    for name, r in (("longserve serve (local-completions)", ours), ("transformers (hf)", hf)):
        print(f"| {name} | {r['acc']:.2f} | {r['acc_norm']:.2f} |")
    print(f"\nmax |loglikelihood difference| per choice: {diff:.2e} (tolerance {args.tolerance:g})")
    sys.exit(0 if diff <= args.tolerance else 1)


if __name__ == "__main__":
    main()
