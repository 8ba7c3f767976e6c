"""`python -m node --join MADDR_OR_URL [...]`: parse -> NodeConfig -> check -> run -> shut down. Subcommands: keygen,
status, demo, config, trust (the owner pins), export (checkpoint -> transformers folder), generate (sample from one). Errors reach the user as one line on stderr and a non-zero exit (2:
usage, 1: could not run). Every argument is checked before anything is written (the identity key, the state directory)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from node.app import run_node
from node.config import (
    NODE_COMPONENTS,
    Component,
    NodeConfig,
    load_node_config,
    reference_markdown,
    reference_text,
)
from node.context import LogContext, NodeContext, exit_process, run_loop, setup_logging
from node.status.progress import JoinProgress
from node.status.progress_view import ProgressView
from protocol.errors import ConfigError, HivenodeError
from protocol.identity import NodeIdentity
from protocol.keys import is_peer_id

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _fail(message: object, code: int = EXIT_FAILED) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


async def _run(config: NodeConfig, log_context: LogContext) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)  # the only thing a signal does
    progress = JoinProgress(time.monotonic)
    view = ProgressView(progress) if config.progress else None
    sources: list[Callable[[], dict[str, Any]]] = []

    def ready(ctx: NodeContext) -> None:
        _print_ready(ctx)
        sources.append(ctx.status_source)

    view_stop = asyncio.Event()
    task = None
    if view is not None:
        task = asyncio.create_task(view.run(view_stop, lambda: sources[0]() if sources else {}))
    try:
        await run_node(config, stop, log_context, ready, progress)
    except HivenodeError as e:
        progress.fail(str(e))  # the view shows it with what to do next
        raise
    finally:
        view_stop.set()
        if task is not None and view is not None:
            await task
            view.close()
    return EXIT_OK


def _print_ready(ctx: NodeContext) -> None:
    print(f"joined run {ctx.manifest.name} ({ctx.run_id[:12]}) as {ctx.role_name}", flush=True)
    print(f"status: http://{ctx.http_address}/api/status", flush=True)


def keygen(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m node keygen", description="Create (or show) a node key.")
    parser.add_argument("--identity", type=Path, required=True, metavar="PATH")
    args = parser.parse_args(argv)
    existed = args.identity.exists()
    identity = NodeIdentity.load_or_create(args.identity)
    print(identity.peer_id)
    print(f"({'existing' if existed else 'new'} key in {args.identity})", file=sys.stderr)
    return EXIT_OK


def status(argv: Sequence[str]) -> int:
    from node.status.command import status_command

    parser = argparse.ArgumentParser(prog="python -m node status", description="Summarize a swarm.")
    parser.add_argument("target", metavar="URL_OR_MULTIADDR", help="a bootstrap URL or multiaddr")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
    mine = parser.add_mutually_exclusive_group()
    mine.add_argument(
        "--peer", metavar="PEER_ID", help="also show this peer's credit and why it is what it is"
    )
    mine.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="the same for the node of this state dir (its identity.key)",
    )
    args = parser.parse_args(argv)
    if args.peer is not None and not is_peer_id(args.peer):
        parser.error(f"--peer {args.peer!r} is not a peer id (12D3KooW...)")
    peer = args.peer or (own_peer_id(args.state_dir) if args.state_dir is not None else None)
    return asyncio.run(status_command(args.target, args.timeout, peer=peer, state_dir=args.state_dir))


def own_peer_id(state_dir: Path) -> str:
    """The peer id of the node whose state dir this is; never creates a key."""
    return NodeIdentity.load(state_dir / "identity.key").peer_id


def demo(argv: Sequence[str]) -> int:
    from tools.demo import main as demo_main  # the one import of tools/ from a node module: the CLI dispatch

    return demo_main(argv)


def components() -> tuple[Component, ...]:
    """Every node.toml table: the node's own and one per role (the roles sit above node.config, so they are
    named here, at the top)."""
    from node.roles.learner import LearnerConfig
    from node.roles.stage import STAGE_ENV, StageConfig
    from node.roles.syncer import SyncerConfig
    from node.roles.verifier import VERIFIER_ENV, VerifierConfig

    return (
        *NODE_COMPONENTS,
        Component("learner", LearnerConfig, "HIVENODE_LEARNER", "learner-local settings"),
        Component(
            "syncer",
            SyncerConfig,
            "HIVENODE_SYNCER",
            "syncer-local settings (run-wide ones, mode, K, H, tau, gamma, are the manifest's)",
            heartbeat_default=lambda hb: SyncerConfig.from_options({}, heartbeat_period_s=hb),
        ),
        Component("stage_options", StageConfig, STAGE_ENV, "settings of one stage replica (`--role stage`)"),
        Component("verifier", VerifierConfig, VERIFIER_ENV, "settings of the driving half of a verifier"),
    )


def config_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m node config", description="Print every node setting with its default, unit and help."
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--defaults", action="store_true", help="as a commented node.toml (the default)")
    form.add_argument("--markdown", action="store_true", help="as docs/config.md")
    args = parser.parse_args(argv)
    render = reference_markdown if args.markdown else reference_text
    sys.stdout.write(render(components()))
    return EXIT_OK


def trust(argv: Sequence[str]) -> int:
    from node.swarm.trust import trust_command

    return trust_command(argv)


def check_arguments(config: NodeConfig) -> None:
    """What can be checked without the network, before anything is written; raise ConfigError."""
    from hivemind.utils.multiaddr import Multiaddr

    from node.swarm import check_multiaddr, is_url, swarm_url

    for target in config.join:
        if is_url(target):
            swarm_url(target)
        else:
            check_multiaddr(target)
    for name in ("listen", "announce"):
        for text in getattr(config.network, name):
            try:
                Multiaddr(text)
            except Exception as e:  # the multiaddr library raises a zoo of types for malformed input
                raise ConfigError(f"--{name} {text!r} is not a multiaddr ({e})") from None
    if config.state_dir.exists() and not config.state_dir.is_dir():
        raise ConfigError(f"--state-dir {config.state_dir} is not a directory")
    if config.identity_file.is_dir():
        raise ConfigError(f"--identity {config.identity_file} is a directory, not a key file")


def export_command(argv: Sequence[str]) -> int:
    """`export`: a checkpoint (the syncer's, or any safetensors state dict), or the newest checkpoint of a running
    syncer (`--from` its status URL) -> a transformers folder."""
    parser = argparse.ArgumentParser(prog="python -m node export", description=export_command.__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, metavar="PATH", help="a .safetensors file")
    source.add_argument(
        "--from",
        dest="url",
        metavar="URL",
        help="a running syncer's status URL (http://host:port): its newest checkpoint, signed manifest "
        "and tokenizer, each checked",
    )
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--run", type=Path, metavar="run.toml", help="the run's settings (default: built-in)")
    parser.add_argument(
        "--tokenizer", type=Path, metavar="tokenizer.json", help="the run's BPE (default: bytes)"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="for --from: per HTTP request")
    args = parser.parse_args(list(argv))
    if args.url and (args.run or args.tokenizer):
        parser.error("--from reads the run and tokenizer from the syncer: drop --run / --tokenizer")
    from node.ml.export import ExportError

    try:
        done = _export_from_url(args) if args.url else _export_from_file(args)
    except (OSError, ValueError, ExportError) as e:
        return _fail(e)
    print(
        f"{done}exported to {args.out}: load it with AutoModelForCausalLM.from_pretrained({str(args.out)!r})"
    )
    return EXIT_OK


def _export_from_file(args: argparse.Namespace) -> str:
    from node.ml.export import checkpoint_params, export_hf
    from node.ml.model import ModelConfig
    from node.ml.tokenizer import tokenizer_spec
    from protocol.manifest import default_manifest, load_run_toml

    manifest = load_run_toml(args.run) if args.run else default_manifest()
    blob = args.tokenizer.read_bytes() if args.tokenizer else None
    model = dict(manifest.model)
    if blob is not None:
        model["vocab_size"] = tokenizer_spec(blob)["vocab_size"]
    export_hf(ModelConfig.from_dict(model), checkpoint_params(args.checkpoint), args.out, blob)
    return ""


def _export_from_url(args: argparse.Namespace) -> str:
    import tempfile

    from node.ml.export import checkpoint_params, export_hf
    from node.ml.model import ModelConfig
    from node.status.export import fetch_export

    with tempfile.TemporaryDirectory(prefix="hivenode-export-") as work:
        fetched = fetch_export(args.url, Path(work), timeout_s=args.timeout_s)
        model = ModelConfig.from_dict(dict(fetched.manifest.model))
        export_hf(model, checkpoint_params(fetched.checkpoint), args.out, fetched.tokenizer)
        name = fetched.checkpoint.name
    return f"run {fetched.run_id[:16]} (owner ...{fetched.owner[-8:]}), checkpoint {name}: "


def generate_command(argv: Sequence[str]) -> int:
    """`generate DIR --prompt TEXT`: sample from an exported folder."""
    parser = argparse.ArgumentParser(prog="python -m node generate", description=generate_command.__doc__)
    parser.add_argument("directory", type=Path, metavar="DIR")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv))
    from node.ml.export import generate

    try:
        text = generate(
            args.directory,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
        )
    except (OSError, ValueError) as e:
        return _fail(e)
    print(text)
    return EXIT_OK


SUBCOMMANDS = {
    "export": export_command,
    "generate": generate_command,
    "keygen": keygen,
    "status": status,
    "demo": demo,
    "config": config_command,
    "trust": trust,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return SUBCOMMANDS[argv[0]](argv[1:])
        config = load_node_config(argv, components=components())
        check_arguments(config)
    except ConfigError as e:
        return _fail(e, EXIT_USAGE)
    except HivenodeError as e:
        return _fail(e)
    log_context = LogContext()
    setup_logging(config.log_level, log_context)
    try:
        return run_loop(_run(config, log_context))
    except ConfigError as e:
        return _fail(e, EXIT_USAGE)
    except HivenodeError as e:
        return _fail(e)
    except TimeoutError:  # every DHT and HTTP wait is bounded; one that runs out while starting ends here
        return _fail("timed out waiting for the swarm (see the log above)")


def cli() -> NoReturn:
    """The console entry point (`hivenode`, `python -m node`)."""
    exit_process(main())


if __name__ == "__main__":
    cli()
