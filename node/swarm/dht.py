"""The DHT process: hivemind's DHT started with our identity, detached from our signals, with per-peer store quotas.

The DHT process runs `QuotaDHTProtocol`: hivemind's validators never see who sent a record, so per-peer store
quotas (`protocol.limits.StoreQuota`) sit in front of the DHT's store handler, where the Noise-authenticated sender
is known, and refuse a record before it is validated or stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import hivemind
import hivemind.dht.node
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from node.config import NetworkConfig
from node.swarm.relay import install_daemon_flags, relay_options
from protocol.errors import JoinError
from protocol.identity import NodeIdentity
from protocol.keys import KeyKind
from protocol.limits import QuotaConfig, QuotaStats, StoreQuota
from protocol.records import HivenodeRecordValidator, RecordLimits

logger = logging.getLogger(__name__)

PARENT_WATCH_PERIOD_S = 0.5
NO_RELAY_CONFIG_FILENAME = "p2pd-no-relay.json"  # beside the identity: p2pd's config when relaying is off
_DAEMON_TIMESTAMP = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)? ")


def dht_store_quota(limits: RecordLimits | None = None) -> QuotaConfig:
    """The store quotas every hivenode DHT peer applies, sized for our records (`RecordLimits`).

    A peer re-stores its heartbeat every `heartbeat_period_s` (2 s by default: 30 a minute), an authorized syncer
    its lease as often, and a node that joins or caches gets whole dictionaries replicated to it, one record per
    subkey. 240 records a minute per peer covers all of that with a 150-peer directory replicated at once, and
    still stops one identity from making us validate thousands of records a second. The global cap bounds a Sybil
    flood (a fresh identity costs ~1 ms): 12,000 a minute is 200 validations a second, ~2 % of one core. Of those,
    4,096 are reserved: 2,048 for the peers a run's signed manifest names (owner, bootstraps, authorized syncers
    and verifiers: `QuotaDHTProtocol`'s known peers), eight of them at their full per-peer rate (a syncer renews
    its lease every few seconds; bans and measured throughputs are rarer), and 2,048 that admitted peers' own
    heartbeats (carrying a valid admission proof) may use too, ~68 peers' 2 s heartbeats (more spill into the
    guests' pool): a flood of fresh identities fills the other 7,904 and leaves the leases, bans and manifests
    of the run's roles and the admitted learners' heartbeats stored. Values are capped like the
    validator caps them; expirations at the longest TTL any record kind may have, for every record, foreign ones
    included.
    """
    limits = limits or RecordLimits()
    records_total = 12_000
    return QuotaConfig(
        window_s=60.0,
        max_records_per_peer=240,
        max_bytes_per_peer=4 << 20,
        max_value_bytes=limits.max_value_bytes,
        max_records_total=records_total,
        reserved_records_total=4096,
        admitted_records_total=2048,
        max_expiration_horizon_s=max(limits.max_ttl_s(kind) for kind in KeyKind),
        clock_skew_s=limits.clock_skew_s,
        max_tracked_peers=records_total,
    )


class QuotaDHTProtocol(DHTProtocol):
    """hivemind's DHT protocol with `StoreQuota` in front of its store handler.

    `rpc_store` asks the quota about every record of a request, with the Noise-authenticated sender, before
    hivemind validates or stores anything; refused records are answered `False` (as hivemind answers a record
    its validators refuse) and never reach the validators or the storage. A whole dictionary (replication, cache)
    counts one record per subkey and is refused whole if any subkey is refused.

    The quota's known peers, who may use its `reserved_records_total`, are those a run our validator knows names
    in its signed manifest (`HivenodeRecordValidator.has_role`); the DHT learns a run when the node adds its
    validator after discovery, a bootstrap from its start. A store that is its sender's own heartbeat carrying a
    valid admission proof for a run that charges one (`HivenodeRecordValidator.admits_store`) may use the reserve
    too: an honest learner's heartbeat then outlasts a flood of free identities, which an allow-list refuses and
    proof-of-work charges per identity.

    Installed only inside `DetachedDHT`'s own process (see `DetachedDHT.run`), with its config in the class
    attribute `quota_config`. It keeps the wire names of `DHTProtocol`, so peers see no difference.
    """

    quota_config: QuotaConfig | None = None
    # Validate (schema, signature) before a record counts toward any quota: else unsigned junk admitted by the
    # quota fills the subkey cap of `<run>/peers` and the like, and honest records are refused. False: the order
    # of old (quota, then hivemind's validators), kept for the tests' negative control.
    validate_first: bool = True

    def __init__(self, *, _initialized_with_create: bool = False) -> None:
        super().__init__(_initialized_with_create=_initialized_with_create)
        config = type(self).quota_config
        self.store_quota = StoreQuota(config, known=self._has_role) if config is not None else None
        self._refusal_logged_at: dict[str, float] = {}

    def _has_role(self, peer: str) -> bool:
        """Whether a run our validators know names `peer` (the store quota's known peers)."""
        return any(v.has_role(peer) for v in self._hivenode_validators())

    def _hivenode_validators(self) -> list[HivenodeRecordValidator]:
        # hivemind sets record_validator after __init__ (DHTProtocol.create); add_validators extends it later
        validators = getattr(getattr(self, "record_validator", None), "_validators", ())
        return [v for v in validators if isinstance(v, HivenodeRecordValidator)]

    def _admitted_heartbeat(
        self, quota: StoreQuota, peer: str, key: bytes, tag: bytes, value: bytes, expiration: float
    ) -> bool:
        """Whether this store is `peer`'s own heartbeat carrying its valid admission proof
        (`HivenodeRecordValidator.admits_store`): it may then use the reserve of the known peers. Asked only where
        a reserve exists and `peer` is not known anyway: one hash, and a signature check for a valid proof."""
        if quota.config.reserved_records_total == 0 or self._has_role(peer):
            return False
        record = DHTRecord(key, tag, value, expiration)
        return any(v.admits_store(peer, record) for v in self._hivenode_validators())

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return DHTProtocol._get_handle_name(namespace, method_name)

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        quota = self.store_quota
        if quota is None:
            return await super().rpc_store(request, context)
        num = len(request.keys)
        fields = (request.subkeys, request.values, request.expiration_time, request.in_cache)
        if any(len(field) != num for field in fields):
            return dht_pb2.StoreResponse(store_ok=[False] * num, peer=self.node_info)
        peer, now = context.remote_id.to_base58(), get_dht_time()
        admitted = [
            self._admit(quota, peer, *item, now) for item in zip(request.keys, *fields[:3], strict=True)
        ]
        if all(admitted):
            return await super().rpc_store(request, context)
        kept = [i for i, ok in enumerate(admitted) if ok]
        subset = dht_pb2.StoreRequest(
            keys=[request.keys[i] for i in kept],
            subkeys=[request.subkeys[i] for i in kept],
            values=[request.values[i] for i in kept],
            expiration_time=[request.expiration_time[i] for i in kept],
            in_cache=[request.in_cache[i] for i in kept],
            peer=request.peer,
        )
        response = await super().rpc_store(subset, context)
        stored = iter(list(response.store_ok))
        del response.store_ok[:]
        response.store_ok.extend(next(stored, False) if ok else False for ok in admitted)
        return response

    def _admit(
        self,
        quota: StoreQuota,
        peer: str,
        key: bytes,
        tag: bytes,
        value: bytes,
        expiration: float,
        now: float,
    ) -> bool:
        if len(key) != DHTID.HASH_NBYTES:
            return False  # not a key hivemind could have made (its handler would raise on it)
        if tag != self.IS_DICTIONARY:
            subkey = None if tag == self.IS_REGULAR_VALUE else tag
            if subkey is not None and not self._is_subkey(subkey):
                return False
            if self.validate_first and not self._validate_record(key, tag, value, expiration):
                return self._note(quota.refuse_invalid(peer), peer)
            admitted = self._admitted_heartbeat(quota, peer, key, tag, value, expiration)
            admission = quota.admit_store(
                peer, key, len(value), expiration, now, subkey=subkey, admitted=admitted
            )
            return self._note(admission, peer)
        try:
            dictionary = self.serializer.loads(value)
        except Exception:  # garbage hivemind's handler would raise on: refuse the item instead
            return False
        if not isinstance(dictionary, DictionaryDHTValue) or not len(dictionary):
            return False  # an empty dictionary stores nothing; hivemind would still answer "stored"
        if self.validate_first and not self._validate_dictionary(key, dictionary):
            return self._note(quota.refuse_invalid(peer), peer)
        for subkey, item in dictionary.items():
            blob, item_expiration = item.value, item.expiration_time
            if not isinstance(blob, bytes) or type(item_expiration) not in (int, float):
                return False
            admission = quota.admit_store(
                peer, key, len(blob), float(item_expiration), now, subkey=self.serializer.dumps(subkey)
            )
            if not self._note(admission, peer):
                return False
        return True

    def _is_subkey(self, tag: bytes) -> bool:
        """Whether hivemind can decode `tag` into a subkey it can store (its handler would raise otherwise)."""
        try:
            subkey = self.serializer.loads(tag)
            hash(subkey)
        except Exception:  # undecodable, or a list or map: not usable as a dictionary key
            return False
        return True

    def _note(self, admission: Any, peer: str) -> bool:
        """Pass the admission through; log a peer's refusals at most once per quota window."""
        if admission:
            return True
        now = time.monotonic()
        assert self.store_quota is not None
        if now - self._refusal_logged_at.get(peer, -math.inf) >= self.store_quota.config.window_s:
            if len(self._refusal_logged_at) >= self.store_quota.config.max_tracked_peers:
                self._refusal_logged_at.clear()
            self._refusal_logged_at[peer] = now
            logger.warning("DHT store quota refused records from %s: %s", peer[-8:], admission.reason)
        return False


async def _quota_stats(_dht: Any, node: Any) -> QuotaStats | None:
    """Runs inside the DHT process: the store quota's counters (None if the DHT runs without quotas)."""
    quota = getattr(node.protocol, "store_quota", None)
    return quota.stats() if quota is not None else None


def dht_quota_stats(dht: hivemind.DHT) -> QuotaStats | None:
    """The store quota's counters of a DHT started by `start_dht` (blocks for one round trip to its process)."""
    return dht.run_coroutine(_quota_stats)


class DetachedDHT(hivemind.DHT):
    """hivemind's DHT process, detached from our signals, with per-peer store quotas.

    The DHT process is forked after we installed asyncio signal handlers, so it would inherit them (and the
    loop's wakeup fd) and then ignore the SIGTERM that `DHT.shutdown()` falls back to. It also shares our process
    group, so a Ctrl+C in a terminal (or a group kill) would kill it and its p2pd before we could announce
    leaving. In its own group with default signal handling, our process alone decides when the DHT stops; and
    `_exit_with_parent` stops it if we die without deciding.

    `store_quota` (None: no quotas) is applied by `QuotaDHTProtocol`, which this process alone uses.
    """

    def __init__(
        self,
        *args: Any,
        store_quota: QuotaConfig | None = None,
        validate_first: bool = True,
        daemon_flags: dict[str, bool | str] | None = None,
        **kwargs: Any,
    ) -> None:
        self._store_quota = store_quota  # read in run(), in the DHT process (forked with this attribute)
        self._validate_first = validate_first
        self._daemon_flags = daemon_flags or {}  # p2pd flags hivemind has no parameter for (node.swarm.relay)
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        if self._store_quota is not None:
            # This process is ours alone: hivemind's DHTNode builds its protocol from this module-level name.
            QuotaDHTProtocol.quota_config = self._store_quota
            QuotaDHTProtocol.validate_first = self._validate_first
            hivemind.dht.node.DHTProtocol = QuotaDHTProtocol
        if self._daemon_flags:
            install_daemon_flags(self._daemon_flags)
        super().run()  # hivemind then ignores SIGINT in this process


_PARENT_WATCH_TASKS: set[asyncio.Task[None]] = set()  # lives in the DHT process


async def _exit_with_parent(_dht: Any, node: Any, *, parent_pid: int, period_s: float) -> None:
    """Runs inside hivemind's DHT process: if our process dies (even by SIGKILL), stop the DHT and its p2pd
    instead of leaving them orphaned."""

    async def watch() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(period_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.shutdown(), 3.0)
        os._exit(0)

    task = asyncio.create_task(watch())
    _PARENT_WATCH_TASKS.add(task)


def _daemon_message(error: BaseException) -> str:
    text = _DAEMON_TIMESTAMP.sub("", str(error)).strip() or type(error).__name__
    return text[0].lower() + text[1:]


def start_dht(
    identity: NodeIdentity,
    initial_peers: Sequence[str],
    network: NetworkConfig,
    validator: HivenodeRecordValidator,
    *,
    store_quota: QuotaConfig | None = None,
    client_mode: bool | None = None,
    validate_first: bool = True,
    relayed: bool = False,
) -> hivemind.DHT:
    """Start hivemind's DHT with our Ed25519 identity (its peer id is `identity.peer_id`); raise JoinError.

    hivemind's own identity-in-use check only works for RSA keys, so it is off; `IdentityLock` covers it.
    Blocks for the daemon start, at most `network.join_timeout_s`. `store_quota` defaults to `dht_store_quota()`;
    `client_mode` to `network.client_mode`. `relayed`: the daemon reserves a slot on the `initial_peers` as relays
    (`start_reachable_dht` asks for it once a reach check failed); `network.use_relay=False` turns circuit relays
    off for real (a bootstrap's `--no-relay`; see `node.swarm.relay.relay_flags`). `validate_first=False` (tests only) lets records count toward the
    quota before they are validated, as hivenode did before.
    """
    if identity.path is None:
        raise ValueError("the DHT needs an identity stored in a file")
    try:
        dht = DetachedDHT(
            initial_peers=list(initial_peers) or None,
            start=True,
            record_validators=[validator],
            identity_path=str(identity.path),
            check_if_identity_free=False,
            host_maddrs=list(network.listen),
            announce_maddrs=list(network.announce) or None,
            startup_timeout=network.join_timeout_s,
            client_mode=network.client_mode if client_mode is None else client_mode,
            store_quota=store_quota or dht_store_quota(),
            validate_first=validate_first,
            **relay_options(
                initial_peers,
                relay=network.use_relay,
                relayed=relayed,
                config_path=identity.path.parent / NO_RELAY_CONFIG_FILENAME,
            ),
            # hivemind's default sends every value a GET found to the nearest peer that lacked it, one record
            # per subkey, charged to the reader's store quota there: a bootstrap polling the swarm directory
            # once a second went over 240 records a minute, and its own heartbeat was refused with the rest
            # (goodput benchmark, elastic arm). Our records are small and read from their owners' neighbours.
            cache_nearest=0,
        )
    except Exception as e:  # hivemind reports a failed start as P2PDaemonError, RuntimeError or TimeoutError
        logger.debug("DHT start failed", exc_info=True)
        message = _daemon_message(e)
        if initial_peers and "failed to connect to bootstrap peers" in message:
            raise JoinError(
                f"cannot reach the swarm: no entry point answered ({', '.join(initial_peers)}); "
                "is the bootstrap running, and is its address (peer id included) current?"
            ) from None
        where = f" via {', '.join(initial_peers)}" if initial_peers else ""
        raise JoinError(f"cannot start the DHT{where}: {message}") from None
    dht.run_coroutine(partial(_exit_with_parent, parent_pid=os.getpid(), period_s=PARENT_WATCH_PERIOD_S))
    return dht
