"""The pipeline stage role: serves layers [a, b) of the run's model to authorized verifiers.

Three layers, from pure to networked:

* `StageCore` (no network, no asyncio): the stage's `StageModule`, its AdamW, the autograd context of every
  microbatch between its forward and its backward, gradient accumulation and the idempotency ledger. All its
  methods run on one thread (the service's compute thread), so its state needs no lock.
  Forward passes run on a *snapshot* of the weights (a detached copy taken after each optimizer step or
  DiLoCo overwrite) through `torch.func.functional_call`: an optimizer step therefore never invalidates the
  graph of a microbatch still waiting for its backward (PipeDream's weight stashing), and several
  microbatches can be in flight at once. Gradients of each microbatch are computed explicitly
  (`torch.autograd.grad`) and accumulated, weighted by its sequences, into a sum that becomes `.grad` (the
  batch mean) when `inner.batch_size` sequences are in; then AdamW steps.
* `StageService`: the wire. Routes `stage.forward`, `stage.backward`, `stage.receipt` for a `FramedServer`;
  each handler checks that the caller is an authorized verifier of the manifest (else `UnauthorizedCaller`,
  a typed refusal), opens the signed envelope, runs the core on the compute thread and signs its answer
  (activation on forward, input gradient on backward; the last stage answers a forward with the loss and the
  input gradient at once).
* `StageRole`: the node role (`--role stage --stage N`): P2P from the node's DHT daemon, the DiLoCo
  `FragmentSync` for the span's fragments, context expiry, heartbeat fields (throughput, load) and the
  periodic rebalancing check (`node.pipeline.routing.Rebalancer`).

Idempotency (docs/pipeline.md): the key is (run, verifier, microbatch, stage, direction). A backward is applied
at most once; a retried backward is answered from cache; a forward for a microbatch whose backward was applied
is refused (`already applied`); a repeated forward whose context is still held is answered from cache.

Token receipts (signed by verifiers, format in `protocol.receipts.TokenReceipt`) are accepted on `stage.receipt` and kept, newest
per verifier session, for the syncer to weight this replica's contributions by verified tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.func import functional_call

from node.config import component_config
from node.ml.device import autocast, to_device, to_wire, to_wire_optional
from node.ml.model import ModelConfig, StageModule, build_stage, stage_spans
from node.pipeline.routing import (
    IdempotencyKey,
    IdempotencyLedger,
    LedgerConfig,
    Phase,
    RebalanceConfig,
    Rebalancer,
    ReplicaInfo,
    Verdict,
    effective_throughputs,
)
from node.roles.registry import measurements_of
from node.swarm.bans import ban_watcher_for
from protocol import boundary_codec
from protocol.codec import TensorLimits
from protocol.envelope import (
    Context,
    Direction,
    Header,
    Kind,
    Opened,
    StreamingFrame,
    max_frame_bytes,
    open_envelope,
    seal_streaming,
)
from protocol.errors import TensorPolicyError, WrongContext
from protocol.identity import NodeIdentity
from protocol.limits import Admission, RateLimit
from protocol.manifest import InnerOptimizerSpec, RunManifest
from protocol.pipeline import (
    ALREADY_APPLIED,
    APPLIED_META,
    BACKWARD_RPC,
    EVAL_META,
    FORWARD_RPC,
    GRAD_OUTPUT,
    INPUT_DIGEST_META,
    LOSS_META,
    MAX_CONTROL_BYTES,
    NO_CONTEXT,
    NOT_SERVING,
    PIPELINE_REPLAY,
    RECEIPT_RPC,
    RECOMPUTE_GRAD_META,
    STALE_MICROBATCH,
    TARGETS,
    BoundaryShape,
    StageRefusal,
    UnauthorizedCaller,
)
from protocol.receipts import TokenReceipt, open_receipt
from protocol.replay import ReplayGuard
from protocol.rpc import FramedServer, PeerStrikes, Route
from verification.attacks import Attack, announce_factor_from_env, attack_from_env

if TYPE_CHECKING:
    from node.context import NodeContext

logger = logging.getLogger(__name__)

T = TypeVar("T")

STAGE_ENV = (
    "HIVENODE_STAGE"  # overrides of StageConfig, "key=value,key=value" (read once, when the role is built)
)


# ---------------------------------------------------------------------------------------------------- config


@dataclass(frozen=True, kw_only=True, slots=True)
class StageConfig:
    """Settings of one stage replica (the model, optimizer and stage count come from the manifest)."""

    max_contexts: int = 32  # microbatches held between forward and backward; past it the oldest is dropped
    context_timeout_s: float = 120.0  # a context whose backward does not come within this is dropped
    sweep_period_s: float = 5.0  # how often expired contexts are looked for
    throughput_ema: float = 0.2  # weight of a new measurement in the announced tokens/s
    compute_threads: int = 0  # torch intra-op threads of this process; 0 = torch's default
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    rebalance_enabled: bool = True  # run the periodic "move to a starved stage?" check
    join_timeout_s: float = 30.0  # how long a late joiner waits for the syncer's global version
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    max_receipts: int = 64  # verifier sessions whose latest receipt is kept
    recent_applied: int = 4096  # applied microbatch ids shown in status (for audits and tests)
    # Per-verifier request rates (`protocol.limits`): one microbatch is one forward and one backward here, plus
    # held-out forwards and retries. 100/s sustained is several times what one verifier drives through the
    # smallest model (~30 microbatches/s with 8 in flight); the burst covers an evaluation round at once.
    forward_rate_per_s: float = 100.0
    forward_burst: float = 200.0
    backward_rate_per_s: float = 100.0
    backward_burst: float = 200.0
    receipt_rate_per_s: float = 1.0  # a verifier sends one per replica every `receipt_every_s` (10 s)
    receipt_burst: float = 10.0

    def __post_init__(self) -> None:
        if self.max_contexts < 1:
            raise ValueError(f"max_contexts must be >= 1, got {self.max_contexts}")
        for name in ("context_timeout_s", "sweep_period_s", "join_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 < self.throughput_ema <= 1:
            raise ValueError(f"throughput_ema must be in (0, 1], got {self.throughput_ema}")
        if self.compute_threads < 0 or self.max_receipts < 1 or self.recent_applied < 0:
            raise ValueError("compute_threads >= 0, max_receipts >= 1, recent_applied >= 0")
        for route in ("forward", "backward", "receipt"):
            RateLimit(rate_per_s=getattr(self, f"{route}_rate_per_s"), burst=getattr(self, f"{route}_burst"))

    def route_rates(self) -> dict[str, RateLimit]:
        """Per-peer rate of each stage RPC (what `StageService.routes` gives the server)."""
        return {
            FORWARD_RPC: RateLimit(rate_per_s=self.forward_rate_per_s, burst=self.forward_burst),
            BACKWARD_RPC: RateLimit(rate_per_s=self.backward_rate_per_s, burst=self.backward_burst),
            RECEIPT_RPC: RateLimit(rate_per_s=self.receipt_rate_per_s, burst=self.receipt_burst),
        }


# ---------------------------------------------------------------------------------------------------- wire caps


# ---------------------------------------------------------------------------------------------------- the core


@dataclass(slots=True)
class _Context:
    """What a microbatch's backward needs: the graph from its input (or tokens) to its output."""

    created_at: float
    x: torch.Tensor | None  # the input leaf (None on the first stage: tokens have no gradient)
    output: torch.Tensor
    leaves: dict[str, torch.Tensor]  # the weight snapshot this forward ran on
    sequences: int
    tokens: int
    tokens_in: torch.Tensor | None = None  # the first stage's input tokens, to recognise a retry


SLOW_SAMPLE_CAP = 4.0  # a compute-time sample counts as at most this many times the current estimate
_NO_GRAD = object()  # cached result of an applied backward on the first stage (nothing to send back)


@dataclass(slots=True)
class StageCounters:
    microbatches_served: int = 0  # forwards computed (training and eval)
    microbatches_applied: int = 0  # backwards applied (each microbatch once)
    tokens: int = 0  # tokens of applied microbatches
    answered_from_cache: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    contexts_dropped: dict[str, int] = field(default_factory=dict)
    compute_s: float = 0.0


class StageCore:
    """One stage's model, optimizer, contexts and ledger. Not thread-safe: call from one thread."""

    def __init__(
        self,
        module: StageModule,
        *,
        stage: int,
        run_id: str,
        inner: InnerOptimizerSpec,
        shape: BoundaryShape,
        config: StageConfig | None = None,
        on_step: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        device: str = "cpu",
    ) -> None:
        """`device`: where the module, its fp32 master weights, the optimizer state and every microbatch's
        compute live (bf16 autocast on CUDA). The public methods take and return CPU tensors (the wire's):
        inputs move to the device on entry, answers come back as CPU fp32 (`node.ml.device`)."""
        self.device = torch.device(device)
        self.module = module.to(self.device)  # before the optimizer: AdamW's state follows its parameters
        self.module.train()
        self.stage = stage
        self.run_id = run_id
        self.inner = inner
        self.shape = shape
        self.config = config or StageConfig()
        self.on_step = on_step
        self.clock = clock
        self.is_first = module.is_first
        self.is_last = module.is_last
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=inner.lr, weight_decay=inner.weight_decay)
        self.params = dict(module.named_parameters())
        self.ledger = IdempotencyLedger(self.config.ledger)
        self.counters = StageCounters()
        self.inner_step = 0
        self.train_loss: float | None = None  # EMA, last stage only
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._contexts: OrderedDict[tuple[str, int], _Context] = OrderedDict()
        self._grad_sum: dict[str, torch.Tensor] = {}
        self._acc_sequences = 0
        self._acc_tokens = 0
        self._sec_per_token: float | None = None

    # ---- status

    @property
    def span(self) -> tuple[int, int]:
        return self.module.span

    @property
    def num_contexts(self) -> int:
        return len(self._contexts)

    @property
    def throughput(self) -> float:
        """Measured tokens/s of forward plus backward compute (0 before the first measurement)."""
        spt = self._sec_per_token
        return 0.0 if spt is None or spt <= 0 else 1.0 / spt

    def accumulated_gradients(self) -> dict[str, torch.Tensor]:
        """The batch-mean gradient accumulated since the last step (what `.grad` will be at the next one), on the
        compute device."""
        if self._acc_sequences == 0:
            return {}
        return {name: total / self._acc_sequences for name, total in self._grad_sum.items()}

    def assume_throughput(self, tokens_per_s: float) -> None:
        """Start from an estimate (a replica that moved stages: its speed per layer, carried over) until measured."""
        if math.isfinite(tokens_per_s) and tokens_per_s > 0:
            self._sec_per_token = 1.0 / tokens_per_s

    def weights_changed(self) -> None:
        """Call after the parameters were overwritten (DiLoCo version): later forwards use the new values."""
        self._snapshot = None

    # ---- forward

    def forward(self, sender: str, microbatch: int, x: torch.Tensor) -> torch.Tensor:
        """Training forward of a non-last stage; keeps the context until the backward. Idempotent."""
        assert not self.is_last, "the last stage answers forwards with forward_loss"
        self._check_input(x)
        key = self._key(sender, microbatch, Phase.BACKWARD)
        self._refuse_applied(key, "forward")
        x = to_device(x, self.device)
        held = self._contexts.get((sender, microbatch))
        if held is not None and self._same_input(held, x):  # a retry whose answer was lost: same output
            self.counters.answered_from_cache += 1
            return to_wire(held.output)
        if (
            held is not None
        ):  # the verifier rerouted upstream: a new input for this microbatch replaces the old
            del self._contexts[(sender, microbatch)]
        started = time.perf_counter()
        leaves = self._leaves()
        x_in = None if self.is_first else x.detach().requires_grad_(True)
        with torch.enable_grad(), autocast(self.device):
            # fp32 inside the graph: the backward's fp32 gradient then flows through the cast (bf16 on CUDA)
            output = functional_call(self.module, leaves, (x if x_in is None else x_in,)).float()
        context = _Context(
            self.clock(), x_in, output, leaves, *self._size(x), tokens_in=x if x_in is None else None
        )
        self._remember(sender, microbatch, context)
        self._measure(started, self._size(x)[1], share=1 / 3)
        self.counters.microbatches_served += 1
        return to_wire(output)

    @staticmethod
    def _same_input(held: _Context, x: torch.Tensor) -> bool:
        ref = held.tokens_in if held.x is None else held.x
        return ref is not None and ref.shape == x.shape and torch.equal(ref.detach(), x)

    def forward_eval(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Forward without context or ledger (held-out loss): activations, or the loss on the last stage."""
        self._check_input(x)
        if self.is_last:
            if targets is None:
                raise TensorPolicyError("the last stage needs targets", reason="missing targets")
            self.shape.check_tokens(targets, "targets")
        given = [x] if targets is None or not self.is_last else [x, targets]
        args = tuple(to_device(t, self.device) for t in given)
        self.module.eval()
        try:
            with torch.no_grad(), autocast(self.device):
                out = functional_call(self.module, self._leaves(), args)
        finally:
            self.module.train()
        self.counters.microbatches_served += 1
        return to_wire(out)

    def input_gradient(
        self, x: torch.Tensor, grad_output: torch.Tensor | None, targets: torch.Tensor | None
    ) -> torch.Tensor:
        """Gradient of this stage's input for `grad_output` (the loss on `targets` at the last stage), with the
        current weights and nothing kept or applied: a SENTINEL spot check's recomputation of a backward."""
        self._check_input(x)
        if self.is_first:
            raise TensorPolicyError("stage 0 has no input gradient", reason="bad tensors")
        x_in = to_device(x, self.device).detach().requires_grad_(True)
        with torch.enable_grad(), autocast(self.device):
            if self.is_last:
                if targets is None or tuple(targets.shape) != tuple(x.shape[:2]):
                    raise TensorPolicyError(
                        "the last stage needs targets of the input's [B, T]", reason="bad shape"
                    )
                self.shape.check_tokens(targets, "targets")
                out = functional_call(self.module, self._leaves(), (x_in, to_device(targets, self.device)))
                (grad,) = torch.autograd.grad(out.float(), [x_in])
            else:
                out = functional_call(self.module, self._leaves(), (x_in,)).float()
                if grad_output is None or tuple(grad_output.shape) != tuple(out.shape):
                    raise TensorPolicyError("the output gradient must match the output", reason="bad shape")
                (grad,) = torch.autograd.grad(out, [x_in], grad_outputs=to_device(grad_output, self.device))
        self.counters.microbatches_served += 1
        return to_wire(grad)

    def forward_loss(
        self, sender: str, microbatch: int, x: torch.Tensor, targets: torch.Tensor
    ) -> tuple[float, torch.Tensor | None]:
        """Last stage: forward, loss, backward and accumulation at once; (loss, input gradient). Idempotent."""
        assert self.is_last, "forward_loss is the last stage's forward"
        self._check_input(x)
        self.shape.check_tokens(targets, "targets")
        if tuple(targets.shape) != tuple(x.shape[:2]):
            raise TensorPolicyError("targets must match the input's [B, T]", reason="bad shape")
        key = self._key(sender, microbatch, Phase.BACKWARD)
        cached = self._cached_or_refuse(key)
        if cached is not None:
            assert isinstance(cached, tuple)  # the ledger stores what this method returned
            return cached[0], cached[1]
        started = time.perf_counter()
        leaves = self._leaves()
        x, targets = to_device(x, self.device), to_device(targets, self.device)
        x_in = None if self.is_first else x.detach().requires_grad_(True)
        with torch.enable_grad(), autocast(self.device):
            loss = functional_call(self.module, leaves, (x if x_in is None else x_in, targets)).float()
            inputs = ([] if x_in is None else [x_in]) + list(leaves.values())
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        input_grad = None if x_in is None else to_wire(grads[0])  # cached as answered: the wire's tensor
        sequences, tokens = self._size(x)
        loss_value = float(loss.detach())
        self.train_loss = loss_value if self.train_loss is None else 0.9 * self.train_loss + 0.1 * loss_value
        self.counters.microbatches_served += 1
        self._apply(key, list(leaves), grads[len(inputs) - len(leaves) :], sequences, tokens)
        self.ledger.mark_applied(key, (loss_value, input_grad))
        self._measure(started, tokens, share=1.0)
        return loss_value, input_grad

    # ---- backward

    def backward(self, sender: str, microbatch: int, grad_output: torch.Tensor) -> torch.Tensor | None:
        """Apply the gradient of this stage's output for a held context; the input gradient (None on stage 0)."""
        assert not self.is_last, "the last stage computes its backward in forward_loss"
        key = self._key(sender, microbatch, Phase.BACKWARD)
        cached = self._cached_or_refuse(key)
        if cached is not None:
            return None if cached is _NO_GRAD else cached  # type: ignore[return-value]
        context = self._contexts.get((sender, microbatch))
        if context is None:
            self._refuse(
                NO_CONTEXT, f"no context for microbatch {microbatch} (expired, dropped or never sent)"
            )
        assert context is not None
        if grad_output.dtype != torch.float32 or tuple(grad_output.shape) != tuple(context.output.shape):
            raise TensorPolicyError(
                f"gradient {tuple(grad_output.shape)} does not match the output {tuple(context.output.shape)}",
                reason="bad shape",
            )
        del self._contexts[(sender, microbatch)]
        started = time.perf_counter()
        inputs = ([] if context.x is None else [context.x]) + list(context.leaves.values())
        grad_output = to_device(grad_output, self.device)
        grads = torch.autograd.grad(context.output, inputs, grad_outputs=grad_output, allow_unused=True)
        input_grad = to_wire_optional(None if context.x is None else grads[0])  # cached as answered
        self._apply(
            key,
            list(context.leaves),
            grads[len(inputs) - len(context.leaves) :],
            context.sequences,
            context.tokens,
        )
        self.ledger.mark_applied(key, _NO_GRAD if input_grad is None else input_grad)
        self._measure(started, context.tokens, share=2 / 3)
        return input_grad

    # ---- contexts

    def expire(self) -> int:
        """Drop contexts older than `context_timeout_s`; returns how many."""
        now = self.clock()
        old = [k for k, c in self._contexts.items() if now - c.created_at > self.config.context_timeout_s]
        for key in old:
            self._drop(key, "timeout")
        return len(old)

    def _remember(self, sender: str, microbatch: int, context: _Context) -> None:
        self.expire()
        self._contexts[(sender, microbatch)] = context
        while len(self._contexts) > self.config.max_contexts:
            self._drop(next(iter(self._contexts)), "too many in flight")

    def _drop(self, key: tuple[str, int], reason: str) -> None:
        del self._contexts[key]
        dropped = self.counters.contexts_dropped
        dropped[reason] = dropped.get(reason, 0) + 1
        logger.info("dropped the context of microbatch %d from %s: %s", key[1], key[0][-8:], reason)

    # ---- gradients and steps

    def _apply(
        self,
        key: IdempotencyKey,
        names: Sequence[str],
        grads: Sequence[torch.Tensor | None],
        sequences: int,
        tokens: int,
    ) -> None:
        """Accumulate one microbatch's parameter gradients (weighted by its sequences); step when a batch is in."""
        for name, grad in zip(names, grads, strict=True):
            if grad is None:
                continue
            held = self._grad_sum.get(name)
            if held is None:
                self._grad_sum[name] = grad.detach() * sequences
            else:
                held.add_(grad.detach(), alpha=sequences)
        self._acc_sequences += sequences
        self._acc_tokens += tokens
        self.counters.microbatches_applied += 1
        self.counters.tokens += tokens
        if self._acc_sequences >= self.inner.batch_size:
            self._step()

    def _step(self) -> None:
        for name, param in self.params.items():
            total = self._grad_sum.get(name)
            param.grad = None if total is None else total / self._acc_sequences
        if self.inner.clip_norm:  # this stage's span only: the global norm would need a cross-stage exchange
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.inner.clip_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.inner.lr_at(self.inner_step + 1)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = self._acc_tokens
        self._grad_sum.clear()
        self._acc_sequences = self._acc_tokens = 0
        self.inner_step += 1
        self._snapshot = None
        if self.on_step is not None:
            self.on_step(self.inner_step, tokens)  # DiLoCo: may overwrite fragments in place
            self._snapshot = None

    def _leaves(self) -> dict[str, torch.Tensor]:
        # A private copy per weight version: an in-place optimizer step must never touch a graph still held.
        if self._snapshot is None:
            self._snapshot = {
                name: p.detach().clone().requires_grad_(True) for name, p in self.params.items()
            }
        return self._snapshot

    # ---- helpers

    def _key(self, sender: str, microbatch: int, phase: Phase) -> IdempotencyKey:
        return IdempotencyKey(self.run_id, sender, microbatch, self.stage, phase)

    def _refuse_applied(self, key: IdempotencyKey, what: str) -> None:
        verdict = self.ledger.check(key)
        if verdict is Verdict.APPLIED:
            self.ledger.note_duplicate()
            self._refuse(ALREADY_APPLIED, f"{what} of microbatch {key.microbatch}: its backward was applied")
        if verdict is Verdict.STALE:
            self._refuse(STALE_MICROBATCH, f"{what} of microbatch {key.microbatch} is below the ledger floor")

    def _cached_or_refuse(self, key: IdempotencyKey) -> object | None:
        verdict = self.ledger.check(key)
        if verdict is Verdict.NEW:
            return None
        if verdict is Verdict.APPLIED:
            cached = self.ledger.cached(key)
            self.ledger.note_duplicate()
            if cached is not None:
                self.counters.answered_from_cache += 1
                return cached
            self._refuse(
                ALREADY_APPLIED, f"microbatch {key.microbatch} was applied; its answer is no longer cached"
            )
        self._refuse(STALE_MICROBATCH, f"microbatch {key.microbatch} is below the ledger floor")
        return None

    def _refuse(self, reason: str, message: str) -> None:
        self.counters.refused[reason] = self.counters.refused.get(reason, 0) + 1
        raise StageRefusal(message, reason=reason)

    def _check_input(self, x: torch.Tensor) -> None:
        if self.is_first:
            self.shape.check_tokens(x)
        else:
            self.shape.check_activation(x)

    @staticmethod
    def _size(x: torch.Tensor) -> tuple[int, int]:
        return int(x.shape[0]), int(x.shape[0] * x.shape[1])

    def _measure(self, started: float, tokens: int, *, share: float) -> None:
        """Fold one compute time into seconds per token of a whole microbatch (forward ~1/3, backward ~2/3)."""
        if self.device.type == "cuda":  # kernels run asynchronously: time them done, not launched
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self.counters.compute_s += seconds
        if tokens <= 0 or share <= 0:
            return
        sample = seconds / share / tokens
        alpha = self.config.throughput_ema
        old = self._sec_per_token
        if old is not None:
            # One slow outlier (a fresh module's first call, a load spike) must not sink the announced throughput:
            # rebalancing reads it, and a replica that just moved would make its new stage look starved.
            sample = min(sample, old * SLOW_SAMPLE_CAP)
        self._sec_per_token = sample if old is None else (1 - alpha) * old + alpha * sample

    def recent_applied(self, limit: int) -> list[int]:
        return [k.microbatch for k in self.ledger.recent(limit)]


# ---------------------------------------------------------------------------------------------------- receipts


# ---------------------------------------------------------------------------------------------------- service


class StageService:
    """The wire of one stage replica: authorize, open, compute on the single compute thread, seal."""

    def __init__(
        self,
        identity: NodeIdentity,
        run_id: str,
        core: StageCore,
        *,
        authorized: Callable[[], Sequence[str]] | Sequence[str],
        executor: Executor | None = None,
        wall_clock: Callable[[], float] = time.time,
        max_receipts: int = 64,
        is_banned: Callable[[str], bool] = lambda _peer: False,
        attack: Attack | None = None,
        rounding: torch.Generator | None = None,
    ) -> None:
        """`is_banned`: swarm-wide SENTINEL bans (callers that are banned are refused). `attack`: a
        `verification.attacks.Attack` applied to this replica's outputs; only ever set through the loudly
        named `HIVENODE_UNSAFE_ATTACK` option (tests and benchmarks). `rounding`: this replica's own noise for the
        activation codec's stochastic rounding of gradients (`boundary_codec.rounding_generator`: why one per
        owner); default seeded from os.urandom."""
        self.identity = identity
        self.is_banned = is_banned
        self.attack = attack
        self._attack_steps = {"forward": 0, "backward": 0}
        self.run_id = run_id
        self.core = core
        self._authorized = authorized
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self.wall_clock = wall_clock
        self.limits = core.shape.limits
        self.replay = ReplayGuard(PIPELINE_REPLAY)
        self.receipts: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # (verifier, session) -> frame
        self.receipt_view: OrderedDict[tuple[str, str], TokenReceipt] = OrderedDict()
        self.max_receipts = max_receipts
        self.queued = 0  # requests waiting for or on the compute thread
        self.moved_at: float | None = None  # wall time of the last stage move (late requests are not blamed)
        self.timings = {"open_s": 0.0, "compute_s": 0.0, "seal_s": 0.0, "requests": 0}
        self.rounding = rounding or boundary_codec.rounding_generator()

    @property
    def stage(self) -> int:
        return self.core.stage

    def routes(self) -> dict[str, Route]:
        cap = max_frame_bytes(self.limits)
        rates = self.core.config.route_rates()
        return {
            FORWARD_RPC: Route(self.rpc_forward, cap, rate=rates[FORWARD_RPC]),
            BACKWARD_RPC: Route(self.rpc_backward, cap, rate=rates[BACKWARD_RPC]),
            RECEIPT_RPC: Route(self.rpc_receipt, MAX_CONTROL_BYTES, rate=rates[RECEIPT_RPC]),
        }

    def authorized(self) -> Sequence[str]:
        return self._authorized() if callable(self._authorized) else self._authorized

    # ---- handlers

    async def rpc_forward(self, frame: bytearray, remote_peer: str) -> StreamingFrame:
        core = self.core
        kind = Kind.TOKENS if core.is_first else Kind.ACTIVATION
        opened = self._open(frame, remote_peer, kind, Direction.FORWARD, limits=self.limits)
        header, x, targets = opened.header, opened.tensors.get(""), opened.tensors.get(TARGETS)
        recompute = opened.meta.get(EVAL_META) is True and opened.meta.get(RECOMPUTE_GRAD_META) is True
        if x is None or set(opened.tensors) - {"", TARGETS, *((GRAD_OUTPUT,) if recompute else ())}:
            raise WrongContext(
                "a forward carries its input (and targets for the last stage)", reason="bad tensors"
            )
        if recompute:
            recomputed = await self.compute(core.input_gradient, x, opened.tensors.get(GRAD_OUTPUT), targets)
            return self._seal(
                remote_peer,
                Kind.GRADIENT,
                Direction.BACKWARD,
                header,
                tensor=recomputed,
                meta={EVAL_META: True},
            )
        if opened.meta.get(EVAL_META) is True:
            out = await self.compute(core.forward_eval, x, targets)
            if core.is_last:
                return self._seal(
                    remote_peer, Kind.LOSS, Direction.FORWARD, header, meta={LOSS_META: float(out)}
                )
            return self._seal(
                remote_peer, Kind.ACTIVATION, Direction.FORWARD, header, tensor=out, meta={EVAL_META: True}
            )
        if core.is_last:
            if targets is None:
                raise WrongContext("the last stage needs targets", reason="bad tensors")
            loss, grad = await self.compute(core.forward_loss, remote_peer, header.microbatch, x, targets)
            if grad is None:  # a single-stage pipeline: nothing to send back but the loss
                return self._seal(remote_peer, Kind.LOSS, Direction.BACKWARD, header, meta={LOSS_META: loss})
            grad = self._attacked(grad, "backward", header.microbatch)
            return self._seal(
                remote_peer, Kind.GRADIENT, Direction.BACKWARD, header, tensor=grad, meta={LOSS_META: loss}
            )
        if targets is not None:
            raise WrongContext("only the last stage takes targets", reason="bad tensors")
        out = await self.compute(core.forward, remote_peer, header.microbatch, x)
        out = self._attacked(out, "forward", header.microbatch)
        return self._seal(remote_peer, Kind.ACTIVATION, Direction.FORWARD, header, tensor=out)

    async def rpc_backward(self, frame: bytearray, remote_peer: str) -> StreamingFrame:
        core = self.core
        # opened first: a backward for the stage this replica left is refused `not serving`, never blamed
        opened = self._open(frame, remote_peer, Kind.GRADIENT, Direction.BACKWARD, limits=self.limits)
        if core.is_last:
            raise WrongContext("the last stage takes no backward request (its forward is the backward)")
        grad = opened.tensors.get("")
        if grad is None or len(opened.tensors) != 1:
            raise WrongContext("a backward carries one gradient", reason="bad tensors")
        header = opened.header
        result = await self.compute(core.backward, remote_peer, header.microbatch, grad)
        if result is None:
            return self._seal(
                remote_peer, Kind.CONTROL, Direction.BACKWARD, header, meta={APPLIED_META: True}
            )
        result = self._attacked(result, "backward", header.microbatch)
        return self._seal(remote_peer, Kind.GRADIENT, Direction.BACKWARD, header, tensor=result)

    async def rpc_receipt(self, frame: bytearray, remote_peer: str) -> bytes:
        self._authorize(remote_peer)
        receipt = open_receipt(
            frame,
            run_id=self.run_id,
            replica=self.identity.peer_id,
            stage=self.stage,
            authorized_verifiers=self.authorized(),
            now=self.wall_clock(),
        )
        key = (receipt.verifier, receipt.session)
        held = self.receipt_view.get(key)
        if held is None or receipt.sequence > held.sequence:
            self.receipts.pop(key, None)
            self.receipt_view.pop(key, None)
            self.receipts[key] = bytes(frame)
            self.receipt_view[key] = receipt
            while len(self.receipts) > self.max_receipts:
                self.receipts.popitem(last=False)
                self.receipt_view.popitem(last=False)
        return b""

    # ---- pieces

    def _attacked(self, tensor: torch.Tensor, direction: str, microbatch: int) -> torch.Tensor:
        if self.attack is None:
            return tensor
        step = self._attack_steps[direction]
        self._attack_steps[direction] = step + 1
        return self.attack.apply(tensor, direction=direction, microbatch_id=microbatch, step=step)

    def _authorize(self, remote_peer: str) -> None:
        if self.is_banned(remote_peer):
            raise UnauthorizedCaller(f"{remote_peer[-8:]} is banned in this run")
        if remote_peer not in self.authorized():
            raise UnauthorizedCaller(f"{remote_peer[-8:]} is not an authorized verifier of this run")

    def _open(
        self, frame: bytearray, remote_peer: str, kind: Kind, direction: Direction, *, limits: TensorLimits
    ) -> Opened:
        self._authorize(remote_peer)
        started = time.perf_counter()
        expect = Context(
            run_id=self.run_id,
            kind=kind,
            receiver=self.identity.peer_id,
            stage=self.stage,
            direction=direction,
        )
        try:
            opened = open_envelope(
                frame,
                remote_peer=remote_peer,
                expect=expect,
                limits=limits,
                replay=self.replay,
                now=self.wall_clock(),
            )
        except WrongContext as e:
            moved = self.moved_at
            if moved is not None and self.wall_clock() - moved < self.core.config.context_timeout_s:
                raise StageRefusal(f"{e} (this replica moved stages recently)", reason=NOT_SERVING) from None
            raise
        # decoded before any use or check: boundary tensors to float32, token ids to int64
        opened = boundary_codec.decode_opened(opened, self.core.shape.codec, limits)
        opened = self.core.shape.widen_tokens(opened)
        self.timings["open_s"] += time.perf_counter() - started
        return opened

    async def compute(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the compute thread (the only thread that touches the core)."""
        self.queued += 1
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args))
        finally:
            self.queued -= 1
            self.timings["compute_s"] += time.perf_counter() - started

    def _seal(
        self,
        receiver: str,
        kind: Kind,
        direction: Direction,
        request: Header,
        *,
        tensor: torch.Tensor | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> StreamingFrame:
        started = time.perf_counter()
        context = Context(
            run_id=self.run_id,
            kind=kind,
            receiver=receiver,
            stage=request.stage,  # not self.stage: the replica may have moved while computing this answer
            direction=direction,
        )
        extra: dict[str, Any] = {}
        if tensor is not None and kind in (
            Kind.ACTIVATION,
            Kind.GRADIENT,
        ):  # encoded after the stage computed
            tensor, extra = boundary_codec.encode(
                tensor, self.core.shape.codec, gradient=kind is Kind.GRADIENT, rounding=self.rounding
            )
        # Binding the request's digest makes "one payload per (microbatch, input)" checkable: an honest replica
        # that gets a new input for a microbatch (the verifier rerouted upstream) is never mistaken for a liar.
        frame = seal_streaming(  # signed while it streams: hashed as sent, head signed last
            self.identity,
            context,
            microbatch=request.microbatch,
            step=self.core.inner_step,
            now=self.wall_clock(),
            tensor=tensor,
            meta={**(meta or {}), **extra, INPUT_DIGEST_META: request.digest.hex()},
        )
        self.timings["seal_s"] += time.perf_counter() - started
        self.timings["requests"] += 1
        return frame

    def verified_tokens(self) -> int:
        return sum(r.tokens for r in self.receipt_view.values())


# ---------------------------------------------------------------------------------------------------- the role


def stage_config(
    table: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> StageConfig:
    """StageConfig from `NodeConfig.stage_options` (node.toml `[stage_options]` and `HIVENODE_STAGE`, merged by
    `node.config.load_node_config`), then `HIVENODE_STAGE` from `environ` if one is given."""
    return component_config(StageConfig(), table, table="stage_options", env=STAGE_ENV, environ=environ)


def build_core(
    manifest: RunManifest,
    run_id: str,
    stage: int,
    config: StageConfig,
    *,
    on_step: Callable[[int, int], None] | None = None,
    device: str = "cpu",
) -> StageCore:
    """A fresh core for `stage` of the run's model, initialised from the run seed (version 0) on the CPU (the
    same values on every device), then moved to `device` (`--device`, resolved) for its compute."""
    cfg = ModelConfig.from_dict(manifest.model)
    module = build_stage(cfg, manifest.seed, stage, manifest.num_stages)
    return StageCore(
        module,
        stage=stage,
        run_id=run_id,
        inner=manifest.inner,
        shape=BoundaryShape.from_manifest(manifest),
        config=config,
        on_step=on_step,
        device=device,
    )


def replicas_from_peers(
    peers: Sequence[Any], now: float, *, states: Sequence[str] = ("serving",)
) -> list[ReplicaInfo]:
    """Live stage replicas from heartbeat records (`protocol.records.PeerRecord`): those serving, or in `states`.

    Verifiers route to serving replicas only; rebalancing also counts the ones joining a stage (moving there)."""
    out = []
    for peer in peers:
        hb = peer.heartbeat
        if (
            hb.role != "stage"
            or hb.stage is None
            or hb.leaving
            or hb.state not in states
            or peer.expires_at <= now
        ):
            continue
        out.append(
            ReplicaInfo(
                peer_id=peer.peer_id,
                stage=hb.stage,
                throughput=hb.throughput,
                queue=hb.load,
                maddrs=tuple(hb.maddrs),
            )
        )
    return out


class StageRole:
    """`--role stage`: serve one stage, sync its fragments, expire contexts, move when another stage starves."""

    name = "stage"

    def __init__(self, ctx: NodeContext, config: StageConfig | None = None) -> None:
        if ctx.stage is None:
            raise ValueError("the stage role needs a stage")
        self.ctx = ctx
        self.config = config or stage_config(getattr(ctx.config, "stage_options", None))
        if self.config.compute_threads > 0:
            torch.set_num_threads(self.config.compute_threads)
        self.manifest = ctx.manifest
        self.spans = stage_spans(ctx.manifest.model["num_layers"], ctx.manifest.num_stages)
        self.sync: Any = None  # node.diloco.sync_client.FragmentSync of the current stage, if a syncer exists
        self.core = build_core(
            ctx.manifest,
            ctx.run_id,
            ctx.stage,
            self.config,
            on_step=partial(self._after_step, ctx.stage),
            device=ctx.device,
        )
        self.service = StageService(
            ctx.identity,
            ctx.run_id,
            self.core,
            authorized=lambda: ctx.manifest.authorized_verifiers,
            max_receipts=self.config.max_receipts,
            attack=attack_from_env(),
        )
        self.bans = ban_watcher_for(ctx)
        self.service.is_banned = self.bans.is_banned
        self.strikes = PeerStrikes()
        self.throttled: dict[str, int] = {}  # "route: limit" -> requests refused for load
        self.state = "joining"
        self.rebalancer = Rebalancer(self.config.rebalance, started_at=time.monotonic())
        self.announce_factor = announce_factor_from_env()
        self.moves = 0
        self._sync_stop: asyncio.Event | None = None
        self._p2p: Any = None

    # ---- life

    async def run(self, ctx: NodeContext, stop: asyncio.Event) -> None:
        self._p2p = await ctx.dht.replicate_p2p()
        server = FramedServer(
            self._p2p, self.service.routes(), strikes=self.strikes, on_throttle=self._on_throttle
        )
        # only verifiers send work: the reserved stream slots are theirs, whoever else opens streams at us
        server.limiter.prefer(lambda peer: peer in self.service.authorized())
        try:
            await self._start_sync(stop)
            await server.start()
            self.state = "serving"
            ctx.events.emit("stage_serving", stage=self.core.stage, span=list(self.core.span))
            ctx.supervisor.spawn("stage-sweep", partial(self._sweep, stop))
            ctx.supervisor.spawn("stage-bans", partial(self.bans.run, stop))
            if self.config.rebalance_enabled and self.manifest.num_stages > 1:
                ctx.supervisor.spawn("stage-rebalance", partial(self._rebalance_loop, stop))
            await self._wait_for_end(stop)
        finally:
            self.state = "leaving"
            if self._sync_stop is not None:
                self._sync_stop.set()
            await server.stop()
            self.service.executor.shutdown(wait=False, cancel_futures=True)

    async def _wait_for_end(self, stop: asyncio.Event) -> None:
        max_steps = self.ctx.config.max_steps
        while not stop.is_set():
            if max_steps is not None and self.core.inner_step >= max_steps:
                logger.info("reached --max-steps %d", max_steps)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def _sweep(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.sweep_period_s)
            await self.service.compute(self.core.expire)

    # ---- DiLoCo

    def _after_step(self, stage: int, step: int, tokens: int) -> None:
        if stage != self.core.stage:  # a step of the stage this replica just left: not the current sync's
            return
        if self.sync is not None:
            self.sync.after_inner_step(step, tokens)

    async def _start_sync(self, stop: asyncio.Event) -> None:
        """FragmentSync for the current stage's span; a late joiner first loads the current global version."""
        if not self.manifest.authorized_syncers:
            logger.info("the run lists no authorized syncer: this stage trains without outer syncs")
            return
        from node.diloco.sync_client import FragmentSync, FramedSyncTransport, run_fragment_plan
        from node.swarm.admission import admission_meta

        plan = run_fragment_plan(self.manifest)
        transport = FramedSyncTransport(
            self._p2p,
            self.ctx.identity,
            self.ctx.records,
            plan,
            authorized_syncers=self.manifest.authorized_syncers,
            admission=await admission_meta(self.ctx),  # stage replicas push fragments too: same cost
        )
        receipts = lambda: list(self.service.receipts.values())  # noqa: E731 - relayed with every push
        self.sync = FragmentSync.create(
            self.core.params,
            plan,
            self.manifest.diloco,
            transport,
            receipts=receipts,
            codec=self.manifest.outer_codec,
        )
        loaded = await self.sync.join_global(stop, timeout_s=self.config.join_timeout_s)
        self.core.weights_changed()
        self.ctx.events.emit(
            "stage_joined_global", stage=self.core.stage, loaded=loaded, versions=self.sync.versions()
        )
        self._sync_stop = asyncio.Event()
        local_stop = self._sync_stop
        sync = self.sync

        async def run_sync() -> None:
            relay = asyncio.ensure_future(_relay_stop(stop, local_stop))
            try:
                await asyncio.gather(sync.run_sender(local_stop), sync.run_watcher(local_stop))
            finally:
                relay.cancel()

        self.ctx.supervisor.spawn(f"stage-diloco-{self.moves}", run_sync)

    # ---- rebalancing

    async def _rebalance_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.rebalance.check_period_s)
            if stop.is_set():
                return
            try:
                peers = await self.ctx.records.list_peers()
                measured = measurements_of(await self.ctx.records.list_measured())
            except asyncio.TimeoutError:
                continue
            from hivemind.utils import get_dht_time

            now = get_dht_time()
            replicas = [  # a banned replica gets no work from verifiers: it is no capacity
                r
                for r in replicas_from_peers(peers, now, states=("serving", "joining"))
                if not self.bans.is_banned(r.peer_id)
            ]
            me = ReplicaInfo(peer_id=self.ctx.peer_id, stage=self.core.stage, throughput=self.core.throughput)
            cfg = self.config.rebalance
            # every replica (this one too) at its announced figure clamped around the verifiers' measurements:
            # a replica lying about its speed neither starves a stage on paper nor sends others away from it
            *replicas, me = effective_throughputs(
                [*replicas, me], measured, now=now, slack=cfg.measured_slack, max_age_s=cfg.measured_max_age_s
            )
            move = self.rebalancer.decide(
                now=time.monotonic(),
                me=self.ctx.peer_id,
                my_stage=self.core.stage,
                my_throughput=me.throughput,
                replicas=replicas,
                spans=self.spans,
            )
            if move is not None:
                await self._move_to(move.to_stage, move.reason, stop)

    async def _move_to(self, stage: int, reason: str, stop: asyncio.Event) -> None:
        """Serve `stage` instead: a core built from the seed, the global version of its span from the syncer.

        From the first line on, the heartbeat announces the new stage as "joining" (verifiers do not route to it
        yet; other replicas' rebalancers count it there, so they do not follow) with this replica's speed per
        layer carried over as its throughput until the new span is measured."""
        old = self.core.stage
        logger.info("moving from stage %d to stage %d: %s", old, stage, reason)
        self.state = "joining"
        if self._sync_stop is not None:
            self._sync_stop.set()
        self.moves += 1
        core = build_core(
            self.manifest,
            self.ctx.run_id,
            stage,
            self.config,
            on_step=partial(self._after_step, stage),
            device=self.ctx.device,
        )
        old_layers, new_layers = (b - a for a, b in (self.core.span, core.span))
        core.assume_throughput(self.core.throughput * old_layers / max(new_layers, 1))
        self.sync = None
        self.core = core
        self.service.core = core
        self.service.moved_at = self.service.wall_clock()
        self.ctx.stage = stage
        await self._start_sync(stop)
        self.rebalancer.moved(time.monotonic())
        self.state = "serving"
        self.ctx.events.emit("stage_moved", from_stage=old, to_stage=stage, why=reason)

    def _on_throttle(self, peer: str, route: str, admission: Admission) -> None:
        """Requests refused for load before they were read: /metrics (`hivenode_rpc_throttled`) and status."""
        self.ctx.metrics.count_throttle(peer, route, admission)
        key = f"{route}: {admission.reason}"
        self.throttled[key] = self.throttled.get(key, 0) + 1

    # ---- status

    def status(self) -> dict[str, Any]:
        core, counters = self.core, self.core.counters
        status: dict[str, Any] = {
            "state": self.state,
            "stage": core.stage,
            "span": list(core.span),
            "inner_step": core.inner_step,
            "tokens": counters.tokens,
            "loss": core.train_loss,
            "throughput": round(core.throughput * self.announce_factor, 1),  # factor 1 unless UNSAFE (tests)
            "load": float(self.service.queued),
            "queue": self.service.queued,
            "contexts": core.num_contexts,
            "microbatches_served": counters.microbatches_served,
            "microbatches_applied": counters.microbatches_applied,
            "answered_from_cache": counters.answered_from_cache,
            "duplicates": core.ledger.duplicates,
            "refused": dict(counters.refused),
            "contexts_dropped": dict(counters.contexts_dropped),
            "strikes": self.strikes.snapshot(),
            "throttled": dict(self.throttled),
            "verified_tokens": self.service.verified_tokens(),
            "receipts": len(self.service.receipts),
            "applied_recent": core.recent_applied(self.config.recent_applied),
            "moves": self.moves,
            "rebalance": self.rebalancer.last_reason,
        }
        if self.sync is not None:
            status["diloco"] = self.sync.status()
        return status


async def _relay_stop(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def create_role(ctx: NodeContext) -> StageRole:
    return StageRole(ctx)
