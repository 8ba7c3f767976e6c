#!/usr/bin/env bash
# GPU smoke check for the transformers models (docs/models.md) and the roles' own device paths (#16 item 3: every
# role honours --device). NOT RUN ON A GPU YET: written on a CPU-only machine; its CPU smoke mode (below) ran:
# learner, 2-stage cut and the stage cores all 4.914 -> 2.930 over 30 steps (llama-tiny), the syncer's held-out
# loss 3.13799 both ways (on "the device", the CPU there, and on the CPU).
# On a CUDA machine: `bash benchmarks/gpu_check.sh [preset]` (default llama-20m). Prints, for a whole-model
# learner step loop and a 2-stage pipeline cut run in one process (stage 0 -> detached activations -> stage 1,
# as over the wire), tokens/s, peak GPU memory and the loss at the start and the end (it must fall), with bf16
# autocast and fp32 master weights. Then the same cut through the stage role's own code (node.roles.stage
# StageCore built on the device: CPU tensors in as from the wire, CPU fp32 answers out, fp32 master weights and
# AdamW state), and the syncer's held-out loss (node.roles.syncer skeleton_loss) computed on the device from
# the CPU master copy against the same on the CPU. Exits non-zero if CUDA is missing, a loss does not fall, a
# role answers anything but CPU fp32 or keeps non-fp32 weights, or the two held-out losses disagree.
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
del s0, s1

# The roles' own code on the device: two StageCores (as `--role stage --device DEV` builds them) driven as a
# verifier would, CPU tensors in and out; then the syncer's held-out loss on the device vs on the CPU.
from node.ml.data import validation_batches
from node.roles.stage import StageConfig, build_core
from node.roles.syncer import model_skeleton, skeleton_loss
from protocol.manifest import InnerOptimizerSpec, RunManifest, WireSpec

manifest = RunManifest(model=cfg.to_dict(), num_stages=2, wire=WireSpec(max_batch=batch),
                       inner=InnerOptimizerSpec(lr=1e-3, batch_size=batch, weight_decay=0.1))
cores = [build_core(manifest, "0" * 40, s, StageConfig(), device=dev) for s in (0, 1)]
sampler = BatchSampler(stream, batch_size=batch, context_len=cfg.context_len, generator=torch.Generator().manual_seed(0))
losses = []
if cuda:
    torch.cuda.reset_peak_memory_stats(); torch.cuda.synchronize()
start = time.perf_counter()
for step in range(steps):
    x, y = sampler.next_batch()  # CPU, as opened from the wire
    act = cores[0].forward("gpu-check", step, x)
    loss, grad = cores[1].forward_loss("gpu-check", step, act, y)
    cores[0].backward("gpu-check", step, grad)
    for t in (act, grad):
        if t.device.type != "cpu" or t.dtype != torch.float32:
            sys.exit(f"stage cores: an answer on {t.device} in {t.dtype}, not CPU fp32")
    losses.append(loss)
elapsed = time.perf_counter() - start
peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
print(f"stage cores on {dev}: {steps * batch * cfg.context_len / elapsed:,.0f} tokens/s, peak {peak:.2f} GiB, "
      f"loss {sum(losses[:5]) / 5:.3f} -> {sum(losses[-5:]) / 5:.3f}, steps {cores[0].inner_step}")
if not sum(losses[-5:]) < sum(losses[:5]) - 0.5:
    sys.exit("stage cores: loss did not fall")
for core in cores:
    if {(p.device.type, p.dtype) for p in core.params.values()} != {(torch.device(dev).type, torch.float32)}:
        sys.exit("stage cores: master weights not fp32 on the device")
master = {n: p.detach().to("cpu") for core in cores for n, p in core.params.items()}  # the syncer's CPU copy
held = validation_batches(load_corpus(None), batch_size=batch, context_len=cfg.context_len, num_batches=4)
on_dev = skeleton_loss(model_skeleton(cfg, dev), master, held, device=dev)
on_cpu = skeleton_loss(model_skeleton(cfg, "cpu"), master, held, device="cpu")
print(f"syncer held-out loss: {on_dev:.5f} on {dev}, {on_cpu:.5f} on cpu")
if not abs(on_dev - on_cpu) <= 1e-3 * abs(on_cpu):
    sys.exit("syncer: the held-out loss on the device differs from the CPU's")
PY
