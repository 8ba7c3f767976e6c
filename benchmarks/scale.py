"""Memory and state transfer at scale (issue 17, "Must show"): peak RSS of the syncer and of a learner through a full
merge round of llama-124m, a llama-1b syncer core merging every fragment, a 1B pipeline stage's slice, and the time
a late joiner takes to download the whole llama-124m state.

Each measured party is a child process of its own (spawned), and reports its peak RSS from
`resource.getrusage(RUSAGE_SELF).ru_maxrss`, so the parties do not count each other:

* `round` (llama-124m, real loopback): a syncer process serves the real `SyncerService` routes (push, versions,
  fetch) from a real `SyncerCore` (screening and the held-out loss probe on, a checkpoint written after the round)
  on its own hivemind P2P daemon; a learner process trains the model (AdamW, short synthetic sequences) under the
  real `FragmentSync` over `FramedSyncTransport` until every fragment was pushed, merged and applied back; then a
  late joiner process downloads every fragment (`FragmentSync.join_global`), timed.
* `core_1b` (llama-1b, no network daemon): a `SyncerCore` merges every fragment from two synthetic contributions
  each (the learner's params plus noise), screening on (the loss probe off: two 1B forwards per contribution on this
  CPU take minutes), and takes its checkpoint snapshot. Each contribution goes through the syncer's real push route
  (benchmarks.push_route: the route's stream server reads the signed frame, generated a chunk at a time as it is
  read, into a spill file, `SyncerService` opens and accepts it; `push_path` "route"); `--push-in-memory` and
  `--push-on-disk` hand a push built in memory or in a spill file to `SyncerCore.accept` instead. `--probe-1b`
  scores each push with the loss probe first (as deployed: the contribution applied streamed through the forward
  pass; `--probe-1b whole`: built whole, the probe before node.ml.streamed_forward), on `--probe-batches` held-out
  batches of `--probe-rows` sequences of `--probe-tokens` (64; the syncer's default is 256). It runs only when the
  machine has the memory free (else the JSON says why it was skipped).
* `stage_1b`: the parameter bytes of the largest pipeline stage of llama-1b (counted on the meta device).
* `data` (benchmarks.data_scale; not in `--quick`): prepare throughput (byte and BPE tokenizers), download throughput
  from the bootstrap's shard routes, and a learner's reader sampling a dataset 4x larger than the memory cgroup it
  runs in, with the corpus read whole into memory under the same budget as the negative control (headline `data_*`).

The syncer's goal is peak RSS <= model bytes + 2 fragments; `syncer_rss_ratio_*` is peak / (model bytes + 2 x the
largest fragment's bytes). The core, as the node's syncer builds it, keeps only the global parameters in memory (the
seed model handed over, not copied); the outer Nesterov momentum, the versions a contribution may still be built on
(`max_staleness`), the screen's recent direction and the round's accepted contributions are files in a spill
directory (node.diloco.spill), read a chunk at a time (node.diloco.chunked); a merge writes its outer gradient to a
file there a chunk at a time, the outer step overwrites it with the new version, read in a tensor at a time once the
one it replaces is dropped; the checkpoint is streamed. What is left over the goal is the process itself (torch and
transformers: ~0.4 GiB) and the push being accepted (one fragment); docs/scale.md has the breakdown.

Run: `python -m benchmarks.scale` (everything; the 1B part needs ~8 GiB free), `--quick` (llama-124m round only), `--model llama-tiny --out DIR` (what the unit test runs), `--only-round --model llama-350m` (one model's merge round into the existing JSON, keys suffixed by the model unless it is the headline's; with `--params-on-disk` the syncer keeps its global parameters on disk, keys further suffixed `_params_on_disk`), `--only-data` (the data part into the existing JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import os
import queue as queue_module
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import data_scale
from tools.proctree import status_bytes

GiB = 1 << 30
NAME = "scale"
SEQ = 64  # tokens per training sequence (short: the round measures memory, not throughput)
TOKENIZER: dict[str, str | int | float | bool] = {
    "sha256": "0" * 64,
    "vocab_size": 32000,
}  # a 32k BPE vocabulary, as the presets' sizes assume
RUN_ID = "5c" * 20
# The 1B syncer core runs with 16 fragments a stage (a run's `num_fragments`, P), not the default 4: the headline's
# setting since its merges held ~2K + 5 fragments of temporaries (smaller fragments, a smaller peak); kept so that
# the figures compare. Now a merge holds chunks over the model, and `--only-1b --fragments-1b 4` measures the
# default P too. Before the spill (older versions and momentum on disk) it held 3 models and was killed on the
# shared 23 GiB machine (P = 16: at 15.9 GB).
FRAGMENTS_1B = 16
MIN_FREE = 1 << 30  # a child is killed when the machine's available memory falls under this (the 1B part)


# ---------------------------------------------------------------------------------------------- shared


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """This process's resident set size now (VmRSS of /proc/self/status; 0 if unknown)."""
    return status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (`/proc/self/clear_refs` 5, Linux >= 4.0); False if it
    could not. It resets `ru_maxrss` too: a caller that resets reads its peaks from `PhasePeaks`."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PhasePeaks:
    """Peak RSS per phase of a run (what holds the memory at the peak: the push being accepted, the merge, ...): the
    kernel's high-water mark read at the end of each phase and reset for the next, and the RSS right after it. The
    whole run's peak is the largest phase peak (`ru_maxrss` no longer is once the mark was reset). If the mark cannot
    be reset, every phase reads the peak so far (`resettable` False says so)."""

    def __init__(
        self,
        read: Any = status_bytes,
        reset: Any = reset_peak_rss,
    ) -> None:
        self._read, self._reset = read, reset
        self.peaks: dict[str, int] = {}  # phase -> its highest peak over every time it ran
        self.after: dict[str, int] = {}  # phase -> the highest RSS right after it ended
        self.overall = 0
        self.resettable = bool(reset())  # the phases start here

    def end(self, phase: str) -> int:
        """The phase that started at the last `end` (or at construction) ended: its peak, recorded."""
        peak, now = self._read("VmHWM"), self._read("VmRSS")
        self.resettable = bool(self._reset()) and self.resettable
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        self.after[phase] = max(self.after.get(phase, 0), now)
        self.overall = max(self.overall, peak)
        return peak

    def report(self) -> dict[str, Any]:
        return {
            "phase_peak_rss": dict(self.peaks),
            "rss_after_phase": dict(self.after),
            "resettable": self.resettable,
        }


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 if unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def manifest(preset: str, *, num_fragments: int = 4, num_stages: int = 1) -> Any:
    from protocol.manifest import DilocoSpec, RunManifest

    tokenizer = {} if preset == "llama-tiny" else dict(TOKENIZER)
    spec = DilocoSpec(
        num_fragments=num_fragments,
        sync_every_steps=num_fragments + 1,
        overlap_steps=1,
        min_sync_interval_s=0.0,
        min_quorum=1,
        grace_gamma=0.0,
    )
    return RunManifest(model={"preset": preset}, tokenizer=tokenizer, num_stages=num_stages, diloco=spec)


def sizes(run: Any) -> dict[str, int]:
    """Model bytes and the largest fragment's bytes (fp32), from the run's fragment plan."""
    from node.diloco.sync_client import run_fragment_plan

    plan = run_fragment_plan(run)
    return {
        "model_bytes": plan.total_params * 4,
        "fragment_bytes": max(f.num_params for f in plan.fragments) * 4,
        "num_fragments": plan.num_fragments,
    }


def learnable_batch(vocab: int, rows: int, seed: int, tokens: int = SEQ) -> tuple[Any, Any]:
    """Sequences of token t+1 = (3 t + 1) mod vocab: training lowers the held-out loss the probe measures."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    seq = [torch.randint(0, vocab, (rows, 1), generator=gen)]
    for _ in range(tokens):
        seq.append((seq[-1] * 3 + 1) % vocab)
    tokens = torch.cat(seq, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def new_core(
    run: Any, params: Any, screening: Any, spill_dir: Path | None, *, params_on_disk: bool = False
) -> Any:
    import time as _time

    from node.diloco.quorum import QuorumConfig
    from node.diloco.sync_client import run_fragment_plan
    from node.diloco.syncer_core import SyncerCore
    from node.ml.model import ModelConfig, embedding_param_names

    cfg = ModelConfig.from_dict(run.model)
    return SyncerCore(
        run_fragment_plan(run),
        params,
        quorum=QuorumConfig.decoupled(1, grace_gamma=0.0),
        embedding_names=embedding_param_names(cfg),
        outer_lr=run.diloco.outer_lr,
        outer_momentum=run.diloco.outer_momentum,
        clip_factor=3.0,
        max_staleness=2,
        max_steps_per_s=50.0,
        tokens_per_step=SEQ,
        now=_time.monotonic(),
        screening=screening,
        spill_dir=spill_dir,  # as the node's syncer: older versions and momentum on disk
        take_params=True,  # as the node's syncer: the seed model is handed over, not copied
        params_on_disk=params_on_disk,  # `[syncer] params_on_disk` (node.diloco.param_store)
    )


# ---------------------------------------------------------------------------------------------- the syncer


class Host:
    """What `SyncerService` reads of the syncer role (node.roles.syncer_rpc.SyncerHost), with every caller taken
    as a live learner: the benchmark measures memory and transfer, not membership."""

    def __init__(
        self, run: Any, identity: Any, core: Any, probe: Any, *, params_on_disk: bool = False
    ) -> None:
        from node.context import NodeMetrics
        from node.diloco.screening import ScreeningConfig
        from node.diloco.sync_client import fragment_limits, run_fragment_plan
        from node.roles.syncer import SyncerConfig
        from protocol.rpc import PeerStrikes

        events = SimpleNamespace(emit=lambda *a, **k: None)
        self.ctx = SimpleNamespace(
            manifest=run,
            run_id=RUN_ID,
            identity=identity,
            peer_id=identity.peer_id,
            events=events,
            metrics=NodeMetrics(),  # the service counts admission refusals on /metrics
        )
        self.config = SyncerConfig(screening=ScreeningConfig(), params_on_disk=params_on_disk)
        self.mode, self.term, self.primary, self.active = "decoupled", 1, None, True
        self.plan = run_fragment_plan(run)
        self.limits = fragment_limits(self.plan)
        self.fragment_stage = [0] * self.plan.num_fragments
        self.strikes = PeerStrikes()
        self.core, self.probe = core, probe
        self.recovering_until, self.adopted = 0.0, 0
        self.fresh: set[tuple[str, int]] = set()
        self.live: dict[str, Any] = {}
        self.merge_lock, self.probe_lock = asyncio.Lock(), asyncio.Lock()
        self.core_free = (
            asyncio.Event()
        )  # cleared while a commit reads its version in (node.roles.syncer.commit)
        self.core_free.set()
        self.ban_outbox: Any = []
        self.wake, self.published = asyncio.Event(), asyncio.Event()
        self.p2p: Any = None

    def holders(self, fragment: int) -> set[str]:
        return set(self.live)

    async def check_known(self, peer: str) -> None:
        return None

    def notify(self) -> None:
        self.published.set()
        self.published = asyncio.Event()


def build_probe_for(
    run: Any, mode: str = "streamed", batches: int = 2, rows: int = 2, tokens: int = SEQ
) -> Any:
    """The syncer's held-out loss probe as `node.roles.syncer.build_probe` makes it (the model's skeleton), on
    `batches` held-out batches of `rows` sequences of `tokens`. `mode` "whole": the contribution applied is built
    whole before each forward pass (the probe before node.ml.streamed_forward, to measure what streaming saves)."""
    from functools import partial

    from node.diloco.loss_probe import LossProbe
    from node.ml.model import ModelConfig
    from node.roles.syncer import model_skeleton, skeleton_loss

    cfg = ModelConfig.from_dict(run.model)
    held = [learnable_batch(cfg.vocab_size, rows, seed=1000 + i, tokens=tokens) for i in range(batches)]
    loss = partial(skeleton_loss, model_skeleton(cfg), batches=held)
    if mode != "whole":
        return LossProbe(loss)

    def whole(params: Any) -> float:
        return float(loss({name: params[name] for name in params}))

    return LossProbe(whole)


def probe_options(probe: bool | dict[str, Any]) -> dict[str, Any] | None:
    """`build_probe_for`'s keyword arguments for a core round's `probe` (False: off; True: as deployed)."""
    if probe is False:
        return None
    return {} if probe is True else dict(probe)


async def merge_one(host: Host, fragment: int) -> Any:
    """`SyncerCore.merge_now` as the syncer role runs it: computed off the loop, committed through
    `node.roles.syncer.commit` (the new version read in off the loop while the routes wait); None if nothing merged."""
    from node.diloco.spill import release_freed_memory
    from node.diloco.syncer_core import NothingToMerge
    from node.roles.syncer import commit

    core = host.core
    taken = core.take_round(fragment, 1, time.monotonic())
    if taken is None:
        return None
    round_, expected, required = taken
    try:
        prepared = await asyncio.to_thread(
            core.compute_merge,
            fragment,
            round_,
            expected=expected,
            required=required,
            started_at=time.monotonic(),
        )
    except NothingToMerge:
        return None
    record = await commit(host.core_free, core, prepared)
    del (
        prepared,
        round_,
        taken,
    )  # the round's contributions and the merge's temporaries, then back to the kernel
    release_freed_memory()
    return record


async def merge_until(host: Host, stop: Any, merges: list[Any]) -> None:
    """The merge loop: every round that is due merges at once (K = 1, no grace), then its version is published."""
    core = host.core
    while not stop.is_set():
        due, _ = core.due(time.monotonic(), lambda f: 1)
        for fragment in due:
            async with host.merge_lock:
                record = await merge_one(host, fragment)
            if record is not None:
                merges.append(record.fragment)
                host.notify()
        await asyncio.sleep(0.05)


async def syncer_main(preset: str, queue: Any, stop: Any, params_on_disk: bool = False) -> None:
    from hivemind.p2p import P2P

    from node.diloco.screening import ScreeningConfig
    from node.ml.checkpoint import CheckpointStore
    from node.ml.model import ModelConfig, SeedParameters, build_model
    from node.roles.syncer_rpc import SyncerService
    from protocol.identity import NodeIdentity

    run = manifest(preset)
    with tempfile.TemporaryDirectory() as tmp:
        identity = NodeIdentity.load_or_create(Path(tmp) / "syncer.key")
        cfg = ModelConfig.from_dict(run.model)
        # as the node's syncer (node.roles.syncer.build_core): with its params on disk the seed is drawn a tensor
        # at a time into their files, never whole in memory
        params = (
            SeedParameters(cfg, run.seed)
            if params_on_disk
            else dict(build_model(cfg, run.seed).named_parameters())
        )
        core = new_core(run, params, ScreeningConfig(), Path(tmp) / "spill", params_on_disk=params_on_disk)
        del params
        host = Host(run, identity, core, build_probe_for(run), params_on_disk=params_on_disk)
        p2p = await P2P.create(identity_path=str(identity.path), check_if_identity_free=False)
        host.p2p = p2p
        service = SyncerService(host)  # type: ignore[arg-type]
        await service.start(p2p, lambda *a, **k: None)
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        queue.put({"maddrs": maddrs, "peer_id": identity.peer_id, "setup_peak": peak_rss_bytes()})
        merges: list[int] = []
        done = asyncio.Event()
        merger = asyncio.create_task(merge_until(host, done, merges))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        done.set()
        await merger
        store = CheckpointStore(Path(tmp) / "ckpt", RUN_ID, keep=1)
        started = time.perf_counter()
        await asyncio.to_thread(store.save, core.snapshot(RUN_ID, 1))
        checkpoint_s = time.perf_counter() - started
        throttles = limiter_counts(service)
        await service.stop()
        await p2p.shutdown()
        queue.put(
            {
                "party": "syncer",
                "peak_rss": peak_rss_bytes(),
                "merges": len(merges),
                "versions": list(core.versions),
                "refusals": dict(service.refusals),
                "probe": probe_status(host.probe),
                "checkpoint_s": round(checkpoint_s, 3),
                "throttles": throttles,
                # the longest the push route held a recent push before its answer (node.diloco.push_wait)
                "push_hold_s": round(service.push_waits.announce_s(time.monotonic()), 2),
            }
        )


def limiter_counts(service: Any) -> dict[str, Any]:
    """The syncer's load refusals by reason and the flood reports its limiter made (docs/diloco.md, refusals)."""
    # the service keeps its server private; the benchmark reads the counters the stream layer already keeps
    server = service._server
    if server is None:
        return {}
    stats = server.limiter.stats()
    return {
        "by_reason": dict(stats.throttled_by_reason),
        "flood_reports": stats.num_flood_reports,
        "floods_logged": sum(server.floods.values()),
    }


def probe_status(probe: Any) -> dict[str, Any]:
    return probe.status() if probe is not None else {}


# ---------------------------------------------------------------------------------------------- the learner


def loopback_transport(p2p: Any, identity: Any, run: Any, syncer: str) -> Any:
    """`FramedSyncTransport` to the one syncer (no DHT lookup)."""
    from node.diloco.sync_client import FramedSyncTransport, run_fragment_plan

    class Loopback(FramedSyncTransport):
        async def current_syncer(self) -> tuple[str, int]:
            return syncer, 1

    records = SimpleNamespace(run_id=RUN_ID, clock=time.time)
    plan = run_fragment_plan(run)
    return Loopback(p2p, identity, records, plan, authorized_syncers=[syncer])  # type: ignore[arg-type]


async def connect(maddrs: list[str], path: Path) -> tuple[Any, Any]:
    from hivemind.p2p import P2P

    from protocol.identity import NodeIdentity

    identity = NodeIdentity.load_or_create(path)
    p2p = await P2P.create(
        initial_peers=maddrs, identity_path=str(identity.path), check_if_identity_free=False
    )
    return p2p, identity


def inner_step(model: Any, opt: Any, vocab: int, seed: int) -> float:
    inputs, targets = learnable_batch(vocab, 1, seed)
    _, loss = model(inputs, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


async def learner_main(preset: str, info: dict[str, Any], queue: Any, max_steps: int) -> None:
    import torch

    from node.diloco.spill import release_freed_memory
    from node.diloco.sync_client import FragmentSync
    from node.diloco.sync_types import SyncClientConfig
    from node.ml.model import ModelConfig, build_model

    run = manifest(preset)
    cfg = ModelConfig.from_dict(run.model)
    with tempfile.TemporaryDirectory() as tmp:
        p2p, identity = await connect(info["maddrs"], Path(tmp) / "learner.key")
        model = build_model(cfg, run.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        transport = loopback_transport(p2p, identity, run, info["peer_id"])
        config = SyncClientConfig(poll_wait_s=1.0, retry_min_s=0.1, retry_max_s=0.5)
        sync = FragmentSync.create(
            dict(model.named_parameters()), transport.plan, run.diloco, transport, config=config
        )
        stop = asyncio.Event()
        tasks = [asyncio.create_task(sync.run_sender(stop)), asyncio.create_task(sync.run_watcher(stop))]
        started, step, losses, first_step_peak = time.perf_counter(), 0, [], 0
        while step < max_steps and min(sync.versions().values()) < 1:
            step += 1
            losses.append(await asyncio.to_thread(inner_step, model, opt, cfg.vocab_size, step))
            if step == 1:  # the model, its AdamW moments, the process: before any version arrived
                first_step_peak = peak_rss_bytes()
            sync.after_inner_step(step, SEQ)
            await asyncio.sleep(0.2)  # the loops' turn: pushes and fetches of ~100 MB frames
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await p2p.shutdown()
        rss_end = current_rss_bytes()
        release_freed_memory()  # what of `rss_end` is freed memory glibc kept in the heap, not held by the learner
        queue.put(
            {
                "party": "learner",
                "peak_rss": peak_rss_bytes(),
                "rss_end": rss_end,
                "rss_end_trimmed": current_rss_bytes(),
                "peak_rss_first_step": first_step_peak,
                "steps": step,
                "round_s": round(time.perf_counter() - started, 2),
                "versions": {str(f): v for f, v in sync.versions().items()},
                "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)] if losses else [],
                "last_error": sync.status().get("last_error", ""),
                "sync": {
                    k: v
                    for k, v in sync.status().items()
                    if k in ("sent", "acked", "refused", "refusals", "throttled", "unanswered", "retries")
                },
            }
        )


async def joiner_main(preset: str, info: dict[str, Any], queue: Any) -> None:
    """A late joiner: its model from the seed, then every fragment's current version from the syncer, timed."""
    from node.diloco.sync_client import FragmentSync
    from node.ml.model import ModelConfig, build_model

    run = manifest(preset)
    with tempfile.TemporaryDirectory() as tmp:
        p2p, identity = await connect(info["maddrs"], Path(tmp) / "joiner.key")
        model = build_model(ModelConfig.from_dict(run.model), run.seed)
        transport = loopback_transport(p2p, identity, run, info["peer_id"])
        sync = FragmentSync.create(dict(model.named_parameters()), transport.plan, run.diloco, transport)
        before = peak_rss_bytes()  # the process and its model from the seed
        started = time.perf_counter()
        joined = await sync.join_global(asyncio.Event(), timeout_s=120.0)
        elapsed = time.perf_counter() - started
        after = current_rss_bytes()  # the model and the signed frames it keeps to offer a successor syncer
        await p2p.shutdown()
        queue.put(
            {
                "party": "joiner",
                "joined": joined,
                "state_transfer_s": round(elapsed, 3),
                "versions": {str(f): v for f, v in sync.versions().items()},
                "peak_rss": peak_rss_bytes(),
                "peak_rss_before_join": before,
                "rss_after_join": after,
            }
        )


def _child(kind: str, preset: str, queue: Any, extra: Any) -> None:
    import torch

    torch.set_num_threads(1)  # two cores, three processes
    if kind == "syncer":
        asyncio.run(syncer_main(preset, queue, *extra))
    elif kind == "learner":
        # the sender's outcome of every push that was not acked (throttles, timeouts), timestamped, on stderr: what
        # traces a push that got no answer (docs/scale.md, "Push pacing")
        logging.basicConfig(format="%(asctime)s %(name)s %(message)s", level=logging.WARNING)
        logging.getLogger("node.diloco.loops_transport").setLevel(logging.DEBUG)
        asyncio.run(learner_main(preset, extra[0], queue, extra[1]))
    elif kind == "joiner":
        asyncio.run(joiner_main(preset, extra, queue))
    elif kind == "core":
        queue.put(core_round(preset, *extra))


def result_of(queue: Any, child: Any, timeout_s: float) -> dict[str, Any]:
    """The child's result; RuntimeError as soon as it died without one (killed for memory: the round waited its
    whole timeout for it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(queue_module.Empty):
            got: dict[str, Any] = queue.get(timeout=1.0)
            return got
        if not child.is_alive() and queue.empty():
            raise RuntimeError(f"the {child.name} child died (exit code {child.exitcode}) without a result")
    raise TimeoutError(f"no result from {child.name} within {timeout_s:.0f} s")


def merge_round(
    preset: str, max_steps: int, timeout_s: float, *, params_on_disk: bool = False
) -> dict[str, Any]:
    """The llama-124m round: syncer, learner, then the late joiner, each its own process; `params_on_disk`: the
    syncer keeps its global parameters in spill files (`[syncer] params_on_disk`)."""
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    syncer = ctx.Process(target=_child, args=("syncer", preset, queue, (stop, params_on_disk)))
    syncer.start()
    try:
        info = queue.get(timeout=timeout_s)
        results: dict[str, Any] = {"syncer_setup_peak_rss": info["setup_peak"]}
        for kind, extra in (("learner", (info, max_steps)), ("joiner", info)):
            child = ctx.Process(target=_child, args=(kind, preset, queue, extra))
            child.start()
            got = result_of(queue, child, timeout_s)
            results[got.pop("party")] = got
            child.join(30)
        stop.set()
        got = queue.get(timeout=timeout_s)
        results[got.pop("party")] = got
        return results
    finally:
        stop.set()
        syncer.join(30)
        if syncer.is_alive():
            syncer.kill()


# ---------------------------------------------------------------------------------------------- llama-1b


def synthetic(core: Any, fragment: int, gen: Any) -> dict[str, Any]:
    """A learner's fragment: the global tensors plus a little noise (what the syncer holds per contribution)."""
    import torch

    params = {}
    for name, tensor in core.fragment_tensors(fragment).items():
        params[name] = torch.randn(tensor.shape, generator=gen).mul_(1e-3).add_(tensor)
    return params


def synthetic_on_disk(core: Any, fragment: int, gen: Any) -> Any:
    """`synthetic`, built a chunk at a time straight into a file of the core's spill directory: a push as a route that
    streamed its payload to disk would hand it over (not how the syncer's route takes one yet: docs/scale.md)."""
    import torch

    from node.diloco import chunked

    current = core.fragment_tensors(fragment)
    spill = core.history.spill
    out = spill.create(spill.new_key("push"), [(n, tuple(t.shape)) for n, t in current.items()])
    for name, tensor in current.items():
        for start, stop in chunked.ranges(tensor.numel()):
            noise = torch.randn(stop - start, generator=gen).mul_(1e-3)
            out.put(name, start, noise.add_(tensor.view(-1)[start:stop]))
    return out


def copying_probe(run: Any) -> Any:
    """On a tree before the probe's skeleton (`--core` on an older checkout, to measure the difference): the probe
    as it was, a model of its own the scored parameters are copied into."""
    import torch

    from node.diloco.loss_probe import LossProbe
    from node.ml.data import evaluate
    from node.ml.model import ModelConfig, build_model

    cfg = ModelConfig.from_dict(run.model)
    model, held = (
        build_model(cfg, run.seed),
        [learnable_batch(cfg.vocab_size, 2, seed=1000 + i) for i in range(2)],
    )

    def loss(params: Any) -> float:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(params[name])
        return evaluate(model, held)

    return LossProbe(loss)


def probe_score(scorer: Any, core: Any, fragment: int, params: dict[str, Any]) -> Any:
    """The held-out score of a contribution on base version 0, as the syncer's push route takes it; its base is not
    held past the call (kept in a variable of the round's loop, it held a replaced version through the next
    fragment's merge: one fragment more in the 1B core's peak)."""
    from node.diloco.syncer_core import probe_base

    base = probe_base(core, fragment, 0)
    if scorer is None or base is None:
        return None
    return scorer.measure(dict(core.params), tuple(core.versions), base, params, time.perf_counter)


def push_and_accept(
    core: Any, scorer: Any, fragment: int, peer: int, gen: Any, meter: PhasePeaks, push: str = "memory"
) -> str | None:
    """One synthetic contribution built (and scored by the probe, when on: phase `push`) and accepted by the core
    (phase `accept`); the refusal's reason, if refused. `push` "disk": built into a spill file
    (`synthetic_on_disk`); "memory": in memory (`synthetic`). ("route" goes through `RoutePusher`.)"""
    from node.diloco.spill import release_freed_memory
    from node.diloco.syncer_core import Refusal

    params = synthetic_on_disk(core, fragment, gen) if push == "disk" else synthetic(core, fragment, gen)
    score = probe_score(scorer, core, fragment, params)
    meter.end("push")
    try:
        core.accept(
            f"peer-{peer}", fragment, params, base_version=0, steps=4, tokens=4 * SEQ, sched_step=4,
            step_time_s=1.0, nonce=bytes([peer]) * 16, now=time.monotonic() + 60.0, loss=score,
        )  # fmt: skip
    except Refusal as e:
        return e.reason
    finally:
        del params  # the caller's reference: the push goes once accepted (the core holds it on disk)
        meter.end("accept")
    release_freed_memory()  # as the syncer's push route does once the push is dropped
    return None


class RoutePusher:
    """Synthetic pushes through the syncer's real push route (benchmarks.push_route): the stream is read into a
    file of the core's spill directory, opened and accepted by `SyncerService` as a learner's push over the network.
    Phase `push`: until the route's handler starts (the frame generated and received into its file); `accept`: the
    route (open, screen, accept) and its answer."""

    def __init__(self, run: Any, core: Any, scorer: Any, meter: PhasePeaks) -> None:
        from benchmarks.push_route import push_route
        from node.roles.syncer_rpc import SyncerService
        from protocol.identity import NodeIdentity

        self.loop = asyncio.new_event_loop()
        self.host = Host(run, NodeIdentity.generate(), core, scorer)
        self.service = SyncerService(self.host)  # type: ignore[arg-type]
        handle = self.service._handle_push

        async def timed(frame: Any, remote: str) -> bytes:
            meter.end("push")
            return await handle(frame, remote)

        self.service._handle_push = timed  # type: ignore[method-assign]
        self.handler = self.loop.run_until_complete(push_route(self.service))
        self.learners: dict[int, Any] = {}
        self.meter, self.files = meter, 0

    def push(self, fragment: int, peer: int) -> str | None:
        from benchmarks.push_route import PushStream, send_push
        from protocol.identity import NodeIdentity

        learner = self.learners.setdefault(peer, NodeIdentity.generate())
        current = self.host.core.fragment_tensors(fragment)
        stream = PushStream(learner, self.host.ctx.peer_id, RUN_ID, current, fragment)
        del current
        reason = self.loop.run_until_complete(send_push(self.handler, learner, stream))
        self.meter.end("accept")
        entry = self.host.core.rounds.get(fragment)
        held = entry.entries.get(learner.peer_id) if entry is not None else None
        self.files += held is not None and getattr(held.contribution.params, "key", "").startswith(".frame-")
        return reason

    def close(self) -> None:
        self.loop.close()


def core_round(
    preset: str, contributors: int, probe: bool | dict[str, Any], num_fragments: int = 4, push: str = "memory"
) -> dict[str, Any]:
    """A syncer core merging every fragment of `preset` from synthetic contributions, each scored by the held-out
    loss probe first (`probe`), in this process; then a checkpoint written from its snapshot. Peak RSS after
    building (`setup`), after the round and per phase (`PhasePeaks`: `push`, `accept`, `merge`, `checkpoint`; the
    RSS right after each, `merge`'s being what the core holds between rounds), and the process before the model
    (`process_rss`: the interpreter and its imports)."""
    import torch

    from node.diloco.screening import ScreeningConfig
    from node.ml.checkpoint import CheckpointStore
    from node.ml.model import ModelConfig, build_model

    process_rss = current_rss_bytes()
    run = manifest(preset, num_fragments=num_fragments)
    model = build_model(ModelConfig.from_dict(run.model), run.seed)
    spill = tempfile.TemporaryDirectory(dir=os.environ.get("SCALE_CKPT_DIR"))
    core = new_core(run, dict(model.named_parameters()), ScreeningConfig(loss_probe=probe), Path(spill.name))
    del model
    try:
        options = probe_options(probe)
        scorer = build_probe_for(run, **options) if options is not None else None
    except ImportError:
        scorer = copying_probe(run)
    setup_peak, started, merged, refused = peak_rss_bytes(), time.perf_counter(), 0, []
    meter = PhasePeaks()  # resets the high-water mark: peaks from here are the meter's
    gen = torch.Generator().manual_seed(0)
    route = RoutePusher(run, core, scorer, meter) if push == "route" else None
    for fragment in range(core.plan.num_fragments):
        for peer in range(contributors):
            if route is not None:
                reason = route.push(fragment, peer)
            else:
                reason = push_and_accept(core, scorer, fragment, peer, gen, meter, push)
            if reason is not None:
                refused.append(reason)
        merged += core.merge_now(fragment, contributors, time.monotonic() + 60.0) is not None
        meter.end("merge")
    round_s, round_peak = time.perf_counter() - started, max(setup_peak, meter.overall)
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCALE_CKPT_DIR")) as tmp:
        saved = time.perf_counter()
        CheckpointStore(Path(tmp), RUN_ID, keep=1).save(core.snapshot(RUN_ID, 1))
        checkpoint_s = time.perf_counter() - saved
    meter.end("checkpoint")
    spill.cleanup()
    if route is not None:
        route.close()
    return {
        "push_path": push,  # memory | disk (built into a spill file) | route (received by the push route)
        "pushes_held_as_received": route.files if route is not None else None,
        "process_rss": process_rss,
        "setup_peak_rss": setup_peak,
        "round_peak_rss": round_peak,
        "peak_rss": max(setup_peak, meter.overall),
        **meter.report(),
        "fragments_merged": merged,
        "num_fragments": core.plan.num_fragments,
        "refused": refused,
        "probe": probe_status(scorer),
        "probe_options": probe_options(probe),
        "round_s": round(round_s, 2),
        "checkpoint_s": round(checkpoint_s, 2),
    }


def child_peak_rss(pid: int | None) -> int | None:
    """VmHWM (peak RSS) of a live child, from /proc (None if unreadable)."""
    return (status_bytes("VmHWM", pid) or None) if pid is not None else None


def run_core(
    preset: str,
    contributors: int,
    probe: bool | dict[str, Any],
    timeout_s: float,
    num_fragments: int = 4,
    push: str = "memory",
) -> dict[str, Any]:
    """`core_round` in a child process, killed if the machine runs short of memory (other work shares it)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    extra = (contributors, probe, num_fragments, push)
    child = ctx.Process(target=_child, args=("core", preset, queue, extra))
    child.start()
    deadline, lowest, reached = time.monotonic() + timeout_s, available_bytes(), 0
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(queue_module.Empty):
                return {**queue.get(timeout=0.5), "lowest_available_bytes": lowest}
            lowest = min(lowest, available_bytes() or lowest)
            # the child resets its high-water mark per phase (`PhasePeaks`): the highest of the polled ones
            reached = max(reached, child_peak_rss(child.pid) or 0)
            if lowest < MIN_FREE:
                child.kill()
                why = f"killed: the machine's available memory fell under {MIN_FREE / GiB:.0f} GiB"
                return {"skipped": why, "peak_rss_when_killed": reached, "lowest_available_bytes": lowest}
            if not child.is_alive() and queue.empty():
                return {"skipped": f"the child died (exit code {child.exitcode})"}
        return {"skipped": f"no result within {timeout_s:.0f} s"}
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def stage_slice(preset: str, num_stages: int) -> dict[str, Any]:
    """Parameter bytes of each pipeline stage of `preset` (meta device: nothing allocated)."""
    import torch

    from node.ml.model import ModelConfig, StageModule, stage_spans

    cfg = ModelConfig.from_dict(manifest(preset).model)
    spans = stage_spans(cfg.num_layers, num_stages)
    counts = []
    for index, span in enumerate(spans):
        with torch.device("meta"):
            stage = StageModule(cfg, span, is_first=index == 0, is_last=index == num_stages - 1)
        counts.append(sum(p.numel() for p in stage.parameters()))
    return {"num_stages": num_stages, "params": counts, "largest_bytes": max(counts) * 4}


# ---------------------------------------------------------------------------------------------- report


def ratio(peak: int | None, size: dict[str, int]) -> float | None:
    if peak is None:
        return None
    return round(peak / (size["model_bytes"] + 2 * size["fragment_bytes"]), 3)


def part_1b(args: argparse.Namespace, fragments: int = FRAGMENTS_1B) -> dict[str, Any]:
    """The llama-1b syncer core at `fragments` a stage, guarded: skipped (with the reason) unless the memory it needs
    is free: the global parameters (the older versions, the momentum, the screen's direction and the round's
    contributions are on disk) plus a merge's outer gradient, the contribution being accepted, the process and a
    margin."""
    size = sizes(manifest("llama-1b", num_fragments=fragments))
    need = int(size["model_bytes"] + 4 * size["fragment_bytes"] + 1.0 * GiB)
    free = available_bytes()
    out: dict[str, Any] = {
        **size,
        "fragments_per_stage": fragments,
        "need_bytes": need,
        "available_bytes": free,
    }
    if args.quick or args.model != "llama-124m":
        return {**out, "skipped": "quick mode: llama-124m only"}
    if free < need:
        return {**out, "skipped": f"{free / GiB:.1f} GiB available < {need / GiB:.1f} GiB needed"}
    push = args.push or "route"  # through the syncer's push route (received into a spill file), as deployed
    out.update(run_core("llama-1b", 2, probe_1b(args), timeout_s=3000, num_fragments=fragments, push=push))
    return out


def probe_1b(args: argparse.Namespace) -> bool | dict[str, Any]:
    """The 1B core's probe from the command line: off unless `--probe-1b` (its mode and held-out batches)."""
    mode = getattr(args, "probe_1b", None)
    if mode is None:
        return False
    return {"mode": mode, "batches": args.probe_batches, "rows": args.probe_rows, "tokens": args.probe_tokens}


def record_core(
    path: Path, key: str, result: dict[str, Any], fragments: int, command: str, started: str
) -> None:
    """A `--core llama-1b` run recorded under `runs[key]` of the results JSON `path` (scratch runs: the probe on, a
    P other than the headline's), with its ratio to the goal, the command and the commit it ran on."""
    from benchmarks.common import machine_info

    size = sizes(manifest("llama-1b", num_fragments=fragments))
    payload = json.loads(path.read_text()) if path.exists() else {"name": path.stem, "runs": {}}
    payload.setdefault("machine", machine_info())
    peak = result.get("peak_rss")
    runs = payload.setdefault("runs", {})
    # a repeat never replaces a recorded run: it goes under `key_2`, `key_3`, ...
    key = next(k for k in [key, *(f"{key}_{n}" for n in range(2, 1000))] if k not in runs)
    runs[key] = {
        "command": command,
        "tree": git_head(),
        "started": started,
        "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model_bytes": size["model_bytes"],
        "fragment_bytes": size["fragment_bytes"],
        "goal_bytes": size["model_bytes"] + 2 * size["fragment_bytes"],
        "syncer_rss_ratio_1b": ratio(peak, size),
        "syncer_peak_gib_1b": round(peak / GiB, 3) if peak else None,
        **result,
    }
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")


def git_head() -> str | None:
    """The commit this tree is at, with "+dirty" when it has uncommitted changes (None: not a git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def headline_1b(big: dict[str, Any]) -> dict[str, Any]:
    merged = big.get("fragments_merged") == big.get("num_fragments") and "skipped" not in big
    ratio_1b = ratio(big.get("peak_rss"), big)
    killed = big.get("peak_rss_when_killed")
    return {
        "merged_1b": bool(merged),
        "syncer_rss_ratio_1b": ratio_1b,
        "syncer_peak_gib_1b": round(big["peak_rss"] / GiB, 3) if "peak_rss" in big else None,
        "skipped_1b": big.get("skipped"),
        # killed for memory: the ratio it had reached by then, a lower bound of the peak's
        "syncer_rss_ratio_1b_at_least": ratio(killed, big) if killed else None,
        "syncer_goal_met_1b": ratio_1b is not None and ratio_1b <= 1.0,
        "syncer_peak_phase_1b": peak_phase(big),
    }


def peak_phase(core: dict[str, Any]) -> str | None:
    """The phase of a core round (`PhasePeaks`) whose peak was the round's (`setup` if none was higher)."""
    peaks = core.get("phase_peak_rss") or {}
    if not peaks or "peak_rss" not in core:
        return None
    phase = max(peaks, key=peaks.__getitem__)
    return str(phase) if peaks[phase] >= core["peak_rss"] else "setup"


def headline(model: str, rnd: dict[str, Any], big: dict[str, Any], stage: dict[str, Any]) -> dict[str, Any]:
    size = sizes(manifest(model))
    syncer, learner, joiner = rnd["syncer"], rnd["learner"], rnd["joiner"]
    return {
        "model": model,
        **headline_1b(big),
        "state_transfer_s_124m": joiner["state_transfer_s"] if model == "llama-124m" else None,
        "state_transfer_s": joiner["state_transfer_s"],
        "syncer_peak_gib": round(syncer["peak_rss"] / GiB, 3),
        "learner_peak_gib": round(learner["peak_rss"] / GiB, 3),
        "syncer_rss_ratio": ratio(syncer["peak_rss"], size),
        "model_gib": round(size["model_bytes"] / GiB, 3),
        "fragment_gib": round(size["fragment_bytes"] / GiB, 3),
        "round_merged": min(int(v) for v in learner["versions"].values()) >= 1,
        "stage_slice_gib_1b": round(stage["largest_bytes"] / GiB, 3),
    }


def only_1b(args: argparse.Namespace, out: Path) -> int:
    """Rerun the 1B part alone (when the machine is quiet) into an existing results JSON; at another fragment count
    than FRAGMENTS_1B (`--fragments-1b`), into keys of its own (`core_1b_p4`, `syncer_rss_ratio_1b_p4`, ...)."""
    path = out / f"{NAME}.json"
    payload = json.loads(path.read_text())
    fragments = args.fragments_1b
    big = part_1b(args, fragments)
    suffix = "" if fragments == FRAGMENTS_1B else f"_p{fragments}"
    payload[f"core_1b{suffix}"] = big
    payload["headline"].update({key + suffix: value for key, value in headline_1b(big).items()})
    payload[f"measured_at_1b{suffix}"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    plot(payload["headline"], payload["core_1b"], out / f"{NAME}.png", payload.get("core_1b_p4"))
    print(json.dumps(payload["headline"], indent=2))
    return 0


def only_core(args: argparse.Namespace, out: Path) -> int:
    """Rerun the syncer core of `--model` (with the probe) alone into an existing results JSON."""
    path = out / f"{NAME}.json"
    payload = json.loads(path.read_text())
    core = run_core(args.model, 2, True, timeout_s=900)
    payload["core"] = core
    payload["headline"]["syncer_core_peak_gib"] = round(core["peak_rss"] / GiB, 3)
    payload["headline"]["syncer_core_rss_ratio"] = ratio(core["peak_rss"], sizes(manifest(args.model)))
    payload["measured_at_core"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    plot(payload["headline"], payload["core_1b"], out / f"{NAME}.png", payload.get("core_1b_p4"))
    print(json.dumps(payload["headline"], indent=2))
    return 0


def only_round(args: argparse.Namespace, out: Path) -> int:
    """Rerun the merge round of `--model` (syncer, learner and late joiner processes) alone into an existing results
    JSON: for the headline's model into `round` and the headline's keys, for another model into keys of its own
    (`round_llama-350m`, headline `syncer_peak_gib_llama-350m`, ...); with `--params-on-disk` (the syncer's global
    parameters in spill files) every key further suffixed `_params_on_disk`."""
    path = out / f"{NAME}.json"
    payload = json.loads(path.read_text())
    rnd = merge_round(args.model, args.max_steps, timeout_s=1800, params_on_disk=args.params_on_disk)
    size = sizes(manifest(args.model))
    syncer, learner = rnd["syncer"], rnd["learner"]
    keys = {
        "syncer_peak_gib": round(syncer["peak_rss"] / GiB, 3),
        "learner_peak_gib": round(learner["peak_rss"] / GiB, 3),
        "syncer_rss_ratio": ratio(syncer["peak_rss"], size),
        "round_merged": min(int(v) for v in learner["versions"].values()) >= 1,
        "state_transfer_s": rnd["joiner"]["state_transfer_s"],
    }
    same = args.model == payload["headline"]["model"]
    suffix = ("" if same else f"_{args.model}") + ("_params_on_disk" if args.params_on_disk else "")
    payload[f"round{suffix}"] = rnd
    payload["headline"].update({key + suffix: value for key, value in keys.items()})
    if not same and not args.params_on_disk:
        payload["headline"][f"model_gib{suffix}"] = round(size["model_bytes"] / GiB, 3)
        payload["headline"][f"fragment_gib{suffix}"] = round(size["fragment_bytes"] / GiB, 3)
    elif args.model == "llama-124m" and not suffix:
        payload["headline"]["state_transfer_s_124m"] = keys["state_transfer_s"]
    payload[f"measured_at_round{suffix}"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    plot(payload["headline"], payload["core_1b"], out / f"{NAME}.png", payload.get("core_1b_p4"))
    print(json.dumps(payload["headline"], indent=2))
    return 0


def only_data(out: Path) -> int:
    """Rerun the data part (`benchmarks.data_scale`: prepare and download throughput, the learner's reader under a
    memory budget 4x smaller than the dataset) into an existing results JSON: `data`, headline keys `data_*`."""
    path = out / f"{NAME}.json"
    payload = json.loads(path.read_text())
    payload["data"] = measure_data()
    payload["headline"].update(data_scale.headline(payload["data"]))
    payload["measured_at_data"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    data_scale.plot(payload["data"], out / f"{NAME}_data.png")
    print(json.dumps(payload["headline"], indent=2))
    return 0


def measure_data() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="scale-data-") as work:
        return data_scale.run(data_scale.DataScaleConfig(), Path(work))


def plot(head: dict[str, Any], big: dict[str, Any], path: Path, big_p4: dict[str, Any] | None = None) -> None:
    """Peak RSS per party against its goal (the syncer: model + 2 fragments; others: the model's bytes); the 1B core,
    when killed for memory, as a hatched bar of what it had reached (a lower bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    goal = head["model_gib"] + 2 * head["fragment_gib"]
    bars = [
        (f"syncer\n{head['model']}", head["syncer_peak_gib"], goal, ""),
        (f"syncer core\n{head['model']}", head.get("syncer_core_peak_gib") or 0.0, goal, ""),
        (f"learner\n{head['model']}", head["learner_peak_gib"], head["model_gib"], ""),
    ]
    goal_1b = (big["model_bytes"] + 2 * big["fragment_bytes"]) / GiB
    killed = big.get("peak_rss_when_killed")
    if head["syncer_peak_gib_1b"] is not None:
        bars.append(("syncer core\nllama-1b", head["syncer_peak_gib_1b"], goal_1b, ""))
    elif killed:
        bars.append(("syncer core\nllama-1b (killed)", killed / GiB, goal_1b, "//"))
    if big_p4 is not None and big_p4.get("peak_rss"):
        goal_p4 = (big_p4["model_bytes"] + 2 * big_p4["fragment_bytes"]) / GiB
        bars.append(("syncer core\nllama-1b P=4", big_p4["peak_rss"] / GiB, goal_p4, ""))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for x, (_, peak, _, hatch) in enumerate(bars):
        ax.bar(x, peak, color="tab:blue", hatch=hatch, label="peak RSS" if x == 0 else None)
    ax.scatter(range(len(bars)), [b[2] for b in bars], color="tab:red", marker="_", s=2500, label="goal")
    ax.set_xticks(list(range(len(bars))), [b[0] for b in bars])
    ax.set_ylabel("GiB")
    ax.set_title(f"peak RSS through a merge round; late joiner state in {head['state_transfer_s']:.1f} s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the llama-124m round only")
    parser.add_argument(
        "--model", default="llama-124m", help="preset of the merge round (llama-tiny in tests)"
    )
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--core", default=None, help="only a syncer core's round of this preset, printed")
    parser.add_argument("--only-1b", action="store_true", help="rerun the 1B part into the existing JSON")
    parser.add_argument(
        "--push-on-disk",
        dest="push",
        action="store_const",
        const="disk",
        help="each push of the core built straight into a spill file, handed to SyncerCore.accept",
    )
    parser.add_argument(
        "--push-in-memory",
        dest="push",
        action="store_const",
        const="memory",
        help="each push of the core built in memory and handed to SyncerCore.accept (--core's default)",
    )
    parser.add_argument(
        "--push-route",
        dest="push",
        action="store_const",
        const="route",
        help="each push sent through the syncer's push route, received into a spill file (the 1B part's default)",
    )
    parser.add_argument(
        "--fragments-1b", type=int, default=FRAGMENTS_1B, help="fragments a stage of the 1B part"
    )
    parser.add_argument(
        "--probe-1b",
        nargs="?",
        const="streamed",
        choices=["streamed", "whole"],
        default=None,
        help="the 1B core (--core llama-1b, --only-1b) scores each push with the held-out loss probe (off by default: "
        "minutes of CPU per contribution); whole: the contribution applied built whole (the probe before streaming)",
    )
    parser.add_argument("--probe-batches", type=int, default=2, help="held-out batches of the 1B probe")
    parser.add_argument(
        "--probe-rows", type=int, default=2, help="sequences per held-out batch of the 1B probe"
    )
    parser.add_argument(
        "--probe-tokens",
        type=int,
        default=SEQ,
        help="tokens per held-out sequence of the 1B probe (the syncer's screening.loss_sequence_tokens is 256)",
    )
    parser.add_argument(
        "--record",
        nargs=2,
        metavar=("FILE", "KEY"),
        default=None,
        help="with --core llama-1b: also record the run under `runs[KEY]` of the results JSON FILE (created if "
        "missing; its other runs kept), with the command, the commit and the ratio (scratch runs, not the headline)",
    )
    parser.add_argument(
        "--only-core", action="store_true", help="rerun the --model core into the existing JSON"
    )
    parser.add_argument(
        "--only-round", action="store_true", help="rerun the --model merge round into the existing JSON"
    )
    parser.add_argument(
        "--params-on-disk",
        action="store_true",
        help="with --only-round: the syncer keeps its global parameters on disk ([syncer] params_on_disk)",
    )
    parser.add_argument(
        "--only-data",
        action="store_true",
        help="rerun the data part (benchmarks.data_scale) into the existing JSON",
    )
    args = parser.parse_args(argv)
    if args.core:  # e.g. on an older checkout, to measure what a change saved
        fragments = args.fragments_1b if args.core == "llama-1b" else 4
        probe = probe_1b(args) if args.core == "llama-1b" else True
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result = run_core(args.core, 2, probe, 3000, fragments, args.push or "memory")
        if args.record is not None:
            command = "python -m benchmarks.scale " + " ".join(argv if argv is not None else sys.argv[1:])
            record_core(Path(args.record[0]), args.record[1], result, fragments, command, started)
        print(json.dumps(result, indent=2))
        return 0
    from benchmarks.common import RESULTS_DIR, machine_info

    out = args.out or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    if args.only_1b:
        return only_1b(args, out)
    if args.only_core:
        return only_core(args, out)
    if args.only_round:
        return only_round(args, out)
    if args.only_data:
        return only_data(out)
    rnd = merge_round(args.model, args.max_steps, timeout_s=900)
    core = run_core(args.model, 2, True, timeout_s=900)
    big = part_1b(args)
    stage = stage_slice("llama-1b", 4)
    head = headline(args.model, rnd, big, stage)
    head["syncer_core_peak_gib"] = round(core["peak_rss"] / GiB, 3)
    head["syncer_core_rss_ratio"] = ratio(core["peak_rss"], sizes(manifest(args.model)))
    data = None if args.quick else measure_data()
    head.update(data_scale.headline(data) if data else {"data_skipped": "quick"})
    payload = {
        "name": NAME,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "command": "python -m benchmarks.scale" + (" --quick" if args.quick else ""),
        "headline": head,
        "round": rnd,
        "core": core,
        "core_1b": big,
        "stage_1b": stage,
        "data": data,
    }
    (out / f"{NAME}.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    if data:
        data_scale.plot(data, out / f"{NAME}_data.png")
    plot(head, big, out / f"{NAME}.png")  # (a P = 4 bar only once `--only-1b --fragments-1b 4` added it)
    print(json.dumps(head, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
