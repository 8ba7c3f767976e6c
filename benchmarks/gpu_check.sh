#!/usr/bin/env bash
# GPU smoke check for the transformers models (docs/models.md). NOT RUN ON A GPU YET: written on a CPU-only
# machine; its CPU smoke mode (below) ran: learner and 2-stage cut both 4.914 -> 2.930 over 30 steps.
# On a CUDA machine: `bash benchmarks/gpu_check.sh [preset]` (default llama-20m). Prints, for a whole-model
# learner step loop and a 2-stage pipeline cut run in one process (stage 0 -> detached activations -> stage 1,
# as over the wire), tokens/s, peak GPU memory and the loss at the start and the end (it must fall), with bf16
# autocast and fp32 master weights. Exits non-zero if CUDA is missing or the loss does not fall.
# Smoke run of the script on a CPU: DEVICE=cpu STEPS=30 BATCH=8 CONTEXT=64 bash benchmarks/gpu_check.sh llama-tiny
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET="${1:-llama-20m}" .venv/bin/python - <<'PY'
import os, sys, time
import torch
from node.ml.data import BatchSampler, load_corpus
from node.ml.model import ModelConfig, build_model, build_stage, count_parameters, lm_loss

dev = os.environ.get("DEVICE", "cuda")  # DEVICE=cpu: a smoke run of this script itself (no bf16, no memory)
if dev == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible")
cuda = dev == "cuda"
cfg = ModelConfig.from_dict({"preset": os.environ["PRESET"], "context_len": int(os.environ.get("CONTEXT", 256))})
stream = load_corpus(None).train_stream()
steps, batch = int(os.environ.get("STEPS", 60)), int(os.environ.get("BATCH", 16))

def run(name, params, step_fn):
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    sampler = BatchSampler(stream, batch_size=batch, context_len=cfg.context_len,
                           generator=torch.Generator().manual_seed(0))
    losses = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(); torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        x, y = (t.to(dev) for t in sampler.next_batch())
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = step_fn(x, y)
        losses.append(float(loss.detach())); opt.step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    print(f"{name}: {steps * batch * cfg.context_len / elapsed:,.0f} tokens/s, peak {peak:.2f} GiB, "
          f"loss {sum(losses[:5]) / 5:.3f} -> {sum(losses[-5:]) / 5:.3f}")
    if not sum(losses[-5:]) < sum(losses[:5]) - 0.5:
        sys.exit(f"{name}: loss did not fall")

model = build_model(cfg, 0).to(dev)
where = torch.cuda.get_device_name() if cuda else "cpu"
print(f"{cfg.preset} ({cfg.family}): {count_parameters(model) / 1e6:.1f} M parameters on {where}")
def learner_step(x, y):
    _, loss = model(x, y); loss.backward(); return loss
run("learner", model.parameters(), learner_step)
del model

s0, s1 = build_stage(cfg, 0, 0, 2).to(dev), build_stage(cfg, 0, 1, 2).to(dev)
def pipeline_step(x, y):
    h = s0(x); received = h.detach().requires_grad_(True)
    loss = s1(received, y); loss.backward(); h.backward(received.grad); return loss
run("pipeline 2 stages", [*s0.parameters(), *s1.parameters()], pipeline_step)
PY
