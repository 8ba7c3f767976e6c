"""Pipeline throughput on loopback against one process, and where the time of a microbatch goes.

Two stage servers run as separate processes (one torch thread each, `StageService` behind a `FramedServer` on
their own hivemind P2P daemon); this process is the verifier (`PipelineDriver` over `FramedTransport`). The model
is the reference run's (4 layers x 128, context 128), microbatches of 8 sequences, AdamW every 16 sequences.

Measured:
* tokens/s of the pipeline for 1, 2, 4 and 8 microbatches in flight;
* tokens/s of the same model trained in one process (same microbatch, same accumulation, torch's threads);
* at 1 microbatch in flight, the share of a microbatch's time spent in stage compute, in serialization +
  signing + checks (sealing and opening envelopes, both ends), in transport (the rest of the round trips) and
  in the driver itself.

Run: `python benchmarks/pipeline.py [--seconds 8]` -> benchmarks/results/pipeline.json and pipeline.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import plot_path, write_result  # noqa: E402
from node.ml.data import BatchSampler, DataConfig, load_corpus  # noqa: E402
from node.ml.model import ModelConfig, build_model  # noqa: E402
from node.pipeline.driver import PipelineDriver  # noqa: E402
from node.pipeline.routing import ReplicaInfo, RetryPolicy  # noqa: E402
from node.pipeline.transport import FramedTransport  # noqa: E402
from node.roles.stage import StageConfig, StageService, build_core
from protocol.identity import NodeIdentity  # noqa: E402
from protocol.manifest import InnerOptimizerSpec, RunManifest, WireSpec  # noqa: E402
from protocol.pipeline import BoundaryShape  # noqa: E402
from protocol.rpc import FramedServer  # noqa: E402

RUN_ID = "b" * 40
MICROBATCH = 8
IN_FLIGHT = (1, 2, 4, 8)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def bench_manifest(verifier: str) -> RunManifest:
    return RunManifest(
        inner=InnerOptimizerSpec(lr=1e-3, batch_size=16, weight_decay=0.01),
        wire=WireSpec(max_batch=MICROBATCH),
        authorized_verifiers=(verifier,),
    )


# ---------------------------------------------------------------------------------------------------- stage server


async def serve(stage: int, identity_path: str, verifier: str, join: str) -> None:
    from hivemind.p2p import P2P

    torch.set_num_threads(1)
    identity = NodeIdentity.load(Path(identity_path))
    p2p = await P2P.create(
        initial_peers=[join], identity_path=identity_path, check_if_identity_free=False, host_maddrs=LOOPBACK
    )
    manifest = bench_manifest(verifier)
    core = build_core(manifest, RUN_ID, stage, StageConfig(max_contexts=64))
    service = StageService(identity, RUN_ID, core, authorized=[verifier])
    server = FramedServer(p2p, service.routes())
    await server.start()
    print(json.dumps({"ready": identity.peer_id}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "report":
            print(
                json.dumps({"timings": service.timings, "applied": core.counters.microbatches_applied}),
                flush=True,
            )
        elif line == "reset":
            service.timings.update(open_s=0.0, compute_s=0.0, seal_s=0.0, requests=0)
        else:  # EOF or "stop"
            break
    await server.stop()
    await p2p.shutdown()


# ---------------------------------------------------------------------------------------------------- verifier side


class StageProcess:
    def __init__(self, stage: int, identity: NodeIdentity, verifier: str, join: str) -> None:
        self.identity = identity
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "serve", str(stage), str(identity.path), verifier, join],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, command: str) -> dict[str, Any] | None:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        return json.loads(self.popen.stdout.readline()) if command == "report" else None

    def wait_ready(self) -> None:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError("a stage server did not start")
        json.loads(line)

    def close(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


async def drive(
    driver: PipelineDriver, sampler: BatchSampler, in_flight: int, seconds: float, ids: list[int]
) -> float:
    """Tokens/s with `in_flight` microbatches kept in flight for about `seconds`."""
    tokens, started = 0, time.perf_counter()
    tasks: set[asyncio.Task[Any]] = set()

    def launch() -> None:
        ids[0] += 1
        tasks.add(asyncio.create_task(driver.run_microbatch(ids[0], *sampler.next_batch())))

    while time.perf_counter() - started < seconds or tasks:
        while len(tasks) < in_flight and time.perf_counter() - started < seconds:
            launch()
        done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            outcome = task.result()
            assert outcome.completed, outcome.reason
            tokens += outcome.tokens
    return tokens / (time.perf_counter() - started)


async def pipeline_run(seconds: float, sampler: BatchSampler, rounds: int) -> dict[str, Any]:
    from hivemind.p2p import P2P

    with tempfile.TemporaryDirectory() as tmp:
        verifier = NodeIdentity.load_or_create(Path(tmp) / "verifier.key")
        stage_ids = [NodeIdentity.load_or_create(Path(tmp) / f"stage{s}.key") for s in (0, 1)]
        p2p = await P2P.create(
            identity_path=str(verifier.path), check_if_identity_free=False, host_maddrs=LOOPBACK
        )
        join = str((await p2p.get_visible_maddrs())[0])
        servers = [StageProcess(s, stage_ids[s], verifier.peer_id, join) for s in (0, 1)]
        try:
            for server in servers:
                server.wait_ready()
            manifest = bench_manifest(verifier.peer_id)
            replicas = [ReplicaInfo(peer_id=stage_ids[s].peer_id, stage=s) for s in (0, 1)]
            driver = PipelineDriver(
                identity=verifier,
                run_id=RUN_ID,
                num_stages=2,
                shape=BoundaryShape.from_manifest(manifest),
                transport=FramedTransport(p2p),
                replicas=lambda: replicas,
                retry=RetryPolicy(hop_timeout_s=60.0),
            )
            ids = [0]
            await drive(driver, sampler, 2, 2.0, ids)  # warm-up: connections, allocator, first steps
            results: dict[str, Any] = {"tokens_per_s": {}, "samples": {f: [] for f in IN_FLIGHT}}
            breakdowns = []
            for _ in range(rounds):
                for in_flight in IN_FLIGHT:
                    for server in servers:
                        server.ask("reset")
                    driver.stats.timings.update(seal_s=0.0, open_s=0.0, call_s=0.0)
                    completed_before = driver.stats.completed
                    wall_started = time.perf_counter()
                    rate = await drive(driver, sampler, in_flight, seconds, ids)
                    wall = time.perf_counter() - wall_started
                    results["samples"][in_flight].append(rate)
                    print(f"pipeline, {in_flight} in flight: {rate:,.0f} tokens/s", flush=True)
                    if in_flight == 1:
                        reports = [server.ask("report") for server in servers]
                        count = driver.stats.completed - completed_before
                        breakdowns.append(breakdown(driver.stats.timings, reports, wall, count))
            results["tokens_per_s"] = {f: max(v) for f, v in results["samples"].items()}
            # the round whose microbatch was fastest is the one least disturbed by other work on the machine
            results["breakdown"] = min(breakdowns, key=lambda b: b["microbatch_s"])
            results["breakdown_rounds"] = breakdowns
            return results
        finally:
            for server in servers:
                server.close()
            await p2p.shutdown()


def breakdown(
    verifier: dict[str, float], stages: list[dict[str, Any] | None], wall_s: float, count: int
) -> dict[str, Any]:
    """Seconds per microbatch by where they went (one microbatch in flight, so the parts add up)."""
    server = {k: sum(r["timings"][k] for r in stages if r) for k in ("open_s", "compute_s", "seal_s")}
    crypto = verifier["seal_s"] + verifier["open_s"] + server["open_s"] + server["seal_s"]
    transport = verifier["call_s"] - (server["open_s"] + server["compute_s"] + server["seal_s"])
    per = {
        "compute": server["compute_s"],
        "serialization_signing_checks": crypto,
        "transport": max(transport, 0.0),
    }
    per["driver_other"] = max(wall_s - sum(per.values()), 0.0)
    per_microbatch = {k: v / count for k, v in per.items()}
    total = sum(per_microbatch.values())
    return {
        "microbatches": count,
        "seconds_per_microbatch": per_microbatch,
        "share": {k: v / total for k, v in per_microbatch.items()},
        "microbatch_s": total,
    }


def single_process(seconds: float, sampler: BatchSampler, threads: int) -> float:
    """Tokens/s of the same model trained in one process: same microbatches, AdamW every 16 sequences."""
    torch.set_num_threads(threads)
    model = build_model(ModelConfig(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    accumulate = 16 // MICROBATCH

    def one(step: int) -> int:
        inputs, targets = sampler.next_batch()
        _, loss = model(inputs, targets)
        (loss / accumulate).backward()
        if step % accumulate == accumulate - 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return int(inputs.numel())

    for step in range(4):
        one(step)
    tokens, started, step = 0, time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        tokens += one(step)
        step += 1
    return tokens / (time.perf_counter() - started)


def plot(result: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    flights = sorted(result["tokens_per_s"])
    left.plot(
        flights, [result["tokens_per_s"][f] for f in flights], "o-", label="2-stage pipeline (loopback)"
    )
    left.axhline(result["single"], color="gray", linestyle="--", label="one process")
    left.set_xscale("log", base=2)
    left.set_xlabel("microbatches in flight")
    left.set_ylabel("tokens/s")
    left.set_title("throughput")
    left.legend()
    share = result["breakdown"]["share"]
    labels = {
        "compute": "compute",
        "serialization_signing_checks": "seal + open",
        "transport": "transport",
        "driver_other": "driver",
    }
    right.bar([labels[n] for n in share], [100 * v for v in share.values()], color=["C0", "C3", "C1", "C7"])
    right.set_ylabel("% of a microbatch (1 in flight)")
    right.set_title(f"where a microbatch's {1000 * result['breakdown']['microbatch_s']:.0f} ms go")
    fig.tight_layout()
    path = plot_path("pipeline")
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        stage, identity, verifier, join = sys.argv[2:6]
        asyncio.run(serve(int(stage), identity, verifier, join))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measuring time per setting")
    parser.add_argument(
        "--rounds", type=int, default=2, help="sweeps over the in-flight settings (best kept)"
    )
    args = parser.parse_args()
    cfg = ModelConfig()
    corpus = load_corpus(None, DataConfig(builtin_max_bytes=2 << 20))

    def sampler() -> BatchSampler:
        return BatchSampler(
            corpus.train_stream(),
            batch_size=MICROBATCH,
            context_len=cfg.context_len,
            generator=torch.Generator().manual_seed(0),
        )

    # The one-process baseline at both thread counts, before and after the pipeline (the machine is shared):
    # its best figure is the one compared with.
    singles: dict[str, list[float]] = {"1": [], "2": []}
    for threads in (1, 2):
        singles[str(threads)].append(single_process(args.seconds, sampler(), threads))
    torch.set_num_threads(1)  # this process is the verifier (see VerifierConfig.torch_threads)
    pipe = asyncio.run(pipeline_run(args.seconds, sampler(), args.rounds))
    for threads in (1, 2):
        singles[str(threads)].append(single_process(args.seconds, sampler(), threads))
    single = max(max(v) for v in singles.values())
    print(f"one process: {single:,.0f} tokens/s (by threads: {singles})", flush=True)
    result = {"single": single, **pipe}
    best = max(pipe["tokens_per_s"].values())
    share = pipe["breakdown"]["share"]
    headline = {
        "tokens_per_s_pipeline": round(best, 1),
        "tokens_per_s_single": round(single, 1),
        "overhead_share": round(share["serialization_signing_checks"], 4),
        "pipeline_over_single": round(best / single, 3),
        "best_in_flight": max(pipe["tokens_per_s"], key=pipe["tokens_per_s"].get),
        "transport_share": round(share["transport"], 4),
        "compute_share": round(share["compute"], 4),
    }
    detail = {
        "setup": {
            "model": cfg.to_dict(),
            "microbatch_sequences": MICROBATCH,
            "inner_batch_sequences": 16,
            "stages": 2,
            "stage_torch_threads": 1,
            "seconds_per_setting": args.seconds,
            "rounds": args.rounds,
            "verifier_torch_threads": 1,
            "load_average_1m_at_end": os.getloadavg()[0],  # other work on the machine skews every figure
        },
        "tokens_per_s_single_by_threads": singles,
        "tokens_per_s_samples": {str(k): v for k, v in pipe["samples"].items()},
        "tokens_per_s_by_in_flight": {str(k): round(v, 1) for k, v in pipe["tokens_per_s"].items()},
        "breakdown_at_1_in_flight": pipe["breakdown"],
    }
    path = write_result("pipeline", headline, detail)
    print(json.dumps(headline, indent=1))
    print(f"wrote {path} and {plot(result)}")


if __name__ == "__main__":
    main()
