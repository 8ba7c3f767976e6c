"""Network links for the goodput simulator: per-peer bandwidth and latency, bytes per outer sync from the codec.

A Decoupled DiLoCo round moves one fragment each way per learner: the learner's contribution up to the syncer,
then the merged fragment back down. Over a data-centre network that costs nothing next to a step; over the
internet links of a P2P swarm it can cost more than a step, and then it is what bounds goodput.

The model, per learner m and per round (one fragment, both directions):

* bytes: the exact payload of a fragment-sized tensor under the run's codec, from
  `protocol.compress.payload_size` (the length `encode` produces and `decode` checks; a unit test encodes a
  tensor to confirm it). A fragment is 1/P of the model's parameters. The fetch of the merged fragment uses
  `fetch_codec` (default: the same codec, i.e. the syncer ships the merged outer delta under the run's codec
  and the learner applies it to its copy of the fragment's last version).
* transfer time = one-way latency + bytes / bandwidth, latency = the learner's `latency_ms` plus the syncer's.
  The bandwidth of an upload is min(learner uplink, syncer downlink / M) and of a fetch min(learner downlink,
  syncer uplink / M): every learner transfers a fragment in the same step window, so the syncer's link is
  shared fairly by the M of them (a steady-state approximation; bursts are not modelled).
* each learner's uplink and downlink carry one transfer at a time, first come first served: when one round's
  fragment takes longer than a step, the next waits behind it, which is what makes a link too slow for the
  step rate a throughput bound rather than a fixed delay.

The simulator applies it: a contribution counts toward a round once it has *arrived* at the syncer, and a
learner may not pass step s + tau before its own fetch of the round that merged step s has arrived. Not
modelled: the state a recovering learner downloads from a peer (it resumes as if that were instant), message
headers (a few hundred bytes against megabytes), packet loss and congestion control.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.compress import CodecSpec, payload_size

BITS_PER_BYTE = 8
BITS_PER_MEGABIT = 1_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerLink:
    """One peer's access link: bandwidth each way in Mbit/s (inf = not a constraint) and one-way latency in ms."""

    uplink_mbps: float = math.inf
    downlink_mbps: float = math.inf
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("uplink_mbps", "downlink_mbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PeerLink.{name} must be > 0, got {getattr(self, name)!r}")
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ValueError(f"PeerLink.latency_ms must be finite and >= 0, got {self.latency_ms!r}")

    @classmethod
    def symmetric(cls, mbps: float, latency_ms: float = 0.0) -> PeerLink:
        return cls(uplink_mbps=mbps, downlink_mbps=mbps, latency_ms=latency_ms)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """The swarm's links and what one round sends over them."""

    model_params: int  # parameters of the whole model; a fragment holds ceil(model_params / P) of them
    peers: tuple[PeerLink, ...] = (PeerLink(),)  # one per learner, or a single link every learner has
    syncer: PeerLink = field(default_factory=PeerLink)
    codec: CodecSpec = field(default_factory=CodecSpec)  # contributions, learner -> syncer
    fetch_codec: CodecSpec | None = None  # merged fragment, syncer -> learner; None: `codec`

    def __post_init__(self) -> None:
        if self.model_params < 1:
            raise ValueError(f"model_params must be >= 1, got {self.model_params}")
        if not self.peers:
            raise ValueError("LinkModel.peers needs at least one link")

    def peer(self, learner: int) -> PeerLink:
        return self.peers[0] if len(self.peers) == 1 else self.peers[learner]

    def fragment_numel(self, num_fragments: int) -> int:
        return -(-self.model_params // num_fragments)

    def upload_bytes(self, num_fragments: int) -> int:
        """Payload bytes of one contribution (one fragment under `codec`)."""
        return payload_size(self.codec, self.fragment_numel(num_fragments))

    def fetch_bytes(self, num_fragments: int) -> int:
        """Payload bytes of one merged fragment under `fetch_codec`."""
        return payload_size(self.fetch_codec or self.codec, self.fragment_numel(num_fragments))

    def timings(self, num_learners: int, num_fragments: int) -> list[LinkTimes]:
        """Per learner: seconds each transfer occupies its link (uplink, downlink) and the one-way latency."""
        if len(self.peers) not in (1, num_learners):
            raise ValueError(f"LinkModel has {len(self.peers)} peer links for {num_learners} learners")
        up_bytes, down_bytes = self.upload_bytes(num_fragments), self.fetch_bytes(num_fragments)
        out = []
        for m in range(num_learners):
            peer = self.peer(m)
            up_mbps = min(peer.uplink_mbps, self.syncer.downlink_mbps / num_learners)
            down_mbps = min(peer.downlink_mbps, self.syncer.uplink_mbps / num_learners)
            out.append(
                LinkTimes(
                    upload_s=transfer_s(up_bytes, up_mbps),
                    fetch_s=transfer_s(down_bytes, down_mbps),
                    latency_s=(peer.latency_ms + self.syncer.latency_ms) / 1000.0,
                )
            )
        return out


@dataclass(frozen=True, slots=True)
class LinkTimes:
    upload_s: float  # the uplink is busy this long per contribution
    fetch_s: float  # the downlink is busy this long per merged fragment
    latency_s: float  # one way, added once per transfer


def transfer_s(nbytes: int, mbps: float) -> float:
    """Seconds `nbytes` occupy a link of `mbps` Mbit/s (0 on an unconstrained link)."""
    return 0.0 if math.isinf(mbps) else nbytes * BITS_PER_BYTE / (mbps * BITS_PER_MEGABIT)
