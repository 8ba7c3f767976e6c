"""What opening a received push costs in memory: the syncer's push route opens the frame with its tensors as views
over it (`open_envelope(views=True)`), where it used to copy them (the frame and its copy: 2 fragments while `accept`
screens the push). Each mode runs in a fresh process: the frame alone in memory, then the peak RSS while it is opened
and the RSS with its tensors held, over the RSS with the frame alone.

    python -m benchmarks.push_open            # a llama-1b fragment at P = 16 (0.246 GiB in 24 tensors)
    python -m benchmarks.push_open --mib 984  # P = 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

GIB = 1 << 30


def measure(mode: str, mib: int, tensors: int) -> dict[str, float]:
    import torch

    from benchmarks.scale import PhasePeaks, current_rss_bytes
    from protocol.codec import TensorLimits
    from protocol.envelope import NO_STAGE, Context, Direction, Kind, open_envelope, seal
    from protocol.identity import NodeIdentity
    from protocol.replay import ReplayGuard

    sender, receiver = NodeIdentity.generate(), NodeIdentity.generate()
    ctx = Context(run_id="push-open", kind=Kind.FRAGMENT, receiver=receiver.peer_id, stage=NO_STAGE,
                  direction=Direction.NONE)  # fmt: skip
    numel = mib * (1 << 20) // 4 // tensors
    frame = bytearray(seal(sender, ctx, microbatch=0, step=0, now=time.time(), meta={"fragment": 0},
                           tensors={f"t{i}": torch.full((numel,), 0.5) for i in range(tensors)}))  # fmt: skip
    limits = TensorLimits(max_bytes=len(frame), max_tensors=tensors)
    peaks = PhasePeaks()
    peaks.end("frame")  # the frame alone (the sealing's temporaries freed)
    held = current_rss_bytes()
    opened = open_envelope(frame, remote_peer=sender.peer_id, expect=ctx, limits=limits, replay=ReplayGuard(),
                           now=time.time(), views=mode == "views")  # fmt: skip
    peaks.end("open")
    return {
        "mode": mode,
        "push_gib": round(tensors * numel * 4 / GIB, 3),
        "rss_frame_gib": round(held / GIB, 3),
        "open_peak_over_frame_gib": round((peaks.peaks["open"] - held) / GIB, 3),
        "held_over_frame_gib": round((current_rss_bytes() - held) / GIB, 3),
        "tensors": len(opened.tensors),
        "resettable": peaks.resettable,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=252, help="the push's payload (MiB)")
    parser.add_argument("--tensors", type=int, default=24)
    parser.add_argument("--mode", choices=["views", "copy"], help="(one mode, in this process)")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.mib, args.tensors)))
        return 0
    for mode in ("copy", "views"):
        cmd = [sys.executable, "-m", "benchmarks.push_open", "--mode", mode, "--mib", str(args.mib)]
        subprocess.run([*cmd, "--tensors", str(args.tensors)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
